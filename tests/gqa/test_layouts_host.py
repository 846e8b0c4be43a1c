"""The layout-keyed convenience plans (issue #21 item 2) without a GPU: tensor-map re-basing (patch
or re-encode, never a stale map), the address checks and patches of ``ops.layouts.LayoutEntry``,
the layout key of ``gqa_decode`` and its refusal paths (a refused call never launches)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from gqadrv.gqa import api
from gqadrv.gqa.args import SIG_TMA
from gqadrv.ops import layouts
from gqadrv.runtime import driver as _drv
from gqadrv.runtime import tensormap as tm
from gqadrv.runtime import tensors as _tensors
from gqadrv.runtime.module import ArgPack
from tests.fakes import FakeCudaArray, assert_layout_keys_differ, register_fast_kind


# ----------------------------------------------------------------------------- fake encoders
def _body(spec: tm.TmaSpec) -> bytes:
    """128 deterministic bytes from everything but the address."""
    h = hashlib.sha512(repr((spec.dtype, spec.dims, spec.strides, spec.box, spec.swizzle)).encode()).digest()
    return (h + h)[:128]


def enc_plain(spec: tm.TmaSpec, at: int = 16) -> bytes:
    """An encoder that stores the address as one little-endian u64 at byte ``at``."""
    b = bytearray(_body(spec))
    b[at:at + 8] = spec.address.to_bytes(8, "little")
    return bytes(b)


def enc_shifted(spec: tm.TmaSpec) -> bytes:
    """An encoder that packs address >> 4 with flag bits: not patchable as a plain u64."""
    b = bytearray(_body(spec))
    b[8:16] = ((spec.address >> 4) | (0xA << 60)).to_bytes(8, "little")
    return bytes(b)


def enc_checksum(spec: tm.TmaSpec) -> bytes:
    """Plain u64 address at 0, but another byte depends on the address too."""
    b = bytearray(enc_plain(spec, 0))
    b[100] = spec.address % 251
    return bytes(b)


@pytest.fixture
def encoder(monkeypatch):
    """Install a fake driver encoder (counting calls) and forget what the probe learned."""
    calls = []

    def use(fn):
        def wrapped(spec):
            calls.append(spec.address)
            return fn(spec)

        monkeypatch.setattr(tm, "_encode", wrapped)
        monkeypatch.setattr(tm, "_offset_state", [])
        calls.clear()
        return calls

    return use


SPEC = tm.TmaSpec(dtype="float16", address=0x7000_0000_1000, dims=(128, 1000, 8, 4),
                  strides=(256, 1000 * 256, 8 * 1000 * 256), box=(64, 32, 1, 1), swizzle="128b")


def test_probe_learns_a_plain_address_field(encoder):
    encoder(lambda s: enc_plain(s, 24))
    m = tm.encode_tiled(SPEC)
    assert tm.address_offset(m, SPEC.address) == 24
    new = 0x7000_0abc_de00
    assert tm.rebase(m, SPEC, new) == enc_plain(tm.TmaSpec(**{**SPEC.__dict__, "address": new}), 24)
    # a map whose field does not hold the address it claims is not patched
    assert tm.address_offset(m, SPEC.address + 16) is None


@pytest.mark.parametrize("fn", [enc_shifted, enc_checksum], ids=["shifted", "checksum"])
def test_unpatchable_encodings_are_encoded_again(encoder, fn):
    calls = encoder(fn)
    m = tm.encode_tiled(SPEC)
    assert tm.address_offset(m, SPEC.address) is None
    n = len(calls)
    new = 0x7000_0abc_de00
    assert tm.rebase(m, SPEC, new) == fn(tm.TmaSpec(**{**SPEC.__dict__, "address": new}))
    assert calls[n:] == [new]  # encoded again, for the new address


def test_rebase_refuses_a_misaligned_address(encoder):
    encoder(enc_plain)
    with pytest.raises(tm.TensorMapError, match="16-byte aligned"):
        tm.rebase(tm.encode_tiled(SPEC), SPEC, SPEC.address + 8)


def test_probe_without_a_driver_gives_no_field(monkeypatch):
    def boom(spec):
        raise RuntimeError("no driver")

    monkeypatch.setattr(tm, "_encode", boom)
    monkeypatch.setattr(tm, "_offset_state", [])
    assert tm.address_offset(bytes(128), 0) is None


# ----------------------------------------------------------------------------- LayoutEntry
class FakePlan:
    def __init__(self, args):
        self.args, self.launches, self.stream = args, [], 5

    def launch(self, stream=None):
        self.launches.append(self.args.bytes())


Q, KV, LENS, OUT = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000
NQ, NKV, NL, NO = 4096, 1 << 20, 8, 4096


def _entry(encoder_fn, monkeypatch, out_slot=3):
    monkeypatch.setattr(tm, "_encode", encoder_fn)
    monkeypatch.setattr(tm, "_offset_state", [])
    monkeypatch.setattr(_drv, "multi_device", lambda: False)
    layouts._encoded.clear()
    spec = tm.TmaSpec(**{**SPEC.__dict__, "address": KV})
    enc = tm.encode_tiled(spec)
    pack = ArgPack(SIG_TMA).pack(enc, {"q": Q, "kv": KV, "out": OUT, "lengths": LENS, "ws_o": 0, "ws_ml": 0,
                                       "counters": 0, "status": 0, "scale_log2": 0.5, "hkv": 8, "group": 4,
                                       "capacity": 1000, "num_splits": 1, "flags": 0})
    plan = FakePlan(pack)
    e = layouts.LayoutEntry((plan,), api._FIELDS, api._ALIGNS, ((0, NQ), (0, NKV), (0, NL), (0, NO)), out_slot,
                            (layouts.TmapSlot(0, "kv_map", 1, spec, enc),), (Q, KV, LENS, OUT), 0, 5)
    return e, plan, spec


def _fields(pack):
    return tuple(pack.get_field(f"args.{n}") for n in ("q", "kv", "lengths", "out"))


@pytest.mark.parametrize("fn", [enc_plain, enc_shifted], ids=["patched", "re-encoded"])
def test_bind_patches_addresses_and_the_tensor_map(fn, monkeypatch):
    """The stale-map check: after a new KV address the packed map is the map of the new address."""
    e, plan, spec = _entry(fn, monkeypatch)
    new = (Q + 0x10_0000, KV + 0x100_0000, LENS + 0x40, OUT + 0x10_0000)
    assert e.bind(new)
    assert _fields(plan.args) == new
    assert plan.args.param_bytes("kv_map") == fn(tm.TmaSpec(**{**spec.__dict__, "address": new[1]}))
    assert plan.args.param_bytes("kv_map") != fn(spec)
    back = (Q, KV, LENS, OUT)
    assert e.bind(back)
    assert plan.args.param_bytes("kv_map") == fn(spec) and _fields(plan.args) == back
    # only the output moves: the map is untouched, the output field follows
    before = plan.args.param_bytes("kv_map")
    assert e.bind((Q, KV, LENS, OUT + 0x2000))
    assert plan.args.param_bytes("kv_map") == before and plan.args.get_field("args.out") == OUT + 0x2000
    e.launch()
    assert len(plan.launches) == 1


@pytest.mark.parametrize("bad,why", [
    ((Q + 8, KV, LENS, OUT), "q misaligned"),
    ((Q, KV + 4, LENS, OUT), "kv misaligned (TMA needs 16 B)"),
    ((Q, KV, LENS + 2, OUT), "lengths misaligned"),
    ((Q, KV, LENS, OUT + 8), "out misaligned"),
    ((Q, KV, LENS, Q), "out is q"),
    ((Q, KV, LENS, Q + NQ - 16), "out overlaps q's tail"),
    ((Q, KV, LENS, KV + 4096), "out inside kv"),
    ((Q, KV, LENS, LENS - NO + 16), "out overlaps the lengths"),
])
def test_bind_refuses_and_patches_nothing(bad, why, monkeypatch):
    e, plan, _ = _entry(enc_plain, monkeypatch)
    before = plan.args.bytes()
    assert not e.bind(bad), why
    assert plan.args.bytes() == before and e.ptrs == (Q, KV, LENS, OUT)


def test_adjacent_output_is_not_an_overlap(monkeypatch):
    e, _, _ = _entry(enc_plain, monkeypatch)
    assert e.bind((Q, KV, LENS, Q + NQ))
    assert e.bind((Q, KV, LENS, Q - NO))


# ----------------------------------------------------------------------------- gqa_decode's layout key
class FakeT(FakeCudaArray):
    """A fake framework array the fast readers know (registered by the fixture)."""


@pytest.fixture
def fake_kind(monkeypatch):
    register_fast_kind(monkeypatch, FakeT)
    monkeypatch.setattr(api, "order_fast", lambda *a: None)
    for k in api._routes.TUNING_ENV:
        monkeypatch.delenv(k, raising=False)


def _aligned(shape, dtype=np.float16, fill=0):
    """A fresh 256-byte aligned buffer viewed as ``shape``."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 256, np.uint8)
    off = (-raw.__array_interface__["data"][0]) % 256
    return raw[off:off + n].view(dtype).reshape(shape)


def _set(D=128, C=100, device=0, dtype=np.float16):
    return (FakeT(_aligned((2, 16, D), dtype), device), FakeT(_aligned((2, 2, 4, C, D), dtype), device),
            FakeT(_aligned((2,), np.int32), device))


def test_key_is_the_layout_not_the_addresses(fake_kind, monkeypatch):
    q, kv, lens = _set()
    q2, kv2, lens2 = _set()
    f1 = api._call_facts(q, kv, lens, None, 1.0, None, None, None)
    f2 = api._call_facts(q2, kv2, lens2, None, 1.0, None, None, None)
    assert f1 is not None and f1[0] == f2[0] and f1[1] != f2[1]
    base = f1[0]
    o = FakeT(_aligned((2, 16, 128)))
    variants = {
        "shape": api._call_facts(*_set(C=101), None, 1.0, None, None, None),
        "head dim": api._call_facts(*_set(D=64), None, 1.0, None, None, None),
        "dtype": api._call_facts(*_set(dtype=np.uint16), None, 1.0, None, None, None),
        "device": api._call_facts(*_set(device=1), None, 1.0, None, None, None),
        "out given": api._call_facts(q, kv, lens, o, 1.0, None, None, None),
        "q_scale": api._call_facts(q, kv, lens, None, 0.5, None, None, None),
        "sm_scale": api._call_facts(q, kv, lens, None, 1.0, 0.1, None, None),
        "backend": api._call_facts(q, kv, lens, None, 1.0, None, None, "portable"),
        "stream": api._call_facts(q, kv, lens, None, 1.0, None, 77, None),
    }
    monkeypatch.setenv("GQADRV_TILING", "4,16,2")
    variants["tuning env"] = api._call_facts(q, kv, lens, None, 1.0, None, None, None)
    assert_layout_keys_differ(variants, base)
    assert variants["device"][3] == 1 and variants["device"][4] == 1001  # that device's current stream
    assert variants["stream"][4] == 77


def test_calls_the_layout_cache_cannot_serve(fake_kind):
    q, kv, lens = _set()
    other = FakeCudaArray(np.zeros((2,), np.int32))  # another framework
    assert api._call_facts(q, kv, other, None, 1.0, None, None, None) is None
    assert api._call_facts(q, kv, lens, None, np.float64(2.0), None, None, None) is None  # 0-d / numpy scalar
    assert api._call_facts(q, kv, lens, None, 1.0, np.float32(0.1), None, None) is None
    assert api._call_facts(q, kv, lens, None, True, None, None, None) is None
    assert api._call_facts(q, kv, lens, None, 1.0, None, None, 3) is None
    kv1 = _set(device=1)[1]
    assert api._call_facts(q, kv1, lens, None, 1.0, None, None, None) is None  # mixed devices


def _install(fake_kind_unused, q, kv, lens, out, monkeypatch, fn=enc_plain):
    """A remembered entry for (q, kv, lens, out) with a fake plan; returns (entry, plan)."""
    facts = api._call_facts(q, kv, lens, out, 1.0, None, None, None)
    e, plan, _ = _entry(fn, monkeypatch)
    e.ptrs = facts[1]
    e.device, e.stream = facts[3], facts[4]
    e.tmaps = (layouts.TmapSlot(0, "kv_map", 1, tm.TmaSpec(**{**SPEC.__dict__, "address": facts[1][1]}),
                                fn(tm.TmaSpec(**{**SPEC.__dict__, "address": facts[1][1]}))),)
    e.spans = ((0, q.a.nbytes), (0, kv.a.nbytes), (0, lens.a.nbytes), (0, out.a.nbytes))
    monkeypatch.setattr(api, "_layouts", layouts.LayoutCache(8))
    api._layouts.remember(facts[0], e)
    return e, plan


def test_repeated_calls_with_new_tensors_launch_the_remembered_plan(fake_kind, monkeypatch):
    import gqadrv

    q, kv, lens = _set()
    out = FakeT(_aligned((2, 16, 128)))
    _, plan = _install(fake_kind, q, kv, lens, out, monkeypatch)
    assert gqadrv.gqa_decode(q, kv, lens, out=out) is out
    assert len(plan.launches) == 1
    q2, kv2, lens2 = _set()
    out2 = FakeT(_aligned((2, 16, 128)))
    assert gqadrv.gqa_decode(q2, kv2, lens2, out=out2) is out2
    assert len(plan.launches) == 2 and len(api._layouts) == 1
    def ptr(x):
        return x.a.__array_interface__["data"][0]

    assert _fields(plan.args) == (ptr(q2), ptr(kv2), ptr(lens2), ptr(out2))
    assert struct.unpack_from("<Q", plan.args.param_bytes("kv_map"), 16)[0] == ptr(kv2)  # map re-based


def test_refused_calls_take_the_full_path_and_never_launch(fake_kind, monkeypatch):
    """Without a GPU the full path stops at NoGpuError; on a GPU it raises the validation error.
    Either way the remembered plan is not launched with the unchecked addresses."""
    import gqadrv

    q, kv, lens = _set()
    out = FakeT(_aligned((2, 16, 128)))
    e, plan = _install(fake_kind, q, kv, lens, out, monkeypatch)
    # out aliasing q (same layout): an overlap
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.gqa_decode(q, kv, lens, out=FakeT(q.a))
    # a KV view 8 bytes into a buffer (same shape, strides and dtype): misaligned for TMA
    raw = _aligned((2 * 2 * 4 * 100 * 128 + 8,))
    kv_off = FakeT(raw[4:4 + kv.a.size].reshape(kv.a.shape))
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.gqa_decode(q, kv_off, lens, out=out)
    assert plan.launches == [] and e.ptrs == api._call_facts(q, kv, lens, out, 1.0, None, None, None)[1]


# ----------------------------------------------------------------------------- XLA FFI buffers (gqadrv.jax)
class Buffer:
    """Stands in for ``jax.experimental.buffer_callback.Buffer`` (same module and type name, the
    attributes the fast reader uses): a row-major device buffer, read-only unless it is an output."""

    def __init__(self, a: np.ndarray, device: int = 0, writeable: bool = False, dl_type: int = 2):
        self.a, self.device, self._writeable, self.dl_type = a, device, writeable, dl_type

    @property
    def writeable(self):  # properties, like the nanobind type's
        return self._writeable

    @property
    def shape(self):
        return self.a.shape

    @property
    def dtype(self):
        return self.a.dtype

    @property
    def __cuda_array_interface__(self):
        if self.dl_type != 2:
            raise RuntimeError("Buffer.__cuda_array_interface__ is only supported on CUDA.")
        return {"shape": self.shape, "typestr": self.a.dtype.str, "data": (self.a.__array_interface__["data"][0],
                                                                           not self.writeable), "version": 2}

    def __dlpack_device__(self):
        return (self.dl_type, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):  # stream ignored, as XLA's
        return self.a.__dlpack__()


Buffer.__module__ = "jax.experimental.buffer_callback"


def _xla_set(C=100, device=0):
    return (Buffer(_aligned((2, 16, 128)), device), Buffer(_aligned((2, 2, 4, C, 128)), device),
            Buffer(_aligned((2,), np.int32), device), Buffer(_aligned((2, 16, 128)), device, writeable=True))


@pytest.fixture
def xla_kind(monkeypatch):
    """The real 'xla' reader; CuPy's current stream must not be consulted when a stream is given."""
    def no_current(kind, dev):
        raise AssertionError(f"current_stream({kind!r}) read for a call with an explicit stream")

    monkeypatch.setattr(layouts, "current_stream", no_current)
    monkeypatch.setattr(_drv, "multi_device", lambda: False)
    monkeypatch.delitem(_tensors._FAST_KIND, Buffer, raising=False)
    for k in api._routes.TUNING_ENV:
        monkeypatch.delenv(k, raising=False)


def test_xla_buffers_are_read_by_their_own_reader(xla_kind):
    q, kv, lens, out = _xla_set()
    assert _tensors.fast_kind(q) == "xla"
    f = api._call_facts(q, kv, lens, out, 1.0, None, 777, None)
    assert f is not None and f[2] == "xla" and f[4] == f[5] == 777
    assert f[1] == tuple(x.a.__array_interface__["data"][0] for x in (q, kv, lens, out))
    q2, kv2, lens2, out2 = _xla_set()
    f2 = api._call_facts(q2, kv2, lens2, out2, 1.0, None, 777, None)
    assert f2[0] == f[0] and f2[1] != f[1]  # keyed by layout, not by address
    assert api._call_facts(*_xla_set(C=101), 1.0, None, 777, None)[0] != f[0]
    assert api._call_facts(q, kv, lens, out, 1.0, None, 778, None)[0] != f[0]


def test_xla_buffers_the_layout_cache_does_not_serve(xla_kind):
    q, kv, lens, out = _xla_set()
    assert api._call_facts(q, kv, lens, None, 1.0, None, 777, None) is None  # no out: not a callback's call
    ro = Buffer(out.a, writeable=False)
    assert api._call_facts(q, kv, lens, ro, 1.0, None, 777, None) is None   # an input buffer as out
    cpu = [Buffer(x.a, writeable=x.writeable, dl_type=1) for x in (q, kv, lens, out)]
    assert api._call_facts(*cpu, 1.0, None, 777, None) is None               # XLA's CPU backend
    assert api._call_facts(q, kv, lens, FakeCudaArray(out.a), 1.0, None, 777, None) is None  # mixed types
    assert api._call_facts(q, _xla_set(device=1)[1], lens, out, 1.0, None, 777, None) is None


def test_xla_ordering_is_a_no_op():
    from gqadrv.runtime import streams

    streams.order_fast("xla", _xla_set(), 0, 777, 777)  # no handshake, no CuPy, no driver call
    with pytest.raises(ValueError, match="unknown tensor kind"):
        streams.order_fast("nope", (), 0, 777, 777)


def test_repeated_callback_calls_launch_the_remembered_plan(xla_kind, monkeypatch):
    """gqadrv.jax's callback under jax.jit: every execution brings new Buffer objects (often at new
    addresses) and the stream; the remembered plan is launched with the addresses patched."""
    import gqadrv

    q, kv, lens, out = _xla_set()
    facts = api._call_facts(q, kv, lens, out, 1.0, None, 777, None)
    e, plan, _ = _entry(enc_plain, monkeypatch)
    e.ptrs, e.device, e.stream = facts[1], facts[3], facts[4]
    spec = tm.TmaSpec(**{**SPEC.__dict__, "address": facts[1][1]})
    e.tmaps = (layouts.TmapSlot(0, "kv_map", 1, spec, enc_plain(spec)),)
    e.spans = tuple((0, x.a.nbytes) for x in (q, kv, lens, out))
    monkeypatch.setattr(api, "_layouts", layouts.LayoutCache(8))
    api._layouts.remember(facts[0], e)
    assert gqadrv.gqa_decode(q, kv, lens, out=out, stream=777) is out
    q2, kv2, lens2, out2 = _xla_set()
    assert gqadrv.gqa_decode(q2, kv2, lens2, out=out2, stream=777) is out2
    assert len(plan.launches) == 2
    assert _fields(plan.args) == tuple(x.a.__array_interface__["data"][0] for x in (q2, kv2, lens2, out2))
    # the output aliasing an input is refused and goes to the full path (NoGpuError here), unlaunched
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.gqa_decode(q2, kv2, lens2, out=Buffer(q2.a, writeable=True), stream=777)
    assert len(plan.launches) == 2
