"""Public MLA decode API, FlashMLA-compatible for the dense path, torch-free.

    meta, _ = get_mla_metadata()            # FlashMLA's names; the arguments are accepted and ignored
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta,
                                      softmax_scale=None, causal=False)
    p = prepare_mla_decode(q, k_cache, block_table, cache_seqlens, out=o, lse=l)
    out, lse = launch_prepared(p)           # one cuLaunchKernelEx, graph-capturable

Unlike FlashMLA, the split plan never depends on the lengths on the host: each CTA derives its
token range from ``cache_seqlens`` on the device at every launch, so one metadata object (or one
prepared object, or one captured graph) stays valid when the lengths change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from ..ops import workspace as _workspace
from ..ops.plans import launch_packed
from ..ops.prepared import PreparedDecode
from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.module import ArgPack, LaunchPlan, launch_plans
from ..runtime.streams import (
    device_hint,
    is_capturing,
    on_stream,
    order_inputs,
    resolve_stream,
)
from ..types import ArrayT, DLPackArray, LseT, MlaBackend, OutT, StreamLike
from . import contract as _contract
from . import kernel_spec as _ks
from . import layout_plans as _lp
from . import plan as _plan
from . import sparse as _sparse
from . import trace_checks as _trace

__all__ = ["MlaSchedMeta", "PreparedMlaDecode", "flash_mla_with_kvcache", "get_mla_metadata", "prepare_mla_decode"]

_SPARSE_ARGS = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                "extra_topk_length")


@dataclasses.dataclass
class MlaSchedMeta:
    """What ``get_mla_metadata`` returns (FlashMLA's ``FlashMLASchedMeta`` role).

    The first ``flash_mla_with_kvcache`` call that receives it records its configuration and split
    count; later calls must use the same configuration (ValueError otherwise) and reuse them. The
    split plan itself is derived on the device from ``cache_seqlens`` at every launch, so, unlike
    FlashMLA's metadata, this object stays valid when the lengths change (one object per model is
    enough)."""

    config: tuple[Any, ...] | None = None
    num_splits: int | None = None

    @property
    def have_initialized(self) -> bool:
        return self.config is not None


def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[MlaSchedMeta, None]:
    """FlashMLA-compatible: returns ``(MlaSchedMeta(), None)``. Both calling forms of FlashMLA are
    accepted (the current no-argument form and the older ``(cache_seqlens, num_q_tokens_per_head_k,
    num_heads_k, ...)`` form); no argument is needed, since gqadrv computes the schedule on the
    device at every launch."""
    return MlaSchedMeta(), None


def _sparse_args(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                 extra_topk_length) -> dict:
    """FlashMLA's six sparse-path arguments by name."""
    return {"indices": indices, "attn_sink": attn_sink, "extra_k_cache": extra_k_cache,
            "extra_indices_in_kvcache": extra_indices_in_kvcache, "topk_length": topk_length,
            "extra_topk_length": extra_topk_length}


def _check_dense_call(who: str, block_table, cache_seqlens, sparse: dict) -> None:
    """No sparse argument without indices; the block table and lengths given (mla.trace_checks' rule)."""
    _trace.check_dense_arguments(who, block_table is not None, cache_seqlens is not None,
                                 [k for k, v in sparse.items() if v is not None])


def _dense_config(problem) -> tuple:
    return (problem.b, problem.s_q, problem.h_q, problem.h_kv, problem.page_size, problem.max_blocks,
            problem.causal, problem.dtype, problem.device, problem.kv_fp8)


def _splits(problem, variant, num_splits: Any, meta: MlaSchedMeta | None, config: tuple | None = None) -> int:
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int):
            raise TypeError("num_splits must be None (gqadrv schedules on the device) or an int in "
                            f"[1, {_ks.MAX_SPLITS}]; got {type(num_splits).__name__} (FlashMLA's num_splits tensor "
                            "from the old get_mla_metadata is not needed)")
        if not 1 <= num_splits <= _ks.MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {_ks.MAX_SPLITS}], got {num_splits}")
    if meta is None:
        return num_splits or _plan.default_splits(problem, variant)
    config = config if config is not None else _dense_config(problem)
    if meta.config is None:
        meta.config = config
        meta.num_splits = num_splits or _plan.default_splits(problem, variant)
    elif meta.config != config:
        raise ValueError(f"tile_scheduler_metadata was initialised for {meta.config}, this call has {config} "
                         "(dense: b, s_q, h_q, h_kv, page, max_blocks, causal, dtype, device, fp8 cache; sparse: "
                         "'sparse', b, s_q, h_q, page, topk, extra page, extra topk, dtype, device, fp8 cache); use one "
                         "metadata object per configuration")
    return num_splits or meta.num_splits


def _export(q, out, lse, new_out, new_lse, s: int, device: int) -> tuple:
    """The caller's out / lse, or the new CuPy arrays handed back in q's framework."""
    with on_stream(s, device):
        o = out if out is not None else _tensors.export_like(new_out, q)
        lo = lse if lse is not None else _tensors.export_like(new_lse, q)
    return o, lo


def _streams(q, tensors: tuple, stream, who: str, capture_ok: bool) -> tuple[int, int | None]:
    """(launch stream, DLPack stream): the stream resolved for q's framework, every input's producer
    ordered before it; a stream under capture is refused when the call allocates (``capture_ok`` False)."""
    _drv.ensure_init()
    dev = device_hint(q)
    s = resolve_stream(stream, dev, _tensors.framework_of(q))
    if not capture_ok and is_capturing(s):
        raise RuntimeError(f"{who} must be called outside CUDA-graph capture (it allocates and synchronizes); "
                           "capture launch_prepared instead")
    return s, order_inputs(tensors, dev, s)


def _ingest(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, out, lse, stream, who: str,
            capture_ok: bool, is_fp8_kvcache: Any = False):
    """Resolve the stream, order every input's producer before it, validate: (problem, stream,
    DLPack stream)."""
    s, dl = _streams(q, (q, k_cache, block_table, cache_seqlens, out, lse), stream, who, capture_ok)
    problem = _contract.validate(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, stream=dl,
                                 is_fp8_kvcache=is_fp8_kvcache)
    return problem, s, dl


def _outputs(problem, out, lse, s: int, dl: int | None):
    """Caller-given or new out / lse: (out obj, lse obj, out ptr, lse ptr, out strides)."""
    ov, lv = _contract.validate_outputs(problem, out, lse, stream=dl)
    return _allocate_outputs(ov, lv, problem.b, problem.s_q, problem.h_q, problem.dtype, problem.device, s)


def _allocate_outputs(ov, lv, b: int, s_q: int, h_q: int, dtype: str, device: int, s: int):
    """(new out or None, new lse or None, out ptr, lse ptr, out strides) for validated views ov / lv."""
    new_out = new_lse = None
    with on_stream(s, device):
        if ov is None:
            new_out = _tensors.empty((b, s_q, h_q, _ks.D_V), dtype, device)
        if lv is None:
            new_lse = _tensors.empty((b, h_q, s_q), "float32", device)
    o_ptr = ov.ptr if ov is not None else int(new_out.data.ptr)
    l_ptr = lv.ptr if lv is not None else int(new_lse.data.ptr)
    o_strides = ov.strides if ov is not None else (s_q * h_q * _ks.D_V, h_q * _ks.D_V, _ks.D_V)
    return new_out, new_lse, o_ptr, l_ptr, o_strides


def _sparse_ingest(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, sparse: dict, out, lse, stream,
                   who: str, capture_ok: bool):
    """The sparse path's (problem, stream, DLPack stream): as ``_ingest``, for the sparse arguments."""
    s, dl = _streams(q, (q, k_cache, *sparse.values(), out, lse), stream, who, capture_ok)
    problem = _sparse.validate_sparse(q, k_cache, sparse["indices"], head_dim_v, softmax_scale, causal, stream=dl,
                                      is_fp8_kvcache=is_fp8_kvcache, attn_sink=sparse["attn_sink"],
                                      extra_k_cache=sparse["extra_k_cache"],
                                      extra_indices=sparse["extra_indices_in_kvcache"],
                                      topk_length=sparse["topk_length"],
                                      extra_topk_length=sparse["extra_topk_length"])
    return problem, s, dl


@dataclasses.dataclass
class SparseLaunch:
    """The launches of one sparse MLA call: gather, the dense kernel per row chunk, finish (or None)."""

    gather: Any
    finish: Any
    variant: Any
    dense: Any                # the dense kernel's Loaded
    splits: int
    ws: Any
    dense_parts: list         # [(grid, block, smem, values)] per row chunk
    fields: dict              # MlaSparseArgs of gather and finish

    def launch(self, sp, s: int) -> None:
        """Enqueue everything on stream s (convenience calls)."""
        launch_packed(self.gather.kernel, *_sparse.gather_geometry(sp), _sparse.SIGNATURE, s, (self.fields,), sp.device)
        for grid, block, smem, values in self.dense_parts:
            launch_packed(self.dense.kernel, grid, block, smem, self.variant.family.signature, s, values, sp.device)
        if self.finish is not None:
            launch_packed(self.finish.kernel, *_sparse.finish_geometry(sp, self.fields["flags"]), _sparse.SIGNATURE, s,
                          (self.fields,), sp.device)

    def plans(self, sp, s: int) -> tuple:
        """The same launches as pre-packed LaunchPlans (prepared objects; PDL on)."""
        args = ArgPack(_sparse.SIGNATURE).pack(self.fields)
        gather = LaunchPlan(self.gather.kernel, *_sparse.gather_geometry(sp), args, stream=s, pdl=True)
        dense = tuple(LaunchPlan(self.dense.kernel, g, b, m, ArgPack(self.variant.family.signature).pack(*v),
                                 stream=s, pdl=True) for g, b, m, v in self.dense_parts)
        if self.finish is None:
            return (gather, *dense)
        args = ArgPack(_sparse.SIGNATURE).pack(self.fields)   # its own argument buffer
        finish = LaunchPlan(self.finish.kernel, *_sparse.finish_geometry(sp, self.fields["flags"]), args, stream=s,
                            pdl=True)
        return (gather, *dense, finish)


def sparse_launch(sp, *, out_ptr: int, out_strides: tuple, lse_ptr: int, lse_rows_ptr, max_offset: int | None,
                  backend, num_splits, meta, make_ws) -> SparseLaunch:
    """Route and split the dense kernel on the lists, allocate the workspace (``make_ws(sizes, zero)``)
    and pack every launch. ``out_strides``: element strides of out's (request, token, head) dims;
    ``lse_rows_ptr(ws)``: where the dense kernel writes its [rows, h_q] LSE (and, with ``max_offset``,
    max_logits at + max_offset)."""
    chunks = _sparse.row_chunks(sp)
    probe = _sparse.dense_problem(sp, 0, 0, 0, 0, chunks[0][1], max_offset)
    variant, loaded = _plan.route(probe, backend)
    splits = _splits(probe, variant, num_splits, meta, sp.config())
    # the balanced grids run the lists with FLAG_NO_CUT (dense_problem): no item is ever split
    fold = _sparse.fold_sink(sp, variant.family, splits, _ks.kernel(variant.family.name).balanced)
    gather, finish = _sparse.kernels(sp, fold)
    ws = make_ws({**_plan.workspace_sizes(probe, variant, splits), **_sparse.workspace_sizes(sp)}, _plan.WORKSPACE_ZERO)
    lse_rows = lse_rows_ptr(ws)
    row_stride = out_strides[1] if sp.s_q > 1 else out_strides[0]
    item = _tensors.DTYPE_BYTES[sp.dtype]
    q_packed = 0 if sp.q_mergeable else ws.ptr("sp_q")
    parts = []
    for row0, n in chunks:
        dense = _sparse.dense_problem(sp, ws.ptr("sp_lists"), ws.ptr("sp_counts"), q_packed, row0, n, max_offset,
                                      fold_sink=fold)
        parts.append(_plan.launch_parts(dense, variant, out_strides=(row_stride, 0, out_strides[2]),
                                        out_ptr=out_ptr + row0 * row_stride * item,
                                        lse_ptr=lse_rows + 4 * row0 * sp.h_q, ws=ws, splits=splits))
    fields = _sparse.args_fields(sp, ws, out_ptr, out_strides, lse_ptr, lse_rows, fold_sink=fold)
    return SparseLaunch(gather, finish, variant, loaded, splits, ws, parts, fields)


def _decode_launch(sp, out, lse, s: int, dl: int | None, backend, num_splits, meta, make_ws):
    """The sparse decode's outputs (caller-given or new) and launches: (new out, new lse, SparseLaunch)."""
    ov, lv = _sparse.validate_outputs(sp, out, lse, stream=dl)
    new_out, new_lse, o_ptr, l_ptr, o_strides = _allocate_outputs(ov, lv, sp.b, sp.s_q, sp.h_q, sp.dtype, sp.device, s)
    # the dense kernel's [rows, h_q] LSE is FlashMLA's [b, h_q, s_q] when s_q == 1, else the finish kernel transposes
    launch = sparse_launch(sp, out_ptr=o_ptr, out_strides=o_strides, lse_ptr=l_ptr,
                           lse_rows_ptr=lambda ws: ws.ptr("sp_lse") if sp.s_q > 1 else l_ptr, max_offset=None,
                           backend=backend, num_splits=num_splits, meta=meta, make_ws=make_ws)
    return new_out, new_lse, launch


def _sparse_call(q, k_cache, head_dim_v, meta, num_splits, softmax_scale, causal, is_fp8_kvcache, sparse: dict, out,
                 lse, stream, backend):
    sp, s, dl = _sparse_ingest(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, sparse, out, lse, stream,
                               "flash_mla_with_kvcache", capture_ok=True)
    new_out, new_lse, launch = _decode_launch(sp, out, lse, s, dl, backend, num_splits, meta,
                                              lambda sizes, zero: _workspace.pooled(sp.device, s, sizes, zero))
    launch.launch(sp, s)
    return _export(q, out, lse, new_out, new_lse, s, sp.device)


def flash_mla_with_kvcache(q: ArrayT, k_cache: DLPackArray, block_table: DLPackArray | None = None,
                           cache_seqlens: DLPackArray | None = None, head_dim_v: int = 512,
                           tile_scheduler_metadata: MlaSchedMeta | None = None,
                           num_splits: int | None = None, softmax_scale: float | None = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices: DLPackArray | None = None,
                           attn_sink: DLPackArray | None = None, extra_k_cache: DLPackArray | None = None,
                           extra_indices_in_kvcache: DLPackArray | None = None,
                           topk_length: DLPackArray | None = None, extra_topk_length: DLPackArray | None = None, *,
                           out: OutT | None = None, lse: LseT | None = None, stream: StreamLike | None = None,
                           backend: MlaBackend | None = None) -> tuple[OutT | ArrayT, LseT | ArrayT]:
    """MLA decode with FlashMLA's names, argument order, shapes and semantics (dense path).

    q [b, s_q, h_q, 576] fp16/bf16; k_cache [num_blocks, page_size, h_kv, 576] (page_size a power of
    two 1..256; V = first 512 channels); block_table int32 [b, max_blocks]; cache_seqlens int32 [b]
    on the device (clamped to [0, max_blocks * page_size]); head_dim_v 512. Returns
    ``(out [b, s_q, h_q, 512], lse fp32 [b, h_q, s_q])`` in q's framework: the natural-log LSE of the
    scaled logits, +inf with a zero output for rows without keys. ``softmax_scale`` is absolute:
    softmax(softmax_scale * q.k) (default 576 ** -0.5). ``causal``: bottom-right mask, query token j sees keys
    [0, len - (s_q - 1 - j)). ``tile_scheduler_metadata``: from ``get_mla_metadata`` or None.
    ``num_splits``: None (chosen from the shapes) or an int: splits per request on the split-grid
    routes, CTAs per (KV head, row block) on the balanced grid (``seesaw_bal`` / ``narrow16_bal`` for
    TMA-describable caches, ``seesaw_bal_cp`` for the others, the defaults once the batch fills the SMs;
    None there means about one CTA per SM).
    gqadrv additions (keywords): ``out`` / ``lse`` to write into, ``stream``, ``backend`` ('auto',
    'seesaw', 'seesaw_tma', 'seesaw_bal', 'seesaw_bal_cp', 'narrow16x2_tma', 'narrow16_bal', 'narrow16', 'narrow32',
    'narrow16_tma', 'narrow32_tma', 'wgmma', 'mma'; with an FP8 cache
    'seesaw_fp8' or 'mma_fp8').
    ``is_fp8_kvcache=True`` (dense FP8 decode, which FlashMLA itself lacks): k_cache is FlashMLA's V3.2
    FP8 cache [num_blocks, page_size, h_kv, 656] (uint8 / int8 / float8_e4m3fn; 512 e4m3 codes, four
    fp32 scales, 64 bf16 RoPE channels per token, as ``gqadrv.mla.quantize_k_cache`` writes it; 16-byte
    aligned rows), q bf16; the result equals dense decode on ``dequantize_k_cache(k_cache)``.
    Sparse path (``indices`` given; FlashMLA's DeepSeek sparse attention decode): k_cache
    [num_blocks, page_size, 1, 656] FP8 (``is_fp8_kvcache=True``) or [num_blocks, page_size, 1, 576] of
    q's dtype (a bf16 / fp16 cache, which FlashMLA lacks), any page size and page stride; ``indices``
    int32 [b, s_q, topk] (any topk >= 1) of flattened slots ``page * page_size + offset``; an index
    outside [0, num_blocks * page_size) is invalid and never read (not only -1); ``topk_length`` int32
    [b] keeps the first topk_length[i] indices of request i; ``extra_k_cache`` /
    ``extra_indices_in_kvcache`` [b, s_q, extra_topk] / ``extra_topk_length`` [b]: a second pool (same
    format) attended in the same softmax; ``attn_sink`` float32 [h_q]: out *= 1 / (1 + exp(sink - lse))
    (+inf: 0, -inf: unchanged), lse returned without it. Any h_q in 1..128; block_table /
    cache_seqlens are ignored; causal must be False. Returns out [b, s_q, h_q, 512] and lse fp32
    [b, h_q, s_q] (+inf with out 0 for rows without a valid key). Three launches (gather the valid
    slots, the dense kernels over them, sink / LSE layout), see ``gqadrv.mla.sparse``.
    """
    if tile_scheduler_metadata is not None and not isinstance(tile_scheduler_metadata, MlaSchedMeta):
        raise TypeError("tile_scheduler_metadata must be None or the object returned by gqadrv.get_mla_metadata, "
                        f"got {type(tile_scheduler_metadata).__name__}")
    sparse = _sparse_args(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    if indices is not None:
        return _sparse_call(q, k_cache, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal,
                            is_fp8_kvcache, sparse, out, lse, stream, backend)
    meta = tile_scheduler_metadata
    facts = None
    if all(v is None for v in sparse.values()):
        facts = _lp.call_facts(q, k_cache, block_table, cache_seqlens, out, lse, head_dim_v, softmax_scale, causal,
                               is_fp8_kvcache, num_splits, meta, stream, backend)
        if facts is not None:
            e = _lp.layouts.get(facts[0])
            if e is not None:
                r = _lp.launch_layout(e, facts, meta, num_splits, q, k_cache, block_table, cache_seqlens, out,
                                      lse)
                if r is not _lp.MISS:
                    return r
    _check_dense_call("flash_mla_with_kvcache", block_table, cache_seqlens, sparse)
    problem, s, dl = _ingest(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, out, lse,
                             stream, "flash_mla_with_kvcache", capture_ok=True, is_fp8_kvcache=is_fp8_kvcache)
    variant, loaded = _plan.route(problem, backend)
    splits = _splits(problem, variant, num_splits, meta)
    ov, lv = _contract.validate_outputs(problem, out, lse, stream=dl)
    new_out, new_lse, o_ptr, l_ptr, o_strides = _allocate_outputs(ov, lv, problem.b, problem.s_q, problem.h_q,
                                                                  problem.dtype, problem.device, s)
    ws = _workspace.pooled(problem.device, s, _plan.workspace_sizes(problem, variant, splits), _plan.WORKSPACE_ZERO)
    if facts is None:
        grid, block, smem, values = _plan.launch_parts(problem, variant, out_strides=o_strides, out_ptr=o_ptr,
                                                       lse_ptr=l_ptr, ws=ws, splits=splits)
        launch_packed(loaded.kernel, grid, block, smem, variant.family.signature, s, values, problem.device)
    else:  # a plan of its own, kept under the layout key
        plan = _plan.build_launch(problem, variant, loaded, out_strides=o_strides, out_ptr=o_ptr, lse_ptr=l_ptr,
                                  ws=ws, splits=splits, stream=s)
        launch_plans((plan,), problem.device)
        views = (problem.q, problem.k_cache, problem.block_table, problem.seqlens, ov, lv)
        ptrs = (problem.q.ptr, problem.k_cache.ptr, problem.block_table.ptr, problem.seqlens.ptr, o_ptr, l_ptr)
        _lp.remember(facts, problem, variant, plan, ws, views, ptrs, _dense_config(problem), splits)
    o, lo = _export(q, out, lse, new_out, new_lse, s, problem.device)
    return o, lo


_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True, repr=False)
class PreparedMlaDecode(PreparedDecode[_R]):
    """Immutable result of ``prepare_mla_decode``; ``launch_prepared`` returns ``(out, lse)`` (type ``_R``)."""


def prepare_mla_decode(q: ArrayT, k_cache: DLPackArray, block_table: DLPackArray | None = None,
                       cache_seqlens: DLPackArray | None = None, head_dim_v: int = 512, *, out: OutT | None = None,
                       lse: LseT | None = None, softmax_scale: float | None = None, causal: bool = False,
                       num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: MlaBackend | None = None, is_fp8_kvcache: bool = False,
                       indices: DLPackArray | None = None, attn_sink: DLPackArray | None = None,
                       extra_k_cache: DLPackArray | None = None, extra_indices_in_kvcache: DLPackArray | None = None,
                       topk_length: DLPackArray | None = None, extra_topk_length: DLPackArray | None = None,
                       ) -> PreparedMlaDecode[tuple[OutT | ArrayT, LseT | ArrayT]]:
    """Validate, route, compile, allocate (outputs when not given, workspace) and pack once; then
    ``launch_prepared(p)`` is one cuLaunchKernelEx that reads the current lengths, block table,
    q and cache contents on the device (update them in place between launches or graph replays).
    The split count depends only on the shapes, so any lengths up to the capacity stay valid.
    ``is_fp8_kvcache=True``: k_cache is FlashMLA's 656-byte FP8 cache (see flash_mla_with_kvcache).
    With ``indices`` (the sparse path, see flash_mla_with_kvcache): three launches (gather, dense
    kernel, finish when s_q > 1 or attn_sink is given) that read indices, topk_length, attn_sink, q
    and the pools on the device at every launch."""
    sparse = _sparse_args(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    if indices is not None:
        return _prepare_sparse(q, k_cache, head_dim_v, out, lse, softmax_scale, causal, num_splits, stream, backend,
                               is_fp8_kvcache, sparse)
    _check_dense_call("prepare_mla_decode", block_table, cache_seqlens, sparse)
    problem, s, dl = _ingest(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, out, lse,
                             stream, "prepare_mla_decode", capture_ok=False, is_fp8_kvcache=is_fp8_kvcache)
    variant, loaded = _plan.route(problem, backend)
    splits = _splits(problem, variant, num_splits, None)
    new_out, new_lse, o_ptr, l_ptr, o_strides = _outputs(problem, out, lse, s, dl)
    ws = _workspace.alloc(problem.device, s, _plan.workspace_sizes(problem, variant, splits), _plan.WORKSPACE_ZERO)
    launch = _plan.build_launch(problem, variant, loaded, out_strides=o_strides, out_ptr=o_ptr, lse_ptr=l_ptr, ws=ws,
                                splits=splits, stream=s)
    _sync(s, problem.device)
    o, lo = _export(q, out, lse, new_out, new_lse, s, problem.device)
    return PreparedMlaDecode(
        device=problem.device, _plans=(launch,), _out=(o, lo),
        _keep=(q, k_cache, block_table, cache_seqlens, o, lo, new_out, new_lse, ws), _status=None, _status_names=(),
        route=variant.name, num_splits=splits, grid=launch.grid, block=launch.block, dynamic_smem=launch.smem,
        workspace_bytes=ws.nbytes, arch=loaded.arch, batch=problem.b, capacity=problem.capacity,
    )


def _sync(s: int, device: int) -> None:
    with _drv.device_scope(device):
        _drv.check(_drv.driver().cuStreamSynchronize(s), "cuStreamSynchronize(prepare_mla_decode)")


def _prepare_sparse(q, k_cache, head_dim_v, out, lse, softmax_scale, causal, num_splits, stream, backend,
                    is_fp8_kvcache, sparse: dict) -> PreparedMlaDecode:
    sp, s, dl = _sparse_ingest(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, sparse, out, lse, stream,
                               "prepare_mla_decode", capture_ok=False)
    new_out, new_lse, launch = _decode_launch(sp, out, lse, s, dl, backend, num_splits, None,
                                              lambda sizes, zero: _workspace.alloc(sp.device, s, sizes, zero))
    plans = launch.plans(sp, s)
    _sync(s, sp.device)
    o, lo = _export(q, out, lse, new_out, new_lse, s, sp.device)
    grid, block, smem, _ = launch.dense_parts[0]
    return PreparedMlaDecode(
        device=sp.device, _plans=plans, _out=(o, lo),
        _keep=(q, k_cache, *sparse.values(), o, lo, new_out, new_lse, launch.ws), _status=None, _status_names=(),
        route=f"mla_sparse+{launch.variant.name}", num_splits=launch.splits, grid=grid, block=block,
        dynamic_smem=smem, workspace_bytes=launch.ws.nbytes, arch=launch.dense.arch, batch=sp.b, capacity=sp.cap,
    )
