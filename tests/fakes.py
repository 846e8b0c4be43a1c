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


def aligned(shape, dtype=np.float16) -> np.ndarray:
    """A fresh zeroed host buffer whose first byte is 256-byte aligned, viewed as ``shape``."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 256, np.uint8)
    off = (-raw.__array_interface__["data"][0]) % 256
    return raw[off:off + n].view(dtype).reshape(shape)


def plain_tensor_map(spec) -> bytes:
    """A stand-in for the driver's tensor-map encoder: 128 bytes derived from the geometry, with the
    global address as a little-endian u64 at byte 16 (what ``runtime.tensormap``'s probe learns)."""
    b = bytearray((repr((spec.dims, spec.strides, spec.box)).encode() * 128)[:128])
    b[16:24] = spec.address.to_bytes(8, "little")
    return bytes(b)


def fake_layout_calls(monkeypatch, cls: type, op_module) -> None:
    """The CPU setting of an op's layout-plan tests: ``cls`` registered as a fast-reader kind, no
    producer ordering in ``op_module``, the stand-in tensor-map encoder (the probe learns it afresh)
    and an empty layout cache of 8 entries as ``op_module.layouts``."""
    from gqadrv.ops import layouts
    from gqadrv.runtime import tensormap

    register_fast_kind(monkeypatch, cls)
    monkeypatch.setattr(op_module, "order_fast", lambda *a: None)
    monkeypatch.setattr(tensormap, "_encode", plain_tensor_map)
    monkeypatch.setattr(tensormap, "_offset_state", [])
    monkeypatch.setattr(op_module, "layouts", layouts.LayoutCache(8))
    layouts._encoded.clear()


class RecordingPlan:
    """A LaunchPlan stand-in: its packed arguments and stream; each launch records the bytes."""

    def __init__(self, args, stream: int):
        self.args, self.stream, self.launches = args, stream, []

    def launch(self, stream=None):
        self.launches.append(self.args.bytes())


def assert_layout_keys_differ(variants: dict, base_key) -> None:
    """Every variant's layout key (``variants[name][0]``: a call-facts tuple) differs from ``base_key``
    and from every other variant's key."""
    keys = {name: f[0] for name, f in variants.items()}
    for name, key in keys.items():
        assert key != base_key, name
    assert len(set(keys.values())) == len(keys)
