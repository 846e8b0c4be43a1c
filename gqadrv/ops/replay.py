"""Convenience-call replays: a repeated call with the same key skips ingestion, validation,
routing and packing and re-launches the plans it built the first time.

The op builds the key (everything its validation and routing looked at: pointers, shapes, strides
and dtypes of the tensors, scalars, backend, tuning environment, device, stream) and the plans;
this module only stores and launches them. Equal pointers with equal shapes, strides and dtypes
describe the same memory, so every validated fact (alignment, contiguity, aliasing) still holds;
device data (lengths, values) is read by the kernels at every launch.

When the caller gives no output, a replay allocates a new one (CuPy, stream-ordered on the launch
stream) and patches the one struct field that holds the output address (``out_field``).
"""

from __future__ import annotations

import threading

from ..runtime import driver as _drv
from ..runtime.streams import on_stream
from .bounded import BoundedMap

__all__ = ["Replay", "ReplayCache"]


class Replay:
    __slots__ = ("plans", "out_plan", "out_field", "shape", "dtype", "device", "stream", "lock")

    def __init__(self, plans: tuple, out_plan: int, out_field: str, shape: tuple, dtype, device: int, stream: int):
        self.plans, self.out_plan, self.out_field = plans, out_plan, out_field
        self.shape, self.dtype, self.device, self.stream = shape, dtype, device, stream
        self.lock = threading.Lock()

    def _launch_all(self) -> None:
        if _drv.multi_device():
            with _drv.device_scope(self.device):
                for p in self.plans:
                    p.launch()
        else:
            for p in self.plans:
                p.launch()

    def launch(self, out):
        """Launch with the caller's ``out`` (same pointer as when recorded) or a new output."""
        if out is not None:
            with self.lock:
                self._launch_all()
            return out
        import cupy

        s = self.stream
        if s == cupy.cuda.get_current_stream().ptr:
            o = cupy.empty(self.shape, self.dtype)
        else:
            with on_stream(s, self.device):
                o = cupy.empty(self.shape, self.dtype)
        with self.lock:
            self.plans[self.out_plan].args.set_field(self.out_field, o.data.ptr)
            self._launch_all()
        return o


class ReplayCache:
    """key -> Replay, bounded."""

    def __init__(self, maxsize: int = 1024):
        self._map = BoundedMap(maxsize)

    def get(self, key):
        return self._map.get(key)

    def remember(self, key, plans: tuple, out_plan: int, out_field: str, shape: tuple, dtype, device: int,
                 stream: int) -> Replay:
        return self._map.put(key, Replay(tuple(plans), out_plan, out_field, tuple(shape), dtype, device, stream))

    def __len__(self) -> int:
        return len(self._map)

    def clear(self) -> None:
        self._map.clear()
