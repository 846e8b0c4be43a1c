"""DeepSeek sparse MLA prefill: FlashMLA's ``flash_mla_sparse_fwd`` without torch, with any h_q in
1..128, any topk >= 1, d_qk 576 or 512 and a native varlen batch form.

    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, sm_scale)
    p = prepare_mla_sparse_fwd(q, kv, indices, sm_scale, attn_sink=sink, topk_length=lens)
    out, max_logits, lse = launch_prepared(p)          # graph-capturable

Every query token is one row of the sparse machinery of ``gqadrv.mla.sparse`` (gather the valid
indices of the token, the dense MLA kernel over them, attention sinks in the finish kernel): the
token's h_q heads are the kernel's query rows (no padding to 64 heads), kv is a pool of s_kv
one-token pages, and the dense kernel also writes each row's max logit (``MLA_FLAG_MAX_LOGITS``).
d_qk 512 runs the ``*_nope`` builds (q and K rows of 512 channels). Query tokens past the dense
grid's 65535 rows are split over several dense launches.

Varlen batch form (``cu_seqlens_q`` / ``cu_seqlens_kv``, int32 [n + 1] on the device): the query
tokens [cu_q[i], cu_q[i+1]) of request i index request i's KV rows [cu_kv[i], cu_kv[i+1]) as
0 .. length - 1; an index outside that range is invalid (so callers need not offset indices).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

from ..ops import contract as _oc
from ..ops import workspace as _workspace
from ..ops.prepared import PreparedDecode
from ..runtime import tensors as _tensors
from ..runtime.streams import on_stream
from ..runtime.tensors import TensorView, as_view
from ..types import ArrayT, DLPackArray, MlaBackend, StreamLike
from . import contract as _contract
from . import sparse as _sparse

__all__ = ["PreparedMlaSparseFwd", "flash_mla_sparse_fwd", "prepare_mla_sparse_fwd", "validate_prefill"]

D_QKS = (576, 512)


def _view4(v: TensorView, name: str, shape: tuple, strides: tuple) -> TensorView:
    return TensorView(v.obj, name, v.ptr, shape, strides, v.dtype, v.itemsize, v.device, v.framework)


def _cu_view(obj: Any, name: str, q: TensorView, stream: int | None) -> TensorView:
    cv = as_view(obj, name, stream=stream, cupy_ordered=True)
    if cv.dtype != "int32":
        raise TypeError(f"{name} must have dtype int32, got {cv.dtype}")
    if cv.ndim != 1 or cv.shape[0] < 2:
        raise ValueError(f"{name} must have shape [n + 1] with n >= 1 requests, got {_oc.shape_str(cv)}")
    _oc.require_contiguous(cv)
    _oc.require_same_device(cv, q)
    _oc.require_aligned(cv, 4)
    return cv


def validate_prefill(q: Any, kv: Any, indices: Any, sm_scale: Any, d_v: Any, attn_sink: Any, topk_length: Any,
                     cu_seqlens_q: Any, cu_seqlens_kv: Any, *, stream: int | None) -> _sparse.SparseProblem:
    """FlashMLA §1.3's contract (with gqadrv's extensions): q bf16 [s_q, h_q, d_qk] (d_qk 576 or 512, any
    h_q in 1..128), kv bf16 [s_kv, 1, d_qk], indices int32 [s_q, 1, topk] (any topk >= 1), sm_scale a
    positive float, d_v 512, attn_sink fp32 [h_q], topk_length int32 [s_q], cu_seqlens_q /
    cu_seqlens_kv int32 [n + 1] (both or neither). Last dims contiguous, rows 16-byte aligned."""
    if d_v != _contract.D_V:
        raise ValueError(f"d_v must be {_contract.D_V}, got {d_v!r}")
    if sm_scale is None:
        raise TypeError("sm_scale is required (FlashMLA's flash_mla_sparse_fwd has no default), e.g. d_qk ** -0.5")
    scale = _oc.check_positive_scale("sm_scale", sm_scale, limit=_oc.F32_MAX / math.log2(math.e))
    qv = as_view(q, "q", stream=stream, cupy_ordered=True)
    if qv.ndim != 3 or qv.shape[2] not in D_QKS:
        raise ValueError(f"q must have shape [s_q, h_q, d_qk] with d_qk 576 or 512, got {_oc.shape_str(qv)}")
    s_q, h_q, d = qv.shape
    if qv.dtype != "bfloat16":
        raise TypeError(f"q must have dtype bfloat16, got {qv.dtype}")
    if s_q < 1:
        raise ValueError(f"q must hold at least one query token, got {_oc.shape_str(qv)}")
    if not 1 <= h_q <= _contract.MAX_HEADS_Q:
        raise ValueError(f"h_q must be in [1, {_contract.MAX_HEADS_Q}], got {h_q}")
    _contract._rows_16b(qv)
    _oc.require_no_grad(qv)

    kvv = as_view(kv, "kv", stream=stream, cupy_ordered=True)
    if kvv.ndim != 3 or kvv.shape[1] != 1 or kvv.shape[2] != d:
        raise ValueError(f"kv must have shape [s_kv, 1, {d}] (q's d_qk; one KV head), got {_oc.shape_str(kvv)}")
    if kvv.dtype != "bfloat16":
        raise TypeError(f"kv must have dtype bfloat16, got {kvv.dtype}")
    s_kv = kvv.shape[0]
    if s_kv < 1:
        raise ValueError(f"kv must hold at least one row, got {_oc.shape_str(kvv)}")
    if s_kv > 2**31 - 1:
        raise ValueError(f"kv holds {s_kv} rows; indices are int32")
    _contract._rows_16b(kvv)
    _oc.require_same_device(kvv, qv)
    _oc.require_no_grad(kvv)
    row_b = kvv.strides[0] * 2 if s_kv > 1 else 0
    _, page16, _ = _sparse._offsets16(kvv.ptr, kvv.ptr, s_kv, 1, row_b, 0, "kv")
    pool = _sparse.SparsePool(_view4(kvv, "kv", (s_kv, 1, 1, d), (kvv.strides[0], kvv.strides[0], kvv.strides[1], 1)),
                              s_kv, 1, page16, 0, 0)

    iv = as_view(indices, "indices", stream=stream, cupy_ordered=True)
    if iv.dtype != "int32":
        raise TypeError(f"indices must have dtype int32, got {iv.dtype}")
    if iv.ndim != 3 or iv.shape[0] != s_q or iv.shape[1] != 1 or iv.shape[2] < 1:
        raise ValueError(f"indices must have shape [{s_q}, 1, topk >= 1] (s_q of q, one KV head), got "
                         f"{_oc.shape_str(iv)}")
    _oc.require_inner_contiguous(iv)
    _oc.require_same_device(iv, qv)
    _oc.require_aligned(iv, 4)
    tl = _sparse._lengths_view(topk_length, "topk_length", s_q, qv, stream)
    sink = None
    if attn_sink is not None:
        sink = _oc.scale_view(attn_sink, "attn_sink", qv, stream)
        if sink.shape != (h_q,):
            raise ValueError(f"attn_sink must have shape ({h_q},) (one value per query head), got "
                             f"{_oc.shape_str(sink)}")
        _oc.require_contiguous(sink)
    if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_kv go together: give both (varlen batch) or neither")
    cq = ck = None
    if cu_seqlens_q is not None:
        cq = _cu_view(cu_seqlens_q, "cu_seqlens_q", qv, stream)
        ck = _cu_view(cu_seqlens_kv, "cu_seqlens_kv", qv, stream)
        if cq.shape != ck.shape:
            raise ValueError(f"cu_seqlens_q {_oc.shape_str(cq)} and cu_seqlens_kv {_oc.shape_str(ck)} must have the "
                             "same length (one entry per request + 1)")
    q4 = _view4(qv, "q", (s_q, 1, h_q, d), (qv.strides[0], qv.strides[0], qv.strides[1], 1))
    i3 = _view4(iv, "indices", (s_q, 1, iv.shape[2]), iv.strides)
    return _sparse.SparseProblem(s_q, 1, h_q, int(iv.shape[2]), 0, "bfloat16", qv.device, False, scale, q4, pool, None,
                                 i3, tl, None, None, sink, d_qk=d, cu_q=cq, cu_kv=ck)


def _outputs(sp: _sparse.SparseProblem, out: Any, stats: Any, s: int, dl: int | None) -> tuple:
    """(out ptr, stats ptr, new CuPy out or None, new CuPy stats or None): caller-given ``out`` bf16
    [s_q, h_q, 512] and ``stats`` fp32 [2, s_q, h_q] (max_logits, lse: the kernel writes a row's max
    logit at a fixed offset from its LSE, so both live in one buffer), contiguous; else new arrays."""
    ins = (sp.q, sp.pool.view, sp.indices, sp.topk_length, sp.attn_sink, sp.cu_q, sp.cu_kv)
    new_out = new_stats = None
    if out is not None:
        ov = _oc.view_without_grad(out, "out", dl)
        _oc.require_output(ov, sp.q, ins, shape=(sp.rows, sp.h_q, _contract.D_V), align=16, dtype="bfloat16")
        o_ptr = ov.ptr
    if stats is not None:
        sv = _oc.view_without_grad(stats, "stats", dl)
        _oc.require_output(sv, sp.q, ins + ((ov,) if out is not None else ()), shape=(2, sp.rows, sp.h_q), align=4,
                           dtype="float32", hint=" (max_logits, lse)")
        st_ptr = sv.ptr
    with on_stream(s, sp.device):
        if out is None:
            new_out = _tensors.empty((sp.rows, sp.h_q, _contract.D_V), "bfloat16", sp.device)
            o_ptr = int(new_out.data.ptr)
        if stats is None:
            new_stats = _tensors.empty((2, sp.rows, sp.h_q), "float32", sp.device)
            st_ptr = int(new_stats.data.ptr)
    return o_ptr, st_ptr, new_out, new_stats


def _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv, stream, backend,
             who: str, capture_ok: bool, make_ws, out=None, stats=None):
    from . import api as _api

    tensors = (q, kv, indices, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv, out, stats)
    s, dl = _api._streams(q, tensors, stream, who, capture_ok)
    sp = validate_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv,
                          stream=dl)
    n = sp.rows * sp.h_q
    o_ptr, st_ptr, new_out, new_stats = _outputs(sp, out, stats, s, dl)
    launch = _api.sparse_launch(sp, out_ptr=o_ptr, out_strides=(sp.h_q * _contract.D_V,) * 2 + (_contract.D_V,),
                                lse_ptr=st_ptr + 4 * n, lse_rows_ptr=lambda ws: st_ptr + 4 * n, max_offset=-n,
                                backend=backend, num_splits=None, meta=None, make_ws=make_ws(sp, s))
    with on_stream(s, sp.device):
        o = out if out is not None else _tensors.export_like(new_out, q)
        if stats is not None:  # the caller's halves (None for buffers without indexing, e.g. a JAX FFI buffer)
            st = (stats[0], stats[1]) if hasattr(stats, "__getitem__") else (None, None)
        else:
            st = tuple(_tensors.export_like(a, q) for a in (new_stats[0], new_stats[1]))
    return sp, s, launch, (o, *st), (new_out, new_stats)


def flash_mla_sparse_fwd(q: ArrayT, kv: DLPackArray, indices: DLPackArray, sm_scale: float, d_v: int = 512,
                         attn_sink: DLPackArray | None = None, topk_length: DLPackArray | None = None, *,
                         cu_seqlens_q: DLPackArray | None = None, cu_seqlens_kv: DLPackArray | None = None,
                         out: Any = None, stats: Any = None, stream: StreamLike | None = None,
                         backend: MlaBackend | None = None) -> tuple[Any, Any, Any]:
    """Sparse MLA prefill with FlashMLA's names and semantics (§1.3 of its spec).

    q bf16 [s_q, h_q, d_qk] (d_qk 576 or 512; any h_q in 1..128); kv bf16 [s_kv, 1, d_qk]; indices
    int32 [s_q, 1, topk] (any topk >= 1): an index < 0 or >= s_kv (INT_MIN, -1, INT_MAX, ...) is
    invalid and never read; ``sm_scale`` absolute (logits = sm_scale * q.k over all d_qk channels);
    V = the first ``d_v`` = 512 channels of kv. ``attn_sink`` fp32 [h_q]: out *= 1 / (1 + exp(sink -
    lse)) (+inf: 0, -inf: unchanged); ``topk_length`` int32 [s_q]: only the first topk_length[t]
    indices of token t count. Returns ``(out bf16 [s_q, h_q, 512], max_logits fp32 [s_q, h_q], lse fp32
    [s_q, h_q])`` in q's framework, natural units (max of the scaled logits; natural-log LSE), both
    without the sink; a row without a valid index gives out 0, max_logits -inf, lse +inf.
    gqadrv additions: ``cu_seqlens_q`` / ``cu_seqlens_kv`` int32 [n + 1] (varlen batch: request i's
    tokens index its own KV rows from 0), ``out`` (bf16 [s_q, h_q, 512]) and ``stats`` (fp32
    [2, s_q, h_q]: max_logits, lse) to write into (contiguous; then max_logits / lse are returned as
    ``stats[0]`` / ``stats[1]``), ``stream``, ``backend`` ('auto', 'seesaw', 'mma').
    Asynchronous on ``stream``; every device input is read on the device only."""
    sp, s, launch, outs, _ = _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q,
                                      cu_seqlens_kv, stream, backend, "flash_mla_sparse_fwd", True,
                                      lambda sp, s: lambda sizes, zero: _workspace.pooled(sp.device, s, sizes, zero),
                                      out, stats)
    launch.launch(sp, s)
    return outs


_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True, repr=False)
class PreparedMlaSparseFwd(PreparedDecode[_R]):
    """Immutable result of ``prepare_mla_sparse_fwd``; ``launch_prepared`` returns
    ``(out, max_logits, lse)``."""


def prepare_mla_sparse_fwd(q: ArrayT, kv: DLPackArray, indices: DLPackArray, sm_scale: float, d_v: int = 512,
                           attn_sink: DLPackArray | None = None, topk_length: DLPackArray | None = None, *,
                           cu_seqlens_q: DLPackArray | None = None, cu_seqlens_kv: DLPackArray | None = None,
                           stream: StreamLike | None = None,
                           backend: MlaBackend | None = None) -> PreparedMlaSparseFwd[tuple[Any, Any, Any]]:
    """Validate, route, compile, allocate (outputs and workspace) and pack once; ``launch_prepared(p)``
    then enqueues the gather, dense and (with attn_sink) finish launches, reading q, kv, indices,
    topk_length, attn_sink and cu_seqlens on the device at every launch (change them in place
    between launches or graph replays). Arguments as ``flash_mla_sparse_fwd``."""
    from . import api as _api

    sp, s, launch, outs, keep = _prepare(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q,
                                         cu_seqlens_kv, stream, backend, "prepare_mla_sparse_fwd", False,
                                         lambda sp, s: lambda sizes, zero: _workspace.alloc(sp.device, s, sizes, zero))
    plans = launch.plans(sp, s)
    _api._sync(s, sp.device)
    grid, block, smem, _ = launch.dense_parts[0]
    return PreparedMlaSparseFwd(
        device=sp.device, _plans=plans, _out=outs,
        _keep=(q, kv, indices, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv, *outs, *keep, launch.ws),
        _status=None, _status_names=(), route=f"mla_sparse_prefill+{launch.variant.name}", num_splits=launch.splits,
        grid=grid, block=block, dynamic_smem=smem, workspace_bytes=launch.ws.nbytes, arch=launch.dense.arch,
        batch=sp.rows, capacity=sp.cap,
    )
