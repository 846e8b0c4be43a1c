"""Deterministic MLA decode oracle grid for the GPU tests (float64 oracle, NaN-poisoned pages).

Each case draws its axes from the issue's grid with co-prime strides, so every value of every axis
appears many times and the combinations vary: batch {1, 2, 37, 128}, s_q {1, 2, 4}, h_q {1, 3, 16,
63, 64, 128} x h_kv {1, 2}, lengths {0, 1, 63, 64, 65, 4096, ragged}, page {1, 16, 32, 64, 128, 256},
causal on/off, bf16/fp16, splits auto / 1 / 7, and the backends in turn: the default route
(on the H200 for pages >= 64 narrow16x2_tma / narrow16_bal at M <= 16 and seesaw_tma / seesaw_bal
above, the cp.async seesaw for smaller pages), the cp.async seesaw
forced, mma.sync, the first wgmma kernel, and narrow16 / narrow32 where M = s_q * h_q / h_kv fits
them (with pages >= 64 also their TMA builds in turn: narrow16_tma, narrow16x2_tma, narrow16_bal /
narrow32_tma).
Inputs are made non-contiguous (q, k_cache and block_table are slices of wider arrays).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BATCHES = (1, 2, 37, 128)
S_QS = (1, 2, 4)
HEADS = ((1, 1), (3, 1), (16, 1), (63, 1), (64, 1), (128, 1), (16, 2), (64, 2), (128, 2), (2, 2))
LENGTHS = ("0", "1", "63", "64", "65", "4096", "ragged")
PAGES = (1, 16, 32, 64, 128, 256)
SPLITS = (None, 1, 7)
N_CASES = 320
TOL = {"float16": 1e-2, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class MlaCase:
    idx: int
    b: int
    s_q: int
    h_q: int
    h_kv: int
    lengths: str
    page: int
    causal: bool
    dtype: str
    splits: int | None
    backend: str | None

    @property
    def label(self) -> str:
        return (f"{self.idx}:b{self.b}s{self.s_q}h{self.h_q}/{self.h_kv}L{self.lengths}p{self.page}"
                f"{'c' if self.causal else ''}{self.dtype[:2]}S{self.splits}{self.backend or ''}")

    def lens(self, rng) -> np.ndarray:
        if self.lengths == "ragged":
            return rng.integers(-3, 700, size=self.b).astype(np.int32)
        n = int(self.lengths)
        return np.full(self.b, n, np.int32)


def grid() -> list[MlaCase]:
    out = []
    n_big: dict = {}  # narrow cases with pages >= 64 so far, per kernel
    for i in range(N_CASES):
        b = BATCHES[i % 4]
        L = LENGTHS[(i * 3) % 7]
        if L == "4096" and b > 2:
            b = 1 + i % 2  # the float64 oracle of 4096 tokens stays small
        h_q, h_kv = HEADS[(i * 7) % len(HEADS)]
        if b == 128 and h_q > 16:
            h_q, h_kv = 16, 1
        s_q = S_QS[(i // 4) % 3]
        backend = (None, "seesaw", "mma", "wgmma", "narrow")[i % 5]
        page = PAGES[(i * 5) % 6]
        if backend == "narrow":
            m = s_q * (h_q // h_kv)
            backend = "narrow16" if m <= 16 else ("narrow32" if m <= 32 else None)
            if backend and page >= 64:  # pages of 64..256: the TMA builds in turn
                n_big[backend] = n_big.get(backend, 0) + 1
                builds = (("narrow16", "narrow16_tma", "narrow16x2_tma", "narrow16_bal") if backend == "narrow16"
                          else ("narrow32", "narrow32_tma"))
                backend = builds[n_big[backend] % len(builds)]
        out.append(MlaCase(i, b, s_q, h_q, h_kv, L, page, bool((i // 3) % 2),
                           ("bfloat16", "float16")[(i // 7) % 2], SPLITS[(i // 2) % 3], backend))
    return out


def strided_inputs(q, k, bt):
    """Device copies that are non-contiguous views: q and k_cache padded in the last dim, the block
    table with a wider row stride (last dims stay contiguous, rows 16-byte aligned)."""
    import cupy as cp

    qw = cp.zeros(q.shape[:-1] + (640,), q.dtype)
    qw[..., :576] = cp.asarray(q)
    kw = cp.full(k.shape[:-1] + (640,), np.nan, k.dtype)
    kw[..., :576] = cp.asarray(k)
    bw = cp.full((bt.shape[0], bt.shape[1] + 3), 2147480000, np.int32)
    bw[:, : bt.shape[1]] = cp.asarray(bt)
    return qw[..., :576], kw[..., :576], bw[:, : bt.shape[1]]
