"""The GQA decode contract: tensor shapes, dtypes, devices and scalar rules, checked before any launch.

Error classes follow the seed system: TypeError for dtypes, ValueError for shapes, devices,
contiguity, capacity, alignment, aliasing, q_scale and num_splits. Lengths are device data and are
never read here (the kernels clamp them to [0, capacity]).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from ..runtime.tensors import TensorView, as_view, overlaps

__all__ = [
    "GqaProblem",
    "MAX_GROUP",
    "MAX_SPLITS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "check_num_splits",
    "check_q_scale",
    "validate",
]

SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class GqaProblem:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    capacity: int
    head_dim: int
    dtype: str
    device: int
    q: TensorView
    kv: TensorView
    lengths: TensorView
    out: TensorView | None
    q_scale: float

    @property
    def framework(self) -> str:
        return self.q.framework

    def geometry(self) -> tuple:
        return (self.batch, self.num_q_heads, self.num_kv_heads, self.capacity, self.head_dim, self.dtype)


def check_q_scale(q_scale: Any) -> float:
    """q_scale must be a real number, finite and > 0 (numpy / 0-d framework scalars are accepted)."""
    bad = ValueError(f"q_scale must be a finite number > 0, got {q_scale!r}")
    if q_scale is None or isinstance(q_scale, (bool, str, bytes, complex)):
        raise bad
    try:
        v = float(q_scale)
    except (TypeError, ValueError):
        raise bad from None
    if not math.isfinite(v) or v <= 0.0:
        raise bad
    return v


def check_num_splits(num_splits: Any) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    n = int(num_splits)
    if not 1 <= n <= MAX_SPLITS:
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {n}")
    return n


def _shape(v: TensorView) -> str:
    return "(" + ", ".join(str(d) for d in v.shape) + ")"


def _require_contiguous(v: TensorView) -> None:
    if not v.contiguous:
        raise ValueError(f"{v.name} must be contiguous (row-major); got shape {_shape(v)} with strides {v.strides} (elements)")


def _require_same_device(v: TensorView, ref: TensorView) -> None:
    if v.device != ref.device:
        raise ValueError(f"{v.name} is on cuda:{v.device} but {ref.name} is on cuda:{ref.device}; all tensors must share one device")


def _require_aligned(v: TensorView, n: int = 16) -> None:
    if v.ptr % n:
        raise ValueError(f"{v.name} must start at a {n}-byte aligned address (got 0x{v.ptr:x}); pass a freshly allocated tensor, not an offset view")


def validate(q: Any, kv: Any, lengths: Any, out: Any, q_scale: Any, *, stream: int | None, names=("q", "kv", "sequence_lengths", "out")) -> GqaProblem:
    """Check every host-visible rule and return the problem description."""
    nq, nkv, nlen, nout = names
    qv = as_view(q, nq, stream=stream)
    if qv.ndim != 3:
        raise ValueError(f"{nq} must have shape [batch, num_q_heads, head_dim], got {_shape(qv)}")
    B, Hq, D = qv.shape
    if B <= 0:
        raise ValueError(f"batch must be positive, got {nq} shape {_shape(qv)}")
    if Hq <= 0:
        raise ValueError(f"num_q_heads must be positive, got {nq} shape {_shape(qv)}")
    if qv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{nq} must have dtype float16 or bfloat16, got {qv.dtype}")
    _require_contiguous(qv)

    kvv = as_view(kv, nkv, stream=stream)
    if kvv.ndim != 5:
        raise ValueError(f"{nkv} must have shape [batch, 2, num_kv_heads, capacity, head_dim], got {_shape(kvv)}")
    if kvv.shape[0] != B:
        raise ValueError(f"{nkv} batch {kvv.shape[0]} does not match {nq} batch {B}")
    if kvv.shape[1] != 2:
        raise ValueError(f"{nkv} dim 1 must be 2 (K at index 0, V at index 1), got {_shape(kvv)}")
    Hkv, C, Dkv = kvv.shape[2], kvv.shape[3], kvv.shape[4]
    if Hkv <= 0:
        raise ValueError(f"num_kv_heads must be positive, got {nkv} shape {_shape(kvv)}")
    if C <= 0:
        raise ValueError(f"kv capacity must be positive, got {nkv} shape {_shape(kvv)}")
    if Dkv != D:
        raise ValueError(f"{nkv} head_dim {Dkv} does not match {nq} head_dim {D}")
    if kvv.dtype != qv.dtype:
        raise TypeError(f"{nkv} must have the dtype of {nq} ({qv.dtype}), got {kvv.dtype}")
    _require_contiguous(kvv)
    _require_same_device(kvv, qv)
    if Hq % Hkv:
        raise ValueError(f"num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    group = Hq // Hkv
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group size num_q_heads/num_kv_heads = {group} is not supported; supported: 1..{MAX_GROUP}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")

    lv = as_view(lengths, nlen, stream=stream)
    if lv.dtype != "int32":
        raise TypeError(f"{nlen} must have dtype int32, got {lv.dtype}")
    if lv.shape != (B,):
        raise ValueError(f"{nlen} must have shape ({B},) (one length per request), got {_shape(lv)}")
    _require_contiguous(lv)
    _require_same_device(lv, qv)
    _require_aligned(qv)
    _require_aligned(kvv)
    _require_aligned(lv, 4)

    ov = None
    if out is not None:
        ov = as_view(out, nout, stream=stream)
        if ov.shape != qv.shape:
            raise ValueError(f"{nout} must have the shape of {nq} {_shape(qv)}, got {_shape(ov)}")
        if ov.dtype != qv.dtype:
            raise TypeError(f"{nout} must have the dtype of {nq} ({qv.dtype}), got {ov.dtype}")
        _require_contiguous(ov)
        _require_same_device(ov, qv)
        _require_aligned(ov)
        if ov.framework == "jax":
            raise ValueError(f"{nout} is a JAX array, and JAX arrays are immutable: omit {nout} and use the returned array")
        for other in (qv, kvv, lv):
            if overlaps(ov, other):
                raise ValueError(f"{nout} must not overlap {other.name} in memory (its bytes alias the input)")
    scale = check_q_scale(q_scale)
    return GqaProblem(B, Hq, Hkv, group, C, D, qv.dtype, qv.device, qv, kvv, lv, ov, scale)
