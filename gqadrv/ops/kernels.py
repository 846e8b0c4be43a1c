"""Kernel loading per (variant, device): NVRTC compile (disk-cached), cuLibraryLoadData, the
dynamic shared-memory opt-in and the occupancy the split heuristics need. One entry per
(variant, device) for the life of the process."""

from __future__ import annotations

import dataclasses

from ..runtime import driver as _drv
from ..runtime.compiler import arch_for_cc, compile_module
from ..runtime.module import Kernel, load_library
from .bounded import BoundedMap

__all__ = ["Loaded", "load"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    kernel: Kernel
    arch: str
    ctas_per_sm: int


_loaded = BoundedMap(4096)


def load(variant, device: int) -> Loaded:
    """Compile (or take from the cache), load and prepare ``variant`` on ``device``."""
    key = (variant, device)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    return _loaded.get_or_create(key, lambda: _load(variant, device))


def _load(variant, device: int) -> Loaded:
    info = _drv.device_info(device)
    arch = arch_for_cc(info.cc)
    mod = compile_module(variant.family.source, arch, variant.defines)
    lib = load_library(mod.cubin, variant.name)
    k = lib.kernel(variant.family.entry, device)
    k.ensure_dynamic_smem(variant.dynamic_smem)
    drv = _drv.driver()
    with _drv.device_scope(device):
        occ = _drv.check(
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.function, variant.block[0], variant.dynamic_smem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
    return Loaded(k, arch, max(1, int(occ)))
