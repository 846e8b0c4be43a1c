"""gqadrv: torch-free, driver-level GPU attention for Python.

NVRTC compiles gqadrv's own kernels at run time; a loader on the CUDA driver API (cuda.bindings)
launches them on any DLPack tensor (CuPy, torch, JAX), on any stream, inside CUDA-graph capture.
Each op family (``gqadrv.gqa``, ...) exports its public names here; ``launch_prepared`` and
``check_status`` serve every family's prepared objects.
"""

from ._version import __version__
from . import gqa, mla
from .gqa import *  # noqa: F401,F403 - the family's __all__
from .mla import *  # noqa: F401,F403
from .ops.prepared import Prepared, check_status, launch_prepared
from .ops.registry import FeatureError

__all__ = ["FeatureError", "Prepared", "__version__", "check_status", "launch_prepared", *gqa.__all__, *mla.__all__]
