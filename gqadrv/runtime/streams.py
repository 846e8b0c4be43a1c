"""Stream resolution: every accepted stream spelling becomes a raw ``CUstream`` handle (int).

Accepted: objects with ``__cuda_stream__()`` (CuPy >= 14, cuda.core, torch), objects with a
``.cuda_stream`` int (torch) or ``.ptr`` int (CuPy), ``cuda.bindings`` ``CUstream`` objects and
plain ints (0 = legacy default stream). ``None`` selects the default: the current torch stream of
the device when the call's tensors come from torch (torch is reached through ``sys.modules``, never
imported), otherwise CuPy's current stream.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from ..types import StreamLike
from . import driver as _driver

__all__ = ["resolve_stream", "current_stream", "default_stream", "is_capturing", "on_stream", "order_fast",
           "order_inputs", "device_hint"]


class relaxed_capture_mode:
    """Let this thread allocate device memory while one of its streams is being captured into a CUDA
    graph: the thread's capture-interaction mode is switched to relaxed for the block
    (``cuThreadExchangeStreamCaptureMode``) and restored after. Under torch's default
    ``capture_error_mode="global"`` a cudaMalloc would otherwise end the capture with an error.
    The memory is not part of any graph: gqadrv keeps what it allocates this way alive (workspaces
    are never freed, outputs belong to the caller). A slotted class rather than a generator-based
    context manager: it runs around every output allocation of the convenience calls (4.8 µs as a
    generator against 1.9 µs for its two driver calls on an H100 host, 2026-12-05)."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        drv = _driver.driver()
        self._prev = _driver.check(
            drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuThreadExchangeStreamCaptureMode")

    def __exit__(self, *exc) -> None:
        _driver.check(_driver.driver().cuThreadExchangeStreamCaptureMode(self._prev), "cuThreadExchangeStreamCaptureMode")


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


def resolve_stream(stream: StreamLike | None, device: int = 0, framework: str | None = None) -> int:
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


class ExternalStream:
    """Minimal ``__cuda_stream__`` carrier, so CuPy can treat a raw handle as its current stream."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_ext_streams: dict[tuple[int, int], Any] = {}


def on_stream(stream: int, device: int) -> Any:
    """A CuPy stream object for a raw handle (cached), usable as a ``with`` context so CuPy
    allocations and kernels are stream-ordered on ``stream``."""
    key = (device, stream)
    st = _ext_streams.get(key)
    if st is None:
        import cupy

        with cupy.cuda.Device(device):
            st = cupy.cuda.Stream.from_external(ExternalStream(stream))
        if len(_ext_streams) > 256:
            _ext_streams.clear()
        _ext_streams[key] = st
    return st


_order_events: dict[tuple[int, int], Any] = {}


def order_cupy(device: int, s: int) -> None:
    """Order CuPy's current stream (where CuPy producers wrote) before ``s`` with one event wait;
    nothing when they are the same stream."""
    import cupy

    from .driver import check, driver

    with cupy.cuda.Device(device):
        cur = cupy.cuda.get_current_stream()
        if int(cur.ptr) == s:
            return
        ev = _order_events.get((device, s))
        if ev is None:
            ev = _order_events[(device, s)] = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(cur)  # re-recording is fine: a wait captures the event's state when issued
        check(driver().cuStreamWaitEvent(s, int(ev.ptr), 0), "cuStreamWaitEvent")


def order_inputs(tensors: Iterable[Any], device: int, s: int) -> int | None:
    """Order every input's producer before a launch on ``s``; returns the stream to hand to
    ``tensors.as_view`` for the DLPack handshake of non-CuPy producers (torch, JAX, ...).

    Each tensor is ordered through its own framework, whatever the others are: CuPy arrays by one
    event wait on CuPy's current stream (done here, once for all of them), other producers by the
    DLPack ``stream`` argument of their ``__dlpack__`` (done by ``as_view``). During graph capture
    no handshake is made (returns None): inputs must already be ordered on the capturing stream."""
    if is_capturing(s):
        return None
    cp = sys.modules.get("cupy")
    if cp is not None:
        nd = cp.ndarray
        for t in tensors:
            if type(t) is nd:
                order_cupy(device, s)
                break
    return s


def device_hint(obj: Any) -> int:
    """The CUDA device ordinal of a DLPack tensor (0 when it cannot tell; validation reports the
    real problem)."""
    try:
        t, d = obj.__dlpack_device__()
        return int(d) if int(t) in (2, 13) else 0
    except Exception:  # noqa: BLE001
        return 0


# ----------------------------------------------------------------------------- fast paths
# Used by repeated convenience calls whose tensors all come from one framework
# (runtime.tensors.fast_kind): the same streams and the same ordering as ``default_stream`` /
# ``order_inputs``, without a DLPack capsule per tensor when nothing has to be ordered.


def current_stream(kind: str, device: int) -> int:
    """The default launch stream for tensors of ``kind`` on ``device``: torch's current stream of
    the device for torch tensors, CuPy's current stream of the device otherwise (as
    ``default_stream``)."""
    if kind == "torch":
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(device))
        return int(torch.cuda.current_stream(device).cuda_stream)
    cp = sys.modules.get("cupy")
    if cp is None:
        import cupy as cp
    return int(cp.cuda.get_current_stream(device).ptr)


def order_fast(kind: str, tensors: Iterable[Any], device: int, s: int, current: int) -> None:
    """Order the producers of ``tensors`` (all of ``kind``) before a launch on ``s``; ``current``
    is ``current_stream(kind, device)`` of this call.

    * CuPy: one event wait when ``s`` is not CuPy's current stream (the producers' stream).
    * torch: torch's own DLPack handshake (its current stream before ``s``), made once for all
      tensors, when ``s`` is not torch's current stream of the current device.
    * JAX: every array that is not ready yet gets JAX's DLPack handshake (XLA makes ``s`` wait for
      the buffer's definition event).
    * XLA FFI buffers (kind 'xla', a ``buffer_callback``'s arguments): nothing. XLA defines them on
      the callback's stream before calling it, and their ``__dlpack__`` ignores ``stream``, so the
      general path's handshake is a no-op for them as well.
    During graph capture no handshake is made (as in ``order_inputs``)."""
    if kind == "cupy":
        if s != current and not is_capturing(s):
            order_cupy(device, s)
    elif kind == "torch":
        torch = sys.modules["torch"]
        if (s != current or torch.cuda.current_device() != device) and not is_capturing(s):
            for t in tensors:
                if t is not None:
                    t.__dlpack__(stream=1 if s == 0 else s)
                    break
    elif kind == "jax":
        pending = []
        for x in tensors:
            if x is None:
                continue
            ready = getattr(x, "is_ready", None)
            if ready is None or not ready():
                pending.append(x)
        if pending and not is_capturing(s):
            for x in pending:
                x.__dlpack__(stream=1 if s == 0 else s)
    elif kind != "xla":
        raise ValueError(f"unknown tensor kind {kind!r}")


def launch_streams(first: Any, tensors: Iterable[Any], stream: StreamLike | None) -> tuple[int, int | None]:
    """(launch stream, DLPack handshake stream) of a call whose first tensor is ``first``: the
    driver initialised, ``stream`` resolved for first's device and framework (``resolve_stream``),
    every input's producer ordered before it (``order_inputs``; None entries are skipped)."""
    from .driver import ensure_init
    from .tensors import framework_of

    ensure_init()
    dev = device_hint(first)
    s = resolve_stream(stream, dev, framework_of(first))
    return s, order_inputs(tensors, dev, s)
