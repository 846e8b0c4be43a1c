"""Layout families of ``gqa_decode`` on the CPU (issue #21 item 2, gqa/layout_family.py): a first call
of a new (batch, capacity) layout of a known family launches exactly what the full path launches for
the same tensors (kernel, grid, block, shared memory, stream and every argument byte, tensor map
included), on every route side; layouts that are not members, and members that break an address
rule, take the full path. GPU steps are stubbed (tests/host_stubs.py); the tensor-map stand-in encodes
the geometry, so a map of the wrong dims would differ."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gqadrv.gqa import api
from gqadrv.gqa import layout_family as fam
from gqadrv.ops import layouts
from gqadrv.ops import outputs as _outputs
from gqadrv.gqa import plan
from gqadrv.runtime import module, tensormap
from tests.fakes import aligned, plain_tensor_map
from tests.host_stubs import FakeT, stub_gpu


@pytest.fixture
def stubbed(monkeypatch):
    """The stubbed GPU, an encoder of the geometry, empty caches, and the list of launches made
    (kernel name, grid, block, smem, cluster, stream, argument bytes)."""
    stub_gpu(monkeypatch)
    monkeypatch.setattr(tensormap, "_encode", plain_tensor_map)
    launched = []
    monkeypatch.setattr(module.LaunchPlan, "launch", lambda self, stream=None: launched.append(
        (self.kernel.name, self.grid, self.block, self.smem, self.cluster, self.stream, self.args.bytes())))
    monkeypatch.setattr(api, "_layouts", layouts.LayoutCache(64))
    monkeypatch.setattr(fam, "families", fam.BoundedMap(16))
    monkeypatch.setattr(plan, "_tmaps", plan.BoundedMap(64))   # maps of another test's encoder
    layouts._encoded.clear()
    buffers = {}

    def allocate(like, shape, dtype, device, stream, current=None):  # one buffer per shape: same address
        b = buffers.get(shape)
        if b is None:
            b = buffers[shape] = FakeT(aligned(shape, like.a.dtype))
        return _outputs.NewOutput(b.a.__array_interface__["data"][0], b, None)

    monkeypatch.setattr(_outputs, "allocate", allocate)
    return launched


def _tensors(B, C, Hq=32, Hkv=8, D=128, dtype=np.float16, out=True):
    q = FakeT(aligned((B, Hq, D), dtype))
    kv = FakeT(aligned((B, 2, Hkv, C, D), dtype))
    lens = FakeT(aligned((B,), np.int32))
    return q, kv, lens, (FakeT(aligned((B, Hq, D), dtype)) if out else None)


def _decode(t, **kw):
    import gqadrv

    q, kv, lens, out = t
    return gqadrv.gqa_decode(q, kv, lens, out=out, stream=7, **kw)


def _full_path_launch(t, launched, **kw):
    """What the full path launches for tensors ``t`` (no layout or family known)."""
    api._layouts.clear()
    fam.families.clear()
    n = len(launched)
    _decode(t, **kw)
    assert len(launched) == n + 1
    return launched[-1]


# (B, C): TMA unsplit, TMA split (B1 long), short (C <= 64, both sides of the threshold), the
# large-batch rule (B * Hkv >= 2 waves of the stub's 132 SMs), odd sizes
MEMBERS = [(2, 1000), (1, 4096), (1, 32768), (3, 48), (1, 64), (5, 65), (40, 512), (33, 77), (7, 1), (128, 2048)]


@pytest.mark.parametrize("Hq,Hkv,D,dtype", [(32, 8, 128, np.float16), (16, 2, 64, np.float16),
                                            (32, 8, 256, ml_dtypes.bfloat16), (8, 8, 128, np.float16)],
                         ids=["Hq32_D128", "Hq16_D64", "D256_bf16", "group1"])
@pytest.mark.parametrize("with_out", [True, False], ids=["out", "alloc"])
def test_members_launch_what_the_full_path_launches(stubbed, Hq, Hkv, D, dtype, with_out):
    launched = stubbed
    template = _tensors(2, 1024, Hq, Hkv, D, dtype, with_out)
    _decode(template)                       # the family's first call: the full path files the template
    assert len(fam.families) == 1
    for B, C in MEMBERS:
        t = _tensors(B, C, Hq, Hkv, D, dtype, with_out)
        _decode(t)
        got = launched[-1]
        assert len(fam.families) == 1
        want = _full_path_launch(t, launched)
        assert got == want, (B, C)
        _decode(template)                   # the full path's call above reset the family: file it again


def test_members_on_every_side_and_their_replays(stubbed):
    """The first member on another route side is built from the template's problem; later members
    of that side copy its arguments; every member's next call is a plain replay of its entry."""
    launched = stubbed
    _decode(_tensors(2, 1024))
    sides = {}
    for B, C in MEMBERS:
        t = _tensors(B, C)
        _decode(t)
        sides = dict(fam.families.values()[0].built)
        n = len(api._layouts)
        t2 = _tensors(B, C)                 # the same layout, new tensors: the layout cache's replay
        _decode(t2)
        assert len(api._layouts) == n
        assert launched[-1][:5] == launched[-2][:5]
    assert set(sides) == {(False, False), (True, False), (False, True)}


def test_scales_backend_and_stream_make_other_families(stubbed):
    _decode(_tensors(2, 1024))
    _decode(_tensors(2, 1024), q_scale=0.5)
    _decode(_tensors(2, 1024), sm_scale=0.1)
    _decode(_tensors(2, 1024), backend="portable")
    assert len(fam.families) == 4
    launched = stubbed
    t = _tensors(3, 333)
    _decode(t, backend="portable")
    assert launched[-1] == _full_path_launch(t, launched, backend="portable")


def test_split_key_of_members_and_non_members(stubbed):
    from gqadrv.gqa.api import _call_facts

    def key(q, kv, lens, out=None):
        f = _call_facts(q, kv, lens, out, 1.0, None, 7, None)
        return fam.split_key(f[0])

    q, kv, lens, out = _tensors(3, 100)
    k, B, C = key(q, kv, lens, out)
    assert (B, C) == (3, 100)
    q2, kv2, lens2, out2 = _tensors(5, 7)
    assert key(q2, kv2, lens2, out2)[0] == k
    assert key(q, kv, lens)[0] != k                                           # out not given: another family
    assert key(*_tensors(3, 100, Hq=16)[:3], None)[0] != key(q, kv, lens)[0]  # another head count
    wide = FakeT(aligned((3, 64, 128))[:, :32, :])                            # q rows of a wider buffer
    assert key(wide, kv, lens, out) is None
    kv_t = FakeT(aligned((3, 2, 8, 128, 100)).transpose(0, 1, 2, 4, 3))        # K / V transposed
    assert key(q, kv_t, lens, out) is None
    assert key(q, kv, FakeT(aligned((4,), np.int32)), out) is None            # lengths of another batch
    assert key(q, FakeT(aligned((3, 2, 8, 100, 64))), lens, out) is None       # head dims differ
    assert key(q, FakeT(aligned((3, 3, 8, 100, 128))), lens, out) is None      # not [B, 2, ...]
    assert key(q, kv, lens, FakeT(aligned((3, 32, 64)))) is None              # out of another shape
    assert key(FakeT(aligned((0, 32, 128))), FakeT(aligned((0, 2, 8, 100, 128))), FakeT(aligned((0,), np.int32)),
               None) is None                                                 # empty batch
    assert key(q, FakeT(aligned((3, 2, 8, 0, 128))), lens, out) is None       # zero capacity


def test_members_breaking_an_address_rule_take_the_full_path(stubbed):
    """A misaligned KV view or an out overlapping q is refused before any launch, and the full path
    raises the contract's error."""
    launched = stubbed
    _decode(_tensors(2, 1024))
    q, kv, lens, out = _tensors(3, 100)
    raw = aligned((3 * 2 * 8 * 100 * 128 + 8,))
    kv_off = FakeT(raw[4:4 + kv.a.size].reshape(kv.a.shape))
    n = len(launched)
    with pytest.raises(ValueError, match="align"):
        _decode((q, kv_off, lens, out))
    with pytest.raises(ValueError, match="overlap"):
        _decode((q, kv, lens, FakeT(q.a)))
    assert len(launched) == n
    _decode(_tensors(3, 100))                                       # the first member on this side
    with pytest.raises(ValueError, match="align"):
        _decode((q, kv_off, lens, out))                             # the copy path refuses it too
    with pytest.raises(ValueError, match="overlap"):
        _decode((q, kv, lens, FakeT(q.a)))
    assert len(launched) == n + 1


def test_non_members_are_validated_by_the_full_path(stubbed):
    launched = stubbed
    _decode(_tensors(2, 1024))
    q, kv, lens, out = _tensors(3, 100)
    with pytest.raises(ValueError, match="sequence_lengths must have shape"):
        _decode((q, kv, FakeT(aligned((4,), np.int32)), out))
    wide = FakeT(aligned((3, 64, 128))[:, :32, :])
    with pytest.raises(ValueError, match="contiguous"):
        _decode((wide, kv, lens, out))
    assert len(fam.families) == 1 and len(launched) == 1


def test_families_keep_no_tensor_alive(stubbed):
    """A family's template must not hold the first call's tensors (a KV cache would never be freed)."""
    import gc
    import weakref

    t = _tensors(2, 1024)
    refs = [weakref.ref(x) for x in t]
    _decode(t)
    _decode(_tensors(3, 500))
    assert len(fam.families) == 1
    del t
    gc.collect()   # the layout entries (still remembered) hold addresses, not tensors
    assert [r() for r in refs] == [None] * 4



# the (route side, B) of each member of RESIZED: C 4096, 32768, 700, 1500, 20000, 300, 1000 at B 1 (16, 16,
# 6, 6, 16, 1 and 8 splits: grid and workspace change, and the launch moves between the ticket merge and
# clusters of 6 or 8 CTAs with the receive area in shared memory) and C 1000 / 333 at B 2 (a cluster of 8,
# then one split); the short side (C 48 / 64 / 1); the large-batch rule (B 40)
RESIZED = [(2, 1000), (1, 4096), (1, 32768), (1, 700), (3, 48), (3, 64), (1, 1500), (40, 512), (2, 333), (40, 700),
           (3, 1), (1, 20000), (1, 300), (1, 1000)]
RESIZED_KEYS = {((False, False), 2), ((False, False), 1), ((True, False), 3), ((False, True), 40)}


@pytest.mark.parametrize("with_out", [True, False], ids=["out", "alloc"])
def test_a_resized_entry_launches_what_the_full_path_launches(stubbed, with_out):
    """Members of one route side and batch size called one after another share a re-sizable entry
    (size fields, tensor map, grid width rewritten in place): each launch equals the full path's for
    the same tensors. Called again in another order, a layout whose sizes the shared entry no longer
    holds gets an entry of its own with the same bytes; after that every call is a plain replay."""
    launched = stubbed
    members = [_tensors(B, C, out=with_out) for B, C in RESIZED]
    want = [_full_path_launch(t, launched) for t in members]
    api._layouts.clear()
    fam.families.clear()
    _decode(_tensors(2, 1024, out=with_out))
    for t, w, bc in zip(members, want, RESIZED):
        _decode(t)
        assert launched[-1] == w, bc
    (f,) = fam.families.values()
    assert set(f.flex) == {(fam_side, B) for fam_side, B in RESIZED_KEYS}
    entries = api._layouts._map.values()
    assert len({id(e) for e in entries}) < len(entries)          # members of a side share one entry
    assert all(e.size is not None for e in f.flex.values())
    for t, w, bc in reversed(list(zip(members, want, RESIZED))):
        _decode(t)
        assert launched[-1] == w, bc
    n, ids = len(api._layouts), {id(e) for e in api._layouts._map.values()}
    for t, w, bc in zip(members, want, RESIZED):
        _decode(t)
        assert launched[-1] == w, bc
    assert len(api._layouts) == n and {id(e) for e in api._layouts._map.values()} == ids


def test_a_resized_entry_checks_every_address_again(stubbed):
    """After a re-size the byte spans are the new layout's: an output inside the larger KV cache is
    refused although every address is the one the entry last launched with (nothing launched)."""
    launched = stubbed
    _decode(_tensors(2, 1024))
    n100, n300, n_out = 3 * 2 * 8 * 100 * 128, 3 * 2 * 8 * 300 * 128, 3 * 32 * 128
    buf = aligned((n300,))
    kv100 = FakeT(buf[:n100].reshape(3, 2, 8, 100, 128))
    kv300 = FakeT(buf.reshape(3, 2, 8, 300, 128))                     # the same address, three times longer
    out = FakeT(buf[n300 - n_out:].reshape(3, 32, 128))              # past kv100, inside kv300
    q, _kv, lens, _out = _tensors(3, 100)
    _decode((q, kv100, lens, out))                                   # the side's re-sizable entry
    n = len(launched)
    with pytest.raises(ValueError, match="overlap"):
        _decode((q, kv300, lens, out))
    assert len(launched) == n
    _decode((q, kv100, lens, out))                                   # its own layout again: launched as before
    assert launched[-1] == launched[n - 1]


def _plain_field_map(spec) -> bytes:
    """A driver-like encoder whose geometry sits in plain fields (address u64 at 0, strides >> 4 and
    dims - 1 as u32 from 12 and 32, a class byte), so runtime.tmap_geometry learns its class."""
    import struct

    b = bytearray(128)
    b[0:8] = spec.address.to_bytes(8, "little")
    for i, s in enumerate(spec.strides):
        struct.pack_into("<I", b, 12 + 4 * i, s >> 4)
    for i, d in enumerate(spec.dims):
        struct.pack_into("<I", b, 32 + 4 * i, d - 1)
    b[100] = (len(spec.dims) * 7 + spec.box[1]) & 0xFF
    return bytes(b)


def test_a_resized_entry_writes_its_map_from_the_learned_class(stubbed, monkeypatch):
    """With the KV map class learned (runtime.tmap_geometry), members' maps are written directly
    (``tensormap.class_writer``: no ``encode_tiled``, copied and re-sized entries alike): the bytes the
    driver-like encoder gives for the member's geometry, and launches equal to the full path's."""
    from gqadrv.runtime import tmap_geometry

    launched = stubbed
    monkeypatch.setattr(tensormap, "_encode", _plain_field_map)
    monkeypatch.setattr(tensormap, "_offset_state", [])
    monkeypatch.setattr(tmap_geometry, "_one_arch", lambda: True)
    monkeypatch.setattr(tmap_geometry, "_ENABLED", True)
    monkeypatch.setattr(tmap_geometry, "_layouts", {})
    monkeypatch.setattr(tmap_geometry, "_bases", {})
    members = [_tensors(B, C) for B, C in [(2, 1000), (1, 4096), (5, 65), (1, 20000)]]
    want = [_full_path_launch(t, launched) for t in members]
    api._layouts.clear()
    fam.families.clear()
    _decode(_tensors(2, 1024))
    encoded = []
    monkeypatch.setattr(fam, "encode_tiled", lambda spec: encoded.append(spec) or tensormap.encode_tiled(spec))
    for t, w in zip(members, want):
        _decode(t)
        assert launched[-1] == w
    assert encoded == []                                          # the class was learned: every map written
    flex = fam.families.values()[0].flex[((False, False), 1)]
    assert flex.size == (1, 20000)                                # re-sized from C 4096
    (slot,) = flex.tmaps
    assert slot.encoded == _plain_field_map(slot.spec)
    assert slot.spec.dims == (128, 20000, 8, 2)
