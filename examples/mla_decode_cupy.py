"""A paged MLA decode step with CuPy (DeepSeek-V3-style latent attention, FlashMLA's API): a page
pool shared by the requests, a block table with pages in shuffled order, lengths on the device;
one prepared launch per step inside a CUDA graph while the engine appends a token to every request
(lengths updated in place, no re-planning), checked against the float64 oracle.

    python examples/mla_decode_cupy.py [--batch 4] [--heads 16] [--page 64] [--length 1000] [--steps 4]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    require_gpu("mla_decode_cupy")
    import cupy as cp
    import numpy as np

    import gqadrv
    from gqadrv.mla.reference import mla_decode_reference

    b, h_q, page = a.batch, a.heads, a.page
    max_len = a.length + a.steps
    max_blocks = -(-max_len // page)
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal((b * max_blocks + 5, page, 1, 576)) * 0.3).astype(np.float16)
    table = rng.permutation(b * max_blocks + 5)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    q = (rng.standard_normal((b, 1, h_q, 576)) * 0.3).astype(np.float16)
    lens = np.array([a.length - 37 * i for i in range(b)], np.int32)

    d_pool, d_table, d_q, d_lens = cp.asarray(pool), cp.asarray(table), cp.asarray(q), cp.asarray(lens)
    out = cp.empty((b, 1, h_q, 512), cp.float16)
    lse = cp.empty((b, h_q, 1), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_mla_decode(d_q, d_pool, d_table, d_lens, out=out, lse=lse, stream=stream)
    print(f"prepared {p}")
    with stream:
        stream.begin_capture()
        gqadrv.launch_prepared(p)
        graph = stream.end_capture()
    worst = 0.0
    for step in range(a.steps):
        lens = lens + 1                      # the engine appended one token to every request
        with stream:
            d_lens.set(lens)
        graph.launch(stream)
        stream.synchronize()
        ref, ref_lse = mla_decode_reference(q, pool, table, lens, 512)
        err = float(np.max(np.abs(cp.asnumpy(out).astype(np.float64) - ref)))
        lerr = float(np.max(np.abs(cp.asnumpy(lse) - ref_lse)))
        worst = max(worst, err)
        print(f"step {step}: lengths {lens.tolist()}: max |out - oracle| {err:.2e}, max |lse - oracle| {lerr:.2e}")
    ok = worst < 2e-2
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
