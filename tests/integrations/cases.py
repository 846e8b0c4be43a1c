"""Small host cases and checks shared by the torch / JAX GPU tests: inputs are drawn on the host,
rounded to fp16 / bf16 and compared with the float64 oracles (gqadrv.gqa_decode_reference,
gqadrv.mla_decode_reference) computed from the rounded values."""

from __future__ import annotations

import numpy as np

from gqadrv.gqa.reference import gqa_decode_reference
from gqadrv.mla.reference import mla_decode_reference
from gqadrv.mla.selftest import make_case
from tests.gqa.cases import TOL
from tests.gqa.cases import check as check_gqa  # noqa: F401 - re-exported
from tests.helpers import record_error

# GQA: B, Hq, Hkv, C, D. C = 300 is above the short route's capacity, so the split route runs (with
# gqadrv's workspace) and the lengths below cross KV tiles.
GQA_SHAPE = (3, 16, 4, 300, 128)
GQA_LENGTHS = ([300, 17, 0], [1, 300, 64], [299, -3, 400], [65, 128, 2])  # incl. <= 0 and > C (clamped)
# MLA: b, s_q, h_q, h_kv, page; capacity = pages * page per request.
MLA_SHAPE = (2, 2, 16, 1, 64)
MLA_PAGES = 5
MLA_LENGTHS = ([320, 1], [0, 320], [64, 65], [319, 2])


def np_dtype(name: str):
    import ml_dtypes

    return np.float16 if name == "float16" else np.dtype(ml_dtypes.bfloat16)


def gqa_inputs(seed: int, dtype: str = "float16", layers: int | None = None):
    """q [B, Hq, D] and kv [B, 2, Hkv, C, D] (or [layers, B, 2, Hkv, C, D]) host arrays in ``dtype``."""
    B, Hq, Hkv, C, D = GQA_SHAPE
    rng = np.random.default_rng(seed)
    kv_shape = (B, 2, Hkv, C, D) if layers is None else (layers, B, 2, Hkv, C, D)
    q = rng.standard_normal((B, Hq, D), dtype=np.float32).astype(np_dtype(dtype))
    kv = rng.standard_normal(kv_shape, dtype=np.float32).astype(np_dtype(dtype))
    return q, kv


def gqa_ref(q, kv, lengths, q_scale: float = 1.0) -> np.ndarray:
    return gqa_decode_reference(np.asarray(q).astype(np.float64), kv, np.asarray(lengths, np.int32), q_scale)


def mla_inputs(seed: int, dtype: str = "bfloat16"):
    """q, k_cache, block_table host arrays of a paged MLA case whose every request holds
    ``MLA_PAGES`` pages (so any length up to the capacity is valid), shuffled pages."""
    b, s_q, h_q, h_kv, page = MLA_SHAPE
    rng = np.random.default_rng(seed)
    q, k, bt, _ = make_case(rng, b, s_q, h_q, h_kv, page, [MLA_PAGES * page] * b, dtype)
    return q, k, bt


def mla_ref(q, k, bt, lengths, softmax_scale: float | None = None, causal: bool = True):
    return mla_decode_reference(q, k, bt, np.asarray(lengths, np.int32), 512, softmax_scale, causal)


def check_mla(got_o, got_l, ref, dtype: str, label: str) -> None:
    """out within the dtype's tolerance, lse within 1e-3 (relative + absolute), +inf exactly where
    the oracle's row has no key."""
    ref_o, ref_l = ref
    g = np.asarray(got_o, np.float64)
    tol = TOL[dtype]
    assert np.all(np.isfinite(g)), f"{label}: non-finite output"
    err = np.abs(g - ref_o)
    assert not (err > tol + tol * np.abs(ref_o)).any(), f"{label}: out off, max {err.max():.3e}"
    gl = np.asarray(got_l, np.float64)
    empty = ~np.isfinite(ref_l)
    assert np.array_equal(np.isposinf(gl), empty), f"{label}: lse +inf rows differ"
    lerr = np.abs(gl[~empty] - ref_l[~empty]) if (~empty).any() else np.zeros(1)
    assert np.all(lerr <= 1e-3 + 1e-3 * np.abs(ref_l[~empty])), f"{label}: lse off by {lerr.max():.3e}"
    record_error(f"mla {label} out", float(err.max()))
    record_error(f"mla {label} lse", float(lerr.max()))
