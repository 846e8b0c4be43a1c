"""Layout-keyed plans of the LSE merge on the GPU (gqadrv/gqa/merge_layouts.py): repeated
``merge_state`` / ``merge_states`` calls with the same layout and new tensors every call give each
call's own result (no stale pointer in the by-value table or the output fields) for the pair, list
and stacked forms, outputs allocated and given; one entry per layout; a misaligned state takes the
scalar path's own entry; a known layout with an output over an input raises and launches nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gqa.test_merge_gpu import attention_parts, check, npdt, stack
from tests.helpers import to_device

pytestmark = pytest.mark.gpu

SHAPE = (6, 8, 128)


@pytest.mark.parametrize("form", ["pair", "list3", "stacked"])
@pytest.mark.parametrize("given", [False, True], ids=["alloc", "given"])
def test_new_tensors_every_call_give_their_own_results(form, given, launches):
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import merge_layouts

    k = 2 if form == "pair" else 3
    cases = [attention_parts(SHAPE, k, seed=100 + i) for i in range(3)]
    merge_layouts.layouts.clear()
    for rnd in range(2):
        for i in (range(3) if rnd == 0 else (2, 0, 1)):
            vs, ss, ref_v, ref_s = cases[i]
            kw = {}
            if given:
                kw = {"out": cp.full(SHAPE, np.nan, npdt("float16")), "out_lse": cp.full(SHAPE[:-1], np.nan, cp.float32)}
            if form == "stacked":
                v, s = stack([x.astype(npdt("float16")) for x in vs], [x.astype(np.float32) for x in ss])
                got = gqadrv.merge_states(to_device(v), to_device(s), **kw)
            else:
                dv = [to_device(x.astype(npdt("float16"))) for x in vs]
                ds = [to_device(x.astype(np.float32)) for x in ss]
                got = (gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1], **kw) if form == "pair"
                       else gqadrv.merge_states(dv, ds, **kw))
            check(*got, ref_v, ref_s, "float16", f"merge layout plan {form} {i}")
    assert len(merge_layouts.layouts) == 1
    assert len(launches) == 6


def test_misaligned_state_and_overlapping_output(launches):
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import merge_layouts

    vs, ss, ref_v, ref_s = attention_parts(SHAPE, 2, seed=7)
    dv = [to_device(x.astype(npdt("float16"))) for x in vs]
    ds = [to_device(x.astype(np.float32)) for x in ss]
    merge_layouts.layouts.clear()
    check(*gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1]), ref_v, ref_s, "float16", "aligned")
    raw = cp.zeros(dv[1].size + 8, dv[1].dtype)
    odd = raw[4:4 + dv[1].size].reshape(dv[1].shape)   # 8 bytes off: the scalar path, its own layout entry
    odd[...] = dv[1]
    check(*gqadrv.merge_state(dv[0], ds[0], odd, ds[1]), ref_v, ref_s, "float16", "misaligned v_b")
    assert len(merge_layouts.layouts) == 2
    n = len(launches)
    out = cp.empty(SHAPE, dv[0].dtype)
    lse = cp.empty(SHAPE[:-1], cp.float32)
    gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1], out=out, out_lse=lse)
    with pytest.raises(ValueError, match="overlap"):
        gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1], out=dv[1], out_lse=lse)   # out over v_b, out's layout
    assert len(launches) == n + 1
