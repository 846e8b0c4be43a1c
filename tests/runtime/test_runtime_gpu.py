"""Runtime proof on the GPU: 4-D TMA ring kernel vs numpy, non-default stream, cuda-python graph,
driver error reporting, and the host cost of one launch through the loader."""

import statistics
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def tile_sums(x: np.ndarray, b0: int, b1: int) -> np.ndarray:
    N3, N2, N1, N0 = x.shape
    ty, tx = -(-N1 // b1), -(-N0 // b0)
    pad = np.zeros((N3, N2, ty * b1, tx * b0), np.float64)
    pad[:, :, :N1, :N0] = x.astype(np.float64)
    return pad.reshape(N3, N2, ty, b1, tx, b0).sum(axis=(3, 5))


def _host(shape, dtype, seed=0):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    dt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    return rng.standard_normal(shape, dtype=np.float32).astype(dt)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 1, 128, 128), (2, 3, 300, 200), (3, 2, 1000, 72), (1, 5, 7, 520)])
def test_tma_ring_reduce_matches_numpy(shape, dtype):
    import cupy as cp

    from gqadrv.runtime.proof import tma_ring_reduce
    from tests.helpers import to_device

    h = _host(shape, dtype)
    x = to_device(h)
    out = tma_ring_reduce(x)
    cp.cuda.Device().synchronize()
    b0, b1 = (64, 128) if dtype == "float32" else (128, 128)
    ref = tile_sums(h, b0, b1)
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=1e-2)


def test_tma_ring_reduce_small_grid_wraps_the_ring():
    import cupy as cp

    from gqadrv.runtime.proof import tma_ring_reduce
    from tests.helpers import to_device

    h = _host((2, 2, 1024, 256), "float32", 1)
    out = tma_ring_reduce(to_device(h), grid=3)  # each CTA cycles the 3-slot ring many times
    np.testing.assert_allclose(cp.asnumpy(out), tile_sums(h, 64, 128), rtol=1e-4, atol=1e-2)


def test_tma_ring_reduce_on_a_non_default_stream():
    import cupy as cp

    from gqadrv.runtime.proof import tma_ring_reduce
    from tests.helpers import to_device

    h = _host((2, 2, 512, 384), "float16", 2)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = to_device(h)
        s.synchronize()
        out = tma_ring_reduce(x, stream=s)
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), tile_sums(h, 128, 128), rtol=1e-4, atol=1e-2)


def test_tma_ring_reduce_in_a_cuda_python_graph():
    import cupy as cp
    from cuda.bindings import driver as drv

    from gqadrv.runtime.driver import check
    from gqadrv.runtime.proof import tma_ring_reduce
    from tests.helpers import to_device

    h = _host((2, 3, 640, 256), "bfloat16", 3)
    x = to_device(h)
    out = cp.zeros((2, 3, 5, 2), cp.float32)
    stream = check(drv.cuStreamCreate(1), "cuStreamCreate")
    cp.cuda.Device().synchronize()
    check(drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin")
    try:
        tma_ring_reduce(x, out=out, stream=int(stream))
    finally:
        graph = check(drv.cuStreamEndCapture(stream), "end")
    gexec = check(drv.cuGraphInstantiate(graph, 0), "instantiate")
    for k in range(3):
        h2 = _host(h.shape, "bfloat16", 10 + k)
        x.data.copy_from_host(h2.ctypes.data, h2.nbytes)  # same address, new contents
        cp.cuda.Device().synchronize()
        check(drv.cuGraphLaunch(gexec, stream), "launch")
        check(drv.cuStreamSynchronize(stream), "sync")
        np.testing.assert_allclose(cp.asnumpy(out), tile_sums(h2, 128, 128), rtol=1e-4, atol=1e-2)


def test_driver_errors_carry_the_result_name():
    from gqadrv.runtime.compiler import arch_for_cc, compile_module
    from gqadrv.runtime.driver import CudaDriverError, device_info
    from gqadrv.runtime.module import PTR, ArgPack, LaunchPlan, Signature, load_library

    k = load_library(compile_module("runtime/stream_read.cu", arch_for_cc(device_info(0).cc)).cubin).kernel("stream_read", 0)
    pack = ArgPack(Signature(("p", PTR), ("n", PTR), ("o", PTR))).pack(0, 0, 0)
    with pytest.raises(CudaDriverError, match="CUDA_ERROR_INVALID_VALUE") as ei:
        LaunchPlan(k, (1, 1, 1), (4096, 1, 1), 0, pack).launch()
    assert ei.value.result == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(RuntimeError, match="shared memory"):
        k.ensure_dynamic_smem(10 << 20)


def test_host_cost_of_one_launch(report):
    import cupy as cp

    from gqadrv.runtime.compiler import arch_for_cc, compile_module
    from gqadrv.runtime.driver import device_info
    from gqadrv.runtime.module import PTR, ArgPack, LaunchPlan, Signature, load_library

    k = load_library(compile_module("runtime/stream_read.cu", arch_for_cc(device_info(0).cc)).cubin).kernel("stream_read", 0)
    buf = cp.zeros(16, cp.uint32)
    pack = ArgPack(Signature(("p", PTR), ("n", PTR), ("o", PTR))).pack(int(buf.data.ptr), 1, int(buf.data.ptr))
    s = cp.cuda.Stream(non_blocking=True)
    for pdl in (False, True):
        plan = LaunchPlan(k, (1, 1, 1), (32, 1, 1), 0, pack, stream=int(s.ptr), pdl=pdl)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                plan.launch()
            samples.append((time.perf_counter() - t0) / 1000 * 1e6)
            s.synchronize()
        med = statistics.median(samples)
        report(f"host cost of LaunchPlan.launch (cuLaunchKernelEx, pdl={pdl}): median {med:.2f} us over 5x1000 launches")
        assert med < 200  # sanity bound only; the number is reported, speed is the benchmark's job
