"""Tensor-parallel GQA decode: KV heads sharded over N GPUs, gqadrv on each shard, the per-GPU
outputs gathered with NCCL (cupy.cuda.nccl, one communicator per GPU in this process) and checked
against a single-GPU run. Runs with N = 1 on a one-GPU machine.

    python examples/tensor_parallel_decode.py [--gpus N] [--batch 4] [--capacity 2048]

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0, and nothing here creates multicast objects.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402

os.environ["NCCL_NVLS_ENABLE"] = "0"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=0, help="0 = all visible GPUs")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=2048)
    a = ap.parse_args()
    require_gpu("tensor_parallel_decode")
    import cupy as cp
    import numpy as np
    from cupy.cuda import nccl

    import gqadrv

    n = a.gpus or cp.cuda.runtime.getDeviceCount()
    B, C, Hq, Hkv, D = a.batch, a.capacity, 32, 8, 128
    if Hkv % n:
        print(f"{Hkv} KV heads cannot be split over {n} GPUs", file=sys.stderr)
        return 2
    hkv, hq = Hkv // n, Hq // n
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, D)).astype(np.float16)
    kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
    lengths = rng.integers(1, C + 1, size=B).astype(np.int32)
    with cp.cuda.Device(0):  # single-GPU reference
        single = cp.asnumpy(gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(lengths)))
    comms = nccl.NcclCommunicator.initAll(list(range(n)))
    outs, gathered, streams = [], [], []
    for r in range(n):
        with cp.cuda.Device(r):
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                q_r = cp.asarray(np.ascontiguousarray(q[:, r * hq:(r + 1) * hq]))
                kv_r = cp.asarray(np.ascontiguousarray(kv[:, :, r * hkv:(r + 1) * hkv]))
                o = gqadrv.gqa_decode(q_r, kv_r, cp.asarray(lengths), stream=s)  # [B, hq, D] on GPU r
                outs.append(cp.ascontiguousarray(o.transpose(1, 0, 2)))       # [hq, B, D]: rank-major gather
                gathered.append(cp.empty((n * hq, B, D), cp.float16))
            streams.append(s)
    nccl.groupStart()
    for r in range(n):
        with cp.cuda.Device(r):
            comms[r].allGather(outs[r].data.ptr, gathered[r].data.ptr, outs[r].size, nccl.NCCL_FLOAT16, streams[r].ptr)
    nccl.groupEnd()
    worst = 0.0
    for r in range(n):
        with cp.cuda.Device(r):
            streams[r].synchronize()
            full = cp.asnumpy(gathered[r]).transpose(1, 0, 2)  # [B, Hq, D]
            worst = max(worst, float(np.max(np.abs(full.astype(np.float64) - single.astype(np.float64)))))
    print(f"{n} GPU(s), {hkv} KV heads each: max |tensor-parallel - single GPU| = {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
