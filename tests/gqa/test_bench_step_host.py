"""The decode-step GQA bench (``bench --op gqa_step``) without a GPU: the row list and its byte
counts, ``--layers`` through the CLI parser, FlashInfer's page copy (numpy) and page arguments, the
table and the whole-step lines, from fake timings."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv import cli
from gqadrv.gqa import bench_step as bs

META = {"gpu": "H200", "cc": "9.0", "sms": 132, "ceiling_TBps": 4.5, "graph_calls": 20}


def _rows(*argv):
    args = cli.build_parser().parse_args(["bench", "--op", "gqa_step", *argv])
    return bs.SPEC.rows(args)


def test_rows_and_bytes():
    assert [(r.batch, r.capacity, r.layers) for r in bs.ROWS] == [(1, 4096, 64), (16, 4096, 64)]
    assert [r.label for r in bs.ROWS] == ["B1 C4096 x64", "B16 C4096 x64"]
    b1, b16 = bs.ROWS
    assert b1.kv_bytes() == 4096 * 2 * 8 * 128 * 2 == 16_777_216  # 16.8 MB of K+V per layer
    assert b16.kv_bytes() == 16 * 4096 * 2 * 8 * 128 * 2 == 268_435_456
    assert b1.step_bytes() == 64 * 16_777_216 == 1_073_741_824  # 1.07 GB: far beyond the 60 MiB L2
    assert b16.step_bytes() == 17_179_869_184  # 17.2 GB of caches (and as much again for FlashInfer)
    # 16777216 B at 4.5 TB/s = 3.728 us; 268435456 B = 59.65 us
    assert bs.ideal_us(b1.kv_bytes(), 4.5) == pytest.approx(3.7282702)
    assert bs.ideal_us(b16.kv_bytes(), 4.5) == pytest.approx(59.652324)


def test_cli_offers_the_op():
    p = cli.build_parser()
    assert p.parse_args(["bench"]).op == "gqa"
    args = p.parse_args(["bench", "--op", "gqa_step", "--reps", "10", "--json", "s.json", "--no-peers"])
    assert args.op == "gqa_step" and args.reps == 10 and args.json == "s.json" and args.no_peers
    assert args.layers == 64 and args.graph_calls == 20
    assert "gqa_step" in {sp.name for sp in cli._bench_specs()}
    assert [r.label for r in _rows()] == ["B1 C4096 x64", "B16 C4096 x64"]
    rows = _rows("--layers", "8")
    assert [r.label for r in rows] == ["B1 C4096 x8", "B16 C4096 x8"]
    assert rows[1].step_bytes() == 8 * 268_435_456
    for bad in ("0", "-3"):
        with pytest.raises(ValueError, match="--layers"):
            _rows("--layers", bad)


def test_paged_nhd_copy():
    rng = np.random.default_rng(0)
    b, hkv, c, d, page = 3, 2, 48, 4, 16
    kv = rng.standard_normal((b, 2, hkv, c, d)).astype(np.float16)
    pages = bs.paged_nhd(kv, page)
    assert pages.shape == (b * c // page, 2, page, hkv, d) and pages.flags.c_contiguous
    for r in range(b):
        for j in range(2):
            for h in range(hkv):
                for t in range(c):
                    np.testing.assert_array_equal(pages[r * (c // page) + t // page, j, t % page, h], kv[r, j, h, t])
    with pytest.raises(ValueError, match="multiple of 16"):
        bs.paged_nhd(kv[:, :, :, :40], page)


def test_flashinfer_page_args():
    indptr, indices, last = bs.flashinfer_args(bs.StepRow(3, 64, 2))  # 4 pages of 16 per request
    assert indptr.tolist() == [0, 4, 8, 12]
    assert indices.tolist() == list(range(12))
    assert last.tolist() == [16, 16, 16]
    indptr, indices, last = bs.flashinfer_args(bs.ROWS[1])
    assert indptr[-1] == indices.size == 16 * 256 and last.tolist() == [16] * 16
    assert all(x.dtype == np.int32 for x in (indptr, indices, last))


def _row(r: bs.StepRow, **results):
    return {"shape": r.label, "batch": r.batch, "capacity": r.capacity, "layers": r.layers,
            "kv_bytes": r.kv_bytes(), "step_kv_bytes": r.step_bytes(), "results": results}


def _fake_rows():
    b1, b16 = bs.ROWS
    small = bs.StepRow(16, 4096, 8)
    return [
        # per layer: gqadrv 448 / 64 = 7.00 hot, 512 / 64 = 8.00 cold; FlashInfer 640 / 720 -> 10.00 / 11.25,
        # TC 768 / 832 -> 12.00 / 13.00
        _row(b1, gqadrv=bs._entry(b1, 448.0, 512.0, 6.5, 14.0, route="tma", num_splits=16, max_err=1e-3,
                                  max_diff_graph_vs_eager=0.0),
             flashinfer=bs._entry(b1, 640.0, 720.0, 9.5, 16.0, max_diff_vs_gqadrv=2e-3),
             flashinfer_tc=bs._entry(b1, 768.0, 832.0, 11.0, 17.0, max_diff_vs_gqadrv=4e-3)),
        _row(b16, gqadrv={"error": "out of memory"}),
        # 8 layers: 500 / 8 = 62.50, 560 / 8 = 70.00
        _row(small, gqadrv=bs._entry(small, 500.0, 560.0, 61.0, 77.0, route="tma", num_splits=1,
                                     max_diff_graph_vs_eager=0.0),
             flashinfer={"error": "no JIT"}),
    ]


def test_entry_holds_per_layer_times():
    e = bs._entry(bs.ROWS[0], 448.0, 512.0, 6.5, 14.0, route="tma")
    assert e == {"hot_us": 7.0, "cold_us": 8.0, "step_hot_us": 448.0, "step_cold_us": 512.0, "single_hot_us": 6.5,
                 "single_cold_us": 14.0, "route": "tma"}


def test_table():
    lines = bs.format_table(META, _fake_rows()).splitlines()
    assert lines[0].startswith("GPU H200 (cc 9.0, 132 SMs), streaming-read ceiling 4.50 TB/s, decode step: one CUDA "
                               "graph of every layer's GQA decode")
    assert "graph of 20 identical calls" in lines[0] and "5 back-to-back replays" in lines[0]
    assert lines[1].count("|") == lines[2].count("|") == 16
    # B1: ideal 16777216 B / 4.5 TB/s = 3.73 us; 16777216 B / 7 us = 2.40 TB/s (53.3 %); step/single 7 / 6.5 =
    # 1.08, 8 / 14 = 0.57; best FI per layer 10.00 / 11.25 -> x 10 / 7 = 1.43, 11.25 / 8 = 1.41
    assert lines[3] == ("| B1 C4096 x64 | 3.73 | 7.00 | 8.00 | 2.40 | 53.3 | 6.50 / 14.00 | 1.08 / 0.57 | "
                        "10.00 / 11.25 | 12.00 / 13.00 | 9.50 / 16.00 | 11.00 / 17.00 | 1.43 / 1.41 | tma / 16 | "
                        "0.0e+00 / 4.0e-03 |")
    assert lines[4] == "| B16 C4096 x64 | error: out of memory |"
    # 8 layers: ideal 268435456 B / 4.5 TB/s = 59.65; 268435456 B / 62.5 us = 4.29 TB/s (95.4 %);
    # 62.5 / 61 = 1.02, 70 / 77 = 0.91; FlashInfer failed, no TC result
    assert lines[5] == ("| B16 C4096 x8 | 59.65 | 62.50 | 70.00 | 4.29 | 95.4 | 61.00 / 77.00 | 1.02 / 0.91 | err | - | "
                        "err | - | - / - | tma / 1 | 0.0e+00 / - |")
    for line in (lines[3], lines[5]):
        assert line.count("|") == 16
    assert lines[6] == ""


def test_step_lines():
    lines = bs.format_table(META, _fake_rows()).splitlines()[7:]
    assert lines == [
        ("- B1 C4096 x64 whole step (64 layers, 1.07 GB of K+V), us hot / cold: gqadrv 448.0 / 512.0, "
         "flashinfer 640.0 / 720.0, flashinfer_tc 768.0 / 832.0"),
        "- B16 C4096 x64 whole step (64 layers, 17.18 GB of K+V), us hot / cold: no timing; failed: gqadrv",
        ("- B16 C4096 x8 whole step (8 layers, 2.15 GB of K+V), us hot / cold: gqadrv 500.0 / 560.0; "
         "failed: flashinfer"),
    ]
    assert bs.step_lines([]) == []
