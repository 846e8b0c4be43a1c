"""CPU tests of the paged GQA decode oracle (gqadrv.gqa.reference.gqa_decode_paged_reference), of the
scatter helper (paged_kv_from_contiguous) and of the GPU grid's construction (tests/gqa/paged_cases.py):
the oracle against an independent per-token loop through the block table and against the contiguous
oracle, causal rows and empty rows, poisoned table entries and NaN pages never read, layouts and
combined caches equivalent, scales, the LSE's meaning, and the grid's coverage and device layouts."""

from __future__ import annotations

import collections
import math

import ml_dtypes
import numpy as np
import pytest

from gqadrv.gqa.reference import (
    TABLE_POISON,
    gqa_decode_paged_reference,
    gqa_decode_reference,
    paged_kv_from_contiguous,
)
from gqadrv.ops.oracle import merge_states
from tests.gqa import paged_cases as pc


def _direct(q, k_cache, v_cache, block_table, seq_lens, kv_layout="NHD", sm_scale=None):
    """Slow per-(request, query token, head, key) loop; every key located through the block table."""
    q = np.asarray(q, np.float64)
    squeeze = q.ndim == 3
    if squeeze:
        q = q[:, None]
    B, s_q, Hq, D = q.shape
    if v_cache is None:
        k_cache, v_cache = k_cache[:, 0], k_cache[:, 1]
    page = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    hkv = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    g = Hq // hkv
    cap = block_table.shape[1] * page
    scale = 1 / math.sqrt(D) if sm_scale is None else sm_scale
    out = np.zeros((B, s_q, Hq, D))
    lse = np.full((B, s_q, Hq), np.inf)
    for b in range(B):
        L = min(max(int(seq_lens[b]), 0), cap)
        for j in range(s_q):
            for h in range(Hq):
                kvh = h // g
                logits, vals = [], []
                for t in range(max(L - (s_q - 1 - j), 0)):
                    pg = int(block_table[b, t // page])
                    if kv_layout == "NHD":
                        kr, vr = k_cache[pg, t % page, kvh], v_cache[pg, t % page, kvh]
                    else:
                        kr, vr = k_cache[pg, kvh, t % page], v_cache[pg, kvh, t % page]
                    logits.append(float(q[b, j, h] @ np.asarray(kr, np.float64)) * scale)
                    vals.append(np.asarray(vr, np.float64))
                if not logits:
                    continue
                lg = np.array(logits)
                m = lg.max()
                w = np.exp(lg - m)
                lse[b, j, h] = math.log(w.sum()) + m
                out[b, j, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return (out[:, 0], lse[:, 0]) if squeeze else (out, lse)


def _rand_case(rng, B=3, s_q=3, hq=4, hkv=2, D=16, page=4, max_pages=5, lens=None, layout="NHD",
               combined=False, share=(), dtype=np.float64):
    T = page * max_pages
    if lens is None:
        lens = rng.integers(-2, T + 3, size=B)
    k = rng.standard_normal((B, T, hkv, D)).astype(dtype)
    v = rng.standard_normal((B, T, hkv, D)).astype(dtype)
    kc, vc, bt = paged_kv_from_contiguous(k, v, lens, page, kv_layout=layout, combined=combined,
                                          max_pages=max_pages, extra_pages=2, share=share, rng=rng)
    q = rng.standard_normal((B, s_q, hq, D)).astype(dtype)
    return q, kc, vc, bt, np.asarray(lens, np.int32), k, v


# ----------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("s_q", [1, 2, 5])
def test_oracle_equals_direct_per_token_loop(layout, combined, s_q):
    rng = np.random.default_rng(len(layout) * 10 + s_q + combined)
    lens = [0, 13, 20 + 7, 4, -3]  # empty, ragged, over capacity (20), one page, negative
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, B=5, s_q=s_q, hq=6, hkv=2, page=4, max_pages=5, lens=lens,
                                           layout=layout, combined=combined, share=((2, 1, 2),))
    o1, l1 = gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout=layout, sm_scale=0.3)
    o2, l2 = _direct(q, kc, vc, bt, lens, kv_layout=layout, sm_scale=0.3)
    assert o1.shape == q.shape and l1.shape == q.shape[:3]
    assert not np.isnan(o1).any() and not np.isnan(l1).any()
    np.testing.assert_allclose(o1, o2, rtol=1e-11, atol=1e-12)
    assert np.array_equal(np.isposinf(l1), np.isposinf(l2))
    fin = np.isfinite(l2)
    np.testing.assert_allclose(l1[fin], l2[fin], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page", [1, 2, 8, 64])  # dividing C: the same capacity
def test_identity_pages_with_one_query_token_equal_the_contiguous_oracle(page):
    """s_q = 1 with 3-D q: the contiguous kv as one HND combined page per request, and scattered into
    shuffled NHD / HND pages, give gqa_decode_reference's output."""
    rng = np.random.default_rng(page)
    B, hq, hkv, D, C = 4, 8, 2, 32, 64
    q = rng.standard_normal((B, hq, D))
    kv = rng.standard_normal((B, 2, hkv, C, D))
    lens = np.array([64, 0, 17, 99], np.int32)
    ref = gqa_decode_reference(q, kv, lens, 1.3)
    o, lse = gqa_decode_paged_reference(q, kv, None, np.arange(B)[:, None], lens, kv_layout="HND", q_scale=1.3)
    assert o.shape == (B, hq, D) and lse.shape == (B, hq)
    np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-13)
    k_tok, v_tok = kv[:, 0].transpose(0, 2, 1, 3), kv[:, 1].transpose(0, 2, 1, 3)
    for layout in ("NHD", "HND"):
        kc, vc, bt = paged_kv_from_contiguous(k_tok, v_tok, lens, page, kv_layout=layout, rng=rng, extra_pages=1)
        o2, lse2 = gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout=layout, q_scale=1.3)
        np.testing.assert_allclose(o2, ref, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse2, lse, rtol=1e-13, atol=1e-13)
    assert np.all(o[1] == 0) and np.all(np.isposinf(lse[1]))


def test_bottom_right_causal_rows_and_empty_rows():
    """Query token j of s_q sees the first L - (s_q - 1 - j) keys: row j equals the one-token oracle
    with that many keys; rows with none give out 0 and lse +inf."""
    rng = np.random.default_rng(5)
    s_q, L = 6, 3
    q, kc, vc, bt, _, _, _ = _rand_case(rng, B=1, s_q=s_q, page=2, max_pages=4, lens=[L])
    o, lse = gqa_decode_paged_reference(q, kc, vc, bt, [L])
    for j in range(s_q):
        n = L - (s_q - 1 - j)
        if n <= 0:
            assert np.all(o[0, j] == 0) and np.all(np.isposinf(lse[0, j]))
            continue
        oj, lj = gqa_decode_paged_reference(q[:, j], kc, vc, bt, [n])
        np.testing.assert_allclose(o[0, j], oj[0], rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(lse[0, j], lj[0], rtol=1e-13, atol=1e-15)
    assert np.isfinite(lse[0, s_q - L:]).all() and np.isposinf(lse[0, : s_q - L]).all()


def test_lengths_are_clamped_to_the_capacity():
    rng = np.random.default_rng(6)
    q, kc, vc, bt, _, _, _ = _rand_case(rng, B=2, page=4, max_pages=3, lens=[12, 12])
    o_cap, l_cap = gqa_decode_paged_reference(q, kc, vc, bt, [12, 12])
    for over in ([13, 2**31 - 1], [1000, 12]):
        o, lse = gqa_decode_paged_reference(q, kc, vc, bt, np.array(over, np.int32))
        np.testing.assert_array_equal(o, o_cap)
        np.testing.assert_array_equal(lse, l_cap)
    o, lse = gqa_decode_paged_reference(q, kc, vc, bt, np.array([-1, -(2**31)], np.int32))
    assert np.all(o == 0) and np.all(np.isposinf(lse))


def test_poisoned_table_entries_and_nan_pages_are_never_read():
    """Entries past each request's pages hold 2147480000 (indexing with it would raise) and unused
    pages / tail slots hold NaN: the oracle is finite and equals the one on a cache where those hold
    other values."""
    rng = np.random.default_rng(7)
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, B=4, s_q=2, page=4, max_pages=6, lens=[5, 0, 9, 1])
    assert (bt == TABLE_POISON).sum() == 4 * 6 - (2 + 0 + 3 + 1)
    assert np.isnan(kc).any() and np.isnan(vc).any()
    o, lse = gqa_decode_paged_reference(q, kc, vc, bt, lens)
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    kc2, vc2 = np.where(np.isnan(kc), 1e6, kc), np.where(np.isnan(vc), -1e6, vc)
    o2, lse2 = gqa_decode_paged_reference(q, kc2, vc2, bt, lens)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    with pytest.raises(IndexError):  # the poison would be caught if it were used as a page index
        kc[bt[1, 0]]


def test_bad_page_entries_read_as_zero_pages():
    """A used entry outside [0, num_pages) (the kernels' "bad_page" status) reads as a page of zeros."""
    rng = np.random.default_rng(8)
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, B=2, s_q=1, page=4, max_pages=4, lens=[16, 16])
    P = kc.shape[0]
    zero = np.zeros((1,) + kc.shape[1:])
    kz, vz = np.concatenate([kc, zero]), np.concatenate([vc, zero])
    for bad in (P, P + 100, -1, -(2**31)):
        bt2, bt3 = bt.copy(), bt.copy()
        bt2[0, 2] = bad
        bt3[0, 2] = P  # the appended zero page
        o, lse = gqa_decode_paged_reference(q, kc, vc, bt2, lens)
        o3, lse3 = gqa_decode_paged_reference(q, kz, vz, bt3, lens)
        np.testing.assert_array_equal(o, o3)
        np.testing.assert_array_equal(lse, lse3)


def test_combined_equals_separate_and_nhd_equals_hnd():
    rng = np.random.default_rng(9)
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, B=3, s_q=4, page=8, max_pages=3)
    o, lse = gqa_decode_paged_reference(q, kc, vc, bt, lens)
    comb = np.stack([kc, vc], axis=1)  # [P, 2, page, Hkv, D]
    oc, lc = gqa_decode_paged_reference(q, comb, None, bt, lens)
    kh, vh = kc.transpose(0, 2, 1, 3).copy(), vc.transpose(0, 2, 1, 3).copy()  # [P, Hkv, page, D]
    oh, lh = gqa_decode_paged_reference(q, kh, vh, bt, lens, kv_layout="HND")
    ohc, lhc = gqa_decode_paged_reference(q, np.stack([kh, vh], axis=1), None, bt, lens, kv_layout="HND")
    for oo, ll in ((oc, lc), (oh, lh), (ohc, lhc)):
        np.testing.assert_allclose(oo, o, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(ll, lse, rtol=1e-13, atol=1e-14)


def test_shared_pages_and_any_page_order():
    """Two requests reading the same pages (in any order of the pool) see the same keys."""
    rng = np.random.default_rng(10)
    hq, hkv, D, page = 4, 1, 8, 4
    k = rng.standard_normal((1, 12, hkv, D))
    v = rng.standard_normal((1, 12, hkv, D))
    kc, vc, bt = paged_kv_from_contiguous(np.repeat(k, 2, 0), np.repeat(v, 2, 0), [12, 10], page,
                                          share=((1, 0, 2),), rng=rng)
    assert list(bt[1, :2]) == list(bt[0, :2]) and bt[1, 2] != bt[0, 2]
    assert kc.shape[0] == 3 + 1  # request 1 owns one page of its own
    q = np.repeat(rng.standard_normal((1, 1, hq, D)), 2, 0)
    o, _ = gqa_decode_paged_reference(q, kc, vc, bt, [12, 10])
    o_ref = gqa_decode_reference(q[:, 0], np.stack([np.repeat(k, 2, 0), np.repeat(v, 2, 0)], 1).transpose(0, 1, 3, 2, 4),
                                 [12, 10])
    np.testing.assert_allclose(o[:, 0], o_ref, rtol=1e-12, atol=1e-13)
    perm = rng.permutation(kc.shape[0])  # reorder the pool and the table with it
    inv = np.argsort(perm)
    bt2 = bt.copy()
    used = bt2 != TABLE_POISON
    bt2[used] = inv[bt2[used]]
    o2, _ = gqa_decode_paged_reference(q, kc[perm], vc[perm], bt2, [12, 10])
    np.testing.assert_array_equal(o, o2)


def test_scales():
    rng = np.random.default_rng(11)
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, D=16)
    s = 0.21
    a = gqa_decode_paged_reference(q, kc, vc, bt, lens, sm_scale=s)
    b = gqa_decode_paged_reference(q, kc, vc, bt, lens, q_scale=s * math.sqrt(16))
    c = gqa_decode_paged_reference(q, kc, vc, bt, lens, q_scale=1.0, sm_scale=s)
    for x in (b, c):
        np.testing.assert_allclose(x[0], a[0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(x[1], a[1], rtol=1e-12, atol=1e-14)
    d = gqa_decode_paged_reference(q, kc, vc, bt, lens)
    e = gqa_decode_paged_reference(q, kc, vc, bt, lens, sm_scale=1 / math.sqrt(16))
    np.testing.assert_array_equal(d[0], e[0])
    with pytest.raises(ValueError, match="not both"):
        gqa_decode_paged_reference(q, kc, vc, bt, lens, q_scale=2.0, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_layout"):
        gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout="XYZ")


def test_lse_is_the_natural_log_sum_exp_and_merges():
    """lse = ln sum_t exp(sm_scale q.k_t); attention over keys [0, m) and [m, L) merged with their
    lse (ops.oracle.merge_states) = attention over [0, L)."""
    rng = np.random.default_rng(12)
    page, mp, m = 4, 6, 8
    q, kc, vc, bt, _, _, _ = _rand_case(rng, B=2, s_q=1, hq=2, hkv=1, D=8, page=page, max_pages=mp, lens=[21, 5])
    lens = np.array([21, 5])
    o, lse = gqa_decode_paged_reference(q, kc, vc, bt, lens, sm_scale=0.5)
    for b in range(2):  # direct log-sum-exp
        keys = kc[bt[b, : -(-lens[b] // page)]].reshape(-1, 1, 8)[: lens[b], 0]
        s = 0.5 * q[b, 0] @ keys.T
        np.testing.assert_allclose(lse[b, 0], np.log(np.exp(s).sum(-1)), rtol=1e-13)
    bt_b = np.full_like(bt, TABLE_POISON)
    bt_b[:, : mp - m // page] = bt[:, m // page:]
    la, lb = np.minimum(lens, m), np.maximum(lens - m, 0)
    for b in range(2):
        bt_b[b, -(-int(lb[b]) // page):] = TABLE_POISON
    oa, sa = gqa_decode_paged_reference(q, kc, vc, bt, la, sm_scale=0.5)
    ob, sb = gqa_decode_paged_reference(q, kc, vc, bt_b, lb, sm_scale=0.5)
    assert np.isposinf(sb[1]).all() and np.all(ob[1] == 0)
    mo, ml = merge_states([oa, ob], [sa, sb])
    np.testing.assert_allclose(mo, o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ml, lse, rtol=1e-13)


def test_low_precision_inputs():
    """fp16 / bf16 host arrays are read as their exact values."""
    rng = np.random.default_rng(13)
    q, kc, vc, bt, lens, _, _ = _rand_case(rng, dtype=np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        q2, k2, v2 = q.astype(dt), kc.astype(dt), vc.astype(dt)
        a = gqa_decode_paged_reference(q2, k2, v2, bt, lens)
        b = gqa_decode_paged_reference(q2.astype(np.float64), k2.astype(np.float64), v2.astype(np.float64), bt, lens)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


# ----------------------------------------------------------------------------- the scatter helper
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_scatter_helper_round_trip(layout, combined):
    rng = np.random.default_rng(14)
    B, T, hkv, D, page, mp = 3, 20, 2, 8, 4, 6
    k = rng.standard_normal((B, T, hkv, D)).astype(np.float16)
    v = rng.standard_normal((B, T, hkv, D)).astype(np.float16)
    lens = np.array([20, 0, 30])  # 30 > capacity 24 -> 24 keys
    with pytest.raises(ValueError, match="tokens"):
        paged_kv_from_contiguous(k, v, lens, page, kv_layout=layout, max_pages=mp)
    lens = np.array([19, 0, 7])
    kc, vc, bt = paged_kv_from_contiguous(k, v, lens, page, kv_layout=layout, combined=combined, max_pages=mp,
                                          extra_pages=3, rng=rng)
    if combined:
        assert vc is None and kc.shape[1] == 2
        kc, vc = kc[:, 0], kc[:, 1]
    assert kc.shape == ((5 + 0 + 2 + 3, page, hkv, D) if layout == "NHD" else (10, hkv, page, D))
    assert bt.dtype == np.int32 and bt.shape == (B, mp)
    assert (bt[0, 5:] == TABLE_POISON).all() and (bt[1] == TABLE_POISON).all() and (bt[2, 2:] == TABLE_POISON).all()
    used = bt[bt != TABLE_POISON]
    assert len(set(used.tolist())) == used.size  # no sharing asked: distinct pages
    for b in range(B):
        for t in range(int(lens[b])):
            pg, sl = bt[b, t // page], t % page
            got = kc[pg, sl] if layout == "NHD" else kc[pg, :, sl]
            np.testing.assert_array_equal(got, k[b, t])
            got = vc[pg, sl] if layout == "NHD" else vc[pg, :, sl]
            np.testing.assert_array_equal(got, v[b, t])
    # tail slots of the last pages and the extra pages are NaN
    tail = kc[bt[0, 4], 3] if layout == "NHD" else kc[bt[0, 4], :, 3]
    assert np.isnan(tail).all()
    unused = sorted(set(range(kc.shape[0])) - set(used.tolist()))
    assert len(unused) == 3 and np.isnan(kc[unused]).all() and np.isnan(vc[unused]).all()


# ----------------------------------------------------------------------------- the GPU grid's construction
def test_grid_size_and_axis_coverage():
    g = pc.grid()
    assert len(g) >= 400
    count = collections.Counter
    axes = {
        "layout": (pc.LAYOUTS, lambda c: c.layout), "combined": ((False, True), lambda c: c.combined),
        "page": (pc.PAGES, lambda c: c.page), "s_q": (pc.S_QS, lambda c: c.s_q),
        "group": (pc.GROUPS, lambda c: c.group), "d": (pc.HEAD_DIMS, lambda c: c.d),
        "dtype": (pc.DTYPES, lambda c: c.dtype), "splits": (pc.SPLITS, lambda c: c.splits),
        "call": (pc.CALLS, lambda c: c.call), "scale": (pc.SCALES, lambda c: c.scale),
        "lse": (pc.LSE_MODES, lambda c: c.lse_mode), "pool": (pc.POOLS, lambda c: c.pool),
        "table": (pc.TABLES, lambda c: c.table), "det": ((False, True), lambda c: c.deterministic),
        "poison": (("nan", "inf"), lambda c: c.poison), "q3d": ((False, True), lambda c: c.q3d),
        "layout x combined": ([(a, b) for a in pc.LAYOUTS for b in (False, True)], lambda c: (c.layout, c.combined)),
        "call x splits": ([(a, b) for a in pc.CALLS for b in pc.SPLITS], lambda c: (c.call, c.splits)),
    }
    for name, (values, key) in axes.items():
        n = count(key(c) for c in g)
        for v in values:
            assert n[v] >= 14, f"axis {name}: value {v!r} appears {n[v]} times"
    # sampled, not the product: each layout x page and s_q x group pair appears
    assert len({(c.layout, c.combined, c.page) for c in g}) == 36
    assert len({(c.s_q, c.group) for c in g}) == 20
    assert len({(c.d, c.dtype, c.s_q) for c in g}) == 30
    assert sum(any(x == 0 for x in c.lengths) for c in g) >= 100
    assert sum(any(x < 0 for x in c.lengths) for c in g) >= 60
    assert sum(any(x > c.capacity for x in c.lengths) for c in g) >= 100
    assert sum(any(0 < x < c.s_q for x in c.lengths) for c in g if c.s_q > 1) >= 40  # causal rows without keys
    assert sum(bool(c.share) for c in g) >= 100
    assert sum(c.s_q * c.group > 16 for c in g) >= 100  # more than one MMA row tile
    assert sum(c.capacity >= 1024 for c in g) >= 30
    for c in g:
        assert 1 <= c.batch <= 6 and c.capacity <= pc.MAX_CAPACITY
        assert c.batch * c.hq * c.s_q * c.capacity * c.d <= pc.WORK_MAX
        assert 1 <= c.group <= 16 and c.hq == c.group * c.hkv
        assert not (c.deterministic and c.splits is not None)
        assert c.q3d <= (c.s_q == 1) and c.out_given <= (c.call == "convenience")
    assert len({c.id for c in g}) == len(g)
    assert pc.grid() is g and [c.id for c in pc.grid.__wrapped__()] == [c.id for c in g]  # deterministic


@pytest.mark.parametrize("start", range(0, 450, 50))
def test_grid_host_inputs_and_device_layouts(start):
    """Every grid case's host side (a CPU dry run of the GPU test with NumPy as the device): the
    oracle is finite and exact on empty rows; the device views hold exactly the host cache and
    table; strided caches and wide tables have the intended strides; poisoned entries sit only past
    each request's pages; no used table entry points at a NaN / Inf page; and the oracle does not
    change when every unused page and slot is overwritten."""
    poisoned = 0
    for case in pc.grid()[start: start + 50]:
        h = pc.host_case(case)
        poisoned += bool(np.isnan(h.k_cache.astype(np.float32)).any() or np.isinf(h.k_cache.astype(np.float32)).any())
        d = pc.device_case(h, upload=np.array)
        B, cap, page = case.batch, case.capacity, case.page
        assert h.q.shape == ((B, case.hq, case.d) if case.q3d else (B, case.s_q, case.hq, case.d))
        assert h.ref_out.shape == h.q.shape and h.ref_lse.shape == h.q.shape[:-1]
        assert np.isfinite(h.ref_out).all() and not np.isnan(h.ref_lse).any()
        assert np.all(h.ref_out[np.isposinf(h.ref_lse)] == 0)
        assert d.q.dtype == h.q.dtype and np.array_equal(d.q.view(np.uint16), h.q.view(np.uint16))
        np.testing.assert_array_equal(d.seq_lens, h.seq_lens)
        np.testing.assert_array_equal(d.block_table, h.block_table)
        assert d.block_table.dtype == np.int32 and d.block_table.strides[1] == 4
        if case.table != "dense":
            assert d.block_table.strides[0] > 4 * case.max_pages
        for got, want in ((d.k_cache, h.k_cache), (d.v_cache, h.v_cache)):
            if want is None:
                assert got is None
                continue
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))  # bit for bit, poison included
            page_bytes = want[0].nbytes
            dense = np.empty(want.shape, want.dtype).strides  # C strides: each page dense
            assert got.strides[1:] == dense[1:]
            if case.pool in ("strided", "kvpair"):
                assert got.strides[0] >= 2 * page_bytes
            else:
                assert got.strides[0] == page_bytes
            assert got.strides[0] % 16 == 0
        assert case.combined == (h.v_cache is None)
        # the table: used entries valid, the rest poisoned
        lens = np.clip(h.seq_lens.astype(np.int64), 0, cap)
        k_pages = h.k_cache if h.v_cache is not None else h.k_cache[:, 0]
        for b in range(B):
            n = -(-int(lens[b]) // page)
            row = h.block_table[b]
            assert (row[n:] == pc.TABLE_POISON).all()
            assert ((row[:n] >= 0) & (row[:n] < k_pages.shape[0])).all()
            for p in range(n):  # every used slot of a used page holds finite data
                used = min(page, int(lens[b]) - p * page)
                pg = k_pages[row[p]]
                slots = pg[:used] if case.layout == "NHD" else pg[:, :used]
                assert np.isfinite(slots.astype(np.float32)).all()
        if case.idx % 5 == 0:  # unused pages / slots overwritten: the oracle does not move
            kc = np.where(np.isfinite(h.k_cache.astype(np.float32)), h.k_cache, h.k_cache.dtype.type(3.0))
            vc = None if h.v_cache is None else np.where(np.isfinite(h.v_cache.astype(np.float32)), h.v_cache,
                                                         h.v_cache.dtype.type(-3.0))
            o2, l2 = gqa_decode_paged_reference(h.q, kc, vc, h.block_table, h.seq_lens, kv_layout=case.layout,
                                                **case.scale_kwargs())
            np.testing.assert_array_equal(o2, h.ref_out)
            np.testing.assert_array_equal(l2, h.ref_lse)
    assert poisoned >= 40  # nearly every case has unused pages or tail slots poisoned


def test_check_paged_accepts_the_oracle_and_catches_errors():
    """The GPU tests' comparison: the oracle itself (rounded to the dtype) passes; NaN, a wrong empty
    row, a missing +inf and an off lse are caught."""
    case = next(c for c in pc.grid() if c.wants_lse and any(x <= 0 for x in c.lengths) and c.dtype == "float16")
    h = pc.host_case(case)
    got = h.ref_out.astype(np.float16)
    lse = h.ref_lse.astype(np.float32)
    pc.check_paged(got, lse, h.ref_out, h.ref_lse, case.dtype, "self", record=False)
    empty = np.argwhere(np.isposinf(h.ref_lse))[0]
    full = np.argwhere(np.isfinite(h.ref_lse))[0]
    bad = got.copy()
    bad[tuple(full)][0] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        pc.check_paged(bad, lse, h.ref_out, h.ref_lse, case.dtype, "nan", record=False)
    bad = got.copy()
    bad[tuple(empty)][0] = 1e-3
    with pytest.raises(AssertionError):
        pc.check_paged(bad, lse, h.ref_out, h.ref_lse, case.dtype, "empty row", record=False)
    bl = lse.copy()
    bl[tuple(empty)] = 0.0
    with pytest.raises(AssertionError, match=r"\+inf"):
        pc.check_paged(got, bl, h.ref_out, h.ref_lse, case.dtype, "missing inf", record=False)
    bl = lse.copy()
    bl[tuple(full)] += 0.1
    with pytest.raises(AssertionError, match="lse values off"):
        pc.check_paged(got, bl, h.ref_out, h.ref_lse, case.dtype, "lse off", record=False)


@pytest.mark.parametrize("page,s_q", [(16, 1), (64, 4), (1, 2), (256, 1), (32, 7), (8, 16)])
def test_graph_states_keep_every_used_entry_valid(page, s_q):
    """The GPU graph test's states (tests/gqa/paged_cases.graph_states): every entry a request uses
    is a finite page of the pool; the states shrink, grow past the capacity, remap, share pages,
    include empty / negative / int32-max lengths, and come back to the first state."""
    rng = np.random.default_rng(page)
    B, mp = 4, max(1, 1536 // page)
    cap, finite = mp * page, B * mp + 8
    states = pc.graph_states(B, mp, page, rng.permutation(finite), s_q, rng)
    assert len(states) >= 6
    for lens, bt in states:
        assert bt.shape == (B, mp) and bt.dtype == np.int32 and lens.dtype == np.int32
        for b in range(B):
            n = -(-min(max(int(lens[b]), 0), cap) // page)
            assert ((bt[b, :n] >= 0) & (bt[b, :n] < finite)).all()
    lens = np.array([s[0] for s in states], np.int64)
    assert (lens[1] < lens[0]).any() and (lens[2] > lens[0]).any() and (lens > cap).any()
    assert (lens <= 0).any() and (lens == 2**31 - 1).any() and (lens == cap).any()
    assert not np.array_equal(states[2][1], states[3][1]) and np.array_equal(states[2][0], states[3][0])
    assert np.array_equal(states[3][1][1, :2], states[3][1][0, :2])  # shared pages
    assert np.array_equal(states[-1][0], states[0][0]) and np.array_equal(states[-1][1], states[0][1])
