"""The MLA dense decode contract (FlashMLA's ``flash_mla_with_kvcache`` dense path), checked before
any launch.

q [b, s_q, h_q, 576] fp16/bf16; k_cache [num_blocks, page_size, h_kv, 576] of q's dtype, V = the
first 512 channels of K (or, with ``is_fp8_kvcache=True`` and a bf16 q, FlashMLA's V3.2 FP8 cache
[num_blocks, page_size, h_kv, 656] of uint8 / int8 / float8_e4m3fn bytes, 16-byte aligned rows); block_table int32 [b, max_blocks]; cache_seqlens int32 [b] (device data,
never read here). Every tensor needs a contiguous last dimension; other strides are free as long as
rows stay 16-byte aligned (strides multiple of 8 elements). Errors: TypeError for dtypes,
ValueError for shapes, devices, strides, alignment, scales; FeatureError (NotImplementedError)
for the sparse path's arguments.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..ops import contract as _oc
from ..runtime.tensors import TensorView, as_view
from . import kernel_spec as _ks
from .fp8_cache import FP8_DTYPES as FP8_CACHE_DTYPES
from .fp8_reference import BYTES_PER_TOKEN as FP8_ROW_BYTES

__all__ = ["D_QK", "D_V", "FP8_CACHE_DTYPES", "FP8_ROW_BYTES", "MAX_HEADS_KV", "MAX_HEADS_Q", "MlaProblem", "SUPPORTED_DTYPES", "validate"]

SUPPORTED_DTYPES = ("float16", "bfloat16")
D_QK, D_V = _ks.D_QK, _ks.D_V
MAX_HEADS_Q = 128
MAX_HEADS_KV = 8
MAX_BATCH = 65535  # grid.z


@dataclasses.dataclass(frozen=True)
class MlaProblem:
    b: int
    s_q: int
    h_q: int
    h_kv: int
    group: int
    page_size: int
    num_blocks: int
    max_blocks: int
    dtype: str
    device: int
    q: TensorView
    k_cache: TensorView
    block_table: TensorView
    seqlens: TensorView
    softmax_scale: float
    causal: bool
    kv_fp8: bool = False  # k_cache in FlashMLA's 656-byte FP8 format (is_fp8_kvcache=True)
    nope: bool = False    # d_qk 512: q / K rows of 512 channels, no RoPE (sparse prefill only)
    max_offset: int | None = None  # write max_logits at lse + max_offset (sparse prefill only)
    no_cut: bool = False  # balanced grids keep every request on one CTA (FLAG_NO_CUT: the sparse paths' lists)
    kv_reuse: bool = False  # K rows read by many requests: kept in L2 (FLAG_KV_REUSE: the sparse prefill)
    sink_ptr: int = 0  # fp32 [h_q] attention sink folded into the epilogue (FLAG_SINK; sparse paths, routes.sink_epilogue)

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.page_size

    @property
    def m_rows(self) -> int:
        return self.s_q * self.group


def _rows_16b(v: TensorView) -> None:
    """Every row of 576 channels starts on a 16-byte boundary (the kernels copy 16-byte chunks)."""
    _oc.require_inner_contiguous(v)
    _oc.require_aligned(v)
    bad = [s for s, n in zip(v.strides[:-1], v.shape[:-1]) if n > 1 and s % 8]
    if bad:
        raise ValueError(f"{v.name} strides {v.strides} (elements) must be multiples of 8 (16-byte aligned rows)")


def _fp8_cache(kv: TensorView, qv: TensorView) -> tuple[int, int, int]:
    """The 656-byte FP8 cache [num_blocks, page_size, h_kv, 656] (uint8 / int8 / float8_e4m3fn bytes):
    (num_blocks, page, h_kv). Rows are read with 16-byte loads: base and strides multiples of 16 bytes."""
    if qv.dtype != "bfloat16":
        raise TypeError(f"is_fp8_kvcache=True needs a bfloat16 q (the cache dequantizes to bf16), got {qv.dtype}")
    if kv.ndim != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, page_size, h_kv, {FP8_ROW_BYTES}] with "
                         f"is_fp8_kvcache=True, got {_oc.shape_str(kv)}")
    nblk, page, h_kv, row = kv.shape
    if kv.dtype not in FP8_CACHE_DTYPES:
        raise TypeError(f"k_cache must have dtype {' or '.join(FP8_CACHE_DTYPES)} with is_fp8_kvcache=True (the "
                        f"{FP8_ROW_BYTES} bytes of each token), got {kv.dtype}")
    if row != FP8_ROW_BYTES:
        raise ValueError(f"k_cache rows must hold {FP8_ROW_BYTES} bytes with is_fp8_kvcache=True (512 e4m3 codes, "
                         f"4 float32 scales, 64 bf16 RoPE channels), got shape {_oc.shape_str(kv)}")
    _oc.require_inner_contiguous(kv)
    _oc.require_aligned(kv)
    bad = [st for st, n in zip(kv.strides[:-1], kv.shape[:-1]) if n > 1 and (st * kv.itemsize) % 16]
    if bad:
        raise ValueError(f"k_cache strides {kv.strides} (bytes) must be multiples of 16 with is_fp8_kvcache=True "
                         "(16-byte aligned rows)")
    return nblk, page, h_kv


def validate(q: Any, k_cache: Any, block_table: Any, cache_seqlens: Any, head_dim_v: Any, softmax_scale: Any,
             causal: Any, *, stream: int | None, is_fp8_kvcache: Any = False) -> MlaProblem:
    """Check every host-visible rule; ``stream`` as in ``gqa.contract.validate``. ``is_fp8_kvcache``:
    k_cache is FlashMLA's 656-byte FP8 format (bf16 q only)."""
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache must be a bool, got {type(is_fp8_kvcache).__name__}")
    if head_dim_v != D_V:
        raise ValueError(f"head_dim_v must be {D_V} (V = the first {D_V} of the {D_QK} K channels), got {head_dim_v!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    qv = as_view(q, "q", stream=stream, cupy_ordered=True)
    if qv.ndim != 4:
        raise ValueError(f"q must have shape [batch, s_q, h_q, {D_QK}], got {_oc.shape_str(qv)}")
    b, s_q, h_q, d = qv.shape
    _oc.require_dtype(qv, SUPPORTED_DTYPES)
    if d != D_QK:
        raise ValueError(f"q head dim must be {D_QK} (512 latent + 64 RoPE channels), got {d}")
    if not 1 <= b <= MAX_BATCH:
        raise ValueError(f"batch must be in [1, {MAX_BATCH}], got q shape {_oc.shape_str(qv)}")
    if s_q < 1:
        raise ValueError(f"s_q must be positive, got q shape {_oc.shape_str(qv)}")
    if not 1 <= h_q <= MAX_HEADS_Q:
        raise ValueError(f"h_q must be in [1, {MAX_HEADS_Q}], got {h_q}")
    _rows_16b(qv)

    kv = as_view(k_cache, "k_cache", stream=stream, cupy_ordered=True)
    if is_fp8_kvcache:
        nblk, page, h_kv = _fp8_cache(kv, qv)
    else:
        if kv.ndim != 4:
            raise ValueError(f"k_cache must have shape [num_blocks, page_size, h_kv, {D_QK}], got {_oc.shape_str(kv)}")
        nblk, page, h_kv, dk = kv.shape
        if kv.dtype in FP8_CACHE_DTYPES and dk == FP8_ROW_BYTES:
            raise TypeError(f"k_cache looks like FlashMLA's FP8 cache ({kv.dtype}, {FP8_ROW_BYTES} bytes per token): "
                            "pass is_fp8_kvcache=True")
        _oc.require_dtype(kv, SUPPORTED_DTYPES, like=qv)
        if dk != D_QK:
            raise ValueError(f"k_cache head dim must be {D_QK}, got {dk}")
    if nblk < 1:
        raise ValueError(f"k_cache must hold at least one page, got shape {_oc.shape_str(kv)}")
    if page not in _ks.PAGE_SIZES:
        raise ValueError(f"page_size (k_cache dim 1) must be a power of two in [1, 256], got {page}")
    if not 1 <= h_kv <= MAX_HEADS_KV:
        raise ValueError(f"h_kv (k_cache dim 2) must be in [1, {MAX_HEADS_KV}], got {h_kv}")
    if h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")
    _oc.require_same_device(kv, qv)
    if not is_fp8_kvcache:
        _rows_16b(kv)

    bt = as_view(block_table, "block_table", stream=stream, cupy_ordered=True)
    if bt.dtype != "int32":
        raise TypeError(f"block_table must have dtype int32, got {bt.dtype}")
    if bt.ndim != 2 or bt.shape[0] != b or bt.shape[1] < 1:
        raise ValueError(f"block_table must have shape [{b}, max_blocks >= 1], got {_oc.shape_str(bt)}")
    _oc.require_inner_contiguous(bt)
    _oc.require_same_device(bt, qv)
    _oc.require_aligned(bt, 4)
    max_blocks = bt.shape[1]
    if max_blocks * page > 2**31 - 1:
        raise ValueError(f"max_blocks * page_size = {max_blocks * page} exceeds the int32 token range")

    lv = as_view(cache_seqlens, "cache_seqlens", stream=stream, cupy_ordered=True)
    if lv.dtype != "int32":
        raise TypeError(f"cache_seqlens must have dtype int32, got {lv.dtype}")
    if lv.shape != (b,):
        raise ValueError(f"cache_seqlens must have shape ({b},), got {_oc.shape_str(lv)}")
    _oc.require_contiguous(lv)
    _oc.require_same_device(lv, qv)
    _oc.require_aligned(lv, 4)
    for v in (qv, kv):
        _oc.require_no_grad(v)
    if softmax_scale is None:
        scale = D_QK ** -0.5
    else:
        scale = _oc.check_positive_scale("softmax_scale", softmax_scale, limit=_oc.F32_MAX / math.log2(math.e))
    return MlaProblem(b, s_q, h_q, h_kv, h_q // h_kv, page, nblk, max_blocks, qv.dtype, qv.device, qv, kv, bt, lv,
                      scale, causal, is_fp8_kvcache)


def validate_outputs(problem: MlaProblem, out: Any, lse: Any, *, stream: int | None) -> tuple:
    """Caller-given out [b, s_q, h_q, 512] (q's dtype, last dim contiguous, 16-byte rows) and lse
    fp32 [b, h_q, s_q] (contiguous); either may be None (allocated)."""
    ins = (problem.q, problem.k_cache, problem.block_table, problem.seqlens)
    return check_outputs(out, lse, problem.b, problem.s_q, problem.h_q, problem.q, ins, stream=stream)


def check_outputs(out: Any, lse: Any, b: int, s_q: int, h_q: int, q: TensorView, ins: tuple, *, stream: int | None,
                  merged_rows: bool = False) -> tuple:
    """(out view, lse view) of caller-given MLA outputs (None where not given): out [b, s_q, h_q, 512]
    of q's dtype with 16-byte rows (``merged_rows``: request stride = s_q x token stride, the sparse
    path's one-row-per-query-token layout), lse fp32 [b, h_q, s_q] contiguous; on q's device,
    writable, overlapping no input."""
    ov = lv = None
    if out is not None:
        ov = as_view(out, "out", stream=stream, cupy_ordered=True)
        want = (b, s_q, h_q, D_V)
        if ov.shape != want:
            raise ValueError(f"out must have shape {list(want)}, got {_oc.shape_str(ov)}")
        _oc.require_dtype(ov, SUPPORTED_DTYPES, like=q)
        _oc.require_same_device(ov, q)
        _rows_16b(ov)
        if merged_rows and s_q > 1 and b > 1 and ov.strides[0] != s_q * ov.strides[1]:
            raise ValueError(f"out strides {ov.strides} (elements): on the sparse path stride(0) must be s_q * stride(1) "
                             "(each query token is one row of the dense decode)")
        _oc.require_writable(ov)
        _oc.require_no_overlap(ov, ins)
        _oc.require_no_grad(ov)
    if lse is not None:
        lv = as_view(lse, "lse", stream=stream, cupy_ordered=True)
        want = (b, h_q, s_q)
        if lv.shape != want:
            raise ValueError(f"lse must have shape {list(want)}, got {_oc.shape_str(lv)}")
        if lv.dtype != "float32":
            raise TypeError(f"lse must have dtype float32, got {lv.dtype}")
        _oc.require_contiguous(lv)
        _oc.require_same_device(lv, q)
        _oc.require_writable(lv)
        _oc.require_no_overlap(lv, ins + ((ov,) if ov is not None else ()))
    return ov, lv
