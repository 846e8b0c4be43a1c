"""``python -m gqadrv selftest`` cases of the GQA family: the oracle against a direct formula (CPU)
and a few GPU shapes against the oracle. Each case is (name, max error, ok)."""

from __future__ import annotations

import numpy as np

from .reference import gqa_decode_reference

__all__ = ["cpu_cases", "gpu_cases"]


def cpu_cases(rng) -> list:
    q = rng.standard_normal((2, 4, 64))
    kv = rng.standard_normal((2, 2, 2, 9, 64))
    lens = np.array([5, 9])
    ref = gqa_decode_reference(q, kv, lens, 0.7)
    worst = 0.0
    for b in range(2):
        for h in range(4):
            k, v = kv[b, 0, h // 2, : lens[b]], kv[b, 1, h // 2, : lens[b]]
            s = k @ q[b, h] * 0.7 / 8.0
            p = np.exp(s - s.max())
            p /= p.sum()
            worst = max(worst, float(np.max(np.abs(p @ v - ref[b, h]))))
    return [("gqa oracle vs direct formula", worst, worst < 1e-12)]


_GPU_SHAPES = ((1, 32, 8, 64, 128, [1]), (4, 32, 8, 256, 128, [64, 127, 191, 256]),
               (2, 16, 2, 300, 64, [300, 7]), (1, 8, 8, 1000, 256, [999]))


def gpu_cases(rng) -> list:
    import cupy as cp

    from .api import gqa_decode

    out = []
    for (B, Hq, Hkv, C, D, L) in _GPU_SHAPES:
        qh = rng.standard_normal((B, Hq, D)).astype(np.float16)
        kvh = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
        lh = np.array(L, np.int32)
        got = cp.asnumpy(gqa_decode(cp.asarray(qh), cp.asarray(kvh), cp.asarray(lh))).astype(np.float64)
        ref = gqa_decode_reference(qh, kvh, lh)
        err = float(np.max(np.abs(got - ref)))
        ok = bool(np.all(np.abs(got - ref) <= 1e-2 + 1e-2 * np.abs(ref)))
        out.append((f"gqa B{B} Hq{Hq} Hkv{Hkv} C{C} D{D}", err, ok))
    return out
