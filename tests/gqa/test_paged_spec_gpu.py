"""The paged TMA kernel's speculative ring fill on the GPU (GQA_PAGED_FLAG_SPEC,
kernels/gqa/sm90/decode_paged_tma.cu): one-wave launches load the block-table entries and the KV
sub-tiles a request filling its capacity would give each warp before the length is known, keep them
when the schedule confirms the guess (len >= 3/4 capacity, or the batch-invariant mode's fixed
splits) and wait them out and refill otherwise.

Every case asserts the flag in the packed launch, compares against the float64 oracle and against
the same kernel without the speculation (GQADRV_PAGED_SPEC=0). Lengths sit on both sides of the
3/4-capacity boundary, at the capacity, at 1, 0, negative and past the capacity; table entries past
a request's pages hold the poison id (zero-filled by TMA) or page 0 (a real page, maybe NaN-filled:
the kept loads of tokens past the length then carry data the decoder must mask); ring depths 1, 2, 3
(e4m3) and 4 (D 64); clusters and the ticket; the batch-invariant mode with idle splits; a bad page
id in a kept speculative box is reported by check_status for its request only."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import TABLE_POISON, gqa_decode_paged_reference
from tests.gqa.paged_cases import check_paged, dense_case, prepare_poisoned

pytestmark = pytest.mark.gpu

SPEC = 8  # GQA_PAGED_FLAG_SPEC

# batch, capacity, Hq, Hkv, D, dtype, page, layout, lengths, splits, table_fill, deterministic
CASES = [
    (1, 4096, 32, 8, 128, "float16", 16, "NHD", [4096], None, TABLE_POISON, False),         # guess exact
    (1, 4096, 32, 8, 128, "bfloat16", 16, "NHD", [3100], None, 0, False),                   # kept, clamped
    (1, 4096, 32, 8, 128, "float16", 64, "HND", [3071], None, 0, False),                    # just below 3/4
    (2, 2048, 16, 2, 128, "float16", 16, "NHD", [2048, 1500], 8, 0, False),                 # one kept, one not
    (3, 1024, 8, 1, 64, "bfloat16", 32, "NHD", [1000, 0, 10**9], 5, 0, False),              # 4-stage ring
    (2, 2048, 32, 4, 128, "float16", 16, "HND", [2047, -3], 16, TABLE_POISON, False),        # 16 splits
    (2, 2048, 32, 4, 128, "float16", 16, "NHD", [1537, 1], 6, 0, False),                    # 6 splits
    (1, 4096, 16, 2, 128, "bfloat16", 64, "NHD", [4000], None, 0, False),                   # group 8
    (1, 4096, 32, 8, 128, "float16", 16, "NHD", [1000], None, 0, True),                     # idle splits
    (2, 8192, 8, 1, 128, "bfloat16", 256, "HND", [8192, 3000], None, 0, True),              # batch-invariant
]


def _flags(p) -> int:
    return p._plans[0].args.get_field("args.flags")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}C{c[1]}h{c[2]}/{c[3]}d{c[4]}{c[5][:2]}p{c[6]}{c[7]}"
                                                     f"L{'_'.join(map(str, c[8]))}S{c[9]}t{c[10]}{'det' if c[11] else ''}")
def test_speculative_fill_against_oracle_and_plain_start(monkeypatch, case):
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, dtype, page, layout, lens, splits, table_fill, det = case
    monkeypatch.delenv("GQADRV_PAGED_SPEC", raising=False)
    q, kc, vc, bt, hl, ref_out, ref_lse = dense_case(B, C, hq, hkv, D, dtype, page, layout, 1, lens,
                                                     seed=C + len(lens) + D, table_fill=table_fill)
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    p, o, lb = prepare_poisoned(d, layout, splits, deterministic=det)
    assert p.route.startswith("paged_tma_") and _flags(p) & SPEC, (p.route, _flags(p))
    for _ in range(3):  # repeated launches: nothing carries over between them
        gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    got_o, got_l = cp.asnumpy(o), cp.asnumpy(lb)
    check_paged(got_o, got_l, ref_out, ref_lse, dtype, "paged speculative fill")
    st = gqadrv.check_status(p)
    assert st["bad_page"] == [], st

    monkeypatch.setenv("GQADRV_PAGED_SPEC", "0")
    p2, o2, lb2 = prepare_poisoned(d, layout, splits, deterministic=det)
    assert not _flags(p2) & SPEC and p2.route == p.route and p2.num_splits == p.num_splits
    gqadrv.launch_prepared(p2)
    cp.cuda.Device().synchronize()
    if det:  # same fixed splits, merged in the same order: bitwise
        assert np.array_equal(got_o.view(np.uint16), cp.asnumpy(o2).view(np.uint16))
        assert np.array_equal(got_l.view(np.uint32), cp.asnumpy(lb2).view(np.uint32))
    else:  # the balanced split takes the capacity split from 3/4 of it on: other boundaries, other rounding
        tol = 2e-3 if dtype == "float16" else 1.6e-2
        np.testing.assert_allclose(got_o.astype(np.float64), cp.asnumpy(o2).astype(np.float64), atol=tol, rtol=tol)
        np.testing.assert_allclose(got_l, cp.asnumpy(lb2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("det", [False, True])
def test_bad_page_in_a_kept_speculative_box(det):
    """A page id outside the pool at the first box of a split whose guess is kept: that request is
    reported (bad_page), its box reads as zeros (no fault), the other request is exact."""
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, page = 2, 4096, 32, 8, 128, 16
    q, kc, vc, bt, hl, _, _ = dense_case(B, C, hq, hkv, D, "float16", page, "NHD", 1, [C, C], seed=3)
    bt = bt.copy()
    bt[1, 40] = kc.shape[0] + 5  # request 1, tokens 640..655: a split's first box under 16 or 8 splits
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    p, o, lb = prepare_poisoned(d, "NHD", None, deterministic=det)
    assert _flags(p) & SPEC
    gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    assert gqadrv.check_status(p) == {"empty": [], "clamped": [], "bad_page": [1]}
    ref_out, ref_lse = gqa_decode_paged_reference(q[:1], kc, vc, bt[:1], hl[:1])
    check_paged(cp.asnumpy(o)[:1], cp.asnumpy(lb)[:1], ref_out, ref_lse, "float16", "paged speculative, good request")
    assert np.isfinite(cp.asnumpy(o)[1].astype(np.float32)).all()


def test_graph_replays_cross_the_guess():
    """A captured launch replayed with lengths moved in place across the 3/4-capacity boundary
    (kept guess, refill, empty, clamped) and the table's tail entries rewritten to real pages."""
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, page = 2, 2048, 32, 8, 128, 16
    q, kc, vc, bt, hl, _, _ = dense_case(B, C, hq, hkv, D, "float16", page, "NHD", 1, [C, C], seed=11)
    dq, dkc, dvc, dbt, dl = (cp.asarray(x) for x in (q, kc, vc, bt, hl))
    s = cp.cuda.Stream(non_blocking=True)
    p, o, lb = prepare_poisoned((dq, dkc, dvc, dbt, dl), "NHD", None)
    assert _flags(p) & SPEC
    gqadrv.launch_prepared(p, stream=s)
    s.synchronize()
    with s:
        s.begin_capture()
        gqadrv.launch_prepared(p, stream=s)
        g = s.end_capture()
    for lens in ([C, 1536], [1535, C], [0, 2**31 - 1], [1, 17], [C - 16, 1000]):
        h = np.array(lens, np.int32)
        tab = bt.copy()
        for b in range(B):  # entries past the request's pages: page 0 instead of the poison
            n = -(-int(min(max(h[b], 0), C)) // page)
            tab[b, n:] = 0
        dl.set(h)
        dbt.set(tab)
        cp.cuda.Device().synchronize()
        for _ in range(2):
            g.launch(s)
        s.synchronize()
        ref_out, ref_lse = gqa_decode_paged_reference(q, kc, vc, tab, h)
        check_paged(cp.asnumpy(o), cp.asnumpy(lb), ref_out, ref_lse, "float16", "paged speculative graph")
