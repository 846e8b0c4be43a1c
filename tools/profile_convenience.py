"""Host cost of the convenience call gqadrv.gqa_decode (CuPy inputs, B1 C1024): median per-call
time of 5 x 1000 calls, then a cProfile of 2000 calls (top functions by own time).

    python tools/profile_convenience.py [--out-given]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-given", action="store_true", help="pass out= (no output allocation)")
    a = ap.parse_args()
    import cupy as cp

    import gqadrv

    q = cp.zeros((1, 32, 128), cp.float16)
    kv = cp.zeros((1, 2, 8, 1024, 128), cp.float16)
    lens = cp.full(1, 1024, cp.int32)
    o = cp.empty_like(q) if a.out_given else None

    def call():
        return gqadrv.gqa_decode(q, kv, lens, out=o)

    for _ in range(200):
        call()
    cp.cuda.Device().synchronize()
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            call()
        per.append((time.perf_counter() - t0) * 1e3)  # us per call (ms per 1000)
        cp.cuda.Device().synchronize()
    print(f"gqa_decode host cost ({'out given' if a.out_given else 'out allocated'}): "
          f"median {statistics.median(per):.1f} us per call (5 x 1000: {', '.join(f'{x:.1f}' for x in per)})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    cp.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
