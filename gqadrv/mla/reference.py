"""float64 NumPy oracle for MLA dense decode (FlashMLA ``flash_mla_with_kvcache`` dense semantics).

``mla_decode_reference(q, k_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None,
causal=False) -> (out [b, s_q, h_q, dv] float64, lse [b, h_q, s_q] float64)``

* q: [b, s_q, h_q, d] (any float dtype NumPy can cast: float16, ml_dtypes.bfloat16, float32, ...).
* k_cache: [num_blocks, page_size, h_kv, d]; V = the first ``head_dim_v`` channels of K.
* block_table: int [b, max_blocks]; cache_seqlens: int [b], clamped to [0, max_blocks * page_size].
* Only pages ``block_table[i, :ceil(len_i / page_size)]`` are gathered and only tokens < len_i are
  used: poisoned block-table entries and NaN-filled unused tokens are never touched.
* causal (bottom-right): query token s sees keys [0, len - (s_q - 1 - s)).
* Rows with no visible key: out 0, lse +inf. lse is the natural-log log-sum-exp of the scaled logits.

Run ``python gqadrv/mla/reference.py`` for a self-check against a direct per-(request, token,
head) loop that looks every key up through the block table one token at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["mla_decode_reference", "clamp_lengths"]


def clamp_lengths(cache_seqlens, max_blocks: int, page_size: int) -> np.ndarray:
    lens = np.asarray(cache_seqlens).astype(np.int64).reshape(-1)
    return np.clip(lens, 0, max_blocks * page_size)


def mla_decode_reference(q: npt.ArrayLike, k_cache: npt.NDArray[Any], block_table: npt.ArrayLike,
                         cache_seqlens: npt.ArrayLike, head_dim_v: int = 512, softmax_scale: float | None = None,
                         causal: bool = False) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    q = np.asarray(q)
    b, s_q, h_q, d = q.shape
    num_blocks, page, h_kv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(f"q has {d} channels, k_cache {d_k}")
    if h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")
    dv = int(head_dim_v)
    group = h_q // h_kv
    bt = np.asarray(block_table)
    max_blocks = bt.shape[1]
    lens = clamp_lengths(cache_seqlens, max_blocks, page)
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)

    out = np.zeros((b, s_q, h_q, dv), np.float64)
    lse = np.full((b, h_q, s_q), np.inf, np.float64)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        npg = -(-n // page)
        pages = bt[i, :npg].astype(np.int64)
        kv = np.asarray(k_cache[pages]).reshape(npg * page, h_kv, d)[:n].astype(np.float64)
        # visible keys per query token
        if causal:
            vis = n - (s_q - 1 - np.arange(s_q))
        else:
            vis = np.full(s_q, n)
        mask = np.arange(n)[None, :] < vis[:, None]  # [s_q, n]
        for kvh in range(h_kv):
            k = kv[:, kvh, :]                     # [n, d]
            v = k[:, :dv]                         # [n, dv]
            qh = q[i, :, kvh * group:(kvh + 1) * group, :].astype(np.float64)  # [s_q, group, d]
            logits = (qh.reshape(s_q * group, d) @ k.T).reshape(s_q, group, n) * scale
            logits = np.where(mask[:, None, :], logits, -np.inf)
            mx = logits.max(axis=-1, keepdims=True)                 # -inf for empty rows
            safe = np.where(np.isfinite(mx), mx, 0.0)
            p = np.exp(logits - safe)                               # 0 at masked keys
            ssum = p.sum(axis=-1, keepdims=True)
            row_lse = np.where(ssum > 0, np.log(np.where(ssum > 0, ssum, 1.0)) + safe, np.inf)[..., 0]
            o = np.where(ssum > 0, (p.reshape(s_q * group, n) @ v).reshape(s_q, group, dv)
                         / np.where(ssum > 0, ssum, 1.0), 0.0)
            out[i, :, kvh * group:(kvh + 1) * group, :] = o
            lse[i, kvh * group:(kvh + 1) * group, :] = row_lse.T
    return out, lse


# ----------------------------------------------------------------------------- self-check
def _direct(q, k_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None, causal=False):
    """Slow per-(request, query token, head) loop; every key located through the block table."""
    q = np.asarray(q, np.float64)
    b, s_q, h_q, d = q.shape
    _, page, h_kv, _ = k_cache.shape
    group = h_q // h_kv
    max_blocks = block_table.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = np.zeros((b, s_q, h_q, head_dim_v))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        n = min(max(int(cache_seqlens[i]), 0), max_blocks * page)
        for s in range(s_q):
            vis = n - (s_q - 1 - s) if causal else n
            for h in range(h_q):
                kvh = h // group
                logits, vals = [], []
                for tok in range(max(vis, 0)):
                    row = np.asarray(k_cache[int(block_table[i, tok // page]), tok % page, kvh], np.float64)
                    logits.append(float(q[i, s, h] @ row) * scale)
                    vals.append(row[:head_dim_v])
                if not logits:
                    continue
                lg = np.array(logits)
                m = lg.max()
                w = np.exp(lg - m)
                lse[i, h, s] = np.log(w.sum()) + m
                out[i, s, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return out, lse


def _self_check(seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    POISON = 2147480000
    for (b, s_q, h_q, h_kv, page, causal, d, dv) in [
        (3, 1, 4, 1, 4, False, 24, 16),
        (3, 3, 4, 2, 2, True, 24, 16),
        (2, 4, 6, 3, 1, True, 20, 12),
        (2, 2, 2, 1, 8, False, 16, 16),
    ]:
        max_blocks = 6
        lens = rng.integers(0, max_blocks * page + 3, size=b)  # includes 0 and over-capacity
        lens[0] = 0
        lens[-1] = max_blocks * page + 5
        nb = b * max_blocks + 3
        k_cache = np.full((nb, page, h_kv, d), np.nan)
        perm = rng.permutation(nb)
        bt = np.full((b, max_blocks), POISON, np.int64)
        used = 0
        for i in range(b):
            n = min(int(lens[i]), max_blocks * page)
            npg = -(-n // page)
            for p in range(npg):
                blk = int(perm[used])
                used += 1
                bt[i, p] = blk
                ntok = min(page, n - p * page)
                k_cache[blk, :ntok] = rng.standard_normal((ntok, h_kv, d))
        q = rng.standard_normal((b, s_q, h_q, d))
        scale = 0.3
        o1, l1 = mla_decode_reference(q, k_cache, bt, lens, dv, scale, causal)
        o2, l2 = _direct(q, k_cache, bt, lens, dv, scale, causal)
        assert not np.isnan(o1).any() and not np.isnan(l1).any()
        assert np.allclose(o1, o2, atol=1e-12, rtol=1e-10), np.abs(o1 - o2).max()
        fin = np.isfinite(l2)
        assert (np.isfinite(l1) == fin).all()
        assert np.allclose(l1[fin], l2[fin], atol=1e-12, rtol=1e-10)
        assert (o1[np.broadcast_to(~fin.transpose(0, 2, 1)[..., None], o1.shape)] == 0).all()
    print("mla reference self-check: OK (4 configurations, causal, empty rows, over-capacity lengths)")


if __name__ == "__main__":
    _self_check()
