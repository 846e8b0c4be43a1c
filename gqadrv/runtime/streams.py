"""Stream resolution: every accepted stream spelling becomes a raw ``CUstream`` handle (int).

Accepted: objects with ``__cuda_stream__()`` (CuPy >= 14, cuda.core, torch), objects with a
``.cuda_stream`` int (torch) or ``.ptr`` int (CuPy), ``cuda.bindings`` ``CUstream`` objects and
plain ints (0 = legacy default stream). ``None`` selects the default: the current torch stream of
the device when the call's tensors come from torch (torch is reached through ``sys.modules``, never
imported), otherwise CuPy's current stream.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["resolve_stream", "default_stream", "is_capturing"]


def is_capturing(stream: int) -> bool:
    """True while ``stream`` is being captured into a CUDA graph."""
    from .driver import check, driver

    status = check(driver().cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return int(status) != 0


def default_stream(device: int, framework: str | None = None) -> int:
    if framework == "torch":
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.cuda.current_stream(device).cuda_stream)
    import cupy

    with cupy.cuda.Device(device):
        return int(cupy.cuda.get_current_stream().ptr)


def resolve_stream(stream: Any, device: int = 0, framework: str | None = None) -> int:
    """The raw stream handle for ``stream`` (see module docstring); raises TypeError/ValueError."""
    if stream is None:
        return default_stream(device, framework)
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream object or an int handle, not a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream handle must be >= 0, got {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        try:
            res = proto() if callable(proto) else proto
            version, handle = res
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"stream.__cuda_stream__ did not return (version, handle): {exc}") from exc
        if int(version) != 0:
            raise TypeError(f"unsupported __cuda_stream__ protocol version {version}")
        return int(handle)
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    if type(stream).__name__ == "CUstream":
        return int(stream)
    t = type(stream)
    raise TypeError(
        f"stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr; "
        f"got {t.__module__}.{t.__qualname__}"
    )
