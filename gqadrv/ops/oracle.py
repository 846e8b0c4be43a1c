"""Float64 numpy oracle helpers shared by the op families' references.

* ``masked_softmax_lse(scores, valid)``: probabilities and natural-log LSE of scores along the last
  axis with a boolean mask; a row with no valid entry gives zero probabilities and LSE = +inf
  (the convention of FlashMLA and of gqadrv's kernels: "no key").
* ``attend(scores, valid, v)``: out = P.V and LSE in one call.
* ``merge_states(vs, lses)``: exact merge of partial attentions over disjoint key sets (the LSE
  merge of FlashInfer's ``merge_states`` and of every split-KV combine).
"""

from __future__ import annotations

import numpy as np

__all__ = ["attend", "masked_softmax_lse", "merge_states"]


def masked_softmax_lse(scores, valid) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    valid = np.broadcast_to(np.asarray(valid, dtype=bool), s.shape)
    s = np.where(valid, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = ~np.isfinite(m)
    m = np.where(empty, 0.0, m)
    e = np.where(valid, np.exp(s - m), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, np.log(np.where(den > 0, den, 1.0)) + m, np.inf)
    return p, lse[..., 0]


def attend(scores, valid, v) -> tuple[np.ndarray, np.ndarray]:
    """scores [..., n], valid broadcastable to it, v [..., n, dv] -> (out [..., dv], lse [...]).
    Invalid keys are never multiplied (NaN stored there cannot leak)."""
    p, lse = masked_softmax_lse(scores, valid)
    v = np.asarray(v, dtype=np.float64)
    v = np.where(np.isfinite(v), v, 0.0) if not np.all(np.isfinite(v)) else v
    return np.einsum("...n,...nd->...d", p, v), lse


def merge_states(vs, lses) -> tuple[np.ndarray, np.ndarray]:
    """vs: sequence of [..., dv] normalised partial outputs; lses: matching [...] natural-log LSEs
    (+inf or -inf for an empty part: both are treated as "no keys"). Returns (v, lse)."""
    vs = [np.asarray(v, dtype=np.float64) for v in vs]
    ls = [np.asarray(s, dtype=np.float64) for s in lses]
    ls = [np.where(np.isfinite(s), s, -np.inf) for s in ls]
    m = np.maximum.reduce(ls)
    empty = ~np.isfinite(m)
    m0 = np.where(empty, 0.0, m)
    ws = [np.exp(s - m0) for s in ls]
    tot = sum(ws)
    out = sum(w[..., None] * v for w, v in zip(ws, vs))
    out = np.divide(out, tot[..., None], out=np.zeros_like(out), where=tot[..., None] > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1.0)) + m0, np.inf)
    return out, lse
