"""Device workspaces of split launches: named buffers (fp32 partials, uint32 counters, ...).

``alloc`` gives a prepared launch its own workspace; ``pooled`` shares one per (device, stream)
among convenience calls (launches on one stream are ordered, and the kernels leave their counters
at zero). A pooled workspace that must grow is retired and kept for the life of the process, never
freed: launches already enqueued may still use it, and so may a CUDA graph captured with it (torch,
CuPy or cuda-python capture of a convenience call), which can be replayed at any later time. A buffer
that grows at least doubles, so the retired copies of one buffer together hold less memory than its
current one.
"""

from __future__ import annotations

import dataclasses
import threading

from ..runtime import driver as _drv
from ..runtime.streams import relaxed_capture_mode

__all__ = ["Workspace", "alloc", "pooled"]

_DTYPES = {"f32": "float32", "u32": "uint32", "i32": "int32"}


@dataclasses.dataclass
class Workspace:
    arrays: dict          # name -> CuPy array (kept alive)
    ptrs: dict            # name -> device address
    sizes: dict           # name -> element count
    nbytes: int
    types: dict = dataclasses.field(default_factory=dict)  # name -> "f32" | "u32" | "i32"

    def ptr(self, name: str) -> int:
        return self.ptrs[name]

    def fits(self, sizes: dict) -> bool:
        return all(k in self.sizes and self.sizes[k] >= n for k, (n, _) in sizes.items())


def alloc(device: int, stream: int, sizes: dict, zero: tuple = ()) -> Workspace:
    """``sizes`` = {name: (elements, "f32" | "u32" | "i32")}; buffers named in ``zero`` are
    zeroed on ``stream`` (counters must be zero before the first launch)."""
    import cupy

    arrays, ptrs, counts, nbytes = {}, {}, {}, 0
    # allowed during graph capture (a convenience call's first use of a capture stream); the
    # counters' memset below is then part of the graph, which is harmless (they are zero anyway)
    with cupy.cuda.Device(device), relaxed_capture_mode():
        for name, (n, dt) in sizes.items():
            a = cupy.empty(max(int(n), 1), dtype=_DTYPES[dt])
            arrays[name], ptrs[name], counts[name] = a, int(a.data.ptr), int(a.size)
            nbytes += a.nbytes
    drv = _drv.driver()
    with _drv.device_scope(device):
        for name in zero:
            _drv.check(drv.cuMemsetD32Async(ptrs[name], 0, counts[name], stream), f"cuMemsetD32Async({name})")
    return Workspace(arrays, ptrs, counts, nbytes, {name: dt for name, (_, dt) in sizes.items()})


_pool: dict = {}
_retired: list = []   # grown-out workspaces, kept alive (captured graphs may still address them)
_lock = threading.Lock()


def pooled(device: int, stream: int, sizes: dict, zero: tuple = ()) -> Workspace:
    """The (device, stream) workspace, its too-small buffers regrown (at least doubling) when ``sizes``
    does not fit."""
    key = (device, stream)
    ws = _pool.get(key)
    if ws is not None and ws.fits(sizes):
        return ws
    with _lock:
        ws = _pool.get(key)
        if ws is not None and ws.fits(sizes):
            return ws
        # the union of the old buffers and the requested ones (ops with different buffer names share
        # the pool without evicting each other); only a buffer that is too small is reallocated (at
        # least doubling), the others are carried over as they are (same memory, counters still zero)
        grow = {}
        for k, (n, dt) in sizes.items():
            have = ws.sizes.get(k) if ws else None
            if have is None or have < n:  # a new name (even of 0 elements: alloc gives it 1) or too small
                grow[k] = (max(n, 2 * (have or 0)), dt)
        new = alloc(device, stream, grow, tuple(k for k in zero if k in grow))
        if ws is not None:
            for k in ws.sizes:
                if k not in grow:
                    new.arrays[k], new.ptrs[k], new.sizes[k], new.types[k] = (ws.arrays[k], ws.ptrs[k], ws.sizes[k],
                                                                              ws.types[k])
                    new.nbytes += ws.arrays[k].nbytes
            _retired.append(ws)
        _pool[key] = new
        return new
