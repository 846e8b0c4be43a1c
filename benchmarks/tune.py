"""Tuning sweep for the GQA kernels on a GPU: compile-time configurations (through the tuning
environment variables of gqadrv.gqa.routes) x shapes x num_splits, hot and cold times.

    python benchmarks/tune.py [--configs base,t16s2,...] [--shapes "1,1024" ...] [--json out.json]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "base": {},
    "evictfirst": {"GQADRV_L2_EVICT_FIRST": "1"},
    "evictnormal": {"GQADRV_L2_EVICT_FIRST": "0"},
    "t32s3": {"GQADRV_TILING": "4,32,3"},
    "t64s1": {"GQADRV_TILING": "4,64,1"},
    "t64s2": {"GQADRV_TILING": "4,64,2"},
    "w8t16s2": {"GQADRV_TILING": "8,16,2"},
    "w8t16s3": {"GQADRV_TILING": "8,16,3"},
    "w8t32s1": {"GQADRV_TILING": "8,32,1"},
    "t16s2": {"GQADRV_TILING": "4,16,2"},
    "portable": {"GQADRV_BACKEND": "portable"},
    "short2x32": {"GQADRV_SHORT_TILING": "2,32"},
    "short1x64": {"GQADRV_SHORT_TILING": "1,64"},
}
SHAPES = ["1,64,[1]", "4,256,[64;127;191;256]", "1,1024,[1024]", "1,4096,[3968]", "1,32768", "16,4096",
          "64,4096", "256,2048"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--small-splits", default="1,2,4,8,16")
    ap.add_argument("--large-splits", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import cupy as cp

    import gqadrv
    from gqadrv.gqa.bench import make_inputs, parse_shape
    from gqadrv.ops.bench import Timer

    try:
        import torch  # noqa: F401  (graph timing like the peers)
    except Exception:  # noqa: BLE001
        pass
    timer = Timer(20, a.reps)
    rows = []
    keys = set().union(*[set(v) for v in CONFIGS.values()])
    for si, text in enumerate(a.shapes):
        shape = parse_shape(text)
        q, kv, lens = make_inputs(shape, si)
        small = shape.batch * shape.capacity <= 8192
        splits = [None] + [int(x) for x in (a.small_splits if small else a.large_splits).split(",") if x]
        for cname in a.configs.split(","):
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update(CONFIGS[cname])
            for ns in splits:
                t0 = time.perf_counter()
                try:
                    o = cp.empty_like(q)
                    p = gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens, num_splits=ns)
                    # launch on CuPy's current stream: the capturing one inside Timer.hot
                    fn = lambda p=p: gqadrv.launch_prepared(p, cp.cuda.get_current_stream())  # noqa: E731
                    hot, cold = timer.hot(fn, False), timer.cold(fn)
                    r = {"shape": shape.label, "config": cname, "splits_req": ns, "splits": p.num_splits, "route": p.route,
                         "hot_us": round(hot, 3), "cold_us": round(cold, 3),
                         "TBps": round(shape.kv_bytes() / (hot * 1e-6) / 1e12, 3)}
                except Exception as exc:  # noqa: BLE001
                    r = {"shape": shape.label, "config": cname, "splits_req": ns, "error": repr(exc)[:200]}
                rows.append(r)
                print(json.dumps(r), flush=True)
        del q, kv, lens
        cp.get_default_memory_pool().free_all_blocks()
    for k in keys:
        os.environ.pop(k, None)
    best = {}
    for r in rows:
        if "hot_us" in r and (r["shape"] not in best or r["hot_us"] < best[r["shape"]]["hot_us"]):
            best[r["shape"]] = r
    print("\nbest per shape (hot):")
    for s, r in best.items():
        print(f"  {s:28s} {r['hot_us']:9.2f} us  cold {r['cold_us']:9.2f}  {r['TBps']:.2f} TB/s  {r['config']} splits={r['splits']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=0)


if __name__ == "__main__":
    main()
