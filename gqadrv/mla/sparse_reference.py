"""Float64 numpy references of DeepSeek sparse attention (FlashMLA's sparse paths), the oracles of the
sparse MLA issues: ``sparse_prefill_reference`` (``flash_mla_sparse_fwd``, with gqadrv's native varlen
batch form) and ``sparse_decode_reference`` (``flash_mla_with_kvcache`` with ``indices``, the extra
pool included). No GPU, no torch; written from the semantics in shared/reference/flashmla.md §1.2, §1.3.

Common rules, per query row (a query token and a head):
* the keys are the rows of K named by the row's index list, in order, duplicates counted as often as
  they appear; an index is **invalid** when it is negative or not below the number of key rows (INT_MIN,
  -1, the row count and INT_MAX included) and is never read; with a ``topk_length`` only the first
  ``topk_length`` indices count (values clamped to [0, topk]);
* logits ``p = sm_scale * q . k`` over all ``d_qk`` channels; V is the first ``d_v`` channels of K;
* ``max_logits = max p`` (-inf without a valid key), ``lse = ln sum exp p`` (natural log; +inf without
  a valid key), ``out = sum softmax(p) v`` (0 without a valid key);
* ``attn_sink`` (float per head): ``out`` is multiplied by ``exp(lse) / (exp(lse) + exp(sink))`` =
  ``1 / (1 + exp(sink - lse))``; a sink of +inf gives 0, -inf leaves ``out`` unchanged; ``lse`` and
  ``max_logits`` are returned without the sink.
Everything is computed in float64 from the inputs converted exactly (bf16 / fp16 / float32).
"""

from __future__ import annotations

import numpy as np

__all__ = ["attend_rows", "sparse_decode_reference", "sparse_prefill_reference", "valid_index_mask"]


def _f64(x) -> np.ndarray:
    a = np.asarray(x)
    return a.astype(np.float64)


def valid_index_mask(indices: np.ndarray, num_rows: int, topk_length=None) -> np.ndarray:
    """True where an index names a key row: 0 <= index < num_rows, and (with ``topk_length``, one value
    per leading row of ``indices[..., topk]``) its position is below that row's length."""
    idx = np.asarray(indices).astype(np.int64)
    ok = (idx >= 0) & (idx < int(num_rows))
    if topk_length is not None:
        n = np.clip(np.asarray(topk_length).astype(np.int64), 0, idx.shape[-1])
        n = n.reshape(n.shape + (1,) * (idx.ndim - n.ndim))
        ok &= np.arange(idx.shape[-1]) < n
    return ok


def attend_rows(q: np.ndarray, keys: np.ndarray, valid: np.ndarray, sm_scale: float, d_v: int,
                sink: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention of query rows q [R, H, d] over their own keys [R, N, d] (``valid`` [R, N]): the keys of
    row r serve all H heads of that row. Returns (out [R, H, d_v], max_logits [R, H], lse [R, H]);
    ``sink`` [H] as in the module docstring. Invalid keys are never read (their values may be NaN)."""
    q = _f64(q)
    R, H, _ = q.shape
    k = np.where(valid[..., None], _f64(keys), 0.0)               # invalid rows: no NaN leaks
    p = np.einsum("rhd,rnd->rhn", q, k) * float(sm_scale)
    p = np.where(valid[:, None, :], p, -np.inf)
    has = valid.any(axis=-1)[:, None] & np.ones((1, H), bool)
    m = np.where(has, p.max(axis=-1, initial=-np.inf), -np.inf)
    msafe = np.where(has, m, 0.0)
    w = np.where(valid[:, None, :], np.exp(p - msafe[..., None]), 0.0)
    l = w.sum(axis=-1)
    lse = np.where(has, msafe + np.log(np.where(has, l, 1.0)), np.inf)
    out = np.einsum("rhn,rnd->rhd", w, k[..., :d_v]) / np.where(has, l, 1.0)[..., None]
    out = np.where(has[..., None], out, 0.0)
    if sink is not None:
        s = _f64(sink).reshape(1, H)
        with np.errstate(over="ignore", invalid="ignore"):
            # 1 / (1 + exp(sink - lse)): +inf sink -> 0, -inf sink -> 1; rows without keys stay 0
            factor = np.where(np.isposinf(s), 0.0, np.where(np.isneginf(s), 1.0, 1.0 / (1.0 + np.exp(s - np.where(has, lse, 0.0)))))
        out = out * np.where(has, factor, 0.0)[..., None]
    return out, m, lse


def sparse_prefill_reference(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None,
                             cu_seqlens_q=None, cu_seqlens_kv=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``flash_mla_sparse_fwd`` in float64: q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices int
    [s_q, 1, topk], attn_sink [h_q], topk_length [s_q]. Returns (out [s_q, h_q, d_v], max_logits
    [s_q, h_q], lse [s_q, h_q]).

    Varlen batch form (gqadrv's addition): ``cu_seqlens_q`` / ``cu_seqlens_kv`` (int [n + 1], starting
    at 0, non-decreasing) split the query tokens and the KV rows into n requests; the indices of a
    query token of request i address request i's KV rows (0 .. its length - 1) and are invalid
    outside that range."""
    q = np.asarray(q)
    kv = np.asarray(kv)
    idx = np.asarray(indices)
    if q.ndim != 3 or kv.ndim != 3 or kv.shape[1] != 1 or idx.ndim != 3 or idx.shape[1] != 1:
        raise ValueError("expected q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk]")
    s_q, s_kv = q.shape[0], kv.shape[0]
    idx = idx[:, 0, :].astype(np.int64)
    if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_kv, or neither")
    if cu_seqlens_q is None:
        base = np.zeros(s_q, np.int64)
        rows = np.full(s_q, s_kv, np.int64)
    else:
        cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_kv, np.int64)
        if cq.shape != ck.shape or cq[0] != 0 or ck[0] != 0 or cq[-1] != s_q or ck[-1] != s_kv:
            raise ValueError("cu_seqlens_q / cu_seqlens_kv must be [n + 1] from 0 to s_q / s_kv")
        req = np.searchsorted(cq, np.arange(s_q), side="right") - 1
        base, rows = ck[req], (ck[1:] - ck[:-1])[req]
    valid = (idx >= 0) & (idx < rows[:, None])
    if topk_length is not None:
        n = np.clip(np.asarray(topk_length).astype(np.int64), 0, idx.shape[-1])
        valid &= np.arange(idx.shape[-1]) < n[:, None]
    gathered = np.where(valid, idx + base[:, None], 0)
    keys = kv[:, 0, :][gathered]                                   # [s_q, topk, d_qk]
    return attend_rows(q, keys, valid, sm_scale, d_v, attn_sink)


def sparse_decode_reference(q, k_cache, indices, softmax_scale: float | None = None, d_v: int = 512,
                            attn_sink=None, topk_length=None, extra_k_cache=None, extra_indices=None,
                            extra_topk_length=None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse decode (``flash_mla_with_kvcache`` with ``indices``) in float64: q [b, s_q, h_q, d_qk];
    k_cache [num_blocks, page, 1, d_qk] as numbers (an FP8 cache dequantized first, e.g. with
    ``fp8_reference.dequantize_k_cache_reference``); indices int [b, s_q, topk] of flattened slots
    (page * page_size + offset), invalid when negative or >= num_blocks * page; topk_length [b]; the
    extra pool (``extra_k_cache`` / ``extra_indices`` [b, s_q, extra_topk] / ``extra_topk_length``) is
    attended in the same softmax. ``softmax_scale`` defaults to d_qk ** -0.5. Returns (out
    [b, s_q, h_q, d_v], lse [b, h_q, s_q])."""
    q = np.asarray(q)
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk ** -0.5 if softmax_scale is None else float(softmax_scale)

    def pool(cache, idx, lens):
        c = np.asarray(cache)
        flat = c.reshape(-1, c.shape[-1])
        idx = np.asarray(idx).astype(np.int64)
        valid = (idx >= 0) & (idx < flat.shape[0])
        if lens is not None:
            n = np.clip(np.asarray(lens).astype(np.int64), 0, idx.shape[-1]).reshape(b, 1, 1)
            valid &= np.arange(idx.shape[-1]) < n
        return flat[np.where(valid, idx, 0)], valid

    keys, valid = pool(k_cache, indices, topk_length)
    if extra_k_cache is not None:
        ek, ev = pool(extra_k_cache, extra_indices, extra_topk_length)
        keys, valid = np.concatenate([keys, ek], axis=2), np.concatenate([valid, ev], axis=2)
    out, _, lse = attend_rows(q.reshape(b * s_q, h_q, d_qk), keys.reshape(b * s_q, -1, d_qk),
                              valid.reshape(b * s_q, -1), scale, d_v, attn_sink)
    return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(0, 2, 1)
