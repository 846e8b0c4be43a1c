"""Layout-keyed plans of the dense MLA convenience call (gqadrv/mla/layout_plans.py) without a GPU:
the layout key (every part of it, never the addresses), the calls it cannot serve, a remembered plan
launched for new tensors with all six addresses and both k_cache tensor maps patched, the metadata
object's rules, and refused calls (an output overlapping another tensor, a misaligned address, a
metadata object of another configuration) that go to the full path without launching."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gqadrv.mla import api
from gqadrv.mla import kernel_spec as _ks
from gqadrv.mla import layout_plans as lp
from gqadrv.mla.args import SIG_TMA
from gqadrv.ops import layouts
from gqadrv.runtime import tensormap as tm
from gqadrv.runtime.module import ArgPack
from tests.fakes import FakeCudaArray, RecordingPlan, aligned, assert_layout_keys_differ, fake_layout_calls


class FakeT(FakeCudaArray):
    """A fake framework array the fast readers know (registered by the fixture)."""


def _ptr(x) -> int:
    return x.a.__array_interface__["data"][0]


@pytest.fixture
def fake_kind(monkeypatch):
    fake_layout_calls(monkeypatch, FakeT, lp)


B, S_Q, H_Q, PAGE, NBLK, MAXB = 2, 1, 16, 64, 8, 4


def _set(device=0, h_q=H_Q, dtype=np.float16):
    """q, k_cache, block_table, cache_seqlens, out, lse of one layout (fresh buffers)."""
    return (FakeT(aligned((B, S_Q, h_q, 576), dtype), device), FakeT(aligned((NBLK, PAGE, 1, 576), dtype), device),
            FakeT(aligned((B, MAXB), np.int32), device), FakeT(aligned((B,), np.int32), device),
            FakeT(aligned((B, S_Q, h_q, 512), dtype), device), FakeT(aligned((B, h_q, S_Q), np.float32), device))


def _facts(t, *, hdv=512, scale=None, causal=False, fp8=False, splits=None, meta=None, stream=None, backend=None):
    return lp.call_facts(*t, hdv, scale, causal, fp8, splits, meta, stream, backend)


def test_key_is_the_layout_not_the_addresses(fake_kind):
    t1, t2 = _set(), _set()
    f1, f2 = _facts(t1), _facts(t2)
    assert f1 is not None and f1[0] == f2[0] and f1[1] != f2[1]
    q, k, bt, sl, o, lse = t1
    meta = api.MlaSchedMeta(config=("x",), num_splits=3)
    variants = {
        "h_q": _facts(_set(h_q=32)),
        "dtype": _facts(_set(dtype=np.uint16)),
        "device": _facts(_set(device=1)),
        "out allocated": _facts((q, k, bt, sl, None, lse)),
        "lse allocated": _facts((q, k, bt, sl, o, None)),
        "head_dim_v": _facts(t1, hdv=511),
        "softmax_scale": _facts(t1, scale=0.05),
        "causal": _facts(t1, causal=True),
        "is_fp8_kvcache": _facts(t1, fp8=True),
        "num_splits": _facts(t1, splits=2),
        "backend": _facts(t1, backend="seesaw"),
        "stream": _facts(t1, stream=77),
    }
    assert_layout_keys_differ(variants, f1[0])
    assert _facts(t1, meta=api.MlaSchedMeta())[0] == f1[0]  # the metadata object is not in the key
    assert _facts(t1, meta=meta)[0] == f1[0]
    assert variants["device"][3] == 1 and variants["device"][4] == 1001 and variants["stream"][4] == 77


def test_calls_the_layout_cache_cannot_serve(fake_kind):
    q, k, bt, sl, o, lse = _set()
    other = FakeCudaArray(sl.a)
    assert lp.call_facts(q, k, bt, other, o, lse, 512, None, False, False, None, None, None, None) is None
    assert lp.call_facts(q, k, bt, sl, FakeCudaArray(o.a), lse, 512, None, False, False, None, None, None, None) is None
    assert _facts(_set(), scale=np.float32(0.05)) is None   # numpy scalar: the full path explains it
    assert _facts(_set(), hdv=np.int64(512)) is None
    assert _facts(_set(), splits=True) is None
    assert lp.call_facts(q, k, bt, sl, o, lse, 512, None, 1, False, None, None, None, None) is None  # causal not bool
    assert _facts(_set(), backend=3) is None
    assert lp.call_facts(q, _set(device=1)[1], bt, sl, o, lse, 512, None, False, False, None, None, None,
                         None) is None  # mixed devices


def _remembered(t, monkeypatch, meta_config=("cfg",), splits=1):
    """A remembered entry for tensors t: a fake plan on the TMA seesaw's signature; returns (entry, plan)."""
    facts = _facts(t)
    ptrs = facts[1]
    specs = [tm.TmaSpec(dtype="float16", address=ptrs[1], dims=g["dims"], strides=g["strides"], box=g["box"],
                        swizzle="128b")
             for g in _ks.k_tensor_maps(PAGE, 1, NBLK, (PAGE * 576, 576, 576), (4, 5))]
    fields = {n: (0.5 if ch == "f" else 0) for n, ch in _ks.FIELDS}
    fields.update(dict(zip(lp._NAMES, ptrs)))
    pack = ArgPack(SIG_TMA).pack(*(tm.encode_tiled(s) for s in specs), fields)
    plan = RecordingPlan(pack, facts[4])
    tmaps = tuple(layouts.TmapSlot(0, n, 1, s, pack.param_bytes(n)) for n, s in zip(("k_lo", "k_hi"), specs))
    spans = tuple((0, x.a.nbytes) for x in t)
    e = layouts.LayoutEntry((plan,), lp._FIELDS, lp._ALIGNS, spans, lp._OUT_SLOTS, tmaps, ptrs, facts[3], facts[4],
                            out_shape=(B, S_Q, H_Q, 512), out_dtype="float16",
                            info=(meta_config, splits, (B, H_Q, S_Q)))
    lp.layouts.remember(facts[0], e)
    return e, plan


def _fields(pack):
    return tuple(pack.get_field(f"args.{n}") for n in lp._NAMES)


def test_new_tensors_launch_the_remembered_plan(fake_kind, monkeypatch):
    import gqadrv

    t = _set()
    _, plan = _remembered(t, monkeypatch)
    q, k, bt, sl, o, lse = t
    assert gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, out=o, lse=lse) == (o, lse)
    t2 = _set()
    q2, k2, bt2, sl2, o2, lse2 = t2
    r = gqadrv.flash_mla_with_kvcache(q2, k2, bt2, sl2, 512, out=o2, lse=lse2)
    assert r[0] is o2 and r[1] is lse2 and len(plan.launches) == 2
    assert _fields(plan.args) == tuple(_ptr(x) for x in t2)
    for name in ("k_lo", "k_hi"):  # both tensor maps re-based to the new k_cache
        assert struct.unpack_from("<Q", plan.args.param_bytes(name), 16)[0] == _ptr(k2)


def test_metadata_is_initialised_or_refused(fake_kind, monkeypatch):
    import gqadrv

    t = _set()
    _, plan = _remembered(t, monkeypatch, meta_config=("cfg",), splits=3)
    q, k, bt, sl, o, lse = t
    meta, _ = gqadrv.get_mla_metadata()
    gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, meta, out=o, lse=lse)
    assert meta.config == ("cfg",) and meta.num_splits == 3 and len(plan.launches) == 1
    gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, meta, out=o, lse=lse)   # initialised: same entry
    assert len(plan.launches) == 2
    for other in (api.MlaSchedMeta(config=("another",), num_splits=3),   # another configuration
                  api.MlaSchedMeta(config=("cfg",), num_splits=5)):      # the layout's, another split count
        with pytest.raises(gqadrv.NoGpuError):  # the full path (here: no GPU); nothing launched
            gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, other, out=o, lse=lse)
    assert len(plan.launches) == 2


@pytest.mark.parametrize("case", ["out is q", "lse inside out", "lse inside q", "out overlaps k_cache", "k_cache misaligned",
                                  "block_table misaligned"])
def test_refused_calls_take_the_full_path_and_never_launch(case, fake_kind, monkeypatch):
    """Same layout, addresses that break an address rule: the plan is neither patched nor launched
    (the full path raises its error; here, without a GPU, NoGpuError)."""
    import gqadrv

    t = _set()
    _, plan = _remembered(t, monkeypatch)
    q, k, bt, sl, o, lse = _set()
    as_strided = np.lib.stride_tricks.as_strided
    if case == "out is q":
        o = FakeT(as_strided(q.a, o.a.shape, o.a.strides))
    elif case == "lse inside out":
        lse = FakeT(o.a.view(np.float32).reshape(-1)[:B * H_Q * S_Q].reshape(B, H_Q, S_Q))
    elif case == "lse inside q":
        lse = FakeT(q.a.view(np.float32).reshape(-1)[:B * H_Q * S_Q].reshape(B, H_Q, S_Q))
    elif case == "out overlaps k_cache":
        o = FakeT(as_strided(k.a, o.a.shape, o.a.strides))
    elif case == "k_cache misaligned":
        raw = aligned((k.a.size + 8,))
        k = FakeT(raw[4:4 + k.a.size].reshape(k.a.shape))
    else:
        raw = aligned((bt.a.nbytes + 8,), np.uint8)
        bt = FakeT(raw[2:2 + bt.a.nbytes].view(np.int32).reshape(bt.a.shape))
    assert _facts((q, k, bt, sl, o, lse))[0] == _facts(t)[0]  # the same layout key
    before = plan.args.bytes()
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, out=o, lse=lse)
    assert plan.launches == [] and plan.args.bytes() == before
