"""The MLA route registry: kernel families (from ``kernel_spec``), variants, routing by compute
capability, split counts. ``python -m gqadrv compile`` and the static tests read it.

* ``wgmma`` (sm_90a): the Hopper kernel, executed and tested on the H200.
* ``mma`` (mma.sync + ldmatrix, same smem layout): chosen on sm_100 / sm_110 (B200, Thor), where
  wgmma does not exist; compile-verified only there (no such GPU here). It also runs on sm_90 when
  forced (``backend="mma"``), which is how the H200 tests cover its code.
"""

from __future__ import annotations

import dataclasses

from ..ops.contract import check_choice
from ..ops.registry import KernelFamily
from . import kernel_spec as _ks
from .args import SIG

__all__ = ["BACKENDS", "FAMILIES", "MlaFamily", "MlaVariant", "backend_for_cc", "default_splits", "select_variant",
           "variants_for_arch"]

FEATURES = frozenset({"dense_kv", "paged_kv", "fp16", "bf16", "causal", "lse", "split_kv", "multi_token"})


@dataclasses.dataclass(frozen=True)
class MlaFamily(KernelFamily):
    mma: str = "wgmma"


FAMILIES = {
    name: MlaFamily(name, _ks.SOURCE, _ks.ENTRY, _ks.VARIANT_ARCHES[name], SIG, FEATURES, mma=name)
    for name in _ks.VARIANTS
}
BACKENDS = ("auto", *FAMILIES)


@dataclasses.dataclass(frozen=True)
class MlaVariant:
    family: MlaFamily
    dtype: str

    @property
    def name(self) -> str:
        return f"mla_decode_{self.family.name}_{self.dtype}"

    @property
    def defines(self) -> dict:
        return _ks.defines(self.dtype, self.family.name)

    @property
    def block(self) -> tuple[int, int, int]:
        return (_ks.BLOCK_THREADS, 1, 1)

    @property
    def dynamic_smem(self) -> int:
        return _ks.dynamic_smem_bytes(self.defines)


def backend_for_cc(cc: tuple[int, int]) -> str:
    """'wgmma' on sm_90; 'mma' on sm_100 / sm_110 (the kernels need ~226 KB of shared memory per
    CTA, which rules out sm_8x and sm_12x)."""
    if cc == (9, 0):
        return "wgmma"
    if cc in ((10, 0), (11, 0)):
        return "mma"
    raise RuntimeError(f"MLA decode needs compute capability 9.0, 10.0 or 11.0 (about 226 KB of shared memory "
                       f"per block); this GPU has {cc[0]}.{cc[1]}")


def select_variant(cc: tuple[int, int], dtype: str, backend: str | None = None) -> MlaVariant:
    native = backend_for_cc(cc)
    forced = check_choice("backend", backend, BACKENDS)
    name = native if forced in (None, "auto") else forced
    arch = {(9, 0): "sm_90a", (10, 0): "sm_100a", (11, 0): "sm_110a"}[cc]
    if arch not in FAMILIES[name].arches:
        raise RuntimeError(f"MLA backend {name!r} is not built for {arch} (built for {', '.join(FAMILIES[name].arches)})")
    return MlaVariant(FAMILIES[name], dtype)


def variants_for_arch(arch: str) -> list[MlaVariant]:
    return [MlaVariant(f, dt) for f in FAMILIES.values() if arch in f.arches for dt in ("float16", "bfloat16")]


def default_splits(b: int, s_q: int, h_q: int, h_kv: int, capacity: int, sm_count: int) -> int:
    """Splits per (request, KV head, row block) from host-known sizes only, never the lengths, so
    a prepared launch stays valid for any lengths (see kernel_spec.choose_num_splits)."""
    return _ks.choose_num_splits(b, s_q, h_q, h_kv, capacity, sm_count)
