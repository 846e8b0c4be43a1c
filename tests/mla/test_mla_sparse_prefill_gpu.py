"""Sparse MLA prefill (``flash_mla_sparse_fwd``) on the GPU against a float64 oracle.

Grid (FlashMLA §5.4's spirit, 286 cases): d_qk {576, 512} x h_q {1, 16, 64, 128} x irregular
(s_kv, topk) {(128,128), (592,128), (1840,256), (1592,384), (95,128), (153,256), (114,384)} x s_q
{1, 62, 213} (168 cases); the same pairs x s_q {62, 213} x attn_sink x topk_length x d_qk with h_q 64 /
128 (112 cases); corners (blocks without any valid index, every row invalid, topk 1 and 37). Data:
q, kv ~ N(0,1)/10 + a uniform offset, sm_scale 0.5 (not the default); indices = a random permutation
of [0, s_kv) cut or padded to topk, with 1 in 7 replaced by an invalid value of every kind (INT_MIN,
-123456, -1, s_kv, 114514, 2147480000, INT_MAX); kv rows no index names are NaN; q and kv are
strided views (a wider last dimension). Sinks hold +inf and -inf entries; topk_length ~ U[0, topk].
The oracle is ``gqadrv.mla.sparse_reference``'s math in float64 on the GPU (CuPy), checked against
the numpy reference itself on small cases. Also: the varlen batch form against per-request calls,
s_q = 70000 (several dense launches), the prepared form under a CuPy graph with indices changed in
place, and the contract errors raised before any launch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.helpers import record_error

pytestmark = pytest.mark.gpu

PAIRS = ((128, 128), (592, 128), (1840, 256), (1592, 384), (95, 128), (153, 256), (114, 384))
BAD = (-(2**31), -123456, -1, None, 114514, 2147480000, 2**31 - 1)  # None: s_kv itself
SCALE = 0.5


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    idx: int
    d_qk: int
    h_q: int
    s_kv: int
    topk: int
    s_q: int
    sink: bool = False
    topk_length: bool = False
    invalid_rows: float = 0.0   # fraction of query tokens whose indices are all invalid

    @property
    def label(self) -> str:
        return (f"{self.idx}:d{self.d_qk}h{self.h_q}kv{self.s_kv}k{self.topk}s{self.s_q}"
                f"{'S' if self.sink else ''}{'L' if self.topk_length else ''}{'I' if self.invalid_rows else ''}")


def grid() -> list[PrefillCase]:
    out = []
    for d in (576, 512):
        for h in (1, 16, 64, 128):
            for s_kv, topk in PAIRS:
                for s_q in (1, 62, 213):
                    out.append(PrefillCase(len(out), d, h, s_kv, topk, s_q))
    for n, (s_kv, topk) in enumerate(PAIRS):
        for s_q in (62, 213):
            for sink in (False, True):
                for tl in (False, True):
                    for d in (576, 512):
                        out.append(PrefillCase(len(out), d, 64 if (n + s_q) % 2 else 128, s_kv, topk, s_q, sink, tl))
    out += [PrefillCase(len(out), 576, 128, 32, 2048, 1), PrefillCase(len(out) + 1, 512, 64, 64, 8192, 5),
            PrefillCase(len(out) + 2, 576, 64, 256, 256, 40, invalid_rows=0.3),
            PrefillCase(len(out) + 3, 512, 128, 128, 128, 17, True, True, invalid_rows=1.0),
            PrefillCase(len(out) + 4, 576, 3, 300, 1, 50, True, True), PrefillCase(len(out) + 5, 512, 100, 300, 37, 9)]
    return out


def make_inputs(rng, c: PrefillCase):
    """Host arrays: q [s_q, h_q, d] bf16, kv [s_kv, 1, d] bf16 (unreferenced rows NaN), indices int32
    [s_q, 1, topk], sink, topk_length."""
    import ml_dtypes

    off = rng.uniform(-0.05, 0.05)
    q = np.clip(rng.standard_normal((c.s_q, c.h_q, c.d_qk)) / 10 + off, -10, 10).astype(ml_dtypes.bfloat16)
    kv = np.clip(rng.standard_normal((c.s_kv, 1, c.d_qk)) / 10 + off, -10, 10).astype(ml_dtypes.bfloat16)
    idx = np.empty((c.s_q, 1, c.topk), np.int32)
    for t in range(c.s_q):
        perm = rng.permutation(c.s_kv)[: c.topk]
        row = np.full(c.topk, -1, np.int64)
        row[: perm.size] = perm
        bad = rng.random(c.topk) < 1 / 7
        kinds = rng.integers(0, len(BAD), size=c.topk)
        row[bad] = [c.s_kv if BAD[k] is None else BAD[k] for k in kinds[bad]]
        if rng.random() < c.invalid_rows:
            row[:] = [c.s_kv if BAD[k] is None else BAD[k] for k in kinds]
        idx[t, 0] = row
    tl = rng.integers(0, c.topk + 1, size=c.s_q).astype(np.int32) if c.topk_length else None
    used = np.zeros(c.s_kv, bool)
    for t in range(c.s_q):
        r = idx[t, 0].astype(np.int64)
        n = c.topk if tl is None else int(tl[t])
        r = r[:n]
        used[r[(r >= 0) & (r < c.s_kv)]] = True
    kv[~used] = np.nan
    sink = None
    if c.sink:
        sink = rng.standard_normal(c.h_q).astype(np.float32)
        sel = rng.random(c.h_q)
        sink[sel < 0.31] = np.inf
        sink[sel > 0.69] = -np.inf
    return q, kv, idx, sink, tl


def oracle(q, kv, idx, scale, sink=None, tl=None, cu_q=None, cu_kv=None):
    """sparse_reference's math in float64 with CuPy: (out, max_logits, lse) as numpy arrays."""
    import cupy as cp

    s_q, s_kv = q.shape[0], kv.shape[0]
    i = cp.asarray(idx[:, 0, :].astype(np.int64))
    if cu_q is None:
        base = cp.zeros(s_q, cp.int64)
        rows = cp.full(s_q, s_kv, cp.int64)
    else:
        cq, ck = np.asarray(cu_q, np.int64), np.asarray(cu_kv, np.int64)
        req = np.searchsorted(cq, np.arange(s_q), side="right") - 1
        base, rows = cp.asarray(ck[req]), cp.asarray((ck[1:] - ck[:-1])[req])
    valid = (i >= 0) & (i < rows[:, None])
    if tl is not None:
        valid &= cp.arange(i.shape[1])[None, :] < cp.asarray(np.clip(tl.astype(np.int64), 0, i.shape[1]))[:, None]
    g = cp.where(valid, i + base[:, None], 0)
    k = cp.asarray(kv[:, 0, :].astype(np.float64))[g]                       # [s_q, topk, d]
    k = cp.where(valid[..., None], k, 0.0)
    qq = cp.asarray(q.astype(np.float64))
    p = cp.einsum("rhd,rnd->rhn", qq, k) * scale
    p = cp.where(valid[:, None, :], p, -cp.inf)
    has = valid.any(axis=1)[:, None]
    m = cp.where(has, p.max(axis=-1), -cp.inf)
    ms = cp.where(has, m, 0.0)
    w = cp.where(valid[:, None, :], cp.exp(p - ms[..., None]), 0.0)
    lsum = w.sum(-1)
    lse = cp.where(has, ms + cp.log(cp.where(has, lsum, 1.0)), cp.inf)
    out = cp.einsum("rhn,rnd->rhd", w, k[..., :512]) / cp.where(has, lsum, 1.0)[..., None]
    out = cp.where(has[..., None], out, 0.0)
    if sink is not None:
        s = cp.asarray(sink.astype(np.float64))[None, :]
        with np.errstate(all="ignore"):
            f = cp.where(cp.isposinf(s), 0.0, cp.where(cp.isneginf(s), 1.0, 1.0 / (1.0 + cp.exp(s - cp.where(has, lse, 0)))))
        out = out * cp.where(has, f, 0.0)[..., None]
    return cp.asnumpy(out), cp.asnumpy(m), cp.asnumpy(lse)


def _strided(cp, a, pad=64):
    """A device view of ``a`` whose last dimension is contiguous but whose rows are ``pad`` elements
    further apart (padding NaN)."""
    w = cp.full(a.shape[:-1] + (a.shape[-1] + pad,), np.nan, a.dtype)
    w[..., : a.shape[-1]] = cp.asarray(a)
    return w[..., : a.shape[-1]]


def check_prefill(got, ref, label):
    o, mx, lse = (np.asarray(x.get() if hasattr(x, "get") else x, np.float64) for x in got)
    ro, rm, rl = ref
    assert np.all(np.isfinite(o)), f"{label}: non-finite output"
    err = np.abs(o - ro)
    bad = err > 2e-3 + 1e-2 * np.abs(ro)
    assert not bad.any(), f"{label}: {int(bad.sum())} out elements off, max {err.max():.3e}"
    assert np.array_equal(np.isposinf(lse), np.isposinf(rl)), f"{label}: lse +inf mismatch"
    assert np.array_equal(np.isneginf(mx), np.isneginf(rm)), f"{label}: max_logits -inf mismatch"
    fin = np.isfinite(rl)
    le = np.abs(lse[fin] - rl[fin]).max() if fin.any() else 0.0
    me = np.abs(mx[fin] - rm[fin]).max() if fin.any() else 0.0
    assert le <= 1e-4 + 1e-5 * np.abs(rl[fin]).max(initial=0) and me <= 1e-4 + 1e-5 * np.abs(rm[fin]).max(initial=0), \
        f"{label}: lse off by {le:.3e}, max_logits by {me:.3e}"
    record_error(f"mla sparse prefill {label} out", float(err.max()) if err.size else 0.0)
    record_error(f"mla sparse prefill {label} lse", float(le))
    record_error(f"mla sparse prefill {label} max_logits", float(me))


@pytest.mark.parametrize("case", grid(), ids=lambda c: c.label)
def test_prefill_oracle_grid(case):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(500 + case.idx)
    q, kv, idx, sink, tl = make_inputs(rng, case)
    got = gqadrv.flash_mla_sparse_fwd(_strided(cp, q), _strided(cp, kv), cp.asarray(idx), SCALE,
                                      attn_sink=None if sink is None else cp.asarray(sink),
                                      topk_length=None if tl is None else cp.asarray(tl))
    assert got[0].shape == (case.s_q, case.h_q, 512) and got[1].shape == got[2].shape == (case.s_q, case.h_q)
    check_prefill(got, oracle(q, kv, idx, SCALE, sink, tl), case.label)
    again = gqadrv.flash_mla_sparse_fwd(_strided(cp, q), _strided(cp, kv), cp.asarray(idx), SCALE,
                                        attn_sink=None if sink is None else cp.asarray(sink),
                                        topk_length=None if tl is None else cp.asarray(tl))
    for a, b in zip(got, again):
        assert cp.array_equal(a, b, equal_nan=True), f"{case.label}: not deterministic"


@pytest.mark.parametrize("d_qk,h_q,want", [(576, 64, "seesaw_bal_cp"), (512, 128, "seesaw_nope_bal"),
                                            (576, 16, "seesaw_bal_cp")])
def test_many_query_tokens_take_the_balanced_grid_without_partials(d_qk, h_q, want):
    """A prefill whose rows fill the SMs runs the dense kernel on the balanced persistent grid with
    FLAG_NO_CUT (every row's list on one CTA, so the workspace holds no partial slots) and applies the
    attention sink in its epilogue (FLAG_SINK: two launches, no finish pass); ragged valid
    counts (topk_length, invalid indices, rows without any valid index) against the oracle, twice."""
    import cupy as cp

    import gqadrv
    from gqadrv.mla import kernel_spec as ks

    c = PrefillCase(0, d_qk, h_q, 1840, 256, 701, sink=True, topk_length=True, invalid_rows=0.05)
    q, kv, idx, sink, tl = make_inputs(np.random.default_rng(77 + h_q), c)
    dq, dkv, di, ds, dt = (cp.asarray(a) for a in (q, kv, idx, sink, tl))
    p = gqadrv.prepare_mla_sparse_fwd(dq, dkv, di, SCALE, attn_sink=ds, topk_length=dt)
    assert p.route == f"mla_sparse_prefill+mla_decode_{want}_bfloat16", p.route
    assert len(p.plans) == 2, p.plans  # gather + dense: the sink is applied in the dense epilogue, no finish pass
    nmb = ks.num_m_blocks(1, h_q, 1, want)
    one_partial = ks.BLOCK_M * ks.D_V * 4
    assert ks.workspace_sizes(c.s_q, 1, h_q, 1, p.num_splits, want, no_cut=True)["ws_o"] == 0
    assert p.workspace_bytes < one_partial * nmb + c.s_q * (c.topk * 4 + 64) + 4096 * 1024, p.workspace_bytes
    ref = oracle(q, kv, idx, SCALE, sink, tl)
    for rep in range(2):
        gqadrv.launch_prepared(p)
        check_prefill(p.output, ref, f"balanced {want} launch {rep}")


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("s_q", [3, 701])
def test_max_logits_stay_exact_when_the_running_max_moves(d_qk, s_q):
    """Logits spanning ~100 (log2 units) along each token's list, rising for even tokens (the kernels' lazy
    running max moves many times), falling for odd ones (it never moves after the first tile): max_logits
    must be the exact maximum the oracle gives, lse and out within the grid's tolerances. s_q 701 runs the
    balanced grid (lazy max, exact max tracked beside it), s_q 3 the split grid."""
    import cupy as cp
    import ml_dtypes

    import gqadrv

    rng = np.random.default_rng(900 + s_q + d_qk)
    h_q, s_kv, topk = 64, 1024, 512
    q = (0.5 + rng.standard_normal((s_q, h_q, d_qk)) / 10).astype(ml_dtypes.bfloat16)
    ramp = np.linspace(0.0, 0.5, s_kv)[:, None, None]
    kv = (ramp + rng.standard_normal((s_kv, 1, d_qk)) / 10).astype(ml_dtypes.bfloat16)
    idx = np.empty((s_q, 1, topk), np.int32)
    for t in range(s_q):
        pick = np.sort(rng.permutation(s_kv)[:topk])
        idx[t, 0] = pick if t % 2 == 0 else pick[::-1]
    ref = oracle(q, kv, idx, SCALE)
    assert float(ref[1].min()) > 40.0, float(ref[1].min())  # the lists' last tiles reach logits of ~70
    got = gqadrv.flash_mla_sparse_fwd(cp.asarray(q), cp.asarray(kv), cp.asarray(idx), SCALE)
    check_prefill(got, ref, f"moving max d{d_qk} s_q{s_q}")
    mx = np.asarray(got[1].get(), np.float64)
    me = float(np.abs(mx - ref[1]).max())
    assert me <= 1e-5 * float(np.abs(ref[1]).max()) + 1e-6, f"max_logits off by {me:.3e}"


def test_gpu_oracle_matches_the_numpy_reference():
    from gqadrv.mla.sparse_reference import sparse_prefill_reference

    for c in (PrefillCase(0, 576, 3, 95, 128, 5, True, True), PrefillCase(1, 512, 2, 40, 37, 4),
              PrefillCase(2, 576, 2, 30, 16, 3, invalid_rows=1.0)):
        q, kv, idx, sink, tl = make_inputs(np.random.default_rng(c.idx), c)
        ref = sparse_prefill_reference(q, kv, idx, SCALE, 512, sink, tl)
        got = oracle(q, kv, idx, SCALE, sink, tl)
        for a, b in zip(got, ref):
            assert np.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_varlen_batch_equals_per_request_calls(d_qk):
    """cu_seqlens form: 4 requests (one with no query token, one with no KV row), request-relative
    indices; matches the oracle and each request called alone on its own slice of kv."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(3)
    nq, nk = [5, 0, 33, 12], [200, 70, 0, 333]
    cu_q, cu_kv = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32), np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    c = PrefillCase(0, d_qk, 16, int(cu_kv[-1]), 96, int(cu_q[-1]))
    q, kv, _, sink, _ = make_inputs(rng, c)
    kv = np.where(np.isnan(kv.astype(np.float32)), 0, kv).astype(kv.dtype)
    idx = np.empty((c.s_q, 1, c.topk), np.int32)
    for i in range(4):
        for t in range(cu_q[i], cu_q[i + 1]):
            idx[t, 0] = rng.integers(-3, nk[i] + 3, size=c.topk)
    sink = rng.standard_normal(16).astype(np.float32)
    args = {"attn_sink": cp.asarray(sink), "cu_seqlens_q": cp.asarray(cu_q), "cu_seqlens_kv": cp.asarray(cu_kv)}
    got = gqadrv.flash_mla_sparse_fwd(cp.asarray(q), cp.asarray(kv), cp.asarray(idx), SCALE, **args)
    check_prefill(got, oracle(q, kv, idx, SCALE, sink, None, cu_q, cu_kv), f"varlen d{d_qk}")
    for i in range(4):
        if nq[i] == 0:
            continue
        sl = slice(int(cu_q[i]), int(cu_q[i + 1]))
        kv_i = kv[cu_kv[i]: cu_kv[i + 1]] if nk[i] else np.full((1, 1, d_qk), np.nan, kv.dtype)
        idx_i = idx[sl] if nk[i] else np.full_like(idx[sl], -1)
        one = gqadrv.flash_mla_sparse_fwd(cp.asarray(q[sl]), cp.asarray(kv_i), cp.asarray(idx_i), SCALE,
                                          attn_sink=cp.asarray(sink))
        for a, b in zip(one, got):  # the split count may differ with the row count: not bitwise
            a, b = cp.asnumpy(a).astype(np.float64), cp.asnumpy(b[sl]).astype(np.float64)
            assert np.array_equal(np.isinf(a), np.isinf(b)), f"request {i}: inf pattern differs from its own call"
            fin = np.isfinite(a)
            assert np.allclose(a[fin], b[fin], rtol=1e-2, atol=2e-3), f"request {i} differs from its own call"


def test_seventy_thousand_query_tokens():
    """s_q 70000 > 65535 (the dense grid's z limit): two dense launches; rows on both sides of the
    chunk boundary checked against the oracle (data drawn on the GPU)."""
    import cupy as cp

    import gqadrv

    s_q, h_q, s_kv = 70000, 16, 256
    g = cp.random.default_rng(9)
    q = (g.standard_normal((s_q, h_q, 576), dtype=cp.float32) / 10).astype("bfloat16")
    kv = (g.standard_normal((s_kv, 1, 576), dtype=cp.float32) / 10).astype("bfloat16")
    perms = cp.asarray(np.stack([np.random.default_rng(i).permutation(s_kv) for i in range(64)]).astype(np.int32))
    idx = perms[cp.arange(s_q) % 64][:, None, :]
    got = gqadrv.flash_mla_sparse_fwd(q, kv, idx, SCALE)
    rows = np.r_[0:3, 65530:65540, 69997:70000]
    r = cp.asarray(rows)
    ref = oracle(cp.asnumpy(q[r]), cp.asnumpy(kv), cp.asnumpy(idx[r]), SCALE)
    check_prefill(tuple(x[r] for x in got), ref, "s_q 70000")


def test_prepared_graph_follows_indices_in_place():
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(11)
    c = PrefillCase(0, 576, 64, 300, 128, 30, sink=True, topk_length=True)
    q, kv, idx, sink, tl = make_inputs(rng, c)
    kv = np.where(np.isnan(kv.astype(np.float32)), 0, kv).astype(kv.dtype)
    dq, dkv, di, ds, dt = (cp.asarray(a) for a in (q, kv, idx, sink, tl))
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_mla_sparse_fwd(dq, dkv, di, SCALE, attn_sink=ds, topk_length=dt, stream=st)
    with st:
        st.begin_capture()
        gqadrv.launch_prepared(p, stream=st)
        g = st.end_capture()
    for step in range(3):
        if step:
            idx = rng.integers(-5, 305, size=idx.shape).astype(np.int32)
            tl = rng.integers(0, 129, size=tl.shape).astype(np.int32)
            tl[0] = 0
            di.set(idx, stream=st)
            dt.set(tl, stream=st)
        g.launch(st)
        st.synchronize()
        check_prefill(p.output, oracle(q, kv, idx, SCALE, sink, tl), f"graph step {step}")


def test_prefill_contract_errors():
    import cupy as cp

    import gqadrv

    f = gqadrv.flash_mla_sparse_fwd
    q = cp.zeros((4, 16, 576), "bfloat16")
    kv = cp.zeros((50, 1, 576), "bfloat16")
    idx = cp.zeros((4, 1, 32), cp.int32)
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        f(q.astype(cp.float16), kv, idx, 0.1)
    with pytest.raises(ValueError, match="d_qk 576 or 512"):
        f(cp.zeros((4, 16, 128), "bfloat16"), kv, idx, 0.1)
    with pytest.raises(ValueError, match=r"kv must have shape \[s_kv, 1, 576\]"):
        f(q, cp.zeros((50, 1, 512), "bfloat16"), idx, 0.1)
    with pytest.raises(ValueError, match=r"indices must have shape \[4, 1, topk"):
        f(q, kv, cp.zeros((4, 2, 32), cp.int32), 0.1)
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        f(q, kv, idx.astype(cp.int64), 0.1)
    with pytest.raises(TypeError, match="sm_scale is required"):
        f(q, kv, idx, None)
    with pytest.raises(ValueError, match="sm_scale"):
        f(q, kv, idx, -1.0)
    with pytest.raises(ValueError, match="d_v must be 512"):
        f(q, kv, idx, 0.1, 576)
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(16,\)"):
        f(q, kv, idx, 0.1, attn_sink=cp.zeros(15, cp.float32))
    with pytest.raises(ValueError, match=r"topk_length must have shape \(4,\)"):
        f(q, kv, idx, 0.1, topk_length=cp.zeros(3, cp.int32))
    with pytest.raises(ValueError, match="go together"):
        f(q, kv, idx, 0.1, cu_seqlens_q=cp.zeros(2, cp.int32))
    with pytest.raises(ValueError, match="h_q must be in"):
        f(cp.zeros((4, 129, 576), "bfloat16"), kv, idx, 0.1)
    with pytest.raises(ValueError, match="d_qk 512 is served by"):
        f(cp.zeros((4, 16, 512), "bfloat16"), cp.zeros((50, 1, 512), "bfloat16"), idx, 0.1, backend="wgmma")
