"""A decode serving loop with CuPy: prepare once, then launch once per step while the engine
appends one token per request and updates the lengths on the device (no host sync, no allocation).

    python examples/serving_loop_cupy.py [--batch 8] [--capacity 4096] [--steps 64]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    require_gpu("serving_loop_cupy")
    import cupy as cp
    import numpy as np

    import gqadrv

    B, C, Hq, Hkv, D = a.batch, a.capacity, 32, 8, 128
    rs = cp.random.RandomState(0)
    kv = rs.standard_normal((B, 2, Hkv, C, D), dtype=cp.float32).astype(cp.float16)  # the KV cache
    q = cp.empty((B, Hq, D), cp.float16)
    out = cp.empty_like(q)
    lengths = cp.asarray(np.random.default_rng(0).integers(1, C // 2, size=B), dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    prepared = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": out, "sequence_lengths": lengths}, stream=stream)
    print(prepared)
    append = cp.ElementwiseKernel("int32 n, int32 cap", "int32 m", "m = n < cap ? n + 1 : n", "append_token")
    queries = rs.standard_normal((a.steps, B, Hq, D), dtype=cp.float32).astype(cp.float16)  # the model's q
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    attn_ms = 0.0
    t0 = time.perf_counter()
    with stream:
        for step in range(a.steps):
            q[...] = queries[step]                   # this step's queries (same address every step)
            append(lengths, C, lengths)              # one more token per request, on the device
            ev0.record(stream)
            gqadrv.launch_prepared(prepared)         # attention for the step: one cuLaunchKernelEx
            ev1.record(stream)
            ev1.synchronize()
            attn_ms += cp.cuda.get_elapsed_time(ev0, ev1)
        stream.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    ref = gqadrv.gqa_decode_reference(cp.asnumpy(q), cp.asnumpy(kv), cp.asnumpy(lengths))
    err = float(np.max(np.abs(cp.asnumpy(out).astype(np.float64) - ref)))
    print(f"{a.steps} steps: attention {attn_ms * 1e3 / a.steps:.1f} us per step (event-timed, includes the "
          f"Python launch), whole step {dt * 1e6:.1f} us; last step max |err| vs float64 oracle {err:.2e}")
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
