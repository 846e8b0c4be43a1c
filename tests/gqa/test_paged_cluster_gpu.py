"""The paged TMA kernel's cluster split merge on the GPU (kernels/gqa/common/cluster_merge.cuh,
sm90/decode_paged_tma.cu): balanced splits of 2..16 run as clusters (asserted on the plan), with
multi-token queries (several row blocks per request), LSE, NHD / HND pools, shuffled pages, empty
and clamped requests, against the float64 oracle and the ticket merge of the same kernel
(GQADRV_CLUSTER_MERGE=0); a CUDA-graph replay with lengths changed in place; the batch-invariant
mode keeps the ticket."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_paged_reference
from tests.gqa.paged_cases import check_paged, dense_case, prepare_poisoned

pytestmark = pytest.mark.gpu

# batch, capacity, Hq, Hkv, D, dtype, page, layout, s_q, lengths, splits
CASES = [
    (1, 4096, 32, 4, 128, "float16", 16, "NHD", 1, [4000], 16),
    (1, 4096, 32, 8, 128, "bfloat16", 16, "NHD", 1, [4096], 8),
    (2, 2048, 8, 1, 128, "float16", 64, "HND", 4, [2048, 5], 12),       # 4 x 8 rows: two row blocks of 16
    (3, 1024, 8, 1, 64, "bfloat16", 32, "NHD", 2, [1000, 0, 10**9], 5),  # empty and clamped requests
    (1, 3000, 64, 4, 128, "float16", 128, "NHD", 1, [2999], 16),         # group 16: the 16-row build
    (2, 777, 24, 3, 128, "bfloat16", 16, "HND", 3, [777, 40], 3),        # request 1: most splits empty
    (1, 8192, 4, 1, 128, "float16", 256, "NHD", 16, [8000], 9),        # 16 x 4 rows: four row blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}C{c[1]}h{c[2]}/{c[3]}d{c[4]}{c[5][:2]}p{c[6]}{c[7]}"
                                                     f"sq{c[8]}S{c[10]}")
def test_paged_cluster_merge_against_oracle_and_ticket(monkeypatch, case):
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, dtype, page, layout, s_q, lens, splits = case
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    q, kc, vc, bt, hl, ref_out, ref_lse = dense_case(B, C, hq, hkv, D, dtype, page, layout, s_q, lens, seed=C + splits)
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    p, o, lb = prepare_poisoned(d, layout, splits)
    (plan,) = p._plans
    assert p.route.startswith("paged_tma_") and p.num_splits == splits
    assert plan.cluster == (splits, 1, 1), "this launch should merge its splits in a cluster"
    for _ in range(3):  # repeated launches: nothing carries over between them
        gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    got_o, got_l = cp.asnumpy(o), cp.asnumpy(lb)
    check_paged(got_o, got_l, ref_out, ref_lse, dtype, "paged cluster merge")

    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")
    p2, o2, lb2 = prepare_poisoned(d, layout, splits)
    assert p2._plans[0].cluster is None and p2.route == p.route
    gqadrv.launch_prepared(p2)
    cp.cuda.Device().synchronize()
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    np.testing.assert_allclose(got_o.astype(np.float64), cp.asnumpy(o2).astype(np.float64), atol=tol, rtol=tol)
    np.testing.assert_allclose(got_l, cp.asnumpy(lb2), atol=1e-4, rtol=1e-5)


def test_paged_cluster_merge_convenience_and_graph():
    """The convenience call (its layout replay too) and a captured prepared launch replayed with
    lengths changed in place, every output against the oracle."""
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, page = 2, 2048, 16, 2, 128, 16
    lens0 = [C, C]
    q, kc, vc, bt, hl, _, _ = dense_case(B, C, hq, hkv, D, "float16", page, "NHD", 1, lens0, seed=5)
    dq, dkc, dvc, dbt = (cp.asarray(x) for x in (q, kc, vc, bt))
    dl = cp.asarray(hl)
    for _ in range(2):
        out, lse = gqadrv.gqa_decode_paged(dq, dkc, dvc, dbt, dl, num_splits=8, return_lse=True)
        ref_out, ref_lse = gqa_decode_paged_reference(q, kc, vc, bt, hl)
        check_paged(cp.asnumpy(out), cp.asnumpy(lse), ref_out, ref_lse, "float16", "paged cluster convenience")
    s = cp.cuda.Stream(non_blocking=True)
    p, o, lb = prepare_poisoned((dq, dkc, dvc, dbt, dl), "NHD", 8)
    assert p._plans[0].cluster == (8, 1, 1)
    gqadrv.launch_prepared(p, stream=s)
    s.synchronize()
    with s:
        s.begin_capture()
        gqadrv.launch_prepared(p, stream=s)
        g = s.end_capture()
    for lens in ([1, 1], [C, 1], [0, C], [C - 1, 257], [17, 16], [65, 500]):
        h = np.array(lens, np.int32)
        dl.set(h)
        cp.cuda.Device().synchronize()
        for _ in range(2):
            g.launch(s)
        s.synchronize()
        ref_out, ref_lse = gqa_decode_paged_reference(q, kc, vc, bt, h)
        check_paged(cp.asnumpy(o), cp.asnumpy(lb), ref_out, ref_lse, "float16", "paged cluster graph")


def test_deterministic_mode_keeps_the_ticket():
    import cupy as cp

    import gqadrv

    q, kc, vc, bt, hl, ref_out, ref_lse = dense_case(1, 4096, 32, 8, 128, "float16", 16, "NHD", 1, [4096], seed=9)
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    o = cp.empty_like(d[0])
    lb = cp.empty(d[0].shape[:3], cp.float32)
    p = gqadrv.prepare_gqa_decode_paged(q=d[0], k_cache=d[1], v_cache=d[2], block_table=d[3], seq_lens=d[4], out=o,
                                        lse=lb, deterministic=True)
    assert p.num_splits > 1 and p._plans[0].cluster is None
    gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    check_paged(cp.asnumpy(o), cp.asnumpy(lb), ref_out, ref_lse, "float16", "paged deterministic")
