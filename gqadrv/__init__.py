"""gqadrv: torch-free, driver-level GPU attention decode for Python.

NVRTC compiles gqadrv's own kernels at run time; a loader on the CUDA driver API (cuda.bindings)
launches them on any DLPack tensor (CuPy, torch, JAX), on any stream, inside CUDA-graph capture.
"""

__version__ = "0.1.0"

from .gqa import (  # noqa: E402
    PreparedGqaDecode,
    check_status,
    gqa_decode,
    gqa_decode_reference,
    launch_prepared,
    launch_sm110_gqa_decode_prepared,
    prepare_gqa_decode,
    prepare_sm110_gqa_decode,
    sm110_gqa_decode,
)

__all__ = [
    "PreparedGqaDecode", "__version__", "check_status", "gqa_decode", "gqa_decode_reference", "launch_prepared",
    "launch_sm110_gqa_decode_prepared", "prepare_gqa_decode", "prepare_sm110_gqa_decode", "sm110_gqa_decode",
]
