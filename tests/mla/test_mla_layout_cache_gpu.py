"""Layout-keyed plans of the dense MLA convenience call on the GPU (gqadrv/mla/layout_plans.py):
repeated ``flash_mla_with_kvcache`` calls with the same layout and new tensors every call give each
call's own result (no stale address, no stale k_cache tensor map) on every dense route family, with
out / lse given and allocated, for CuPy and torch; the metadata object's rules hold; calls whose new
addresses break a rule raise the documented error and launch nothing; one entry per layout."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from gqadrv.mla.selftest import make_case
from tests.mla.test_mla_gpu import check

pytestmark = pytest.mark.gpu


def _sets(n, b, s_q, h_q, page, L, seed, dtype="bfloat16"):
    """n host cases of one layout (same max_blocks and pool size) with different data and lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lens = [max(0, L - 97 * i - 13 * r) for r in range(b)]
        out.append(make_case(rng, b, s_q, h_q, 1, page, lens, dtype, max_blocks=-(-L // page)))
    return out


# (b, s_q, h_q, page, L, backend): the TMA seesaw split grid, the cp.async seesaw (page 16), the narrow
# two-warpgroup kernel, the balanced grid (uniform batch that fills the SMs), causal two-token rows
SHAPES = [(2, 1, 64, 64, 1500, None), (2, 1, 64, 16, 900, None), (3, 1, 16, 64, 2000, None),
          (2, 2, 32, 128, 700, "seesaw_tma"), (132, 1, 16, 64, 256, None)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_s{}_h{}_p{}_L{}_{}".format(*s))
@pytest.mark.parametrize("given", [False, True], ids=["alloc", "out_lse"])
def test_new_tensors_every_call_give_their_own_results(shape, given, launches):
    import cupy as cp

    import gqadrv
    from gqadrv.mla import layout_plans

    b, s_q, h_q, page, L, backend = shape
    sets = _sets(3, b, s_q, h_q, page, L, seed=page + h_q)
    causal = s_q > 1
    dev = [tuple(cp.asarray(x) for x in t) for t in sets]
    refs = [mla_decode_reference(q, k, bt, ln, 512, None, causal) for q, k, bt, ln in sets]
    outs = [(cp.full((b, s_q, h_q, 512), np.nan, dev[0][0].dtype), cp.full((b, h_q, s_q), np.nan, cp.float32))
            for _ in sets]
    layout_plans.layouts.clear()
    meta, _ = gqadrv.get_mla_metadata()
    for rnd in range(2):  # second round: every address seen before, in a new order
        for i in (range(3) if rnd == 0 else (2, 0, 1)):
            kw = {"out": outs[i][0], "lse": outs[i][1]} if given else {}
            o, lse = gqadrv.flash_mla_with_kvcache(*dev[i], 512, meta, causal=causal, backend=backend, **kw)
            if given:
                assert o is outs[i][0] and lse is outs[i][1]
            check(cp.asnumpy(o), cp.asnumpy(lse), *refs[i], "bfloat16", f"layout plan {shape} set {i}")
    assert len(layout_plans.layouts) == 1
    assert len(launches) == 6


def test_a_second_cache_of_the_same_layout_is_read():
    """Same q, block table, lengths and outputs; another k_cache of the same layout: the TMA route's
    two tensor maps must follow it (a stale map would read the first cache)."""
    import cupy as cp

    import gqadrv

    (q, k1, bt, ln), = _sets(1, 2, 1, 64, 64, 1200, seed=5)
    k2 = -k1   # the same pages (and NaN in the unused ones), other values
    dq, dbt, dl = cp.asarray(q), cp.asarray(bt), cp.asarray(ln)
    for k in (k1, k2, k1):
        o, lse = gqadrv.flash_mla_with_kvcache(dq, cp.asarray(k), dbt, dl, 512)
        check(cp.asnumpy(o), cp.asnumpy(lse), *mla_decode_reference(q, k, bt, ln, 512, None, False), "bfloat16",
              "second cache")


def test_refusals_and_metadata_rules_hold_for_known_layouts(launches):
    import cupy as cp

    import gqadrv

    (q, k, bt, ln), = _sets(1, 2, 1, 16, 64, 300, seed=9)
    dq, dk, dbt, dl = cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln)
    o = cp.empty((2, 1, 16, 512), dq.dtype)
    lse = cp.empty((2, 16, 1), cp.float32)
    meta, _ = gqadrv.get_mla_metadata()
    gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, meta, out=o, lse=lse)   # the layout is known now
    n = len(launches)
    with pytest.raises(ValueError, match="overlap"):   # out over q's memory, out's own layout
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, meta, out=dq.reshape(-1)[:o.size].reshape(o.shape),
                                      lse=lse)
    with pytest.raises(ValueError, match="overlap"):   # lse over k_cache's memory, lse's own layout
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, meta, out=o,
                                      lse=dk.reshape(-1).view(cp.float32)[:lse.size].reshape(lse.shape))
    raw = cp.zeros(dk.size + 8, dk.dtype)
    with pytest.raises(ValueError, match="16-byte aligned"):   # k_cache 8 bytes into a buffer
        gqadrv.flash_mla_with_kvcache(dq, raw[4:4 + dk.size].reshape(dk.shape), dbt, dl, 512, meta, out=o, lse=lse)
    other, _ = gqadrv.get_mla_metadata()
    gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, other, causal=True, out=o, lse=lse)
    with pytest.raises(ValueError, match="tile_scheduler_metadata was initialised"):
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, other, out=o, lse=lse)
    assert len(launches) == n + 1


def test_torch_tensors_every_call():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import gqadrv
    from gqadrv.mla import layout_plans

    sets = _sets(3, 2, 1, 64, 64, 1000, seed=21)
    layout_plans.layouts.clear()
    for _ in range(2):
        for q, k, bt, ln in sets:
            tq, tk = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k))
            tbt, tl = torch.from_numpy(bt).cuda(), torch.from_numpy(ln).cuda()
            o, lse = gqadrv.flash_mla_with_kvcache(tq, tk, tbt, tl, 512)
            assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
            check(o.float().cpu().numpy(), lse.cpu().numpy(), *mla_decode_reference(q, k, bt, ln, 512, None, False),
                  "bfloat16", "torch layout plan")
    assert len(layout_plans.layouts) == 1
