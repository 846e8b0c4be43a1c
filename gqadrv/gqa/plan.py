"""Building GQA launches: route + kernel, split count, workspace sizes, the named argument block,
the KV tensor map and the ``LaunchPlan`` — the one seam the API, the benchmark and the tools use.

    variant, loaded = route(problem, backend)
    splits = default_splits(problem, variant, loaded)          # or an explicit count
    plan = build_launch(problem, variant, loaded, out_ptr=..., ws=..., status_ptr=..., splits=..., stream=s)
"""

from __future__ import annotations

import math
import os

from ..ops import kernels as _kernels
from ..ops.bounded import BoundedMap
from ..ops.kernels import Loaded
from ..ops.workspace import Workspace
from ..runtime import driver as _drv
from ..runtime.module import ArgPack, LaunchPlan
from ..runtime.tensormap import TmaSpec, encode_tiled
from . import routes as _routes
from .args import GQA_FLAG_L2_EVICT_FIRST, GQA_FLAG_L2_PREFETCH
from .contract import GqaProblem

__all__ = ["args_fields", "build_launch", "default_splits", "flags_for", "kv_spec", "kv_tensor_map", "launch_shape", "splits_for",
           "kv_tensor_spec", "param_values", "route", "route_side", "scale_log2", "size_fields", "workspace_sizes",
           "workspace_sizes_for", "WORKSPACE_ZERO"]

_LN2 = math.log(2.0)
_routes_cache = BoundedMap(1024)
_tmaps = BoundedMap(512)
_splits = BoundedMap(4096)  # splits_for: (variant, device, B, Hkv, C, switch) -> count

WORKSPACE_ZERO = ("counters",)  # counters must be zero before the first launch; the kernels keep them so


def route_side(device: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int) -> tuple[bool, bool]:
    """What the route depends on besides dtype, heads, head dim, backend and tuning: whether the
    capacity is at most the short route's threshold, and the large-batch rule (routes.prefers_portable)."""
    info = _drv.device_info(device)
    return (capacity <= _routes.SHORT_CAPACITY_MAX,
            _routes.prefers_portable(info.cc, head_dim, batch * num_kv_heads, info.sm_count))


def route(problem: GqaProblem, backend: str | None) -> tuple[_routes.Variant, Loaded]:
    """The variant for ``problem`` on its device and the loaded kernel (cached per route side)."""
    short, large = route_side(problem.device, problem.batch, problem.num_kv_heads, problem.capacity, problem.head_dim)
    key = (problem.device, short, problem.head_dim, problem.dtype, problem.group, backend, large, _routes.tuning_env())
    hit = _routes_cache.get(key)
    if hit is None:
        info = _drv.device_info(problem.device)
        variant = _routes.select_variant(info.cc, problem.capacity, problem.head_dim, problem.dtype, problem.group,
                                         backend, problem.batch * problem.num_kv_heads, info.sm_count)
        hit = _routes_cache.put(key, (variant, _kernels.load(variant, problem.device)))
    return hit


def default_splits(problem: GqaProblem, variant: _routes.Variant, loaded: Loaded) -> int:
    return splits_for(variant, loaded, problem.device, problem.batch, problem.num_kv_heads, problem.capacity)


def splits_for(variant: _routes.Variant, loaded: Loaded, device: int, batch: int, num_kv_heads: int,
               capacity: int) -> int:
    """The default split count: ``routes.default_splits`` (the ticket merge's count), then
    ``routes.cluster_splits`` where the splits may merge in a cluster (residency from
    cuOccupancyMaxActiveClusters with the receive area added)."""
    key = (variant, device, batch, num_kv_heads, capacity, _routes.cluster_merge_switch())
    hit = _splits.get(key)
    if hit is not None:
        return hit
    info = _drv.device_info(device)
    splits = _routes.default_splits(variant, batch, num_kv_heads, capacity, info.sm_count, loaded.ctas_per_sm)
    csmem = variant.dynamic_smem + _routes.cluster_recv_bytes(variant)
    splits = _routes.cluster_splits(variant, batch, num_kv_heads, capacity, splits,
                                    lambda S: _kernels.max_active_clusters(loaded, S, csmem, variant.block, device))
    return _splits.put(key, splits)


def workspace_sizes(problem: GqaProblem, splits: int) -> dict:
    """Split workspace of one launch: fp32 partial numerators, {max, sum} pairs, one counter per
    (batch, KV head)."""
    return workspace_sizes_for(problem.batch, problem.num_kv_heads, problem.group, problem.head_dim, splits)


def workspace_sizes_for(batch: int, num_kv_heads: int, group: int, head_dim: int, splits: int) -> dict:
    bh = batch * num_kv_heads
    return {"ws_o": (bh * splits * group * head_dim, "f32"),
            "ws_ml": (bh * splits * group * 2, "f32"),
            "counters": (bh, "u32")}


def kv_tensor_spec(problem: GqaProblem, variant: _routes.Variant) -> TmaSpec:
    """The KV tensor map's description: dims (D, C, Hkv, 2B) innermost first, one 64-channel x
    ``tok``-token box, 128-byte swizzle."""
    return kv_spec(problem.dtype, problem.kv.ptr, problem.batch, problem.num_kv_heads, problem.capacity,
                   problem.head_dim, variant.tiling.tok)


def kv_spec(dtype: str, address: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
            tok: int) -> TmaSpec:
    """``kv_tensor_spec`` from the sizes (2-byte elements)."""
    B, Hkv, C, D = batch, num_kv_heads, capacity, head_dim
    return TmaSpec(dtype=dtype, address=address, dims=(D, C, Hkv, 2 * B), strides=(D * 2, C * D * 2, Hkv * C * D * 2),
                   box=(64, tok, 1, 1), swizzle="128b")


def kv_tensor_map(problem: GqaProblem, variant: _routes.Variant) -> bytes:
    """Encoded once per (KV address, geometry, tile); the 128 bytes are copied into each launch."""
    spec = kv_tensor_spec(problem, variant)
    hit = _tmaps.get(spec)
    if hit is None:
        hit = _tmaps.put(spec, encode_tiled(spec))
    return hit


def flags_for(device: int, kv_nbytes: int, batch: int, num_kv_heads: int, capacity: int, variant: _routes.Variant,
              loaded: Loaded, splits: int) -> int:
    """GqaArgs.flags of a launch: L2 evict-first for KV footprints above half the L2
    (GQADRV_L2_EVICT_FIRST=0/1 overrides) and the L2 prefetch rule of routes.l2_prefetch_pays."""
    info = _drv.device_info(device)
    env = os.environ.get("GQADRV_L2_EVICT_FIRST")
    if env is not None:
        f = GQA_FLAG_L2_EVICT_FIRST if env == "1" else 0
    else:
        f = GQA_FLAG_L2_EVICT_FIRST if kv_nbytes * 2 > info.l2_bytes else 0
    if _routes.l2_prefetch_pays(variant, batch, num_kv_heads, capacity, splits, info.sm_count, loaded.ctas_per_sm):
        f |= GQA_FLAG_L2_PREFETCH
    return f


def scale_log2(problem: GqaProblem) -> float:
    """GqaArgs.scale_log2: the absolute softmax scale in the log2 domain (the kernels use exp2).
    ``problem.sm_scale`` is sm_scale when given, else q_scale / sqrt(D), so both spellings of one
    scale pack the same float32 (checked in tests/gqa/test_scale_host.py)."""
    return problem.sm_scale / _LN2


def args_fields(problem: GqaProblem, out_ptr: int, ws: Workspace | None, status_ptr: int, splits: int,
                variant: _routes.Variant, loaded: Loaded) -> dict:
    """The GqaArgs block by field name (gqa/args.py mirrors kernels/gqa/common/args.cuh)."""
    return {
        "q": problem.q.ptr, "kv": problem.kv.ptr, "out": out_ptr, "lengths": problem.lengths.ptr, "status": status_ptr,
        "scale_log2": scale_log2(problem), "hkv": problem.num_kv_heads, "group": problem.group,
        **size_fields(problem.device, problem.kv.nbytes, problem.batch, problem.num_kv_heads, problem.capacity, variant,
                      loaded, splits, ws),
    }


def size_fields(device: int, kv_nbytes: int, batch: int, num_kv_heads: int, capacity: int, variant: _routes.Variant,
                loaded: Loaded, splits: int, ws: Workspace | None) -> dict:
    """The GqaArgs fields that depend on the batch size, the capacity or the split count: with the
    addresses, all that differs between two layouts of a family (gqa.layout_family)."""
    return {
        "ws_o": ws.ptr("ws_o") if ws else 0, "ws_ml": ws.ptr("ws_ml") if ws else 0,
        "counters": ws.ptr("counters") if ws else 0, "capacity": capacity, "num_splits": splits,
        "flags": flags_for(device, kv_nbytes, batch, num_kv_heads, capacity, variant, loaded, splits),
    }


def param_values(problem: GqaProblem, variant: _routes.Variant, args: dict) -> tuple:
    """One value per kernel parameter: (kv tensor map, args) for TMA families, (args,) otherwise."""
    if variant.family.uses_tma:
        return (kv_tensor_map(problem, variant), args)
    return (args,)


def launch_shape(variant: _routes.Variant, loaded: Loaded, device: int, batch: int, num_kv_heads: int,
                 splits: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int, tuple[int, int, int] | None]:
    """(grid, block, dynamic smem, cluster dims or None) of a launch: ``routes.launch_geometry``,
    as clusters of ``splits`` CTAs with the receive area added when the splits merge in a cluster
    (``routes.cluster_merge_applies`` and every (batch, KV head) cluster resident at once, per
    cuOccupancyMaxActiveClusters: a second wave of clusters would wait for the first)."""
    grid, block, smem = _routes.launch_geometry(variant, batch, num_kv_heads, splits)
    if _routes.cluster_merge_applies(variant, splits):
        csmem = smem + _routes.cluster_recv_bytes(variant)
        if batch * num_kv_heads <= _kernels.max_active_clusters(loaded, splits, csmem, block, device):
            return grid, block, csmem, (splits, 1, 1)
    return grid, block, smem, None


def build_launch(problem: GqaProblem, variant: _routes.Variant, loaded: Loaded, *, out_ptr: int,
                 ws: Workspace | None, status_ptr: int, splits: int, stream: int) -> LaunchPlan:
    """A ready ``LaunchPlan`` (PDL on) for one decode: grid B*Hkv*splits (``launch_shape``)."""
    grid, block, smem, cluster = launch_shape(variant, loaded, problem.device, problem.batch, problem.num_kv_heads,
                                              splits)
    args = args_fields(problem, out_ptr, ws, status_ptr, splits, variant, loaded)
    pack = ArgPack(variant.family.signature).pack(*param_values(problem, variant, args))
    return LaunchPlan(loaded.kernel, grid, block, smem, pack, stream=stream, pdl=True, cluster=cluster)
