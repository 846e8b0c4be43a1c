"""Where does a decode launch spend its time? Builds the route with GQA_TRACE=1 (globaltimer stamps
per CTA, see kernels/gqa/common/config.cuh), launches it cold (L2 flushed) and hot (last of 20
back-to-back launches), and prints stamp statistics (min / median / max over CTAs) relative to the
first CTA's first stamp.

    python tools/trace_decode.py "1,1024,[1024]" "1,4096,[3968]" --splits 8
    python tools/trace_decode.py --paged "1,4096,16,NHD" "1,4096,64,NHD,32768"   # B,L,PAGE,LAYOUT[,TABLE_TOKENS]
Marks: 0 prologue done, 1 after griddepcontrol.wait, 2 length known, 3 first sub-tile in smem (TMA),
4 warp 0 done, 5 warp states merged in smem, 6 epilogue stores issued, 7 ticket drawn, 9 split
merge computed, 8 counter reset (last CTA only). Paged rows (--paged: fp16, Hq 32, Hkv 8, D 128, every request
at its full length L, pages in random order, table entries past them poisoned, as tools/paged_tune.py): the
paged route's own kernel with the same marks, 10 the speculative start's first boxes issued (their
block-table entries arrived), 2 meaning the schedule known (length read) and 4 every warp's last step
done. In a cluster launch (the split merge through distributed shared memory,
kernels/gqa/common/cluster_merge.cuh): 6 every item's state pushed to the rank that owns it, 7 every push
into this CTA landed, 9 its chunk of the output stored; no 8.

``--kv-dtype e4m3`` runs the paged rows on FP8-e4m3 codes (random finite codes, per-tensor scales 1/64), the
route of ``bench --op gqa_fp8``. The paged TMA kernel also records its CTA's SM (%smid, slot 15); for its rows
a per-SM line follows each launch: CTAs per SM, the share of the launch's span in which an SM had a CTA
between its first sub-tile and its warp states merged (streaming), its start-ups (mark 0 -> first sub-tile)
and the gaps between one CTA's end and the next CTA's first sub-tile on the same SM (medians over SMs).

    python tools/trace_decode.py --paged --kv-dtype e4m3 "64,4096,16,NHD" "256,2048,16,NHD"
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["GQADRV_TRACE"] = "1"

import numpy as np  # noqa: E402

NAMES = {0: "prologue", 1: "pdl_wait", 10: "issued", 2: "len", 3: "first_tile", 4: "warp0_done", 5: "cta_merge",
         6: "stores", 7: "ticket", 9: "merged", 8: "done"}


def run(text, splits, flush, cp):
    from gqadrv.gqa import contract
    from gqadrv.gqa import plan as gplan
    from gqadrv.gqa.bench import make_inputs, parse_shape
    from gqadrv.ops import workspace

    shape = parse_shape(text)
    q, kv, lens = make_inputs(shape, 0)
    o = cp.empty_like(q)
    s = int(cp.cuda.get_current_stream().ptr)
    prob = contract.validate(q, kv, lens, o, 1.0, stream=s)
    variant, loaded = gplan.route(prob, None)
    ns = splits or gplan.default_splits(prob, variant, loaded)
    if not variant.family.splittable:
        ns = 1
    ws = workspace.alloc(0, s, gplan.workspace_sizes(prob, ns), gplan.WORKSPACE_ZERO) if ns > 1 else None
    # the trace buffer (grid * 16 stamps) takes the place of the status pointer
    n_cta = prob.batch * prob.num_kv_heads * ns
    trace = cp.zeros(n_cta * 16, cp.uint64)
    plan = gplan.build_launch(prob, variant, loaded, out_ptr=int(o.data.ptr), ws=ws, status_ptr=int(trace.data.ptr),
                             splits=ns, stream=s)
    _time(plan, trace, plan.grid, flush, cp, f"{shape.label} route {variant.name} splits {ns} grid {plan.grid[0]} "
          f"smem {plan.smem} cluster {plan.cluster} ctas/SM {loaded.ctas_per_sm}")


def _per_sm(t, base):
    """The paged TMA kernel's per-SM view of one launch (slot 15 = %smid): see the module docstring."""
    start, first, merged = t[:, 0] - base, t[:, 3] - base, t[:, 5] - base
    ends = np.where(t[:, [5, 6, 7, 8, 9]] >= base, t[:, [5, 6, 7, 8, 9]] - base, 0).max(axis=1)
    ok = (t[:, 0] >= base) & (t[:, 3] >= base) & (t[:, 5] >= base)
    sm = t[:, 15]
    span = ends[ok].max() - start[ok].min()
    stream_share, per_sm, startups, gaps = [], [], [], []
    for s in np.unique(sm[ok]):
        idx = np.where(ok & (sm == s))[0]
        idx = idx[np.argsort(start[idx])]
        per_sm.append(idx.size)
        stream_share.append(sum(merged[i] - first[i] for i in idx) / span)
        startups.extend(first[i] - start[i] for i in idx)
        gaps.extend(first[j] - ends[i] for i, j in zip(idx[:-1], idx[1:]))
    med = lambda x: float(np.median(x)) / 1000 if len(x) else float("nan")  # noqa: E731
    return (f"per SM: {len(per_sm)} SMs, CTAs {min(per_sm)}-{max(per_sm)}, streaming share med "
            f"{np.median(stream_share) * 100:.1f} % (min {min(stream_share) * 100:.1f}), "
            f"start-up med {med(startups):.2f} us, end -> next first sub-tile med {med(gaps):.2f} us "
            f"(max {max(gaps, default=0) / 1000:.2f}), span {span / 1000:.2f} us")


def _time(plan, trace, grid, flush, cp, title, per_sm=False):
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
        for m in NAMES:
            col = t[:, m]
            col = col[col >= base] - base  # stamps of earlier launches (marks of last CTAs) are older
            if col.size:
                rows.append(f"{NAMES[m]}: min {col.min() / 1000:.2f} med {np.median(col) / 1000:.2f} "
                            f"max {col.max() / 1000:.2f}")
        if per_sm:
            rows.append(_per_sm(t, base))
        out[mode] = (ms, rows)
    print(f"== {title}")
    for mode, (us, rows) in out.items():
        print(f"   {mode}: event {us:.2f} us | " + " | ".join(rows))


def run_paged(text, splits, flush, cp, kv_dtype="float16"):
    from gqadrv.gqa import paged as gpaged
    from gqadrv.gqa.paged_contract import validate_paged
    from gqadrv.runtime.module import ArgPack, LaunchPlan

    parts = text.split(",")
    b, length, page, layout = int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
    table_tokens = int(parts[4]) if len(parts) > 4 else length
    hq, hkv, d = 32, 8, 128
    rng = np.random.default_rng(0)
    mp = -(-length // page)
    width = max(mp, -(-table_tokens // page))
    shape = (b * mp, page, hkv, d) if layout == "NHD" else (b * mp, hkv, page, d)
    if kv_dtype == "e4m3":  # finite codes (no 0x7f / 0xff), either sign
        k = (cp.random.randint(0, 0x7F, shape, dtype=cp.int32) | (cp.random.randint(0, 2, shape, dtype=cp.int32) << 7))
        v = (cp.random.randint(0, 0x7F, shape, dtype=cp.int32) | (cp.random.randint(0, 2, shape, dtype=cp.int32) << 7))
        k, v = k.astype(cp.uint8), v.astype(cp.uint8)
        kv_args = {"kv_dtype": "e4m3", "k_scale": 1.0 / 64, "v_scale": 1.0 / 64}
    else:
        k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        kv_args = {}
    table = cp.full((b, width), 2147480000, cp.int32)
    table[:, :mp] = cp.asarray(rng.permutation(b * mp).astype(np.int32).reshape(b, mp))
    lens = cp.full(b, length, cp.int32)
    q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
    o = cp.empty_like(q)
    s = int(cp.cuda.get_current_stream().ptr)
    prob = validate_paged(q, k, v, table, lens, layout, o, None, 1.0, None, stream=s, **kv_args)
    variant, loaded, maps = gpaged.route(prob, None, False)
    ns, subs = gpaged.splits_for(prob, variant, loaded, False, splits or None)
    ws = gpaged._split_workspace(prob, variant, ns, s, pooled=False)
    grid, block, smem, cluster = gpaged.launch_shape(prob, variant, loaded, ns, subs)
    trace = cp.zeros(grid[0] * 16, cp.uint64)
    args = gpaged.args_fields(prob, variant, out_ptr=int(o.data.ptr), lse_ptr=0, ws=ws, status_ptr=int(trace.data.ptr),
                              splits=ns, split_subs=subs, spec=gpaged.speculates(prob, variant, loaded.ctas_per_sm, ns),
                              next_stride=gpaged.successor_stride(prob, variant, loaded.ctas_per_sm, ns))
    pack = ArgPack(variant.family.signature).pack(*gpaged.param_values(variant, maps, args))
    plan = LaunchPlan(loaded.kernel, grid, block, smem, pack, stream=s, pdl=True, cluster=cluster)
    _time(plan, trace, grid, flush, cp, f"paged {text} {kv_dtype} route {variant.name} splits {ns} grid {grid[0]} "
          f"smem {smem} cluster {cluster} spec {bool(args['flags'] & gpaged.GQA_PAGED_FLAG_SPEC)}",
          per_sm=variant.name.startswith("paged_tma"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["1,64,[1]", "4,256,[64;127;191;256]", "1,1024,[1024]", "1,4096,[3968]"])
    ap.add_argument("--splits", default="0", help="comma list; 0 = heuristic")
    ap.add_argument("--paged", action="store_true", help="shapes are paged rows B,L,PAGE,LAYOUT[,TABLE_TOKENS]")
    ap.add_argument("--kv-dtype", choices=("float16", "e4m3"), default="float16", help="paged rows: the caches' type")
    a = ap.parse_args()
    import cupy as cp

    flush = cp.empty(512 << 20, cp.uint8)
    for text in a.shapes:
        for ns in a.splits.split(","):
            if a.paged:
                run_paged(text, int(ns), flush, cp, a.kv_dtype)
            else:
                run(text, int(ns), flush, cp)


if __name__ == "__main__":
    main()
