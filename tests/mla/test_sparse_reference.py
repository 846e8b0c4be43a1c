"""The float64 references of DeepSeek sparse attention (gqadrv/mla/sparse_reference.py) against a
direct per-row, per-key loop, and their edge rules: every kind of invalid index, duplicates,
topk_length, attention sinks of +-inf, rows without keys, NaN in unreferenced KV rows, the varlen
batch form against per-request runs, decode with the extra pool against the prefill form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gqadrv.mla.sparse_reference import attend_rows, sparse_decode_reference, sparse_prefill_reference, valid_index_mask

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
BAD = (INT_MIN, -123456, -1, INT_MAX)


def direct(q, kv_rows, index_lists, scale, d_v, sink=None):
    """Per row and head: plain Python float64 over the listed key rows (None = invalid)."""
    s_q, h_q, _ = q.shape
    out = np.zeros((s_q, h_q, d_v))
    mx = np.full((s_q, h_q), -math.inf)
    lse = np.full((s_q, h_q), math.inf)
    for i in range(s_q):
        keys = [kv_rows[j] for j in index_lists[i] if j is not None]
        if not keys:
            continue
        for h in range(h_q):
            p = [scale * float(np.dot(q[i, h].astype(np.float64), k.astype(np.float64))) for k in keys]
            m = max(p)
            tot = sum(math.exp(x - m) for x in p)
            mx[i, h], lse[i, h] = m, m + math.log(tot)
            o = sum(math.exp(x - lse[i, h]) * k[:d_v].astype(np.float64) for x, k in zip(p, keys))
            if sink is not None:
                sk = float(sink[h])
                o = o * (0.0 if sk == math.inf else 1.0 if sk == -math.inf else 1.0 / (1.0 + math.exp(sk - lse[i, h])))
            out[i, h] = o
    return out, mx, lse


def _case(rng, s_q=6, h_q=3, s_kv=40, topk=12, d_qk=576, d_v=512):
    q = (rng.standard_normal((s_q, h_q, d_qk)) * 0.3).astype(np.float32)
    kv = (rng.standard_normal((s_kv, 1, d_qk)) * 0.3).astype(np.float32)
    idx = rng.integers(0, s_kv, size=(s_q, 1, topk)).astype(np.int64)
    for i in range(s_q):  # every kind of invalid index, and a duplicate
        idx[i, 0, i % topk] = BAD[i % len(BAD)]
        idx[i, 0, (i + 3) % topk] = s_kv + i
        idx[i, 0, (i + 5) % topk] = idx[i, 0, (i + 6) % topk]
    used = set(int(j) for j in idx.ravel() if 0 <= j < s_kv)
    for j in range(s_kv):
        if j not in used:
            kv[j] = np.nan  # never read
    return q, kv, idx.astype(np.int64), d_v


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("with_len", [False, True])
def test_prefill_reference_matches_direct_loop(with_sink, with_len):
    rng = np.random.default_rng(3 + 2 * with_sink + with_len)
    q, kv, idx, d_v = _case(rng)
    s_q, h_q, topk = q.shape[0], q.shape[1], idx.shape[-1]
    sink = np.array([np.inf, -np.inf, 0.7], np.float32) if with_sink else None
    lens = rng.integers(0, topk + 3, size=s_q) if with_len else None
    out, mx, lse = sparse_prefill_reference(q, kv, idx.astype(np.int32), 0.5, d_v, sink, lens)
    lists = [[int(j) if 0 <= j < kv.shape[0] and (lens is None or p < min(lens[i], topk)) else None
              for p, j in enumerate(idx[i, 0])] for i in range(s_q)]
    ro, rm, rl = direct(q, kv[:, 0], lists, 0.5, d_v, sink)
    assert out.shape == (s_q, h_q, d_v) and mx.shape == lse.shape == (s_q, h_q)
    np.testing.assert_allclose(out, ro, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(mx, rm, rtol=1e-12)
    np.testing.assert_allclose(lse, rl, rtol=1e-12)
    assert np.isfinite(out).all()
    if with_sink:
        assert (out[:, 0] == 0).all()  # +inf sink
        _, _, lse0 = sparse_prefill_reference(q, kv, idx, 0.5, d_v, None, lens)
        np.testing.assert_array_equal(lse, lse0)  # lse without the sink


def test_rows_without_a_valid_key():
    rng = np.random.default_rng(5)
    q, kv, idx, d_v = _case(rng, s_q=3)
    idx[1, 0, :] = -1
    idx[2, 0, :] = np.array([INT_MIN, INT_MAX, kv.shape[0]] * 4)
    out, mx, lse = sparse_prefill_reference(q, kv, idx, 0.5, d_v, np.zeros(q.shape[1], np.float32), [12, 12, 12])
    for i in (1, 2):
        assert (out[i] == 0).all() and np.isneginf(mx[i]).all() and np.isposinf(lse[i]).all()
    out0, mx0, lse0 = sparse_prefill_reference(q, kv, idx, 0.5, d_v, topk_length=[0, 5, 7])
    assert (out0[0] == 0).all() and np.isposinf(lse0[0]).all() and np.isneginf(mx0[0]).all()


def test_varlen_equals_per_request_runs():
    rng = np.random.default_rng(11)
    sq, skv = [3, 0, 5], [20, 7, 13]
    qs, kvs, idxs = [], [], []
    for a, k in zip(sq, skv):
        q, kv, idx, d_v = _case(rng, s_q=max(a, 1), s_kv=k, topk=8)
        qs.append(q[:a]), kvs.append(kv), idxs.append(idx[:a])
    cq, ck = np.cumsum([0] + sq), np.cumsum([0] + skv)
    out, mx, lse = sparse_prefill_reference(np.concatenate(qs), np.concatenate(kvs), np.concatenate(idxs), 0.3, d_v,
                                            cu_seqlens_q=cq, cu_seqlens_kv=ck)
    for r in range(3):
        if sq[r] == 0:
            continue
        o, m, l = sparse_prefill_reference(qs[r], kvs[r], idxs[r], 0.3, d_v)
        sl = slice(cq[r], cq[r + 1])
        np.testing.assert_array_equal(out[sl], o)
        np.testing.assert_array_equal(lse[sl], l)
        np.testing.assert_array_equal(mx[sl], m)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_prefill_reference(qs[0], kvs[0], idxs[0], 0.3, d_v, cu_seqlens_q=[0, 3])


def test_decode_with_extra_pool_equals_the_prefill_form():
    rng = np.random.default_rng(17)
    b, s_q, h_q, d_qk, page = 2, 3, 4, 576, 5
    k = (rng.standard_normal((6, page, 1, d_qk)) * 0.3).astype(np.float32)
    ek = (rng.standard_normal((4, page, 1, d_qk)) * 0.3).astype(np.float32)
    q = (rng.standard_normal((b, s_q, h_q, d_qk)) * 0.3).astype(np.float32)
    idx = rng.integers(-2, 6 * page + 2, size=(b, s_q, 9))
    eidx = rng.integers(-2, 4 * page + 2, size=(b, s_q, 4))
    sink = np.array([0.1, np.inf, -np.inf, -0.4])
    out, lse = sparse_decode_reference(q, k, idx, None, 512, sink, [7, 2], ek, eidx, [4, 1])
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    flat, eflat = k.reshape(-1, d_qk), ek.reshape(-1, d_qk)
    for bi in range(b):
        for si in range(s_q):
            keys, valid = [], []
            for p, j in enumerate(idx[bi, si]):
                ok = 0 <= j < flat.shape[0] and p < [7, 2][bi]
                keys.append(flat[j] if ok else np.zeros(d_qk)), valid.append(ok)
            for p, j in enumerate(eidx[bi, si]):
                ok = 0 <= j < eflat.shape[0] and p < [4, 1][bi]
                keys.append(eflat[j] if ok else np.zeros(d_qk)), valid.append(ok)
            o, _, l = attend_rows(q[bi, si][None], np.array(keys)[None], np.array(valid)[None], d_qk ** -0.5, 512, sink)
            np.testing.assert_allclose(out[bi, si], o[0], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(lse[bi, :, si], l[0], rtol=1e-12)


def test_valid_index_mask():
    m = valid_index_mask(np.array([[0, 4, 5, -1, INT_MIN, INT_MAX, 3]]), 5, [5])
    assert m.tolist() == [[True, True, False, False, False, False, False]]
