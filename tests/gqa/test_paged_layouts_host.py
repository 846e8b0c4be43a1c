"""Layout-keyed plans of the paged convenience call (gqadrv/gqa/paged_layouts.py) without a GPU: the
key (every part, never the addresses), the calls it cannot serve, ``remember`` on a problem from the
real ``validate_paged`` (separate and combined pools, NHD / HND, FP8 with device scales), and a
remembered plan launched for new tensors: every address field patched, the V address of a combined
pool at its offset, both pool tensor maps re-based; refused calls neither patch nor launch."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gqadrv.gqa import paged as _paged
from gqadrv.gqa import paged_layouts as pl
from gqadrv.gqa import routes as _routes
from gqadrv.gqa.paged_args import GQA_PAGED_ARGS, SIG_PAGED_TMA
from gqadrv.gqa.paged_contract import validate_paged
from gqadrv.runtime.module import ArgPack
from tests.fakes import (FakeCudaArray, RecordingPlan, aligned, assert_layout_keys_differ, fake_layout_calls,
                         plain_tensor_map)


class FakeT(FakeCudaArray):
    """A fake framework array the fast readers know (registered by the fixture)."""


@pytest.fixture
def fake_kind(monkeypatch):
    fake_layout_calls(monkeypatch, FakeT, pl)
    for k in _routes.TUNING_ENV:
        monkeypatch.delenv(k, raising=False)


B, HQ, HKV, D, PAGE, P, MAXP = 2, 8, 2, 128, 16, 6, 3


def _set(layout="NHD", combined=False, fp8=False, lse=True, device=0):
    """(q, k, v, table, lengths, out, lse, k_scale, v_scale) of one layout (fresh buffers)."""
    kv_dt = np.uint8 if fp8 else np.float16
    pool = (P, PAGE, HKV, D) if layout == "NHD" else (P, HKV, PAGE, D)
    if combined:
        k, v = FakeT(aligned((P, 2) + pool[1:], kv_dt), device), None
    else:
        k, v = FakeT(aligned(pool, kv_dt), device), FakeT(aligned(pool, kv_dt), device)
    sc = (FakeT(aligned((HKV,), np.float32), device), FakeT(aligned((HKV,), np.float32), device)) if fp8 else (None, None)
    return (FakeT(aligned((B, HQ, D)), device), k, v, FakeT(aligned((B, MAXP), np.int32), device),
            FakeT(aligned((B,), np.int32), device), FakeT(aligned((B, HQ, D)), device),
            FakeT(aligned((B, HQ), np.float32), device) if lse else None, *sc)


def _facts(t, layout="NHD", return_lse=False, q_scale=1.0, sm_scale=None, det=False, splits=None, stream=None,
           backend=None, kv_dtype=None, k_scale=None, v_scale=None):
    q, k, v, bt, sl, o, lo, ks, vs = t
    return pl.call_facts(q, k, v, bt, sl, o, lo, layout, return_lse, q_scale, sm_scale, det, splits, stream, backend,
                         kv_dtype, ks if k_scale is None else k_scale, vs if v_scale is None else v_scale)


def test_key_is_the_layout_not_the_addresses(fake_kind):
    t1, t2 = _set(), _set()
    f1, f2 = _facts(t1), _facts(t2)
    assert f1 is not None and f1[0] == f2[0] and f1[1] != f2[1]
    q, k, v, bt, sl, o, lo, _, _ = t1
    variants = {
        "HND pools": _facts(_set("HND"), "HND"),
        "combined pool": _facts(_set(combined=True)),
        "fp8 pools + scale arrays": _facts(_set(fp8=True), kv_dtype="e4m3"),
        "device": _facts(_set(device=1)),
        "out allocated": _facts((q, k, v, bt, sl, None, lo, None, None)),
        "no lse": _facts((q, k, v, bt, sl, o, None, None, None)),
        "return_lse": _facts((q, k, v, bt, sl, o, None, None, None), return_lse=True),
        "q_scale": _facts(t1, q_scale=0.5),
        "sm_scale": _facts(t1, sm_scale=0.1),
        "deterministic": _facts(t1, det=True),
        "num_splits": _facts(t1, splits=2),
        "stream": _facts(t1, stream=77),
        "backend": _facts(t1, backend="portable"),
        "kv_dtype": _facts(t1, kv_dtype="e4m3"),
        "numeric k_scale": _facts(t1, k_scale=0.5),
    }
    assert_layout_keys_differ(variants, f1[0])
    assert _facts(t1, k_scale=0.5)[0] != _facts(t1, k_scale=0.25)[0]


def test_calls_the_layout_cache_cannot_serve(fake_kind):
    t = _set()
    q, k, v, bt, sl, o, lo, _, _ = t
    other = FakeCudaArray(sl.a)
    assert _facts((q, k, v, bt, other, o, lo, None, None)) is None
    assert _facts((q, k, FakeCudaArray(v.a), bt, sl, o, lo, None, None)) is None
    assert _facts(t, q_scale=np.float32(0.5)) is None
    assert _facts(t, k_scale=np.float64(0.5)) is None
    assert _facts(t, k_scale=FakeCudaArray(np.ones(1, np.float32))) is None
    assert _facts(t, return_lse=1) is None
    assert _facts(t, det=0) is None
    assert _facts(t, splits=True) is None
    assert _facts(t, layout=b"NHD") is None
    assert _facts((q, _set(device=1)[1], v, bt, sl, o, lo, None, None)) is None


def _remember(t, monkeypatch, layout="NHD", fp8=False):
    """Validate t with the real contract, remember a fake plan on the paged TMA signature; returns
    (entry, plan, problem)."""
    q, k, v, bt, sl, o, lo, ks, vs = t
    kv_dtype = "e4m3" if fp8 else None
    facts = _facts(t, layout, kv_dtype=kv_dtype)
    problem = validate_paged(q, k, v, bt, sl, layout, o, lo, 1.0, None, stream=None, kv_dtype=kv_dtype, k_scale=ks,
                             v_scale=vs)
    variant = _routes.select_paged_variant((9, 0), D, "float16", problem.rows, None, tma_ok=True, kv8=fp8)
    assert variant.family.uses_tma
    specs = _paged._tma_specs(problem, variant.tiling.tok)
    values = {n: 0 for n, _, _ in GQA_PAGED_ARGS.fields}
    values.update(q=problem.q.ptr, k=problem.k_ptr, v=problem.v_ptr, table=problem.table.ptr,
                  lengths=problem.lengths.ptr, out=problem.out.ptr, lse=problem.lse.ptr,
                  k_scale=problem.scales.k_ptr, v_scale=problem.scales.v_ptr)
    for n, _, ch in GQA_PAGED_ARGS.fields:
        if ch == "f":
            values[n] = float(values[n])
    pack = ArgPack(SIG_PAGED_TMA).pack(plain_tensor_map(specs[0]), plain_tensor_map(specs[1]), values)
    plan = RecordingPlan(pack, facts[4])
    sc = problem.scales
    ptrs = (problem.q.ptr, problem.k.ptr, problem.v.ptr if problem.v is not None else 0, problem.table.ptr,
            problem.lengths.ptr, problem.out.ptr, problem.lse.ptr, sc.k_ptr, sc.v_ptr)
    pl.remember(facts, problem, variant, plan, None, ptrs, True, specs)
    e = pl.layouts.get(facts[0])
    assert e is not None, "the validated call was not remembered"
    return e, plan, problem


def _ptr(x) -> int:
    return 0 if x is None else x.a.__array_interface__["data"][0]


def _field(plan, name):
    return plan.args.get_field(f"args.{name}")


def _map_address(plan, name):
    return struct.unpack_from("<Q", plan.args.param_bytes(name), 16)[0]


@pytest.mark.parametrize("layout,combined,fp8", [("NHD", False, False), ("HND", False, False), ("NHD", True, False),
                                                 ("HND", True, False), ("NHD", False, True)],
                         ids=["nhd", "hnd", "nhd-combined", "hnd-combined", "nhd-fp8-scale-arrays"])
def test_new_tensors_launch_the_remembered_plan(layout, combined, fp8, fake_kind, monkeypatch):
    import gqadrv

    t = _set(layout, combined, fp8)
    e, plan, problem = _remember(t, monkeypatch, layout, fp8)
    v_off = problem.v_ptr - problem.k_ptr
    t2 = _set(layout, combined, fp8)
    q, k, v, bt, sl, o, lo, ks, vs = t2
    kw = {"kv_dtype": "e4m3", "k_scale": ks, "v_scale": vs} if fp8 else {}
    r = gqadrv.gqa_decode_paged(q, k, v, bt, sl, kv_layout=layout, out=o, lse=lo, **kw)
    assert r[0] is o and r[1] is lo and len(plan.launches) == 1
    want = {"q": _ptr(q), "k": _ptr(k), "v": _ptr(k) + v_off if combined else _ptr(v), "table": _ptr(bt),
            "lengths": _ptr(sl), "out": _ptr(o), "lse": _ptr(lo), "k_scale": _ptr(ks), "v_scale": _ptr(vs)}
    assert {n: _field(plan, n) for n in want} == want
    assert _map_address(plan, "k_map") == want["k"] and _map_address(plan, "v_map") == want["v"]


@pytest.mark.parametrize("case", ["out over the K pool", "lse over the table", "V pool misaligned", "q misaligned",
                                  "out over a scale array"])
def test_refused_calls_take_the_full_path_and_never_launch(case, fake_kind, monkeypatch):
    import gqadrv

    fp8 = case == "out over a scale array"
    e, plan, _ = _remember(_set(fp8=fp8), monkeypatch, fp8=fp8)
    q, k, v, bt, sl, o, lo, ks, vs = _set(fp8=fp8)
    as_strided = np.lib.stride_tricks.as_strided
    if case == "out over the K pool":
        o = FakeT(as_strided(k.a.view(np.float16) if not fp8 else k.a, o.a.shape, o.a.strides))
    elif case == "lse over the table":
        lo = FakeT(as_strided(bt.a.view(np.float32), lo.a.shape, lo.a.strides))
    elif case == "V pool misaligned":
        raw = aligned((v.a.size + 8,))
        v = FakeT(raw[4:4 + v.a.size].reshape(v.a.shape))
    elif case == "q misaligned":
        raw = aligned((q.a.size + 8,))
        q = FakeT(raw[4:4 + q.a.size].reshape(q.a.shape))
    else:
        o = FakeT(as_strided(ks.a.view(np.float16), o.a.shape, o.a.strides))
    kw = {"kv_dtype": "e4m3", "k_scale": ks, "v_scale": vs} if fp8 else {}
    assert _facts((q, k, v, bt, sl, o, lo, ks, vs), kv_dtype="e4m3" if fp8 else None)[0] in pl.layouts._map._d
    before = plan.args.bytes()
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.gqa_decode_paged(q, k, v, bt, sl, out=o, lse=lo, **kw)
    assert plan.launches == [] and plan.args.bytes() == before


def test_contiguous_cache_calls_of_gqa_decode(fake_kind):
    """gqa_decode with a 4-D q and LSE (the paged kernels on the contiguous cache, layout
    "contiguous"): no table; V sits at the fixed offset Hkv * C * D elements inside the cache."""
    import gqadrv
    from gqadrv.gqa.paged_args import SIG_PAGED
    from gqadrv.gqa.paged_contract import contiguous_problem

    C = 96

    def tensors():
        return (FakeT(aligned((B, 2, HQ, D))), FakeT(aligned((B, 2, HKV, C, D))), FakeT(aligned((B,), np.int32)),
                FakeT(aligned((B, 2, HQ, D))), FakeT(aligned((B, 2, HQ), np.float32)))

    q, kv, ln, o, lo = tensors()
    facts = pl.call_facts(q, kv, None, None, ln, o, lo, "contiguous", False, 1.0, None, False, None, None, None, None,
                          None, None)
    assert facts is not None and facts[0][:1] == ("paged",) and "contiguous" in facts[0]
    assert pl.call_facts(q, kv, None, FakeT(aligned((B, 3), np.int32)), ln, o, lo, "contiguous", False, 1.0, None,
                         False, None, None, None, None, None, None) is None
    problem = contiguous_problem(q, kv, ln, o, lo, 1.0, None, stream=None)
    variant = _routes.select_paged_variant((9, 0), D, "float16", problem.rows, None, tma_ok=False)
    values = {n: (0.0 if ch == "f" else 0) for n, _, ch in GQA_PAGED_ARGS.fields}
    values.update(q=problem.q.ptr, k=problem.k_ptr, v=problem.v_ptr, lengths=problem.lengths.ptr,
                  out=problem.out.ptr, lse=problem.lse.ptr)
    plan = RecordingPlan(ArgPack(SIG_PAGED).pack(values), facts[4])
    ptrs = (problem.q.ptr, problem.k.ptr, 0, 0, problem.lengths.ptr, problem.out.ptr, problem.lse.ptr, 0, 0)
    pl.remember(facts, problem, variant, plan, None, ptrs, True)
    q2, kv2, ln2, o2, lo2 = tensors()
    r = gqadrv.gqa_decode(q2, kv2, ln2, out=o2, lse=lo2)
    assert r[0] is o2 and r[1] is lo2 and len(plan.launches) == 1
    v_off = problem.v_ptr - problem.k_ptr
    assert v_off == HKV * C * D * 2
    got = {n: plan.args.get_field(f"args.{n}") for n in ("q", "k", "v", "lengths", "out", "lse", "table")}
    assert got == {"q": _ptr(q2), "k": _ptr(kv2), "v": _ptr(kv2) + v_off, "lengths": _ptr(ln2), "out": _ptr(o2),
                   "lse": _ptr(lo2), "table": 0}
