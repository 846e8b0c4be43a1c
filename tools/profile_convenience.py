"""Host cost of gqadrv's launch paths (CuPy inputs, B1 C1024): median per-call time of 5 x 1000
calls for the convenience call (output allocated / given: replays) and for ``launch_prepared``
(no stream, an int handle, a CuPy ``Stream`` object); ``--profile`` adds a cProfile of 2000
convenience calls.

    python tools/profile_convenience.py [--profile] [--label TEXT]
Works on any gqadrv version that has gqa_decode / prepare_gqa_decode / launch_prepared, so one GPU
call can measure a baseline checkout and the current tree side by side (PYTHONPATH=...).
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time


def _median_us(fn, n=1000, rounds=5) -> tuple[float, list]:
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / n)
    return statistics.median(per), per


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="cProfile 2000 convenience calls (top 25 by own time)")
    ap.add_argument("--label", default="", help="printed in front of every line")
    a = ap.parse_args()
    import cupy as cp

    import gqadrv

    q = cp.zeros((1, 32, 128), cp.float16)
    kv = cp.zeros((1, 2, 8, 1024, 128), cp.float16)
    lens = cp.full(1, 1024, cp.int32)
    o = cp.empty_like(q)
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens)
    cases = {
        "gqa_decode (out allocated)": lambda: gqadrv.gqa_decode(q, kv, lens),
        "gqa_decode (out given)": lambda: gqadrv.gqa_decode(q, kv, lens, out=o),
        "launch_prepared(p)": lambda: gqadrv.launch_prepared(p),
        "launch_prepared(p, int handle)": lambda: gqadrv.launch_prepared(p, st.ptr),
        "launch_prepared(p, cupy Stream)": lambda: gqadrv.launch_prepared(p, st),
    }
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        cp.cuda.Device().synchronize()
        med, per = _median_us(fn)
        cp.cuda.Device().synchronize()
        print(f"{a.label}{name:34s} median {med:6.2f} us per call (5 x 1000: {', '.join(f'{x:.2f}' for x in per)})",
              flush=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            gqadrv.gqa_decode(q, kv, lens)
        prof.disable()
        cp.cuda.Device().synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
