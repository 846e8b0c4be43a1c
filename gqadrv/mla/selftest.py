"""``python -m gqadrv selftest`` cases of the MLA family: the oracle against a direct per-token loop
(CPU) and a few GPU shapes against the oracle. Each case is (name, max error, ok)."""

from __future__ import annotations

import numpy as np

from .reference import _self_check, mla_decode_reference

__all__ = ["cpu_cases", "gpu_cases", "make_case"]


def cpu_cases(rng) -> list:
    try:
        _self_check(int(rng.integers(0, 1000)))
        return [("mla oracle vs direct per-token loop", 0.0, True)]
    except AssertionError as exc:  # pragma: no cover - reported, not raised
        return [(f"mla oracle vs direct per-token loop ({exc})", float("nan"), False)]


def make_case(rng, b, s_q, h_q, h_kv, page, lens, dtype="bfloat16", max_blocks=None):
    """Host arrays of one paged MLA case: NaN in every unused page row, block-table entries past
    each request's pages poisoned with 2147480000, pages of a request in shuffled order."""
    import ml_dtypes

    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    lens = np.asarray(lens, np.int64)
    cap_blocks = max(1, -(-int(max(1, lens.clip(0).max())) // page))
    max_blocks = max_blocks or cap_blocks
    nb = b * max_blocks + 2
    k = np.full((nb, page, h_kv, 576), np.nan, np.float32)
    bt = np.full((b, max_blocks), 2147480000, np.int32)
    perm = rng.permutation(nb)
    used = 0
    for i in range(b):
        n = int(min(max(lens[i], 0), max_blocks * page))
        for p in range(-(-n // page)):
            blk = int(perm[used])
            used += 1
            bt[i, p] = blk
            ntok = min(page, n - p * page)
            k[blk, :ntok] = rng.standard_normal((ntok, h_kv, 576)) * 0.5
    q = (rng.standard_normal((b, s_q, h_q, 576)) * 0.5).astype(npdt)
    return q, k.astype(npdt), bt, lens.astype(np.int32)


_GPU_SHAPES = ((2, 1, 16, 1, 64, [300, 1]), (1, 2, 128, 1, 16, [1000]), (3, 1, 8, 2, 1, [0, 70, 5]))


def gpu_cases(rng) -> list:
    import cupy as cp

    from .api import flash_mla_with_kvcache

    out = []
    for (b, s_q, h_q, h_kv, page, lens) in _GPU_SHAPES:
        q, k, bt, ln = make_case(rng, b, s_q, h_q, h_kv, page, lens)
        o, lse = flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512,
                                        causal=s_q > 1)
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, s_q > 1)
        got = cp.asnumpy(o).astype(np.float64)
        err = float(np.max(np.abs(got - ro)))
        gl = cp.asnumpy(lse).astype(np.float64)
        fin = np.isfinite(rl)
        ok = bool(np.all(np.abs(got - ro) <= 2e-2 + 2e-2 * np.abs(ro))) and bool(
            np.array_equal(np.isposinf(gl), ~fin)) and bool(
            np.all(np.abs(gl[fin] - rl[fin]) <= 1e-3 * np.maximum(1, np.abs(rl[fin]))))
        out.append((f"mla b{b} s_q{s_q} h_q{h_q} h_kv{h_kv} page{page}", err, ok))
    return out
