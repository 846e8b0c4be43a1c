"""New output arrays in the caller's framework, for every op's convenience calls (full paths and the
layout-keyed plans of ``ops.layouts``).

``allocate(like, shape, dtype, device, stream)`` gives an output the caller did not pass: a torch
tensor from torch's allocator when ``like`` is a torch tensor and the launch runs on torch's current
stream (torch then owns the memory's stream semantics), else a CuPy array allocated on ``stream``
(allowed during graph capture: ``tensors.empty`` relaxes the capture mode), handed back in
``like``'s framework by ``hand_back`` after the launch (zero copy: CuPy, torch or JAX; other producers
get the CuPy array)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..runtime import tensors as _tensors
from ..runtime.streams import current_stream, on_stream, relaxed_capture_mode

__all__ = ["NewOutput", "allocate", "hand_back"]


@dataclasses.dataclass
class NewOutput:
    ptr: int
    obj: Any          # the torch tensor, or None until ``hand_back`` exports the CuPy array
    cupy: Any         # the CuPy array to export (None for torch allocations)


def allocate(like: Any, shape: tuple[int, ...], dtype: str, device: int, stream: int,
             current: int | None = None) -> NewOutput:
    """``current``: the current stream of like's framework on ``device`` when the caller already
    knows it (the layout-keyed plans: ``streams.current_stream``); a CuPy ``like`` on CuPy's current
    stream and device then allocates without switching streams or devices."""
    fw = _tensors.framework_of(like)
    torch = sys.modules.get("torch")
    if fw == "torch" and torch is not None and stream == (current_stream("torch", device) if current is None
                                                          else current):
        t = like.new_empty(shape, dtype=getattr(torch, dtype))
        return NewOutput(int(t.data_ptr()), t, None)
    cp = sys.modules.get("cupy")
    if fw == "cupy" and stream == current and cp is not None and cp.cuda.runtime.getDevice() == device:
        with relaxed_capture_mode():  # CuPy's pool may have to grow while the stream is being captured
            arr = cp.empty(shape, _tensors._np_dtype(dtype))
    else:
        with on_stream(stream, device):
            arr = _tensors.empty(shape, dtype, device)
    return NewOutput(int(arr.data.ptr), None, arr)


def hand_back(out: NewOutput, like: Any, stream: int, device: int) -> Any:
    """The new output as the caller gets it (after the launch that fills it was enqueued)."""
    if out.cupy is None:
        return out.obj
    if type(like) is type(out.cupy):  # a CuPy caller gets the array itself: no export, no stream switch
        return out.cupy
    with on_stream(stream, device):
        return _tensors.export_like(out.cupy, like)
