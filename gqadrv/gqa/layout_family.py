"""Layout families of ``gqa_decode``: a first call of a new layout that differs from a known one only
in the batch size B and the cache capacity C skips validation and most of the launch building.

A *layout* (``ops.layouts``) fixes every shape, stride and dtype; its *family* fixes everything but
B and C: the framework, dtypes, Hq, Hkv, D, whether ``out`` is given, the device, the scales, the
backend, the tuning environment and the launch stream, with every tensor densely packed. Serving
engines change B (requests join and leave) and C (the cache grows) from step to step, so most new
layouts belong to a family seen before.

The full path (``api._full_call``) validates the first call of a family and leaves here its problem
(the family's *template*) and its layout entry, filed under the entry's *route side* (short capacity
or not, large batch or not: ``plan.route_side``; nothing else of the route depends on B or C). A new
layout of the family (``api._family_call``) then does only what depends on B and C:

1. the size rules of ``contract.validate`` (``split_key``): q ``[B, Hq, D]``, kv ``[B, 2, Hkv, C, D]``,
   lengths ``[B]``, out ``[B, Hq, D]``, B >= 1, 1 <= C <= the kernels' int32 positions, each tensor
   densely packed; any other layout is not a member and takes the full path;
2. with an entry of the same route side (``copy_member``): a copy of that entry's argument block
   with the size fields (``plan.size_fields``: capacity, split count, flags, workspace) and the
   addresses rewritten, the KV tensor map of the new geometry, the grid; ``LayoutEntry.derive``
   makes the new entry;
3. without one (the first member on another route side): the template's problem with the new sizes
   (``member_problem``), routed and built like a full call; its entry is filed for that side;
4. the address rules (alignment, out overlapping an input: ``LayoutEntry.check``) before anything is
   launched; a failed rule sends the call to the full path, which raises the documented error.
The new layout's entry is remembered in the layout cache, so its next call is a plain replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..ops.bounded import BoundedMap
from ..ops.layouts import LayoutEntry, TmapSlot
from ..runtime.module import LaunchPlan
from ..runtime.tensormap import class_writer, encode_tiled
from ..runtime.tensors import TensorView
from . import plan as _plan
from . import routes as _routes
from .contract import _INT32_POSITIONS, GqaProblem

__all__ = ["Family", "copy_member", "families", "key_size", "make_flexible", "member_problem", "remember",
           "resize", "split_key"]


class Family:
    """A family's template problem and, per route side, (variant, loaded kernel, layout entry) of a
    member built on that side, and per (route side, batch size) a re-sizable entry (``flex``, see
    ``resize``)."""

    __slots__ = ("built", "flex", "template")

    def __init__(self, template: GqaProblem):
        self.template = template
        self.built: dict[tuple[bool, bool], tuple] = {}
        self.flex: dict[tuple[tuple[bool, bool], int], LayoutEntry] = {}


families = BoundedMap(256)   # family key -> Family


def _dense3(shape: tuple, strides: tuple, u: int) -> bool:
    return strides == (shape[1] * shape[2] * u, shape[2] * u, u)


def _dense_kv(shape: tuple, strides: tuple, u: int) -> bool:
    d = shape[4] * u
    c = shape[3] * d
    h = shape[2] * c
    return strides == (2 * h, h, c, d, u)


def _unit(kind: str, dtype: Any) -> int:
    """What one element's stride reads in the fast reader's layout: bytes for CuPy (and the fake
    arrays of the CPU tests), elements for torch."""
    return 1 if kind == "torch" else dtype.itemsize


def split_key(key: tuple) -> tuple[tuple, int, int] | None:
    """(family key, B, C) of a layout key (``api._call_facts``), or None when the layout is not a
    family member: a shape the contract rejects, or a tensor that is not densely packed (such
    layouts are validated by the full path at every first call)."""
    kind, lq, lk, ll, lo = key[:5]
    sq, sk, sl = lq[0], lk[0], ll[0]
    if len(sq) != 3 or len(sk) != 5 or len(sl) != 1:
        return None
    B, Hq, D = sq
    C = sk[3]
    if B < 1 or sk[0] != B or sl[0] != B or sk[1] != 2 or sk[4] != D or not 1 <= C <= _INT32_POSITIONS:
        return None
    if lo is not None and tuple(lo[0]) != tuple(sq):
        return None
    if len(lq) == 3:  # (shape, strides, dtype); JAX / XLA layouts carry no strides (dense by the reader)
        if not (_dense3(sq, tuple(lq[1]), _unit(kind, lq[2])) and _dense_kv(sk, tuple(lk[1]), _unit(kind, lk[2]))
                and tuple(ll[1]) == (_unit(kind, ll[2]),)
                and (lo is None or _dense3(lo[0], tuple(lo[1]), _unit(kind, lo[2])))):
            return None
    fam = (kind, Hq, D, lq[-1], sk[2], lk[-1], ll[-1], None if lo is None else lo[-1]) + tuple(key[5:])
    return fam, B, C


def remember(key: tuple, problem: GqaProblem, side: tuple[bool, bool], built: tuple) -> None:
    """File a full call's validated ``problem`` (layout ``key``) as its family's template, with
    ``built`` = (variant, loaded, entry) for its route side; a known family keeps its template."""
    split = split_key(key)
    if split is None or split[1] != problem.batch or split[2] != problem.capacity:
        return
    fam = families.get(split[0])
    if fam is None:
        fam = families.put(split[0], Family(_detached(problem)))
    fam.built.setdefault(side, built)


def _detached(problem: GqaProblem) -> GqaProblem:
    """``problem`` with views that no longer reference the caller's tensors: a template must not keep
    a KV cache alive (its views are dense: ``split_key`` admitted its layout)."""
    def bare(v: TensorView | None) -> TensorView | None:
        return None if v is None else _view(v, None, v.ptr, v.shape)

    return dataclasses.replace(problem, q=bare(problem.q), kv=bare(problem.kv), lengths=bare(problem.lengths),
                               out=bare(problem.out))


def _view(t: TensorView, obj: Any, ptr: int, shape: tuple) -> TensorView:
    """The template's view ``t`` for another tensor of its family: densely packed ``shape``."""
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return TensorView(obj, t.name, ptr, shape, tuple(reversed(strides)), t.dtype, t.itemsize, t.device, t.framework)


def member_problem(template: GqaProblem, B: int, C: int, tensors: tuple, ptrs: tuple) -> GqaProblem:
    """The problem of a family member: the template with batch B, capacity C and views of
    ``tensors`` (q, kv, lengths, out or None) at ``ptrs`` (out's 0 when it is not given)."""
    t = template
    Hq, D, Hkv = t.num_q_heads, t.head_dim, t.num_kv_heads
    q, kv, lens, out = tensors
    return dataclasses.replace(
        t, batch=B, capacity=C,
        q=_view(t.q, q, ptrs[0], (B, Hq, D)), kv=_view(t.kv, kv, ptrs[1], (B, 2, Hkv, C, D)),
        lengths=_view(t.lengths, lens, ptrs[2], (B,)),
        out=None if out is None else _view(t.out, out, ptrs[3], (B, Hq, D)))


_PLACES: dict = {}   # (signature, size field names) -> ((byte offset, struct format), ...) in that order


def _places(sig, fields: dict) -> tuple:
    key = (sig, tuple(fields))
    hit = _PLACES.get(key)
    if hit is None:
        hit = _PLACES[key] = tuple(sig.field_offsets["args." + name] for name in fields)
    return hit


def _spans(template: GqaProblem, B: int, C: int) -> tuple:
    """Byte spans of a member's q, kv, lengths and out (dense tensors of batch B and capacity C)."""
    t = template
    q_bytes = B * t.num_q_heads * t.head_dim * t.q.itemsize
    return ((0, q_bytes), (0, B * 2 * t.num_kv_heads * C * t.head_dim * t.kv.itemsize), (0, 4 * B), (0, q_bytes))


def _write_sizes(args, variant: _routes.Variant, loaded, template: GqaProblem, B: int, C: int, splits: int, ws,
                 kv_ptr: int, device: int, kv_bytes: int) -> tuple:
    """Write into argument block ``args`` what depends on B, C and the split count: the size fields
    (``plan.size_fields``) and, for TMA families, the KV tensor map of the new geometry at ``kv_ptr``
    (written from its learned map class when there is one: a dense member's map always passes
    ``validate_tiled``; else ``encode_tiled``). Returns the entry's tensor-map slots."""
    t = template
    Hkv, D = t.num_kv_heads, t.head_dim
    fields = _plan.size_fields(device, kv_bytes, B, Hkv, C, variant, loaded, splits, ws)
    for (off, fmt), v in zip(_places(args.sig, fields), fields.values()):
        args.patch(off, fmt, v)
    if not variant.family.uses_tma:
        return ()
    spec = _plan.kv_spec(t.dtype, kv_ptr, B, Hkv, C, D, variant.tiling.tok)
    write = class_writer(spec)
    encoded = None if write is None else write(kv_ptr, spec.dims, spec.strides)
    if encoded is None:
        encoded = encode_tiled(spec)  # a new geometry: the plan's cache of maps would not hit
    args.set("kv_map", encoded)
    return (TmapSlot(0, "kv_map", 1, spec, encoded),)


def copy_member(base: LayoutEntry, variant: _routes.Variant, loaded, template: GqaProblem, B: int, C: int,
                ptrs: tuple, ws, splits: int, device: int, stream: int) -> LayoutEntry | None:
    """The entry of a member with batch B and capacity C, tensors at ``ptrs`` (q, kv, lengths, out),
    from ``base``, an entry of the same family and route side: its argument block copied with the
    size fields and the KV tensor map rewritten (``_write_sizes``), the grid of the new sizes and
    split count, the addresses written by ``LayoutEntry.derive``. None (nothing built) when an
    address rule fails (alignment, out overlapping an input)."""
    spans = _spans(template, B, C)
    if not base.check(ptrs, spans):
        return None
    with base.lock:
        args = base.plans[0].args.copy()
    tmaps = _write_sizes(args, variant, loaded, template, B, C, splits, ws, ptrs[1], device, spans[1][1])
    grid, block, smem, cluster = _plan.launch_shape(variant, loaded, device, B, template.num_kv_heads, splits)
    plan = LaunchPlan(loaded.kernel, grid, block, smem, args, stream=stream, pdl=True, cluster=cluster)
    return base.derive((plan,), spans, tmaps, ptrs, keep=(ws,), out_shape=(B, template.num_q_heads, template.head_dim))


# ----------------------------------------------------------------------------- re-sizable entries
# The first member entry built for a (route side, batch size) becomes their re-sizable entry
# (Family.flex). A first call of a new layout with that side and B (a new capacity: a cache that
# grows, another split count) takes it and rewrites in place what depends on C (``resize``: the size
# fields, the KV tensor map, the grid width, the byte spans, the workspace kept alive);
# ``LayoutEntry.bind`` then re-checks and patches every address. No argument block, launch
# configuration or entry is built, so such a call costs about what a call with new pointers costs
# plus the re-size. Every layout served so is remembered under its own key with that entry and the
# sizes it needs (``key_size``); a later call of a layout whose sizes the entry no longer holds gets an
# entry of its own (``copy_member``), so layouts that alternate settle into plain replays after their
# second call. A new batch size builds its own entry (``copy_member``) as before: batch sizes come
# back step after step in a serving engine, and each keeps its entry.
def make_flexible(e: LayoutEntry, variant: _routes.Variant, loaded, template: GqaProblem, device: int,
                  B: int, C: int) -> LayoutEntry:
    """Mark ``e`` (an entry of batch B and capacity C built for ``template``'s family on ``variant``'s
    route side) as the re-sizable entry of that route side and batch size: ``e.info`` holds what
    ``resize`` needs, (variant, loaded kernel, template, device)."""
    e.info, e.size = (variant, loaded, template, device), (B, C)
    return e


def key_size(key: tuple) -> tuple[int, int]:
    """(B, C) of a family member's layout key (q's shape leads its layout, kv's shape holds C)."""
    return key[1][0][0], key[2][0][3]


def resize(e: LayoutEntry, B: int, C: int, splits: int, ws, kv_ptr: int) -> None:
    """Rewrite re-sizable entry ``e`` (``make_flexible``) for batch B, capacity C and ``splits``
    (``routes.default_splits`` of B and C on the entry's route side), with workspace ``ws`` (None
    for one split): size fields and KV tensor map (``_write_sizes``, the map written for ``kv_ptr``),
    grid width, byte spans, output shape. Every address is re-checked and re-patched by the next
    ``bind``. Call with ``e.lock`` held."""
    variant, loaded, t, device = e.info
    spans = _spans(t, B, C)
    plan = e.plans[0]
    e.tmaps = _write_sizes(plan.args, variant, loaded, t, B, C, splits, ws, kv_ptr, device, spans[1][1])
    grid, _block, smem, cluster = _plan.launch_shape(variant, loaded, device, B, t.num_kv_heads, splits)
    plan.reshape(grid[0], smem, cluster)
    e.spans, e.out_shape, e.keep, e.size = spans, (B, t.num_q_heads, t.head_dim), (ws,), (B, C)
    e.forget_addresses()
