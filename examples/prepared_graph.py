"""Prepared decode in a CUDA graph (cuda-python stream capture), replayed after updating the
lengths in place on the device. Without --graph it launches the prepared object directly.

    python examples/prepared_graph.py [--graph] [--batch 1] [--capacity 1024]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=1024)
    a = ap.parse_args()
    require_gpu("prepared_graph")
    import cupy as cp
    import numpy as np
    from cuda.bindings import driver as drv

    import gqadrv
    from gqadrv.runtime.driver import check

    B, C = a.batch, a.capacity
    rng = np.random.default_rng(0)
    qh = (0.25 * rng.standard_normal((B, 32, 128))).astype(np.float16)
    kvh = (0.25 * rng.standard_normal((B, 2, 8, C, 128))).astype(np.float16)
    q, kv = cp.asarray(qh), cp.asarray(kvh)
    lengths = cp.full(B, C, cp.int32)
    out = cp.empty_like(q)
    side = cp.cuda.Stream(non_blocking=True)
    prepared = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": out, "sequence_lengths": lengths}, stream=side)
    gqadrv.launch_prepared(prepared)  # warm-up outside capture
    side.synchronize()
    print(prepared)
    if not a.graph:
        states = [[C] * B]
        run = lambda: gqadrv.launch_prepared(prepared)  # noqa: E731
    else:
        h = int(side.ptr)
        check(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "capture")
        gqadrv.launch_prepared(prepared, stream=h)
        graph = check(drv.cuStreamEndCapture(h), "end capture")
        gexec = check(drv.cuGraphInstantiate(graph, 0), "instantiate")
        states = [[max(1, C - 1)] * B, [1] * B, [C] * B, [C // 2] * B]
        run = lambda: check(drv.cuGraphLaunch(gexec, h), "graph launch")  # noqa: E731
    worst = 0.0
    for st in states:
        lengths.set(np.array(st, np.int32))  # same address, new values
        cp.cuda.Device().synchronize()
        run()
        side.synchronize()
        ref = gqadrv.gqa_decode_reference(qh, kvh, st)
        err = float(np.max(np.abs(cp.asnumpy(out).astype(np.float64) - ref)))
        worst = max(worst, err)
        print(f"lengths {st[:4]}{'...' if B > 4 else ''}: max |err| {err:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
