"""The FP8 narrow kernel (``narrow16_fp8``: tokens as wgmma M, e4m3 codes dequantized into register
fragments, M = s_q * h_q / h_kv <= 16) on the GPU: every case of the FP8 oracle grid with M <= 16
forced onto it, batches and lengths that exercise its two-warpgroup tile split and its refills,
scales that are not powers of two or span 2^50 inside one tile (its per-block exponent
normalisation), NaN codes, and agreement with seesaw_fp8."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from tests.mla.fp8_decode_cases import fp8_case, grid, padded_cache
from tests.mla.test_mla_gpu import check

pytestmark = pytest.mark.gpu

BACKEND = "narrow16_fp8"
NARROW_GRID = [dataclasses.replace(c, backend=BACKEND) for c in grid() if c.s_q * c.h_q // c.h_kv <= 16]
# (b, s_q, h_q, h_kv, page, lengths, causal, splits): long requests (many tiles per warpgroup, every
# stage refilled), odd tile counts (warpgroup 1 one tile short), splits that leave one CTA one tile
EXTRA = [
    (4, 1, 16, 1, 64, [4096, 4095, 4033, 4160], False, None),
    (3, 1, 16, 1, 16, [64 * 9, 64 * 9 + 1, 64 * 9 - 1], False, 1),
    (2, 2, 8, 1, 256, [3000, 129], True, 5),
    (5, 1, 16, 2, 32, [1, 2, 65, 127, 128], False, 2),
    (1, 16, 1, 1, 64, [700], True, 3),
    (2, 1, 5, 1, 128, [64 * 37, 64 * 37 + 63], False, 37),
    (1, 1, 16, 1, 1, [5000], False, None),
]


def _run(case_args, rng, code_dtype="uint8", mutate=None, padded=True, backend=BACKEND):
    import cupy as cp

    import gqadrv

    b, s_q, h_q, h_kv, page, lens, causal, splits = case_args
    q, k8, bt, ln, _ = fp8_case(rng, b, s_q, h_q, h_kv, page, lens)
    if mutate is not None:
        mutate(k8, bt)
    from gqadrv.mla.fp8_reference import dequantize_k_cache_reference

    kdq = dequantize_k_cache_reference(k8)
    # padded rows (672 bytes apart: one copy per row) or dense ones (656: one copy per 16-row run)
    dk = padded_cache(k8, code_dtype) if padded else cp.asarray(k8)
    o, lse = gqadrv.flash_mla_with_kvcache(cp.asarray(q), dk, cp.asarray(bt), cp.asarray(ln), 512, num_splits=splits,
                                           causal=causal, is_fp8_kvcache=True, backend=backend)
    ro, rl = mla_decode_reference(q, kdq, bt, ln, 512, None, causal)
    return cp.asnumpy(o), cp.asnumpy(lse), ro, rl


@pytest.mark.parametrize("case", NARROW_GRID, ids=lambda c: c.label)
def test_narrow_fp8_oracle_grid(case):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(1000 + case.idx)
    q, k8, bt, ln, kdq = fp8_case(rng, case.b, case.s_q, case.h_q, case.h_kv, case.page, case.lens(rng))
    qw = cp.zeros(q.shape[:-1] + (640,), q.dtype)
    qw[..., :576] = cp.asarray(q)
    dq = qw[..., :576]
    dk = padded_cache(k8, case.code_dtype)
    bw = cp.full((bt.shape[0], bt.shape[1] + 3), 2147480000, np.int32)
    bw[:, : bt.shape[1]] = cp.asarray(bt)
    dbt = bw[:, : bt.shape[1]]
    o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, cp.asarray(ln), 512, num_splits=case.splits,
                                           causal=case.causal, is_fp8_kvcache=True, backend=BACKEND)
    ro, rl = mla_decode_reference(q, kdq, bt, ln, 512, None, case.causal)
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"fp8 narrow grid {case.label}")


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("idx", range(len(EXTRA)))
def test_narrow_fp8_tiles_and_splits(idx, padded):
    o, lse, ro, rl = _run(EXTRA[idx], np.random.default_rng(77 + idx), padded=padded)
    check(o, lse, ro, rl, "bfloat16", f"fp8 narrow extra {EXTRA[idx]}")


def _scales(k8):
    return k8[..., 512:528].copy().view("<f4")


def _exact_dequant(k8):
    """float64 code * scale (no bf16 rounding) and the bf16 RoPE: the values the kernel multiplies."""
    import ml_dtypes

    codes = k8[..., :512].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sc = np.repeat(_scales(k8).astype(np.float64), 128, axis=-1)
    rope = k8[..., 528:656].copy().view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([codes * sc, rope], axis=-1)


def test_narrow_fp8_scales_not_powers_of_two_and_wide_ranges():
    """Scales times 1.37 on every third page, 2^-30 and 2^20 on others, in the same requests and tiles
    (pages of 16: four pages per 64-token tile). The kernel applies the scales in fp32 (Q K^T) and
    f16 (V) without rounding each dequantized element to bf16, so the oracle here is the float64
    decode of code * scale; the per-block exponent normalisation keeps the 2^50 range exact."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(5)
    q, k8, bt, ln, _ = fp8_case(rng, 3, 1, 16, 1, 16, [1000, 2049, 37])
    sc = _scales(k8)
    sc[::3] *= np.float32(1.37)
    sc[1::5] *= np.float32(2.0 ** -30)
    sc[2::7] *= np.float32(2.0 ** 20)
    k8[..., 512:528] = sc.view(np.uint8)
    kx = _exact_dequant(k8)
    o, lse = gqadrv.flash_mla_with_kvcache(cp.asarray(q), padded_cache(k8), cp.asarray(bt), cp.asarray(ln), 512,
                                           num_splits=2, causal=True, is_fp8_kvcache=True, backend=BACKEND)
    ro, rl = mla_decode_reference(q, kx, bt, ln, 512, None, True)
    g, lse = np.asarray(cp.asnumpy(o), np.float64), cp.asnumpy(lse)
    assert np.all(np.isfinite(g))
    # outputs span 2^50 between rows: relative to each row's largest value
    mag = np.maximum(np.abs(ro).max(axis=-1, keepdims=True), 1e-30)
    err = np.abs(g - ro) / mag
    assert float(err.max()) < 2e-2, float(err.max())
    inf = ~np.isfinite(rl)
    assert np.array_equal(np.isposinf(lse), inf)
    lerr = np.abs(lse[~inf] - rl[~inf])
    assert np.all(lerr <= 1e-3 + 1e-3 * np.abs(rl[~inf])), float(lerr.max())


def test_narrow_fp8_nan_code_stays_in_its_request():
    def mutate(k8, bt):
        k8[bt[1, 2], 5, 0, 300] = 0x7F  # a NaN code in request 1, token 2 * 64 + 5

    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(9)
    q, k8, bt, ln, _ = fp8_case(rng, 3, 1, 16, 1, 64, [700, 800, 900])
    mutate(k8, bt)
    o, _ = gqadrv.flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512,
                                         num_splits=3, is_fp8_kvcache=True, backend=BACKEND)
    of = cp.asnumpy(o).astype(np.float32)
    assert np.isnan(of[1]).any()
    assert not np.isnan(of[0]).any() and not np.isnan(of[2]).any()


@pytest.mark.parametrize("splits", [None, 4])
def test_narrow_fp8_close_to_seesaw_fp8(splits):
    """Same cache, both FP8 kernels: within bf16 output rounding of each other (they differ only in
    the order of fp32 sums and in f16 vs bf16 rounding of P)."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(11)
    q, k8, bt, ln, _ = fp8_case(rng, 8, 1, 16, 1, 64, [4096, 17, 2000, 64, 65, 3333, 1, 4000])
    args = (cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512)
    o1, l1 = gqadrv.flash_mla_with_kvcache(*args, num_splits=splits, is_fp8_kvcache=True, backend=BACKEND)
    o2, l2 = gqadrv.flash_mla_with_kvcache(*args, num_splits=splits, is_fp8_kvcache=True, backend="seesaw_fp8")
    d = float(cp.abs(o1.astype(cp.float32) - o2.astype(cp.float32)).max())
    assert d < 1e-2, d
    assert float(cp.abs(l1 - l2).max()) < 1e-3
