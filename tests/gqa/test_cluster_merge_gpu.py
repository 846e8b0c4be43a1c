"""The TMA kernel's cluster split merge on the GPU (kernels/gqa/common/cluster_merge.cuh): launches
of 2..16 splits run as clusters (asserted on the plan; 9..16 are non-portable), against the float64 oracle and against the
ticket merge of the same kernel (GQADRV_CLUSTER_MERGE=0), with empty splits, empty / clamped
requests and NaN-poisoned padding; repeated launches and a CUDA-graph replay with lengths changed in
place; the convenience call's layout entry re-sized across the cluster boundary."""

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check, to_device, to_host

pytestmark = pytest.mark.gpu

# batch, capacity, Hq, Hkv, D, dtype, lengths (None: the capacity), splits
CASES = [
    (1, 1024, 32, 8, 128, "float16", None, 8),
    (1, 1024, 32, 8, 128, "bfloat16", [700], 8),
    (1, 4096, 32, 8, 128, "float16", [3968], 8),
    (4, 256, 32, 8, 128, "float16", [64, 127, 191, 256], 2),
    (2, 1000, 32, 8, 128, "bfloat16", [1, 999], 3),      # request 0: splits 1.. hold no key
    (2, 777, 8, 8, 128, "float16", [0, 2**31 - 1], 5),   # empty and clamped requests
    (1, 2048, 128, 8, 128, "float16", [2047], 6),        # group 16: the 16-row build
    (1, 2048, 64, 4, 64, "bfloat16", [1500], 7),         # D 64
    (3, 600, 24, 3, 128, "float16", [600, 129, 5], 4),   # group 8, some splits empty
    (1, 300, 40, 5, 128, "bfloat16", [300], 2),
    # non-portable clusters (9..16 CTAs), few KV heads so that every cluster is resident
    (1, 4096, 32, 4, 128, "float16", [3968], 16),
    (1, 4096, 8, 2, 128, "bfloat16", [4096], 16),
    (2, 3000, 16, 2, 64, "float16", [2999, 17], 16),    # request 1: splits 1.. hold no key
    (1, 2048, 64, 4, 128, "bfloat16", [2000], 12),      # group 16: the 16-row build
    (1, 1200, 8, 1, 128, "float16", [1100], 9),
]


def _inputs(B, C, hq, hkv, D, dtype, lens, seed):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    npdt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q = rng.standard_normal((B, hq, D), dtype=np.float32).astype(npdt)
    kv = rng.standard_normal((B, 2, hkv, C, D), dtype=np.float32).astype(npdt)
    lens = np.array(lens if lens is not None else [C] * B, np.int32)
    for b, n in enumerate(lens):
        kv[b, :, :, max(0, min(int(n), C)):] = np.nan  # padding must never leak
    return q, kv, lens


def _prepared(q, kv, lens, o, splits):
    import gqadrv

    return gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens, "q_scale": 1.25},
                                     num_splits=splits)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}C{c[1]}h{c[2]}/{c[3]}d{c[4]}{c[5][:2]}S{c[7]}")
def test_cluster_merge_against_oracle_and_ticket(monkeypatch, case):
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, dtype, lens, splits = case
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    q, kv, hl = _inputs(B, C, hq, hkv, D, dtype, lens, seed=C + splits)
    dq, dkv, dl = to_device(q), to_device(kv), to_device(hl)
    ref = gqa_decode_reference(q.astype(np.float64), kv, hl, 1.25)
    o = cp.full(dq.shape, np.nan, dtype=dq.dtype)
    p = _prepared(dq, dkv, dl, o, splits)
    (plan,) = p._plans
    assert p.route.startswith("tma_") and p.num_splits == splits
    assert plan.cluster == (splits, 1, 1), "this launch should merge its splits in a cluster"
    for _ in range(3):  # repeated launches: nothing carries over between them
        gqadrv.launch_prepared(p)
    got = to_host(o).astype(np.float64)
    check(got, ref, dtype, "cluster merge")
    empty = [b for b, n in enumerate(hl) if n <= 0]
    assert np.all(got[empty] == 0)

    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")
    o2 = cp.full(dq.shape, np.nan, dtype=dq.dtype)
    p2 = _prepared(dq, dkv, dl, o2, splits)
    assert p2._plans[0].cluster is None and p2.route == p.route
    gqadrv.launch_prepared(p2)
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    np.testing.assert_allclose(got, to_host(o2).astype(np.float64), atol=tol, rtol=tol)


def test_cluster_merge_in_a_graph_with_lengths_changed_in_place():
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D = 2, 1024, 32, 8, 128
    q, kv, _ = _inputs(B, C, hq, hkv, D, "float16", None, seed=3)
    dq, dkv = to_device(q), to_device(kv)
    dl = cp.full(B, C, cp.int32)
    o = cp.empty_like(dq)
    s = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode({"Q": dq, "KV": dkv, "O": o, "sequence_lengths": dl}, stream=s)
    # the default count is one whose 16 clusters are resident at once (4 on an H100: 16 clusters of 8 are not)
    assert p._plans[0].cluster == (p.num_splits, 1, 1) and 2 <= p.num_splits <= 8
    gqadrv.launch_prepared(p)
    s.synchronize()
    with s:
        s.begin_capture()
        gqadrv.launch_prepared(p, stream=s)
        g = s.end_capture()
    for lens in ([1, 1], [C, 1], [0, C], [C - 1, 257], [63, 64], [65, 500]):
        hl = np.array(lens, np.int32)
        dl.set(hl)
        cp.cuda.Device().synchronize()
        for _ in range(2):
            g.launch(s)
        s.synchronize()
        ref = gqa_decode_reference(q.astype(np.float64), kv, hl)
        check(to_host(o).astype(np.float64), ref, "float16", "cluster merge graph")


def test_convenience_entry_resized_across_the_cluster_boundary():
    """gqa_decode's re-sizable layout entry moves between the ticket merge (16 splits) and clusters
    (8 and 6 splits) as the capacity changes; every output matches the oracle."""
    import gqadrv

    hq, hkv, D = 32, 8, 128
    for C in (4096, 1024, 700, 4096, 1024, 32768, 700):
        q, kv, hl = _inputs(1, C, hq, hkv, D, "float16", [C - 3], seed=C)
        out = gqadrv.gqa_decode(to_device(q), to_device(kv), to_device(hl))
        ref = gqa_decode_reference(q.astype(np.float64), kv, hl)
        check(to_host(out).astype(np.float64), ref, "float16", f"cluster boundary C{C}")
