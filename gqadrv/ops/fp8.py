"""float8_e4m3fn ("e4m3") on the host: the bit-exact numpy model of ``kernels/common/fp8.cuh``
that the FP8 quantizers' references (``gqadrv/mla/fp8_reference.py``, ``gqadrv/gqa/fp8_reference.py``)
and tests build on. Op-neutral (floor 1): imports numpy and ml_dtypes only.

Encoding float32 -> e4m3 code (uint8), the one definition every kernel path implements:

* NaN (either sign) -> 0x7F, the canonical e4m3fn NaN;
* |x| >= 448, including +-Inf -> sign | 0x7E (+-448: saturation, never NaN);
* otherwise round to nearest, ties to even, sign kept (-0.0 and negative values that round to zero
  give 0x80).

``e4m3_from_f32`` is the same integer algorithm as the device's software path (sm_80 / sm_86):
normal range (|x| >= 2^-6): round the 23-bit mantissa to 3 bits by adding 0x7FFFF plus the lowest
kept bit, shift, re-bias the exponent (127 -> 7; a carry moves into the exponent, which is right);
subnormal range: rint(|x| * 512) (exact scaling, ties to even). sm_89+ use the hardware
``cvt.rn.satfinite.e4m3x2.f32`` on inputs clamped to [-448, 448] with NaN lanes forced to 0x7F, which
is the same function. ``e4m3_from_f32_ml_dtypes`` is an independent model on ml_dtypes' cast
(round to nearest even, but overflow gives NaN and NaN keeps its sign, so saturation and the NaN code
are applied explicitly); the tests compare the two over every fp32 of a representative sweep.

Decoding is exact (``e4m3_to_f32``); 0x7F and 0xFF decode to NaN.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "BF16_NAN", "E4M3_MAX", "E4M3_NAN", "bf16_bits", "e4m3_from_f32", "e4m3_from_f32_ml_dtypes", "e4m3_to_f32",
    "pow2_ceil",
]

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
BF16_NAN = 0x7FFF           # the canonical bf16 NaN the kernels store
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _f32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"expected a float32 array, got {x.dtype} (convert explicitly: the rounding to float32 is "
                        "part of the definition)")
    return x


def e4m3_from_f32(x: np.ndarray) -> np.ndarray:
    """e4m3 codes (uint8, x's shape) of a float32 array: the integer algorithm of the device's
    software path (``e4m3_from_f32_soft`` in kernels/common/fp8.cuh)."""
    u = _f32(x).view(np.uint32)
    sign = ((u >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    normal = ((a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.rint(a.view(np.float32) * np.float32(512.0))
    sub = np.where(a < 0x3C800000, sub, 0).astype(np.uint32)
    mag = np.where(a >= 0x3C800000, normal, sub)
    mag = np.where(a >= 0x43E00000, np.uint32(0x7E), mag)
    code = sign | mag
    code = np.where(a > 0x7F800000, np.uint32(E4M3_NAN), code)
    return code.astype(np.uint8)


def e4m3_from_f32_ml_dtypes(x: np.ndarray) -> np.ndarray:
    """The same encoding on ml_dtypes' float32 -> float8_e4m3fn cast (an independent model):
    saturation at +-448 and the NaN code 0x7F applied explicitly."""
    x = _f32(x)
    with np.errstate(invalid="ignore", over="ignore"):
        clamped = np.clip(x, np.float32(-E4M3_MAX), np.float32(E4M3_MAX))  # NaN stays NaN
        code = clamped.astype(_E4M3).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(E4M3_NAN), code).astype(np.uint8)


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """The exact float32 value of e4m3 codes (uint8 / int8 / float8_e4m3fn); 0x7F / 0xFF -> NaN."""
    c = np.asarray(codes)
    if c.dtype == _E4M3:
        c = c.view(np.uint8)
    if c.dtype not in (np.uint8, np.int8):
        raise TypeError(f"e4m3 codes must be uint8, int8 or float8_e4m3fn, got {c.dtype}")
    return c.view(np.uint8).view(_E4M3).astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16): round to nearest even, every NaN as 0x7FFF (the kernels' store)."""
    x = _f32(x)
    bits = x.astype(_BF16).view(np.uint16)
    return np.where(np.isnan(x), np.uint16(BF16_NAN), bits).astype(np.uint16)


def pow2_ceil(x: np.ndarray) -> np.ndarray:
    """The smallest power of two >= x for positive normal float32 x (clear the mantissa, raise the
    exponent when any mantissa bit was set): 2^ceil(log2(x)) without a logarithm's rounding."""
    b = _f32(x).view(np.uint32)
    return ((b + np.uint32(0x7FFFFF)) & np.uint32(0xFF800000)).astype(np.uint32).view(np.float32)
