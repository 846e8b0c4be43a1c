"""The contract of the paged / multi-token GQA decode (``gqa_decode_paged`` and the extended
``gqa_decode``): shapes, dtypes, strides and scalar rules, checked before any launch.

Caches (``kv_layout``):
    NHD  k_cache, v_cache [num_pages, page_size, Hkv, D]     combined (v_cache None) [num_pages, 2, page_size, Hkv, D]
    HND  k_cache, v_cache [num_pages, Hkv, page_size, D]     combined (v_cache None) [num_pages, 2, Hkv, page_size, D]
The page dimension may have any stride (a slice of a larger pool); every stride must be a multiple
of 8 elements (16 bytes) and D contiguous. block_table int32 [B, max_pages] (stride(1) == 1, any
row stride), seq_lens int32 [B]; both are read on the device only. The contiguous cache of
``gqa_decode`` [B, 2, Hkv, C, D] is the same problem with one page of C tokens per request and no
table (``contiguous_problem``).

Queries: q [B, Hq, D] (one token) or [B, s_q, Hq, D] with s_q in 1..16; query token j sees keys
[0, L - (s_q - 1 - j)) (bottom-right causal). lse: fp32 [B, Hq] / [B, s_q, Hq].

Cache element type: q's dtype, or float8 e4m3fn codes with their K / V scales (gqa/kv_dtype.py);
strides are multiples of 16 bytes either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ops import contract as _oc
from ..runtime.tensors import TensorView, as_view
from .contract import (MAX_GROUP, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, check_contiguous_kv, check_q_scale,
                       check_scale_pair, check_sm_scale)
from .kv_dtype import KvScales, check_kv_dtype, check_kv_scales

__all__ = ["KV_LAYOUTS", "MAX_PAGE_SIZE", "MAX_S_Q", "PagedProblem", "contiguous_problem", "validate_paged"]

KV_LAYOUTS = ("NHD", "HND")
MAX_S_Q = 16
MAX_PAGE_SIZE = 65536
_INT32_MAX = 2**31 - 1
_shape = _oc.shape_str


@dataclasses.dataclass(frozen=True)
class PagedProblem:
    batch: int
    s_q: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: str
    device: int
    page_size: int          # C for a contiguous cache
    num_pages: int          # B for a contiguous cache
    max_pages: int          # 1 for a contiguous cache
    capacity: int
    layout: str             # "NHD", "HND" or "contiguous"
    q: TensorView
    k: TensorView           # the K (or combined) cache
    v: TensorView | None    # the V cache (None: combined / contiguous)
    table: TensorView | None
    lengths: TensorView
    out: TensorView | None
    lse: TensorView | None
    k_ptr: int
    v_ptr: int
    page_stride: int        # elements
    tok_stride: int
    head_stride: int
    table_stride: int
    q_4d: bool              # q was given as [B, s_q, Hq, D]
    q_scale: float
    sm_scale: float
    kv8: bool = False       # the caches hold e4m3 codes (gqa/kv_dtype.py)
    scales: KvScales = KvScales()

    @property
    def rows(self) -> int:
        return self.s_q * self.group

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.s_q, self.num_q_heads) if self.q_4d else (self.batch, self.num_q_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.k.itemsize


def _check_q(q: Any, name: str, stream: int | None) -> tuple[TensorView, int, int, int, int, bool]:
    qv = as_view(q, name, stream=stream, cupy_ordered=True)
    if qv.ndim == 3:
        B, Hq, D = qv.shape
        s_q, q4 = 1, False
    elif qv.ndim == 4:
        B, s_q, Hq, D = qv.shape
        q4 = True
    else:
        raise ValueError(f"{name} must have shape [batch, num_q_heads, head_dim] or [batch, s_q, num_q_heads, "
                         f"head_dim], got {_shape(qv)}")
    if B <= 0 or Hq <= 0:
        raise ValueError(f"batch and num_q_heads must be positive, got {name} shape {_shape(qv)}")
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"s_q (query tokens per request) must be in 1..{MAX_S_Q}, got {name} shape {_shape(qv)}")
    _oc.require_dtype(qv, SUPPORTED_DTYPES)
    _oc.require_contiguous(qv)
    _oc.require_aligned(qv)
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    return qv, B, s_q, Hq, D, q4


def _check_group(Hq: int, Hkv: int) -> int:
    if Hkv <= 0:
        raise ValueError(f"num_kv_heads must be positive, got {Hkv}")
    if Hq % Hkv:
        raise ValueError(f"num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    group = Hq // Hkv
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group size num_q_heads/num_kv_heads = {group} is not supported; supported: 1..{MAX_GROUP}")
    return group


def _check_strides16(v: TensorView, dims: tuple[int, ...]) -> None:
    n = max(1, 16 // v.itemsize)  # elements per 16 bytes
    bad = [v.strides[d] for d in dims if v.shape[d] > 1 and v.strides[d] % n]
    if bad or v.strides[-1] != 1:
        raise ValueError(f"{v.name} must have a contiguous head dimension and strides that are multiples of {n} "
                         f"elements (16 bytes); got strides {v.strides} (elements) for shape {_shape(v)}")
    if any(v.strides[d] < 0 for d in dims):
        raise ValueError(f"{v.name} must not have negative strides, got {v.strides}")


def _outputs(out: Any, lse: Any, names: tuple[str, str], qv: TensorView, lse_shape: tuple[int, ...],
             inputs: tuple, stream: int | None) -> tuple[TensorView | None, TensorView | None]:
    nout, nlse = names
    ov = lv = None
    if out is not None:
        ov = as_view(out, nout, stream=stream, cupy_ordered=True)
        _oc.require_output(ov, qv, inputs, shape=qv.shape, align=16, hint=f" ({qv.name}'s shape)")
    if lse is not None:
        lv = as_view(lse, nlse, stream=stream, cupy_ordered=True)
        _oc.require_output(lv, qv, inputs + ((ov,) if ov is not None else ()), shape=lse_shape, align=4,
                           dtype="float32", hint=" ([batch, s_q, num_q_heads] for 4-D q, [batch, num_q_heads] for 3-D q)")
    return ov, lv


def _scales(q_scale: Any, sm_scale: Any, D: int) -> tuple[float, float]:
    check_scale_pair(q_scale, sm_scale)
    if sm_scale is not None:
        sm = check_sm_scale(sm_scale)
        return sm * math.sqrt(D), sm
    scale = check_q_scale(1.0 if q_scale is None else q_scale, D)
    return scale, scale / math.sqrt(D)


def _check_lengths(lengths: Any, name: str, B: int, qv: TensorView, stream: int | None) -> TensorView:
    lv = as_view(lengths, name, stream=stream, cupy_ordered=True)
    if lv.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {lv.dtype}")
    if lv.shape != (B,):
        raise ValueError(f"{name} must have shape ({B},) (one length per request), got {_shape(lv)}")
    _oc.require_contiguous(lv)
    _oc.require_same_device(lv, qv)
    _oc.require_aligned(lv, 4)
    return lv


def validate_paged(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any, kv_layout: Any, out: Any,
                   lse: Any, q_scale: Any, sm_scale: Any, *, stream: int | None,
                   names=("q", "k_cache", "v_cache", "block_table", "seq_lens", "out", "lse"),
                   kv_dtype: Any = None, k_scale: Any = None, v_scale: Any = None) -> PagedProblem:
    """Check every host-visible rule of a paged decode and return the problem description."""
    nq, nk, nv, nt, nl, nout, nlse = names
    if not isinstance(kv_layout, str) or kv_layout.upper() not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' ([pages, page_size, Hkv, D]) or 'HND' ([pages, Hkv, page_size, "
                         f"D]), got {kv_layout!r}")
    layout = kv_layout.upper()
    qv, B, s_q, Hq, D, q4 = _check_q(q, nq, stream)

    kv = as_view(k_cache, nk, stream=stream, cupy_ordered=True)
    combined = v_cache is None
    want = 5 if combined else 4
    form = {("NHD", 4): "[num_pages, page_size, num_kv_heads, head_dim]",
            ("HND", 4): "[num_pages, num_kv_heads, page_size, head_dim]",
            ("NHD", 5): "[num_pages, 2, page_size, num_kv_heads, head_dim]",
            ("HND", 5): "[num_pages, 2, num_kv_heads, page_size, head_dim]"}[(layout, want)]
    if kv.ndim != want:
        hint = " (v_cache=None means one combined K/V tensor)" if combined else ""
        raise ValueError(f"{nk} must have shape {form} for kv_layout={layout!r}{hint}, got {_shape(kv)}")
    if combined and kv.shape[1] != 2:
        raise ValueError(f"{nk} dim 1 must be 2 (K at index 0, V at index 1) for a combined cache, got {_shape(kv)}")
    inner = kv.shape[-3:]
    if layout == "NHD":
        page, Hkv, Dk = inner
    else:
        Hkv, page, Dk = inner
    P = kv.shape[0]
    if P <= 0:
        raise ValueError(f"{nk} must hold at least one page, got {_shape(kv)}")
    if Dk != D:
        raise ValueError(f"{nk} head_dim {Dk} does not match {nq} head_dim {D}")
    if page < 1 or page > MAX_PAGE_SIZE or page & (page - 1):
        raise ValueError(f"page_size must be a power of two in 1..{MAX_PAGE_SIZE} (e.g. 1, 16, 64, 256), got {page} "
                         f"({nk} shape {_shape(kv)})")
    kv8 = check_kv_dtype(kv, qv, kv_dtype)
    _oc.require_same_device(kv, qv)
    _oc.require_aligned(kv)
    nd = kv.ndim
    _check_strides16(kv, tuple(range(nd - 1)))
    group = _check_group(Hq, Hkv)
    st = kv.strides
    page_stride = st[0]
    if layout == "NHD":
        tok_stride, head_stride = st[nd - 3], st[nd - 2]
    else:
        head_stride, tok_stride = st[nd - 3], st[nd - 2]
    k_ptr = kv.ptr
    vv = None
    if combined:
        v_ptr = kv.ptr + st[1] * kv.itemsize
    else:
        vv = as_view(v_cache, nv, stream=stream, cupy_ordered=True)
        if vv.shape != kv.shape:
            raise ValueError(f"{nv} must have the shape of {nk} {_shape(kv)}, got {_shape(vv)}")
        if vv.strides != kv.strides:
            raise ValueError(f"{nv} must have the strides of {nk} {kv.strides}, got {vv.strides} (elements)")
        if vv.dtype != kv.dtype:
            raise TypeError(f"{nv} must have the dtype of {nk} ({kv.dtype}), got {vv.dtype}")
        _oc.require_same_device(vv, qv)
        _oc.require_aligned(vv)
        v_ptr = vv.ptr

    tv = as_view(block_table, nt, stream=stream, cupy_ordered=True)
    if tv.dtype != "int32":
        raise TypeError(f"{nt} must have dtype int32 (page ids), got {tv.dtype}")
    if tv.ndim != 2 or tv.shape[0] != B or tv.shape[1] < 1:
        raise ValueError(f"{nt} must have shape [batch={B}, max_pages >= 1], got {_shape(tv)}")
    max_pages = tv.shape[1]
    if max_pages > 1 and tv.strides[1] != 1:
        raise ValueError(f"{nt} must be contiguous along its last dimension (stride 1), got strides {tv.strides}")
    table_stride = tv.strides[0] if B > 1 else max_pages
    if table_stride < 0 or table_stride > _INT32_MAX:
        raise ValueError(f"{nt} row stride must be in [0, 2**31), got {tv.strides}")
    _oc.require_same_device(tv, qv)
    _oc.require_aligned(tv, 4)
    capacity = max_pages * page
    if capacity > _INT32_MAX - 64:
        raise ValueError(f"max_pages x page_size = {capacity} tokens is more than the kernels' int32 positions allow")
    if P > _INT32_MAX:
        raise ValueError(f"{nk} has {P} pages; at most 2**31 - 1 are addressable")

    lv = _check_lengths(seq_lens, nl, B, qv, stream)
    inputs = tuple(x for x in (qv, kv, vv, tv, lv) if x is not None)
    ov, lsev = _outputs(out, lse, (nout, nlse), qv, (B, s_q, Hq) if q4 else (B, Hq), inputs, stream)
    for x in (qv, kv, vv):
        if x is not None:
            _oc.require_no_grad(x)
    scale, sm = _scales(q_scale, sm_scale, D)
    scales = check_kv_scales(k_scale, v_scale, kv8, Hkv, qv, stream)
    return PagedProblem(B, s_q, Hq, Hkv, group, D, qv.dtype, qv.device, page, P, max_pages, capacity, layout,
                        qv, kv, vv, tv, lv, ov, lsev, k_ptr, v_ptr, page_stride, tok_stride, head_stride, table_stride,
                        q4, scale, sm, kv8, scales)


def contiguous_problem(q: Any, kv: Any, lengths: Any, out: Any, lse: Any, q_scale: Any, sm_scale: Any, *,
                       stream: int | None, names=("q", "kv", "sequence_lengths", "out", "lse"),
                       kv_dtype: Any = None, k_scale: Any = None, v_scale: Any = None) -> PagedProblem:
    """The contiguous cache kv [B, 2, Hkv, C, D] of gqa_decode as a paged problem: request b is page
    b of C tokens (HND, no table)."""
    nq, nkv, nl, nout, nlse = names
    qv, B, s_q, Hq, D, q4 = _check_q(q, nq, stream)
    kvv = check_contiguous_kv(kv, nkv, qv, B, D, stream, check_dtype=False)
    kv8 = check_kv_dtype(kvv, qv, kv_dtype)
    Hkv, C = kvv.shape[2], kvv.shape[3]
    _oc.require_aligned(kvv)
    group = _check_group(Hq, Hkv)
    lv = _check_lengths(lengths, nl, B, qv, stream)
    ov, lsev = _outputs(out, lse, (nout, nlse), qv, (B, s_q, Hq) if q4 else (B, Hq), (qv, kvv, lv), stream)
    for x in (qv, kvv):
        _oc.require_no_grad(x)
    scale, sm = _scales(q_scale, sm_scale, D)
    scales = check_kv_scales(k_scale, v_scale, kv8, Hkv, qv, stream)
    plane = C * D
    return PagedProblem(B, s_q, Hq, Hkv, group, D, qv.dtype, qv.device, C, B, 1, C, "contiguous",
                        qv, kvv, None, None, lv, ov, lsev, kvv.ptr, kvv.ptr + Hkv * plane * kvv.itemsize,
                        2 * Hkv * plane, D, plane, 0, q4, scale, sm, kv8, scales)
