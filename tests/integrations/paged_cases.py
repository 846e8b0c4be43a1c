"""Inputs and oracles shared by the torch / JAX tests of the paged GQA decode, the contiguous LSE
call and the LSE state merge (host numpy arrays; each framework moves them to its device)."""

from __future__ import annotations

import numpy as np

from gqadrv.gqa.reference import gqa_decode_paged_reference, paged_kv_from_contiguous

B, S_Q, HQ, HKV, D, PAGE, T = 3, 2, 16, 4, 128, 16, 300
PAGED_LENGTHS = ([300, 17, 0], [120, 300, 5], [1, 2, 299])   # changed in place between calls
TOL = 1e-2  # fp16 out (relative + absolute), as the paged grid
LSE_TOL = 2e-3


def paged_inputs(seed: int, *, combined: bool = False):
    """q [B, S_Q, HQ, D] fp16, NHD pools (or one combined pool), block table; every request's pages
    hold T tokens so any length up to T is valid data."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S_Q, HQ, D)).astype(np.float16)
    k = rng.standard_normal((B, T, HKV, D)).astype(np.float16)
    v = rng.standard_normal((B, T, HKV, D)).astype(np.float16)
    mp = -(-T // PAGE)
    kc, vc, bt = paged_kv_from_contiguous(k, v, np.full(B, mp * PAGE if mp * PAGE <= T else T), PAGE,
                                          combined=combined, max_pages=mp, rng=rng, extra_pages=2)
    return q, kc, vc, bt


def fp8_paged_inputs(seed: int):
    """paged_inputs with K / V as e4m3 codes (uint8, NaN poison kept as the NaN code) and per-KV-head
    scales: (q, k codes, v codes, table, k scales [HKV], v scales [HKV], dequantized k, v for the oracle)."""
    from gqadrv.ops.fp8 import e4m3_from_f32, e4m3_to_f32

    q, kc, vc, bt = paged_inputs(seed)
    rng = np.random.default_rng(seed + 1)
    ks = rng.uniform(0.005, 0.02, HKV).astype(np.float32)
    vs = rng.uniform(0.005, 0.02, HKV).astype(np.float32)
    k8 = e4m3_from_f32(kc.astype(np.float32) / ks[:, None])   # NHD [pages, page, HKV, D]
    v8 = e4m3_from_f32(vc.astype(np.float32) / vs[:, None])
    return q, k8, v8, bt, ks, vs, e4m3_to_f32(k8) * ks[:, None], e4m3_to_f32(v8) * vs[:, None]


def paged_ref(q, kc, vc, bt, lengths, q_scale):
    return gqa_decode_paged_reference(q, kc, vc, bt, np.array(lengths, np.int32), q_scale=q_scale)


def check_paged(out, lse, ref, what: str) -> None:
    ro, rl = ref
    err = np.abs(out.astype(np.float64) - ro)
    assert np.all(err <= TOL + TOL * np.abs(ro)), f"{what}: out max err {err.max():.3e}"
    fin = np.isfinite(rl)
    assert np.array_equal(np.isinf(lse), ~fin), f"{what}: +inf lse rows differ"
    if fin.any():
        lerr = np.abs(lse[fin] - rl[fin])
        assert lerr.max() <= LSE_TOL, f"{what}: lse max err {lerr.max():.3e}"


def merge_inputs(seed: int, n: int = 6, k: int = 3, h: int = 4, d: int = 64):
    """k states of the same rows from disjoint key sets: stacked v [n, k, h, d] fp16, s [n, k, h],
    and the float64 (v, s) of their union."""
    rng = np.random.default_rng(seed)
    vs, ss = [], []
    num, den, m = 0.0, 0.0, None
    scores = [rng.standard_normal((n, h, 5 + 3 * i)) for i in range(k)]
    vals = [rng.standard_normal((n, h, 5 + 3 * i, d)) for i in range(k)]
    allsc = np.concatenate(scores, axis=-1)
    m = allsc.max(axis=-1, keepdims=True)
    for sc, vv in zip(scores, vals):
        w = np.exp(sc - m)
        vs.append((np.einsum("nhj,nhjd->nhd", w, vv) / w.sum(-1)[..., None]).astype(np.float16))
        ss.append((np.log(w.sum(-1)) + m[..., 0]).astype(np.float32))
        num = num + np.einsum("nhj,nhjd->nhd", w, vv)
        den = den + w.sum(-1)
    return np.stack(vs, axis=1), np.stack(ss, axis=1), num / den[..., None], np.log(den) + m[..., 0]
