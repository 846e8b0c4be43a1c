"""Numpy reference of the FP8-e4m3 KV quantizer (``gqadrv.quantize_kv_fp8``), bit-exact with
``kernels/gqa/smxx/kv_fp8.cu``.

    code = e4m3(float32(x) / scale)

x is widened to float32 (exact for fp16 / bf16), divided by the float32 scale (IEEE, round to
nearest even) and rounded to e4m3 by ``gqadrv.ops.fp8.e4m3_from_f32`` (nearest even, saturation at
+-448, NaN -> 0x7F, +-Inf -> +-448). Scales:

* per tensor: one float32 scale;
* per KV head: a float32 array [H], ``head_axis`` the axis of x that indexes it (x.shape[head_axis] == H);
* computed (``scale=None``): ``max(amax / 448, 2^-126)`` with amax the largest |x| over x's finite
  values (NaN and +-Inf ignored) and the division rounded to float32; 2^-126 (the smallest normal
  float32) for a tensor without any finite nonzero value.

Dequantization (not a kernel here): ``float(code) * scale``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import fp8 as _fp8

__all__ = ["SCALE_FLOOR", "computed_scale", "dequantize_kv_fp8_reference", "quantize_kv_fp8_reference"]

SCALE_FLOOR = np.uint32(0x00800000).view(np.float32)   # 2^-126


def _as_f32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.name not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    return x.astype(np.float32)


def computed_scale(x: np.ndarray) -> np.float32:
    """``max(fl32(amax / 448), 2^-126)`` over x's finite values."""
    a = np.abs(_as_f32(x))
    a = a[np.isfinite(a)]
    amax = np.float32(a.max()) if a.size else np.float32(0.0)
    return np.float32(max(np.float32(amax / np.float32(_fp8.E4M3_MAX)), SCALE_FLOOR))


def _broadcast_scale(x: np.ndarray, scale: Any, head_axis: int | None) -> np.ndarray:
    s = np.asarray(scale, dtype=np.float32)
    if head_axis is None:
        if s.size != 1:
            raise ValueError(f"a per-tensor scale has one element, got shape {s.shape} (per-head scales need head_axis)")
        return s.reshape(())
    ax = head_axis % x.ndim
    if s.shape != (x.shape[ax],):
        raise ValueError(f"per-head scales must have shape ({x.shape[ax]},) for head_axis {head_axis}, got {s.shape}")
    shape = [1] * x.ndim
    shape[ax] = x.shape[ax]
    return s.reshape(shape)


def quantize_kv_fp8_reference(x: np.ndarray, scale: Any = None, *,
                              head_axis: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 of x's shape, the float32 scale used: shape () or [H])."""
    xf = _as_f32(x)
    if scale is None:
        if head_axis is not None:
            raise ValueError("head_axis needs per-head scales (a computed scale is per tensor)")
        s = np.asarray(computed_scale(x), dtype=np.float32)
        sb = s
    else:
        sb = _broadcast_scale(xf, scale, head_axis)
        s = np.asarray(scale, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = (xf / sb).astype(np.float32)
    return _fp8.e4m3_from_f32(q), s


def dequantize_kv_fp8_reference(codes: np.ndarray, scale: Any, *, head_axis: int | None = None) -> np.ndarray:
    """float32 ``float(code) * scale`` (codes uint8 / int8 / float8_e4m3fn)."""
    vals = _fp8.e4m3_to_f32(codes)
    sb = _broadcast_scale(vals, scale, head_axis)
    with np.errstate(invalid="ignore", over="ignore"):
        return (vals * sb).astype(np.float32)
