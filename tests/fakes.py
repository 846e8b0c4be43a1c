"""CPU stand-ins for CUDA arrays: a numpy array that claims (through __dlpack_device__) to live on
a CUDA device, so host-side validation can be exercised on machines without a GPU."""

import numpy as np


class FakeCudaArray:
    def __init__(self, array: np.ndarray, device: int = 0, module: str | None = None):
        self.a = array
        self.device = device
        self.shape = array.shape
        self.dtype = array.dtype

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is not None:
            return self.a.__dlpack__(max_version=max_version)
        return self.a.__dlpack__()


def fake(shape, dtype=np.float16, device=0, fill=0.0):
    return FakeCudaArray(np.full(shape, fill, dtype=dtype), device)


def read_fake(x: FakeCudaArray) -> tuple:
    """A fast reader (runtime.tensors.FAST_READERS) for fake arrays: (layout, address, device)."""
    a = x.a
    return (a.shape, a.strides, a.dtype), a.__array_interface__["data"][0], x.device


def register_fast_kind(monkeypatch, cls: type, name: str = "fakefw") -> None:
    """Let the layout-keyed convenience plans treat ``cls`` (a FakeCudaArray subclass) as a framework
    the fast readers know, for the test's duration: its reader, device d's current stream 1000 + d,
    a one-GPU process."""
    from gqadrv.ops import layouts
    from gqadrv.runtime import driver, tensors

    monkeypatch.setitem(tensors._FAST_KIND, cls, name)
    monkeypatch.setitem(tensors.FAST_READERS, name, read_fake)
    monkeypatch.setattr(layouts, "current_stream", lambda kind, dev: 1000 + dev)
    monkeypatch.setattr(driver, "multi_device", lambda: False)
