"""Float64 numpy oracle of the GQA decode contract (used by tests, selftest and the demo).

    O[b, h] = softmax_j(sm_scale * <Q[b, h], K[b, h // g, j]>, j < len[b]) . V[b, h // g, :len[b]]

with sm_scale absolute (default 1/sqrt(D)) or, in the seed's spelling, sm_scale = q_scale / sqrt(D)
(give one of them, as in gqa_decode),

with head mapping h = kvh * g + i and len clamped to [0, C]; an empty request (len <= 0) gives
zeros. Positions >= len are never read, so NaN/Inf stored there cannot matter.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["gqa_decode_reference"]


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
