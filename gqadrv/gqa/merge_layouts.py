"""Layout-keyed plans of the LSE merge (``merge_state`` / ``merge_states``), on ``ops.layouts``.

A cascade or prefix-sharing engine merges two partial states per layer and step with new tensors of
the same layout. A call whose tensors all come from one framework with a fast reader (CuPy, torch,
JAX arrays without outputs, XLA FFI buffers with both outputs: ``runtime.tensors.fast_kind``) is
keyed by layout: the form (a pair, a list of K states, the stacked [N, K, H, D] form), framework,
shape / strides / dtype of every state and of out / out_lse when given, device, whether the 16-byte
vector path applies (every v and out 16-byte aligned: the kernel's ``MERGE_FLAG_VEC16``, decided on
the host from the addresses) and the launch stream. A later call of the key re-reads the addresses,
orders the producers, allocates the outputs not given, re-checks what depends on an address
(alignment: 16 bytes for v and out on the vector path, else their element size, 4 bytes for the
LSEs; neither output overlapping another tensor), patches the output fields of ``MergeArgs`` and
the state pointers of the by-value ``MergeTable``, and launches the first call's plan. Calls the
cache cannot serve take the full path, which validates, launches and remembers the layout.
"""

from __future__ import annotations

from typing import Any

from ..ops import outputs as _outputs
from ..ops.layouts import LayoutCache, LayoutEntry, call_kind, call_streams
from ..runtime import tensors as _tensors
from ..runtime.streams import order_fast

__all__ = ["MISS", "call_facts", "launch_layout", "layouts", "remember"]

layouts = LayoutCache(1024)
MISS = object()
_NO_TENSOR = (None, 0, None)


def call_facts(form: str, vs: tuple, ss: tuple, out, out_lse, stream) -> tuple | None:
    """(key, ptrs, kind, device, stream, current stream) of a merge the layout cache can serve, or
    None. ``form``: "pair", "list" or "stacked"; ptrs: the v's, the s's, out (0: allocated), out_lse."""
    kind = call_kind((*vs, *ss), (), (out, out_lse))
    if kind is None or (kind == "xla" and (out is None or out_lse is None)):
        return None
    read = _tensors.FAST_READERS[kind]
    try:
        facts = [read(t) for t in (*vs, *ss)]
        facts += [read(t) if t is not None else _NO_TENSOR for t in (out, out_lse)]
    except Exception:  # noqa: BLE001 - anything unusual is explained by the full path
        return None
    if any(f is None for f in facts):
        return None
    dev = facts[0][2]
    if any(f[2] not in (None, dev) for f in facts[1:]):
        return None
    k = len(vs)
    vec16 = all(f[1] % 16 == 0 for f in facts[:k]) and facts[-2][1] % 16 == 0
    s, cur = call_streams(kind, dev, stream)
    key = ("merge", form, kind, *(f[0] for f in facts), dev, vec16, s)
    return key, tuple(f[1] for f in facts), kind, dev, s, cur


def launch_layout(e: LayoutEntry, facts: tuple, like, tensors: tuple, out, out_lse) -> Any:
    """Launch the remembered plan for this call's tensors: (v, s) as the full path returns them, or
    MISS when the call must take the full path."""
    _key, ptrs, kind, dev, s, cur = facts
    order_fast(kind, tensors, dev, s, cur)
    o = _outputs.allocate(like, e.out_shape, e.out_dtype, dev, s, cur) if out is None else None
    lo = _outputs.allocate(like, e.info, "float32", dev, s, cur) if out_lse is None else None
    with e.lock:
        if not e.bind(ptrs[:-2] + (ptrs[-2] if o is None else o.ptr, ptrs[-1] if lo is None else lo.ptr)):
            return MISS
        e.launch()
    return (out if o is None else _outputs.hand_back(o, like, s, dev),
            out_lse if lo is None else _outputs.hand_back(lo, like, s, dev))


def remember(facts: tuple, problem, plan, table_offsets: tuple[int, int], vec16: bool, ptrs: tuple) -> None:
    """Keep the plan of a validated merge under its layout key, when the full path saw exactly the
    facts the key was made of (device, stream, addresses, the vector path). ``table_offsets``: byte
    offsets of the v and s pointer arrays inside ``MergeTable``; ``ptrs``: the addresses the plan
    holds (the outputs' included)."""
    key, fptrs, _kind, dev, s, _cur = facts
    k = len(problem.v)
    views = (*problem.v, *problem.s, problem.out, problem.out_lse)
    if problem.device != dev or plan.stream != s or key[-2] != vec16 or problem.rows == 0:
        return
    for i, v in enumerate(views):
        if v is not None and v.ptr != fptrs[i]:
            return
    item = _tensors.DTYPE_BYTES[problem.dtype]
    n_out = n_lse = 1
    for d in problem.out_shape:
        n_out *= d
    for d in problem.lse_shape:
        n_lse *= d
    spans, fields, aligns = [], [], []
    v_off, s_off = table_offsets
    for i, v in enumerate(views):
        if v is not None:
            lo, hi = v.byte_range()
            spans.append((lo - v.ptr, hi - v.ptr))
        else:
            spans.append((0, n_out * item if i == len(views) - 2 else n_lse * 4))
        if i < k:
            fields.append(((0, f"table@{v_off + 8 * i}"),))
            aligns.append(16 if vec16 else item)
        elif i < 2 * k:
            fields.append(((0, f"table@{s_off + 8 * (i - k)}"),))
            aligns.append(4)
        elif i == 2 * k:
            fields.append(((0, "args.out"),))
            aligns.append(16 if vec16 else item)
        else:
            fields.append(((0, "args.out_lse"),))
            aligns.append(4)
    layouts.remember(key, LayoutEntry(
        (plan,), tuple(fields), tuple(aligns), tuple(spans), (2 * k, 2 * k + 1), (), tuple(ptrs), dev, s,
        out_shape=problem.out_shape, out_dtype=problem.dtype, info=problem.lse_shape))
