"""Where does an MLA decode launch spend its time, CTA by CTA? (development; needs a GPU, except --from-json)

Builds the MLA routes with MLA_TRACE=1 (GQADRV_MLA_TRACE=1: %globaltimer stamps written by one thread
per CTA, kernels/mla/common/decode_util.cuh MLA_MARK; the seesaw and narrow2 kernels carry them), runs
one launch after warm-up launches (hot L2 as in the bench's graphs, but a single launch: no
programmatic overlap with a previous one) and prints, per backend and row, the stamps relative to the
earliest CTA start (min / median / max over CTAs) and derived spans.

    GQADRV_MLA_EXPERIMENTS=1 python tools/mla_trace.py 128,1,16,4096 128,1,64,4096 \\
        --backends narrow16_bal,narrow16_bal_cut32 seesaw_bal,seesaw_bal_cut32 --json trace.json
    python tools/mla_trace.py --from-json trace.json --ceiling-tbps 3.11   # the reports again, no GPU

Rows are the bench's `b,s_q,h_q,L[,kind]` (kind uniform / varlen / skew / spread, as `bench --op mla`);
each backend group applies to the rows its kernel serves (h_q <= 16 for narrow*, any for seesaw*).
Stamps: 0 entry, 1 schedule scan done, 2/5/8 item 0/1/2 Q ready (consumer side), 3/6/9 its last tile
done, 4/7/10 its epilogue done (out stored, or partial stored and ticket drawn), 11 all items done,
12 merges won done, 13 first K load issued, 14 last K load issued (producer thread; in the cp.async seesaw
builds: item 0's epilogue after its row sums / before its out stores, consumer thread 0); slot 15 holds
the CTA's SM (%smid), not a time. A stamp that a CTA did not reach stays 0 and is left out of its statistics.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["GQADRV_MLA_TRACE"] = "1"

import numpy as np  # noqa: E402

NAMES = {0: "entry", 1: "scan", 2: "i0 q", 3: "i0 tiles", 4: "i0 epi", 5: "i1 q", 6: "i1 tiles", 7: "i1 epi",
         8: "i2 q", 9: "i2 tiles", 10: "i2 epi", 11: "items", 12: "merges", 13: "tma0", 14: "tma_end"}
SM_SLOT = 15


def trace_row(row: str, backend: str, cp, launches: int = 3, raw: list | None = None,
              ceiling_tbps: float | None = None, page_pool: int | None = None) -> str:
    import ml_dtypes

    import gqadrv
    from gqadrv.mla.bench import row_lengths

    parts = row.split(",")
    b, s_q, h_q, L = (int(x) for x in parts[:4])
    kind = parts[4] if len(parts) > 4 else "uniform"
    lens = row_lengths(b, L, kind)
    page = 64
    max_blocks = -(-max(lens) // page)
    rs = cp.random.RandomState(7)
    k = (rs.standard_normal((b * max_blocks, page, 1, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
    q = (rs.standard_normal((b, s_q, h_q, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
    bt = cp.arange(b * max_blocks, dtype=cp.int32).reshape(b, max_blocks)
    if page_pool:  # every request reads pages of one small pool (L2-resident, as the sparse prefill's kv)
        bt = bt % page_pool
    sl = cp.asarray(np.array(lens, np.int32))
    out = cp.empty((b, s_q, h_q, 512), q.dtype)
    n_lse = b * h_q * s_q
    base = (n_lse + 1) & ~1
    max_ctas = 1 << 16
    big = cp.zeros(base + 2 * 16 * max_ctas, cp.float32)  # lse, then u64 stamps per CTA
    lse = big[:n_lse].reshape(b, h_q, s_q)
    p = gqadrv.prepare_mla_decode(q, k, bt, sl, out=out, lse=lse, causal=s_q > 1, backend=backend)
    grid = p.grid
    n_cta = grid[0] * grid[1] * grid[2]
    if n_cta > max_ctas:
        return f"{row} {backend}: grid {grid} too large for the trace buffer"
    for _ in range(20):
        gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    runs = []
    for _ in range(max(1, launches)):
        big[base:] = 0
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        gqadrv.launch_prepared(p)
        e1.record()
        e1.synchronize()
        st = big[base:base + 2 * 16 * n_cta].view(cp.uint64).get().reshape(n_cta, 16).astype(np.int64)
        runs.append((cp.cuda.get_elapsed_time(e0, e1) * 1e3, st))
    if raw is not None:
        raw.append({"row": row, "backend": backend, "route": p.route, "grid": list(grid),
                    "launches": [{"event_us": u, "stamps": x.tolist()} for u, x in runs]})
    return report(row, backend, p.route, grid, runs, ceiling_tbps)


def _cp_async(route: str) -> bool:
    """Whether the route's kernel is a cp.async seesaw build (its stamps 13 / 14 split the first item's epilogue;
    in the TMA builds they are the producer's first / last K load)."""
    from gqadrv.mla.routes import FAMILIES

    name = route.removeprefix("mla_decode_").rsplit("_", 1)[0]
    fam = FAMILIES.get(name)
    return fam is not None and not fam.tma and fam.source.endswith("dense_decode_seesaw.cu")


def report(row: str, backend: str, route: str, grid, runs, ceiling_tbps: float | None = None) -> str:
    """The text report of one row and backend from its launches' (event µs, int64 stamps [CTAs, 16])."""
    us, st = runs[0]
    n_cta = int(np.prod(grid))
    lines = [f"{row} {backend} ({route}, grid {tuple(grid)}, {n_cta} CTAs): event time {us:.1f} us"
             + (f" (repeats: {', '.join(f'{u:.1f}' for u, _ in runs[1:])})" if len(runs) > 1 else "")]
    rel = _relative(st)
    lines.append("  stamp          n    min      med      max   (us from the first CTA's entry)")
    for i in NAMES:
        col = rel[:, i]
        col = col[~np.isnan(col)]
        if len(col):
            lines.append(f"  {i:2d} {NAMES[i]:9s} {len(col):5d} {col.min():8.2f} {np.median(col):8.2f} {col.max():8.2f}")

    def span(a_, b_, label):
        d = rel[:, b_] - rel[:, a_]
        d = d[~np.isnan(d)]
        if len(d):
            lines.append(f"  {label:34s} n {len(d):4d}  min {d.min():7.2f}  med {np.median(d):7.2f}  max {d.max():7.2f}")

    span(0, 1, "entry -> scan")
    span(1, 2, "scan -> item 0 Q ready")
    span(2, 3, "item 0 tiles")
    span(3, 4, "item 0 epilogue")
    span(4, 5, "item 0 epi -> item 1 Q ready")
    span(5, 6, "item 1 tiles")
    span(6, 7, "item 1 epilogue")
    span(11, 12, "merges won")
    if _cp_async(route):  # slots 13 / 14: item 0's epilogue after the row sums / before the out stores
        span(3, 13, "item 0 epi: row sums (barrier)")
        span(13, 14, "item 0 epi: maxima, sM reset")
        span(14, 4, "item 0 epi: out / lse stores")
    else:
        span(0, 13, "entry -> first K load")
    end = np.nanmax(rel[:, [4, 7, 10, 11, 12]], axis=1)
    lines.append(f"  CTA end (last stamp): min {np.nanmin(end):.2f} med {np.nanmedian(end):.2f} max {np.nanmax(end):.2f}"
                 f"; busiest 5 CTAs {', '.join(f'{x:.1f}' for x in np.sort(end)[-5:])}")
    lines += _end_report(runs, row, ceiling_tbps)
    lines += _sm_report(runs)
    return "\n".join(lines)


def _end_report(runs, row: str, ceiling_tbps: float | None) -> list[str]:
    """How much CTA time the uneven ends leave idle (medians over the launches): the mean over the CTAs
    that streamed of (last CTA end - own end), i.e. what evening out their work at their measured
    speeds could save; and, given the streaming-read ceiling, the time the row's K bytes need at that
    ceiling plus the median first K load, below which no schedule brings the last CTA end (in a
    memory-bound row the slow SMs are slow because the bandwidth is shared, so this is the tighter bound)."""
    last, idle, first_k = [], [], []
    for _, st in runs:
        rel = _relative(st)
        ok = ~np.isnan(rel[:, 3])
        if not ok.any():
            return []
        end = np.nanmax(rel[ok][:, [4, 7, 10, 11, 12]], axis=1)
        last.append(float(end.max()))
        idle.append(float((end.max() - end).mean()))
        k0 = rel[ok][:, 13]
        k0 = k0[~np.isnan(k0)]
        first_k.append(float(np.median(k0)) if len(k0) else 0.0)
    out = [f"  uneven ends: last CTA end {np.median(last):.1f} us, mean CTA idle before it {np.median(idle):.1f} us "
           f"over {len(runs)} launch(es)"]
    if ceiling_tbps:
        from gqadrv.mla.bench import row_lengths

        parts = row.split(",")
        b, L = int(parts[0]), int(parts[3])
        nbytes = sum(row_lengths(b, L, parts[4] if len(parts) > 4 else "uniform")) * 576 * 2
        bound = nbytes / (ceiling_tbps * 1e6) + float(np.median(first_k))
        gain = min(float(np.median(idle)), max(0.0, float(np.median(last)) - bound))
        out.append(f"  ceiling bound: K bytes {nbytes / 1e6:.0f} MB at {ceiling_tbps:.2f} TB/s + first K load = "
                   f"{bound:.1f} us; evening out the CTAs that streamed recovers at most {gain:.1f} us "
                   f"({100 * gain / float(np.median(last)):.1f} % of the last CTA end: the smaller of the idle time "
                   f"and the distance to the bound)")
    return out


def _relative(st):
    """Stamps in us from the earliest entry; NaN where a CTA left a slot unwritten; the SM slot NaN."""
    t0 = st[:, 0][st[:, 0] > 0].min()
    rel = np.where(st > 0, (st - t0) / 1e3, np.nan)
    rel[:, SM_SLOT] = np.nan
    return rel


def _sm_report(runs) -> list[str]:
    """Item 0's streaming time per SM in each launch: the slowest and fastest SMs of the first launch,
    and the correlation of the per-SM times between consecutive launches (near 1: the same SMs are
    slow every time, i.e. where a CTA runs decides its speed; near 0: it changes from launch to launch)."""
    per = []
    for _, st in runs:
        rel = _relative(st)
        t = rel[:, 3] - rel[:, 2]
        sm = st[:, SM_SLOT]
        ok = ~np.isnan(t)
        per.append({int(s): float(x) for s, x in zip(sm[ok], t[ok])})
    if not per or not per[0]:
        return []
    first = sorted(per[0].items(), key=lambda kv: kv[1])
    out = [f"  item 0 tiles by SM, launch 1: fastest {', '.join(f'sm{s} {x:.1f}' for s, x in first[:4])}; "
           f"slowest {', '.join(f'sm{s} {x:.1f}' for s, x in first[-4:])}"]
    for i in range(1, len(per)):
        common = sorted(set(per[i - 1]) & set(per[i]))
        if len(common) > 2:
            a = np.array([per[i - 1][s] for s in common])
            c = np.array([per[i][s] for s in common])
            r = float(np.corrcoef(a, c)[0, 1]) if a.std() > 0 and c.std() > 0 else float("nan")
            out.append(f"  per-SM item 0 tiles, launch {i} vs {i + 1}: correlation {r:.2f} over {len(common)} SMs")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rows", nargs="*", help="b,s_q,h_q,L[,kind]")
    ap.add_argument("--backends", nargs="+", default=["narrow16_bal", "seesaw_bal"],
                    help="comma-separated backend groups; narrow* groups run on rows with h_q <= 16 only")
    ap.add_argument("--launches", type=int, default=3, help="traced launches per row and backend (default 3)")
    ap.add_argument("--page-pool", type=int, default=None, metavar="N",
                    help="block-table entries modulo N: every request reads the same N pages (an L2-resident "
                         "cache, like the sparse prefill's kv rows); default: distinct pages")
    ap.add_argument("--json", help="write every stamp of every traced launch to this file")
    ap.add_argument("--from-json", metavar="FILE", help="print the reports of a saved --json file (no GPU needed)")
    ap.add_argument("--ceiling-tbps", type=float, default=None,
                    help="the streaming-read ceiling (TB/s, e.g. from `bench`): adds the bound no schedule can beat")
    a = ap.parse_args(argv)
    import json

    if a.from_json:
        with open(a.from_json) as f:
            for e in json.load(f):
                runs = [(x["event_us"], np.array(x["stamps"], np.int64)) for x in e["launches"]]
                print(report(e["row"], e["backend"], e["route"], e["grid"], runs, a.ceiling_tbps))
        return 0
    if not a.rows:
        ap.error("rows are required unless --from-json is given")

    import cupy as cp

    raw: list = []
    for group in a.backends:
        for row in a.rows:
            h_q = int(row.split(",")[2])
            for backend in group.split(","):
                if backend.startswith("narrow") and h_q > 16:
                    continue
                try:
                    print(trace_row(row, backend, cp, a.launches, raw, a.ceiling_tbps, a.page_pool), flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on with the next row
                    print(f"{row} {backend}: {type(exc).__name__}: {exc}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
