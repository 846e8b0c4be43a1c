"""MLA dense decode on the GPU against the float64 oracle: the grid of tests/mla/cases.py, graph
replays with lengths and block tables changed in place, torch / JAX interop, metadata reuse."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from gqadrv.mla.selftest import make_case
from tests.helpers import record_error
from tests.mla.cases import TOL, grid, strided_inputs

pytestmark = pytest.mark.gpu


def check(got_o, got_l, ref_o, ref_l, dtype, label):
    g = np.asarray(got_o, np.float64)
    tol = TOL[dtype]
    assert np.all(np.isfinite(g)), f"{label}: non-finite output"
    err = np.abs(g - ref_o)
    bad = err > tol + tol * np.abs(ref_o)
    assert not bad.any(), f"{label}: {int(bad.sum())} out elements off, max {err.max():.3e}"
    gl = np.asarray(got_l, np.float64)
    inf = ~np.isfinite(ref_l)
    assert np.array_equal(np.isposinf(gl), inf), f"{label}: lse +inf mismatch"
    lerr = np.abs(gl[~inf] - ref_l[~inf]) if (~inf).any() else np.zeros(1)
    assert np.all(lerr <= 1e-3 + 1e-3 * np.abs(ref_l[~inf])), f"{label}: lse off by {lerr.max():.3e}"
    record_error(f"mla {label} out", float(err.max()) if err.size else 0.0)
    record_error(f"mla {label} lse", float(lerr.max()))


@pytest.mark.parametrize("case", grid(), ids=lambda c: c.label)
def test_oracle_grid(case):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(case.idx)
    lens = case.lens(rng)
    q, k, bt, ln = make_case(rng, case.b, case.s_q, case.h_q, case.h_kv, case.page, lens, case.dtype)
    dq, dk, dbt = strided_inputs(q, k, bt)
    meta, _ = gqadrv.get_mla_metadata()
    o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, cp.asarray(ln), 512, meta, num_splits=case.splits,
                                           causal=case.causal, backend=case.backend)
    ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, case.causal)
    assert o.shape == (case.b, case.s_q, case.h_q, 512) and lse.shape == (case.b, case.h_q, case.s_q)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, case.dtype, f"grid {case.backend or 'auto'}")
    # a second call with the same metadata object reuses it (split counters were reset by the kernel)
    o2, lse2 = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, cp.asarray(ln), 512, meta, num_splits=case.splits,
                                             causal=case.causal, backend=case.backend)
    assert cp.array_equal(o2, o) and cp.array_equal(lse2, lse)


def _graph_case(seed=0, b=4, h_q=64, page=16, L=2000):
    rng = np.random.default_rng(seed)
    q, k, bt, ln = make_case(rng, b, 1, h_q, 1, page, [L] * b, "bfloat16")
    return rng, q, k, bt, ln


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_cupy_graph_replay_follows_lengths_and_block_table(splits, page):
    """One prepared object captured in a CuPy graph; lengths and the block table change in place
    between replays (including 0, 1 and the capacity), and every replay matches the oracle."""
    import cupy as cp

    import gqadrv

    # L a multiple of the page: every token up to the capacity holds data (the state with len = capacity
    # must not read the NaN poison of a partly filled last page as valid keys)
    rng, q, k, bt, ln = _graph_case(page=page, L=2000 - 2000 % page)
    dq, dk, dbt, dl = cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln)
    o = cp.full((4, 1, 64, 512), np.nan, q.dtype)
    lse = cp.empty((4, 64, 1), cp.float32)
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_mla_decode(dq, dk, dbt, dl, out=o, lse=lse, num_splits=splits, stream=st)
    with st:
        st.begin_capture()
        gqadrv.launch_prepared(p)
        g = st.end_capture()
    cap = bt.shape[1] * page
    for state in ([2000, 2000, 2000, 2000], [0, 1, cap, 17], [5, 1999, 0, 640], [cap + 9, -4, 333, 1]):
        ln2 = np.array(state, np.int32)
        bt2 = bt.copy()
        for i in range(4):  # shuffle each request's used pages (the table changes in place too)
            n = -(-min(max(int(ln2[i]), 0), cap) // page)
            n0 = -(-int(ln[i]) // page)
            if n <= n0:
                bt2[i, :n] = rng.permutation(bt[i, :n])
        dl.set(ln2)
        dbt.set(bt2)
        g.launch(st)
        st.synchronize()
        ro, rl = mla_decode_reference(q, k, bt2, ln2, 512, None, False)
        check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", "graph replay")


_TMA_EDGES = [  # (backend, page, b, s_q, h_q, lengths, splits, causal): partial last tiles, empty and
    # over-capacity lengths, splits whose ends fall inside a page, pages of 64..256 tokens
    ("seesaw_tma", 64, 3, 1, 64, [65, 0, 10**6], None, False),
    ("seesaw_tma", 128, 2, 2, 128, [127, 4096 + 17], 3, True),
    ("seesaw_tma", 256, 4, 1, 16, [1, 255, 257, -5], 2, False),
    ("seesaw_tma", 64, 1, 4, 32, [64 * 7 + 1], 5, True),
    ("narrow16_tma", 64, 3, 1, 16, [65, 0, 1000], None, False),
    ("narrow16_tma", 256, 2, 1, 8, [300, 4097], 3, False),
    ("narrow16x2_tma", 64, 3, 1, 16, [65, 0, 1000], None, False),
    ("narrow16x2_tma", 256, 2, 1, 8, [300, 4097], 3, False),
    ("narrow16x2_tma", 128, 3, 2, 8, [129, 64 * 9 + 1, 10**6], 5, True),
    ("narrow16x2_tma", 64, 2, 4, 4, [1, 64 * 3], 7, True),
    ("narrow32_tma", 128, 2, 2, 16, [129, 63], 2, True),
    ("narrow32_tma", 64, 2, 1, 32, [10**6, 1], None, False),
]


@pytest.mark.parametrize("case", _TMA_EDGES, ids=lambda c: f"{c[0]}-p{c[1]}-h{c[4]}s{c[3]}-S{c[6]}")
def test_tma_routes_edges(case):
    """The TMA kernels (forced) on pages of 64..256 tokens: rows past each split's end come from real
    pages poisoned with NaN and must be zeroed; lengths <= 0 and > capacity; every input strided."""
    import cupy as cp

    import gqadrv

    backend, page, b, s_q, h_q, lens, splits, causal = case
    rng = np.random.default_rng(page + h_q + b)
    cap_blocks = -(-max(min(int(x), 4096 + 64) for x in lens) // page) if max(lens) > 0 else 1
    q, k, bt, ln = make_case(rng, b, s_q, h_q, 1, page, lens, "bfloat16", max_blocks=max(cap_blocks, 1))
    dq, dk, dbt = strided_inputs(q, k, bt)
    p = gqadrv.prepare_mla_decode(dq, dk, dbt, cp.asarray(ln), 512, causal=causal, num_splits=splits,
                                  backend=backend)
    assert p.route.startswith(f"mla_decode_{backend}_")
    o, lse = gqadrv.launch_prepared(p)
    o2, lse2 = gqadrv.launch_prepared(p)  # counters reset by the last CTA of each unit
    cp.cuda.Device().synchronize()
    ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, causal)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"tma {backend}")
    assert cp.array_equal(o, o2) and cp.array_equal(lse, lse2)


def _balanced_cases():
    """(page, b, s_q, h_q, h_kv, lengths, ctas per group or None, causal, dtype): the balanced grid
    (``seesaw_bal``, forced) with requests cut between CTAs at any pair, empty and over-capacity
    lengths, a single CTA (no sharing), more CTAs than pairs, several row blocks and KV heads."""
    rng = np.random.default_rng(1234)
    cases = [
        (64, 3, 1, 64, 1, [65, 0, 10**6], None, False, "bfloat16"),
        (64, 37, 1, 16, 1, list(rng.integers(-3, 3000, 37)), None, False, "bfloat16"),
        (128, 37, 1, 128, 1, list(rng.integers(0, 5000, 37)), None, False, "float16"),
        (256, 5, 2, 128, 1, [127, 4096 + 17, 0, 1, 2000], 7, True, "bfloat16"),
        (64, 4, 4, 32, 2, [64 * 7 + 1, 300, 0, 129], 3, True, "bfloat16"),
        (64, 128, 1, 16, 1, [4096] * 128, None, False, "bfloat16"),
        (64, 128, 1, 64, 1, [700 + 3 * i for i in range(128)], None, False, "bfloat16"),
        (64, 2, 1, 64, 1, [8192, 1], None, False, "bfloat16"),
        (64, 9, 1, 16, 1, [0] * 8 + [5000], 300, False, "bfloat16"),
        (128, 6, 1, 64, 2, [1, 128, 129, 0, 3000, 64], 1, False, "bfloat16"),
        (64, 1, 1, 128, 1, [20000], 64, False, "bfloat16"),
        (64, 16, 2, 64, 1, list(rng.integers(1, 2500, 16)), 13, True, "float16"),
        # uniform lengths, about k = ceil(b / P) requests per CTA: the whole-request chunk (no cuts)
        (64, 40, 1, 64, 1, [1000] * 40, 10, False, "bfloat16"),
        (64, 12, 2, 64, 2, [777] * 12, 4, True, "float16"),
        (64, 30, 1, 16, 1, [3000] * 30, 15, False, "bfloat16"),
    ]
    return cases


def _narrow_balanced_cases():
    """The balanced cases with at most 16 packed rows (narrow16_bal) plus ones of its own: two row
    groups (h_kv 2), s_q 2 / 4 causal, a request of one tile, odd tile counts (the two consumer
    warpgroups alternate over the CTA's tiles across items)."""
    rng = np.random.default_rng(4321)
    own = [
        (64, 5, 2, 8, 1, [127, 4096 + 17, 0, 1, 2000], 7, True, "bfloat16"),
        (128, 6, 1, 32, 2, [1, 128, 129, 0, 3000, 64], 1, False, "bfloat16"),
        (64, 1, 1, 16, 1, [20000], 64, False, "bfloat16"),
        (64, 16, 4, 4, 1, list(rng.integers(1, 2500, 16)), 13, True, "float16"),
        (256, 33, 1, 16, 1, list(rng.integers(-3, 9000, 33)), None, False, "float16"),
    ]
    return [("narrow16_bal", c) for c in _balanced_cases() if c[2] * (c[3] // c[4]) <= 16] + \
        [("narrow16_bal", c) for c in own]


def _cp_balanced_cases():
    """The balanced cases on pages of 1, 16 and 32 tokens (no tensor map: seesaw_bal_cp, the cp.async
    producer walking the CTA's items; rows past a request's length are zero-filled by the copies)."""
    return [("seesaw_bal_cp", (PAGES_CP[i % 3], *c[1:])) for i, c in enumerate(_balanced_cases())]


PAGES_CP = (16, 1, 32)


@pytest.mark.parametrize("backend,case", [(bk, c) for bk in ("seesaw_bal",) for c in _balanced_cases()]
                         + _narrow_balanced_cases() + _cp_balanced_cases(),
                         ids=lambda c: c if isinstance(c, str) else f"p{c[0]}-b{c[1]}-s{c[2]}h{c[3]}kv{c[4]}-P{c[6]}")
def test_balanced_grid(backend, case):
    """seesaw_bal / narrow16_bal / seesaw_bal_cp: every CTA takes k whole requests (near-uniform lengths) or an equal
    share of all requests' tile pairs (work_items.cuh); shared requests merge in the CTA that finishes
    last. Every input strided, NaN
    in unused pages, a second launch equal to the first (tickets reset), and a replay with other
    lengths in place."""
    import cupy as cp

    import gqadrv

    page, b, s_q, h_q, h_kv, lens, ctas, causal, dtype = case
    rng = np.random.default_rng(page + b + h_q)
    cap = max(min(max(int(x) for x in lens), 20000), 1)
    q, k, bt, ln = make_case(rng, b, s_q, h_q, h_kv, page, lens, dtype, max_blocks=-(-cap // page))
    dq, dk, dbt = strided_inputs(q, k, bt)
    dl = cp.asarray(ln)
    p = gqadrv.prepare_mla_decode(dq, dk, dbt, dl, 512, causal=causal, num_splits=ctas, backend=backend)
    assert p.route.startswith(f"mla_decode_{backend}_")
    o, lse = gqadrv.launch_prepared(p)
    ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, causal)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, dtype, "balanced")
    o1, l1 = o.copy(), lse.copy()
    gqadrv.launch_prepared(p)
    assert cp.array_equal(o, o1) and cp.array_equal(lse, l1)
    # other lengths in place (each at most the request's filled pages): the schedule follows them
    ln2 = np.array([int(rng.integers(0, min(max(int(x), 0), bt.shape[1] * page) + 1)) for x in ln], np.int32)
    dl.set(ln2)
    gqadrv.launch_prepared(p)
    ro, rl = mla_decode_reference(q, k, bt, ln2, 512, None, causal)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, dtype, "balanced, new lengths")


def test_small_pages_at_large_batch_take_the_balanced_cp_grid():
    """Pages a tensor map cannot describe (here 16 tokens) route to seesaw_bal_cp once the batch fills the
    SMs (b 128 x h_q 64), to the split-grid seesaw below that; both match the oracle, ragged lengths."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(17)
    for b, want in ((128, "seesaw_bal_cp"), (3, "seesaw")):
        lens = list(rng.integers(0, 900, b))
        q, k, bt, ln = make_case(rng, b, 1, 64, 1, 16, lens, "bfloat16")
        p = gqadrv.prepare_mla_decode(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512)
        assert p.route == f"mla_decode_{want}_bfloat16", (b, p.route)
        o, lse = gqadrv.launch_prepared(p)
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, False)
        check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"route {want}")


def test_default_route_is_tma_for_large_pages_only():
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(3)
    for page, want in ((64, "seesaw_tma"), (256, "seesaw_tma"), (32, "seesaw"), (1, "seesaw")):
        q, k, bt, ln = make_case(rng, 2, 1, 64, 1, page, [300, 70], "bfloat16")
        p = gqadrv.prepare_mla_decode(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512)
        assert p.route == f"mla_decode_{want}_bfloat16", (page, p.route)
    with pytest.raises(ValueError, match="TMA-describable"):
        q, k, bt, ln = make_case(rng, 2, 1, 64, 1, 16, [300, 70], "bfloat16")
        gqadrv.prepare_mla_decode(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512,
                                  backend="seesaw_tma")


def test_torch_interop_and_torch_graph():
    torch = pytest.importorskip("torch")
    import gqadrv

    rng, q, k, bt, ln = _graph_case(1, b=2, h_q=16, page=64, L=1500)
    tq = torch.from_numpy(q.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16).cuda()
    tk = torch.from_numpy(k.view(np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16).cuda()
    tbt, tl = torch.from_numpy(bt).cuda(), torch.from_numpy(ln).cuda()
    o, lse = gqadrv.flash_mla_with_kvcache(tq, tk, tbt, tl, 512, causal=False)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ro, rl = mla_decode_reference(q, k, bt, ln, 512)
    check(o.float().cpu().numpy(), lse.cpu().numpy(), ro, rl, "bfloat16", "torch")
    out = torch.empty((2, 1, 16, 512), dtype=torch.bfloat16, device="cuda")
    ls = torch.empty((2, 16, 1), dtype=torch.float32, device="cuda")
    p = gqadrv.prepare_mla_decode(tq, tk, tbt, tl, out=out, lse=ls, stream=torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            gqadrv.launch_prepared(p, torch.cuda.current_stream())
    tl.copy_(torch.tensor([7, 1500], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    ro, rl = mla_decode_reference(q, k, bt, np.array([7, 1500]), 512)
    check(out.float().cpu().numpy(), ls.cpu().numpy(), ro, rl, "bfloat16", "torch graph")


def test_jax_interop():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gqadrv

    rng, q, k, bt, ln = _graph_case(2, b=2, h_q=16, page=32, L=700)
    jq, jk = jnp.asarray(q), jnp.asarray(k)
    o, lse = gqadrv.flash_mla_with_kvcache(jq, jk, jnp.asarray(bt), jnp.asarray(ln), 512)
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array)
    ro, rl = mla_decode_reference(q, k, bt, ln, 512)
    check(np.asarray(o, np.float64), np.asarray(lse), ro, rl, "bfloat16", "jax")


def test_metadata_is_checked_and_sparse_arguments_are_refused():
    import cupy as cp

    import gqadrv

    rng, q, k, bt, ln = _graph_case(3, b=2, h_q=16, page=16, L=100)
    dq, dk, dbt, dl = cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln)
    meta, none = gqadrv.get_mla_metadata(dl, 16, 1)  # FlashMLA's older calling form is accepted
    assert none is None and not meta.have_initialized
    gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, meta)
    assert meta.have_initialized
    with pytest.raises(ValueError, match="tile_scheduler_metadata was initialised"):
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, meta, causal=True)
    with pytest.raises(ValueError, match="sparse MLA path: pass indices"):
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, None, topk_length=dl)
    # a bf16 cache with is_fp8_kvcache=True (the dense FP8 decode exists): the cache's dtype is refused
    with pytest.raises(TypeError, match="k_cache must have dtype .* with is_fp8_kvcache=True"):
        gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, None, is_fp8_kvcache=True)


def test_convenience_calls_allocate_inside_graph_capture():
    """The first convenience calls on a fresh stream inside a CuPy graph capture (global mode): the
    split workspace and the outputs are allocated during the capture (relaxed capture mode for the
    allocation); the replayed graph matches the oracle."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa.reference import gqa_decode_reference

    rng, q, k, bt, ln = _graph_case(7, b=2, h_q=32, page=64, L=1984)
    qg = rng.standard_normal((1, 32, 128)).astype(np.float16)
    kvg = rng.standard_normal((1, 2, 8, 4096, 128)).astype(np.float16)
    lg = np.array([4000], np.int32)
    dq, dk, dbt, dl = cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln)
    dqg, dkvg, dlg = cp.asarray(qg), cp.asarray(kvg), cp.asarray(lg)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        st.begin_capture()
        o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, dl, 512, num_splits=3, stream=st)
        og = gqadrv.gqa_decode(dqg, dkvg, dlg, stream=st)
        g = st.end_capture()
    g.launch(st)
    st.synchronize()
    ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, False)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", "captured convenience call")
    err = np.abs(cp.asnumpy(og).astype(np.float64) - gqa_decode_reference(qg, kvg, lg)).max()
    assert err < 2e-2, err


def _growing_logits_case(rng, b, s_q, h_q, page, lens, dtype, period):
    """make_case with every query head near one direction u and keys that move along u with the token
    position (a rising ramp with a drop every `period` tiles): row maxima jump by several log2 units
    from tile to tile, so the kernels' running-max rescales are taken (and skipped) many times."""
    import ml_dtypes

    q, k, bt, ln = make_case(rng, b, s_q, h_q, 1, page, lens, dtype)
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    u = rng.standard_normal(576) * 0.5
    qf = (u + 0.1 * rng.standard_normal(q.shape)).astype(npdt)
    kf = k.astype(np.float32)
    for i in range(b):
        for p in range(int(min(max(ln[i], 0), bt.shape[1] * page))):
            tile = p // 64
            c = 0.3 * (tile % period) + 0.01 * (p % 64)
            kf[bt[i, p // page], p % page, 0] += c * u
    return qf, kf.astype(npdt), bt, ln


@pytest.mark.parametrize("backend", ["seesaw_bal", "seesaw_tma", "seesaw", "narrow16x2_tma"])
@pytest.mark.parametrize("shape", [(3, 1, 128, [2000, 777, 64 * 31 + 5], False),
                                   (2, 2, 64, [1500, 64 * 9], True)], ids=lambda s: f"b{s[0]}s{s[1]}h{s[2]}")
def test_running_max_jumps(backend, shape):
    """Logits that rise by several log2 units from tile to tile and fall back (see
    _growing_logits_case): every rescale of the running max (and every skipped one) must keep out and
    lse equal to the oracle."""
    import cupy as cp

    import gqadrv

    b, s_q, h_q, lens, causal = shape
    if backend == "narrow16x2_tma":
        h_q = 16 // s_q
    rng = np.random.default_rng(b * 7 + h_q)
    q, k, bt, ln = _growing_logits_case(rng, b, s_q, h_q, 64, lens, "bfloat16", period=11)
    dq, dk, dbt = strided_inputs(q, k, bt)
    p = gqadrv.prepare_mla_decode(dq, dk, dbt, cp.asarray(ln), 512, causal=causal, backend=backend,
                                  num_splits=None if backend.endswith("_bal") else 2)
    assert p.route.startswith(f"mla_decode_{backend}_")
    o, lse = gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, causal)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"max jumps {backend}")
