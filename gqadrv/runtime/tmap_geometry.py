"""Tensor maps of a new geometry written from one encoded before, where the driver's encoding is
known to allow it; otherwise the driver encodes.

The first call of a new layout (a new batch size, KV capacity or page-pool size) needs tensor maps
that differ from the layout's previous ones only in the global address, the dims and the strides.
``cuTensorMapEncodeTiled`` costs 10-13 us of host time per map on the H200 / H100 hosts (its
arguments become ~15 cuda.bindings objects); ``encode_tiled`` with a written map costs 2.9 us on the
2-core development machine (validation, class lookup, copy and seven field writes; fake encoder), whose
Python runs ~2.5x faster than those hosts' (on an H100 host: 2-5 us less per first call of a new GQA
layout, below). The descriptor layout is opaque, but on the drivers seen so far each of those
values is a plain field of the 128 bytes: the address a little-endian u64, each dim ``d`` as
``d - 1`` in a u32, each stride ``s`` as ``s >> 4`` in a u32 (strides below 2^36 bytes).

Nothing here is assumed: per map *class* (dtype, rank, box, element strides, swizzle, L2 promotion,
OOB fill) and process, ``learn`` takes the address field from ``tensormap.address_offset`` (the
field ``rebase`` patches), asks the driver for encodings that change one dim or stride of a base map
at a time and finds the one field each change lands in (the only bytes that differ, holding the old
and the new value); then it checks the learned places against the driver on encodings that change
every value at once: each dim and each stride at large values in turn, every dim at 1, and random
geometries. A class whose encodings do not behave like that (any other byte moving, a probe the
driver refuses, two candidate places) is never patched. A patch writes only values no wider (in
bits) than the widest each field was checked with; anything else is encoded by the driver. Learning costs 3 * rank + 2 encodings, once per class,
at the second geometry of the class a process encodes (a class seen with one geometry costs
nothing extra). A process whose GPUs are not all of one compute capability never patches (a layout
is learned in whichever context is current).

On by default; ``GQADRV_TMAP_PATCH=0`` turns it off (every map encoded by the driver). Verified on an
H100 (driver 580.159.04, 2026-12-07): ``tests/runtime/test_tmap_geometry_gpu.py`` learned every map class
gqadrv encodes (the GQA KV cache, the paged K / V pools in both layouts and the e4m3 pools, the MLA
cache, the runtime proof's maps) and 150 written maps per class equalled the driver's encodings byte for
byte (20 passed); host cost of a first call of a new GQA layout 71-76 us with patching against 76-79
without (``tools/profile_convenience.py``, two interleaved runs each, CuPy and torch).
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import threading
from typing import Callable

__all__ = ["ClassLayout", "class_key", "enabled", "learn", "note", "patch", "reset", "writer"]

_STRIDE_LIMIT = 1 << 36   # strides at or above 2^36 bytes keep bits outside their u32 field
_pack_q = struct.Struct("<Q").pack_into
_pack_i = struct.Struct("<I").pack_into


class ClassLayout:
    """Where one map class keeps its geometry: byte offsets of the address (u64), of each dim's
    ``d - 1`` and of each stride's ``s >> 4`` (u32), the widest value (bits) each field was checked
    with, and a base encoding to copy."""

    __slots__ = ("addr", "base", "dim_bits", "dim_top", "dims", "stride_bits", "stride_top", "strides")

    def __init__(self, base: bytes, addr: int, dims: tuple[int, ...], strides: tuple[int, ...],
                 dim_bits: tuple[int, ...], stride_bits: tuple[int, ...]):
        self.base, self.addr, self.dims, self.strides = base, addr, dims, strides
        self.dim_bits, self.stride_bits = dim_bits, stride_bits
        # the largest value each field takes: (d - 1) and (s >> 4) no wider than checked, strides < 2^36
        self.dim_top = tuple(1 << w for w in dim_bits)
        self.stride_top = tuple(min(((1 << w) << 4) - 1, _STRIDE_LIMIT - 1) for w in stride_bits)

    def write(self, address: int, dims: tuple[int, ...], strides: tuple[int, ...]) -> bytes | None:
        """The map of this class for ``address`` / ``dims`` / ``strides`` (already validated by
        ``tensormap.validate_tiled``), or None when a value is wider than its field was checked with."""
        for d, top in zip(dims, self.dim_top):
            if d > top:
                return None
        for s, top in zip(strides, self.stride_top):
            if s > top:
                return None
        buf = bytearray(self.base)
        _pack_q(buf, self.addr, address)
        for off, d in zip(self.dims, dims):
            _pack_i(buf, off, d - 1)
        for off, s in zip(self.strides, strides):
            _pack_i(buf, off, s >> 4)
        return bytes(buf)


def enabled() -> bool:
    """On unless GQADRV_TMAP_PATCH=0 (see the module docstring)."""
    return os.environ.get("GQADRV_TMAP_PATCH", "1") != "0"


_ENABLED = enabled()
_lock = threading.Lock()
_bases: dict = {}     # (encoder, class key) -> (spec, 128 bytes): the class's first map, until a second geometry
_layouts: dict = {}   # (encoder, class key) -> ClassLayout, or None (not patchable)


def reset() -> None:
    """Forget every class (tests; a process that changed GQADRV_TMAP_PATCH)."""
    global _ENABLED
    with _lock:
        _bases.clear()
        _layouts.clear()
        _ENABLED = enabled()


def class_key(spec) -> tuple:
    """What fixes a map's class: dtype, box (its length is the rank), element strides, swizzle, L2
    promotion and OOB fill (specs are frozen, their sequences tuples)."""
    return (spec.dtype, spec.box, spec.element_strides, spec.swizzle, spec.l2_promotion, spec.oob_nan)


def patch(spec, encode: Callable) -> bytes | None:
    """The map of ``spec`` written from its class's layout learned from ``encode`` (the driver's
    encoder: what is learned holds for that encoder only), or None (encode it)."""
    if not _ENABLED:
        return None
    lay = _layouts.get((encode, class_key(spec)))
    if lay is None:
        return None
    return lay.write(spec.address, spec.dims, spec.strides)


def writer(spec, encode: Callable) -> Callable | None:
    """``ClassLayout.write`` of ``spec``'s class learned from ``encode``, for callers that write many
    maps of one class whose geometries are valid by construction (``write`` still refuses values
    wider than checked: encode those); None while the class is not learned or patching is off."""
    if not _ENABLED:
        return None
    lay = _layouts.get((encode, class_key(spec)))
    return None if lay is None else lay.write


def note(spec, data: bytes, encode: Callable) -> None:
    """Record a map the driver encoded (``data`` for ``spec``); at the class's second geometry,
    learn the class (``encode``: the driver's encoder, spec -> 128 bytes)."""
    if not _ENABLED:
        return
    key = (encode, class_key(spec))
    if key in _layouts:
        return
    with _lock:
        if key in _layouts:
            return
        first = _bases.get(key)
        if first is None or any(s >= _STRIDE_LIMIT for s in first[0].strides):
            _bases[key] = (spec, data)  # (a base with strides past the u32 fields would not be learnable)
            return
        if first[0].dims == spec.dims and first[0].strides == spec.strides:
            return  # another address of the same geometry: nothing to learn from
        _layouts[key] = learn(first[0], first[1], encode) if _one_arch() else None
        del _bases[key]


def _one_arch() -> bool:
    """Whether every GPU of the process has the same compute capability: the class layouts are
    learned in whichever context is current, so a process with GPUs of two architectures (whose
    encodings might differ) encodes every map."""
    from . import driver as _drv

    try:
        n = _drv.device_count()
        return n <= 1 or len({_drv.device_info(i).cc for i in range(n)}) == 1
    except Exception:  # noqa: BLE001 - no answer: no patching
        return False


# ----------------------------------------------------------------------------- learning
def _field(old_map: bytes, new_map: bytes, old: int, new: int, width: int) -> int | None:
    """The one byte offset where ``old_map`` holds ``old`` and ``new_map`` holds ``new`` (little-endian,
    ``width`` bytes) and outside which the two maps are equal; None if there is not exactly one."""
    diff = [i for i in range(128) if old_map[i] != new_map[i]]
    if not diff:
        return None
    lo, hi = diff[0], diff[-1]
    hits = [w for w in range(max(0, hi - width + 1), min(lo, 128 - width) + 1)
            if int.from_bytes(old_map[w:w + width], "little") == old
            and int.from_bytes(new_map[w:w + width], "little") == new]
    return hits[0] if len(hits) == 1 else None


def _flip(v: int) -> int:
    """A different value of the same u32 field (its low bits flipped), never 0."""
    w = v ^ 0x15
    return w if w else v ^ 0x16


def _wide_geometries(spec, esize: int, rng: random.Random) -> list[tuple[int, tuple, tuple]]:
    """Valid (address, dims, strides): each dim in turn at a large value with the others at their box
    sizes and the strides packed (so the strides outside the large dim are large too), then two
    random packed geometries with the outermost dim (which sets no stride) near 2^32."""
    rank = len(spec.dims)
    out = []
    for k in range(rank):
        dims = [max(1, b) for b in spec.box]
        hi = 1 << 32
        while True:
            dims[k] = hi
            strides = _packed(dims, esize, rng, pad=False)
            if not strides or strides[-1] < _STRIDE_LIMIT:
                break
            hi //= 2
        dims[k] = rng.randint(max(1, hi // 2), hi)
        out.append((_address(rng), tuple(dims), _packed(dims, esize, rng, pad=False)))
    dims = [1] * rank  # every dim below its box (the base usually has none)
    out.append((_address(rng), tuple(dims), _packed(dims, esize, rng, pad=False)))
    for _ in range(2):
        dims = [rng.randint(1, 1 << 11) for _ in range(rank)]
        strides = _packed(dims, esize, rng, pad=True)
        while strides and strides[-1] >= _STRIDE_LIMIT:
            dims = [max(1, d // 2) for d in dims]
            strides = _packed(dims, esize, rng, pad=True)
        dims[-1] = rng.randint(1 << 31, 1 << 32)  # the outermost dim sets no stride
        out.append((_address(rng), tuple(dims), strides))
    return out


def _packed(dims: list[int], esize: int, rng: random.Random, pad: bool) -> tuple[int, ...]:
    strides, s = [], -(-dims[0] * esize // 16) * 16
    for j in range(1, len(dims)):
        if pad:
            s += 16 * rng.randint(0, 3)
        strides.append(s)
        s = -(-s * dims[j] // 16) * 16
    return tuple(strides)


def _address(rng: random.Random) -> int:
    """A 16-byte aligned address in the range device pointers take (below 2^47)."""
    return rng.randrange(1 << 32, 1 << 47) & ~15


def learn(spec, data: bytes, encode: Callable) -> ClassLayout | None:
    """The layout of ``spec``'s class learned from its encoding ``data`` and the driver (``encode``),
    or None when the class cannot be patched safely (see the module docstring)."""
    from .tensormap import ELEMENT_BYTES, address_offset  # (tensormap imports this module)

    if len(data) != 128 or any(s >= _STRIDE_LIMIT for s in spec.strides):
        return None
    try:
        def enc(**change) -> bytes:
            m = encode(dataclasses.replace(spec, **change))
            if len(m) != 128:
                raise ValueError("a tensor map of other than 128 bytes")
            return m

        addr = address_offset(data, spec.address)  # the address field tensormap.rebase patches
        if addr is None:
            return None
        dims = []
        for k, d in enumerate(spec.dims):
            e = _flip(d - 1)
            f = _field(data, enc(dims=spec.dims[:k] + (e + 1,) + spec.dims[k + 1:]), d - 1, e, 4)
            if f is None:
                return None
            dims.append(f)
        strides = []
        for k, s in enumerate(spec.strides):
            e = _flip(s >> 4)
            f = _field(data, enc(strides=spec.strides[:k] + (e << 4,) + spec.strides[k + 1:]), s >> 4, e, 4)
            if f is None:
                return None
            strides.append(f)
        places = [(addr, 8)] + [(f, 4) for f in dims + strides]
        spans = sorted((o, o + w) for o, w in places)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return None  # two values in overlapping bytes: not plain fields
        rank = len(spec.dims)
        lay = ClassLayout(data, addr, tuple(dims), tuple(strides), (32,) * rank, (32,) * (rank - 1))
        dim_bits, stride_bits = [0] * rank, [0] * (rank - 1)
        rng = random.Random(0x7A3A)
        for address, gd, gs in _wide_geometries(spec, ELEMENT_BYTES[spec.dtype], rng):
            if lay.write(address, gd, gs) != enc(address=address, dims=gd, strides=gs):
                return None
            dim_bits = [max(w, (d - 1).bit_length()) for w, d in zip(dim_bits, gd)]
            stride_bits = [max(w, (s >> 4).bit_length()) for w, s in zip(stride_bits, gs)]
    except Exception:  # noqa: BLE001 - a probe the driver refuses: the class is encoded, never patched
        return None
    return ClassLayout(data, addr, tuple(dims), tuple(strides), tuple(dim_bits), tuple(stride_bits))
