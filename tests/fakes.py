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
