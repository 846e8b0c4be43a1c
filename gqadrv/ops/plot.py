"""Figures of ``python -m gqadrv bench`` results: ``bench --plot FILE.png`` plots the run just made,
``bench --plot FILE.png --from-json a.json [b.json ...]`` re-plots saved ``--json`` files (no GPU).

It works from the bench JSON alone (``{"meta": {...}, "rows": [...]}``, written by ``ops.bench.run``;
each row has ``results``: implementation name -> ``hot_us`` / ``cold_us`` / ... or ``error``) and
imports no op family; it knows the ops' row keys by name. Panels (those with data):

* hot latency per call of the seed shapes (``--op gqa`` rows ``SEED_LABELS``; every GQA row when the
  run has none of them), grouped bars per implementation;
* TB/s (valid KV bytes / hot time) against the KV length at B 1, 16 and 128, one line per
  implementation (``--op gqa`` rows of the default geometry whose requests share one length, and
  the s_q 1 rows of ``--op gqa_paged`` / ``--op gqa_fp8``, labelled with their page size; lengths
  from ``MIN_TBPS_LENGTH`` tokens; FP8 rows count e4m3 bytes, their fp16 implementations fp16
  bytes), with each run's measured streaming-read ceiling as a horizontal line;
* MLA (``--op mla``): hot TFLOPS and hot TB/s per row and implementation (FlashMLA's formulas, as
  the table), with the ceiling on the TB/s panel;
* any other op (e.g. ``--op gqa_step``): its results' ``hot_us`` per row and implementation.

matplotlib is optional (``pip install 'gqadrv[plot]'``) and imported only inside these functions;
figures are drawn on the non-interactive Agg canvas (no pyplot, no display, no global state).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["SEED_LABELS", "TBPS_BATCHES", "build_figure", "check_results", "load_results", "plot_results",
           "require_matplotlib"]

# Shape labels of gqa/bench.py's SEED_SHAPES (tests/test_plot.py keeps the two in step)
SEED_LABELS = ("B1 C64 L[1]", "B4 C256 L[64,127,191,256]", "B1 C1024", "B1 C4096 L[3968]")
TBPS_BATCHES = (1, 16, 128)
TBPS_OPS = ("gqa", "gqa_paged", "gqa_fp8")
MIN_TBPS_LENGTH = 256  # shorter rows (the seed's B1 C64 L[1]) time a launch, not a stream: latency panel only
GQA_GEOMETRY = {"hq": 32, "hkv": 8, "d": 128, "dtype": "float16"}
MATPLOTLIB_MISSING = "bench --plot needs matplotlib, which is not installed: pip install 'gqadrv[plot]' (or matplotlib)"
PANEL_COLS, LEGEND_COLS = 6, 2  # grid columns of a figure row: its 1, 2 or 3 panels, then their legend


def require_matplotlib():
    """(Figure, FigureCanvasAgg); ImportError naming the ``plot`` extra when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"{MATPLOTLIB_MISSING} ({exc})") from None
    return Figure, FigureCanvasAgg


# ----------------------------------------------------------------------------- input
def check_results(doc: Any, name: str = "results") -> dict:
    """``doc`` if it is a bench JSON object (``meta`` object, ``rows`` list of objects with a
    ``results`` object), else ValueError naming ``name``."""
    # ValueError, not TypeError: a bad file content, which the CLI reports as a usage error (exit 2)
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(  # noqa: TRY004
            f"{name}: not a gqadrv bench result (an object with 'meta' and 'rows', as bench --json writes)")
    for i, r in enumerate(doc["rows"]):
        if not isinstance(r, dict) or not isinstance(r.get("results"), dict):
            raise ValueError(f"{name}: row {i + 1} has no 'results' object")  # noqa: TRY004
    return doc


def load_results(source: Any) -> dict:
    """A bench JSON object from a dict or a path (str / PathLike), checked by ``check_results``."""
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            return check_results(json.load(f), os.fspath(source))
    return check_results(source)


def _sources(sources: Any) -> list[dict]:
    if isinstance(sources, (dict, str, os.PathLike)):
        sources = [sources]
    docs = [load_results(s) for s in sources]
    if not docs:
        raise ValueError("nothing to plot: no bench results given")
    counts: dict[str, int] = {}
    out = []
    for d in docs:
        op = str(d["meta"].get("op", "gqa"))
        counts[op] = counts.get(op, 0) + 1
        out.append({"op": op, "meta": d["meta"], "rows": d["rows"], "n": counts[op]})
    for s in out:  # a run's tag: its op, numbered when several runs of one op are plotted together
        s["tag"] = s["op"] if counts[s["op"]] == 1 else f"{s['op']} #{s['n']}"
        s["dup"] = counts[s["op"]] > 1
    return out


def _timed(res: dict) -> Iterable[tuple[str, dict]]:
    """(implementation, result) of a row's results that have a hot time."""
    for impl, v in res.items():
        if isinstance(v, dict) and isinstance(v.get("hot_us"), (int, float)) and v["hot_us"] > 0:
            yield impl, v


def _label(src: dict, row: dict, impl: str) -> str:
    s = impl
    if row.get("page") is not None:
        s += f" (p{row['page']})"
    return f"{s} [{src['tag']}]" if src["dup"] else s


def _kv_length(src: dict, row: dict) -> int | None:
    """The one KV length of all requests of a TB/s-eligible row, else None."""
    if src["op"] not in TBPS_OPS or row.get("s_q", 1) != 1 or not row.get("kv_bytes") or row.get("batch") is None:
        return None
    if src["op"] == "gqa":
        if any(row.get(k, v) != v for k, v in GQA_GEOMETRY.items()):
            return None
        lens = row.get("lengths") or []
        n = lens[0] if lens and all(x == lens[0] for x in lens) else None
    else:
        n = row.get("length")
    return int(n) if isinstance(n, (int, float)) and n >= MIN_TBPS_LENGTH else None


def _impl_bytes(row: dict, impl: str, v: dict) -> float:
    """KV bytes one call of ``impl`` reads: its own ``bytes``, the row's fp16 bytes for an fp16
    implementation of an FP8 row, else the row's ``kv_bytes``."""
    if v.get("bytes"):
        return float(v["bytes"])
    if "fp16" in impl and row.get("kv_bytes_fp16"):
        return float(row["kv_bytes_fp16"])
    return float(row["kv_bytes"])


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------- panels
class _Colors:
    """One colour per series label across every panel (tab10, then the other tab palettes)."""

    def __init__(self):
        from matplotlib import colormaps

        tab20 = colormaps["tab20"].colors
        self.palette = (list(colormaps["tab10"].colors) + list(tab20[1::2]) + list(colormaps["tab20b"].colors)
                        + list(colormaps["tab20c"].colors))
        self.map: dict[str, Any] = {}

    def __call__(self, label: str):
        if label not in self.map:
            self.map[label] = self.palette[len(self.map) % len(self.palette)]
        return self.map[label]


def _side_legend(lax, axes: list) -> None:
    """The legend of a figure row (every series of its panels, once) on its own blank axes."""
    lax.axis("off")
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        lax.legend(list(seen.values()), list(seen), loc="upper left", fontsize=8, frameon=False,
                   ncol=1 if len(seen) <= 24 else 2)


def _bars(ax, groups: list[str], series: dict[str, dict[str, float]], colors: _Colors, fmt: str) -> None:
    """Grouped bars: ``series`` label -> {group: value}; one bar per (group, series) with a value."""
    n = max(1, len(series))
    width = 0.8 / n
    for j, (label, vals) in enumerate(series.items()):
        xs = [i - 0.4 + (j + 0.5) * width for i, g in enumerate(groups) if g in vals]
        hs = [vals[g] for g in groups if g in vals]
        bc = ax.bar(xs, hs, width, label=label, color=colors(label))
        if len(groups) * n <= 40:
            ax.bar_label(bc, fmt=fmt, fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), groups, fontsize=8, rotation=0 if len(groups) <= 6 else 30,
                  ha="center" if len(groups) <= 6 else "right")
    ax.set_xlim(-0.6, len(groups) - 0.4)
    vals = [v for s in series.values() for v in s.values()]
    if vals and min(vals) > 0 and max(vals) / min(vals) > 50:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def _ceilings(ax, srcs: list[dict]) -> None:
    seen: dict[float, list[str]] = {}
    for s in srcs:
        c = s["meta"].get("ceiling_TBps")
        if isinstance(c, (int, float)) and c > 0:
            seen.setdefault(round(float(c), 3), []).append(s["tag"])
    for i, (c, tags) in enumerate(seen.items()):
        label = f"read ceiling {c:.2f} TB/s" + (f" ({', '.join(tags)})" if len(seen) > 1 else "")
        ax.axhline(c, color="black", linestyle=(":", "-.", "--")[i % 3], linewidth=1.2, label=label, gid="ceiling")


def _latency_panel(srcs: list[dict], seed_labels: tuple[str, ...]):
    """(title, groups, series) of the GQA hot latency panel, or None without GQA rows."""
    rows = [(s, r) for s in srcs if s["op"] == "gqa" for r in s["rows"] if any(True for _ in _timed(r["results"]))]
    if not rows:
        return None
    seed = [(s, r) for s, r in rows if r.get("shape") in seed_labels]
    if seed:
        order = {lab: i for i, lab in enumerate(seed_labels)}
        rows = sorted(seed, key=lambda sr: order[sr[1]["shape"]])
        title = "Seed shapes: hot latency per call (µs, lower is better)"
    else:
        title = "GQA rows (no seed shape in these results): hot latency per call (µs, lower is better)"
    groups: list[str] = []
    series: dict[str, dict[str, float]] = {}
    for s, r in rows:
        g = str(r.get("shape", "?"))
        if g not in groups:
            groups.append(g)
        for impl in r["results"]:  # series in the results' order, also where a first run failed
            series.setdefault(_label(s, r, impl), {})
        for impl, v in _timed(r["results"]):
            series[_label(s, r, impl)][g] = float(v["hot_us"])
    return title, groups, {k: v for k, v in series.items() if v}


def _tbps_points(srcs: list[dict]) -> dict[int, dict[str, dict[int, float]]]:
    """batch -> series label -> {KV length: hot TB/s}."""
    out: dict[int, dict[str, dict[int, float]]] = {}
    for s in srcs:
        for r in s["rows"]:
            n = _kv_length(s, r)
            if n is None:
                continue
            for impl, v in _timed(r["results"]):
                tb = _impl_bytes(r, impl, v) / (float(v["hot_us"]) * 1e-6) / 1e12
                out.setdefault(int(r["batch"]), {}).setdefault(_label(s, r, impl), {})[n] = tb
    return out


def _draw_tbps(ax, batch: int, series: dict[str, dict[int, float]], srcs: list[dict], colors: _Colors) -> None:
    lengths = sorted({n for pts in series.values() for n in pts})
    for j, (label, pts) in enumerate(series.items()):
        xs = sorted(pts)
        ours = label.startswith("gqadrv")
        ax.plot(xs, [pts[x] for x in xs], marker="osD^v<>ph*"[j % 10], markersize=4, linewidth=1.4 if ours else 1.0,
                linestyle="-" if ours else "--", label=label, color=colors(label))
    _ceilings(ax, srcs)
    ax.set_title(f"B={batch}: hot TB/s of the valid KV bytes vs KV length", fontsize=10)
    ax.set_xlabel("KV length per request (tokens)", fontsize=8)
    ax.set_ylabel("TB/s", fontsize=8)
    if lengths:
        ax.set_xscale("log", base=2)
        shown: list[int] = []  # label a tick only when it is not crowded by the previous labelled one
        for n in lengths:
            if not shown or n >= 1.4 * shown[-1]:
                shown.append(n)
        ax.set_xticks(lengths, [_fmt_len(n) if n in shown else "" for n in lengths], fontsize=8)
        ax.minorticks_off()
        lo, hi = lengths[0], lengths[-1]
        ax.set_xlim(lo / 1.5, hi * 1.5)
    else:
        ax.text(0.5, 0.5, f"no row at B={batch} in these results", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _metric_panel(srcs: list[dict], key: str) -> tuple[list[str], dict[str, dict[str, float]]]:
    groups: list[str] = []
    series: dict[str, dict[str, float]] = {}
    for s in srcs:
        for r in s["rows"]:
            g = str(r.get("shape", "?")) + (f" [{s['tag']}]" if s["dup"] else "")
            for impl in r["results"]:
                series.setdefault(impl, {})
            for impl, v in _timed(r["results"]):
                if isinstance(v.get(key), (int, float)):
                    if g not in groups:
                        groups.append(g)
                    series[impl][g] = float(v[key])
    return groups, {k: v for k, v in series.items() if v}


def build_figure(sources: Any, seed_labels: Iterable[str] = SEED_LABELS):
    """The matplotlib Figure (Agg canvas) of one or more bench results (dicts or JSON paths). Each
    panel's axes carry a gid: ``latency``, ``tbps_b<B>``, ``mla_tflops``, ``mla_tbps``,
    ``latency_<op>``. ValueError when nothing in the results can be plotted."""
    Figure, FigureCanvasAgg = require_matplotlib()
    srcs = _sources(sources)
    colors = _Colors()
    fig_rows: list[list[tuple[str, Any]]] = []

    lat = _latency_panel(srcs, tuple(seed_labels))
    if lat is not None:
        title, groups, series = lat

        def draw_latency(ax, title=title, groups=groups, series=series):
            _bars(ax, groups, series, colors, "%.1f")
            ax.set_title(title, fontsize=10)
            ax.set_ylabel("µs per call (hot)", fontsize=8)

        fig_rows.append([("latency", draw_latency)])

    pts = _tbps_points(srcs)
    if pts:
        batches = [b for b in TBPS_BATCHES] if set(pts) & set(TBPS_BATCHES) else sorted(pts)[:3]
        tb_srcs = [s for s in srcs if s["op"] in TBPS_OPS]
        fig_rows.append([(f"tbps_b{b}", lambda ax, b=b: _draw_tbps(ax, b, pts.get(b, {}), tb_srcs, colors))
                         for b in batches])

    mla = [s for s in srcs if s["op"] == "mla"]
    for key, gid, title, unit in (("hot_TFLOPS", "mla_tflops", "MLA decode: hot TFLOPS per row (higher is better)",
                                   "TFLOPS"),
                                  ("hot_TBps", "mla_tbps", "MLA decode: hot TB/s per row (q + latent KV + out bytes)",
                                   "TB/s")):
        groups, series = _metric_panel(mla, key)
        if not groups:
            continue

        def draw_mla(ax, groups=groups, series=series, title=title, unit=unit, key=key):
            _bars(ax, groups, series, colors, "%.0f" if key == "hot_TFLOPS" else "%.2f")
            if key == "hot_TBps":
                _ceilings(ax, mla)
            ax.set_title(title, fontsize=10)
            ax.set_ylabel(unit, fontsize=8)

        fig_rows.append([(gid, draw_mla)])

    for op in dict.fromkeys(s["op"] for s in srcs if s["op"] not in TBPS_OPS + ("mla",)):
        groups, series = _metric_panel([s for s in srcs if s["op"] == op], "hot_us")
        if not groups:
            continue

        def draw_other(ax, op=op, groups=groups, series=series):
            _bars(ax, groups, series, colors, "%.1f")
            ax.set_title(f"{op}: hot time per row (the results' hot_us, µs, lower is better)", fontsize=10)
            ax.set_ylabel("µs (hot_us)", fontsize=8)

        fig_rows.append([(f"latency_{op}", draw_other)])

    if not fig_rows:
        raise ValueError("nothing to plot: no row of these results has a gqadrv or peer timing (hot_us)")

    fig = Figure(figsize=(20, 5.2 * len(fig_rows)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(fig_rows), PANEL_COLS + LEGEND_COLS)
    for i, panels in enumerate(fig_rows):
        span = PANEL_COLS // len(panels)
        axes = []
        for j, (gid, draw) in enumerate(panels):
            ax = fig.add_subplot(grid[i, j * span:(j + 1) * span])
            ax.set_gid(gid)
            draw(ax)
            axes.append(ax)
        lax = fig.add_subplot(grid[i, PANEL_COLS:])
        lax.set_gid("legend")
        _side_legend(lax, axes)
    gpus = ", ".join(dict.fromkeys(str(s["meta"].get("gpu", "?")) for s in srcs))
    runs = "; ".join(f"{s['tag']} {s['meta'].get('date', '')}".strip() for s in srcs)
    fig.suptitle(f"gqadrv bench on {gpus} ({runs}); hot = per call in a CUDA graph", fontsize=12)
    return fig


def plot_results(sources: Any, out_png: str | os.PathLike, seed_labels: Iterable[str] = SEED_LABELS):
    """Draw ``build_figure(sources)`` and write it to ``out_png`` (the format follows the suffix:
    .png, .svg, .pdf); returns the Figure."""
    fig = build_figure(sources, seed_labels)
    fig.savefig(os.fspath(out_png), dpi=110)
    return fig
