"""Float64 numpy oracle of the GQA decode contract (used by tests, selftest and the demo).

    O[b, h] = softmax_j(sm_scale * <Q[b, h], K[b, h // g, j]>, j < len[b]) . V[b, h // g, :len[b]]

with sm_scale absolute (default 1/sqrt(D)) or, in the seed's spelling, sm_scale = q_scale / sqrt(D)
(give one of them, as in gqa_decode),

with head mapping h = kvh * g + i and len clamped to [0, C]; an empty request (len <= 0) gives
zeros. Positions >= len are never read, so NaN/Inf stored there cannot matter.

``gqa_decode_paged_reference`` is the oracle of the paged decode (``gqa_decode_paged``: NHD / HND
pages, separate or combined K/V, block table, s_q query tokens with bottom-right causal masking,
natural-log LSE); ``paged_kv_from_contiguous`` scatters per-request K / V into shuffled pages for tests.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["gqa_decode_paged_reference", "gqa_decode_reference", "paged_kv_from_contiguous"]


def gqa_decode_reference(q: npt.ArrayLike, kv: npt.ArrayLike, lengths: npt.ArrayLike,
                         q_scale: float = 1.0, sm_scale: float | None = None) -> npt.NDArray[np.float64]:
    """q [B, Hq, D], kv [B, 2, Hkv, C, D], lengths [B] (host arrays, any float dtype) -> float64 [B, Hq, D].

    softmax(sm_scale * q.k); ``sm_scale`` None means q_scale / sqrt(D). Giving sm_scale with a
    q_scale other than 1.0 is a ValueError (as in gqa_decode)."""
    from .contract import check_scale_pair

    check_scale_pair(q_scale, sm_scale)
    q = np.asarray(q, dtype=np.float64)
    kv = np.asarray(kv)
    lengths = np.asarray(lengths).astype(np.int64)
    B, Hq, D = q.shape
    _, two, Hkv, C, Dk = kv.shape
    if two != 2 or Dk != D or Hq % Hkv:
        raise ValueError(f"inconsistent shapes q {q.shape} kv {kv.shape}")
    g = Hq // Hkv
    out = np.zeros((B, Hq, D), dtype=np.float64)
    scale = float(sm_scale) if sm_scale is not None else float(q_scale) / np.sqrt(D)
    for b in range(B):
        n = int(min(max(lengths[b], 0), C))
        if n == 0:
            continue
        k = kv[b, 0, :, :n].astype(np.float64)  # [Hkv, n, D]
        v = kv[b, 1, :, :n].astype(np.float64)
        qb = q[b].reshape(Hkv, g, D)
        s = np.einsum("hgd,hnd->hgn", qb, k) * scale
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("hgn,hnd->hgd", p, v).reshape(Hq, D)
    return out


# ----------------------------------------------------------------------------- paged decode
PAGED_LAYOUTS = ("NHD", "HND")
TABLE_POISON = 2147480000  # what the tests store in block-table entries that must never be read


def _check_paged_layout(kv_layout: str) -> str:
    if kv_layout not in PAGED_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {', '.join(PAGED_LAYOUTS)}, got {kv_layout!r}")
    return kv_layout


def _split_paged_cache(k_cache: npt.ArrayLike, v_cache: npt.ArrayLike | None,
                       kv_layout: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(K pages, V pages, page_size, Hkv) of a separate or combined cache, as views of the input."""
    kc = np.asarray(k_cache)
    if v_cache is None:
        if kc.ndim != 5 or kc.shape[1] != 2:
            raise ValueError(f"a combined cache (v_cache None) must be [num_pages, 2, ...], got {kc.shape}")
        k, v = kc[:, 0], kc[:, 1]
    else:
        k, v = kc, np.asarray(v_cache)
        if k.shape != v.shape:
            raise ValueError(f"k_cache {k.shape} and v_cache {v.shape} differ")
    if k.ndim != 4:
        raise ValueError(f"K pages must be 4-D [num_pages, ...], got {k.shape}")
    if kv_layout == "NHD":
        _, page, hkv, _ = k.shape
    else:
        _, hkv, page, _ = k.shape
    return k, v, page, hkv


def gqa_decode_paged_reference(q: npt.ArrayLike, k_cache: npt.ArrayLike, v_cache: npt.ArrayLike | None,
                               block_table: npt.ArrayLike, seq_lens: npt.ArrayLike, *, kv_layout: str = "NHD",
                               q_scale: float = 1.0, sm_scale: float | None = None
                               ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Float64 oracle of paged GQA decode (``gqa_decode_paged``) on host arrays -> (out, lse).

    * q [B, Hq, D] or [B, s_q, Hq, D] (any float dtype NumPy casts: fp16, ml_dtypes.bfloat16, ...).
    * kv_layout "NHD": k_cache, v_cache [num_pages, page_size, Hkv, D]; "HND": [num_pages, Hkv,
      page_size, D]; v_cache None: k_cache is combined, [num_pages, 2, <page>] (index 0 K, 1 V).
    * block_table int [B, max_pages], seq_lens int [B]; L = clamp(seq_lens[b], 0, max_pages * page_size).
      Key t < L of KV head kvh is page block_table[b, t // page_size], slot t % page_size. Only the
      entries ``block_table[b, :ceil(L / page_size)]`` are read and only slots t < L are used, so
      poisoned entries past them and NaN in unused pages / tail slots never matter. A used entry
      outside [0, num_pages) reads as a page of zeros (the kernels' "bad_page" behaviour).
    * Query head h uses KV head h // (Hq // Hkv); query token j of s_q sees keys
      [0, L - (s_q - 1 - j)) (bottom-right causal; s_q = 1: all L keys).
    * Scores sm_scale * q.k with sm_scale absolute (default 1/sqrt(D)) or q_scale / sqrt(D); giving
      sm_scale with a q_scale other than 1.0 is a ValueError.
    * out float64 in q's shape; lse float64 natural-log [B, s_q, Hq] ([B, Hq] for 3-D q). A row with no
      key: out 0, lse +inf.
    """
    from ..ops.oracle import masked_softmax_lse
    from .contract import check_scale_pair

    check_scale_pair(q_scale, sm_scale)
    _check_paged_layout(kv_layout)
    qa = np.asarray(q)
    squeeze = qa.ndim == 3
    if squeeze:
        qa = qa[:, None]
    if qa.ndim != 4:
        raise ValueError(f"q must be [B, Hq, D] or [B, s_q, Hq, D], got {np.shape(q)}")
    B, s_q, Hq, D = qa.shape
    k, v, page, Hkv = _split_paged_cache(k_cache, v_cache, kv_layout)
    if k.shape[-1] != D or Hq % Hkv:
        raise ValueError(f"inconsistent shapes q {qa.shape} K pages {k.shape} ({kv_layout})")
    num_pages = k.shape[0]
    g = Hq // Hkv
    bt = np.asarray(block_table)
    if bt.ndim != 2 or bt.shape[0] != B:
        raise ValueError(f"block_table must be [B={B}, max_pages], got {bt.shape}")
    cap = bt.shape[1] * page
    lens = np.clip(np.asarray(seq_lens).astype(np.int64).reshape(-1), 0, cap)
    if lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got {np.shape(seq_lens)}")
    scale = float(sm_scale) if sm_scale is not None else float(q_scale) / np.sqrt(D)

    out = np.zeros((B, s_q, Hq, D), np.float64)
    lse = np.full((B, s_q, Hq), np.inf, np.float64)
    j = np.arange(s_q)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        npg = -(-n // page)
        pages = bt[b, :npg].astype(np.int64)  # never past the used entries
        bad = (pages < 0) | (pages >= num_pages)
        idx = np.where(bad, 0, pages)
        kb, vb = k[idx].astype(np.float64), v[idx].astype(np.float64)  # [npg, <page>, D]
        if bad.any():
            kb[bad] = 0.0
            vb[bad] = 0.0
        if kv_layout == "NHD":  # [npg, page, Hkv, D] -> [Hkv, npg * page, D]
            kb, vb = kb.transpose(2, 0, 1, 3), vb.transpose(2, 0, 1, 3)
        else:                   # [npg, Hkv, page, D] -> [Hkv, npg * page, D]
            kb, vb = kb.transpose(1, 0, 2, 3), vb.transpose(1, 0, 2, 3)
        kb = kb.reshape(Hkv, npg * page, D)[:, :n]
        vb = vb.reshape(Hkv, npg * page, D)[:, :n]
        visible = n - (s_q - 1 - j)                                 # keys seen by query token j
        valid = np.arange(n)[None, :] < visible[:, None]            # [s_q, n]
        qb = qa[b].astype(np.float64).reshape(s_q, Hkv, g, D).transpose(1, 0, 2, 3).reshape(Hkv, s_q * g, D)
        scores = (qb @ kb.transpose(0, 2, 1)).reshape(Hkv, s_q, g, n) * scale
        p, row_lse = masked_softmax_lse(scores, valid[None, :, None, :])    # [Hkv, s_q, g, n], [Hkv, s_q, g]
        o = (p.reshape(Hkv, s_q * g, n) @ vb).reshape(Hkv, s_q, g, D)
        out[b] = o.transpose(1, 0, 2, 3).reshape(s_q, Hq, D)
        lse[b] = row_lse.transpose(1, 0, 2).reshape(s_q, Hq)
    if squeeze:
        return out[:, 0], lse[:, 0]
    return out, lse


def paged_kv_from_contiguous(k: npt.ArrayLike, v: npt.ArrayLike, lengths: npt.ArrayLike, page_size: int, *,
                             kv_layout: str = "NHD", combined: bool = False, max_pages: int | None = None,
                             extra_pages: int = 0, share: tuple = (), rng: np.random.Generator | None = None,
                             fill: float = np.nan, table_fill: int = TABLE_POISON
                             ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Scatter per-request contiguous K / V ``[B, T, Hkv, D]`` into a paged cache.

    Returns (k_cache, v_cache or None when ``combined``, block_table int32 [B, max_pages]) in
    ``kv_layout``. max_pages defaults to ceil(T / page_size); lengths are clamped to
    [0, max_pages * page_size] and must not exceed T. Each request gets ceil(L / page_size) pages,
    placed at shuffled physical indices when ``rng`` is given (identity order otherwise), plus
    ``extra_pages`` pages nobody references. Unused pages and the slots past L in a request's last page
    hold ``fill``; table entries past a request's pages hold ``table_fill``.

    ``share``: (dst, src, n) triples with src < dst: request dst's first n pages are request src's
    first n pages (n * page_size <= src's length, n <= dst's page count). Those keys of dst are then
    src's data: the returned cache, not ``k`` / ``v``, is the truth for them.
    """
    _check_paged_layout(kv_layout)
    ka, va = np.asarray(k), np.asarray(v)
    if ka.ndim != 4 or ka.shape != va.shape:
        raise ValueError(f"k and v must be the same [B, T, Hkv, D] shape, got {ka.shape} and {va.shape}")
    B, T, Hkv, D = ka.shape
    page = int(page_size)
    mp = max(1, -(-T // page)) if max_pages is None else int(max_pages)
    lens = np.clip(np.asarray(lengths).astype(np.int64).reshape(-1), 0, mp * page)
    if lens.shape != (B,):
        raise ValueError(f"lengths must be [B={B}], got {np.shape(lengths)}")
    if (lens > T).any():
        raise ValueError(f"k / v hold {T} tokens per request, a request uses {int(lens.max())}")
    npg = -(-lens // page)
    shared: dict[int, tuple[int, int]] = {}
    for dst, src, n in share:
        if not (0 <= src < dst < B) or dst in shared:
            raise ValueError(f"bad share triple {(dst, src, n)}")
        if n < 0 or n > npg[dst] or n * page > lens[src]:
            raise ValueError(f"share {(dst, src, n)}: needs n <= {int(npg[dst])} and n * page <= {int(lens[src])}")
        shared[dst] = (src, int(n))
    total = int(sum(int(npg[b]) - shared.get(b, (0, 0))[1] for b in range(B))) + int(extra_pages)
    total = max(total, 1)
    perm = rng.permutation(total) if rng is not None else np.arange(total)
    kc = np.full((total, page, Hkv, D), fill, ka.dtype)
    vc = np.full((total, page, Hkv, D), fill, va.dtype)
    bt = np.full((B, mp), table_fill, np.int32)
    nxt = 0
    for b in range(B):
        src, n = shared.get(b, (0, 0))
        bt[b, :n] = bt[src, :n]
        for p in range(n, int(npg[b])):
            phys = int(perm[nxt])
            nxt += 1
            bt[b, p] = phys
            t0, t1 = p * page, min((p + 1) * page, int(lens[b]))
            kc[phys, : t1 - t0] = ka[b, t0:t1]
            vc[phys, : t1 - t0] = va[b, t0:t1]
    if kv_layout == "HND":
        kc, vc = kc.transpose(0, 2, 1, 3).copy(), vc.transpose(0, 2, 1, 3).copy()  # canonical C strides
    if combined:
        return np.stack([kc, vc], axis=1), None, bt
    return kc, vc, bt
