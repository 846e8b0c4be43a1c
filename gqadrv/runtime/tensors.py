"""Framework-neutral tensor ingestion (DLPack) and output hand-back.

Inputs: any object with ``__dlpack__`` (CuPy, torch, JAX, numba, cuda.core views...) is read
through cuda.core's ``StridedMemoryView`` (pointer, shape, strides, dtype, device) without
importing its framework. fp8 is not parsed by DLPack consumers today, so an fp8 tensor's dtype is
taken from an explicit argument or from the producer's own ``dtype`` attribute.

Outputs: allocated with CuPy and returned in the caller's framework, zero copy: CuPy in -> CuPy
out, torch in -> torch out, JAX in -> JAX out (other producers get CuPy arrays). The caller's
framework is reached through ``sys.modules`` only: gqadrv never imports torch or JAX.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["TensorView", "as_view", "empty", "export_like", "fast_kind", "framework_of", "overlaps", "DTYPE_BYTES",
           "FAST_READERS"]

DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 2, 3, 13
_SMV = None  # cuda.core.utils.StridedMemoryView, imported on first use
_DT_NAMES: dict = {}
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 13: "CUDA managed", 14: "oneAPI"}


def framework_of(obj: Any) -> str:
    mod = type(obj).__module__.split(".")[0]
    if mod in ("jax", "jaxlib"):
        return "jax"
    return mod


def _dtype_name(dt: Any) -> str:
    s = str(dt)
    for prefix in ("torch.", "dtype(", "jnp.", "numpy."):
        s = s.replace(prefix, "")
    return s.strip("')\" ")


class TensorView:
    """What gqadrv needs to know about a device tensor (pointer, shape, element strides, dtype)."""

    __slots__ = ("obj", "name", "ptr", "shape", "strides", "dtype", "itemsize", "device", "framework", "_range")

    def __init__(self, obj, name, ptr, shape, strides, dtype, itemsize, device, framework):
        self.obj, self.name, self.ptr, self.shape, self.strides = obj, name, ptr, shape, strides
        self.dtype, self.itemsize, self.device, self.framework = dtype, itemsize, device, framework

    def __repr__(self) -> str:
        return f"TensorView({self.name}: {self.dtype}{list(self.shape)} @0x{self.ptr:x} cuda:{self.device})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def contiguous(self) -> bool:
        expect = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != expect:
                return False
            expect *= d
        return True

    def byte_range(self) -> tuple[int, int]:
        """[lo, hi) of the bytes this view can touch (empty range for zero-size views); computed once
        per view (the fields are not changed after construction)."""
        try:
            return self._range
        except AttributeError:
            pass
        lo = hi = 0
        for d, st in zip(self.shape, self.strides):
            if d == 0:
                r = self._range = (self.ptr, self.ptr)
                return r
            span = (d - 1) * st
            if span < 0:
                lo += span
            else:
                hi += span
        it = self.itemsize
        r = self._range = (self.ptr + lo * it, self.ptr + hi * it + it)
        return r


def overlaps(a: TensorView, b: TensorView) -> bool:
    a0, a1 = a.byte_range()
    b0, b1 = b.byte_range()
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _cupy_view(obj: Any, name: str, dtype: str | None) -> TensorView | None:
    """Fast path for CuPy arrays (no DLPack capsule): their attributes are the same facts DLPack
    would give. Returns None when the array needs the general path (fp8 & co., zero itemsize)."""
    npdt = obj.dtype
    dt = dtype or _DT_NAMES.get(npdt)
    if dt is None:
        dt = _DT_NAMES.setdefault(npdt, _dtype_name(npdt))
    itemsize = npdt.itemsize
    if dt not in DTYPE_BYTES or DTYPE_BYTES[dt] != itemsize or itemsize == 0:
        return None
    strides = tuple(st // itemsize for st in obj.strides)
    return TensorView(obj, name, obj.data.ptr, obj.shape, strides, dt, itemsize, obj.device.id, "cupy")


def as_view(obj: Any, name: str, *, stream: int | None = None, dtype: str | None = None,
            cupy_ordered: bool = False) -> TensorView:
    """Read a DLPack tensor. ``stream``: the consumer stream the producer must order against
    (None: no synchronisation requested). CuPy arrays are read from their attributes (same facts,
    no capsule: a few microseconds less per tensor) when ``stream`` is None or when the caller has
    already ordered CuPy's current stream before ``stream`` (``cupy_ordered``, see
    ``streams.order_inputs``)."""
    if stream is None or cupy_ordered:
        cp = sys.modules.get("cupy")
        if cp is not None and type(obj) is cp.ndarray:
            v = _cupy_view(obj, name, dtype)
            if v is not None:
                return v
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise TypeError(f"{name} must be a CUDA array supporting DLPack (CuPy, torch, JAX, ...); got {_describe(obj)}")
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except Exception as exc:  # noqa: BLE001
        raise TypeError(f"{name}: __dlpack_device__() failed: {exc}") from exc
    dev_type = int(dev_type)
    if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        where = _DEVICE_NAMES.get(dev_type, f"DLPack device type {dev_type}")
        raise ValueError(f"{name} must be a CUDA array; got a {where} array ({_describe(obj)}): move it to the GPU first")
    global _SMV
    if _SMV is None:
        from cuda.core.utils import StridedMemoryView as _SMV
    stream_ptr = -1 if stream is None else (1 if stream == 0 else int(stream))
    try:
        v = _SMV.from_dlpack(obj, stream_ptr=stream_ptr)
    except (BufferError, TypeError, RuntimeError) as exc:
        # e.g. a producer without a DLPack code for its dtype (some torch / JAX versions and fp8)
        alt = _byte_view_of_torch_fp8(obj)
        if alt is not None:
            return _relabel(as_view(alt, name, stream=stream), obj)
        raise ValueError(f"{name} cannot be exported through DLPack: {type(exc).__name__}: {exc}") from exc
    shape = tuple(v.shape)
    try:
        npdt = v.dtype
        dt = _DT_NAMES.get(npdt)
        if dt is None:
            dt = _DT_NAMES.setdefault(npdt, _dtype_name(npdt))
    except TypeError:
        dt = None  # fp8 & co.: not parsed by the DLPack consumer
    if dtype is not None:
        dt = dtype
    elif dt is None:
        dt = _dtype_name(getattr(obj, "dtype", "unknown"))
    itemsize = DTYPE_BYTES.get(dt)
    if itemsize is None:
        try:
            itemsize = int(v.dtype.itemsize)
        except Exception:  # noqa: BLE001
            itemsize = 1
    try:
        v_strides = v.strides
    except TypeError as exc:  # a consumer that derives element strides from a dtype it cannot parse
        alt = _byte_view_of_torch_fp8(obj)
        if alt is not None:
            return _relabel(as_view(alt, name, stream=stream), obj)
        raise ValueError(f"{name} cannot be read through DLPack (dtype {dt}): {exc}") from exc
    if v_strides is None:
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        strides = tuple(reversed(strides))
    else:
        strides = tuple(v_strides)
    return TensorView(obj, name, v.ptr, shape, strides, dt, itemsize, dev_id, framework_of(obj))


def _byte_view_of_torch_fp8(obj: Any) -> Any:
    """A torch float8 tensor as a uint8 view of the same bytes (torch's own ``view(dtype)``: no copy,
    same strides), for DLPack consumers that cannot take the float8 codes; None for anything else.
    torch is the caller's: it is in sys.modules whenever obj is a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is None or framework_of(obj) != "torch" or not str(getattr(obj, "dtype", "")).startswith("torch.float8"):
        return None
    return obj.view(torch.uint8)


def _relabel(v: TensorView, obj: Any) -> TensorView:
    """``v`` (read from a uint8 view) with the original object and its float8 dtype name."""
    return TensorView(obj, v.name, v.ptr, v.shape, v.strides, _dtype_name(obj.dtype), 1, v.device, v.framework)


def _np_dtype(dtype: str):
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def empty(shape: tuple[int, ...], dtype: str, device: int):
    """A new CuPy array on ``device`` (allowed while a stream of this thread is being captured:
    streams.relaxed_capture_mode)."""
    import cupy

    from .streams import relaxed_capture_mode

    with cupy.cuda.Device(device), relaxed_capture_mode():
        return cupy.empty(shape, dtype=_np_dtype(dtype))


def export_like(arr: Any, like: Any) -> Any:
    """Hand a CuPy array back in ``like``'s framework (zero copy through DLPack)."""
    fw = framework_of(like)
    if fw == "torch":
        torch = sys.modules.get("torch")
        if torch is not None:
            return torch.from_dlpack(arr)
    elif fw == "jax":
        jnp = sys.modules.get("jax.numpy")
        if jnp is not None and hasattr(jnp, "from_dlpack"):
            return jnp.from_dlpack(arr)
        jdl = sys.modules.get("jax.dlpack")
        if jdl is not None:
            return jdl.from_dlpack(arr)
    return arr


# ----------------------------------------------------------------------------- fast readers
# Repeated convenience calls re-read only what can change between calls of one layout: each
# tensor's address and device, and the facts that decide whether it still has that layout (shape,
# strides, dtype). A reader gives ``(layout, address, device)`` from the framework's own cheap
# attributes, or None when the tensor needs the general (DLPack) path; the caller then validates
# fully. Frameworks are recognised by exact type, never imported.
#
# * CuPy ``ndarray``: ``.data.ptr`` / ``.data.device_id``, shape, byte strides, dtype.
# * torch ``Tensor``: ``data_ptr()``, ``get_device()``, shape, element strides, dtype; CPU tensors
#   and tensors that require grad go to the general path (which explains the error).
# * JAX ``ArrayImpl``: ``__cuda_array_interface__`` (defined for single-device GPU buffers in
#   row-major order only: anything else raises and takes the general path), the device from
#   ``__dlpack_device__`` cached per sharding object.
# * XLA FFI ``Buffer`` (the arguments of a ``jax.experimental.buffer_callback``, i.e. gqadrv.jax under
#   ``jax.jit``): kind 'xla'. Its ``__cuda_array_interface__`` (CUDA buffers only; it raises for other
#   devices and for element types it does not describe, e.g. fp8) gives the address; buffers are
#   always row-major (no strides), shape and dtype are attributes; ``writeable`` is False for inputs.
#   The buffers are defined on the callback's stream (``ExecutionContext.stream``) and their
#   ``__dlpack__`` ignores the ``stream`` argument, so there is nothing to order (streams.order_fast).
FAST_READERS: dict[str, Any] = {}
_FAST_KIND: dict[type, str | None] = {}
_JAX_DEVICES: dict[Any, int] = {}


def _classify(t: type) -> str | None:
    mod = t.__module__.split(".")[0]
    name = t.__name__
    if mod == "cupy" and name == "ndarray":
        return "cupy"
    if mod == "torch" and name == "Tensor":
        return "torch"
    if mod in ("jax", "jaxlib") and name == "ArrayImpl" and hasattr(t, "__cuda_array_interface__"):
        return "jax"
    if (mod in ("jax", "jaxlib") and name == "Buffer" and hasattr(t, "__cuda_array_interface__")
            and hasattr(t, "writeable")):
        return "xla"
    return None


def fast_kind(obj: Any) -> str | None:
    """'cupy', 'torch', 'jax' or 'xla' for the exact array types the fast readers know, else None."""
    t = type(obj)
    try:
        return _FAST_KIND[t]
    except KeyError:
        k = _FAST_KIND[t] = _classify(t)
        return k


def _read_cupy(a: Any) -> tuple | None:
    m = a.data
    return (a.shape, a.strides, a.dtype), m.ptr, m.device_id


def _read_torch(t: Any) -> tuple | None:
    if not t.is_cuda or t.requires_grad:
        return None
    return (t.shape, t.stride(), t.dtype), t.data_ptr(), t.get_device()


def _read_jax(x: Any) -> tuple | None:
    cai = x.__cuda_array_interface__
    if cai.get("strides") is not None:
        return None
    sh = x.sharding
    dev = _JAX_DEVICES.get(sh)
    if dev is None:
        t, d = x.__dlpack_device__()
        if int(t) != _KDL_CUDA:
            return None
        if len(_JAX_DEVICES) > 256:
            _JAX_DEVICES.clear()
        dev = _JAX_DEVICES[sh] = int(d)
    return (x.shape, x.dtype), cai["data"][0], dev


def _read_xla(x: Any) -> tuple | None:
    t, d = x.__dlpack_device__()
    if int(t) != _KDL_CUDA:
        return None
    return (x.shape, x.dtype), x.__cuda_array_interface__["data"][0], int(d)


FAST_READERS.update(cupy=_read_cupy, torch=_read_torch, jax=_read_jax, xla=_read_xla)
