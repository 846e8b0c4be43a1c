"""Prepared decode on the GPU: CUDA graphs from cuda-python, CuPy and torch replayed with lengths
changed in place, two concurrent streams, object lifetime, and the host cost of a launch."""

import gc
import statistics
import time

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu

GRAPH_SHAPES = [  # batch, capacity, Hq, Hkv, D, dtype
    (1, 64, 32, 8, 128, "float16"),
    (4, 256, 32, 8, 128, "float16"),
    (1, 1024, 32, 8, 128, "float16"),
    (1, 4096, 32, 8, 128, "float16"),
    (3, 2000, 32, 2, 256, "bfloat16"),
]


def length_states(B, C, n=16):
    rng = np.random.default_rng(B * 7919 + C)
    fixed = [[1] * B, [C] * B, [C - 1] * B, [min(C, 64)] * B, [min(C, 65)] * B, [min(C, 33)] * B]
    if B > 1:
        fixed.append([1] + [C] * (B - 1))
        fixed.append([0] + [C // 2] * (B - 1))
    states = fixed + [list(rng.integers(1, C + 1, size=B)) for _ in range(n - len(fixed))]
    return [np.array(s, np.int32) for s in states]


def make(shape, seed=0):
    import cupy as cp
    import ml_dtypes

    B, C, hq, hkv, d, dt = shape
    rng = np.random.default_rng(seed)
    npdt = np.float16 if dt == "float16" else ml_dtypes.bfloat16
    q = rng.standard_normal((B, hq, d), dtype=np.float32).astype(npdt)
    kv = rng.standard_normal((B, 2, hkv, C, d), dtype=np.float32).astype(npdt)
    from tests.helpers import to_device

    return q, kv, to_device(q), to_device(kv), cp.zeros(B, cp.int32)


@pytest.mark.parametrize("backend", [None, "portable"])
@pytest.mark.parametrize("shape", GRAPH_SHAPES, ids=lambda s: f"B{s[0]}C{s[1]}h{s[2]}/{s[3]}d{s[4]}{s[5][:2]}")
@pytest.mark.parametrize("api", ["cuda-python", "cupy", "torch"])
def test_graph_replay_with_lengths_updated_in_place(api, shape, backend):
    import cupy as cp

    import gqadrv

    q, kv, dq, dkv, dlen = make(shape, seed=len(api))
    B, C = shape[0], shape[1]
    states = length_states(B, C)
    assert len(states) >= 15 and any((s == 1).all() for s in states) and any((s == C).all() for s in states)
    o = cp.empty_like(dq)
    dlen.set(states[0])
    side = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode({"Q": dq, "KV": dkv, "O": o, "sequence_lengths": dlen, "q_scale": 1.5},
                                  stream=side, backend=backend)
    gqadrv.launch_prepared(p)  # warm launch outside capture
    side.synchronize()

    if api == "cuda-python":
        from cuda.bindings import driver as drv

        from gqadrv.runtime.driver import check as ck

        h = int(side.ptr)
        ck(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin")
        gqadrv.launch_prepared(p, stream=h)
        gexec = ck(drv.cuGraphInstantiate(ck(drv.cuStreamEndCapture(h), "end"), 0), "instantiate")
        replay = lambda: ck(drv.cuGraphLaunch(gexec, h), "launch")  # noqa: E731
        sync = side.synchronize
    elif api == "cupy":
        with side:
            side.begin_capture()
            gqadrv.launch_prepared(p, stream=side)
            g = side.end_capture()
        replay = lambda: g.launch(side)  # noqa: E731
        sync = side.synchronize
    else:
        torch = pytest.importorskip("torch")
        ts = torch.cuda.Stream()
        torch.cuda.synchronize()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg, stream=ts):
            gqadrv.launch_prepared(p, stream=torch.cuda.current_stream())
        replay = tg.replay
        sync = torch.cuda.synchronize

    for lens in states:
        dlen.set(lens)  # same device address, new values
        cp.cuda.Device().synchronize()
        for _ in range(3):
            replay()
        sync()
        ref = gqa_decode_reference(q.astype(np.float64), kv, lens, 1.5)
        check(cp.asnumpy(o).astype(np.float64), ref, shape[5], f"graph {api}")


@pytest.mark.parametrize("backend", [None, "portable"])
@pytest.mark.parametrize("shape,splits", [
    ((1, 1024, 32, 8, 128, "float16"), 2),
    ((2, 4096, 32, 8, 128, "float16"), 64),   # 64 splits: 16 lanes per item in the merge
    ((3, 2000, 32, 2, 256, "bfloat16"), 7),   # group 16, D 256
    ((2, 1000, 48, 3, 64, "bfloat16"), 33),   # group 16, odd split count
    ((1, 300, 16, 16, 64, "float16"), 5),     # group 1
], ids=lambda v: f"B{v[0]}C{v[1]}h{v[2]}/{v[3]}d{v[4]}{v[5][:2]}" if isinstance(v, tuple) else f"S{v}")
def test_split_merge_resets_its_counters_every_launch(shape, splits, backend):
    """After every split launch the arrival counters are back at zero, whatever the lengths (empty
    splits, len <= 0, len > C), and the output (NaN-filled before each launch) is fully written:
    the next launch's last-CTA merge can never be skipped or run twice."""
    import cupy as cp

    import gqadrv

    q, kv, dq, dkv, dlen = make(shape, seed=splits)
    B, C = shape[0], shape[1]
    o = cp.empty_like(dq)
    p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dlen, num_splits=splits, backend=backend)
    assert p.num_splits == splits
    counters = p._keep[4].arrays["counters"]
    states = length_states(B, C, n=10) + [np.full(B, -3, np.int32), np.full(B, C + 5, np.int32)]
    for lens in states:
        dlen.set(lens)
        for _ in range(2):
            o.view(cp.uint16).fill(0xFFFF)  # NaN in fp16 and bf16
            gqadrv.launch_prepared(p)
            cp.cuda.Device().synchronize()
            assert int(cp.count_nonzero(counters)) == 0, f"lengths {lens.tolist()}"
            ref = gqa_decode_reference(q.astype(np.float64), kv, lens)
            check(cp.asnumpy(o).astype(np.float64), ref, shape[5], "split merge")


def test_two_streams_with_separate_prepared_objects():
    import cupy as cp

    import gqadrv

    shape = (1, 4096, 32, 8, 128, "float16")
    q, kv, dq, dkv, _ = make(shape, 5)
    la, lb = cp.asarray([4096], cp.int32), cp.asarray([1000], cp.int32)
    sa, sb = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    oa, ob = cp.full(dq.shape, np.nan, dq.dtype), cp.full(dq.shape, np.nan, dq.dtype)
    pa = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=oa, sequence_lengths=la, stream=sa)
    pb = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=ob, sequence_lengths=lb, stream=sb)
    assert pa.num_splits > 1 and pb.num_splits > 1
    for _ in range(16):
        gqadrv.launch_prepared(pa)
        gqadrv.launch_prepared(pb)
    sa.synchronize()
    sb.synchronize()
    check(cp.asnumpy(oa).astype(np.float64), gqa_decode_reference(q, kv, [4096]), "float16", "two streams")
    check(cp.asnumpy(ob).astype(np.float64), gqa_decode_reference(q, kv, [1000]), "float16", "two streams")


def test_prepared_object_is_small_immutable_and_owns_its_tensors():
    import dataclasses

    import cupy as cp

    import gqadrv

    shape = (2, 3000, 16, 4, 64, "float16")
    q, kv, dq, dkv, dlen = make(shape, 9)
    dlen.set(np.array([3000, 17], np.int32))
    o = cp.empty_like(dq)
    inputs = {"Q": dq, "KV": dkv, "O": o, "sequence_lengths": dlen}
    p = gqadrv.prepare_gqa_decode(inputs, num_splits=5)
    r = repr(p)
    assert "route=" in r and "num_splits=5" in r and "workspace_bytes=" in r and "arch=" in r
    assert p.workspace_bytes == 4 * (2 * 4 * 5 * 4 * 64 + 2 * 4 * 5 * 4 * 2 + 2 * 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_splits = 3
    del inputs, dq, dkv, dlen
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    junk = cp.full(20_000_000, 7, cp.float32)  # would reuse freed input memory if it were freed
    assert gqadrv.launch_prepared(p) is o
    cp.cuda.Device().synchronize()
    del junk
    check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, [3000, 17]), "float16", "ownership")


def test_host_cost_of_a_prepared_launch(report):
    import cupy as cp

    import gqadrv

    q, kv, dq, dkv, dlen = make((1, 1024, 32, 8, 128, "float16"), 1)
    dlen.fill(1024)
    s = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=cp.empty_like(dq), sequence_lengths=dlen, stream=s)
    launch = gqadrv.launch_prepared
    meds = {}
    o = cp.empty_like(dq)

    def on_current_stream():
        with s:
            return gqadrv.gqa_decode(dq, dkv, dlen)

    for label, fn in (("launch_prepared", lambda: launch(p)),
                      ("convenience gqa_decode (stream=s)", lambda: gqadrv.gqa_decode(dq, dkv, dlen, stream=s)),
                      ("convenience gqa_decode (stream=s, out=)", lambda: gqadrv.gqa_decode(dq, dkv, dlen, out=o, stream=s)),
                      ("convenience gqa_decode (current stream)", on_current_stream)):
        fn()
        s.synchronize()
        n = 1000 if label == "launch_prepared" else 300
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter() - t0) / n * 1e6)
            s.synchronize()
        meds[label] = statistics.median(samples)
        report(f"host cost of {label}: median {meds[label]:.2f} us per call (7 x {n} calls, kernel queued on a stream)")
    assert meds["launch_prepared"] < 200
