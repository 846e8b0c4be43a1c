"""Decode-step GQA bench spec (run by ``ops.bench.run``): ``python -m gqadrv bench --op gqa_step``.

    python -m gqadrv bench --op gqa_step [--layers N] [--no-peers] [--reps N] [--json out.json]

What a serving engine feels: one CUDA graph holding a whole decode step's attention, ``--layers``
(default 64) consecutive layers, each with its own KV cache, so every layer reads its cache from
HBM (64 caches of 16.8 MB / 268 MB are far beyond the H200's 60 MiB L2), while the single-launch numbers
of ``bench --op gqa`` re-read one cache in a graph of N identical calls (at B1 C4096 the cache
stays in L2). fp16, Hq 32, Hkv 8, D 128, contiguous caches ``[B, 2, Hkv, C, D]``, every request at
its full length C. Rows: B1 C4096 and B16 C4096 (B16: 64 x 268 MB = 17.2 GB of caches, plus the
same again for FlashInfer's paged copies). Per row, in one process:
  gqadrv         one ``prepare_gqa_decode`` per layer (own q, cache, output; shared lengths), the
                 layers' ``launch_prepared`` calls captured into one CUDA graph (torch's graph when
                 torch imports, else CuPy's)
  flashinfer, flashinfer_tc   ``BatchDecodeWithPagedKVCacheWrapper`` NHD (CUDA-core / tensor-core
                 path) planned once per step and run once per layer on that layer's cache (the
                 wrapper is built to be reused across layers), copied from the same bytes into page-16
                 NHD pages (``paged_nhd``), the layers' ``run`` calls captured into one torch graph
Columns (``hot_us`` / ``cold_us`` of a result are its per-layer step times):
  step us/layer  graph replay time / layers; hot: mean of REPLAYS_PER_SAMPLE back-to-back replays
                 (median of ``--reps`` samples), cold: one replay after an L2 flush (median)
  single         one layer as the other benches time it: per call in a graph of ``--graph-calls``
                 identical calls (hot, the same cache re-read) and one L2-flushed call (cold)
  ideal          K+V bytes of one layer / the streaming-read ceiling measured in this run
  TB/s, % ceil   K+V bytes of one layer / step us/layer (hot)
  step/single    step us/layer / single-layer time, hot / cold
  x best FI      the best FlashInfer step us/layer / gqadrv's, hot / cold (> 1: gqadrv faster)
  max diff       after the replays: gqadrv's outputs against its eager step (outputs zeroed before
                 the replays, so a layer the graph missed shows) / FlashInfer's (all layers) against
                 gqadrv's
Below the table, one line per row with the whole-step times (``step_lines``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from ..ops.bench import (
    BenchSpec,
    Timer,
    best_peer_times,
    log,
    row_results,
    speedup_cell,
)
from . import bench_paged as bp

HQ, HKV, D = 32, 8, 128
LAYERS = 64
CAPACITY = 4096
BATCHES = (1, 16)
FI_PAGE = 16
REPLAYS_PER_SAMPLE = 5
SEED = 4321
ORACLE_MAX_ELEMENTS = 64 << 20  # float64 oracle of layer 0 only for caches up to this many elements
FI_NAMES = (("flashinfer", False), ("flashinfer_tc", True))


@dataclasses.dataclass(frozen=True)
class StepRow:
    batch: int
    capacity: int = CAPACITY
    layers: int = LAYERS

    @property
    def label(self) -> str:
        return f"B{self.batch} C{self.capacity} x{self.layers}"

    def kv_bytes(self) -> int:
        """K+V bytes one layer reads (fp16, every request at full length)."""
        return self.batch * self.capacity * 2 * HKV * D * 2

    def step_bytes(self) -> int:
        """K+V bytes of all layers' caches (what the step reads, and what it allocates)."""
        return self.layers * self.kv_bytes()


def ideal_us(kv_bytes: int, ceiling_tbps: float) -> float:
    """µs to read ``kv_bytes`` at the streaming-read ceiling (TB/s)."""
    return kv_bytes / (ceiling_tbps * 1e6)


ROWS = [StepRow(b) for b in BATCHES]


def paged_nhd(kv, page: int):
    """A contiguous cache [B, 2, Hkv, C, D] as FlashInfer's combined NHD pages [B * C/page, 2, page,
    Hkv, D], request b's pages b*C/page .. (b+1)*C/page - 1 in order (a C-contiguous copy; numpy or
    CuPy). C must be a multiple of ``page``."""
    b, two, hkv, c, d = kv.shape
    if two != 2 or c % page:
        raise ValueError(f"paged_nhd: cache {tuple(kv.shape)} is not [B, 2, Hkv, C, D] with C a multiple of {page}")
    n = c // page
    out = kv.reshape(b, 2, hkv, n, page, d).transpose(0, 3, 1, 4, 2, 5).reshape(b * n, 2, page, hkv, d)
    return out if out.flags.c_contiguous else out.copy()


def flashinfer_args(row: StepRow, page: int = FI_PAGE):
    """FlashInfer's (indptr, indices, last_page_len), numpy int32, for ``paged_nhd``'s page order."""
    import numpy as np

    n = -(-row.capacity // page)
    table = np.arange(row.batch * n, dtype=np.int32).reshape(row.batch, n)
    return bp.flashinfer_page_args(table, [row.capacity] * row.batch, page)


# ----------------------------------------------------------------------------- options and rows
def add_arguments(p: argparse.ArgumentParser) -> None:
    # --no-peers and --backend come from the gqa spec (one shared parser); read with getattr
    p.add_argument("--layers", type=int, default=LAYERS, metavar="N",
                   help=f"--op gqa_step: layers in the captured decode step, each with its own KV cache "
                        f"(default {LAYERS})")


def _rows(args) -> list:
    layers = getattr(args, "layers", LAYERS)
    if layers < 1:
        raise ValueError(f"--layers {layers}: expected a positive count")
    return [dataclasses.replace(r, layers=layers) for r in ROWS]


# ----------------------------------------------------------------------------- GPU side
class StepGraph:
    """One CUDA graph of ``fn`` (a whole step: every layer's launch), captured after one eager call,
    and the CuPy stream its replays go to (torch graphs replay on torch's current stream)."""

    def __init__(self, fn, use_torch: bool):
        import cupy as cp

        if use_torch:
            torch = sys.modules["torch"]
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                fn()
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=side):
                    fn()
            torch.cuda.synchronize()
            ptr = torch.cuda.current_stream().cuda_stream
            self.stream = cp.cuda.Stream.null if ptr == 0 else cp.cuda.ExternalStream(ptr)
            self.replay = g.replay
        else:
            side = cp.cuda.Stream(non_blocking=True)
            with side:
                fn()
                side.synchronize()
                side.begin_capture()
                fn()
                g = side.end_capture()
            g.upload(side)
            self.stream = side
            self.replay = lambda: g.launch(side)
        self.graph = g  # keeps the graph (and a torch graph's memory pool) alive


def time_step(graph: StepGraph, timer: Timer) -> tuple[float, float]:
    """(hot, cold) µs of one replay of ``graph``: hot the mean of REPLAYS_PER_SAMPLE back-to-back
    replays, cold one replay after the L2 flush; each the median of ``timer.reps`` samples."""
    cp = timer.cp
    s = graph.stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    graph.replay()
    s.synchronize()
    hot, cold = [], []
    for _ in range(timer.reps):
        e0.record(s)
        for _ in range(REPLAYS_PER_SAMPLE):
            graph.replay()
        e1.record(s)
        e1.synchronize()
        hot.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / REPLAYS_PER_SAMPLE)
    for _ in range(timer.reps):
        with s:
            timer.flush.fill(0)
        e0.record(s)
        graph.replay()
        e1.record(s)
        e1.synchronize()
        cold.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(hot), statistics.median(cold)


def _entry(row: StepRow, step_hot: float, step_cold: float, single_hot: float, single_cold: float, **kw) -> dict:
    """A result: per-layer step times as hot_us / cold_us (what the harness and the peer ratios read)."""
    return {"hot_us": step_hot / row.layers, "cold_us": step_cold / row.layers, "step_hot_us": step_hot,
            "step_cold_us": step_cold, "single_hot_us": single_hot, "single_cold_us": single_cold, **kw}


def _enough_memory(need: int, what: str, row: StepRow, res: dict, name: str) -> bool:
    import cupy as cp

    bp._free_memory()
    free = cp.cuda.runtime.memGetInfo()[0]
    if need <= free:
        return True
    res[name] = {"error": f"skipped: {what} need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"}
    log(f"[bench] {row.label} {name}: {res[name]['error']}")
    return False


def _gqadrv(row: StepRow, qs, kvs, lens, outs, timer: Timer, res: dict, backend) -> bool:
    """Prepare every layer, run the step eagerly, capture it, time the replays and one layer."""
    import cupy as cp

    import gqadrv

    from .reference import gqa_decode_reference

    use_torch = bp._torch() is not None
    try:
        preps = [gqadrv.prepare_gqa_decode({"Q": qs[i], "KV": kvs[i], "O": outs[i], "sequence_lengths": lens},
                                           backend=backend, stream=bp._prepare_stream()) for i in range(row.layers)]

        def step():
            s = bp._launch_stream()
            for p in preps:
                gqadrv.launch_prepared(p, s)

        def layer():
            gqadrv.launch_prepared(preps[0], bp._launch_stream())

        step()
        cp.cuda.Device().synchronize()
        eager = outs.copy()
        err = None
        if kvs[0].size <= ORACLE_MAX_ELEMENTS:
            ref = gqa_decode_reference(cp.asnumpy(qs[0]), cp.asnumpy(kvs[0]), cp.asnumpy(lens))
            err = float(abs(cp.asnumpy(eager[0]).astype("float64") - ref).max())
        graph = StepGraph(step, use_torch)
        outs.fill(0)
        cp.cuda.Device().synchronize()
        step_hot, step_cold = time_step(graph, timer)
        cp.cuda.Device().synchronize()
        diff = bp._max_diff(eager, outs)
        del graph
        res["gqadrv"] = _entry(row, step_hot, step_cold, timer.hot(layer, use_torch), timer.cold(layer),
                               route=preps[0].route, num_splits=preps[0].num_splits, max_err=err,
                               max_diff_graph_vs_eager=diff)
        return True
    except Exception as exc:  # noqa: BLE001 - one failed measurement must not end the run
        bp._error(res, "gqadrv", row.label, exc)
        return False


def _flashinfer(row: StepRow, qs, kvs, ref, timer: Timer, res: dict) -> None:
    """FlashInfer's paged decode on page-16 NHD copies of the layers' caches, one wrapper per path."""
    import cupy as cp

    torch, fi = sys.modules["torch"], sys.modules["flashinfer"]
    if not _enough_memory(row.step_bytes() + bp.FI_WORKSPACE_BYTES + (1 << 30), "FlashInfer's paged copies", row,
                          res, "flashinfer"):
        return
    try:
        pages = [torch.from_dlpack(paged_nhd(kv, FI_PAGE)) for kv in kvs]
        tq = torch.from_dlpack(qs)
        dev = tq.device
        tout = torch.empty_like(tq)
        tref = torch.from_dlpack(ref) if ref is not None else None
        indptr, indices, last = (torch.from_numpy(x).to(dev) for x in flashinfer_args(row))
        ws = torch.zeros(bp.FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        cp.cuda.Device().synchronize()
    except Exception as exc:  # noqa: BLE001 - optional peer
        bp._error(res, "flashinfer", row.label, exc)
        return
    for name, tc in FI_NAMES:
        try:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(indptr, indices, last, HQ, HKV, D, FI_PAGE, pos_encoding_mode="NONE", q_data_type=tq.dtype,
                   kv_data_type=tq.dtype)

            def step(w=w):
                for i in range(row.layers):
                    w.run(tq[i], pages[i], out=tout[i])

            def layer(w=w):
                w.run(tq[0], pages[0], out=tout[0])

            graph = StepGraph(step, True)
            tout.zero_()
            torch.cuda.synchronize()
            step_hot, step_cold = time_step(graph, timer)
            torch.cuda.synchronize()
            diff = None if tref is None else float((tout.float() - tref.float()).abs().max())
            del graph
            res[name] = _entry(row, step_hot, step_cold, timer.hot(layer, True), timer.cold(layer),
                               max_diff_vs_gqadrv=diff)
        except Exception as exc:  # noqa: BLE001 - optional peer
            bp._error(res, name, row.label, exc)


def _measure(row: StepRow, timer: Timer, args) -> dict:
    import cupy as cp

    out = {"shape": row.label, "batch": row.batch, "capacity": row.capacity, "layers": row.layers, "hq": HQ,
           "hkv": HKV, "d": D, "dtype": "float16", "kv_bytes": row.kv_bytes(), "step_kv_bytes": row.step_bytes(),
           "fi_page": FI_PAGE, "replays_per_sample": REPLAYS_PER_SAMPLE}
    res: dict = {}
    out["results"] = res
    if not _enough_memory(row.step_bytes() + (1 << 30), f"{row.layers} caches", row, res, "gqadrv"):
        return out
    log(f"[bench] {row.label}: {row.layers} caches of {row.kv_bytes() / 1e6:.1f} MB "
        f"({row.step_bytes() / 1e9:.2f} GB)")
    rs = cp.random.RandomState(SEED + row.batch)
    qs = bp._randn_fp16(rs, (row.layers, row.batch, HQ, D))
    kvs = [bp._randn_fp16(rs, (row.batch, 2, HKV, row.capacity, D)) for _ in range(row.layers)]
    lens = cp.full((row.batch,), row.capacity, dtype=cp.int32)
    outs = cp.empty_like(qs)
    ok = _gqadrv(row, qs, kvs, lens, outs, timer, res, getattr(args, "backend", None))
    if not getattr(args, "no_peers", False) and "torch" in sys.modules and "flashinfer" in sys.modules:
        _flashinfer(row, qs, kvs, outs if ok else None, timer, res)
    return out


def _run_row(row: StepRow, timer: Timer, args) -> dict:
    out = _measure(row, timer, args)
    bp._free_memory()  # _measure's arrays are gone: the next row starts with an empty pool
    return out


# ----------------------------------------------------------------------------- table
def _pair(v: dict, hot: str, cold: str) -> str:
    if hot in v and cold in v:
        return f"{v[hot]:.2f} / {v[cold]:.2f}"
    return "err" if "error" in v else "-"


def _diff(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def format_table(meta: dict, rows: list) -> str:
    ceil = meta["ceiling_TBps"]
    out = [(f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {ceil:.2f} TB/s, "
            f"decode step: one CUDA graph of every layer's GQA decode, each layer its own contiguous cache "
            f"[B, 2, Hkv, C, D], fp16 Hq {HQ} Hkv {HKV} D {D}, every request at full length; step us/layer = "
            f"replay time / layers (hot: {REPLAYS_PER_SAMPLE} back-to-back replays, cold: one replay after an L2 "
            f"flush); single = one layer per call in a graph of {meta['graph_calls']} identical calls (hot) / "
            f"one L2-flushed call (cold); ideal = K+V bytes per layer / ceiling; FlashInfer on page-{FI_PAGE} "
            f"NHD copies; cells hot / cold"),
           ("| row | ideal us/layer | step us/layer hot | step us/layer cold | TB/s | % ceil | single hot / cold | "
            "step/single | FI step hot / cold | FI TC step hot / cold | FI single hot / cold | "
            "FI TC single hot / cold | x best FI step | route / splits | max diff graph / FI |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res, g, error_line = row_results(r)
        if error_line is not None:
            out.append(error_line)
            continue
        ideal = ideal_us(r["kv_bytes"], ceil)
        tbps = r["kv_bytes"] / (g["hot_us"] * 1e-6) / 1e12
        single = {"hot_us": g["single_hot_us"], "cold_us": g["single_cold_us"]}
        best_hot, best_cold = best_peer_times(res)
        fi = [v.get("max_diff_vs_gqadrv") for k, v in res.items() if not k.startswith("gqadrv")]
        fi = [x for x in fi if x is not None]
        out.append(f"| {r['shape']} | {ideal:.2f} | {g['hot_us']:.2f} | {g['cold_us']:.2f} | {tbps:.2f} | "
                   f"{100 * tbps / ceil:.1f} | {_pair(g, 'single_hot_us', 'single_cold_us')} | "
                   f"{bp._ratio_pair(g, single)} | {_pair(res.get('flashinfer', {}), 'hot_us', 'cold_us')} | "
                   f"{_pair(res.get('flashinfer_tc', {}), 'hot_us', 'cold_us')} | "
                   f"{_pair(res.get('flashinfer', {}), 'single_hot_us', 'single_cold_us')} | "
                   f"{_pair(res.get('flashinfer_tc', {}), 'single_hot_us', 'single_cold_us')} | "
                   f"{speedup_cell(best_hot, g['hot_us'])} / {speedup_cell(best_cold, g['cold_us'])} | "
                   f"{g.get('route', '?')} / {g.get('num_splits', '?')} | "
                   f"{_diff(g.get('max_diff_graph_vs_eager'))} / {_diff(max(fi) if fi else None)} |")
    return "\n".join(out + [""] + step_lines(rows))


def step_lines(rows: list) -> list[str]:
    """One line per row: each result's whole-step time (µs per replay of the graph, hot / cold) and
    gqadrv's per-layer time against the ideal."""
    lines = []
    for r in rows:
        res = r["results"]
        parts = [f"{k} {v['step_hot_us']:.1f} / {v['step_cold_us']:.1f}" for k, v in res.items() if "step_hot_us" in v]
        errs = [k for k, v in res.items() if "error" in v]
        s = f"- {r['shape']} whole step ({r['layers']} layers, {r['step_kv_bytes'] / 1e9:.2f} GB of K+V), us hot / cold: "
        s += ", ".join(parts) if parts else "no timing"
        if errs:
            s += "; failed: " + ", ".join(errs)
        lines.append(s)
    return lines


SPEC = BenchSpec(name="gqa_step", add_arguments=add_arguments, rows=_rows, run_row=_run_row,
                 format_table=format_table, import_peers=bp._import_peers)
