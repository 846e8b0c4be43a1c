"""gqadrv: torch-free, driver-level GPU attention for Python.

NVRTC compiles gqadrv's own kernels at run time; a loader on the CUDA driver API (cuda.bindings)
launches them on any DLPack tensor (CuPy, torch, JAX), on any stream, inside CUDA-graph capture.
Each op family (``gqadrv.gqa``, ...) exports its public names here (the LSE state merge
``merge_state`` / ``merge_states`` from ``gqadrv.gqa.merge``, the FP8 KV quantizer ``quantize_kv_fp8``
from ``gqadrv.gqa.kv_fp8``); ``launch_prepared`` and
``check_status`` serve every family's prepared objects. The API is typed (``py.typed``); the
protocols and aliases of its signatures are in ``gqadrv.types``.
"""

from . import gqa as gqa  # the family packages and the type aliases, as attributes
from . import mla as mla
from . import types as types
from ._version import __version__

# Each family's __all__, imported by name so that type checkers see every public name (tests/test_typing.py
# checks that __all__ below covers gqa.__all__ and mla.__all__).
from .gqa import (
    PreparedGqaDecode,
    PreparedGqaPagedDecode,
    gqa_decode,
    gqa_decode_paged,
    gqa_decode_reference,
    launch_sm110_gqa_decode_prepared,
    prepare_gqa_decode,
    prepare_gqa_decode_paged,
    prepare_sm110_gqa_decode,
    sm110_gqa_decode,
)
from .gqa.kv_fp8 import quantize_kv_fp8
from .gqa.merge import merge_state, merge_states
from .mla import (
    MlaSchedMeta,
    PreparedMlaDecode,
    PreparedMlaSparseFwd,
    dequantize_k_cache,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
    mla_decode_reference,
    prepare_mla_decode,
    prepare_mla_sparse_fwd,
    quantize_k_cache,
)
from .ops.prepared import Prepared, check_status, launch_prepared
from .ops.registry import FeatureError
from .runtime import CompileError, CudaDriverError, NoGpuError, TensorMapError

__all__ = [
    "CompileError", "CudaDriverError", "FeatureError", "MlaSchedMeta", "NoGpuError", "Prepared", "PreparedGqaDecode",
    "PreparedGqaPagedDecode", "PreparedMlaDecode", "PreparedMlaSparseFwd", "TensorMapError", "__version__", "check_status", "dequantize_k_cache",
    "flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata", "gqa_decode", "gqa_decode_paged", "gqa_decode_reference", "launch_prepared",
    "launch_sm110_gqa_decode_prepared", "merge_state", "merge_states", "mla_decode_reference", "prepare_gqa_decode",
    "prepare_gqa_decode_paged", "prepare_mla_decode", "prepare_mla_sparse_fwd", "prepare_sm110_gqa_decode", "quantize_k_cache", "quantize_kv_fp8",
    "sm110_gqa_decode",
]
