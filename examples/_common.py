"""Shared helper of the examples: exit with a clear message where there is no GPU."""

import sys


def require_gpu(name: str) -> None:
    from gqadrv.runtime.driver import gpu_status

    ok, why = gpu_status()
    if not ok:
        print(f"{name}: needs an NVIDIA GPU (compute capability 8.0+); none usable here: {why}", file=sys.stderr)
        sys.exit(2)
