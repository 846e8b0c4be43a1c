"""New output arrays in the caller's framework, for the elementwise op families (FP8 quantizers).

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
from ..runtime.streams import current_stream, on_stream

__all__ = ["NewOutput", "allocate", "hand_back"]


@dataclasses.dataclass
class NewOutput:
    ptr: int
    obj: Any          # the torch tensor, or None until ``hand_back`` exports the CuPy array
    cupy: Any         # the CuPy array to export (None for torch allocations)


def allocate(like: Any, shape: tuple[int, ...], dtype: str, device: int, stream: int) -> NewOutput:
    torch = sys.modules.get("torch")
    if _tensors.framework_of(like) == "torch" and torch is not None and stream == current_stream("torch", device):
        t = like.new_empty(shape, dtype=getattr(torch, dtype))
        return NewOutput(int(t.data_ptr()), t, None)
    with on_stream(stream, device):
        arr = _tensors.empty(shape, dtype, device)
    return NewOutput(int(arr.data.ptr), None, arr)


def hand_back(out: NewOutput, like: Any, stream: int, device: int) -> Any:
    """The new output as the caller gets it (after the launch that fills it was enqueued)."""
    if out.cupy is None:
        return out.obj
    with on_stream(stream, device):
        return _tensors.export_like(out.cupy, like)
