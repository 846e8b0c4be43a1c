"""Device time of one prepared MLA decode launch under different launch modes, to find why a call
costs more inside a CUDA graph than back to back on a stream (docs/RESULTS.md, "Where the time
goes": 171 µs in the bench's graph against 150 µs on a stream at h_q 16, L 4096).

For each shape it times the same prepared launch (the route ``prepare_mla_decode`` picks):

* ``stream``: N launches back to back on torch's current stream, between two events;
* ``graph``:  a torch CUDA graph of N launches, timed by ``gqadrv bench``'s own hot timer
  (``gqadrv.ops.bench.Timer.hot``), so the number is the bench's;

each with the plan's programmatic dependent launch attribute on (``pdl``, what gqadrv uses) and off
(``nopdl``: a copy of the plan without the attribute), and with the bench's inputs (block table
``arange``, values N(0, 1) / 10) or randomly permuted pages and N(0, 1) / 2 values (``--inputs``).
Medians of ``--reps`` repetitions, microseconds per call, one line per (shape, inputs).

    python tools/mla_launch_modes.py [--shapes 16,4096 128,8192] [--calls 20] [--reps 10]
                                     [--inputs bench,perm] [--json out.json]

Needs an sm_90 GPU, CuPy and torch (for the graph API and events). First run 2026-12-01 05:55 UTC
(docs/RESULTS.md, "MLA decode, TMA seesaw": the 171-vs-150 us gap did not reproduce).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(cp, h_q: int, L: int, kind: str, b: int = 128, page: int = 64):
    import ml_dtypes
    import numpy as np

    npg = -(-L // page)
    nb = b * npg
    rs = cp.random.RandomState(7)
    scale = 0.1 if kind == "bench" else 0.5
    k = (rs.standard_normal((nb, page, 1, 576), dtype=cp.float32) * scale).astype(ml_dtypes.bfloat16)
    q = (rs.standard_normal((b, 1, h_q, 576), dtype=cp.float32) * scale).astype(ml_dtypes.bfloat16)
    if kind == "bench":
        bt = cp.arange(nb, dtype=cp.int32).reshape(b, npg)
    else:
        bt = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32).reshape(b, npg))
    lens = cp.full(b, L, cp.int32)
    out = cp.empty((b, 1, h_q, 512), q.dtype)
    lse = cp.empty((b, h_q, 1), cp.float32)
    return q, k, bt, lens, out, lse


def _time_stream(torch, fn, n: int, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["16,4096", "16,8192", "128,4096", "128,8192"],
                    help="h_q,L pairs (b 128, s_q 1, h_kv 1, bf16, page 64)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inputs", default="bench,perm", help="comma-separated subset of bench,perm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp
    import torch

    import gqadrv
    from gqadrv.ops.bench import Timer
    from gqadrv.runtime.module import LaunchPlan

    timer = Timer(args.calls, args.reps)

    rows = []
    for shape in args.shapes:
        h_q, L = (int(x) for x in shape.split(","))
        for kind in args.inputs.split(","):
            q, k, bt, lens, out, lse = _inputs(cp, h_q, L, kind)
            p = gqadrv.prepare_mla_decode(q, k, bt, lens, out=out, lse=lse, stream=torch.cuda.current_stream())
            plan = p.plans[0]
            plain = LaunchPlan(plan.kernel, plan.grid, plan.block, plan.smem, plan.args, stream=plan.stream,
                               pdl=False)

            def launch(lp):
                return lambda: lp.launch(int(torch.cuda.current_stream().cuda_stream))

            row = {"h_q": h_q, "L": L, "inputs": kind, "route": p.route, "splits": p.num_splits}
            for name, lp in (("pdl", plan), ("nopdl", plain)):
                row[f"stream_{name}_us"] = _time_stream(torch, launch(lp), args.calls, args.reps)
                row[f"graph_{name}_us"] = timer.hot(launch(lp), True)
            rows.append(row)
            print(f"h_q {h_q:3d} L {L:6d} {kind:5s} {p.route}: stream pdl {row['stream_pdl_us']:8.1f}  "
                  f"stream nopdl {row['stream_nopdl_us']:8.1f}  graph pdl {row['graph_pdl_us']:8.1f}  "
                  f"graph nopdl {row['graph_nopdl_us']:8.1f} us", flush=True)
            del p, plan, plain, q, k, bt, lens, out, lse
            cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "gqadrv.mla_launch_modes/1", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
