"""gqadrv.runtime: NVRTC compiler + cubin cache, driver loader, tensor maps, DLPack tensors, streams.

Knows nothing about attention; ``gqadrv.gqa`` builds on it.
"""

from .cache import CubinCache, cache_dir, cache_enabled, default_cache
from .compiler import ARCHES, CompileError, CompiledModule, ResourceUsage, arch_for_cc, compile_module, nvrtc_version
from .driver import CudaDriverError, NoGpuError, device_count, device_info, gpu_status
from .module import ArgPack, Kernel, LaunchPlan, Library, Signature, load_library
from .streams import resolve_stream
from .tensormap import TensorMapError, TmaSpec, encode_tiled, validate_tiled
from .tensors import TensorView, as_view

__all__ = [
    "ARCHES", "ArgPack", "CompileError", "CompiledModule", "CubinCache", "CudaDriverError", "Kernel", "LaunchPlan",
    "Library", "NoGpuError", "ResourceUsage", "Signature", "TensorMapError", "TensorView", "TmaSpec", "arch_for_cc",
    "as_view", "cache_dir", "cache_enabled", "compile_module", "default_cache", "device_count", "device_info",
    "encode_tiled", "gpu_status", "load_library", "nvrtc_version", "resolve_stream", "validate_tiled",
]
