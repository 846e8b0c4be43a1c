"""The FP8 wide kernel (``wide64_fp8``: tokens as wgmma M, 64 query rows as N, the two consumer
warpgroups splitting the channels of every tile and summing their S^T partials through shared
memory) on the GPU: the whole FP8 oracle grid forced onto it (every M, one to four row blocks),
batches and lengths that exercise its stage ring, partial row blocks and splits, scales that are not
powers of two or span 2^50 (its per-token and per-block exponent normalisation), NaN codes, and
agreement with seesaw_fp8."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from tests.mla.fp8_decode_cases import fp8_case, grid, padded_cache
from tests.mla.test_mla_fp8_narrow_gpu import _exact_dequant, _run, _scales
from tests.mla.test_mla_gpu import check

pytestmark = pytest.mark.gpu

BACKEND = "wide64_fp8"
WIDE_GRID = [dataclasses.replace(c, backend=BACKEND) for c in grid()]
# (b, s_q, h_q, h_kv, page, lengths, causal, splits): long requests (every stage refilled), two and
# four row blocks, a partial second row block (M 100), causal s_q 2 and 4, splits down to one tile
EXTRA = [
    (4, 1, 64, 1, 64, [4096, 4095, 4033, 4160], False, None),
    (3, 1, 128, 1, 16, [64 * 9, 64 * 9 + 1, 64 * 9 - 1], False, 1),
    (2, 2, 128, 1, 256, [3000, 129], True, 5),
    (5, 1, 64, 2, 32, [1, 2, 65, 127, 128], False, 2),
    (1, 4, 16, 1, 64, [700], True, 3),
    (2, 1, 100, 1, 128, [64 * 37, 64 * 37 + 63], False, 37),
    (1, 1, 128, 1, 1, [5000], False, None),
    (3, 1, 24, 1, 64, [64, 63, 0], False, None),
]


@pytest.mark.parametrize("case", WIDE_GRID, ids=lambda c: c.label)
def test_wide_fp8_oracle_grid(case):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(3000 + case.idx)
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
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"fp8 wide grid {case.label}")


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("idx", range(len(EXTRA)))
def test_wide_fp8_tiles_blocks_and_splits(idx, padded):
    o, lse, ro, rl = _run(EXTRA[idx], np.random.default_rng(177 + idx), padded=padded, backend=BACKEND)
    check(o, lse, ro, rl, "bfloat16", f"fp8 wide extra {EXTRA[idx]}")


@pytest.mark.parametrize("h_q", [64, 128])
def test_wide_fp8_scales_not_powers_of_two_and_wide_ranges(h_q):
    """Scales times 1.37 on every third page, 2^-30 and 2^20 on others, in the same requests and tiles
    (pages of 16: four pages per 64-token tile). The kernel folds each token's block scales, normalised
    by a power of two per token, into f16 A fragments of Q K^T, and the V scales into f16 per block
    with a running exponent; the oracle is the float64 decode of code * scale (no bf16 rounding)."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(15 + h_q)
    q, k8, bt, ln, _ = fp8_case(rng, 3, 1, h_q, 1, 16, [1000, 2049, 37])
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
    mag = np.maximum(np.abs(ro).max(axis=-1, keepdims=True), 1e-30)
    err = np.abs(g - ro) / mag
    assert float(err.max()) < 2e-2, float(err.max())
    inf = ~np.isfinite(rl)
    assert np.array_equal(np.isposinf(lse), inf)
    lerr = np.abs(lse[~inf] - rl[~inf])
    assert np.all(lerr <= 1e-3 + 1e-3 * np.abs(rl[~inf])), float(lerr.max())


def test_wide_fp8_nan_code_stays_in_its_request():
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(19)
    q, k8, bt, ln, _ = fp8_case(rng, 3, 1, 128, 1, 64, [700, 800, 900])
    k8[bt[1, 2], 5, 0, 300] = 0x7F  # a NaN code in request 1, token 2 * 64 + 5
    o, _ = gqadrv.flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512,
                                         num_splits=3, is_fp8_kvcache=True, backend=BACKEND)
    of = cp.asnumpy(o).astype(np.float32)
    assert np.isnan(of[1]).any()
    assert not np.isnan(of[0]).any() and not np.isnan(of[2]).any()


@pytest.mark.parametrize("h_q, splits", [(128, None), (64, 4), (32, None)])
def test_wide_fp8_close_to_seesaw_fp8(h_q, splits):
    """Same cache, both FP8 kernels: within bf16 output rounding of each other."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(21 + h_q)
    q, k8, bt, ln, _ = fp8_case(rng, 8, 1, h_q, 1, 64, [4096, 17, 2000, 64, 65, 3333, 1, 4000])
    args = (cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512)
    o1, l1 = gqadrv.flash_mla_with_kvcache(*args, num_splits=splits, is_fp8_kvcache=True, backend=BACKEND)
    o2, l2 = gqadrv.flash_mla_with_kvcache(*args, num_splits=splits, is_fp8_kvcache=True, backend="seesaw_fp8")
    d = float(cp.abs(o1.astype(cp.float32) - o2.astype(cp.float32)).max())
    assert d < 1e-2, d
    assert float(cp.abs(l1 - l2).max()) < 1e-3


def test_wide_fp8_is_the_default_above_16_rows():
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(23)
    q, k8, bt, ln, _ = fp8_case(rng, 2, 1, 64, 1, 64, [300, 900])
    args = (cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512)
    o1, l1 = gqadrv.flash_mla_with_kvcache(*args, is_fp8_kvcache=True)
    o2, l2 = gqadrv.flash_mla_with_kvcache(*args, is_fp8_kvcache=True, backend=BACKEND)
    assert bool(cp.array_equal(o1, o2)) and bool(cp.array_equal(l1, l2))
