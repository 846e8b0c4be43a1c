"""Paged GQA decode on the GPU against the float64 oracle (gqadrv.gqa.reference.gqa_decode_paged_reference).

* the grid of tests/gqa/paged_cases.py (450 cases: layouts, page sizes, s_q, groups, head dims, dtypes,
  ragged / empty / over-capacity lengths, split counts, convenience and prepared calls, shared and
  shuffled pages, poisoned tables and pages, strided tables and caches);
* the contiguous ``gqa_decode`` with 4-D q (s_q 1..16) and ``return_lse``;
* s_q = 1 consistency between the contiguous and the paged call, and the LSE merge identity;
* batch invariance of ``deterministic=True`` (paged and contiguous), bit for bit;
* CUDA-graph replays of a prepared paged launch with lengths and block tables changed in place;
* ``check_status`` (empty, clamped, bad_page) and host-side validation errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import (
    TABLE_POISON,
    gqa_decode_paged_reference,
    gqa_decode_reference,
    paged_kv_from_contiguous,
)
from tests.gqa.paged_cases import (
    BATCH_PLACES,
    INV_D,
    INV_HKV,
    INV_HQ,
    INV_MAX_PAGES,
    INV_PAGE,
    LSE_ATOL,
    S_QS,
    TARGET_LEN,
    TOL,
    check_paged,
    device_case,
    graph_states,
    grid,
    host_case,
    invariance_batch,
    np_dtype,
)

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")


def nan_out(like):
    """An output buffer shaped like ``like`` (fp16 / bf16) whose every element is NaN (0xFFFF)."""
    import cupy as cp

    o = cp.empty_like(like)
    o.view(cp.uint16).fill(0xFFFF)
    return o


def nan_lse(shape):
    import cupy as cp

    return cp.full(shape, np.nan, cp.float32)


def to_np(x) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(x)


def _unpack(res, wants_lse: bool):
    if wants_lse:
        assert isinstance(res, tuple) and len(res) == 2, f"expected (out, lse), got {type(res).__name__}"
        return res
    assert not isinstance(res, tuple), "lse returned although it was not asked for"
    return res, None


# ----------------------------------------------------------------------------- the oracle grid
# (its size and axis coverage are checked on the CPU: tests/gqa/test_paged_reference_host.py)
@pytest.mark.parametrize("case", grid(), ids=lambda c: c.id)
def test_paged_oracle_grid(case):
    """One case of the grid: out (and lse) against the float64 oracle; every output element written
    (NaN-filled buffers), no NaN anywhere, rows without a key exactly 0 with lse +inf. The convenience
    call runs twice (the second is a layout replay), the prepared launch twice (split counters reset)."""
    import cupy as cp

    import gqadrv

    h = host_case(case)
    d = device_case(h)
    v = None if case.combined else d.v_cache
    kw = dict(kv_layout=case.layout, num_splits=case.splits, deterministic=case.deterministic, **case.scale_kwargs())
    lse_shape = h.ref_lse.shape
    runs = []
    if case.call == "convenience":
        o = nan_out(d.q) if case.out_given else None
        lbuf = nan_lse(lse_shape) if case.lse_mode == "given" else None
        for _ in range(2):
            if o is not None:
                o.view(cp.uint16).fill(0xFFFF)
            if lbuf is not None:
                lbuf.fill(np.nan)
            res = gqadrv.gqa_decode_paged(d.q, d.k_cache, v, d.block_table, d.seq_lens, out=o, lse=lbuf,
                                          return_lse=case.lse_mode == "return", **kw)
            out, lse = _unpack(res, case.wants_lse)
            if o is not None:
                assert out is o
            if lbuf is not None:
                assert lse is lbuf
            runs.append((out.copy(), None if lse is None else lse.copy()))
    else:
        o = nan_out(d.q)
        lbuf = nan_lse(lse_shape) if case.wants_lse else None
        p = gqadrv.prepare_gqa_decode_paged(q=d.q, k_cache=d.k_cache, v_cache=v, block_table=d.block_table,
                                            seq_lens=d.seq_lens, out=o, lse=lbuf, **kw)
        for _ in range(2):
            o.view(cp.uint16).fill(0xFFFF)
            if lbuf is not None:
                lbuf.fill(np.nan)
            res = gqadrv.launch_prepared(p)
            out, lse = _unpack(res, case.wants_lse)
            assert out is o and lse is lbuf
            cp.cuda.Device().synchronize()
            runs.append((out.copy(), None if lse is None else lse.copy()))
    for out, lse in runs:
        assert isinstance(out, cp.ndarray) and out.shape == d.q.shape and out.dtype == d.q.dtype
        if lse is not None:
            assert lse.dtype == cp.float32 and lse.shape == lse_shape
        check_paged(to_np(out), None if lse is None else to_np(lse), h.ref_out, h.ref_lse, case.dtype,
                    f"grid {case.call}")
    if case.deterministic:
        (o1, l1), (o2, l2) = runs
        assert bool(cp.array_equal(o1.view(cp.uint16), o2.view(cp.uint16)))
        if l1 is not None:
            assert bool(cp.array_equal(l1.view(cp.uint32), l2.view(cp.uint32)))


# ----------------------------------------------------------------------------- contiguous gqa_decode, 4-D q
CONTIG_GEOMS = [  # dtype, D, Hq, Hkv, C
    ("float16", 128, 32, 8, 1000),   # group 4, TMA route
    ("bfloat16", 64, 16, 16, 64),    # group 1, short route
    ("float16", 256, 16, 1, 300),    # group 16 (rows = 16 * s_q up to 256)
    ("bfloat16", 128, 32, 4, 4096),  # group 8, split route
]


def _contig_case(geom, s_q, seed):
    dt, D, hq, hkv, C = geom
    rng = np.random.default_rng(seed)
    npdt = np_dtype(dt)
    lens = np.array([C, 0, max(1, min(C, s_q - 1)), C + 5, -2, int(rng.integers(1, C + 1))], np.int32)
    B = len(lens)
    q = rng.standard_normal((B, s_q, hq, D), dtype=np.float32).astype(npdt)
    kv = rng.standard_normal((B, 2, hkv, C, D), dtype=np.float32).astype(npdt)
    for b, n in enumerate(lens):
        kv[b, :, :, min(max(int(n), 0), C):] = np.nan
    # the contiguous cache is the combined HND layout with one page of C tokens per request
    ref_o, ref_l = gqa_decode_paged_reference(q, kv, None, np.arange(B, dtype=np.int32)[:, None], lens,
                                              kv_layout="HND")
    return q, kv, lens, ref_o, ref_l


@pytest.mark.parametrize("s_q", S_QS)
@pytest.mark.parametrize("geom", CONTIG_GEOMS, ids=lambda g: f"{g[0][:2]}{g[1]}-h{g[2]}/{g[3]}-C{g[4]}")
def test_contiguous_gqa_decode_with_4d_q(geom, s_q):
    """gqa_decode(q [B, s_q, Hq, D], kv [B, 2, Hkv, C, D]) with return_lse: bottom-right causal
    rows, empty / negative / over-capacity lengths, NaN padding; also out= / lse= buffers and
    deterministic=True."""
    import cupy as cp

    import gqadrv
    from tests.helpers import to_device

    dt = geom[0]
    q, kv, lens, ref_o, ref_l = _contig_case(geom, s_q, seed=s_q * 31 + geom[1])
    dq, dkv, dl = to_device(q), to_device(kv), to_device(lens)
    out, lse = gqadrv.gqa_decode(dq, dkv, dl, return_lse=True)
    assert out.shape == dq.shape and out.dtype == dq.dtype
    assert lse.shape == (q.shape[0], s_q, q.shape[2]) and lse.dtype == cp.float32
    check_paged(to_np(out), to_np(lse), ref_o, ref_l, dt, "contiguous 4-D")
    out2 = gqadrv.gqa_decode(dq, dkv, dl)
    assert not isinstance(out2, tuple)
    check_paged(to_np(out2), None, ref_o, ref_l, dt, "contiguous 4-D")
    o, lb = nan_out(dq), nan_lse(ref_l.shape)
    res = gqadrv.gqa_decode(dq, dkv, dl, out=o, lse=lb)
    assert res[0] is o and res[1] is lb
    check_paged(to_np(o), to_np(lb), ref_o, ref_l, dt, "contiguous 4-D out=")
    o3, l3 = gqadrv.gqa_decode(dq, dkv, dl, return_lse=True, deterministic=True)
    check_paged(to_np(o3), to_np(l3), ref_o, ref_l, dt, "contiguous 4-D deterministic")


# ----------------------------------------------------------------------------- s_q = 1: contiguous vs paged, LSE
@pytest.mark.parametrize("dtype", DTYPES)
def test_s_q1_contiguous_and_paged_agree_and_lse_merges(dtype):
    """The same data as a contiguous cache (gqa_decode, 3-D and 4-D q) and as shuffled pages
    (gqa_decode_paged): outputs agree with each other and with both oracles; lse of the two calls
    agree; and lse is the natural-log LSE: merging the attention over keys [0, m) and [m, L) with
    their lse gives the attention over [0, L)."""
    import gqadrv
    from gqadrv.ops.oracle import merge_states
    from tests.helpers import to_device

    rng = np.random.default_rng(11 if dtype == "float16" else 12)
    npdt = np_dtype(dtype)
    B, hq, hkv, D, C, page = 4, 32, 8, 128, 1024, 16
    lens = np.array([1024, 517, 3, 800], np.int32)
    q = rng.standard_normal((B, hq, D), dtype=np.float32).astype(npdt)
    kv = rng.standard_normal((B, 2, hkv, C, D), dtype=np.float32).astype(npdt)
    ref = gqa_decode_reference(q, kv, lens)
    k_tok, v_tok = kv[:, 0].transpose(0, 2, 1, 3), kv[:, 1].transpose(0, 2, 1, 3)  # [B, C, Hkv, D]
    kc, vc, bt = paged_kv_from_contiguous(k_tok, v_tok, lens, page, kv_layout="NHD", extra_pages=3, rng=rng)
    pref_o, pref_l = gqa_decode_paged_reference(q, kc, vc, bt, lens)
    np.testing.assert_allclose(pref_o, ref, rtol=1e-12, atol=1e-12)

    dq, dkv, dl = to_device(q), to_device(kv), to_device(lens)
    dk, dv, dbt = to_device(kc), to_device(vc), to_device(bt)
    o_old = gqadrv.gqa_decode(dq, dkv, dl)
    o_c, l_c = gqadrv.gqa_decode(dq, dkv, dl, return_lse=True)
    o_c4, l_c4 = gqadrv.gqa_decode(dq.reshape(B, 1, hq, D), dkv, dl, return_lse=True)
    o_p, l_p = gqadrv.gqa_decode_paged(dq, dk, dv, dbt, dl, return_lse=True)
    o_p4, l_p4 = gqadrv.gqa_decode_paged(dq.reshape(B, 1, hq, D), dk, dv, dbt, dl, return_lse=True)
    assert l_c.shape == (B, hq) and l_p.shape == (B, hq) and l_c4.shape == (B, 1, hq) and l_p4.shape == (B, 1, hq)
    for label, o, lse in (("contiguous", o_c, l_c), ("contiguous 4-D", o_c4[:, 0], l_c4[:, 0]),
                          ("paged", o_p, l_p), ("paged 4-D", o_p4[:, 0], l_p4[:, 0])):
        check_paged(to_np(o), to_np(lse), ref, pref_l, dtype, f"s_q=1 {label}")
    check_paged(to_np(o_old), None, ref, pref_l, dtype, "s_q=1 gqa_decode without lse")
    tol, ltol = TOL[dtype], LSE_ATOL[dtype]
    a = to_np(o_old).astype(np.float64)
    for o in (o_c, o_p):  # two results each within tol of the oracle: 2 tol apart at most
        assert np.all(np.abs(to_np(o).astype(np.float64) - a) <= 2 * (tol + tol * np.abs(a)))
    assert np.all(np.abs(to_np(l_c).astype(np.float64) - to_np(l_p).astype(np.float64)) <= 2 * ltol)

    # the merge identity: keys [0, m) through the first pages, [m, L) through the remaining pages
    m = 256  # a multiple of the page size, below every length except the one of 3 tokens
    la = np.minimum(lens, m).astype(np.int32)
    lb = np.maximum(lens - m, 0).astype(np.int32)
    bt_b = np.full_like(bt, TABLE_POISON)
    bt_b[:, : bt.shape[1] - m // page] = bt[:, m // page:]
    for b in range(B):  # past each request's used pages the table stays poisoned
        bt_b[b, -(-int(lb[b]) // page):] = TABLE_POISON
    o_a, l_a = gqadrv.gqa_decode_paged(dq, dk, dv, dbt, to_device(la), return_lse=True)
    o_b, l_b = gqadrv.gqa_decode_paged(dq, dk, dv, to_device(bt_b), to_device(lb), return_lse=True)
    lb_np = to_np(l_b).astype(np.float64)
    assert np.all(np.isposinf(lb_np[lens <= m]))  # no key past m: lse +inf, out 0
    assert np.all(to_np(o_b).astype(np.float64)[lens <= m] == 0)
    mo, ml = merge_states([to_np(o_a).astype(np.float64), to_np(o_b).astype(np.float64)],
                          [to_np(l_a).astype(np.float64), lb_np])
    assert np.all(np.abs(mo - ref) <= 2 * (tol + tol * np.abs(ref))), np.abs(mo - ref).max()
    assert np.all(np.abs(ml - pref_l) <= 2 * ltol), np.abs(ml - pref_l).max()


# ----------------------------------------------------------------------------- batch invariance


def _bits(x) -> np.ndarray:
    a = to_np(x)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16)


@pytest.mark.parametrize("s_q", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_paged_is_batch_invariant(dtype, s_q):
    """A target request (3000 keys, group 4, D 128) in batches of 1, 7 and 64 at the first, a middle
    and the last position, among requests of random lengths (0 and > capacity included) on random
    (shared) pages: with deterministic=True its out and lse are the same bits in every batch and in
    a repeated run, through the convenience call and a prepared launch; and they match the oracle."""
    import cupy as cp

    import gqadrv
    from tests.helpers import to_device

    rng = np.random.default_rng(100 + s_q + (dtype == "bfloat16"))
    npdt = np_dtype(dtype)
    t_pages = -(-TARGET_LEN // INV_PAGE)
    num_pages = t_pages + 700
    shape = (num_pages, INV_PAGE, INV_HKV, INV_D)
    kc = rng.standard_normal(shape, dtype=np.float32).astype(npdt)
    vc = rng.standard_normal(shape, dtype=np.float32).astype(npdt)
    perm = rng.permutation(num_pages)
    t_row = np.full(INV_MAX_PAGES, TABLE_POISON, np.int32)
    t_row[:t_pages] = perm[:t_pages]  # the target's pages: shuffled, fixed in every batch
    kc[perm[t_pages - 1], TARGET_LEN % INV_PAGE or INV_PAGE:] = np.nan  # its last page's tail slots
    vc[perm[t_pages - 1], TARGET_LEN % INV_PAGE or INV_PAGE:] = np.nan
    others = perm[t_pages:]  # pages the other requests draw from (with repeats: shared pages)
    t_q = rng.standard_normal((s_q, INV_HQ, INV_D), dtype=np.float32).astype(npdt)
    dk, dv = to_device(kc), to_device(vc)

    ref_o, ref_l = gqa_decode_paged_reference(t_q[None], kc, vc, t_row[None], np.array([TARGET_LEN]))

    seen_o, seen_l = None, None
    for B, pos in BATCH_PLACES:
        q, bt, lens = invariance_batch(rng, B, pos, others, t_row, t_q, npdt)
        dq, dbt, dl = to_device(q), to_device(bt), to_device(lens)
        runs = [gqadrv.gqa_decode_paged(dq, dk, dv, dbt, dl, return_lse=True, deterministic=True) for _ in range(2)]
        if B == 7 and pos == 3:
            o, lb = nan_out(dq), nan_lse((B, s_q, INV_HQ))
            p = gqadrv.prepare_gqa_decode_paged(q=dq, k_cache=dk, v_cache=dv, block_table=dbt, seq_lens=dl,
                                                out=o, lse=lb, deterministic=True)
            runs.append(gqadrv.launch_prepared(p))
        cp.cuda.Device().synchronize()
        for o, lse in runs:
            ob, lb_ = _bits(o[pos]), _bits(lse[pos])
            if seen_o is None:
                seen_o, seen_l = ob, lb_
                check_paged(to_np(o[pos : pos + 1]), to_np(lse[pos : pos + 1]), ref_o, ref_l, dtype,
                            "deterministic paged target")
            assert np.array_equal(ob, seen_o), f"batch {B} position {pos}: out bits differ"
            assert np.array_equal(lb_, seen_l), f"batch {B} position {pos}: lse bits differ"


@pytest.mark.parametrize("s_q", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_contiguous_is_batch_invariant(dtype, s_q):
    """The same for the contiguous gqa_decode(deterministic=True): the target request (3000 of 4096
    tokens) in batches of 1, 7 and 64, other requests' lengths random, same bits everywhere."""
    import cupy as cp

    import gqadrv
    from tests.helpers import to_device

    rng = np.random.default_rng(200 + s_q + (dtype == "bfloat16"))
    npdt = np_dtype(dtype)
    C = INV_MAX_PAGES * INV_PAGE
    n_bank = 6
    bank = rng.standard_normal((n_bank, 2, INV_HKV, C, INV_D), dtype=np.float32).astype(npdt)
    t_kv = rng.standard_normal((2, INV_HKV, C, INV_D), dtype=np.float32).astype(npdt)
    t_kv[:, :, TARGET_LEN:] = np.nan
    t_q = rng.standard_normal((s_q, INV_HQ, INV_D), dtype=np.float32).astype(npdt)
    dbank, dt_kv = to_device(bank), to_device(t_kv)
    ref_o, ref_l = gqa_decode_paged_reference(t_q[None], t_kv[None], None, np.zeros((1, 1), np.int32),
                                              np.array([TARGET_LEN]), kv_layout="HND")

    seen_o, seen_l = None, None
    for B, pos in BATCH_PLACES:
        dkv = cp.empty((B, 2, INV_HKV, C, INV_D), dt_kv.dtype)
        for b in range(B):
            dkv[b] = dt_kv if b == pos else dbank[int(rng.integers(0, n_bank))]
        lens = rng.integers(-2, C + 50, size=B).astype(np.int32)
        lens[pos] = TARGET_LEN
        q = rng.standard_normal((B, s_q, INV_HQ, INV_D), dtype=np.float32).astype(npdt)
        q[pos] = t_q
        dq, dl = to_device(q), to_device(lens)
        if s_q == 1 and B == 7:
            dq = dq.reshape(B, INV_HQ, INV_D)  # 3-D q: out [B, Hq, D], lse [B, Hq]
        for _ in range(2):
            o, lse = gqadrv.gqa_decode(dq, dkv, dl, return_lse=True, deterministic=True)
            cp.cuda.Device().synchronize()
            o_t, l_t = o[pos].reshape(s_q, INV_HQ, INV_D), lse[pos].reshape(s_q, INV_HQ)
            ob, lb = _bits(o_t), _bits(l_t)
            if seen_o is None:
                seen_o, seen_l = ob, lb
                check_paged(to_np(o_t)[None], to_np(l_t)[None], ref_o, ref_l, dtype, "deterministic contiguous target")
            assert np.array_equal(ob, seen_o), f"batch {B} position {pos}: out bits differ"
            assert np.array_equal(lb, seen_l), f"batch {B} position {pos}: lse bits differ"


# ----------------------------------------------------------------------------- graph replays
GRAPH_CASES = [  # layout, combined, page, s_q, dtype, num_splits, deterministic
    ("NHD", False, 16, 1, "float16", None, False),
    ("HND", True, 64, 4, "bfloat16", None, False),
    ("NHD", True, 1, 2, "float16", 3, False),
    ("HND", False, 256, 1, "bfloat16", 1, False),
    ("NHD", False, 32, 7, "bfloat16", 5, False),
    ("HND", True, 8, 16, "float16", None, True),
]


@pytest.mark.parametrize("gc", GRAPH_CASES, ids=lambda g: f"{g[0]}{'c' if g[1] else 's'}-p{g[2]}-s{g[3]}-{g[4][:2]}-S{g[5]}{'-det' if g[6] else ''}")
def test_graph_replay_follows_lengths_and_block_table(gc):
    """prepare_gqa_decode_paged + launch_prepared captured once in a CuPy graph; seq_lens and the
    block table (a column slice of a wider table) change in place between replays; every replay
    (twice per state, NaN-filled outputs) matches the oracle of the new data."""
    import cupy as cp

    import gqadrv
    from tests.helpers import to_device

    layout, combined, page, s_q, dtype, splits, det = gc
    rng = np.random.default_rng(page * 100 + s_q)
    npdt = np_dtype(dtype)
    B, hq, hkv, D = 4, 16, 2, 128
    mp = max(1, 1536 // page)
    finite = B * mp + 8
    num_pages = finite + 4  # the last 4 pages are NaN and never referenced
    page_shape = (page, hkv, D) if layout == "NHD" else (hkv, page, D)
    kc = rng.standard_normal((num_pages,) + page_shape, dtype=np.float32).astype(npdt)
    vc = rng.standard_normal((num_pages,) + page_shape, dtype=np.float32).astype(npdt)
    kc[finite:] = np.nan
    vc[finite:] = np.nan
    finite_pages = rng.permutation(finite)
    q = rng.standard_normal((B, s_q, hq, D), dtype=np.float32).astype(npdt)
    states = graph_states(B, mp, page, finite_pages, s_q, rng)

    # device: the cache as every other page of a NaN pool (dim-0 stride 2 pages), the table a
    # column slice of a wider table
    if combined:
        host = np.stack([kc, vc], axis=1)
        pool = np.full((2 * num_pages,) + host.shape[1:], np.nan, npdt)
        pool[::2] = host
        dpool = to_device(pool)
        dk, dv = dpool[::2], None
    else:
        pool = np.full((num_pages, 2) + page_shape, np.nan, npdt)
        pool[:, 0], pool[:, 1] = kc, vc
        dpool = to_device(pool)
        dk, dv = dpool[:, 0], dpool[:, 1]
    wide = np.full((B, mp + 5), TABLE_POISON, np.int32)
    wide[:, :mp] = states[0][1]
    dwide = to_device(wide)
    dbt = dwide[:, :mp]
    dl = to_device(states[0][0])
    dq = to_device(q)
    o, lbuf = nan_out(dq), nan_lse((B, s_q, hq))
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode_paged(q=dq, k_cache=dk, v_cache=dv, block_table=dbt, seq_lens=dl, out=o,
                                        lse=lbuf, kv_layout=layout, num_splits=splits, deterministic=det, stream=st)
    gqadrv.launch_prepared(p)  # warm launch outside the capture
    st.synchronize()
    with st:
        st.begin_capture()
        gqadrv.launch_prepared(p, stream=st)
        g = st.end_capture()
    for lens, bt in states:
        wide[:, :mp] = bt
        dwide.set(wide)  # same device addresses, new values
        dl.set(lens)
        cp.cuda.Device().synchronize()
        ref_o, ref_l = gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout=layout)
        for _ in range(2):
            o.view(cp.uint16).fill(0xFFFF)
            lbuf.fill(np.nan)
            cp.cuda.Device().synchronize()
            g.launch(st)
            st.synchronize()
            check_paged(to_np(o), to_np(lbuf), ref_o, ref_l, dtype, "graph replay")


# ----------------------------------------------------------------------------- status
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_check_status_reports_empty_clamped_and_bad_pages(splits):
    """A length < 0, one > capacity, and table entries outside [0, num_pages) inside the used range
    (num_pages + 5 and -1) are reported by check_status; those keys read as zeros (no fault); every
    other request of the batch is exact. A later launch with good data reports nothing."""
    import cupy as cp

    import gqadrv
    from tests.helpers import to_device

    rng = np.random.default_rng(40 + (splits or 0))
    B, hq, hkv, D, page, mp = 6, 32, 8, 128, 16, 32
    cap = mp * page
    lens = np.array([300, -3, cap + 50, 200, 100, cap], np.int32)
    k = rng.standard_normal((B, cap, hkv, D), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((B, cap, hkv, D), dtype=np.float32).astype(np.float16)
    kc, vc, bt = paged_kv_from_contiguous(k, v, lens, page, max_pages=mp, extra_pages=2, rng=rng)
    num_pages = kc.shape[0]
    good_bt = bt.copy()
    bt[3, 5] = num_pages + 5   # request 3 uses 13 pages
    bt[4, 0] = -1              # request 4 uses 7 pages
    q = rng.standard_normal((B, hq, D), dtype=np.float32).astype(np.float16)
    ref_o, ref_l = gqa_decode_paged_reference(q, kc, vc, bt, lens)  # bad pages read as zeros
    dq, dk, dv, dbt, dl = (to_device(x) for x in (q, kc, vc, bt, lens))
    o, lbuf = nan_out(dq), nan_lse((B, hq))
    p = gqadrv.prepare_gqa_decode_paged(q=dq, k_cache=dk, v_cache=dv, block_table=dbt, seq_lens=dl, out=o,
                                        lse=lbuf, num_splits=splits)
    gqadrv.launch_prepared(p)
    status = gqadrv.check_status(p)
    got_o, got_l = to_np(o).astype(np.float64), to_np(lbuf).astype(np.float64)
    valid = [0, 2, 5]
    check_paged(got_o[valid], got_l[valid], ref_o[valid], ref_l[valid], "float16", "status: valid requests")
    assert np.all(got_o[1] == 0) and np.all(np.isposinf(got_l[1]))
    check_paged(got_o[[3, 4]], got_l[[3, 4]], ref_o[[3, 4]], ref_l[[3, 4]], "float16", "status: bad pages as zeros")
    assert status == {"empty": [1], "clamped": [2], "bad_page": [3, 4]}, status

    good_bt[1, 0] = good_bt[0, 0]  # request 1 (7 keys now) reads request 0's first (full) page
    good_lens = np.array([300, 7, cap, 200, 100, cap], np.int32)
    dbt.set(good_bt)
    dl.set(good_lens)
    cp.cuda.Device().synchronize()
    gqadrv.launch_prepared(p)
    assert gqadrv.check_status(p) == {"empty": [], "clamped": [], "bad_page": []}
    ref_o, ref_l = gqa_decode_paged_reference(q, kc, vc, good_bt, good_lens)
    check_paged(to_np(o), to_np(lbuf), ref_o, ref_l, "float16", "status: good data")


# ----------------------------------------------------------------------------- validation
@pytest.fixture
def launches(monkeypatch):
    from gqadrv.runtime import module

    calls = []
    real = module.LaunchPlan.launch

    def counting(self, stream=None):
        calls.append(self.kernel.name)
        return real(self, stream)

    monkeypatch.setattr(module.LaunchPlan, "launch", counting)
    return calls


VB, VHQ, VHKV, VD, VPAGE, VPAGES, VMP, VSQ = 2, 8, 2, 128, 16, 8, 4, 2


def _valid_paged():
    import cupy as cp

    return {"q": cp.zeros((VB, VSQ, VHQ, VD), cp.float16),
            "k_cache": cp.zeros((VPAGES, VPAGE, VHKV, VD), cp.float16),
            "v_cache": cp.zeros((VPAGES, VPAGE, VHKV, VD), cp.float16),
            "block_table": cp.zeros((VB, VMP), cp.int32), "seq_lens": cp.full(VB, 20, cp.int32)}


def _paged_bad_inputs():
    import cupy as cp

    f16 = cp.float16
    return {  # name: (changes to the valid call, error class)
        "table-int64": ({"block_table": cp.zeros((VB, VMP), cp.int64)}, TypeError),
        "page-size-3": ({"k_cache": cp.zeros((VPAGES, 3, VHKV, VD), f16),
                         "v_cache": cp.zeros((VPAGES, 3, VHKV, VD), f16)}, ValueError),
        "s_q-17": ({"q": cp.zeros((VB, 17, VHQ, VD), f16)}, ValueError),
        "layout-XYZ": ({"kv_layout": "XYZ"}, ValueError),
        "v-cache-heads": ({"v_cache": cp.zeros((VPAGES, VPAGE, 2 * VHKV, VD), f16)}, ValueError),
        "v-cache-page": ({"v_cache": cp.zeros((VPAGES, VPAGE // 2, VHKV, VD), f16)}, ValueError),
        "combined-dim1-3": ({"k_cache": cp.zeros((VPAGES, 3, VPAGE, VHKV, VD), f16), "v_cache": None}, ValueError),
        "lse-3d-shape-for-4d-q": ({"lse": cp.zeros((VB, VHQ), cp.float32)}, ValueError),
        "lse-[B,Hq,s_q]": ({"lse": cp.zeros((VB, VHQ, VSQ), cp.float32)}, ValueError),
        "both-scales": ({"q_scale": 2.0, "sm_scale": 0.1}, ValueError),
    }


PAGED_BAD = ["table-int64", "page-size-3", "s_q-17", "layout-XYZ", "v-cache-heads", "v-cache-page", "combined-dim1-3",
             "lse-3d-shape-for-4d-q", "lse-[B,Hq,s_q]", "both-scales"]


@pytest.mark.parametrize("call", ["convenience", "prepare"])
@pytest.mark.parametrize("name", PAGED_BAD)
def test_paged_validation_errors(name, call, launches):
    """Each invalid call raises the documented class before anything is launched."""
    import cupy as cp

    import gqadrv

    change, exc = _paged_bad_inputs()[name]
    kw = _valid_paged()
    kw.update(change)
    with pytest.raises(exc):
        if call == "convenience":
            args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
            gqadrv.gqa_decode_paged(*args, **kw)
        else:
            kw.setdefault("out", cp.empty_like(kw["q"]))
            gqadrv.prepare_gqa_decode_paged(**kw)
    assert launches == []


def test_paged_valid_base_call_is_accepted():
    """The base of the validation cases is itself valid (each case above changes one thing)."""
    import cupy as cp

    import gqadrv

    kw = _valid_paged()
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")]
    out, lse = gqadrv.gqa_decode_paged(*args, return_lse=True)
    cp.cuda.Device().synchronize()
    assert out.shape == (VB, VSQ, VHQ, VD) and lse.shape == (VB, VSQ, VHQ)
    assert np.all(to_np(out) == 0) and np.all(np.isfinite(to_np(lse)))  # zero K / V: uniform over 20 keys


@pytest.mark.parametrize("name", ["s_q-17", "lse-3d-shape-for-4d-q", "lse-[B,Hq,s_q]"])
def test_contiguous_4d_validation_errors(name, launches):
    import cupy as cp

    import gqadrv

    q = cp.zeros((VB, 17 if name == "s_q-17" else VSQ, VHQ, VD), cp.float16)
    kv = cp.zeros((VB, 2, VHKV, 128, VD), cp.float16)
    lens = cp.full(VB, 20, cp.int32)
    lse = {"lse-3d-shape-for-4d-q": cp.zeros((VB, VHQ), cp.float32),
           "lse-[B,Hq,s_q]": cp.zeros((VB, VHQ, VSQ), cp.float32)}.get(name)
    with pytest.raises(ValueError):
        gqadrv.gqa_decode(q, kv, lens, lse=lse)
    assert launches == []
