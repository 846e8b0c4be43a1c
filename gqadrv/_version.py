"""The package version and the versions of what it runs on (``info``, bench JSON, RESULTS).

A leaf module: it imports nothing of gqadrv at import time, so ``cli`` and the benchmark harness
can both use it without an import circle."""

from __future__ import annotations

import platform

__version__ = "0.1.0"

__all__ = ["__version__", "versions"]


def versions() -> dict:
    out = {"python": platform.python_version(), "gqadrv": __version__}
    for mod in ("cuda.bindings", "cuda.core", "cupy", "numpy"):
        try:
            m = __import__(mod, fromlist=["_"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            out[mod] = f"not importable ({type(exc).__name__})"
    try:
        from .runtime.compiler import nvrtc_version

        out["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception as exc:  # noqa: BLE001
        out["nvrtc"] = f"not available ({exc})"
    from .runtime.driver import driver_version

    dv = driver_version()
    out["driver (CUDA)"] = f"{dv // 1000}.{dv % 1000 // 10}" if dv else "no driver"
    return out
