"""Layout-keyed plans of the LSE merge (gqadrv/gqa/merge_layouts.py) without a GPU: the key (form,
layouts, outputs given, device, the vector path, stream; never the addresses), ``remember`` on
problems of the real contract (pair, list, stacked), a remembered plan launched for new tensors with
the outputs' fields and the by-value pointer table patched, and refusals (an output overlapping a
state, the outputs overlapping each other) that neither patch nor launch."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gqadrv.gqa import merge as _merge
from gqadrv.gqa import merge_layouts as ml
from tests.fakes import FakeCudaArray, RecordingPlan, aligned, fake_layout_calls


class FakeT(FakeCudaArray):
    """A fake framework array the fast readers know (registered by the fixture)."""


@pytest.fixture
def fake_kind(monkeypatch):
    fake_layout_calls(monkeypatch, FakeT, ml)


N, H, D = 4, 8, 128


def _pair(device=0, out=True):
    v = [FakeT(aligned((N, H, D)), device) for _ in range(2)]
    s = [FakeT(aligned((N, H), np.float32), device) for _ in range(2)]
    o = (FakeT(aligned((N, H, D)), device), FakeT(aligned((N, H), np.float32), device)) if out else (None, None)
    return v, s, o


def _ptr(x) -> int:
    return x.a.__array_interface__["data"][0]


def test_key_is_the_layout_not_the_addresses(fake_kind):
    (v, s, o), (v2, s2, o2) = _pair(), _pair()
    f = ml.call_facts("pair", tuple(v), tuple(s), *o, None)
    f2 = ml.call_facts("pair", tuple(v2), tuple(s2), *o2, None)
    assert f is not None and f[0] == f2[0] and f[1] != f2[1]
    raw = aligned((N * H * D + 8,))
    v_odd = FakeT(raw[4:4 + N * H * D].reshape(N, H, D))   # 8 bytes off: no vector path
    others = {
        "list form": ml.call_facts("list", tuple(v), tuple(s), *o, None),
        "outputs allocated": ml.call_facts("pair", tuple(v), tuple(s), None, None, None),
        "device": ml.call_facts("pair", *map(tuple, _pair(device=1)[:2]), *_pair(device=1)[2], None),
        "stream": ml.call_facts("pair", tuple(v), tuple(s), *o, 77),
        "no vector path": ml.call_facts("pair", (v[0], v_odd), tuple(s), *o, None),
        "three states": ml.call_facts("list", (*v, v2[0]), (*s, s2[0]), *o, None),
    }
    for name, g in others.items():
        assert g is not None and g[0] != f[0], name
    assert len({g[0] for g in others.values()}) == len(others)
    assert ml.call_facts("pair", (v[0], FakeCudaArray(v[1].a)), tuple(s), *o, None) is None  # mixed frameworks


def _remember(form, v, s, o):
    """Validate with the real contract and remember a recording plan; returns (entry, plan)."""
    out, out_lse = o
    if form == "stacked":
        problem = _merge.validate_stacked(v[0], s[0], out, out_lse, stream=None)
    else:
        problem = _merge.validate_list(v, s, out, out_lse, stream=None)
    facts = ml.call_facts(form, tuple(v), tuple(s), out, out_lse, None)
    fields, table = _merge.args_fields(problem, _ptr(out), _ptr(out_lse))
    plan = RecordingPlan(_merge_pack(fields, table), facts[4])
    ptrs = (*(x.ptr for x in problem.v), *(x.ptr for x in problem.s), _ptr(out), _ptr(out_lse))
    ml.remember(facts, problem, plan, (0, 8 * _merge.MAX_LIST_STATES), bool(fields["flags"] & _merge.MERGE_FLAG_VEC16),
                ptrs)
    e = ml.layouts.get(facts[0])
    assert e is not None
    return e, plan


def _merge_pack(fields, table):
    from gqadrv.runtime.module import ArgPack

    return ArgPack(_merge.SIGNATURE).pack(fields, table)


def _table(plan):
    raw = plan.args.param_bytes("table")
    m = _merge.MAX_LIST_STATES
    vals = struct.unpack(f"<{2 * m}Q", raw)
    return vals[:m], vals[m:]


@pytest.mark.parametrize("form", ["pair", "list3", "stacked"])
def test_new_tensors_launch_the_remembered_plan(form, fake_kind):
    import gqadrv

    def states():
        if form == "stacked":
            return ([FakeT(aligned((N, 3, H, D)))], [FakeT(aligned((N, 3, H), np.float32))],
                    (FakeT(aligned((N, H, D))), FakeT(aligned((N, H), np.float32))))
        k = 2 if form == "pair" else 3
        return ([FakeT(aligned((N, H, D))) for _ in range(k)], [FakeT(aligned((N, H), np.float32)) for _ in range(k)],
                (FakeT(aligned((N, H, D))), FakeT(aligned((N, H), np.float32))))

    v, s, o = states()
    _, plan = _remember("pair" if form == "pair" else ("list" if form == "list3" else "stacked"), v, s, o)
    v2, s2, (o2, l2) = states()
    if form == "pair":
        r = gqadrv.merge_state(v2[0], s2[0], v2[1], s2[1], out=o2, out_lse=l2)
    elif form == "list3":
        r = gqadrv.merge_states(v2, s2, out=o2, out_lse=l2)
    else:
        r = gqadrv.merge_states(v2[0], s2[0], out=o2, out_lse=l2)
    assert r[0] is o2 and r[1] is l2 and len(plan.launches) == 1
    tv, ts = _table(plan)
    assert list(tv[:len(v2)]) == [_ptr(x) for x in v2] and list(ts[:len(s2)]) == [_ptr(x) for x in s2]
    assert plan.args.get_field("args.out") == _ptr(o2) and plan.args.get_field("args.out_lse") == _ptr(l2)


@pytest.mark.parametrize("case", ["out over v_b", "out_lse over s_a", "out_lse over out"])
def test_refused_calls_take_the_full_path_and_never_launch(case, fake_kind):
    import gqadrv

    _, plan = _remember("pair", *_pair())
    v, s, (o, lo) = _pair()
    as_strided = np.lib.stride_tricks.as_strided
    if case == "out over v_b":
        o = FakeT(as_strided(v[1].a, o.a.shape, o.a.strides))
    elif case == "out_lse over s_a":
        lo = FakeT(as_strided(s[0].a, lo.a.shape, lo.a.strides))
    else:
        lo = FakeT(as_strided(o.a.view(np.float32), lo.a.shape, lo.a.strides))
    before = plan.args.bytes()
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.merge_state(v[0], s[0], v[1], s[1], out=o, out_lse=lo)
    assert plan.launches == [] and plan.args.bytes() == before
