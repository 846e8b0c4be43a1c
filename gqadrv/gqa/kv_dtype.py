"""The KV-cache element type of the paged / contiguous GQA decode and the FP8 cache scales
(``kv_dtype=``, ``k_scale=``, ``v_scale=`` of ``gqa_decode_paged``, ``gqa_decode`` and their
prepared forms), checked before any launch.

Caches are either the query's dtype (fp16 / bf16) or float8 e4m3fn codes:
  * a ``float8_e4m3fn`` array (torch, JAX, ml_dtypes through DLPack), or
  * a ``uint8`` / ``int8`` array holding e4m3 bits with ``kv_dtype="e4m3"`` (CuPy has no fp8 dtype;
    ``gqadrv.quantize_kv_fp8`` returns such arrays).
The dequantized value of a code is ``float(code) * scale`` (vLLM's convention): ``k_scale`` /
``v_scale`` are None (1.0), a positive finite number, or a float32 device array of shape () / (1,)
(one scale per tensor, read on the device at every launch) or (Hkv,) (one per KV head). Scales
with a fp16 / bf16 cache are an error. A device scale that is not positive and finite gives NaN or
zero outputs for its heads (it cannot be checked without a read back).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from ..ops import contract as _oc
from ..runtime.tensors import TensorView

__all__ = ["E4M3_NAMES", "KvScales", "check_kv_dtype", "check_kv_scales", "fp8_args_given", "kv_dtype_name",
           "kv_is_8bit"]

E4M3_NAMES = ("e4m3", "float8_e4m3fn", "fp8_e4m3")
MAX_HOST_SCALE = 2.0**100  # a number scale times 2^8 and the softmax scale stays finite in float32
_CODE_DTYPES = ("uint8", "int8")


def fp8_args_given(kv_dtype: Any, k_scale: Any, v_scale: Any) -> bool:
    """An FP8 argument was given: the call takes the paged family (which reads FP8 caches)."""
    return kv_dtype is not None or k_scale is not None or v_scale is not None


def kv_is_8bit(kv: Any) -> bool:
    """The cache's dtype (as its framework spells it) is an 8-bit one: float8_*, uint8 or int8. No
    DLPack export; used off the fast path only."""
    dt = str(getattr(kv, "dtype", ""))
    return "float8" in dt or "int8" in dt


def kv_dtype_name(kv_dtype: Any) -> str | None:
    """'e4m3' for any spelling of float8 e4m3fn (a string, torch.float8_e4m3fn, an ml_dtypes / numpy
    dtype), None for None; anything else is a ValueError."""
    if kv_dtype is None:
        return None
    name = str(kv_dtype).lower()
    for prefix in ("torch.", "jnp.", "dtype(", "<class '"):
        name = name.replace(prefix, "")
    name = name.strip("')\" >").split(".")[-1]
    if name in E4M3_NAMES:
        return "e4m3"
    raise ValueError(f"kv_dtype must be None (the cache's own dtype) or 'e4m3' / float8_e4m3fn (e4m3 codes), "
                     f"got {kv_dtype!r}")


def check_kv_dtype(kv: TensorView, q: TensorView, kv_dtype: Any) -> bool:
    """True for an e4m3 cache, False for a cache of q's dtype; errors name the fix."""
    kv_dtype = kv_dtype_name(kv_dtype)
    if kv.dtype == "float8_e4m3fn":
        return True
    if kv.dtype in _CODE_DTYPES:
        if kv_dtype is None:
            raise TypeError(f"{kv.name} has dtype {kv.dtype}: for e4m3 codes pass kv_dtype='e4m3' (other 8-bit "
                            "formats are not supported)")
        return True
    if kv_dtype is not None:
        raise TypeError(f"kv_dtype='e4m3' needs a float8_e4m3fn, uint8 or int8 cache; {kv.name} has dtype {kv.dtype}")
    if kv.dtype.startswith("float8"):
        raise TypeError(f"{kv.name} has dtype {kv.dtype}; the FP8 caches supported are float8_e4m3fn (or uint8 codes "
                        "with kv_dtype='e4m3')")
    _oc.require_dtype(kv, ("float16", "bfloat16"), like=q)
    return False


@dataclasses.dataclass(frozen=True)
class KvScales:
    """The kernel's view of the two scales: value * (ptr ? ptr[head * stride] : 1)."""
    k_value: float = 1.0
    v_value: float = 1.0
    k_ptr: int = 0
    v_ptr: int = 0
    k_stride: int = 0
    v_stride: int = 0
    views: tuple = ()            # the device scales (kept alive by prepared launches)

    @property
    def per_head(self) -> bool:
        return self.k_stride == 1 or self.v_stride == 1


def _one_scale(value: Any, name: str, hkv: int, q: TensorView, stream: int | None) -> tuple[float, int, int, Any]:
    if value is None:
        return 1.0, 0, 0, None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = _oc.check_positive_scale(name, value, MAX_HOST_SCALE)
        if float(v) < 1.1754943508222875e-38:
            raise ValueError(f"{name}={value!r} is below the smallest normal float32 (the kernel multiplies by "
                             "float32(scale))")
        return float(v), 0, 0, None
    if hasattr(value, "__dlpack__"):
        sv = _oc.scale_view(value, name, q, stream)
        if sv.size == 1 and sv.ndim <= 1:
            return 1.0, sv.ptr, 0, sv
        if sv.shape == (hkv,):
            if hkv > 1 and sv.strides[0] != 1:
                raise ValueError(f"{name} [{hkv}] must be contiguous, got strides {sv.strides}")
            return 1.0, sv.ptr, 1, sv
        raise ValueError(f"{name} must have shape () or (1,) (per tensor) or ({hkv},) (per KV head), "
                         f"got {_oc.shape_str(sv)}")
    raise TypeError(f"{name} must be None, a positive number or a float32 device array; got {type(value).__name__}")


def check_kv_scales(k_scale: Any, v_scale: Any, kv8: bool, hkv: int, q: TensorView,
                    stream: int | None) -> KvScales:
    if not kv8:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale apply to FP8 (e4m3) caches only; this cache is fp16/bf16")
        return KvScales()
    kv_, kp, ks, kview = _one_scale(k_scale, "k_scale", hkv, q, stream)
    vv_, vp, vs, vview = _one_scale(v_scale, "v_scale", hkv, q, stream)
    return KvScales(kv_, vv_, kp, vp, ks, vs, tuple(x for x in (kview, vview) if x is not None))
