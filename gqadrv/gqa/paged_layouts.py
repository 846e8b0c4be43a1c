"""Layout-keyed plans of the paged convenience call (``gqa_decode_paged``), on ``ops.layouts``.

A serving engine calls ``gqa_decode_paged`` once per layer and step with new tensors of the same
layout (its page pools, block table, lengths and queries). A call whose tensors all come from one
framework with a fast reader (CuPy, torch, JAX arrays without out / lse, XLA FFI buffers with every
output given: ``runtime.tensors.fast_kind``) is keyed by layout: framework, shape / strides / dtype of
q, the K pool, the V pool (or none: a combined pool), the block table, the lengths, out and lse when
given and the FP8 scale arrays when given, device, ``kv_layout``, whether LSE is returned, the scales
(``q_scale`` / ``sm_scale`` / numeric FP8 scales), ``deterministic``, ``num_splits``, ``kv_dtype``,
backend, the tuning environment and the launch stream. Not by addresses. ``gqa_decode``'s calls
that run the paged kernels on a contiguous cache (4-D q, LSE, ``deterministic``, FP8) use the same
cache with the layout "contiguous" (no table, V at a fixed offset inside the cache). A later call of the key
re-reads the addresses, orders the producers, allocates out / lse when not given, re-checks what
depends on an address (16-byte alignment of q, the pools and out; 4 bytes for the table, the lengths,
lse and scale arrays; no output overlapping another tensor), patches the address fields of
``GqaPagedArgs`` (the V address of a combined pool is the K address plus the pool's V offset) and the
pools' tensor maps on the TMA route, and launches the plan the first call built. Everything else the
first call validated is a property of the layout; the route's only address-dependent choice (whether
TMA can describe the pools) depends on their 16-byte alignment, which every later call re-checks.
Calls the cache cannot serve take the full path, which validates, launches and remembers the layout.
"""

from __future__ import annotations

import numbers
from typing import Any

from ..ops import outputs as _outputs
from ..ops.layouts import LayoutCache, LayoutEntry, TmapSlot, call_kind, call_streams
from ..runtime import tensors as _tensors
from ..runtime.module import TMAP
from ..runtime.streams import order_fast
from . import routes as _routes

__all__ = ["MISS", "call_facts", "launch_layout", "layouts", "remember", "try_layout"]

layouts = LayoutCache(1024)
MISS = object()
# the tensors of a call, in slot order: (name, struct field, alignment)
_SLOTS = (("q", "q", 16), ("k_cache", "k", 16), ("v_cache", "v", 16), ("block_table", "table", 4),
          ("seq_lens", "lengths", 4), ("out", "out", 16), ("lse", "lse", 4), ("k_scale", "k_scale", 4),
          ("v_scale", "v_scale", 4))
_OUT, _LSE = 5, 6
_NO_TENSOR = (None, 0, None)


def _number(x: Any) -> bool:
    t = type(x)
    return t is int or t is float


def call_facts(q, k_cache, v_cache, block_table, seq_lens, out, lse, kv_layout, return_lse, q_scale, sm_scale,
               deterministic, num_splits, stream, backend, kv_dtype, k_scale, v_scale) -> tuple | None:
    """(key, ptrs, kind, device, stream, current stream) of a call the layout cache can serve, or
    None (see the module docstring). ptrs: one address per slot (0 where the tensor is absent).
    ``kv_layout="contiguous"``: ``gqa_decode``'s contiguous cache [B, 2, Hkv, C, D] as k_cache, no
    V pool and no table (its 4-D q / LSE / deterministic / FP8 calls run the paged kernels)."""
    if kv_layout == "contiguous":
        if v_cache is not None or block_table is not None:
            return None
        kind = call_kind((q, k_cache, seq_lens), (), (out, lse))
    else:
        kind = call_kind((q, k_cache, block_table, seq_lens), (v_cache,), (out, lse))
    if kind is None:
        return None
    tq = type(q)
    want_lse = return_lse is True or lse is not None
    if kind == "xla" and (out is None or (want_lse and lse is None)):  # XLA buffers: a callback's outputs
        return None
    if (type(kv_layout) is not str or type(return_lse) is not bool or type(deterministic) is not bool
            or not _number(q_scale) or (sm_scale is not None and not _number(sm_scale))
            or (num_splits is not None and type(num_splits) is not int)
            or (backend is not None and type(backend) is not str) or (kv_dtype is not None and type(kv_dtype) is not str)):
        return None
    scales = []
    for x in (k_scale, v_scale):  # None, a number (in the key) or an array of q's framework (a slot)
        if x is None or (isinstance(x, numbers.Real) and _number(x)):
            scales.append(None)
        elif type(x) is tq:
            scales.append(x)
        else:
            return None
    read = _tensors.FAST_READERS[kind]
    tensors = (q, k_cache, v_cache, block_table, seq_lens, out, lse, *scales)
    try:
        facts = [read(t) if t is not None else _NO_TENSOR for t in tensors]
    except Exception:  # noqa: BLE001 - anything unusual is explained by the full path
        return None
    if any(f is None for f in facts):
        return None
    dev = facts[0][2]
    if any(f[2] not in (None, dev) for f in facts[1:]) or facts[1][2] is None:
        return None
    s, cur = call_streams(kind, dev, stream)
    nums = tuple(x if scales[i] is None else "array" for i, x in enumerate((k_scale, v_scale)))
    key = ("paged", kind, *(f[0] for f in facts), dev, kv_layout, want_lse, q_scale, sm_scale, deterministic,
           num_splits, backend, kv_dtype, nums, _routes.tuning_env(), s)
    return key, tuple(f[1] for f in facts), kind, dev, s, cur


def try_layout(facts: tuple | None, q, tensors: tuple, out, lse, want_lse: bool) -> Any:
    """The call served by its layout's plan (``launch_layout``), or MISS (no facts, no entry, or refused)."""
    if facts is None:
        return MISS
    e = layouts.get(facts[0])
    return MISS if e is None else launch_layout(e, facts, q, tensors, out, lse, want_lse)


def launch_layout(e: LayoutEntry, facts: tuple, q, tensors: tuple, out, lse, want_lse: bool) -> Any:
    """Launch the remembered plan for this call's tensors; out or (out, lse) as the full path
    returns them, or MISS when the call must take the full path."""
    _key, ptrs, kind, dev, s, cur = facts
    lse_shape = e.info
    order_fast(kind, tensors, dev, s, cur)
    o = _outputs.allocate(q, e.out_shape, e.out_dtype, dev, s, cur) if out is None else None
    lo = _outputs.allocate(q, lse_shape, "float32", dev, s, cur) if want_lse and lse is None else None
    ptrs = ptrs[:_OUT] + (ptrs[_OUT] if o is None else o.ptr, ptrs[_LSE] if lo is None else lo.ptr) + ptrs[_LSE + 1:]
    with e.lock:
        if not e.bind(ptrs):
            return MISS
        e.launch()
    res = out if o is None else _outputs.hand_back(o, q, s, dev)
    if not want_lse:
        return res
    return res, (lse if lo is None else _outputs.hand_back(lo, q, s, dev))


def remember(facts: tuple, problem, variant, plan, ws, ptrs: tuple, want_lse: bool, specs: tuple | None = None) -> None:
    """Keep the plan of a validated call under its layout key, when the full path saw exactly the
    facts the key was made of (device, stream, addresses). ``ptrs``: the addresses the plan holds,
    one per slot (0: absent), the outputs' included; ``specs``: the K / V tensor-map specs of the
    TMA route (``paged.tma_map_specs``)."""
    key, fptrs, _kind, dev, s, _cur = facts
    if problem.device != dev or plan.stream != s:
        return
    sc = problem.scales
    views = [problem.q, problem.k, problem.v, problem.table, problem.lengths, problem.out, problem.lse, None, None]
    for i, ptr in ((7, sc.k_ptr), (8, sc.v_ptr)):
        if ptr:
            views[i] = next((v for v in sc.views if v.ptr == ptr), None)
    for i, v in enumerate(views):
        if i in (_OUT, _LSE) and v is None:
            continue  # allocated by the call
        if (v.ptr if v is not None else 0) != fptrs[i]:
            return
    item = _tensors.DTYPE_BYTES[problem.dtype]
    n_out = 1
    for d in problem.out_shape:
        n_out *= d
    n_lse = 1
    for d in problem.lse_shape:
        n_lse *= d
    spans, fields, aligns = [], [], []
    for i, (v, (_name, field, align)) in enumerate(zip(views, _SLOTS)):
        if v is not None:
            lo, hi = v.byte_range()
            spans.append((lo - v.ptr, hi - v.ptr))
        elif i == _OUT:
            spans.append((0, n_out * item))
        elif i == _LSE and want_lse:
            spans.append((0, n_lse * 4))
        else:
            spans.append((0, 0))
        present = v is not None or i == _OUT or (i == _LSE and want_lse)
        f = ((0, f"args.{field}"),) if present else ()
        if i == 1 and problem.v is None:  # a combined pool: V at a fixed offset inside it
            f = f + ((0, "args.v", problem.v_ptr - problem.k_ptr),)
        fields.append(f)
        aligns.append(align if present else 1)
    tmaps: tuple = ()
    if variant.family.uses_tma:
        names = [n for n, kind_ in variant.family.signature.params if kind_ is TMAP]
        if specs is None or len(names) != 2:
            return
        v_slot, v_off = (2, 0) if problem.v is not None else (1, problem.v_ptr - problem.k_ptr)
        tmaps = (TmapSlot(0, names[0], 1, specs[0], plan.args.param_bytes(names[0])),
                 TmapSlot(0, names[1], v_slot, specs[1], plan.args.param_bytes(names[1]), offset=v_off))
    layouts.remember(key, LayoutEntry(
        (plan,), tuple(fields), tuple(aligns), tuple(spans), (_OUT, _LSE) if want_lse else (_OUT,), tmaps,
        tuple(ptrs), dev, s, keep=(ws,), out_shape=problem.out_shape, out_dtype=problem.dtype,
        info=problem.lse_shape))
