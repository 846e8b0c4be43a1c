"""Registry base shared by the op families.

* ``KernelFamily``: one kernel source + entry symbol, the NVRTC targets it is built for, its
  parameter ``Signature`` and the features it supports (FlashMLA's "declared features": a
  dispatcher that cannot serve a request names what is missing instead of picking a wrong kernel).
* A *variant* (defined by each family: GQA's ``routes.Variant``, MLA's ``routes.MlaVariant``) is one
  compiled module; it exposes ``name`` (spells every compile parameter, used as the module label),
  ``family``, ``defines``, ``block`` and ``dynamic_smem``. ``ops.kernels.load`` needs only those.
* ``OpRecord``: what an op family tells the CLI (``info``, ``compile``, ``selftest``, ``bench``) —
  the CLI iterates the records and hard-codes no family.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable

from ..runtime.module import Signature

__all__ = ["ElementwiseGeometry", "FeatureError", "KernelFamily", "OpRecord", "require_features"]


class FeatureError(NotImplementedError):
    """No kernel supports the requested combination of features (the message names them)."""


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    name: str
    source: str                  # path below the kernels root, e.g. "gqa/sm90/decode_tma.cu"
    entry: str                   # extern "C" symbol
    arches: tuple[str, ...]      # NVRTC targets this family is built and checked for
    signature: Signature
    features: frozenset = frozenset()


class ElementwiseGeometry:
    """Mixin of the variants of elementwise families (merge, FP8 quantizers): a block of
    ``THREADS`` threads (the subclass sets it, equal to the kernel's compile-time constant) and no
    dynamic shared memory."""

    THREADS: ClassVar[int]

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.THREADS, 1, 1)

    @property
    def dynamic_smem(self) -> int:
        return 0


def require_features(family: KernelFamily, required: Iterable[str], where: str = "") -> None:
    """Raise FeatureError naming the features ``family`` lacks (none: return)."""
    missing = sorted(set(required) - set(family.features))
    if missing:
        raise FeatureError(
            f"{where or family.name}: kernel family {family.name!r} does not support {', '.join(missing)} "
            f"(it supports: {', '.join(sorted(family.features)) or 'nothing optional'})"
        )


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op family as the CLI sees it.

    ``variants_for_arch(arch)`` lists every module ``compile --arch`` builds; ``describe(cc)`` is a
    line for ``info`` (kernel families a device would use); ``selftest(rng, gpu)`` returns
    (name, max_err, ok) tuples; ``bench_spec()`` returns the op's ``ops.bench.BenchSpec`` (imported
    lazily; None: no bench).
    """

    name: str
    variants_for_arch: Callable[[str], list]
    describe: Callable[[tuple[int, int]], str]
    selftest: Callable[..., list]
    bench_spec: Any = None
