"""Layout-keyed plans of the dense MLA convenience call (``flash_mla_with_kvcache`` without
``indices``), on the shared machinery of ``ops.layouts``.

A FlashMLA-style engine calls ``flash_mla_with_kvcache`` once per layer and step with new tensors of
the same layout. A call whose tensors all come from one framework the fast readers know (CuPy,
torch, JAX arrays without out / lse, XLA FFI buffers with both: ``runtime.tensors.fast_kind``) is
keyed by layout: framework, shape / strides / dtype of q, k_cache, block_table, cache_seqlens and
of out / lse when given, device, head_dim_v, softmax_scale, causal, is_fp8_kvcache, ``num_splits``,
backend and launch stream. Not by addresses. A later call of the same key re-reads only the addresses, orders the
producers (``streams.order_fast``), allocates out / lse when not given, re-checks what depends on
the address (16-byte alignment of q, k_cache and out, 4 bytes for block_table, cache_seqlens and
lse; out and lse overlapping no other tensor; ``ops.layouts.LayoutEntry``), patches the address
fields of ``MlaDecodeArgs`` and the k_cache tensor maps, and launches the plan the first call built.
Everything else the first call validated is a property of the layout (the lengths and the block
table are device data, read by the kernel at every launch).

``tile_scheduler_metadata``: an object already initialised for another configuration (or, without
``num_splits``, with another split count than the layout's plan) sends the call to the full path
(which raises the documented ValueError, or launches with the object's count); a fresh one is
initialised here exactly as the full path would (the layout's configuration and split count). Calls the cache cannot serve
(mixed frameworks, numpy scalars, sparse arguments, a refused address) take the full path, which
validates, launches and remembers the layout when it succeeded.
"""

from __future__ import annotations

from typing import Any

from ..ops import outputs as _outputs
from ..ops.layouts import LayoutCache, LayoutEntry, TmapSlot, call_kind, call_streams
from ..runtime import tensors as _tensors
from ..runtime.module import TMAP
from ..runtime.streams import order_fast
from . import kernel_spec as _ks
from . import plan as _plan

__all__ = ["MISS", "call_facts", "launch_layout", "layouts", "remember"]

layouts = LayoutCache(1024)
MISS = object()
_NAMES = ("q", "k_cache", "block_table", "cache_seqlens", "out", "lse")
_FIELDS = tuple(((0, f"args.{n}"),) for n in _NAMES)
_ALIGNS = (16, 16, 4, 4, 16, 4)
_OUT_SLOTS = (4, 5)


def _scalar(x: Any, none_ok: bool = True) -> bool:
    """A plain Python int / float (the layout key compares them exactly; anything else: full path)."""
    t = type(x)
    return (none_ok and x is None) or t is int or t is float


def call_facts(q, k_cache, block_table, cache_seqlens, out, lse, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
               num_splits, meta, stream, backend) -> tuple | None:
    """(key, ptrs, kind, device, stream, current stream) of a dense call the layout cache can serve,
    or None (see the module docstring)."""
    kind = call_kind((q, k_cache, block_table, cache_seqlens), (), (out, lse))
    if kind is None or (kind == "xla" and (out is None or lse is None)):  # XLA buffers: a callback's outputs
        return None
    if (type(head_dim_v) is not int or not _scalar(softmax_scale) or type(causal) is not bool
            or type(is_fp8_kvcache) is not bool or (num_splits is not None and type(num_splits) is not int)
            or (backend is not None and type(backend) is not str)):
        return None
    read = _tensors.FAST_READERS[kind]
    try:
        facts = [read(q), read(k_cache), read(block_table), read(cache_seqlens),
                 read(out) if out is not None else (None, 0, None), read(lse) if lse is not None else (None, 0, None)]
    except Exception:  # noqa: BLE001 - anything unusual is explained by the full path
        return None
    if any(f is None for f in facts):
        return None
    dev = facts[0][2]
    if any(f[2] != dev for f in facts[1:4]) or any(f[2] not in (None, dev) for f in facts[4:]):
        return None
    s, cur = call_streams(kind, dev, stream)
    key = ("mla", kind, *(f[0] for f in facts), dev, head_dim_v, softmax_scale, causal, is_fp8_kvcache, num_splits,
           backend, s)
    return key, tuple(f[1] for f in facts), kind, dev, s, cur


def launch_layout(e: LayoutEntry, facts: tuple, meta, num_splits, q, k_cache, block_table, cache_seqlens, out, lse):
    """Launch the remembered plan for this call's tensors: (out, lse) as the full path returns them,
    or MISS when the call must take the full path."""
    _key, ptrs, kind, dev, s, cur = facts
    config, splits, lse_shape = e.info
    if meta is not None:
        if meta.config is None:
            meta.config, meta.num_splits = config, splits
        elif meta.config != config or (num_splits is None and meta.num_splits != splits):
            return MISS  # another configuration (the full path raises), or the metadata's own split count
    order_fast(kind, (q, k_cache, block_table, cache_seqlens, out, lse), dev, s, cur)
    o = _outputs.allocate(q, e.out_shape, e.out_dtype, dev, s, cur) if out is None else None
    lo = _outputs.allocate(q, lse_shape, "float32", dev, s, cur) if lse is None else None
    with e.lock:
        if not e.bind(ptrs[:4] + (ptrs[4] if o is None else o.ptr, ptrs[5] if lo is None else lo.ptr)):
            return MISS
        e.launch()
    return (out if o is None else _outputs.hand_back(o, q, s, dev),
            lse if lo is None else _outputs.hand_back(lo, q, s, dev))


def remember(facts: tuple, problem, variant, plan, ws, views: tuple, ptrs: tuple, config: tuple, splits: int) -> None:
    """Keep the plan of a validated dense call under its layout key, when the full path saw exactly
    the facts the key was made of (device, stream, addresses). ``views``: the six tensor views
    (out / lse None when allocated); ``ptrs``: the six addresses the plan holds."""
    key, fptrs, _kind, dev, s, _cur = facts
    if problem.device != dev or plan.stream != s:
        return
    for i, v in enumerate(views):
        if v is not None and v.ptr != fptrs[i]:
            return
    b, s_q, h_q = problem.b, problem.s_q, problem.h_q
    item = _tensors.DTYPE_BYTES[problem.dtype]
    alloc = ((0, b * s_q * h_q * _ks.D_V * item), (0, b * h_q * s_q * 4))
    spans = []
    for i, v in enumerate(views):
        if v is None:
            spans.append(alloc[i - 4])
        else:
            lo, hi = v.byte_range()
            spans.append((lo - v.ptr, hi - v.ptr))
    tmaps: tuple = ()
    fam = variant.family
    if fam.tma:
        names = [n for n, kind_ in fam.signature.params if kind_ is TMAP]
        specs = _plan.k_tensor_specs(problem, fam.tma_boxes)
        tmaps = tuple(TmapSlot(0, n, 1, spec, plan.args.param_bytes(n)) for n, spec in zip(names, specs))
    layouts.remember(key, LayoutEntry(
        (plan,), _FIELDS, _ALIGNS, tuple(spans), _OUT_SLOTS, tmaps, tuple(ptrs), dev, s, keep=(ws,),
        out_shape=(b, s_q, h_q, _ks.D_V), out_dtype=problem.dtype,
        info=(config, splits, (b, h_q, s_q))))
