"""FP8-e4m3 KV quantizer (``gqadrv.quantize_kv_fp8``), torch-free: fp16 / bf16 / fp32 arrays of
any shape to e4m3 codes with a per-tensor or per-KV-head float32 scale (vLLM's FP8 KV-cache
convention: ``x ~= float(code) * scale``), one or two launches (``kernels/gqa/smxx/kv_fp8.cu``).

    codes, scale = quantize_kv_fp8(k)                          # scale computed on the GPU: amax / 448
    codes, scale = quantize_kv_fp8(k, 0.05)                    # a given per-tensor scale (float)
    codes, scale = quantize_kv_fp8(k, k_scale)                 # a device scale, 0-d or one element
    codes, scale = quantize_kv_fp8(k, scales, head_axis=-2)    # per-KV-head scales [Hkv], k [..., Hkv, D]

``code = e4m3(float32(x) / scale)``: the division in float32 (IEEE, nearest even), then e4m3 with
round to nearest even and saturation (|x / scale| beyond 448, Inf included, gives +-448; NaN gives
0x7F). A computed scale is ``max(amax / 448, 2^-126)`` with amax the largest |x| over the finite
values (NaN and +-Inf ignored): a memset, an amax launch (one atomicMax per CTA on the float bits)
and the quantize launch, which reads the scale on the device. Nothing is read back to the host, so
with ``out`` and ``out_scale`` given the call is capturable into a CUDA graph. The numpy model is
``gqadrv.gqa.fp8_reference`` (bit-exact); docs/GQA.md "FP8 KV quantizer".

This module holds the family: the argument struct (mirror of the kernel's ``KvFp8Args``), the
kernel families (amax, quantize) and their variants (one per input dtype), the contract, the
launch, the public call and the ``OP`` record the CLI iterates (``compile``, ``info``, ``selftest``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar, overload

from ..ops import contract as _oc
from ..ops import outputs as _outputs
from ..ops.kernels import Loaded, load
from ..ops.plans import launch_packed
from ..ops.registry import ElementwiseGeometry, KernelFamily, OpRecord
from ..runtime import driver as _drv
from ..runtime.module import NamedStruct, Signature
from ..runtime.streams import launch_streams
from ..runtime.tensors import TensorView
from ..types import ArrayT, OutT, ScaleT, StreamLike
from . import fp8_reference as _ref

__all__ = ["quantize_kv_fp8"]

# ----------------------------------------------------------------------------- limits
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("uint8", "int8", "float8_e4m3fn")   # what an output of e4m3 codes may be typed as
THREADS = 256             # KVFP8_THREADS
GROUP = 16                # KVFP8_GROUP: elements per work item
MAX_GRID = 2**31 - 1
MAX_HEADS = 2**31 - 1
_DT_CODE = {"float16": 0, "bfloat16": 1, "float32": 2}
F32_MAX = _oc.F32_MAX
F32_MIN_NORMAL = 2.0**-126

# ----------------------------------------------------------------------------- argument struct
KVFP8_FLAG_SCALE_PTR = 1  # the scale is read from the device: scale[0], or scale[head] with PER_HEAD
KVFP8_FLAG_PER_HEAD = 2   # scale[(e / inner) % heads]
KVFP8_FLAG_VEC16 = 4      # x and out 16-byte aligned: vector loads / stores for full items
KVFP8_SCALE_FLOOR = 0x00800000   # bits of 2^-126: the computed scale's floor (the memset value)

KVFP8_ARGS = NamedStruct(
    "KvFp8Args",
    ("x", "Q"),              # const void* [n] fp16 / bf16 / fp32, contiguous
    ("out", "Q"),            # u8* [n] e4m3 codes
    ("scale", "Q"),          # float*: device scale(s) ([1] or [heads]); amax: the computed scale
    ("n", "q"),              # elements of x
    ("inner", "q"),          # per head: elements from one head index to the next
    ("groups", "q"),         # work items: ceil(n / 16)
    ("heads", "i"),          # per head: x.shape[head_axis]; else 1
    ("flags", "i"),          # KVFP8_FLAG_* bits
    ("scale_value", "f"),    # the scale when KVFP8_FLAG_SCALE_PTR is clear
)
SIGNATURE = Signature(("args", KVFP8_ARGS))

# ----------------------------------------------------------------------------- families and variants
SOURCE = "gqa/smxx/kv_fp8.cu"
_ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
_FEATURES = frozenset({"fp16", "bf16", "fp32", "fp8_e4m3", "per_tensor_scale", "per_head_scale", "computed_scale"})
AMAX = KernelFamily("kv_fp8_amax", SOURCE, "kv_fp8_amax", _ARCHES, SIGNATURE, _FEATURES)
QUANTIZE = KernelFamily("kv_fp8_quantize", SOURCE, "kv_fp8_quantize", _ARCHES, SIGNATURE, _FEATURES)
_OP_CODE = {AMAX.name: 0, QUANTIZE.name: 1}


@dataclasses.dataclass(frozen=True)
class KvFp8Variant(ElementwiseGeometry):
    """One compiled module (one entry, one input dtype)."""

    THREADS: ClassVar[int] = THREADS
    family: KernelFamily
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.family.name}_{self.dtype}"

    @property
    def defines(self) -> dict:
        return {"KVFP8_DT": _DT_CODE[self.dtype], "KVFP8_OP": _OP_CODE[self.family.name]}



def variants_for_arch(arch: str) -> list[KvFp8Variant]:
    """Every module ``python -m gqadrv compile --arch ARCH`` builds for this family."""
    if arch not in _ARCHES:
        return []
    return [KvFp8Variant(fam, dt) for fam in (AMAX, QUANTIZE) for dt in SUPPORTED_DTYPES]


def check_cc(cc: tuple[int, int]) -> None:
    if cc[0] < 8:
        raise RuntimeError(f"quantize_kv_fp8 needs compute capability 8.0 or newer; this GPU has {cc[0]}.{cc[1]}")


def route(family: KernelFamily, dtype: str, device: int) -> Loaded:
    check_cc(_drv.device_info(device).cc)
    return load(KvFp8Variant(family, dtype), device)


# ----------------------------------------------------------------------------- contract
@dataclasses.dataclass(frozen=True)
class KvFp8Problem:
    """``mode``: "computed" (scale None), "value" (a number), "tensor" (a device array of one
    element) or "head" (a device array [H] with head_axis)."""

    mode: str
    dtype: str
    device: int
    shape: tuple[int, ...]
    x: TensorView
    scale_value: float             # "value": float32(scale); else 1.0
    scale: TensorView | None       # "tensor" / "head": the device scale
    heads: int
    inner: int
    out: TensorView | None
    out_scale: TensorView | None

    @property
    def n(self) -> int:
        return int(math.prod(self.shape))

    @property
    def groups(self) -> int:
        return -(-self.n // GROUP)


_shape = _oc.shape_str




def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_scale_value(value: Any) -> float:
    """A number > 0 whose float32 rounding is a finite positive normal (>= 2^-126, <= FLT_MAX)."""
    v = _oc.check_positive_scale("scale", value)
    import numpy as np

    f = float(np.float32(v))
    if not F32_MIN_NORMAL <= f <= F32_MAX:
        raise ValueError(f"scale={value!r} is not a normal float32 number (the kernel divides by float32(scale)); "
                         f"it must lie in [{F32_MIN_NORMAL:.4g}, {F32_MAX:.4g}]")
    return f


def check_head_axis(head_axis: Any, ndim: int) -> int:
    if isinstance(head_axis, bool) or not isinstance(head_axis, numbers.Integral):
        raise TypeError(f"head_axis must be None or an int, got {type(head_axis).__name__} {head_axis!r}")
    a = int(head_axis)
    if not -ndim <= a < ndim:
        raise ValueError(f"head_axis {a} is out of range for x with {ndim} dimensions")
    return a % ndim


def validate(x: Any, scale: Any, head_axis: Any, out: Any, out_scale: Any, *, stream: int | None) -> KvFp8Problem:
    """Every host-visible rule of ``quantize_kv_fp8``, before any launch."""
    xv = _oc.view_without_grad(x, "x", stream)
    _oc.require_dtype(xv, SUPPORTED_DTYPES)
    _oc.require_contiguous_or_empty(xv)
    _oc.require_aligned(xv, xv.itemsize)
    _oc.require_no_grad(xv)
    shape = tuple(int(d) for d in xv.shape)
    mode, value, sv, heads, inner = "computed", 1.0, None, 1, 1
    if scale is None:
        if head_axis is not None:
            raise ValueError("head_axis selects per-head scales, which must be given (scale=array [H]); a computed "
                             "scale is per tensor: pass head_axis=None")
    elif _is_number(scale):
        if head_axis is not None:
            raise ValueError("head_axis needs per-head scales as a device float32 array [H], not a number")
        mode, value = "value", check_scale_value(scale)
    elif hasattr(scale, "__dlpack__"):
        sv = _oc.scale_view(scale, "scale", xv, stream)
        if head_axis is None:
            if sv.size != 1:
                raise ValueError(f"a per-tensor device scale has one element (shape () or (1,)), got {_shape(sv)}; "
                                 "per-KV-head scales [H] need head_axis (the axis of x that indexes them)")
            mode = "tensor"
        else:
            ax = check_head_axis(head_axis, len(shape))
            heads = shape[ax]
            inner = int(math.prod(shape[ax + 1:]))
            if tuple(sv.shape) != (heads,):
                raise ValueError(f"per-head scales must have shape ({heads},) (x.shape[{head_axis}]), got {_shape(sv)}")
            if not 1 <= heads <= MAX_HEADS:
                raise ValueError(f"x.shape[{head_axis}] = {heads} heads: per-head scales need 1..{MAX_HEADS} heads")
            _oc.require_contiguous_or_empty(sv)
            mode = "head"
    else:
        raise TypeError(f"scale must be None, a number or a float32 device array (DLPack); got {type(scale).__name__}")

    ov = None
    if out is not None:
        ov = _oc.view_without_grad(out, "out", stream)
        if tuple(ov.shape) != shape:
            raise ValueError(f"out must have x's shape {_shape(xv)}, got {_shape(ov)}")
        if ov.dtype not in FP8_DTYPES:
            raise TypeError(f"out must have dtype {' or '.join(FP8_DTYPES)} (one e4m3 code per element), got {ov.dtype}")
        _oc.require_contiguous_or_empty(ov)
        _oc.require_same_device(ov, xv)
        _oc.require_writable(ov)
        _oc.require_no_overlap(ov, (xv, sv))
        _oc.require_no_grad(ov)
    osv = None
    if out_scale is not None:
        if mode != "computed":
            raise ValueError("out_scale receives a computed scale: give it only with scale=None (a given scale is "
                             "returned as it is)")
        osv = _oc.view_without_grad(out_scale, "out_scale", stream)
        if osv.dtype != "float32":
            raise TypeError(f"out_scale must have dtype float32, got {osv.dtype}")
        if osv.size != 1:
            raise ValueError(f"out_scale must hold one element (shape () or (1,)), got {_shape(osv)}")
        _oc.require_same_device(osv, xv)
        _oc.require_aligned(osv, 4)
        _oc.require_writable(osv)
        _oc.require_no_overlap(osv, (xv, ov))
        _oc.require_no_grad(osv)
    return KvFp8Problem(mode, xv.dtype, xv.device, shape, xv, value, sv, heads, inner, ov, osv)


# ----------------------------------------------------------------------------- launch
def args_fields(problem: KvFp8Problem, out_ptr: int, scale_ptr: int) -> dict:
    """The ``KvFp8Args`` fields (by name) of both launches; ``scale_ptr`` is the device scale (the
    computed one's address in "computed" mode, 0 in "value" mode)."""
    flags = 0
    if problem.mode != "value":
        flags |= KVFP8_FLAG_SCALE_PTR
    if problem.mode == "head":
        flags |= KVFP8_FLAG_PER_HEAD
    if problem.x.ptr % 16 == 0 and out_ptr % 16 == 0:
        flags |= KVFP8_FLAG_VEC16
    return {"x": problem.x.ptr, "out": out_ptr, "scale": scale_ptr, "n": problem.n, "inner": max(problem.inner, 1),
            "groups": problem.groups, "heads": max(problem.heads, 1), "flags": flags,
            "scale_value": problem.scale_value if problem.mode == "value" else 1.0}


def grid_for(groups: int, cap: int) -> int:
    """CTAs of a launch over ``groups`` work items, at most ``cap`` (the kernels stride over the rest)."""
    return max(1, min(-(-groups // THREADS), cap, MAX_GRID))


def _memset_floor(ptr: int, stream: int, device: int) -> None:
    drv = _drv.driver()
    with _drv.device_scope(device):
        _drv.check(drv.cuMemsetD32Async(ptr, KVFP8_SCALE_FLOOR, 1, stream), "cuMemsetD32Async(out_scale)")


def _run(problem: KvFp8Problem, like: Any, out: Any, scale: Any, out_scale: Any, s: int) -> tuple[Any, Any]:
    dev = problem.device
    new_out = new_scale = None
    out_ptr = problem.out.ptr if problem.out is not None else 0
    if problem.out is None:
        new_out = _outputs.allocate(like, problem.shape, "uint8", dev, s)
        out_ptr = new_out.ptr
    scale_ptr = 0
    if problem.mode == "computed":
        if problem.out_scale is not None:
            scale_ptr = problem.out_scale.ptr
        else:
            new_scale = _outputs.allocate(like, (), "float32", dev, s)
            scale_ptr = new_scale.ptr
        _memset_floor(scale_ptr, s, dev)
    elif problem.scale is not None:
        scale_ptr = problem.scale.ptr
    if problem.n > 0:
        fields = args_fields(problem, out_ptr, scale_ptr)
        if problem.mode == "computed":
            amax = route(AMAX, problem.dtype, dev)
            cap = _drv.device_info(dev).sm_count * amax.ctas_per_sm   # one atomic per resident CTA
            launch_packed(amax.kernel, (grid_for(problem.groups, cap), 1, 1), (THREADS, 1, 1), 0, SIGNATURE, s,
                          (fields,), dev)
        quant = route(QUANTIZE, problem.dtype, dev)
        launch_packed(quant.kernel, (grid_for(problem.groups, MAX_GRID), 1, 1), (THREADS, 1, 1), 0, SIGNATURE, s,
                      (fields,), dev)
    codes = _outputs.hand_back(new_out, like, s, dev) if new_out is not None else out
    if problem.mode == "computed":
        ret_scale = _outputs.hand_back(new_scale, like, s, dev) if new_scale is not None else out_scale
    elif problem.mode == "value":
        ret_scale = problem.scale_value
    else:
        ret_scale = scale
    return codes, ret_scale



# ----------------------------------------------------------------------------- public API
@overload
def quantize_kv_fp8(x: ArrayT, scale: None = None, *, head_axis: None = None, out: OutT | None = None,
                    out_scale: ScaleT | None = None,
                    stream: StreamLike | None = None) -> tuple[OutT | ArrayT, ScaleT | ArrayT]: ...


@overload
def quantize_kv_fp8(x: ArrayT, scale: float, *, head_axis: None = None, out: OutT | None = None,
                    out_scale: None = None, stream: StreamLike | None = None) -> tuple[OutT | ArrayT, float]: ...


@overload
def quantize_kv_fp8(x: ArrayT, scale: ScaleT, *, head_axis: int | None = None, out: OutT | None = None,
                    out_scale: None = None, stream: StreamLike | None = None) -> tuple[OutT | ArrayT, ScaleT]: ...


def quantize_kv_fp8(x: Any, scale: Any = None, *, head_axis: int | None = None, out: Any = None,
                    out_scale: Any = None, stream: StreamLike | None = None) -> tuple[Any, Any]:
    """Quantize a KV array to FP8 e4m3 codes with a float32 scale: ``x ~= float(code) * scale``.

    ``x``: float16, bfloat16 or float32, any shape, contiguous. ``code = e4m3(float32(x) / scale)``
    (float32 division, round to nearest even; e4m3 round to nearest even with saturation: values
    beyond +-448 after scaling, Inf included, become +-448; NaN becomes the e4m3 NaN 0x7F).

    ``scale``:

    * ``None`` (default): one scale computed on the GPU, ``max(amax / 448, 2^-126)`` with amax the
      largest |x| over its finite values (NaN and +-Inf ignored). Returned as a float32 device array
      of shape () (or written into ``out_scale``: float32, one element); never read on the host.
    * a Python / numpy number > 0: a per-tensor scale (used as float32; returned as that float).
    * a float32 device array of one element (shape () or (1,)): vLLM's per-tensor ``k_scale`` /
      ``v_scale``, read by the kernel (returned as given).
    * a float32 device array [H] with ``head_axis``: per-KV-head scales, ``head_axis`` the axis of x
      that indexes them (``x.shape[head_axis] == H``; e.g. -2 for x [..., Hkv, D] such as NHD pages
      [num_blocks, page, Hkv, D], 1 for HND pages [num_blocks, Hkv, page, D]). Returned as given.

    Device scales are not checked (never read on the host): a zero scale gives +-448 / NaN codes.
    Returns ``(codes, scale)``: codes uint8 of x's shape in x's framework (view them as
    float8_e4m3fn if you like), or ``out`` (uint8 / int8 / float8_e4m3fn of x's shape, contiguous)
    filled and returned. Bit-exact with ``gqadrv.gqa.fp8_reference.quantize_kv_fp8_reference``.

    Asynchronous on ``stream`` (default: torch's current stream for torch tensors, else CuPy's); the
    inputs' producers are ordered before the launches. A computed scale takes a memset, an amax
    launch and the quantize launch; a given scale, the quantize launch only. With ``out`` (and, for a
    computed scale, ``out_scale``) given nothing is allocated and nothing read back: capturable into
    a CUDA graph (after one call outside capture has loaded the kernels).
    """
    if head_axis is not None and scale is None:
        raise ValueError("head_axis selects per-head scales, which must be given (scale=array [H]); a computed "
                         "scale is per tensor: pass head_axis=None")
    s, dl = launch_streams(x, (x, scale if hasattr(scale, "__dlpack__") else None, out, out_scale), stream)
    problem = validate(x, scale, head_axis, out, out_scale, stream=dl)
    return _run(problem, x, out, scale, out_scale, s)


# ----------------------------------------------------------------------------- CLI record
def _describe(cc: tuple[int, int]) -> str:
    check_cc(cc)
    conv = "hardware cvt (sm_89+)" if cc >= (8, 9) else "software RNE (below sm_89)"
    return (f"FP8 KV quantizer: kernel families {AMAX.name!r}, {QUANTIZE.name!r} (float16 / bfloat16 / float32; "
            f"per-tensor, per-head or computed scale); e4m3 conversion: {conv}")


def _selftest(rng: Any, gpu: bool) -> list:
    import numpy as np

    from ..ops import fp8 as _fp8

    x = (rng.standard_normal((4, 8, 2, 64)) * 3.0).astype(np.float32)
    codes, sc = _ref.quantize_kv_fp8_reference(x)
    back = _ref.dequantize_kv_fp8_reference(codes, sc)
    err = float(np.max(np.abs(back - x)))
    ok = err <= float(sc) * 16.0 and bool(np.array_equal(codes, _fp8.e4m3_from_f32_ml_dtypes((x / sc).astype(np.float32))))
    cases = [("kv fp8 reference round trip (error <= 16 * scale; both e4m3 models agree)", err, ok)]
    if not gpu:
        return cases
    import cupy as cp

    for dtype in SUPPORTED_DTYPES:
        xd = x.astype(np.float16) if dtype == "float16" else x
        if dtype == "bfloat16":
            import ml_dtypes

            xd = x.astype(ml_dtypes.bfloat16)
        d = cp.empty(xd.shape, dtype=xd.dtype)
        d.data.copy_from_host(np.ascontiguousarray(xd).ctypes.data, xd.nbytes)
        got, gs = quantize_kv_fp8(d)
        ref, rs = _ref.quantize_kv_fp8_reference(xd)
        bad = int(np.count_nonzero(cp.asnumpy(got) != ref)) + int(float(cp.asnumpy(gs)) != float(rs))
        cases.append((f"kv fp8 quantize {dtype} computed scale, bit-exact with the reference", float(bad), bad == 0))
    return cases


OP = OpRecord(name="kv_fp8", variants_for_arch=variants_for_arch, describe=_describe, selftest=_selftest)
