"""Convenience-call plans keyed by layout: a repeated call whose tensors have the same layout
(shapes, strides, dtypes, device, framework) and the same scalars, backend, tuning environment and
stream re-launches the plan built the first time, with new tensor addresses patched in.

The op builds the key and the entry (plans, which struct field holds which tensor's address, the
alignment each needs, the byte span each covers, tensor maps that embed an address); this module
re-checks and patches addresses and launches. What the first call validated still holds for a new
address of the same layout except what depends on the address itself, and that is checked again
at every call whose addresses differ from the entry's last ones:

* alignment (``aligns``: 16 bytes for TMA / vector loads, 4 for the lengths);
* aliasing: an output's byte span must not overlap any other tensor's (inputs and the other outputs);
* tensor maps are re-based to the new address (``runtime.tensormap.rebase``: the address field is
  patched when its place in the descriptor is known and verified, else the map is encoded again).

A call that fails a check is refused (``bind`` returns False) and the op runs its full validation,
which raises the documented error: nothing is launched with an unchecked address.
Patching and launching happen under the entry's lock, so threads sharing an entry cannot
interleave their arguments.
"""

from __future__ import annotations

import threading
from typing import Any

from ..runtime import tensormap as _tm
from ..runtime import tensors as _tensors
from ..runtime.module import LaunchPlan, launch_plans
from ..runtime.streams import current_stream, resolve_stream
from .bounded import BoundedMap

__all__ = ["LayoutCache", "LayoutEntry", "TmapSlot", "call_kind", "call_streams"]

_encoded = BoundedMap(256)   # (spec, address) -> 128 bytes, for maps whose address field is not patchable


class TmapSlot:
    """A by-value tensor-map parameter (``param`` of plan ``plan``) describing tensor ``slot``, whose
    global address is the tensor's address + ``offset`` bytes (e.g. the V half of a combined cache)."""

    __slots__ = ("encoded", "field", "offset", "param", "plan", "slot", "spec")

    def __init__(self, plan: int, param: str, slot: int, spec: _tm.TmaSpec, encoded: bytes, offset: int = 0):
        self.plan, self.param, self.slot, self.spec, self.encoded = plan, param, slot, spec, encoded
        self.offset = offset
        self.field = _tm.address_offset(encoded, spec.address)   # byte offset of the address, or None

    def apply(self, plans: tuple[LaunchPlan, ...], address: int) -> None:
        args = plans[self.plan].args
        if self.field is not None:
            args.patch(args.param_offset(self.param) + self.field, "<Q", address)
            return
        key = (self.spec, address)
        data = _encoded.get(key)
        if data is None:
            data = _encoded.put(key, _tm.rebase(self.encoded, self.spec, address))
        args.set(self.param, data)


_places: dict = {}   # (signature, place) -> (absolute byte offset, struct format)


def _resolve(sig, f: tuple) -> tuple[int, int, str, int]:
    """(plan index, absolute byte offset, struct format, added bytes) of one address place (LayoutEntry)."""
    place = f[1]
    hit = _places.get((sig, place))
    if hit is None:
        if "@" in place:
            param, off = place.split("@")
            hit = (sig.offsets[sig.names.index(param)] + int(off), "<Q")
        else:
            try:
                hit = sig.field_offsets[place]
            except KeyError:
                raise KeyError(f"{sig} has no struct field {place!r}") from None
        if len(_places) > 4096:
            _places.clear()
        _places[(sig, place)] = hit
    return f[0], hit[0], hit[1], (f[2] if len(f) > 2 else 0)


class LayoutEntry:
    """One validated layout: its plans and how each tensor's address enters them.

    ``fields[i]``: (plan index, place) pairs that hold tensor i's address, or (plan index, place, byte
    offset) triples that hold an address inside it; a place is a struct field ``"param.field"`` or a
    u64 at a byte offset of a raw parameter, ``"param@offset"`` (e.g. a pointer table passed by
    value); ``aligns[i]``: its
    required alignment; ``spans[i]``: (lo, hi) byte offsets of its extent relative to its address;
    ``out_slot``: the output's index, or a tuple of the outputs' indices (an output's span must not
    overlap any other tensor's); ``tmaps``: tensor maps to re-base when their tensor moves; ``ptrs``:
    the addresses of the last launch; ``info``: whatever else the op keeps with the layout; ``size``:
    None, or for an entry the op re-sizes in place to serve several layouts of one family (``gqa_decode``:
    gqa.layout_family), the sizes its plans hold now (the op re-sizes it under ``lock`` when a call's
    layout has others, then ``bind`` re-checks every address)."""

    __slots__ = (
        "aligns",
        "device",
        "fields",
        "info",
        "keep",
        "lock",
        "out_dtype",
        "out_shape",
        "out_slot",
        "out_slots",
        "patches",
        "plans",
        "ptrs",
        "size",
        "spans",
        "stream",
        "tmaps",
    )

    def __init__(self, plans: tuple[LaunchPlan, ...], fields: tuple, aligns: tuple[int, ...],
                 spans: tuple[tuple[int, int], ...], out_slot: int | tuple[int, ...] | None,
                 tmaps: tuple[TmapSlot, ...], ptrs: tuple[int, ...], device: int, stream: int, keep: tuple = (),
                 out_shape: tuple = (), out_dtype: Any = None, info: Any = None):
        if not (len(fields) == len(aligns) == len(spans) == len(ptrs)):
            raise ValueError("fields, aligns, spans and ptrs must describe the same tensors")
        self.plans, self.fields, self.aligns, self.spans = tuple(plans), tuple(fields), tuple(aligns), tuple(spans)
        self.out_slot, self.tmaps, self.ptrs = out_slot, tuple(tmaps), tuple(ptrs)
        self.out_slots = () if out_slot is None else (out_slot,) if isinstance(out_slot, int) else tuple(out_slot)
        self.device, self.stream, self.keep = device, stream, keep
        self.out_shape, self.out_dtype, self.info = tuple(out_shape), out_dtype, info
        self.size = None
        self.patches = tuple(tuple(_resolve(self.plans[f[0]].args.sig, f) for f in fs) for fs in self.fields)
        self.lock = threading.Lock()

    def derive(self, plans: tuple[LaunchPlan, ...], spans: tuple[tuple[int, int], ...], tmaps: tuple[TmapSlot, ...],
               ptrs: tuple[int, ...], keep: tuple = (), out_shape: tuple = ()) -> "LayoutEntry":
        """The entry of another layout of the same kind (a layout family's member): ``plans`` are
        launches of the same signatures whose argument blocks the caller built from copies of this
        entry's (``ArgPack.copy``) with the size fields changed; fields, alignments, outputs, device,
        stream, output dtype and info are this entry's. ``ptrs`` are written into the plans here
        (the maps in ``tmaps`` must already hold their addresses); nothing is checked (``check``)."""
        e = LayoutEntry.__new__(LayoutEntry)
        e.fields, e.aligns, e.patches, e.out_slot, e.out_slots = (self.fields, self.aligns, self.patches,
                                                                   self.out_slot, self.out_slots)
        e.device, e.stream, e.out_dtype, e.info = self.device, self.stream, self.out_dtype, self.info
        e.plans, e.spans, e.tmaps, e.ptrs = tuple(plans), tuple(spans), tuple(tmaps), tuple(ptrs)
        e.keep, e.out_shape, e.size = keep, tuple(out_shape), None
        for i, p in enumerate(e.ptrs):
            for pi, off, fmt, add in self.patches[i]:
                e.plans[pi].args.patch(off, fmt, p + add)
        e.lock = threading.Lock()
        return e

    def check(self, ptrs: tuple[int, ...], spans: tuple[tuple[int, int], ...] | None = None) -> bool:
        """Whether ``ptrs`` satisfy the address-dependent rules (alignment, no output overlap), with
        the entry's byte spans or those of another layout of its kind (``spans``, for ``derive``)."""
        for p, a in zip(ptrs, self.aligns):
            if p % a:
                return False
        if spans is None:
            spans = self.spans
        for o in self.out_slots:
            po = ptrs[o]
            lo, hi = po + spans[o][0], po + spans[o][1]
            for i, p in enumerate(ptrs):
                if i != o and p + spans[i][0] < hi and lo < p + spans[i][1]:
                    return False
        return True

    def forget_addresses(self) -> None:
        """Make the next ``bind`` check and patch every address (after the spans or maps changed)."""
        self.ptrs = (-1,) * len(self.ptrs)

    def bind(self, ptrs: tuple[int, ...]) -> bool:
        """Check ``ptrs`` and patch the ones that changed; False (nothing patched) when a check
        fails. Call with ``lock`` held, and launch under the same hold."""
        old = self.ptrs
        if ptrs == old:
            return True
        if len(ptrs) != len(old) or not self.check(ptrs):
            return False
        plans = self.plans
        for i, p in enumerate(ptrs):
            if p != old[i]:
                for pi, off, fmt, add in self.patches[i]:
                    plans[pi].args.patch(off, fmt, p + add)
                for t in self.tmaps:
                    if t.slot == i:
                        t.apply(plans, p + t.offset)
        self.ptrs = ptrs
        return True

    def launch(self) -> None:
        """Launch every plan on the entry's stream, with its device's context current in processes
        that see several GPUs. Call with ``lock`` held."""
        launch_plans(self.plans, self.device)


class LayoutCache:
    """key -> LayoutEntry, bounded (oldest entries evicted first)."""

    def __init__(self, maxsize: int = 1024):
        self._map = BoundedMap(maxsize)

    def get(self, key) -> LayoutEntry | None:
        return self._map.get(key)

    def remember(self, key, entry: LayoutEntry) -> LayoutEntry:
        return self._map.put(key, entry)

    def __len__(self) -> int:
        return len(self._map)

    def clear(self) -> None:
        self._map.clear()


# ----------------------------------------------------------------------------- the tensors and streams of a layout call
def call_kind(inputs: tuple, optional: tuple = (), outputs: tuple = ()) -> str | None:
    """The fast-reader kind (runtime.tensors.fast_kind) of a call whose tensors the layout plans can
    serve, or None: every input of one exact type with a fast reader, optional inputs None or of that
    type, outputs None or of that type and writable (JAX arrays cannot be outputs; XLA buffers must
    be writable)."""
    t = type(inputs[0])
    kind = _tensors.fast_kind(inputs[0])
    if kind is None:
        return None
    for x in inputs[1:]:
        if type(x) is not t:
            return None
    for x in optional:
        if x is not None and type(x) is not t:
            return None
    for x in outputs:
        if x is not None and (type(x) is not t or kind == "jax" or (kind == "xla" and not x.writeable)):
            return None
    return kind


def call_streams(kind: str, dev: int, stream: Any) -> tuple[int, int]:
    """(launch stream, the framework's current stream) of a layout call whose tensors are of fast
    reader ``kind`` on ``dev``: ``stream`` resolved, or the current stream when it is None (torch's
    for torch tensors, CuPy's otherwise). XLA buffers come with their callback's stream: CuPy's
    current stream is not read for them (the second value is then the launch stream too)."""
    if kind == "xla" and stream is not None:
        s = resolve_stream(stream, dev, kind)
        return s, s
    cur = current_stream(kind, dev)
    return (cur if stream is None else resolve_stream(stream, dev, kind)), cur
