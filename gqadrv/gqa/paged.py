"""Paged GQA decode, multi-token queries, LSE output and the batch-invariant mode (family "paged",
kernels/gqa/sm80/decode_paged.cu; contract in gqa/paged_contract.py).

    out            = gqa_decode_paged(q, k_cache, v_cache, block_table, seq_lens, kv_layout="NHD")
    out, lse       = gqa_decode_paged(..., return_lse=True)
    p              = prepare_gqa_decode_paged(q=..., k_cache=..., v_cache=..., block_table=..., seq_lens=..., out=...)
    out[, lse]     = launch_prepared(p)

``gqa_decode`` / ``prepare_gqa_decode`` route here for a 4-D q, an LSE output or
``deterministic=True`` (the contiguous cache as one page per request).

Splits: by default the KV sub-tiles of each request's own length are balanced over S splits (S
from the grid-filling heuristic of routes.default_splits). ``deterministic=True``: split s owns
tokens [s * T, (s + 1) * T) with T = DET_SPLIT_TOKENS (larger only when the capacity needs more
than 64 splits: T = capacity / 64 rounded up to whole sub-tiles), and the splits are merged one
after another in split order, so a request's output depends only on its own data and length:
bitwise identical in any batch, at any position, run after run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal, overload

from ..ops import kernels as _kernels
from ..ops import outputs as _outputs
from ..ops import workspace as _workspace
from ..ops.bounded import BoundedMap
from ..ops.kernels import Loaded
from ..ops.plans import launch_packed
from ..ops.workspace import Workspace
from ..runtime import driver as _drv
from ..runtime.module import ArgPack, LaunchPlan, launch_plans
from ..runtime.tensormap import TensorMapError, TmaSpec, encode_tiled, validate_tiled
from ..ops.prepared import prepare_streams
from ..runtime.streams import launch_streams
from ..types import ArrayT, Backend, DLPackArray, OutT, StreamLike
from . import paged_layouts as _paged_layouts
from . import routes as _routes
from .api import PreparedGqaDecode
from .args import GQA_FLAG_L2_EVICT_FIRST
from .contract import MAX_SPLITS, check_num_splits, check_scale_pair
from .paged_args import GQA_PAGED_FLAG_HND, GQA_PAGED_FLAG_SPEC, GQA_PAGED_NEXT_SHIFT
from .paged_contract import PagedProblem, contiguous_problem, validate_paged

__all__ = ["DET_SPLIT_TOKENS", "PreparedGqaPagedDecode", "gqa_decode_paged", "prepare_gqa_decode_paged"]

DET_SPLIT_TOKENS = 2048
WORKSPACE_ZERO = ("counters",)
STATUS_NAMES = ((1, "empty"), (2, "clamped"), (3, "bad_page"))
_LN2 = math.log(2.0)
_routes_cache = BoundedMap(1024)
_tmaps = BoundedMap(512)
TMA_MIN_PAGE = 16   # smaller pages take the cp.async route (a box per page would be too small)


# ----------------------------------------------------------------------------- plan
def _tma_specs(problem: PagedProblem, tok: int) -> tuple[TmaSpec, TmaSpec] | None:
    """The K and V pool tensor maps of the TMA route, or None when the pools are not describable
    (then the cp.async route reads them): NHD (D, Hkv, page, pages) with box {64, 1, BT, 1}, HND
    (D, page, Hkv, pages) with box {64, BT, 1, 1}, BT = min(TOK, page)."""
    D, Hkv, page, P = problem.head_dim, problem.num_kv_heads, problem.page_size, problem.num_pages
    bt = min(tok, page)
    es = problem.k.itemsize
    hs, ts, ps = problem.head_stride * es, problem.tok_stride * es, problem.page_stride * es
    inner = 128 // es  # elements per 128-byte box row (fp16 / bf16: 64, e4m3: 128)
    if problem.layout == "NHD":
        dims, strides, box = (D, Hkv, page, P), (hs, ts, ps), (inner, 1, bt, 1)
    else:
        dims, strides, box = (D, page, Hkv, P), (ts, hs, ps), (inner, bt, 1, 1)
    # strides of size-1 dimensions are never used: give them a legal value
    strides = tuple(s if d > 1 else max(16, s - s % 16) for s, d in zip(strides, dims[1:]))
    dtype = "uint8" if problem.kv8 else problem.dtype
    specs = tuple(TmaSpec(dtype=dtype, address=a, dims=dims, strides=strides, box=box, swizzle="128b")
                  for a in (problem.k_ptr, problem.v_ptr))
    try:
        for sp in specs:
            validate_tiled(sp)
    except TensorMapError:
        return None
    return specs[0], specs[1]


def tma_maps(problem: PagedProblem) -> tuple[bytes, bytes] | None:
    """Encoded K / V maps of the TMA route, or None where TMA cannot describe the pools. Cached by
    addresses and geometry (the answer "not describable" too), so a repeated call builds, validates
    and encodes nothing."""
    if problem.table is None or problem.page_size < TMA_MIN_PAGE:
        return None
    if problem.kv8 and problem.head_dim < _routes.E4M3_TMA_MIN_HEAD_DIM:
        return None
    tok, key = _tma_key(problem)
    hit = _tmaps.get(key)
    if hit is None:
        specs = _tma_specs(problem, tok)
        maps: tuple[bytes, bytes] | None = None
        if specs is not None:
            try:
                with _drv.device_scope(problem.device):
                    maps = (encode_tiled(specs[0]), encode_tiled(specs[1]))
            except (TensorMapError, _drv.CudaDriverError):
                maps = None
        hit = _tmaps.put(key, (maps, specs if maps is not None else None))
    return hit[0]


def tma_map_specs(problem: PagedProblem) -> tuple[TmaSpec, TmaSpec] | None:
    """The specs of the maps ``tma_maps`` gave for this problem (kept with them), or None."""
    tok, key = _tma_key(problem)
    hit = _tmaps.get(key)
    return hit[1] if hit is not None else _tma_specs(problem, tok)


def _tma_key(problem: PagedProblem) -> tuple[int, tuple]:
    """(the TMA route's tokens per box row, the tensor-map cache key: addresses and geometry)."""
    tok = _routes.tiling_for("paged_tma", problem.head_dim, problem.kv8).tok
    return tok, (problem.device, problem.k_ptr, problem.v_ptr, problem.layout, problem.dtype, problem.kv8,
                 problem.head_dim, problem.num_kv_heads, problem.page_size, problem.num_pages, problem.page_stride,
                 problem.tok_stride, problem.head_stride, tok)


def route(problem: PagedProblem, backend: str | None,
          deterministic: bool = False) -> tuple[_routes.Variant, Loaded, tuple[bytes, bytes] | None]:
    """(variant, loaded kernel, tensor maps or None): the TMA route on sm_90 for TMA-describable
    pools with page size >= TMA_MIN_PAGE (unless backend 'portable'), the cp.async route otherwise.
    The batch-invariant mode skips the large-batch rule, so a request's kernel (and with it the
    order of its sums) never depends on the batch it is in."""
    info = _drv.device_info(problem.device)
    maps = None
    native, forced = _routes._native_and_forced(info.cc, backend)
    if native == "hopper" and forced in (None, "hopper"):
        # the large-batch rule of the contiguous routes (routes.prefers_portable): from two waves
        # of CTAs on, the cp.async kernel streams a cold cache faster (docs/RESULTS.md, paged table)
        units = problem.batch * problem.num_kv_heads * -(-problem.rows // _routes.rows_for_group(problem.rows))
        # (e4m3 caches: the TMA kernel is as fast or faster at every batch, docs/RESULTS.md, FP8 tilings)
        if forced == "hopper" or deterministic or problem.kv8 or not _routes.prefers_portable(
                info.cc, problem.head_dim, units, info.sm_count):
            maps = tma_maps(problem)
    key = (problem.device, problem.head_dim, problem.dtype, problem.kv8, problem.rows > 8, backend, maps is not None,
           _routes.tuning_env())
    hit = _routes_cache.get(key)
    if hit is None:
        v = _routes.select_paged_variant(info.cc, problem.head_dim, problem.dtype, problem.rows, backend,
                                         tma_ok=maps is not None, kv8=problem.kv8)
        hit = _routes_cache.put(key, (v, _kernels.load(v, problem.device)))
    return hit[0], hit[1], maps


def row_blocks(problem: PagedProblem, variant: _routes.Variant) -> int:
    return -(-problem.rows // variant.rows)


def deterministic_split_subs(capacity: int, tok: int) -> tuple[int, int]:
    """(splits, sub-tiles per split) of the batch-invariant mode for a capacity in tokens."""
    nsub = -(-capacity // tok)
    subs = max(1, DET_SPLIT_TOKENS // tok)
    if -(-nsub // subs) > MAX_SPLITS:
        subs = -(-nsub // MAX_SPLITS)
    return max(1, -(-nsub // subs)), subs


def splits_for(problem: PagedProblem, variant: _routes.Variant, loaded: Loaded, deterministic: bool,
               requested: int | None) -> tuple[int, int]:
    """(num_splits, split_subs) of a launch."""
    if deterministic:
        if requested is not None:
            raise ValueError("num_splits cannot be combined with deterministic=True: the batch-invariant mode fixes "
                             f"the split size ({DET_SPLIT_TOKENS} tokens)")
        return deterministic_split_subs(problem.capacity, variant.tiling.tok)
    if requested is not None:
        return requested, 0
    info = _drv.device_info(problem.device)
    units = problem.batch * row_blocks(problem, variant)
    splits = _routes.default_splits(variant, units, problem.num_kv_heads, problem.capacity, info.sm_count,
                                    loaded.ctas_per_sm)
    csmem = variant.dynamic_smem + _routes.cluster_recv_bytes(variant)
    return _routes.cluster_splits(variant, units, problem.num_kv_heads, problem.capacity, splits,
                                  lambda S: _kernels.max_active_clusters(loaded, S, csmem, variant.block,
                                                                         problem.device), extra_rounds=0), 0


def workspace_sizes(problem: PagedProblem, variant: _routes.Variant, splits: int) -> dict:
    units = problem.batch * problem.num_kv_heads * row_blocks(problem, variant)
    rows = variant.rows
    return {"ws_o": (units * splits * rows * problem.head_dim, "f32"),
            "ws_ml": (units * splits * rows * 2, "f32"),
            "counters": (units, "u32")}


SPEC_MAX_HEAD_DIM = 128  # SPEC_BUILD of kernels/gqa/sm90/decode_paged_tma.cu (D 256 has no register for it)


def _grid_ctas(problem: PagedProblem, variant: _routes.Variant, splits: int) -> int:
    """CTAs of a launch with one CTA per (batch, KV head, row block, split)."""
    return problem.batch * problem.num_kv_heads * row_blocks(problem, variant) * splits


def _resident_ctas(problem: PagedProblem, ctas_per_sm: int) -> int:
    """CTAs of the route's kernel resident at once on the problem's GPU."""
    return _drv.device_info(problem.device).sm_count * max(1, ctas_per_sm)


def speculates(problem: PagedProblem, variant: _routes.Variant, ctas_per_sm: int, splits: int) -> bool:
    """Whether the TMA kernel fills its ring before the length is known (GQA_PAGED_FLAG_SPEC,
    kernels/gqa/sm90/decode_paged_tma.cu): for grids of one wave, where each CTA's start is on the
    critical path (a wave behind another hides it, and a wrong guess costs a ring fill of reads).
    Head dims up to SPEC_MAX_HEAD_DIM. GQADRV_PAGED_SPEC=0 turns it off (tuning only)."""
    if (variant.family.name != "paged_tma" or variant.head_dim > SPEC_MAX_HEAD_DIM or problem.table is None
            or os.environ.get("GQADRV_PAGED_SPEC") == "0"):
        return False
    return _grid_ctas(problem, variant, splits) <= _resident_ctas(problem, ctas_per_sm)


def multi_build(variant: _routes.Variant) -> bool:
    """Whether a TMA build walks several units per CTA (GQA_PAGED_MULTI, a development switch: MULTI_BUILD of
    kernels/gqa/sm90/decode_paged_tma.cu): D <= 128 and a warp's state (ROWS x (D + 8) floats and the
    {m, l} pairs) fits one ring slot (K and V of TOK tokens)."""
    if (not variant.switches or variant.family.name != "paged_tma"
            or not dict(variant.switches).get("GQA_PAGED_MULTI", 0)):
        return False
    d, rows, tok = variant.head_dim, variant.rows, variant.tiling.tok
    kv_bytes = max(d, 128) * tok if variant.kv8 else d * tok * 2
    return d <= SPEC_MAX_HEAD_DIM and rows * 2 * 4 + rows * (d + 8) * 4 <= 2 * kv_bytes


def successor_stride(problem: PagedProblem, variant: _routes.Variant, ctas_per_sm: int, splits: int) -> int:
    """G for the TMA kernel's successor prefetch (GQA_PAGED_NEXT builds, a development switch,
    GQADRV_PAGED_NEXT=n): the co-resident CTAs of a launch of more than one wave (CTA x + G takes the
    SM that x frees), else 0 (no prefetch; one-wave grids speculate instead, ``speculates``)."""
    if (not variant.switches or dict(variant.switches).get("GQA_PAGED_NEXT", 0) <= 0
            or variant.head_dim > SPEC_MAX_HEAD_DIM or problem.table is None):
        return 0
    resident = _resident_ctas(problem, ctas_per_sm)
    return resident if _grid_ctas(problem, variant, splits) > resident and resident < (1 << 15) else 0


def _flags(problem: PagedProblem, spec: bool = False, next_stride: int = 0) -> int:
    info = _drv.device_info(problem.device)
    kv_bytes = problem.k.nbytes * (1 if problem.v is None else 2)
    f = GQA_FLAG_L2_EVICT_FIRST if kv_bytes * 2 > info.l2_bytes else 0
    return (f | (GQA_PAGED_FLAG_HND if problem.layout == "HND" else 0) | (GQA_PAGED_FLAG_SPEC if spec else 0)
            | (next_stride << GQA_PAGED_NEXT_SHIFT))


def args_fields(problem: PagedProblem, variant: _routes.Variant, *, out_ptr: int, lse_ptr: int,
                ws: Workspace | None, status_ptr: int, splits: int, split_subs: int, spec: bool = False,
                next_stride: int = 0) -> dict:
    """The GqaPagedArgs block by field name (gqa/paged_args.py mirrors kernels/gqa/common/paged_args.cuh)."""
    paged = problem.table is not None
    return {
        "q": problem.q.ptr, "k": problem.k_ptr, "v": problem.v_ptr, "out": out_ptr, "lse": lse_ptr,
        "lengths": problem.lengths.ptr, "table": problem.table.ptr if paged else 0,
        "ws_o": ws.ptr("ws_o") if ws else 0, "ws_ml": ws.ptr("ws_ml") if ws else 0,
        "counters": ws.ptr("counters") if ws else 0, "status": status_ptr,
        "page_stride": problem.page_stride, "tok_stride": problem.tok_stride, "head_stride": problem.head_stride,
        "scale_log2": problem.sm_scale / _LN2,
        "hkv": problem.num_kv_heads, "group": problem.group, "s_q": problem.s_q, "rows": problem.rows,
        "row_blocks": row_blocks(problem, variant),
        "page_shift": problem.page_size.bit_length() - 1 if paged else 0,
        "num_pages": problem.num_pages, "table_stride": problem.table_stride, "capacity": problem.capacity,
        "num_splits": splits, "split_subs": split_subs, "flags": _flags(problem, spec, next_stride),
        "k_scale": problem.scales.k_ptr, "v_scale": problem.scales.v_ptr,
        "k_scale_value": problem.scales.k_value, "v_scale_value": problem.scales.v_value,
        "k_scale_stride": problem.scales.k_stride, "v_scale_stride": problem.scales.v_stride,
        "units": _grid_ctas(problem, variant, 1),
    }


def param_values(variant: _routes.Variant, maps: tuple[bytes, bytes] | None, args: dict) -> tuple:
    """One value per kernel parameter: (k_map, v_map, args) for the TMA family, (args,) otherwise."""
    if variant.family.uses_tma:
        assert maps is not None
        return (maps[0], maps[1], args)
    return (args,)


def launch_shape(problem: PagedProblem, variant: _routes.Variant, loaded: Loaded, splits: int,
                 split_subs: int) -> tuple[tuple, tuple, int, tuple | None]:
    """(grid, block, dynamic smem, cluster dims or None): one CTA per (batch, KV head, row block,
    split); the balanced splits of the TMA kernel as clusters of ``splits`` CTAs with the receive
    area added (kernels/gqa/common/cluster_merge.cuh) when ``routes.cluster_merge_applies`` and
    every unit's cluster is resident at once (cuOccupancyMaxActiveClusters), as plan.launch_shape."""
    units = problem.batch * problem.num_kv_heads * row_blocks(problem, variant)
    grid = (units * splits, 1, 1)
    if split_subs == 0 and _routes.cluster_merge_applies(variant, splits):
        csmem = variant.dynamic_smem + _routes.cluster_recv_bytes(variant)
        if units <= _kernels.max_active_clusters(loaded, splits, csmem, variant.block, problem.device):
            return grid, variant.block, csmem, (splits, 1, 1)
    if (splits == 1 and split_subs == 0 and multi_build(variant)
            and not speculates(problem, variant, loaded.ctas_per_sm, splits)):
        # GQA_PAGED_MULTI=K builds (development; the kernel walks units x, x + grid, ... exactly for one-split
        # launches without speculation or clusters): K >= 2 units per CTA, the hardware still placing the
        # CTAs on the SMs that free first; K = 1 the resident CTAs (a static order, measured 2026-12-08)
        k = dict(variant.switches)["GQA_PAGED_MULTI"]
        grid = (min(units, _resident_ctas(problem, loaded.ctas_per_sm)) if k <= 1 else -(-units // k), 1, 1)
    return grid, variant.block, variant.dynamic_smem, None


def _split_workspace(problem, variant, splits, stream, pooled: bool) -> Workspace | None:
    if splits <= 1:
        return None
    sizes = workspace_sizes(problem, variant, splits)
    if pooled:
        return _workspace.pooled(problem.device, stream, sizes, WORKSPACE_ZERO)
    return _workspace.alloc(problem.device, stream, sizes, WORKSPACE_ZERO)



def _check_flags(return_lse: Any, deterministic: Any) -> None:
    for name, v in (("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")


# ----------------------------------------------------------------------------- convenience call
def run_convenience(problem: PagedProblem, s: int, like: Any, want_lse: bool, deterministic: bool,
                    splits_req: int | None, backend: str | None, out: Any, lse: Any, facts: tuple | None = None) -> Any:
    """Route, allocate what the caller did not give (on ``s``), launch; returns out or (out, lse).
    ``facts`` (gqa_decode_paged's layout key, gqa/paged_layouts.py): the launch gets a plan of its
    own, kept under that key."""
    variant, loaded, maps = route(problem, backend, deterministic)
    splits, subs = splits_for(problem, variant, loaded, deterministic, splits_req)
    dev = problem.device
    o_new = _outputs.allocate(like, problem.out_shape, problem.dtype, dev, s) if problem.out is None else None
    l_new = _outputs.allocate(like, problem.lse_shape, "float32", dev, s) if want_lse and problem.lse is None else None
    out_ptr = problem.out.ptr if o_new is None else o_new.ptr
    lse_ptr = problem.lse.ptr if problem.lse is not None else (l_new.ptr if l_new is not None else 0)
    ws = _split_workspace(problem, variant, splits, s, pooled=True)
    args = args_fields(problem, variant, out_ptr=out_ptr, lse_ptr=lse_ptr, ws=ws, status_ptr=0, splits=splits,
                       split_subs=subs, spec=speculates(problem, variant, loaded.ctas_per_sm, splits),
                       next_stride=successor_stride(problem, variant, loaded.ctas_per_sm, splits))
    grid, block, smem, cluster = launch_shape(problem, variant, loaded, splits, subs)
    values = param_values(variant, maps, args)
    if facts is None:
        launch_packed(loaded.kernel, grid, block, smem, variant.family.signature, s, values, dev, cluster=cluster)
    else:
        plan = LaunchPlan(loaded.kernel, grid, block, smem, ArgPack(variant.family.signature).pack(*values), stream=s,
                          pdl=True, cluster=cluster)
        launch_plans((plan,), dev)
        sc = problem.scales
        ptrs = (problem.q.ptr, problem.k.ptr, problem.v.ptr if problem.v is not None else 0,
                problem.table.ptr if problem.table is not None else 0, problem.lengths.ptr, out_ptr, lse_ptr,
                sc.k_ptr, sc.v_ptr)
        _paged_layouts.remember(facts, problem, variant, plan, ws, ptrs, want_lse,
                                tma_map_specs(problem) if variant.family.uses_tma else None)
    o = out if o_new is None else _outputs.hand_back(o_new, like, s, dev)
    if not want_lse:
        return o
    lo = lse if l_new is None else _outputs.hand_back(l_new, like, s, dev)
    return o, lo


@overload
def gqa_decode_paged(q: ArrayT, k_cache: DLPackArray, v_cache: DLPackArray | None, block_table: DLPackArray,
                     seq_lens: DLPackArray, *, kv_layout: str = "NHD", out: None = None, lse: None = None,
                     return_lse: Literal[False] = False, q_scale: float = 1.0, sm_scale: float | None = None,
                     deterministic: bool = False, num_splits: int | None = None, stream: StreamLike | None = None,
                     backend: Backend | None = None, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                     v_scale: float | DLPackArray | None = None) -> ArrayT: ...
@overload
def gqa_decode_paged(q: DLPackArray, k_cache: DLPackArray, v_cache: DLPackArray | None, block_table: DLPackArray,
                     seq_lens: DLPackArray, *, kv_layout: str = "NHD", out: OutT, lse: None = None,
                     return_lse: Literal[False] = False, q_scale: float = 1.0, sm_scale: float | None = None,
                     deterministic: bool = False, num_splits: int | None = None, stream: StreamLike | None = None,
                     backend: Backend | None = None, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                     v_scale: float | DLPackArray | None = None) -> OutT: ...
@overload
def gqa_decode_paged(q: DLPackArray, k_cache: DLPackArray, v_cache: DLPackArray | None, block_table: DLPackArray,
                     seq_lens: DLPackArray, *, kv_layout: str = "NHD", out: DLPackArray | None = None,
                     lse: DLPackArray | None = None, return_lse: bool = False, q_scale: float = 1.0,
                     sm_scale: float | None = None, deterministic: bool = False, num_splits: int | None = None,
                     stream: StreamLike | None = None, backend: Backend | None = None, kv_dtype: str | None = None,
                     k_scale: float | DLPackArray | None = None, v_scale: float | DLPackArray | None = None) -> tuple[Any, Any]: ...
def gqa_decode_paged(q: DLPackArray, k_cache: DLPackArray, v_cache: DLPackArray | None, block_table: DLPackArray,
                     seq_lens: DLPackArray, *, kv_layout: str = "NHD", out: DLPackArray | None = None,
                     lse: DLPackArray | None = None, return_lse: bool = False, q_scale: float = 1.0,
                     sm_scale: float | None = None, deterministic: bool = False, num_splits: int | None = None,
                     stream: StreamLike | None = None, backend: Backend | None = None, kv_dtype: str | None = None,
                     k_scale: float | DLPackArray | None = None, v_scale: float | DLPackArray | None = None) -> Any:
    """GQA decode from a paged KV cache.

    q [B, Hq, D] or [B, s_q, Hq, D] (s_q 1..16; query token j sees keys [0, L - (s_q - 1 - j)),
    bottom-right causal), fp16 or bf16. kv_layout 'NHD': k_cache, v_cache [num_pages, page_size,
    Hkv, D]; 'HND': [num_pages, Hkv, page_size, D]; v_cache=None: one combined k_cache [num_pages, 2,
    page_size, Hkv, D] / [num_pages, 2, Hkv, page_size, D]. page_size a power of two; the page
    dimension may have any stride; strides multiples of 8 elements. block_table int32 [B,
    max_pages] (stride(1) == 1, any row stride), seq_lens int32 [B]: read on the device only;
    lengths are clamped to [0, max_pages * page_size], table entries past a request's pages are
    never read, and a page id outside [0, num_pages) reads as zeros (never a fault; reported by
    ``check_status`` of a prepared launch).
    Scale: softmax(sm_scale * q.k), sm_scale absolute (default 1/sqrt(D)) or q_scale = sm_scale *
    sqrt(D); not both. ``return_lse=True`` (or ``lse`` given) returns (out, lse): lse fp32 [B, s_q,
    Hq] (4-D q) or [B, Hq], natural log, +inf for a row without keys (whose out is 0).
    ``deterministic=True``: batch-invariant, run-to-run identical results (module docstring).
    ``num_splits``: None (heuristic) or 1..64. Asynchronous on ``stream`` (default: the current
    stream of q's framework); outputs come back in q's framework.
    FP8 caches: K / V as float8_e4m3fn arrays, or uint8 / int8 e4m3 codes with ``kv_dtype='e4m3'``
    (``quantize_kv_fp8`` makes them); ``k_scale`` / ``v_scale``: None (1.0), a number, or a float32
    device array () / (1,) per tensor or (Hkv,) per KV head; element = float(code) * scale
    (gqadrv.gqa.kv_dtype). Output and LSE as for fp16 caches (q's dtype).
    """
    facts = _paged_layouts.call_facts(q, k_cache, v_cache, block_table, seq_lens, out, lse, kv_layout, return_lse,
                                      q_scale, sm_scale, deterministic, num_splits, stream, backend, kv_dtype, k_scale,
                                      v_scale)
    want_lse = return_lse is True or lse is not None
    r = _paged_layouts.try_layout(facts, q, (q, k_cache, v_cache, block_table, seq_lens, out, lse, k_scale, v_scale),
                                  out, lse, want_lse)
    if r is not _paged_layouts.MISS:
        return r
    _check_flags(return_lse, deterministic)
    check_scale_pair(q_scale, sm_scale)
    b = _routes.check_backend(backend)
    splits_req = check_num_splits(num_splits)
    s, dl_stream = launch_streams(q, (q, k_cache, v_cache, block_table, seq_lens, out, lse, k_scale, v_scale),
                                  stream)
    problem = validate_paged(q, k_cache, v_cache, block_table, seq_lens, kv_layout, out, lse, q_scale, sm_scale,
                             stream=dl_stream, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    return run_convenience(problem, s, q, want_lse, deterministic, splits_req, b, out, lse, facts)


def contiguous_decode(q: Any, kv: Any, lengths: Any, *, out: Any, lse: Any, return_lse: bool, deterministic: bool,
                      q_scale: Any, sm_scale: Any, stream: Any, backend: Any, kv_dtype: Any = None,
                      k_scale: float | DLPackArray | None = None, v_scale: float | DLPackArray | None = None) -> Any:
    """gqa_decode for a 4-D q, an LSE output, deterministic=True or an FP8 cache (contiguous cache
    as pages); repeated calls of one layout take its plan (gqa/paged_layouts.py, layout "contiguous")."""
    facts = _paged_layouts.call_facts(q, kv, None, None, lengths, out, lse, "contiguous", return_lse, q_scale,
                                      sm_scale, deterministic, None, stream, backend, kv_dtype, k_scale, v_scale)
    want_lse = return_lse is True or lse is not None
    r = _paged_layouts.try_layout(facts, q, (q, kv, lengths, out, lse, k_scale, v_scale), out, lse, want_lse)
    if r is not _paged_layouts.MISS:
        return r
    _check_flags(return_lse, deterministic)
    check_scale_pair(q_scale, sm_scale)
    b = _routes.check_backend(backend)
    s, dl_stream = launch_streams(q, (q, kv, lengths, out, lse, k_scale, v_scale), stream)
    problem = contiguous_problem(q, kv, lengths, out, lse, q_scale, sm_scale, stream=dl_stream, kv_dtype=kv_dtype,
                                 k_scale=k_scale, v_scale=v_scale)
    return run_convenience(problem, s, q, want_lse, deterministic, None, b, out, lse, facts)


# ----------------------------------------------------------------------------- prepared API
@dataclasses.dataclass(frozen=True, repr=False)
class PreparedGqaPagedDecode(PreparedGqaDecode[Any]):
    """Result of ``prepare_gqa_decode_paged`` (and of ``prepare_gqa_decode`` for 4-D Q, LSE or
    deterministic): ``launch_prepared`` returns out, or (out, lse) when lse was given.
    ``check_status`` reports ``empty`` (length <= 0), ``clamped`` (length > capacity) and
    ``bad_page`` (a used table entry outside [0, num_pages)) requests."""

    def _decode_status(self, words: Any) -> dict[str, list[int]]:
        w = words.reshape(self.batch, -1)
        return {"empty": [i for i in range(self.batch) if w[i, 0] == 1],
                "clamped": [i for i in range(self.batch) if w[i, 0] == 2],
                "bad_page": [i for i in range(self.batch) if w[i, 1:].any()]}


def prepare_problem(problem: PagedProblem, keep: tuple, result: Any, *, deterministic: bool,
                    splits_req: int | None, backend: str | None, s: int) -> PreparedGqaPagedDecode:
    """Route, compile, allocate the workspace and status, pack the launch once."""
    variant, loaded, maps = route(problem, backend, deterministic)
    splits, subs = splits_for(problem, variant, loaded, deterministic, splits_req)
    ws = _split_workspace(problem, variant, splits, s, pooled=False)
    import cupy

    words = problem.batch * (1 + splits)
    with cupy.cuda.Device(problem.device):
        status = cupy.empty(words, dtype=cupy.uint32)
    args = args_fields(problem, variant, out_ptr=problem.out.ptr, lse_ptr=problem.lse.ptr if problem.lse else 0,
                       ws=ws, status_ptr=int(status.data.ptr), splits=splits, split_subs=subs,
                       spec=speculates(problem, variant, loaded.ctas_per_sm, splits),
                       next_stride=successor_stride(problem, variant, loaded.ctas_per_sm, splits))
    grid, block, smem, cluster = launch_shape(problem, variant, loaded, splits, subs)
    pack = ArgPack(variant.family.signature).pack(*param_values(variant, maps, args))
    plan = LaunchPlan(loaded.kernel, grid, block, smem, pack, stream=s, pdl=True, cluster=cluster)
    drv = _drv.driver()
    with _drv.device_scope(problem.device):
        _drv.check(drv.cuMemsetD32Async(int(status.data.ptr), 0, words, s), "cuMemsetD32Async(status)")
        # the workspace counters and the status must be zero before the first launch on any stream
        _drv.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize(prepare)")
    return PreparedGqaPagedDecode(
        device=problem.device, _plans=(plan,), _out=result, _keep=keep + problem.scales.views + (ws, status), _status=status,
        _status_names=STATUS_NAMES, route=variant.name, num_splits=splits, grid=grid, block=block, dynamic_smem=smem,
        workspace_bytes=ws.nbytes if ws else 0, arch=loaded.arch, batch=problem.batch, capacity=problem.capacity,
    )


def prepare_gqa_decode_paged(*, q: DLPackArray, k_cache: DLPackArray, block_table: DLPackArray,
                             seq_lens: DLPackArray, out: DLPackArray, v_cache: DLPackArray | None = None,
                             lse: DLPackArray | None = None, kv_layout: str = "NHD", q_scale: float | None = None,
                             sm_scale: float | None = None, deterministic: bool = False,
                             num_splits: int | None = None, stream: StreamLike | None = None,
                             backend: Backend | None = None, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                             v_scale: float | DLPackArray | None = None) -> PreparedGqaPagedDecode:
    """Validate, route, compile, allocate and pack a paged decode once (arguments as in
    ``gqa_decode_paged``; ``out`` is required, ``lse`` optional). ``launch_prepared(p)`` then
    launches it with no host work (graph-capturable); it reads ``seq_lens``, ``block_table`` and
    device ``k_scale`` / ``v_scale`` on the device at every launch, so in-place updates between
    graph replays are honoured. Call outside CUDA-graph capture."""
    _check_flags(False, deterministic)
    check_scale_pair(q_scale, sm_scale)
    b = _routes.check_backend(backend)
    splits_req = check_num_splits(num_splits)
    if out is None:
        raise ValueError("out (the output tensor) is required by the prepared API")
    s, dl_stream = prepare_streams(q, (q, k_cache, v_cache, block_table, seq_lens, out, lse, k_scale, v_scale),
                                   stream, "prepare_gqa_decode_paged")
    problem = validate_paged(q, k_cache, v_cache, block_table, seq_lens, kv_layout, out, lse,
                             1.0 if q_scale is None else q_scale, sm_scale, stream=dl_stream, kv_dtype=kv_dtype,
                             k_scale=k_scale, v_scale=v_scale)
    result = out if lse is None else (out, lse)
    return prepare_problem(problem, (q, k_cache, v_cache, block_table, seq_lens, out, lse), result,
                           deterministic=deterministic, splits_req=splits_req, backend=b, s=s)
