"""Kernel loading per (variant, device): NVRTC compile (disk-cached), cuLibraryLoadData, the
dynamic shared-memory opt-in and the occupancy the split heuristics need. One entry per
(variant, device) for the life of the process."""

from __future__ import annotations

import dataclasses

from ..runtime import driver as _drv
from ..runtime.compiler import arch_for_cc, compile_module
from ..runtime.module import PORTABLE_CLUSTER_MAX, Kernel, load_library
from .bounded import BoundedMap

__all__ = ["Loaded", "load", "max_active_clusters"]


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


_clusters = BoundedMap(1024)


def max_active_clusters(loaded: Loaded, size: int, smem: int, block: tuple[int, int, int], device: int) -> int:
    """How many clusters of ``size`` CTAs (along x) of ``loaded``'s kernel with ``smem`` bytes of
    dynamic shared memory the device runs at once (cuOccupancyMaxActiveClusters; clusters live in
    one GPC, so this is less than SMs / size when GPCs have SMs left over). 0 when the driver says
    the configuration cannot run. Sizes above 8 set the kernel's non-portable-cluster attribute
    first (launches of that kernel may then use them). Cached per (kernel, size, smem, block)."""
    key = (loaded.kernel.function_int, size, smem, block)
    hit = _clusters.get(key)
    if hit is not None:
        return hit
    drv = _drv.driver()
    loaded.kernel.ensure_dynamic_smem(smem)
    if size > PORTABLE_CLUSTER_MAX:
        try:
            loaded.kernel.allow_non_portable_clusters()
        except _drv.CudaDriverError:  # a device without non-portable clusters: none of this size run
            return _clusters.put(key, 0)
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = size, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    a = drv.CUlaunchAttribute()
    a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = size, 1, 1
    cfg.attrs = [a]
    cfg.numAttrs = 1
    with _drv.device_scope(device):
        err, n = drv.cuOccupancyMaxActiveClusters(loaded.kernel.function, cfg)
    n = int(n) if not int(err) else 0
    return _clusters.put(key, n)
