"""Soak and lifetime: 10,000 graph replays with random in-place length updates (oracle every 500,
split counters back at zero at the end), 1,000 prepare/free cycles with stable device memory, and
every visible device, including concurrent launches from one thread per device."""

import gc
import threading

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu


def test_soak_10000_graph_replays(report):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(11)
    B, C = 4, 2048
    q = rng.standard_normal((B, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((B, 2, 8, C, 128)).astype(np.float16)
    dq, dkv = cp.asarray(q), cp.asarray(kv)
    dlen = cp.asarray(np.full(B, C, np.int32))
    o = cp.empty_like(dq)
    s = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dlen, num_splits=12, stream=s)
    gqadrv.launch_prepared(p)
    s.synchronize()
    with s:
        s.begin_capture()
        gqadrv.launch_prepared(p, stream=s)
        g = s.end_capture()
    host_lens = np.empty(B, np.int32)
    mismatches = checks = 0
    for it in range(10_000):
        host_lens[:] = rng.integers(-2, C + 3, size=B)
        with s:
            dlen.set(host_lens)  # ordered on the replay stream
        g.launch(s)
        if it % 500 == 499:
            s.synchronize()
            ref = gqa_decode_reference(q, kv, host_lens)
            got = cp.asnumpy(o).astype(np.float64)
            checks += 1
            if not np.all(np.abs(got - ref) <= 1e-2 + 1e-2 * np.abs(ref)):
                mismatches += 1
    s.synchronize()
    counters = p._keep[4].arrays["counters"]  # the split workspace's arrival counters
    assert int(cp.count_nonzero(counters)) == 0
    assert mismatches == 0
    report(f"soak: 10000 graph replays (num_splits 12), {checks} oracle checks, {mismatches} mismatches, "
           f"split counters all zero at the end")


def test_prepare_free_cycles_keep_device_memory_stable(report):
    import cupy as cp
    from cuda.bindings import driver as drv

    import gqadrv
    from gqadrv.runtime.driver import check as ck

    q = cp.zeros((2, 32, 128), cp.float16)
    kv = cp.zeros((2, 2, 8, 1024, 128), cp.float16)
    lens = cp.full(2, 1024, cp.int32)
    pool = cp.get_default_memory_pool()

    def cycle(n):
        for _ in range(n):
            p = gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=cp.empty_like(q), sequence_lengths=lens, num_splits=4)
            gqadrv.launch_prepared(p)
            del p
        cp.cuda.Device().synchronize()
        gc.collect()

    cycle(50)  # warm: modules loaded, pool populated
    used0, free0 = pool.used_bytes(), ck(drv.cuMemGetInfo(), "cuMemGetInfo")[0]
    cycle(1000)
    used1, free1 = pool.used_bytes(), ck(drv.cuMemGetInfo(), "cuMemGetInfo")[0]
    report(f"1000 prepare/launch/free cycles: CuPy pool in use {used0} -> {used1} B, device free {free0} -> {free1} B")
    assert used1 <= used0 + (1 << 20)
    assert free1 >= free0 - (64 << 20)


def _devices():
    from gqadrv.runtime.driver import device_count, gpu_status

    return list(range(device_count())) if gpu_status()[0] else [0]


@pytest.mark.parametrize("device", _devices())
def test_every_device(device):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(device)
    q = rng.standard_normal((3, 16, 128)).astype(np.float16)
    kv = rng.standard_normal((3, 2, 4, 777, 128)).astype(np.float16)
    lens = np.array([777, 5, 300], np.int32)
    with cp.cuda.Device(device):
        dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
        out = gqadrv.gqa_decode(dq, dkv, dl)
        assert out.device.id == device
        o = cp.empty_like(dq)
        p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dl)
        assert p.device == device
        gqadrv.launch_prepared(p)
        cp.cuda.Device().synchronize()
        ref = gqa_decode_reference(q, kv, lens)
        check(cp.asnumpy(out).astype(np.float64), ref, "float16", f"device {device}")
        check(cp.asnumpy(o).astype(np.float64), ref, "float16", f"device {device}")


def test_concurrent_launches_from_one_thread_per_device():
    import cupy as cp

    import gqadrv

    devices = _devices()
    errors = []
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 8, 1500, 128)).astype(np.float16)
    lens = np.array([1500, 999], np.int32)
    ref = gqa_decode_reference(q, kv, lens)

    def worker(dev, k):
        try:
            with cp.cuda.Device(dev):
                s = cp.cuda.Stream(non_blocking=True)
                with s:
                    dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
                    o = cp.empty_like(dq)
                    p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dl, stream=s)
                    for _ in range(200):
                        gqadrv.launch_prepared(p)
                        out = gqadrv.gqa_decode(dq, dkv, dl, stream=s)
                    s.synchronize()
                    check(cp.asnumpy(o).astype(np.float64), ref, "float16", "threads")
                    check(cp.asnumpy(out).astype(np.float64), ref, "float16", "threads")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"device {dev} thread {k}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(d, k)) for d in devices for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
