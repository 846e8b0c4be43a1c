"""DeepSeek sparse MLA decode: FlashMLA's ``flash_mla_with_kvcache`` with ``indices`` (top-k keys per
query token, an FP8 or a BF16 cache, attention sinks, ``topk_length``, a second KV pool), torch-free.

How it runs (three launches chained with programmatic dependent launch, one prepared object):

1. ``mla_sparse_gather`` (kernels/mla/smxx/sparse_gather.cu) lists, for every (request, query token)
   row, the valid slots it names, in order (main pool, then extra pool), as 16-byte offsets from the
   main pool's base, and their count. An index is valid when it is in [0, num_blocks * page_size) of
   its pool and its position is below ``topk_length`` (clamped to [0, topk]); every other value is
   skipped, never used as an address.
2. The dense MLA decode kernel the router picks (``seesaw_fp8`` / ``seesaw`` on the H200, ``mma_fp8``
   / ``mma`` on sm_100 / sm_110) attends over those lists exactly as over a paged cache with one
   token per page: one "request" per (request, query token) row with s_q = 1 and h_q query rows,
   block_table = the lists, cache_seqlens = the counts. Softmax attention does not depend on the
   order of its keys, so this is the sparse attention, with every dense feature (splits merged in
   the kernel, LSE, any h_q in 1..128 without padding the rows to 64).
3. ``mla_sparse_finish`` (only when needed) writes the LSE in FlashMLA's [b, h_q, s_q] layout when
   s_q > 1 and scales the output rows by the attention-sink factor ``1 / (1 + exp(sink - lse))``.

This module holds the argument struct (mirror of ``MlaSparseArgs``), the two kernel families, the
contract of the sparse arguments and the plan; ``gqadrv/mla/api.py`` exposes it through
``flash_mla_with_kvcache`` / ``prepare_mla_decode``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

from ..ops import contract as _oc
from ..ops.kernels import Loaded, load
from ..ops.registry import ElementwiseGeometry, KernelFamily, OpRecord
from ..runtime import driver as _drv
from ..runtime.module import NamedStruct, Signature
from ..runtime.tensors import TensorView, as_view
from . import contract as _contract
from . import kernel_spec as _ks

__all__ = ["SPARSE_ARGS", "SparseProblem", "validate_sparse"]

# ----------------------------------------------------------------------------- argument struct
FLAG_PACK_Q, FLAG_WRITE_LSE, FLAG_SINK, FLAG_OUT_BF16 = 1, 2, 4, 8
THREADS = 128          # MLA_SPARSE_THREADS
FINISH_WARPS = 4       # MLA_SPARSE_WARPS: (row, head) pairs per finish CTA
OFFSET_RANGE = 2**31   # list entries are int32 offsets in 16-byte units: rows within +-32 GiB of the base
MAX_ROWS = _contract.MAX_BATCH  # b * s_q rows become the dense kernel's grid.z

SPARSE_ARGS = NamedStruct(
    "MlaSparseArgs",
    ("indices", "Q"), ("topk_length", "Q"), ("extra_indices", "Q"), ("extra_topk_length", "Q"),
    ("q", "Q"), ("q_packed", "Q"), ("lists", "Q"), ("counts", "Q"), ("lse_rows", "Q"), ("lse", "Q"),
    ("out", "Q"), ("attn_sink", "Q"), ("cu_seqlens_q", "Q"), ("cu_seqlens_kv", "Q"),
    ("idx_stride_b", "q"), ("idx_stride_s", "q"), ("eidx_stride_b", "q"), ("eidx_stride_s", "q"),
    ("q_stride_b", "q"), ("q_stride_s", "q"), ("q_stride_h", "q"), ("o_stride_r", "q"), ("o_stride_h", "q"),
    ("slots", "q"), ("page_stride16", "q"), ("row_stride16", "q"),
    ("extra_slots", "q"), ("extra_page_stride16", "q"), ("extra_row_stride16", "q"), ("extra_base16", "q"),
    ("page_size", "i"), ("extra_page_size", "i"), ("topk", "i"), ("extra_topk", "i"), ("cap", "i"),
    ("b", "i"), ("s_q", "i"), ("h_q", "i"), ("rows", "i"), ("flags", "i"), ("n_req", "i"), ("d_qk", "i"),
)
SIGNATURE = Signature(("args", SPARSE_ARGS))

# ----------------------------------------------------------------------------- families and variants
SOURCE = "mla/smxx/sparse_gather.cu"
_ARCHES = ("sm_90a", "sm_100a", "sm_110a")   # where the dense MLA kernels the lists feed run
_FEATURES = frozenset({"sparse_indices", "attn_sink", "topk_length", "extra_pool"})
GATHER = KernelFamily("mla_sparse_gather", SOURCE, "mla_sparse_gather", _ARCHES, SIGNATURE, _FEATURES)
FINISH = KernelFamily("mla_sparse_finish", SOURCE, "mla_sparse_finish", _ARCHES, SIGNATURE, _FEATURES)
_OP_CODE = {GATHER.name: 0, FINISH.name: 1}


@dataclasses.dataclass(frozen=True)
class SparseVariant(ElementwiseGeometry):
    THREADS: ClassVar[int] = THREADS
    family: KernelFamily

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def defines(self) -> dict:
        d = {"MLA_SPARSE_OP": _OP_CODE[self.family.name]}
        # development only (timing comparisons): GQADRV_SPARSE_GATHER_GROUP=1 builds the gather with one chunk
        # of 128 positions per load round (the kernel before 2026-12-06), instead of 8
        group = os.environ.get("GQADRV_SPARSE_GATHER_GROUP")
        if group and self.family.name == GATHER.name:
            d["MLA_SPARSE_GATHER_GROUP"] = int(group)
        return d


def variants_for_arch(arch: str) -> list[SparseVariant]:
    return [SparseVariant(GATHER), SparseVariant(FINISH)] if arch in _ARCHES else []


def _loaded(family: KernelFamily, device: int) -> Loaded:
    return load(SparseVariant(family), device)


# ----------------------------------------------------------------------------- contract
@dataclasses.dataclass(frozen=True)
class SparsePool:
    """One KV pool [num_blocks, page, 1, row]: its view, slot count and geometry in 16-byte units
    (``base16`` = its base minus the main pool's base)."""

    view: TensorView
    num_blocks: int
    page: int
    page16: int
    row16: int
    base16: int

    @property
    def slots(self) -> int:
        return self.num_blocks * self.page


@dataclasses.dataclass(frozen=True)
class SparseProblem:
    b: int
    s_q: int
    h_q: int
    topk: int
    extra_topk: int
    dtype: str
    device: int
    kv_fp8: bool
    softmax_scale: float
    q: TensorView
    pool: SparsePool
    extra: SparsePool | None
    indices: TensorView
    topk_length: TensorView | None
    extra_indices: TensorView | None
    extra_topk_length: TensorView | None
    attn_sink: TensorView | None
    d_qk: int = 576                       # 512: q / K rows without RoPE channels (sparse prefill)
    cu_q: TensorView | None = None        # varlen prefill: cu_seqlens_q [n_req + 1]
    cu_kv: TensorView | None = None       # varlen prefill: cu_seqlens_kv [n_req + 1]

    @property
    def n_req(self) -> int:
        return self.cu_q.shape[0] - 1 if self.cu_q is not None else 0

    @property
    def rows(self) -> int:
        return self.b * self.s_q

    @property
    def cap(self) -> int:
        return self.topk + self.extra_topk

    @property
    def q_mergeable(self) -> bool:
        """q's (request, token) pairs are one stride apart: the dense kernel reads q in place."""
        return self.s_q == 1 or self.q.strides[0] == self.s_q * self.q.strides[1]

    def config(self) -> tuple:
        """What a metadata object records (FlashMLA's Config fields of the sparse path)."""
        return ("sparse", self.b, self.s_q, self.h_q, self.pool.page, self.topk,
                self.extra.page if self.extra else None, self.extra_topk, self.dtype, self.device, self.kv_fp8)


def _pool(obj: Any, name: str, q: TensorView, fp8: bool, stream: int | None) -> tuple[TensorView, int, int, int, int]:
    """(view, num_blocks, page, page stride bytes, row stride bytes) of a sparse KV pool."""
    kv = as_view(obj, name, stream=stream, cupy_ordered=True)
    row = _contract.FP8_ROW_BYTES if fp8 else _contract.D_QK
    if not fp8 and kv.dtype in _contract.FP8_CACHE_DTYPES:
        raise TypeError(f"{name} has dtype {kv.dtype}: an FP8 cache needs is_fp8_kvcache=True")
    if kv.ndim != 4 or kv.shape[2] != 1 or kv.shape[3] != row:
        what = "uint8 / int8 / float8_e4m3fn FP8 rows" if fp8 else f"{q.dtype} rows"
        raise ValueError(f"{name} must have shape [num_blocks, page_size, 1, {row}] ({what}; h_kv must be 1 on the "
                         f"sparse path), got {_oc.shape_str(kv)}")
    if fp8:
        if kv.dtype not in _contract.FP8_CACHE_DTYPES:
            raise TypeError(f"{name} must have dtype {' or '.join(_contract.FP8_CACHE_DTYPES)} with "
                            f"is_fp8_kvcache=True, got {kv.dtype}")
    else:
        _oc.require_dtype(kv, _contract.SUPPORTED_DTYPES, like=q)
    nb, page = int(kv.shape[0]), int(kv.shape[1])
    if nb < 1 or page < 1:
        raise ValueError(f"{name} must hold at least one token, got shape {_oc.shape_str(kv)}")
    if nb * page > 2**31 - 1:
        raise ValueError(f"{name} holds {nb * page} slots; indices are int32, so at most {2**31 - 1}")
    _oc.require_inner_contiguous(kv)
    _oc.require_aligned(kv)
    _oc.require_same_device(kv, q)
    _oc.require_no_grad(kv)
    page_b = kv.strides[0] * kv.itemsize if nb > 1 else 0
    row_b = kv.strides[1] * kv.itemsize if page > 1 else 0
    if page_b % 16 or row_b % 16:
        raise ValueError(f"{name} strides {kv.strides} (elements) must be multiples of 16 bytes (rows are read with "
                         "16-byte copies)")
    return kv, nb, page, page_b, row_b


def _index_view(obj: Any, name: str, b: int, s_q: int, q: TensorView, stream: int | None) -> TensorView:
    iv = as_view(obj, name, stream=stream, cupy_ordered=True)
    if iv.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {iv.dtype}")
    if iv.ndim != 3 or iv.shape[0] != b or iv.shape[1] != s_q or iv.shape[2] < 1:
        raise ValueError(f"{name} must have shape [{b}, {s_q}, topk >= 1] (batch, s_q of q), got {_oc.shape_str(iv)}")
    _oc.require_inner_contiguous(iv)
    _oc.require_same_device(iv, q)
    _oc.require_aligned(iv, 4)
    return iv


def _lengths_view(obj: Any, name: str, b: int, q: TensorView, stream: int | None) -> TensorView | None:
    if obj is None:
        return None
    lv = as_view(obj, name, stream=stream, cupy_ordered=True)
    if lv.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {lv.dtype}")
    if lv.shape != (b,):
        raise ValueError(f"{name} must have shape ({b},) (one length per request), got {_oc.shape_str(lv)}")
    _oc.require_contiguous(lv)
    _oc.require_same_device(lv, q)
    _oc.require_aligned(lv, 4)
    return lv


def _offsets16(pool_ptr: int, main_ptr: int, nb: int, page: int, page_b: int, row_b: int, name: str) -> tuple:
    """(base16, page16, row16) of a pool, after checking that each of its rows lies on a 16-byte offset
    from the main pool's base within the int32 range of the lists."""
    delta = pool_ptr - main_ptr
    if delta % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary relative to k_cache")
    lo = delta + min(0, (nb - 1) * page_b) + min(0, (page - 1) * row_b)
    hi = delta + max(0, (nb - 1) * page_b) + max(0, (page - 1) * row_b)
    if lo < -OFFSET_RANGE * 16 or hi >= OFFSET_RANGE * 16:
        raise ValueError(f"{name}'s rows span more than +-32 GiB from k_cache's base (the gathered row lists hold "
                         "int32 offsets in 16-byte units); split the pool or place both pools closer together")
    return delta // 16, page_b // 16, row_b // 16


def validate_sparse(q: Any, k_cache: Any, indices: Any, head_dim_v: Any, softmax_scale: Any, causal: Any, *,
                    stream: int | None, is_fp8_kvcache: Any, attn_sink: Any, extra_k_cache: Any,
                    extra_indices: Any, topk_length: Any, extra_topk_length: Any) -> SparseProblem:
    """Check every host-visible rule of the sparse path (FlashMLA §1.2, with gqadrv's extensions:
    any h_q in 1..128, any topk >= 1, any page size, topk_length and the extra pool on the V3.2
    format, a bf16 / fp16 cache with ``is_fp8_kvcache=False``)."""
    if not isinstance(is_fp8_kvcache, bool):
        raise TypeError(f"is_fp8_kvcache must be a bool, got {type(is_fp8_kvcache).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        raise ValueError("causal=True is not defined on the sparse path (indices name each query token's keys)")
    if head_dim_v != _contract.D_V:
        raise ValueError(f"head_dim_v must be {_contract.D_V}, got {head_dim_v!r}")
    qv = as_view(q, "q", stream=stream, cupy_ordered=True)
    if qv.ndim != 4 or qv.shape[3] != _contract.D_QK:
        raise ValueError(f"q must have shape [batch, s_q, h_q, {_contract.D_QK}], got {_oc.shape_str(qv)}")
    b, s_q, h_q, _ = qv.shape
    _oc.require_dtype(qv, _contract.SUPPORTED_DTYPES)
    if is_fp8_kvcache and qv.dtype != "bfloat16":
        raise TypeError(f"is_fp8_kvcache=True needs a bfloat16 q (the cache dequantizes to bf16), got {qv.dtype}")
    if b < 1 or s_q < 1:
        raise ValueError(f"q must hold at least one request and query token, got {_oc.shape_str(qv)}")
    if not 1 <= h_q <= _contract.MAX_HEADS_Q:
        raise ValueError(f"h_q must be in [1, {_contract.MAX_HEADS_Q}], got {h_q}")
    _contract._rows_16b(qv)
    _oc.require_no_grad(qv)

    kv, nb, page, page_b, row_b = _pool(k_cache, "k_cache", qv, is_fp8_kvcache, stream)
    iv = _index_view(indices, "indices", b, s_q, qv, stream)
    tl = _lengths_view(topk_length, "topk_length", b, qv, stream)
    _, page16, row16 = _offsets16(kv.ptr, kv.ptr, nb, page, page_b, row_b, "k_cache")
    main = SparsePool(kv, nb, page, page16, row16, 0)

    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache go together: give both or neither")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length needs extra_k_cache and extra_indices_in_kvcache")
    extra = eiv = etl = None
    if extra_k_cache is not None:
        ekv, enb, epage, epage_b, erow_b = _pool(extra_k_cache, "extra_k_cache", qv, is_fp8_kvcache, stream)
        if ekv.dtype != kv.dtype and not (is_fp8_kvcache and {ekv.dtype, kv.dtype} <= set(_contract.FP8_CACHE_DTYPES)):
            raise TypeError(f"extra_k_cache must have k_cache's dtype {kv.dtype}, got {ekv.dtype}")
        base16, p16, r16 = _offsets16(ekv.ptr, kv.ptr, enb, epage, epage_b, erow_b, "extra_k_cache")
        extra = SparsePool(ekv, enb, epage, p16, r16, base16)
        eiv = _index_view(extra_indices, "extra_indices_in_kvcache", b, s_q, qv, stream)
        etl = _lengths_view(extra_topk_length, "extra_topk_length", b, qv, stream)

    sink = None
    if attn_sink is not None:
        sink = as_view(attn_sink, "attn_sink", stream=stream, cupy_ordered=True)
        if sink.dtype != "float32":
            raise TypeError(f"attn_sink must have dtype float32, got {sink.dtype}")
        if sink.shape != (h_q,):
            raise ValueError(f"attn_sink must have shape ({h_q},) (one value per query head), got "
                             f"{_oc.shape_str(sink)}")
        _oc.require_contiguous(sink)
        _oc.require_same_device(sink, qv)
        _oc.require_aligned(sink, 4)
    topk = int(iv.shape[2])
    etopk = int(eiv.shape[2]) if eiv is not None else 0
    if topk + etopk > 2**31 - 1:
        raise ValueError("topk + extra_topk exceeds the int32 range")
    if softmax_scale is None:
        scale = _contract.D_QK ** -0.5
    else:
        scale = _oc.check_positive_scale("softmax_scale", softmax_scale, limit=_oc.F32_MAX / math.log2(math.e))
    return SparseProblem(b, s_q, h_q, topk, etopk, qv.dtype, qv.device, is_fp8_kvcache, scale, qv, main, extra, iv,
                         tl, eiv, etl, sink)


def validate_outputs(problem: SparseProblem, out: Any, lse: Any, *, stream: int | None) -> tuple:
    """Caller-given out [b, s_q, h_q, 512] (q's dtype, 16-byte rows, request stride = s_q x token
    stride so that (request, token) rows are one stride apart) and lse fp32 [b, h_q, s_q] contiguous."""
    ins = tuple(v for v in (problem.q, problem.pool.view, problem.extra.view if problem.extra else None,
                            problem.indices, problem.topk_length, problem.extra_indices, problem.extra_topk_length,
                            problem.attn_sink) if v is not None)
    return _contract.check_outputs(out, lse, problem.b, problem.s_q, problem.h_q, problem.q, ins, stream=stream,
                                   merged_rows=True)


# ----------------------------------------------------------------------------- plan
def workspace_sizes(problem: SparseProblem) -> dict:
    """The sparse buffers (the dense kernel's split workspace comes from mla.plan)."""
    sizes = {"sp_lists": (problem.rows * problem.cap, "i32"), "sp_counts": (problem.rows, "i32")}
    if problem.s_q > 1:
        sizes["sp_lse"] = (problem.rows * problem.h_q, "f32")
    if not problem.q_mergeable:
        sizes["sp_q"] = (problem.rows * problem.h_q * problem.d_qk // 2, "u32")
    return sizes


def _synthetic(name: str, ptr: int, shape: tuple, strides: tuple, dtype: str, itemsize: int, device: int,
               framework: str) -> TensorView:
    return TensorView(None, name, ptr, shape, strides, dtype, itemsize, device, framework)


def dense_problem(problem: SparseProblem, lists_ptr: int, counts_ptr: int, q_packed_ptr: int, row0: int = 0,
                  rows: int | None = None, max_offset: int | None = None, fold_sink: bool = False) -> _contract.MlaProblem:
    """The dense decode the gathered lists feed, for rows [row0, row0 + rows) (default: all): one
    "request" per (request, query token) row with s_q = 1 and h_q heads (h_kv 1), page_size 1,
    block_table = the lists (entries: 16-byte offsets from the main pool's base), cache_seqlens =
    the counts; q, lists and counts start at row0 (the caller offsets out / lse). ``max_offset``:
    the kernel also writes max_logits at lse + max_offset; such launches (the prefill, whose query
    tokens share one kv) also keep the K rows in L2 (``kv_reuse``). ``fold_sink``: the dense kernel applies
    attn_sink in its epilogue (sink_ptr; see fold_sink())."""
    q, dev, fw = problem.q, problem.device, problem.q.framework
    rows = problem.rows - row0 if rows is None else rows
    cap, h, d = problem.cap, problem.h_q, problem.d_qk
    if q_packed_ptr:
        qs = (h * d, h * d, d, 1)
        qptr = q_packed_ptr + row0 * h * d * q.itemsize
    else:
        rs = q.strides[1] if problem.s_q > 1 else q.strides[0]
        qs = (rs, 0, q.strides[2], 1)
        qptr = q.ptr + row0 * rs * q.itemsize
    qv = _synthetic("q", qptr, (rows, 1, h, d), qs, q.dtype, q.itemsize, dev, fw)
    pool = problem.pool.view
    # a 16-byte "page" stride in the kernels' element units (FP8 byte strides are halved by mla.plan)
    k_strides = (16, 0, 0, 1) if problem.kv_fp8 else (8, 0, 0, 1)
    kv = _synthetic("k_cache", pool.ptr, (1, 1, 1, pool.shape[3]), k_strides, pool.dtype, pool.itemsize, dev, fw)
    bt = _synthetic("lists", lists_ptr + 4 * row0 * cap, (rows, cap), (cap, 1), "int32", 4, dev, fw)
    ln = _synthetic("counts", counts_ptr + 4 * row0, (rows,), (1,), "int32", 4, dev, fw)
    return _contract.MlaProblem(rows, 1, h, 1, h, 1, 1, cap, problem.dtype, dev, qv, kv, bt, ln,
                                problem.softmax_scale, False, problem.kv_fp8, nope=d == 512, max_offset=max_offset,
                                no_cut=True, kv_reuse=max_offset is not None,
                                sink_ptr=problem.attn_sink.ptr if fold_sink and problem.attn_sink is not None else 0)


def row_chunks(problem: SparseProblem) -> list[tuple[int, int]]:
    """(row0, rows) of the dense launches: at most MAX_ROWS rows each (the dense grid's z limit)."""
    return [(r, min(MAX_ROWS, problem.rows - r)) for r in range(0, problem.rows, MAX_ROWS)]


def args_fields(problem: SparseProblem, ws: Any, out_ptr: int, out_strides: tuple, lse_ptr: int,
                lse_rows_ptr: int, fold_sink: bool = False) -> dict:
    """The ``MlaSparseArgs`` fields (by name) shared by the gather and the finish launch (``fold_sink``:
    the dense kernel applies attn_sink, so the finish launch does not)."""
    q, pool, extra = problem.q, problem.pool, problem.extra
    flags = 0
    if not problem.q_mergeable:
        flags |= FLAG_PACK_Q
    if problem.s_q > 1:
        flags |= FLAG_WRITE_LSE
    if problem.attn_sink is not None and not fold_sink:
        flags |= FLAG_SINK
    if problem.dtype == "bfloat16":
        flags |= FLAG_OUT_BF16
    return {
        "indices": problem.indices.ptr, "topk_length": problem.topk_length.ptr if problem.topk_length else 0,
        "extra_indices": problem.extra_indices.ptr if problem.extra_indices else 0,
        "extra_topk_length": problem.extra_topk_length.ptr if problem.extra_topk_length else 0,
        "q": q.ptr, "q_packed": ws.ptr("sp_q") if flags & FLAG_PACK_Q else 0,
        "lists": ws.ptr("sp_lists"), "counts": ws.ptr("sp_counts"),
        "lse_rows": lse_rows_ptr, "lse": lse_ptr, "out": out_ptr,
        "attn_sink": problem.attn_sink.ptr if problem.attn_sink else 0,
        "idx_stride_b": problem.indices.strides[0], "idx_stride_s": problem.indices.strides[1],
        "eidx_stride_b": problem.extra_indices.strides[0] if problem.extra_indices else 0,
        "eidx_stride_s": problem.extra_indices.strides[1] if problem.extra_indices else 0,
        "q_stride_b": q.strides[0], "q_stride_s": q.strides[1], "q_stride_h": q.strides[2],
        "o_stride_r": out_strides[1] if problem.s_q > 1 else out_strides[0], "o_stride_h": out_strides[2],
        "slots": pool.slots, "page_stride16": pool.page16, "row_stride16": pool.row16,
        "extra_slots": extra.slots if extra else 0, "extra_page_stride16": extra.page16 if extra else 0,
        "extra_row_stride16": extra.row16 if extra else 0, "extra_base16": extra.base16 if extra else 0,
        "page_size": pool.page, "extra_page_size": extra.page if extra else 1,
        "topk": problem.topk, "extra_topk": problem.extra_topk, "cap": problem.cap,
        "b": problem.b, "s_q": problem.s_q, "h_q": problem.h_q, "rows": problem.rows, "flags": flags,
        "cu_seqlens_q": problem.cu_q.ptr if problem.cu_q else 0,
        "cu_seqlens_kv": problem.cu_kv.ptr if problem.cu_kv else 0, "n_req": problem.n_req, "d_qk": problem.d_qk,
    }


def needs_finish(problem: SparseProblem, fold_sink: bool = False) -> bool:
    """The finish launch has work: the LSE transpose (s_q > 1) or an attn_sink the dense kernel does not
    apply."""
    return problem.s_q > 1 or (problem.attn_sink is not None and not fold_sink)


def fold_sink(problem: SparseProblem, family, splits: int, balanced: bool) -> bool:
    """Whether the dense kernel applies attn_sink in its epilogue (FLAG_SINK), saving the finish launch's
    pass over out: the routed family's epilogue can (routes.MlaFamily.sink_epilogue) and no item of the
    launch is split (the balanced grid without cuts, which the sparse launches always use, or one split),
    since the split merge does not apply it."""
    return problem.attn_sink is not None and family.sink_epilogue and (balanced or splits == 1)


def gather_geometry(problem: SparseProblem) -> tuple[tuple, tuple, int]:
    return (problem.rows, 1, 1), (THREADS, 1, 1), 0


def finish_geometry(problem: SparseProblem, flags: int) -> tuple[tuple, tuple, int]:
    """One (row, head) unit per warp when the finish launch scales out by the sink (FLAG_SINK in
    ``flags``), else one per thread (the LSE transpose alone)."""
    per_cta = FINISH_WARPS if flags & FLAG_SINK else THREADS
    return (-(-problem.rows * problem.h_q // per_cta), 1, 1), (THREADS, 1, 1), 0


def kernels(problem: SparseProblem, fold_sink: bool = False) -> tuple[Loaded, Loaded | None]:
    _check_cc(_drv.device_info(problem.device).cc)
    return (_loaded(GATHER, problem.device),
            _loaded(FINISH, problem.device) if needs_finish(problem, fold_sink) else None)


def _check_cc(cc: tuple[int, int]) -> None:
    """The sparse paths run where MLA decode runs (sm_90 / sm_100 / sm_110): routes' error otherwise."""
    from .routes import backend_for_cc

    backend_for_cc(cc)


# ----------------------------------------------------------------------------- CLI record
def _describe(cc: tuple[int, int]) -> str:
    _check_cc(cc)
    return (f"sparse MLA decode (top-k indices, sinks, extra pool): kernel families {GATHER.name!r}, {FINISH.name!r} "
            "around the dense MLA decode kernels")


def _selftest(rng: Any, gpu: bool) -> list:
    """The float64 oracle against a direct loop (CPU); on a GPU, one small FP8 sparse decode with
    every feature against the oracle."""
    import numpy as np

    from . import sparse_reference as _sref

    b, s_q, h_q, nb, page, topk = 2, 2, 3, 4, 5, 9
    q = rng.standard_normal((b, s_q, h_q, _ks.D_QK)).astype(np.float32) / 4
    kc = rng.standard_normal((nb, page, 1, _ks.D_QK)).astype(np.float32) / 4
    idx = rng.integers(-3, nb * page + 3, size=(b, s_q, topk)).astype(np.int32)
    out, _ = _sref.sparse_decode_reference(q, kc, idx, 0.1)
    flat = kc.reshape(-1, _ks.D_QK)
    err = 0.0
    for bi in range(b):
        for si in range(s_q):
            keys = [flat[x] for x in idx[bi, si] if 0 <= x < nb * page]
            for h in range(h_q):
                p = np.array([0.1 * float(np.dot(q[bi, si, h].astype(np.float64), k)) for k in keys])
                w = np.exp(p - p.max())
                o = (w[:, None] * np.array(keys)[:, :512]).sum(0) / w.sum() if keys else np.zeros(512)
                err = max(err, float(np.abs(o - out[bi, si, h]).max()))
    cases = [("mla sparse decode reference vs a direct loop", err, err < 1e-9)]
    if not gpu:
        return cases
    cases.extend(_gpu_selftest(rng))
    return cases


def _gpu_selftest(rng: Any) -> list:
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from . import fp8_reference as _fref
    from . import sparse_reference as _sref
    from .api import flash_mla_with_kvcache

    b, s_q, h_q, nb, page, topk = 2, 2, 16, 6, 7, 40
    k = (rng.standard_normal((nb, page, 1, _ks.D_QK)) / 4).astype(ml_dtypes.bfloat16)
    k8 = _fref.quantize_k_cache_reference(k)
    q = (rng.standard_normal((b, s_q, h_q, _ks.D_QK)) / 4).astype(ml_dtypes.bfloat16)
    idx = rng.integers(-2, nb * page + 2, size=(b, s_q, topk)).astype(np.int32)
    sink = rng.standard_normal(h_q).astype(np.float32)
    tl = np.array([topk, 17], np.int32)
    o, lse = flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k8), None, None, 512, None, is_fp8_kvcache=True,
                                    indices=cp.asarray(idx), attn_sink=cp.asarray(sink), topk_length=cp.asarray(tl))
    ro, rl = _sref.sparse_decode_reference(q, _fref.dequantize_k_cache_reference(k8), idx, None, 512, sink, tl)
    eo = float(np.abs(cp.asnumpy(o).astype(np.float64) - ro).max())
    el = float(np.abs(cp.asnumpy(lse) - rl).max())
    return [("mla sparse FP8 decode b2 s_q2 h_q16 topk40 page7 (sink, topk_length), max |out - oracle|", eo,
             eo < 2e-2),
            ("mla sparse FP8 decode, max |lse - oracle|", el, el < 1e-3)]


OP = OpRecord(name="mla_sparse", variants_for_arch=variants_for_arch, describe=_describe, selftest=_selftest)
