"""Where does a decode launch spend its time? Builds the route with GQA_TRACE=1 (globaltimer stamps
per CTA, see kernels/common/gqa_config.cuh), launches it cold (L2 flushed) and hot (last of 20
back-to-back launches), and prints stamp statistics (min / median / max over CTAs) relative to the
first CTA's first stamp.

    python tools/trace_decode.py "1,1024,[1024]" "1,4096,[3968]" --splits 8
Marks: 0 prologue done, 1 after griddepcontrol.wait, 2 length known, 3 first sub-tile in smem (TMA),
4 warp 0 done, 5 warp states merged in smem, 6 epilogue stores issued, 7 ticket drawn, 9 split
merge computed, 8 counter reset (last CTA only)."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["GQADRV_TRACE"] = "1"

import numpy as np  # noqa: E402

NAMES = {0: "prologue", 1: "pdl_wait", 2: "len", 3: "first_tile", 4: "warp0_done", 5: "cta_merge",
         6: "stores", 7: "ticket", 9: "merged", 8: "done"}


def run(text, splits, flush, cp):
    from gqadrv.bench import _make_inputs, parse_shape
    from gqadrv.gqa import api, contract, routes
    from gqadrv.runtime.module import LaunchPlan

    shape = parse_shape(text)
    q, kv, lens = _make_inputs(shape, 0)
    o = cp.empty_like(q)
    s = int(cp.cuda.get_current_stream().ptr)
    prob = contract.validate(q, kv, lens, o, 1.0, stream=s)
    variant, loaded = api._route(prob, None)
    from gqadrv.runtime.driver import device_info

    info = device_info(0)
    ns = splits or routes.default_splits(variant, prob.batch, prob.num_kv_heads, prob.capacity, info.sm_count,
                                         loaded.ctas_per_sm)
    if not variant.family.splittable:
        ns = 1
    ws = None
    if ns > 1:
        ws = api._alloc_workspace(0, s, *api._workspace_bytes(prob.batch, prob.num_kv_heads, prob.group, prob.head_dim, ns))
    grid, block, smem = routes.launch_geometry(variant, prob.batch, prob.num_kv_heads, ns)
    trace = cp.zeros(grid[0] * 16, cp.uint64)
    pack = api._pack(variant, prob, api._args_tuple(prob, int(o.data.ptr), ws, int(trace.data.ptr), ns, variant, loaded))
    plan = LaunchPlan(loaded.kernel, grid, block, smem, pack, stream=s, pdl=True)
    out = {}
    for mode in ("cold", "hot"):
        plan.launch()
        cp.cuda.Device().synchronize()
        trace.fill(0)
        if mode == "cold":
            flush.fill(1)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            plan.launch()
            e1.record()
        else:
            for _ in range(19):
                plan.launch()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            plan.launch()
            e1.record()
        e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1) * 1000
        t = cp.asnumpy(trace).reshape(grid[0], 16).astype(np.int64)
        base = t[:, 0][t[:, 0] > 0].min()
        rows = []
        for m in (0, 1, 2, 3, 4, 5, 6, 7, 9, 8):
            col = t[:, m]
            col = col[col >= base] - base  # stamps of earlier launches (marks of last CTAs) are older
            if col.size:
                rows.append(f"{NAMES[m]}: min {col.min() / 1000:.2f} med {np.median(col) / 1000:.2f} "
                            f"max {col.max() / 1000:.2f}")
        out[mode] = (ms, rows)
    print(f"== {shape.label} route {variant.name} splits {ns} grid {grid[0]} smem {smem} ctas/SM {loaded.ctas_per_sm}")
    for mode, (us, rows) in out.items():
        print(f"   {mode}: event {us:.2f} us | " + " | ".join(rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1,64,[1]", "4,256,[64;127;191;256]", "1,1024,[1024]", "1,4096,[3968]"])
    ap.add_argument("--splits", default="0", help="comma list; 0 = heuristic")
    a = ap.parse_args()
    import cupy as cp

    flush = cp.empty(512 << 20, cp.uint8)
    for text in a.shapes:
        for ns in a.splits.split(","):
            run(text, int(ns), flush, cp)


if __name__ == "__main__":
    main()
