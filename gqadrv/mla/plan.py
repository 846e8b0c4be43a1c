"""Building MLA decode launches: route + kernel, split count, workspace, the named argument block
and the ``LaunchPlan`` (PDL on). Split-KV is merged inside the kernel (the last CTA of each
(request, KV head, row block) merges), so one launch per decode; the split bounds come from the
device-side lengths at every launch."""

from __future__ import annotations

from ..ops import kernels as _kernels
from ..ops.bounded import BoundedMap
from ..ops.kernels import Loaded
from ..ops.registry import require_features
from ..ops.workspace import Workspace
from ..runtime import driver as _drv
from ..runtime.module import ArgPack, LaunchPlan
from ..runtime.tensormap import TmaSpec, encode_tiled
from . import kernel_spec as _ks
from . import routes as _routes
from .contract import MlaProblem

__all__ = ["WORKSPACE_ZERO", "args_fields", "build_launch", "default_splits", "features_of", "k_tensor_maps",
           "k_tensor_specs", "launch_parts", "param_values", "route", "tma_ok", "workspace_sizes"]

WORKSPACE_ZERO = ("counters",)
_routes_cache = BoundedMap(256)
_tmaps = BoundedMap(512)


def features_of(problem: MlaProblem) -> set[str]:
    """The kernel features a problem needs (checked against the routed family's declaration)."""
    f = {"dense_kv", "paged_kv", "lse", "fp16" if problem.dtype == "float16" else "bf16"}
    if problem.kv_fp8:
        f.add("fp8_kv")
    if problem.causal:
        f.add("causal")
    if problem.s_q > 1:
        f.add("multi_token")
    return f


def tma_ok(problem: MlaProblem) -> bool:
    """k_cache can be read by the TMA seesaw (kernel_spec.tma_eligible)."""
    k = problem.k_cache
    if problem.kv_fp8 or problem.nope:
        return False  # the FP8 kernels read K through registers; 512-channel rows are gathered
    return _ks.tma_eligible(problem.page_size, k.ptr, tuple(k.strides[:3]), problem.num_blocks)


def k_tensor_specs(problem: MlaProblem, boxes: tuple = (4, 5)) -> tuple[TmaSpec, ...]:
    """The tensor-map specs of k_cache for a TMA family, one per entry of its ``tma_boxes``."""
    k = problem.k_cache
    maps = _ks.k_tensor_maps(problem.page_size, problem.h_kv, problem.num_blocks, tuple(k.strides[:3]), boxes)
    return tuple(TmaSpec(dtype=problem.dtype, address=k.ptr, dims=g["dims"], strides=g["strides"], box=g["box"],
                         swizzle="128b") for g in maps)


def k_tensor_maps(problem: MlaProblem, boxes: tuple = (4, 5)) -> tuple[bytes, ...]:
    """The 128-byte CUtensorMaps of k_cache for a TMA family (one per entry of its ``tma_boxes``),
    encoded once per (address, geometry, boxes)."""
    k = problem.k_cache
    key = (problem.device, k.ptr, problem.dtype, problem.page_size, problem.h_kv, problem.num_blocks, tuple(k.strides),
           boxes)
    hit = _tmaps.get(key)
    if hit is None:
        hit = _tmaps.put(key, tuple(encode_tiled(spec) for spec in k_tensor_specs(problem, boxes)))
    return hit


def param_values(problem: MlaProblem, variant: _routes.MlaVariant, fields: dict) -> tuple:
    """The kernel's parameter values in signature order: (tensor maps..., args) for TMA families, else (args,)."""
    return (*k_tensor_maps(problem, variant.family.tma_boxes), fields) if variant.family.tma else (fields,)


def large_batch(problem: MlaProblem) -> bool:
    """The requests' 64-row blocks fill 3/4 of the SMs (kernel_spec.choose_num_splits would not split):
    the balanced grid's regime (routes.select_variant)."""
    units = problem.b * problem.h_kv * _ks.num_m_blocks(problem.s_q, problem.h_q, problem.h_kv, "seesaw")
    return units * 4 >= _drv.device_info(problem.device).sm_count * 3


def route(problem: MlaProblem, backend: str | None) -> tuple[_routes.MlaVariant, Loaded]:
    """The variant and its loaded module (routes.select_variant; the balanced grids where the batch
    fills the SMs: ``large_batch``)."""
    use_tma = tma_ok(problem)
    big = large_batch(problem)
    key = (problem.device, problem.dtype, problem.m_rows, backend, use_tma, problem.kv_fp8, problem.nope, big)
    hit = _routes_cache.get(key)
    if hit is None:
        info = _drv.device_info(problem.device)
        narrow = _routes.narrow_preferred(info.peak_dram_bytes_per_s, info.sm_count)
        variant = _routes.select_variant(info.cc, problem.dtype, problem.m_rows, backend, use_tma, problem.kv_fp8,
                                         problem.nope, big, narrow)
        require_features(variant.family, features_of(problem), "MLA decode")
        hit = _routes_cache.put(key, (variant, _kernels.load(variant, problem.device)))
    elif problem.causal or problem.s_q > 1:
        require_features(hit[0].family, features_of(problem), "MLA decode")
    return hit


def default_splits(problem: MlaProblem, variant: _routes.MlaVariant) -> int:
    info = _drv.device_info(problem.device)
    return _routes.default_splits(variant, problem.b, problem.s_q, problem.h_q, problem.h_kv, problem.capacity,
                                  info.sm_count)


def workspace_sizes(problem: MlaProblem, variant: _routes.MlaVariant, splits: int) -> dict:
    """{name: (elements, type)} for ops.workspace (kernel_spec gives bytes)."""
    nbytes = _ks.workspace_sizes(problem.b, problem.s_q, problem.h_q, problem.h_kv, splits, variant.family.name,
                                 no_cut=problem.no_cut)
    return {"ws_o": (nbytes["ws_o"] // 4, "f32"), "ws_ml": (nbytes["ws_ml"] // 4, "f32"),
            "counters": (nbytes["counters"] // 4, "u32")}


def args_fields(problem: MlaProblem, variant: _routes.MlaVariant, out, out_ptr: int, lse_ptr: int,
                ws: Workspace | None, splits: int) -> dict:
    """The MlaDecodeArgs block by field name; ``out`` = (shape strides in elements) of the output."""
    q, k = problem.q, problem.k_cache
    o_strides = out
    # the kernels address k_cache in 2-byte units: an FP8 cache's byte strides (multiples of 16) halved
    k_strides = tuple(st * k.itemsize // 2 for st in k.strides[:3]) if problem.kv_fp8 else tuple(k.strides[:3])
    return {
        "q": q.ptr, "k_cache": k.ptr, "block_table": problem.block_table.ptr, "cache_seqlens": problem.seqlens.ptr,
        "out": out_ptr, "lse": lse_ptr,
        "ws_o": ws.ptr("ws_o") if ws else 0, "ws_ml": ws.ptr("ws_ml") if ws else 0,
        "counters": ws.ptr("counters") if ws else 0,
        "q_stride_b": q.strides[0], "q_stride_s": q.strides[1], "q_stride_h": q.strides[2],
        "k_stride_block": k_strides[0], "k_stride_tok": k_strides[1], "k_stride_head": k_strides[2],
        "o_stride_b": o_strides[0], "o_stride_s": o_strides[1], "o_stride_h": o_strides[2],
        "bt_stride": problem.block_table.strides[0],
        "b": problem.b, "s_q": problem.s_q, "h_q": problem.h_q, "h_kv": problem.h_kv, "group": problem.group,
        "m_rows": problem.m_rows, "num_m_blocks": _ks.num_m_blocks(problem.s_q, problem.h_q, problem.h_kv, variant.family.name),
        "page_size": problem.page_size, "page_shift": _ks.page_shift(problem.page_size),
        "max_blocks": problem.max_blocks, "num_splits": splits,
        "flags": ((_ks.FLAG_CAUSAL if problem.causal else 0)
                  | (_ks.FLAG_MAX_LOGITS if problem.max_offset is not None else 0)
                  | (_ks.FLAG_NO_CUT if problem.no_cut else 0)
                  | (_ks.FLAG_KV_REUSE if problem.kv_reuse else 0)
                  | (_ks.FLAG_SINK if problem.sink_ptr else 0)),
        "scale_log2": _ks.scale_log2(problem.softmax_scale),
        "max_offset": problem.max_offset if problem.max_offset is not None else 0,
        "sink": problem.sink_ptr,
    }


def launch_parts(problem: MlaProblem, variant: _routes.MlaVariant, *, out_strides: tuple, out_ptr: int,
                 lse_ptr: int, ws: Workspace | None, splits: int) -> tuple[tuple, tuple, int, tuple]:
    """(grid, block, dynamic smem, parameter values in signature order) of one launch: what the
    prepared plan packs once and the convenience call packs into its cached plan."""
    grid, block, smem = _ks.launch_geometry(problem.b, problem.s_q, problem.h_q, problem.h_kv, splits,
                                            variant.family.name)
    fields = args_fields(problem, variant, out_strides, out_ptr, lse_ptr, ws, splits)
    return grid, block, smem, param_values(problem, variant, fields)


def build_launch(problem: MlaProblem, variant: _routes.MlaVariant, loaded: Loaded, *, out_strides: tuple,
                 out_ptr: int, lse_ptr: int, ws: Workspace | None, splits: int, stream: int) -> LaunchPlan:
    grid, block, smem, values = launch_parts(problem, variant, out_strides=out_strides, out_ptr=out_ptr,
                                             lse_ptr=lse_ptr, ws=ws, splits=splits)
    return LaunchPlan(loaded.kernel, grid, block, smem, ArgPack(variant.family.signature).pack(*values), stream=stream,
                      pdl=True)
