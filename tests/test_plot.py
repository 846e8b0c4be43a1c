"""``bench --plot`` (gqadrv/ops/plot.py) from synthetic bench JSONs, on the CPU: the PNG, the panels and
their series and values, several runs in one figure, the ``--from-json`` re-plot command's exit
statuses and one-line errors, the bench loop drawing its own results, and a missing matplotlib."""

from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from gqadrv import cli
from gqadrv.gqa.bench import LARGE_SHAPES, SEED_SHAPES, parse_shape
from gqadrv.ops import bench as ob
from gqadrv.ops import plot

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _meta(op, ceiling, date="2026-12-01 00:00:00 UTC"):
    return {"op": op, "date": date, "gpu": "NVIDIA H200", "cc": "9.0", "sms": 132, "versions": {},
            "command": f"python -m gqadrv bench --op {op}", "graph_calls": 20, "reps": 10, "ceiling_TBps": ceiling}


def _t(hot, **kw):
    return {"hot_us": hot, "cold_us": hot * 1.25, **kw}


def gqa_doc(ceiling=4.56, scale=1.0, date="2026-12-01 00:00:00 UTC"):
    """GQA rows as gqa/bench.py writes them: the seed and large shapes with peers (FlashInfer's tc path
    failed on the first seed shape), a bf16 geometry row without peers, a row whose gqadrv run failed."""
    rows = []
    for i, s in enumerate(SEED_SHAPES + LARGE_SHAPES + ["16,4096,32,8,128,bfloat16"]):
        sh = parse_shape(s)
        hot = scale * (2.0 + i)
        res = {"gqadrv": _t(hot, route="tma", num_splits=1, max_err=1e-3)}
        if "bfloat16" not in s:
            res.update(torch_sdpa=_t(hot * 3.0), flashinfer=_t(hot * 1.5),  # the order gqa/bench.py writes
                       flashinfer_tc=({"error": "RuntimeError('no kernel')"} if i == 0 else _t(hot * 2.0)))
        rows.append({"shape": sh.label, "batch": sh.batch, "capacity": sh.capacity, "lengths": sh.lengths,
                     "hq": sh.hq, "hkv": sh.hkv, "d": sh.d, "dtype": sh.dtype, "kv_bytes": sh.kv_bytes(),
                     "results": res})
    rows.append({"shape": "B2 C8", "batch": 2, "capacity": 8, "lengths": [8, 8], "hq": 32, "hkv": 8, "d": 128,
                 "dtype": "float16", "kv_bytes": 65536, "results": {"gqadrv": {"error": "boom"}}})
    return {"meta": _meta("gqa", ceiling, date), "rows": rows}


def _paged_row(page, b, n, s_q=1):
    kvb = b * n * 2 * 8 * 128 * 2
    res = {"gqadrv": _t(kvb / 4.0e6, route="paged_tma", num_splits=1), "gqadrv_det": _t(kvb / 3.8e6),
           "gqadrv_contig": _t(kvb / 4.1e6)}
    if s_q == 1:
        res.update(flashinfer=_t(kvb / 3.0e6), flashinfer_tc=_t(kvb / 3.5e6))
    else:
        res.update(gqadrv_sq1=_t(kvb / 4.2e6), flashinfer_prefill=_t(kvb / 2.0e6))
    label = f"p{page} B{b} L{n // 1024}K" + ("" if s_q == 1 else f" s_q{s_q}")
    return {"shape": label, "page": page, "batch": b, "length": n, "s_q": s_q, "hq": 32, "hkv": 8, "d": 128,
            "dtype": "float16", "kv_bytes": kvb, "results": res}


def paged_doc():
    rows = [_paged_row(p, b, n) for p in (16, 1) for b in (1, 16, 64, 128) for n in (4096, 32768)]
    return {"meta": _meta("gqa_paged", 4.50), "rows": rows + [_paged_row(16, 16, 4096, 4)]}


def fp8_doc():
    rows = []
    for b, n in ((1, 4096), (1, 32768), (16, 4096), (128, 8192)):
        b16 = b * n * 2 * 8 * 128 * 2
        res = {"gqadrv_fp8": _t(b16 / 7.0e6, bytes=b16 // 2), "gqadrv_fp8_dev": _t(b16 / 7.1e6),
               "gqadrv_fp16": _t(b16 / 4.0e6), "flashinfer_fp8": _t(b16 / 4.0e6),
               "flashinfer_fp8_tc": _t(b16 / 5.0e6), "flashinfer_fp16_tc": _t(b16 / 3.0e6)}
        rows.append({"shape": f"p16 B{b} L{n // 1024}K", "page": 16, "batch": b, "length": n, "s_q": 1, "hq": 32,
                     "hkv": 8, "d": 128, "dtype": "float16", "kv_dtype": "e4m3", "kv_bytes": b16 // 2,
                     "kv_bytes_fp16": b16, "k_scale": 0.01, "v_scale": 0.01, "results": res})
    return {"meta": _meta("gqa_fp8", 4.67), "rows": rows}


def _mla(hot, tf, tb):
    return _t(hot, hot_TFLOPS=tf, hot_TBps=tb, cold_TFLOPS=tf * 0.9, cold_TBps=tb * 0.9)


def mla_doc():
    rows = [{"shape": "b128 s_q1 h_q128 L4096", "b": 128, "s_q": 1, "h_q": 128, "L": 4096, "lens": "uniform",
             "results": {"gqadrv": _mla(271.7, 537.5, 2.35), "flashmla": _mla(240.1, 608.2, 2.66),
                         "flashinfer": _mla(261.5, 558.5, 2.45)}},
            {"shape": "b128 s_q2 h_q64 L8192", "b": 128, "s_q": 2, "h_q": 64, "L": 8192, "lens": "uniform",
             "results": {"gqadrv": _mla(500.0, 520.0, 2.2), "flashmla": {"error": "x"}}}]
    return {"meta": _meta("mla", 4.56), "rows": rows}


def step_doc():
    """An op the plot knows nothing about (bench --op gqa_step): its hot_us per row."""
    return {"meta": _meta("gqa_step", 4.6), "rows": [
        {"shape": "B1 C4096 x64", "results": {"gqadrv": _t(9.5, step_hot_us=608.0), "flashinfer": _t(14.0)}}]}


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _panels(fig):
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid() != "legend"}


def _bars(ax):
    """series label -> [(its group's tick label, bar height), ...] (a group's bars sit within 0.4 of its tick)."""
    ticks = [lab.get_text() for lab in ax.get_xticklabels()]
    return {c.get_label(): [(ticks[round(p.get_x() + p.get_width() / 2)], p.get_height()) for p in c.patches]
            for c in ax.containers}


def _lines(ax):
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()
            if ln.get_gid() != "ceiling"}


def _ceilings(ax):
    return sorted(round(float(ln.get_ydata()[0]), 3) for ln in ax.get_lines() if ln.get_gid() == "ceiling")


def _png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------- the figure
def test_seed_labels_are_the_gqa_bench_seed_shapes():
    assert plot.SEED_LABELS == tuple(parse_shape(s).label for s in SEED_SHAPES)


def test_every_op_in_one_png(tmp_path):
    out = tmp_path / "all.png"
    fig = plot.plot_results([gqa_doc(), paged_doc(), fp8_doc(), mla_doc(), step_doc()], out)
    w, h = _png_size(out)
    assert out.stat().st_size > 50_000 and w > 1000 and h > 1000
    assert list(_panels(fig)) == ["latency", "tbps_b1", "tbps_b16", "tbps_b128", "mla_tflops", "mla_tbps",
                                  "latency_gqa_step"]
    assert sum(ax.get_gid() == "legend" for ax in fig.axes) == 5  # one per figure row
    assert "NVIDIA H200" in fig.get_suptitle() and "gqa_fp8" in fig.get_suptitle()


def test_latency_panel_has_the_seed_shapes_per_implementation(tmp_path):
    doc = gqa_doc()
    ax = _panels(plot.build_figure(doc))["latency"]
    assert "Seed shapes" in ax.get_title()
    seeds = list(plot.SEED_LABELS)
    assert [t.get_text() for t in ax.get_xticklabels()] == seeds
    bars = _bars(ax)
    assert list(bars) == ["gqadrv", "torch_sdpa", "flashinfer", "flashinfer_tc"]
    by_shape = {r["shape"]: r["results"] for r in doc["rows"]}
    for label, pts in bars.items():
        want = [(s, by_shape[s][label]["hot_us"]) for s in seeds if "hot_us" in by_shape[s].get(label, {})]
        assert pts == [(g, pytest.approx(v)) for g, v in want], label
    assert [g for g, _ in bars["flashinfer_tc"]] == seeds[1:]  # its failed run has no bar


def test_latency_panel_without_seed_rows_shows_every_gqa_row():
    doc = gqa_doc()
    doc["rows"] = [r for r in doc["rows"] if r["shape"] not in plot.SEED_LABELS]
    ax = _panels(plot.build_figure(doc))["latency"]
    assert "no seed shape" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == [r["shape"] for r in doc["rows"][:-1]]  # not the error row


def test_tbps_panels_per_batch_with_the_ceilings():
    docs = [gqa_doc(), paged_doc(), fp8_doc()]
    panels = _panels(plot.build_figure(docs))
    gqa = {r["shape"]: r for r in docs[0]["rows"]}

    def tb(row, impl, nbytes=None):
        return (nbytes or row["kv_bytes"]) / (row["results"][impl]["hot_us"] * 1e-6) / 1e12

    b1 = _lines(panels["tbps_b1"])
    # gqa: B1 C1024, B1 C4096 L[3968], B1 C32768; not B1 C64 L[1] (a launch, not a stream)
    xs, ys = b1["gqadrv"]
    assert xs == [1024, 3968, 32768]
    assert ys == pytest.approx([tb(gqa[k], "gqadrv") for k in ("B1 C1024", "B1 C4096 L[3968]", "B1 C32768")])
    for impl in ("gqadrv (p16)", "gqadrv (p1)", "gqadrv_det (p16)", "gqadrv_contig (p1)", "flashinfer_tc (p16)",
                 "gqadrv_fp8 (p16)", "flashinfer_fp16_tc (p16)"):
        assert b1[impl][0] == [4096, 32768], impl
    fp8 = docs[2]["rows"][0]
    assert b1["gqadrv_fp8 (p16)"][1][0] == pytest.approx(tb(fp8, "gqadrv_fp8", fp8["kv_bytes"]))
    assert b1["gqadrv_fp8_dev (p16)"][1][0] == pytest.approx(tb(fp8, "gqadrv_fp8_dev", fp8["kv_bytes"]))
    assert b1["gqadrv_fp16 (p16)"][1][0] == pytest.approx(tb(fp8, "gqadrv_fp16", fp8["kv_bytes_fp16"]))
    assert b1["flashinfer_fp16_tc (p16)"][1][0] == pytest.approx(tb(fp8, "flashinfer_fp16_tc", fp8["kv_bytes_fp16"]))
    assert not any("sq1" in k or "prefill" in k for k in b1)

    b16 = _lines(panels["tbps_b16"])
    assert b16["gqadrv"] == ([4096], [pytest.approx(tb(gqa["B16 C4096"], "gqadrv"))])  # the bf16 row is left out
    assert not any("sq1" in k or "prefill" in k for k in b16)  # s_q 4 rows are left out
    assert _lines(panels["tbps_b128"])["gqadrv"][0] == [8192]
    for gid in ("tbps_b1", "tbps_b16", "tbps_b128"):
        assert _ceilings(panels[gid]) == [4.5, 4.56, 4.67], gid
        assert f"B={gid[6:]}" in panels[gid].get_title()


def test_mla_panels():
    doc = mla_doc()
    panels = _panels(plot.build_figure(doc))
    assert list(panels) == ["mla_tflops", "mla_tbps"]
    tf, tbp = _bars(panels["mla_tflops"]), _bars(panels["mla_tbps"])
    assert list(tf) == ["gqadrv", "flashmla", "flashinfer"]
    assert tf["gqadrv"] == [("b128 s_q1 h_q128 L4096", pytest.approx(537.5)), ("b128 s_q2 h_q64 L8192", pytest.approx(520.0))]
    assert tf["flashmla"] == [("b128 s_q1 h_q128 L4096", pytest.approx(608.2))]  # its s_q 2 run failed
    assert tbp["flashinfer"] == [("b128 s_q1 h_q128 L4096", pytest.approx(2.45))]
    assert _ceilings(panels["mla_tbps"]) == [4.56] and _ceilings(panels["mla_tflops"]) == []


def test_two_runs_of_one_op_are_told_apart():
    fig = plot.build_figure([gqa_doc(date="d1"), gqa_doc(scale=2.0, ceiling=4.4, date="d2")])
    panels = _panels(fig)
    bars = _bars(panels["latency"])
    assert bars["gqadrv [gqa #1]"][0][1] == pytest.approx(2.0) and bars["gqadrv [gqa #2]"][0][1] == pytest.approx(4.0)
    assert {"gqadrv [gqa #1]", "gqadrv [gqa #2]"} <= set(_lines(panels["tbps_b1"]))
    assert _ceilings(panels["tbps_b1"]) == [4.4, 4.56]
    assert "gqa #1 d1" in fig.get_suptitle() and "gqa #2 d2" in fig.get_suptitle()


def test_paths_and_dicts_are_both_accepted(tmp_path):
    p = _write(tmp_path, "paged.json", paged_doc())
    fig = plot.build_figure([str(p), p, mla_doc()])
    assert list(_panels(fig)) == ["tbps_b1", "tbps_b16", "tbps_b128", "mla_tflops", "mla_tbps"]
    assert "gqadrv (p16) [gqa_paged #2]" in _lines(_panels(fig)["tbps_b1"])


def test_nothing_to_plot_and_bad_documents_are_value_errors():
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.build_figure({"meta": _meta("gqa", 4.5), "rows": [{"shape": "x", "results": {"gqadrv": {"error": "e"}}}]})
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.build_figure([])
    for bad in ({"rows": []}, {"meta": {}, "rows": {}}, [1], {"meta": {}, "rows": [{"shape": "x"}]}):
        with pytest.raises(ValueError, match="bench"):
            plot.check_results(bad, "bench.json")


def test_missing_matplotlib_names_the_plot_extra(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'gqadrv[plot]'")):
        plot.plot_results(gqa_doc(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- the command line
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gqadrv", "bench", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)


def _one_line_error(rc, err, status=2):
    assert rc == status, (rc, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqadrv bench: error: "), err
    return lines[0]


def test_from_json_replots_without_a_gpu(tmp_path):
    a, b = _write(tmp_path, "a.json", gqa_doc()), _write(tmp_path, "b.json", mla_doc())
    out = tmp_path / "sub" / "fig.png"
    out.parent.mkdir()
    r = _cli("--plot", out, "--from-json", a, b)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"wrote {out} from 2 result file(s)"
    _png_size(out)
    assert "--plot FILE.png" in _cli("--help").stdout and "--from-json" in _cli("--help").stdout


def test_from_json_svg(tmp_path):
    r = _cli("--plot", tmp_path / "f.svg", "--from-json", _write(tmp_path, "a.json", fp8_doc()))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "f.svg").read_text().lstrip().startswith("<?xml")


def test_from_json_errors_are_one_line(tmp_path):
    good = _write(tmp_path, "good.json", gqa_doc())
    (tmp_path / "notjson.json").write_text("{")
    _write(tmp_path, "notbench.json", {"a": 1})
    _write(tmp_path, "empty.json", {"meta": _meta("gqa", 4.5), "rows": []})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    png = tmp_path / "x.png"
    cases = [
        (("--from-json", good), "--from-json re-plots saved results: give the image with --plot"),
        (("--plot", png, "--from-json", tmp_path / "missing.json"), "missing.json: no such file"),
        (("--plot", png, "--from-json", tmp_path), "is a directory"),
        (("--plot", png, "--from-json", tmp_path / "notjson.json"), "notjson.json: not JSON"),
        (("--plot", png, "--from-json", tmp_path / "notbench.json"), "notbench.json: not a gqadrv bench result"),
        (("--plot", png, "--from-json", tmp_path / "empty.json"), "nothing to plot"),
        (("--plot", png, "--from-json", good, "--json", tmp_path / "o.json"), "give one of them"),
        (("--plot", tmp_path / "x.txt", "--from-json", good), "expected an image file name ending in .png"),
        (("--plot", tmp_path / "d.png", "--from-json", good), "is a directory"),
        (("--plot", "/proc/forbidden/x.png", "--from-json", good), "/proc/forbidden does not exist"),
        (("--plot", a_file / "x.png", "--from-json", good), "is not a directory"),
        (("--plot",), "expected one argument"),
        (("--plot", png, "--from-json"), "expected at least one argument"),
    ]
    (tmp_path / "d.png").mkdir()
    for args, want in cases:
        r = _cli(*args)
        line = _one_line_error(r.returncode, r.stderr)
        assert want in line, (args, line)
    assert not png.exists()


def test_unwritable_plot_path_is_a_usage_error(monkeypatch, tmp_path, capsys):
    good = _write(tmp_path, "good.json", gqa_doc())
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)  # root may write anywhere: pretend
    rc = cli.main(["bench", "--plot", str(tmp_path / "x.png"), "--from-json", str(good)])
    assert "x.png: not writable" in _one_line_error(rc, capsys.readouterr().err)


def test_missing_matplotlib_is_a_usage_error_before_any_work(monkeypatch, tmp_path, capsys):
    good = _write(tmp_path, "good.json", gqa_doc())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (["bench", "--plot", str(tmp_path / "x.png"), "--from-json", str(good)],
                 ["bench", "--plot", str(tmp_path / "x.png")]):  # the GPU run: refused before it starts
        rc = cli.main(argv)
        line = _one_line_error(rc, capsys.readouterr().err)
        assert "needs matplotlib" in line and "gqadrv[plot]" in line, line
    assert not (tmp_path / "x.png").exists()


def test_a_bad_plot_path_is_found_before_the_gpu_check(tmp_path):
    r = _cli("--plot", tmp_path / "x.bmp")
    assert "x.bmp: expected an image file name" in _one_line_error(r.returncode, r.stderr)


# ----------------------------------------------------------------------------- the bench loop
def test_bench_run_draws_its_results_after_the_table(monkeypatch, tmp_path, capsys):
    """ops.bench.run with --plot, on CPU stand-ins for the device, ceiling and timer."""
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    info = types.SimpleNamespace(name="Fake GPU", arch="9.0", sm_count=132)
    monkeypatch.setattr("gqadrv.runtime.driver.device_info", lambda i: info)
    monkeypatch.setattr(ob, "stream_read_ceiling", lambda gib: {"TBps": 4.5})
    monkeypatch.setattr(ob, "Timer", lambda n, reps: None)
    rows = {r["shape"]: r for r in gqa_doc()["rows"]}
    spec = ob.BenchSpec(name="gqa", add_arguments=lambda p: None, rows=lambda args: list(plot.SEED_LABELS),
                        run_row=lambda item, timer, args: rows[item], format_table=lambda meta, rs: f"TABLE {len(rs)}")
    out, js = tmp_path / "run.png", tmp_path / "run.json"
    args = argparse.Namespace(graph_calls=20, reps=3, ceiling_gib=1.0, json=str(js), plot=str(out))
    assert ob.run(spec, args) == 0
    io = capsys.readouterr()
    assert io.out.strip() == "TABLE 4" and f"[bench] wrote {out}" in io.err
    _png_size(out)
    saved = json.loads(js.read_text())  # the same results re-plot to the same panels
    assert saved["meta"]["ceiling_TBps"] == 4.5 and len(saved["rows"]) == 4
    panels = _panels(plot.build_figure(saved))
    assert list(panels) == ["latency", "tbps_b1", "tbps_b16", "tbps_b128"]
    assert _lines(panels["tbps_b1"])["gqadrv"][0] == [1024, 3968] and _ceilings(panels["tbps_b1"]) == [4.5]
    assert _lines(panels["tbps_b16"]) == {} and "no row at B=16" in panels["tbps_b16"].texts[0].get_text()
    args.plot = None  # without --plot nothing is drawn
    out.unlink()
    assert ob.run(spec, args) == 0 and not out.exists()
