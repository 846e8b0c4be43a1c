"""Small host cases of the sparse MLA prefill (``flash_mla_sparse_fwd``) shared by
test_integrations_sparse_prefill_host.py (tiny sizes) and test_sparse_prefill_gpu.py, and their float64
oracle (gqadrv.mla.sparse_reference.sparse_prefill_reference).

A case: q bf16 [s_q, h_q, d_qk] and kv bf16 [s_kv, 1, d_qk] ~ N(0, 1) (d_qk 576 or 512), indices int32
[s_q, 1, topk]. The last ``spare`` KV rows hold NaN bits (0xFFFF) and only positions past
``topk_length`` name them (or none, without topk_length): a kernel that reads beyond the counted
positions produces NaN. Counted positions name distinct live rows, about a quarter of them replaced
by invalid values of every kind (-1, INT_MIN, -7, s_kv, s_kv + 5, INT_MAX), which are skipped;
query token 3 has only invalid indices (out 0, max_logits -inf, lse +inf). ``attn_sink`` holds +inf
(head 0: out 0), -inf (head 1: no effect) and finite values near the LSE. ``topk_length`` has a 0
(token 5: no key either) and a value past topk (clamped).

The varlen form (``build_varlen``): three requests with 7, 0 and s_q - 7 query tokens over 2/5, 4/15
and the rest of the KV rows (120, 80, 100 for s_kv 300); each token's indices are request-relative (0 .. its request's rows - 1), with
values past the request's rows (but inside kv) among the invalid ones.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from gqadrv.mla.sparse_reference import sparse_prefill_reference
from tests.helpers import record_error

BF16 = np.dtype(ml_dtypes.bfloat16)
D_V = 512
S_Q, S_KV, TOPK, SPARE = 20, 300, 100, 20   # the GPU tests' sizes
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
DEAD_TOKEN, EMPTY_TOKEN = 3, 5              # all indices invalid / topk_length 0
OPTIONAL = ("attn_sink", "topk_length", "cu_seqlens_q", "cu_seqlens_kv")
OUT_TOL, STAT_TOL = 2e-2, 1e-3              # out (bf16) abs; max_logits / lse abs


@dataclasses.dataclass
class PrefillHost:
    q: np.ndarray                           # bf16 [s_q, h_q, d_qk]
    kv: np.ndarray                          # bf16 [s_kv, 1, d_qk], the last SPARE rows NaN
    indices: np.ndarray                     # int32 [s_q, 1, topk]
    sm_scale: float
    spare: int
    attn_sink: np.ndarray | None = None     # float32 [h_q]
    topk_length: np.ndarray | None = None   # int32 [s_q]
    cu_seqlens_q: np.ndarray | None = None  # int32 [n + 1]
    cu_seqlens_kv: np.ndarray | None = None

    @property
    def s_q(self) -> int:
        return int(self.q.shape[0])

    @property
    def h_q(self) -> int:
        return int(self.q.shape[1])

    @property
    def d_qk(self) -> int:
        return int(self.q.shape[2])

    @property
    def s_kv(self) -> int:
        return int(self.kv.shape[0])

    def arrays(self) -> dict:
        """The optional keyword arrays this case passes (host), in OPTIONAL order."""
        return {n: getattr(self, n) for n in OPTIONAL if getattr(self, n) is not None}

    def reference(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float64 (out [s_q, h_q, 512], max_logits [s_q, h_q], lse [s_q, h_q]) of the current arrays."""
        return sparse_prefill_reference(self.q, self.kv, self.indices, self.sm_scale, D_V, self.attn_sink,
                                        self.topk_length, self.cu_seqlens_q, self.cu_seqlens_kv)


def _kv(rng, s_kv: int, d_qk: int, spare: int) -> np.ndarray:
    kv = rng.standard_normal((s_kv, 1, d_qk)).astype(np.float32).astype(BF16)
    bits = kv.view(np.uint16).copy()
    bits[s_kv - spare:] = 0xFFFF
    return bits.view(BF16)


def _row(rng, live: np.ndarray, spare_rows: np.ndarray, rows: int, topk: int, n: int) -> np.ndarray:
    """One token's indices: n counted positions naming distinct live rows (some invalid), the rest
    naming spare (NaN) rows or -1."""
    invalid = np.array([-1, INT_MIN, -7, rows, rows + 5, INT_MAX], np.int64)
    row = rng.choice(spare_rows, size=topk) if spare_rows.size else np.full(topk, -1, np.int64)
    row[rng.random(topk) < 0.3] = -1
    row[:n] = rng.choice(live, size=n, replace=n > live.size)
    bad = rng.random(n) < 0.25
    row[:n][bad] = invalid[rng.integers(0, invalid.size, size=int(bad.sum()))]
    return row


def _lengths(rng, s_q: int, topk: int) -> np.ndarray:
    tl = rng.integers(topk // 2, topk + 1, size=s_q).astype(np.int32)
    tl[EMPTY_TOKEN] = 0
    tl[-1] = topk + 7   # clamped to topk
    return tl


def _indices(rng, s_q: int, s_kv: int, topk: int, spare: int, tl: np.ndarray | None) -> np.ndarray:
    live = np.arange(s_kv - spare)
    spare_rows = np.arange(s_kv - spare, s_kv) if tl is not None else np.arange(0)
    idx = np.zeros((s_q, 1, topk), np.int64)
    for t in range(s_q):
        n = topk if tl is None else min(int(tl[t]), topk)
        idx[t, 0] = _row(rng, live, spare_rows, s_kv, topk, n)
    invalid = np.array([-1, INT_MIN, -7, s_kv, s_kv + 5, INT_MAX], np.int64)
    idx[DEAD_TOKEN, 0] = invalid[np.arange(topk) % invalid.size]
    return idx.astype(np.int32)


def _sink(rng, h_q: int) -> np.ndarray:
    s = (rng.standard_normal(h_q) * 1.5 + 4.0).astype(np.float32)
    s[0], s[1] = np.inf, -np.inf
    return s


def build(d_qk: int, h_q: int, seed: int, *, sink: bool = True, lengths: bool = True, s_q: int = S_Q,
          s_kv: int = S_KV, topk: int = TOPK, spare: int = SPARE, sm_scale: float | None = None) -> PrefillHost:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((s_q, h_q, d_qk)).astype(np.float32).astype(BF16)
    kv = _kv(rng, s_kv, d_qk, spare)
    tl = _lengths(rng, s_q, topk) if lengths else None
    idx = _indices(rng, s_q, s_kv, topk, spare, tl)
    scale = d_qk ** -0.5 if sm_scale is None else sm_scale
    return PrefillHost(q, kv, idx, scale, spare, _sink(rng, h_q) if sink else None, tl)


def redraw(h: PrefillHost, seed: int) -> dict:
    """New indices, lengths (when the case has them) and sinks (idem) for the same q / kv, set on
    ``h``; returns the arrays that changed (to copy into device tensors in place)."""
    rng = np.random.default_rng(seed)
    changed: dict = {}
    if h.topk_length is not None:
        h.topk_length = changed["topk_length"] = _lengths(rng, h.s_q, h.indices.shape[-1])
    h.indices = changed["indices"] = _indices(rng, h.s_q, h.s_kv, h.indices.shape[-1], h.spare, h.topk_length)
    if h.attn_sink is not None:
        h.attn_sink = changed["attn_sink"] = _sink(rng, h.h_q)
    return changed


def build_varlen(d_qk: int, h_q: int, seed: int, *, s_q: int = S_Q, s_kv: int = S_KV,
                 topk: int = TOPK) -> PrefillHost:
    """Three requests (7, 0, s_q - 7 query tokens; 2/5, 4/15 and the rest of the KV rows),
    request-relative indices, a sink, no topk_length and no NaN rows (every row of a request may be
    named)."""
    rng = np.random.default_rng(seed)
    nq, nk = [7, 0, s_q - 7], [s_kv * 2 // 5, s_kv * 4 // 15, s_kv - s_kv * 2 // 5 - s_kv * 4 // 15]
    cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q = rng.standard_normal((s_q, h_q, d_qk)).astype(np.float32).astype(BF16)
    kv = _kv(rng, s_kv, d_qk, 0)
    idx = np.zeros((s_q, 1, topk), np.int64)
    for i in range(len(nq)):
        for t in range(cu_q[i], cu_q[i + 1]):
            # request-relative rows; rows + 5 and INT_MAX are invalid, and so is nk[i] itself (the next
            # request's first row in kv)
            idx[t, 0] = _row(rng, np.arange(nk[i]), np.arange(0), nk[i], topk, topk)
    return PrefillHost(q, kv, idx.astype(np.int32), d_qk ** -0.5, 0, _sink(rng, h_q), None, cu_q, cu_kv)


def check(got: tuple, ref: tuple, label: str, *, sink_head0_inf: bool = True) -> None:
    """got (out, max_logits, lse) as host arrays vs the float64 oracle: out within 2e-2 (absolute),
    max_logits / lse within 1e-3 (absolute), -inf / +inf exactly where the oracle's row has no key;
    with a +inf sink on head 0, that head's output exactly 0."""
    go, gm, gl = (np.asarray(x).astype(np.float64) for x in got)
    ro, rm, rl = ref
    assert go.shape == ro.shape and gm.shape == rm.shape and gl.shape == rl.shape, (go.shape, gm.shape, gl.shape)
    assert np.all(np.isfinite(go)), f"{label}: non-finite output"
    err = np.abs(go - ro)
    assert err.max() <= OUT_TOL, f"{label}: out off by {err.max():.3e}"
    empty = ~np.isfinite(rl)
    assert np.array_equal(empty, np.isneginf(rm)), f"{label}: oracle rows without keys disagree"
    assert np.array_equal(np.isposinf(gl), empty), f"{label}: lse +inf rows differ"
    assert np.array_equal(np.isneginf(gm), empty), f"{label}: max_logits -inf rows differ"
    stat_err = 0.0
    if (~empty).any():
        for name, g, r in (("max_logits", gm, rm), ("lse", gl, rl)):
            e = np.abs(g[~empty] - r[~empty])
            assert np.all(np.isfinite(g[~empty])) and e.max() <= STAT_TOL, f"{label}: {name} off by {e.max():.3e}"
            stat_err = max(stat_err, float(e.max()))
    if sink_head0_inf:
        assert not go[:, 0].any(), f"{label}: the +inf sink of head 0 must zero its output"
    record_error(f"sparse prefill {label} out", float(err.max()))
    record_error(f"sparse prefill {label} stats", stat_err)
