"""MLA dense decode on FlashMLA's 656-byte FP8 cache (``is_fp8_kvcache=True``) on the GPU: the oracle
grid of tests/mla/fp8_decode_cases.py, bitwise agreement with the bf16 kernels on the dequantized
cache, graph replays with lengths and tables changed in place, torch float8 caches, and the
contract errors raised before any launch."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from tests.mla.fp8_decode_cases import TOL, fp8_case, grid, padded_cache
from tests.mla.test_mla_gpu import check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", grid(), ids=lambda c: c.label)
def test_fp8_oracle_grid(case):
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
    meta, _ = gqadrv.get_mla_metadata()
    o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, cp.asarray(ln), 512, meta, num_splits=case.splits,
                                           causal=case.causal, is_fp8_kvcache=True, backend=case.backend)
    ro, rl = mla_decode_reference(q, kdq, bt, ln, 512, None, case.causal)
    assert o.shape == (case.b, case.s_q, case.h_q, 512) and o.dtype == q.dtype
    assert lse.shape == (case.b, case.h_q, case.s_q)
    assert TOL == 2e-2
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"fp8 grid {case.backend or 'auto'}")
    o2, lse2 = gqadrv.flash_mla_with_kvcache(dq, dk, dbt, cp.asarray(ln), 512, meta, num_splits=case.splits,
                                             causal=case.causal, is_fp8_kvcache=True, backend=case.backend)
    assert cp.array_equal(o2, o) and cp.array_equal(lse2, lse)


@pytest.mark.parametrize("fp8_backend,bf16_backend", [("seesaw_fp8", "seesaw"), ("mma_fp8", "mma")])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_equals_bf16_kernel_on_dequantized_cache(fp8_backend, bf16_backend, splits):
    """The FP8 kernels write exactly the bf16 tile dequantize_k_cache gives, and keep the GEMMs of
    their bf16 twins: outputs and LSE are bitwise equal to the bf16 kernel on the dequantized cache."""
    import cupy as cp

    import gqadrv
    from gqadrv.mla import dequantize_k_cache

    rng = np.random.default_rng(7)
    q, k8, bt, ln, _ = fp8_case(rng, 3, 2, 64, 1, 16, [1000, 37, 2049])
    # both dequantization paths of the kernels: the fast one (power-of-two scales up to 2^7, the
    # quantizer's 2^-8 / 2^-7 here; pages 1::7 times 2^14 reach 2^6 / 2^7, the top of that range) and the
    # exact one (any other scale: every third page's scales times 1.37, pages 2::7 times 2^20, powers of
    # two above 2^7; a NaN code in request 2). Unused rows hold NaN scales (0xFF poison).
    sc = k8[..., 512:528].copy().view("<f4")
    assert float(np.nanmax(sc)) <= 2.0 ** -7
    sc[1::7] *= np.float32(2.0 ** 14)
    sc[2::7] *= np.float32(2.0 ** 20)
    sc[::3] *= np.float32(1.37)
    k8[..., 512:528] = sc.view(np.uint8)
    k8[bt[2, 5], 3, 0, 77] = 0x7F
    dq, dk8, dbt, dl = cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln)
    o8, l8 = gqadrv.flash_mla_with_kvcache(dq, dk8, dbt, dl, 512, num_splits=splits, causal=True,
                                           is_fp8_kvcache=True, backend=fp8_backend)
    kdq = dequantize_k_cache(dk8)
    o16, l16 = gqadrv.flash_mla_with_kvcache(dq, kdq, dbt, dl, 512, num_splits=splits, causal=True,
                                             backend=bf16_backend)
    cp.cuda.Device().synchronize()
    assert cp.array_equal(o8.view(cp.uint16), o16.view(cp.uint16))
    assert cp.array_equal(l8.view(cp.uint32), l16.view(cp.uint32))
    assert bool(cp.isnan(o8[2].astype(cp.float32)).all()) and not bool(cp.isnan(o8[:2].astype(cp.float32)).any())


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("splits", [None, 4])
def test_fp8_graph_replay_follows_lengths_and_block_table(page, splits):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(3)
    L = 1536
    q, k8, bt, ln, kdq = fp8_case(rng, 4, 1, 128, 1, page, [L] * 4)
    dq, dk, dbt, dl = cp.asarray(q), padded_cache(k8), cp.asarray(bt), cp.asarray(ln)
    o = cp.full((4, 1, 128, 512), np.nan, q.dtype)
    lse = cp.empty((4, 128, 1), cp.float32)
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_mla_decode(dq, dk, dbt, dl, out=o, lse=lse, num_splits=splits, stream=st, is_fp8_kvcache=True)
    assert "wide64_fp8" in p.route or "mma_fp8" in p.route  # h_q 128: the sm_90 default is wide64_fp8
    with st:
        st.begin_capture()
        gqadrv.launch_prepared(p)
        g = st.end_capture()
    cap = bt.shape[1] * page
    for state in ([L, L, L, L], [0, 1, cap, 17], [5, L - 1, 0, 640], [cap + 9, -4, 333, 1]):
        ln2 = np.array(state, np.int32)
        bt2 = bt.copy()
        for i in range(4):
            n = -(-min(max(int(ln2[i]), 0), cap) // page)
            if n <= -(-int(ln[i]) // page):
                bt2[i, :n] = rng.permutation(bt[i, :n])
        dl.set(ln2)
        dbt.set(bt2)
        g.launch(st)
        st.synchronize()
        ro, rl = mla_decode_reference(q, kdq, bt2, ln2, 512, None, False)
        check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", "fp8 graph replay")


def test_fp8_torch_float8_cache():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    import gqadrv

    rng = np.random.default_rng(11)
    q, k8, bt, ln, kdq = fp8_case(rng, 2, 1, 16, 1, 64, [300, 129])
    tq = torch.from_numpy(q.view(np.int16)).cuda().view(torch.bfloat16)
    tk = torch.from_numpy(k8).cuda().view(torch.float8_e4m3fn)
    o, lse = gqadrv.flash_mla_with_kvcache(tq, tk, torch.from_numpy(bt).cuda(), torch.from_numpy(ln).cuda(), 512,
                                           is_fp8_kvcache=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
    ro, rl = mla_decode_reference(q, kdq, bt, ln, 512, None, False)
    check(o.float().cpu().numpy(), lse.cpu().numpy(), ro, rl, "bfloat16", "fp8 torch float8")


def _small():
    import cupy as cp

    rng = np.random.default_rng(5)
    q, k8, bt, ln, _ = fp8_case(rng, 2, 1, 16, 1, 16, [40, 3])
    return cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln)


def test_fp8_contract_errors():
    import cupy as cp

    import gqadrv

    q, k8, bt, ln = _small()
    f = gqadrv.flash_mla_with_kvcache
    with pytest.raises(TypeError, match="bfloat16 q"):
        f(q.astype(cp.float16), k8, bt, ln, 512, is_fp8_kvcache=True)
    with pytest.raises(TypeError, match="is_fp8_kvcache=True"):
        f(q, k8, bt, ln, 512)  # an FP8 cache without the flag
    with pytest.raises(TypeError, match="is_fp8_kvcache must be a bool"):
        f(q, k8, bt, ln, 512, is_fp8_kvcache=1)
    with pytest.raises(ValueError, match="656 bytes"):
        f(q, k8[..., :640], bt, ln, 512, is_fp8_kvcache=True)
    with pytest.raises(TypeError, match="dtype"):
        f(q, k8.view(cp.uint16), bt, ln, 512, is_fp8_kvcache=True)
    wide = cp.zeros(k8.shape[:-1] + (664,), cp.uint8)[..., :656]  # rows 664 bytes apart: not 16-byte aligned
    with pytest.raises(ValueError, match="multiples of 16"):
        f(q, wide, bt, ln, 512, is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="reads bf16 / fp16 caches"):
        f(q, k8, bt, ln, 512, is_fp8_kvcache=True, backend="seesaw")
    with pytest.raises(ValueError, match="pass is_fp8_kvcache=True"):
        kb = cp.zeros(k8.shape[:-1] + (576,), q.dtype)
        f(q, kb, bt, ln, 512, backend="seesaw_fp8")
    with pytest.raises(ValueError, match="sparse MLA path: pass indices"):
        f(q, k8, bt, ln, 512, is_fp8_kvcache=True, attn_sink=cp.zeros((q.shape[2],), cp.float32))
    meta, _ = gqadrv.get_mla_metadata()
    f(q, k8, bt, ln, 512, meta, is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="fp8 cache"):
        f(q, cp.zeros(k8.shape[:-1] + (576,), q.dtype), bt, ln, 512, meta)  # same metadata, bf16 cache
