"""The GQA decode contract: tensor shapes, dtypes, devices and scalar rules, checked before any launch.

Error classes follow the seed system: TypeError for dtypes, ValueError for shapes, devices,
contiguity, capacity, alignment, aliasing, q_scale / sm_scale and num_splits. Lengths are device data
and are never read here (the kernels clamp them to [0, capacity]).

Softmax scale: the logits are ``sm_scale * q.k`` with ``sm_scale`` absolute (FlashInfer's and
FlashMLA's convention, default ``1/sqrt(D)``); the seed's ``q_scale`` multiplies that default, so
``q_scale = sm_scale * sqrt(D)``. A call gives at most one of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ops import contract as _oc
from ..runtime.tensors import TensorView, as_view

__all__ = [
    "GqaProblem",
    "MAX_GROUP",
    "MAX_SPLITS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "check_contiguous_kv",
    "check_num_splits",
    "check_q_scale",
    "check_scale_pair",
    "check_sm_scale",
    "validate",
]

SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
MAX_SPLITS = 64       # GQA_MAX_SPLITS of kernels/gqa/common/config.cuh
STATE_ROW_PAD = 8     # extra floats per softmax-state row in the CTA merge area (StateLayout<D>::STRIDE = D + 8)


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
    q_scale: float        # sm_scale * sqrt(D) (the seed's relative scale)
    sm_scale: float       # the absolute softmax scale the kernels apply: softmax(sm_scale * q.k)

    @property
    def framework(self) -> str:
        return self.q.framework

    def geometry(self) -> tuple:
        return (self.batch, self.num_q_heads, self.num_kv_heads, self.capacity, self.head_dim, self.dtype)


def check_q_scale(q_scale: Any, head_dim: int = 64) -> float:
    """q_scale must be a real number, finite and > 0 (numpy / 0-d framework scalars are accepted),
    small enough that q_scale / sqrt(head_dim) / ln 2 is a finite float32."""
    return _oc.check_positive_scale("q_scale", q_scale, limit=_oc.F32_MAX * math.sqrt(head_dim) * math.log(2.0))


def check_sm_scale(sm_scale: Any) -> float:
    """sm_scale (absolute) must be a real number, finite and > 0, small enough that sm_scale / ln 2
    is a finite float32."""
    return _oc.check_positive_scale("sm_scale", sm_scale, limit=_oc.F32_MAX * math.log(2.0))


def _is_default_q_scale(q_scale: Any) -> bool:
    if q_scale is None:
        return True
    if isinstance(q_scale, (bool, str, bytes)):
        return False
    try:
        return float(q_scale) == 1.0
    except (TypeError, ValueError, OverflowError):
        return False


def check_scale_pair(q_scale: Any, sm_scale: Any) -> None:
    """At most one scale: ``sm_scale`` (absolute) together with a ``q_scale`` other than None / 1.0
    is a ValueError (the two would contradict each other)."""
    if sm_scale is not None and not _is_default_q_scale(q_scale):
        raise ValueError(f"give either q_scale (relative: softmax(q_scale / sqrt(D) * q.k)) or sm_scale (absolute: "
                         f"softmax(sm_scale * q.k)), not both; got q_scale={q_scale!r}, sm_scale={sm_scale!r} "
                         "(q_scale = sm_scale * sqrt(D))")


def check_num_splits(num_splits: Any) -> int | None:
    return _oc.check_num_splits(num_splits, MAX_SPLITS)


_shape = _oc.shape_str
_require_contiguous = _oc.require_contiguous
_INT32_POSITIONS = 2**31 - 1 - 64  # largest capacity the kernels' int32 token positions allow


def check_contiguous_kv(kv: Any, name: str, qv: TensorView, B: int, D: int, stream: int | None,
                        check_dtype: bool = True) -> TensorView:
    """The contiguous cache [B, 2, Hkv, C, D] of ``gqa_decode`` (shared with the paged family's
    ``contiguous_problem``): shape against q's batch and head dim, dtype of q (unless
    ``check_dtype`` is False: the caller checks it, e.g. for e4m3 caches), contiguity, device."""
    kvv = as_view(kv, name, stream=stream, cupy_ordered=True)
    if kvv.ndim != 5:
        raise ValueError(f"{name} must have shape [batch, 2, num_kv_heads, capacity, head_dim], got {_shape(kvv)}")
    if kvv.shape[0] != B:
        raise ValueError(f"{name} batch {kvv.shape[0]} does not match {qv.name} batch {B}")
    if kvv.shape[1] != 2:
        raise ValueError(f"{name} dim 1 must be 2 (K at index 0, V at index 1), got {_shape(kvv)}")
    Hkv, C, Dkv = kvv.shape[2], kvv.shape[3], kvv.shape[4]
    if Hkv <= 0:
        raise ValueError(f"num_kv_heads must be positive, got {name} shape {_shape(kvv)}")
    if C <= 0:
        raise ValueError(f"kv capacity must be positive, got {name} shape {_shape(kvv)}")
    if C > _INT32_POSITIONS:
        raise ValueError(f"kv capacity {C} is more than the kernels' int32 token positions allow")
    if Dkv != D:
        raise ValueError(f"{name} head_dim {Dkv} does not match {qv.name} head_dim {D}")
    if check_dtype:
        _oc.require_dtype(kvv, SUPPORTED_DTYPES, like=qv)
    _oc.require_contiguous(kvv)
    _oc.require_same_device(kvv, qv)
    return kvv
_require_same_device = _oc.require_same_device
_require_aligned = _oc.require_aligned


def validate(q: Any, kv: Any, lengths: Any, out: Any, q_scale: Any, *, stream: int | None,
             names=("q", "kv", "sequence_lengths", "out"), sm_scale: Any = None) -> GqaProblem:
    """Check every host-visible rule and return the problem description.

    ``sm_scale`` (absolute) replaces ``q_scale`` when given; giving both (q_scale not None / 1.0) is
    a ValueError (``check_scale_pair``).

    ``stream``: the launch stream, handed to non-CuPy producers' ``__dlpack__`` so they order their
    writes before it (None: no handshake, e.g. during graph capture); CuPy producers must already be
    ordered by the caller (``runtime.streams.order_inputs``)."""
    nq, nkv, nlen, nout = names
    qv = as_view(q, nq, stream=stream, cupy_ordered=True)
    if qv.ndim != 3:
        raise ValueError(f"{nq} must have shape [batch, num_q_heads, head_dim], got {_shape(qv)}")
    B, Hq, D = qv.shape
    if B <= 0:
        raise ValueError(f"batch must be positive, got {nq} shape {_shape(qv)}")
    if Hq <= 0:
        raise ValueError(f"num_q_heads must be positive, got {nq} shape {_shape(qv)}")
    _oc.require_dtype(qv, SUPPORTED_DTYPES)
    _require_contiguous(qv)

    kvv = check_contiguous_kv(kv, nkv, qv, B, D, stream)
    Hkv, C = kvv.shape[2], kvv.shape[3]
    if Hq % Hkv:
        raise ValueError(f"num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    group = Hq // Hkv
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group size num_q_heads/num_kv_heads = {group} is not supported; supported: 1..{MAX_GROUP}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")

    lv = as_view(lengths, nlen, stream=stream, cupy_ordered=True)
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
        ov = as_view(out, nout, stream=stream, cupy_ordered=True)
        if ov.shape != qv.shape:
            raise ValueError(f"{nout} must have the shape of {nq} {_shape(qv)}, got {_shape(ov)}")
        _oc.require_dtype(ov, SUPPORTED_DTYPES, like=qv)
        _require_contiguous(ov)
        _require_same_device(ov, qv)
        _require_aligned(ov)
        _oc.require_writable(ov)
        _oc.require_no_overlap(ov, (qv, kvv, lv))
        _oc.require_no_grad(ov)
    for v in (qv, kvv):
        _oc.require_no_grad(v)
    check_scale_pair(q_scale, sm_scale)
    if sm_scale is not None:
        sm = check_sm_scale(sm_scale)
        scale = sm * math.sqrt(D)
    else:
        scale = check_q_scale(q_scale, D)
        sm = scale / math.sqrt(D)
    return GqaProblem(B, Hq, Hkv, group, C, D, qv.dtype, qv.device, qv, kvv, lv, ov, scale, sm)
