"""Benchmark harness shared by the op families: the streaming-read ceiling, hot (CUDA graph) and
cold (L2 flushed) timers, and the driver loop that runs an op's ``BenchSpec`` and writes JSON.

An op family supplies a ``BenchSpec``: its argparse options, a ``rows(args)`` list of work items,
``run_row(item, timer, args) -> dict`` and ``format_table(meta, rows) -> str``. The harness never
imports an op. ``--plot`` draws the run's results after the table (``ops/plot.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Callable

__all__ = ["BenchSpec", "Timer", "add_common_arguments", "log", "run", "stream_read_ceiling", "target_lines"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    rows: Callable[[Any], list]                       # args -> work items (each has .label)
    run_row: Callable[[Any, "Timer", Any], dict]      # (item, timer, args) -> row dict
    format_table: Callable[[dict, list], str]
    import_peers: Callable[[Any], None] = lambda args: None


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graph-calls", type=int, default=20, help="calls per captured graph (hot)")
    p.add_argument("--reps", type=int, default=15, help="replays / cold samples per measurement")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--ceiling-gib", type=float, default=8.0, help="buffer size of the streaming-read ceiling")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the results to this image (.png, .svg or .pdf; needs matplotlib: "
                        "pip install 'gqadrv[plot]'): seed-shape latency, TB/s vs KV length at B 1/16/128 "
                        "with the read ceiling, MLA TFLOPS and TB/s")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="with --plot: re-plot these saved --json results instead of running (no GPU needed)")


class Timer:
    """CUDA-graph (hot) and L2-flushed (cold) timing on a torch or CuPy stream."""

    def __init__(self, graph_calls: int, reps: int):
        self.n, self.reps = graph_calls, reps
        import cupy as cp

        self.cp = cp
        self.torch = sys.modules.get("torch")
        self.flush = cp.empty(512 << 20, dtype=cp.uint8)

    def cold(self, fn) -> float:
        cp = self.cp
        s = cp.cuda.get_current_stream()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        fn()
        s.synchronize()
        ts = []
        for _ in range(self.reps):
            self.flush.fill(0)
            e0.record(s)
            fn()
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return statistics.median(ts)

    def hot(self, fn, use_torch_graph: bool) -> float:
        if use_torch_graph:
            torch = self.torch
            g = torch.cuda.CUDAGraph()
            st = torch.cuda.Stream()
            with torch.cuda.stream(st):
                fn()
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=st):
                    for _ in range(self.n):
                        fn()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(self.reps):
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3 / self.n)
            return statistics.median(ts)
        cp = self.cp
        st = cp.cuda.Stream(non_blocking=True)
        with st:
            fn()
            st.synchronize()
            st.begin_capture()
            for _ in range(self.n):
                fn()
            g = st.end_capture()
            g.upload(st)
            g.launch(st)
            st.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            ts = []
            for _ in range(self.reps):
                e0.record(st)
                g.launch(st)
                e1.record(st)
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / self.n)
        return statistics.median(ts)


def row_results(r: dict) -> tuple[dict, dict, str | None]:
    """(a bench row's results, gqadrv's result, the table line that replaces the row when gqadrv has
    no timing: its error)."""
    res = r["results"]
    g = res.get("gqadrv", {})
    if "hot_us" in g:
        return res, g, None
    return res, g, f"| {r['shape']} | error: {g.get('error', '?')[:80]} |"


def best_peer_times(res: dict) -> tuple[float | None, float | None]:
    """The fastest hot and cold times (µs) among a row's peers: every result not named ``gqadrv*``
    that has timings; None where no peer ran."""
    peers = [v for k, v in res.items() if not k.startswith("gqadrv") and "hot_us" in v]
    return (min((v["hot_us"] for v in peers), default=None), min((v["cold_us"] for v in peers), default=None))


def speedup_cell(peer_us: float | None, ours_us: float) -> str:
    """gqadrv's speed over a peer's as a table cell (peer time / gqadrv time), '-' without a peer."""
    return f"{peer_us / ours_us:.2f}" if peer_us else "-"


def stream_read_ceiling(gib: float) -> dict:
    """The HBM streaming-read bandwidth of device 0 (int4 loads, grid-stride), best over 4 grids."""
    import cupy as cp

    from ..runtime.compiler import arch_for_cc, compile_module
    from ..runtime.driver import device_info
    from ..runtime.module import PTR, ArgPack, LaunchPlan, Signature, load_library

    info = device_info(0)
    mod = compile_module("runtime/stream_read.cu", arch_for_cc(info.cc))
    k = load_library(mod.cubin, "stream_read").kernel("stream_read", 0)
    nbytes = int(gib * (1 << 30)) // 16 * 16
    buf = cp.ones(nbytes // 4, dtype=cp.int32)
    out = cp.zeros(1, dtype=cp.uint32)
    pack = ArgPack(Signature(("p", PTR), ("n", PTR), ("out", PTR))).pack(int(buf.data.ptr), nbytes // 16, int(out.data.ptr))
    s = cp.cuda.get_current_stream()
    res = {}
    for per_sm in (4, 8, 16, 32):
        plan = LaunchPlan(k, (info.sm_count * per_sm, 1, 1), (512, 1, 1), 0, pack, stream=int(s.ptr))
        plan.launch()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(8):
            e0.record(s)
            plan.launch()
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        res[per_sm] = nbytes / statistics.median(ts) / 1e12
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return {"TBps": max(res.values()), "by_blocks_per_sm": res, "bytes": nbytes}


def run(spec: BenchSpec, args) -> int:
    """Measure the ceiling, then every row of ``spec`` in this process; print the table, write JSON."""
    import cupy as cp

    from .._version import versions
    from ..runtime.driver import device_info

    spec.import_peers(args)
    items = spec.rows(args)
    info = device_info(0)
    meta = {"op": spec.name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": info.name, "cc": info.arch,
            "sms": info.sm_count, "versions": versions(), "command": "python -m gqadrv " + " ".join(sys.argv[1:]),
            "graph_calls": args.graph_calls, "reps": args.reps}
    meta["versions"].update({m: getattr(sys.modules[m], "__version__", "?") for m in ("torch", "flashinfer", "flash_mla")
                             if m in sys.modules})
    log(f"[bench] {info.name}: measuring the streaming-read ceiling ({args.ceiling_gib} GiB)")
    ceil = stream_read_ceiling(args.ceiling_gib)
    meta["ceiling_TBps"] = ceil["TBps"]
    log(f"[bench] ceiling {ceil['TBps']:.3f} TB/s")
    timer = Timer(args.graph_calls, args.reps)
    rows = []
    for i, item in enumerate(items):
        t0 = time.perf_counter()
        row = spec.run_row(item, timer, args)
        rows.append(row)
        res = row.get("results", {})
        g = res.get("gqadrv", {})
        peer_txt = ", ".join(f"{k} {v['hot_us']:.2f}" for k, v in res.items() if not k.startswith("gqadrv") and "hot_us" in v)
        log(f"[bench] {i + 1}/{len(items)} {row.get('shape', item)}: gqadrv hot {g.get('hot_us', float('nan')):.2f} us; "
            f"peers: {peer_txt or 'none'} ({time.perf_counter() - t0:.1f} s)")
        cp.get_default_memory_pool().free_all_blocks()
        if "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()
        if args.json:  # after every row, so an interrupted run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print(spec.format_table(meta, rows))
    if args.json:
        log(f"[bench] wrote {args.json}")
    plot = getattr(args, "plot", None)
    if plot:
        from .plot import plot_results

        plot_results({"meta": meta, "rows": rows}, plot)
        log(f"[bench] wrote {plot}")
    return 0


def target_lines(rows: list, targets: tuple) -> list[str]:
    """One line per target of ``targets`` = ((text, row applies, ratio(results, 'hot_us' | 'cold_us'),
    ratio is good), ...): the rows meeting it hot and cold, the rows missing it (ratios hot / cold),
    the rows where a time is missing."""
    lines = ["Targets (a row meets one when both its hot and cold ratio do):"]
    for text, applies, ratio, good in targets:
        rs = [r for r in rows if applies(r)]
        if not rs:
            lines.append(f"- {text}: no row in this run")
            continue
        met, missed, unmeasured = 0, [], []
        for r in rs:
            hc = [ratio(r["results"], k) for k in ("hot_us", "cold_us")]
            if None in hc:
                unmeasured.append(r["shape"])
            elif all(good(x) for x in hc):
                met += 1
            else:
                missed.append(f"{r['shape']} ({hc[0]:.2f} / {hc[1]:.2f})")
        s = f"- {text}: {met}/{len(rs)} rows"
        if missed:
            s += "; missed: " + ", ".join(missed)
        if unmeasured:
            s += "; not measured: " + ", ".join(unmeasured)
        lines.append(s)
    return lines
