"""Small host cases of the sparse MLA decode (``flash_mla_with_kvcache`` with ``indices``) shared by
test_torch_sparse_gpu.py / test_jax_sparse_gpu.py, and their float64 oracle
(gqadrv.mla.sparse_reference.sparse_decode_reference).

A case: b 2, s_q 2, h_q 16, d 576; a main pool of 9 pages of 7 tokens (topk 40) and, for the
``*_extra`` kinds, an extra pool of 4 pages of 5 tokens (extra_topk 12). Each pool has one spare page
filled with NaN bits (FP8: 0xFF codes, scales and RoPE bytes; bf16: 0xFFFF) that only indices at
positions past ``topk_length`` name: a kernel that reads beyond the counted positions produces NaN.
Every other slot holds data ~ N(0, 1), so the indices may be redrawn freely between calls / graph
replays. Among the counted positions some indices are invalid (-1, INT_MIN, -7, the slot count, the
slot count + 5, INT_MAX) and are skipped; request 1's first query token has only invalid indices (lse
+inf, out 0). ``attn_sink`` holds +inf (head 0: out 0), -inf (head 1: no effect) and finite values
near the LSE. ``topk_length`` has a value past topk (clamped). FP8 pools are built on the host with
``quantize_k_cache_reference`` and the oracle reads their ``dequantize_k_cache_reference``.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from gqadrv.mla.fp8_reference import (
    dequantize_k_cache_reference,
    quantize_k_cache_reference,
)
from gqadrv.mla.sparse_reference import sparse_decode_reference

BF16 = np.dtype(ml_dtypes.bfloat16)
B, S_Q, H_Q, D_QK, D_V = 2, 2, 16, 576, 512
MAIN = (9, 7, 40)    # (num_blocks, page_size, topk)
EXTRA = (4, 5, 12)   # (num_blocks, page_size, extra_topk)
SPARE = {MAIN: 4, EXTRA: 1}   # the NaN page of each pool
KINDS = ("fp8", "fp8_extra", "bf16_extra")
SCALES = {"fp8": None, "fp8_extra": 0.05, "bf16_extra": D_QK ** -0.55}
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
SPARSE_NAMES = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                "extra_topk_length")


@dataclasses.dataclass
class SparseHost:
    kind: str
    q: np.ndarray                        # bf16 [b, s_q, h_q, 576]
    k_cache: np.ndarray                  # FP8 uint8 [nb, page, 1, 656] or bf16 [nb, page, 1, 576]
    k_num: np.ndarray                    # what the oracle reads: bf16 [nb, page, 1, 576]
    indices: np.ndarray                  # int32 [b, s_q, topk]
    topk_length: np.ndarray              # int32 [b]
    attn_sink: np.ndarray                # float32 [h_q]
    k_src: np.ndarray | None = None      # the bf16 pool an FP8 cache was quantized from (no NaN page)
    extra_k_cache: np.ndarray | None = None
    extra_num: np.ndarray | None = None
    extra_indices_in_kvcache: np.ndarray | None = None
    extra_topk_length: np.ndarray | None = None

    @property
    def fp8(self) -> bool:
        return self.kind.startswith("fp8")

    @property
    def scale(self) -> float | None:
        return SCALES[self.kind]

    def arrays(self) -> dict:
        """The sparse keyword arrays this case passes (host), in SPARSE_NAMES order."""
        return {n: getattr(self, n) for n in SPARSE_NAMES if getattr(self, n) is not None}

    def reference(self, q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """float64 (out [b, s_q, h_q, 512], lse [b, h_q, s_q]) of the current indices / lengths / sinks."""
        return sparse_decode_reference(self.q if q is None else q, self.k_num, self.indices, self.scale, D_V,
                                       self.attn_sink, self.topk_length, self.extra_num,
                                       self.extra_indices_in_kvcache, self.extra_topk_length)


def _pool(rng, pool: tuple, fp8: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cache as handed to gqadrv, numbers the oracle reads, the bf16 source); the spare page is NaN
    (in the first two)."""
    nb, page, _ = pool
    k = rng.standard_normal((nb, page, 1, D_QK)).astype(np.float32).astype(BF16)
    spare = SPARE[pool]
    if fp8:
        k8 = quantize_k_cache_reference(k)
        k8[spare] = 0xFF
        return k8, dequantize_k_cache_reference(k8), k
    bits = k.view(np.uint16).copy()
    bits[spare] = 0xFFFF
    return bits.view(BF16), bits.view(BF16), k


def _lengths(rng, topk: int) -> np.ndarray:
    """int32 [b]: request 0 below topk, request 1 past it (clamped to topk)."""
    return np.array([rng.integers(topk // 2, topk), topk + int(rng.integers(1, 6))], np.int32)


def _indices(rng, pool: tuple, lengths: np.ndarray, dead_row: bool) -> np.ndarray:
    """int32 [b, s_q, topk]: counted positions name distinct data slots (some replaced by invalid
    values), positions past the length name the NaN spare page (or -1)."""
    nb, page, topk = pool
    slots = nb * page
    spare = np.arange(SPARE[pool] * page, (SPARE[pool] + 1) * page)
    live = np.setdiff1d(np.arange(slots), spare)
    invalid = np.array([-1, INT_MIN, -7, slots, slots + 5, INT_MAX], np.int64)
    idx = np.zeros((B, S_Q, topk), np.int64)
    for i in range(B):
        n = min(int(lengths[i]), topk)
        for t in range(S_Q):
            row = rng.choice(spare, size=topk)                       # not counted: NaN if read
            row[rng.random(topk) < 0.3] = -1
            row[:n] = rng.choice(live, size=n, replace=n > live.size)
            bad = rng.random(n) < 0.25
            row[:n][bad] = invalid[rng.integers(0, invalid.size, size=int(bad.sum()))]
            idx[i, t] = row
    if dead_row:
        idx[1, 0] = invalid[np.arange(topk) % invalid.size]
    return idx.astype(np.int32)


def _sink(rng) -> np.ndarray:
    s = (rng.standard_normal(H_Q) * 1.5 + 3.5).astype(np.float32)
    s[0], s[1] = np.inf, -np.inf
    return s


def build(kind: str, seed: int) -> SparseHost:
    if kind not in KINDS:
        raise ValueError(kind)
    rng = np.random.default_rng(seed)
    fp8 = kind.startswith("fp8")
    q = rng.standard_normal((B, S_Q, H_Q, D_QK)).astype(np.float32).astype(BF16)
    k, k_num, k_src = _pool(rng, MAIN, fp8)
    tl = _lengths(rng, MAIN[2])
    h = SparseHost(kind, q, k, k_num, _indices(rng, MAIN, tl, True), tl, _sink(rng), k_src)
    if kind.endswith("_extra"):
        h.extra_k_cache, h.extra_num, _ = _pool(rng, EXTRA, fp8)
        h.extra_topk_length = _lengths(rng, EXTRA[2])
        h.extra_indices_in_kvcache = _indices(rng, EXTRA, h.extra_topk_length, False)
    return h


def redraw(h: SparseHost, seed: int) -> dict:
    """New indices, lengths and sinks for the same pools (shapes unchanged), set on ``h``; returns the
    arrays that changed (to copy into device tensors in place)."""
    rng = np.random.default_rng(seed)
    h.topk_length = _lengths(rng, MAIN[2])
    h.indices = _indices(rng, MAIN, h.topk_length, seed % 2 == 0)
    h.attn_sink = _sink(rng)
    changed = {"indices": h.indices, "topk_length": h.topk_length, "attn_sink": h.attn_sink}
    if h.extra_k_cache is not None:
        h.extra_topk_length = _lengths(rng, EXTRA[2])
        h.extra_indices_in_kvcache = _indices(rng, EXTRA, h.extra_topk_length, False)
        changed.update(extra_indices_in_kvcache=h.extra_indices_in_kvcache, extra_topk_length=h.extra_topk_length)
    return changed
