"""Layout-keyed plans of the paged convenience call on the GPU (gqadrv/gqa/paged_layouts.py):
repeated ``gqa_decode_paged`` calls with the same layout and new tensors every call give each call's
own result (no stale pool, table, output or tensor-map address) on the TMA route (NHD / HND, separate
and combined pools, 4-token queries with LSE) and the cp.async route (page 1), on an FP8 cache with
per-head device scales, with outputs given and allocated; known layouts with an output overlapping an
input raise the documented error and launch nothing; one entry per layout; torch tensors every call."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_paged_reference, paged_kv_from_contiguous
from tests.gqa.paged_cases import check_paged, np_dtype

pytestmark = pytest.mark.gpu

B, HQ, HKV, D = 3, 16, 4, 128


def _sets(n, page, layout, combined, s_q, max_pages, seed):
    """n host cases of one layout: (q, k_pool, v_pool, table, lengths, ref_out, ref_lse)."""
    rng = np.random.default_rng(seed)
    dt = np_dtype("float16")
    cap = page * max_pages
    out = []
    for i in range(n):
        q = rng.standard_normal((B, s_q, HQ, D), dtype=np.float32).astype(dt)
        k = rng.standard_normal((B, cap, HKV, D), dtype=np.float32).astype(dt)
        v = rng.standard_normal((B, cap, HKV, D), dtype=np.float32).astype(dt)
        lens = [max(1, cap - 37 * i - 11 * r) for r in range(B)]
        kc, vc, bt = paged_kv_from_contiguous(k, v, lens, page, kv_layout=layout, combined=combined,
                                              max_pages=max_pages, rng=rng, fill=np.nan)
        kc, vc = (None if c is None else _pad_pages(c, B * max_pages + 1) for c in (kc, vc))  # one pool size
        ln = np.array(lens, np.int32)
        ro, rl = gqa_decode_paged_reference(q, kc, vc, bt, ln, kv_layout=layout)
        out.append((q, kc, vc, bt, ln, ro, rl))
    return out


def _pad_pages(pool: np.ndarray, n: int) -> np.ndarray:
    """The pool with NaN pages appended up to n pages (every set of one layout has the same pool)."""
    pad = np.full((n - pool.shape[0],) + pool.shape[1:], np.nan, pool.dtype)
    return np.concatenate([pool, pad])


# (page, layout, combined, s_q, max_pages): TMA route (pages >= 16), cp.async route (page 1)
SHAPES = [(16, "NHD", False, 1, 40), (16, "HND", True, 1, 40), (64, "NHD", True, 4, 12), (1, "NHD", False, 1, 700)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "p{}_{}_{}_s{}".format(s[0], s[1], "comb" if s[2] else "sep", s[3]))
@pytest.mark.parametrize("given", [False, True], ids=["alloc", "given"])
def test_new_tensors_every_call_give_their_own_results(shape, given, launches):
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import paged_layouts

    page, layout, combined, s_q, max_pages = shape
    sets = _sets(3, page, layout, combined, s_q, max_pages, seed=page + s_q)
    dev = [tuple(None if x is None else cp.asarray(x) for x in t[:5]) for t in sets]
    outs = [(cp.full((B, s_q, HQ, D), np.nan, cp.float16), cp.full((B, s_q, HQ), np.nan, cp.float32)) for _ in sets]
    paged_layouts.layouts.clear()
    for rnd in range(2):  # second round: every address seen before, in a new order
        for i in (range(3) if rnd == 0 else (2, 0, 1)):
            q, k, v, bt, ln = dev[i]
            kw = {"out": outs[i][0], "lse": outs[i][1]} if given else {"return_lse": True}
            o, lse = gqadrv.gqa_decode_paged(q, k, v, bt, ln, kv_layout=layout, **kw)
            if given:
                assert o is outs[i][0] and lse is outs[i][1]
            check_paged(cp.asnumpy(o), cp.asnumpy(lse), sets[i][5], sets[i][6], "float16", f"paged layout plan {shape} {i}")
    assert len(paged_layouts.layouts) == 1
    assert len(launches) == 6


def test_fp8_cache_with_device_scales_every_call():
    """e4m3 pools (quantize_kv_fp8 of NaN-free pools) with per-KV-head float32 device scales: the two
    scale arrays are slots of the layout (patched like the tensors); the oracle decodes the codes."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import paged_layouts
    from gqadrv.gqa.fp8_reference import dequantize_kv_fp8_reference

    sets = _sets(3, 16, "NHD", False, 1, 20, seed=3)
    paged_layouts.layouts.clear()
    counts = []
    for _ in range(2):
        for q, kc, vc, bt, ln, _, _ in sets:
            pools, refs, scales = [], [], []
            for c in (kc, vc):
                codes, sc = gqadrv.quantize_kv_fp8(cp.asarray(np.nan_to_num(c)), scale=None)
                sc = float(cp.asnumpy(sc)) if not isinstance(sc, float) else sc
                pools.append(codes)
                refs.append(dequantize_kv_fp8_reference(cp.asnumpy(codes), sc))
                scales.append(cp.full((HKV,), sc, cp.float32))
            ro, rl = gqa_decode_paged_reference(q, refs[0], refs[1], bt, ln, kv_layout="NHD")
            o, lse = gqadrv.gqa_decode_paged(cp.asarray(q), pools[0], pools[1], cp.asarray(bt), cp.asarray(ln),
                                             return_lse=True, kv_dtype="e4m3", k_scale=scales[0], v_scale=scales[1])
            check_paged(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "float16", "paged fp8 layout plan", record=False)
        counts.append(len(paged_layouts.layouts))
    assert counts == [1, 1]


def test_known_layout_refusals(launches):
    import cupy as cp

    import gqadrv

    (q, kc, vc, bt, ln, _, _), = _sets(1, 16, "NHD", False, 1, 10, seed=5)
    dq, dk, dv, dbt, dl = (cp.asarray(x) for x in (q, kc, vc, bt, ln))
    o = cp.empty((B, 1, HQ, D), cp.float16)
    lse = cp.empty((B, 1, HQ), cp.float32)
    gqadrv.gqa_decode_paged(dq, dk, dv, dbt, dl, out=o, lse=lse)   # the layout is known now
    n = len(launches)
    with pytest.raises(ValueError, match="overlap"):   # out over the K pool's memory, out's own layout
        gqadrv.gqa_decode_paged(dq, dk, dv, dbt, dl, out=dk.reshape(-1)[:o.size].reshape(o.shape), lse=lse)
    with pytest.raises(ValueError, match="overlap"):   # lse over q's memory, lse's own layout
        gqadrv.gqa_decode_paged(dq, dk, dv, dbt, dl, out=o,
                                lse=dq.reshape(-1).view(cp.float32)[:lse.size].reshape(lse.shape))
    assert len(launches) == n


def test_torch_tensors_every_call():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import gqadrv
    from gqadrv.gqa import paged_layouts

    sets = _sets(3, 16, "NHD", False, 1, 30, seed=8)
    paged_layouts.layouts.clear()
    for _ in range(2):
        for q, kc, vc, bt, ln, ro, rl in sets:
            tq, tk, tv, tbt, tl = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in (q[:, 0], kc, vc, bt, ln))
            o, lse = gqadrv.gqa_decode_paged(tq, tk, tv, tbt, tl, return_lse=True)
            assert isinstance(o, torch.Tensor) and lse.dtype == torch.float32
            check_paged(o.float().cpu().numpy(), lse.cpu().numpy(), ro[:, 0], rl[:, 0], "float16", "paged torch")
    assert len(paged_layouts.layouts) == 1
