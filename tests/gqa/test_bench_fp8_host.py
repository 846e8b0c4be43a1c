"""The FP8-e4m3 KV paged GQA decode bench (``bench --op gqa_fp8``) without a GPU: the row list (the
ANCHORS rows), ``--rows`` / ``--quick`` through the CLI parser, the table and its ratio / TB/s /
diff cells, and the FP8 target lines, from fake timings."""

from __future__ import annotations

import pytest

from gqadrv import cli
from gqadrv.gqa import bench_fp8 as bf
from gqadrv.gqa import bench_paged as bp

META = {"gpu": "H200", "cc": "9.0", "sms": 132, "ceiling_TBps": 4.5, "graph_calls": 20}


def _t(hot, cold, **kw):
    return {"hot_us": hot, "cold_us": cold, **kw}


def _rows(*argv):
    args = cli.build_parser().parse_args(["bench", "--op", "gqa_fp8", *argv])
    return [r.label for r in bf.SPEC.rows(args)]


def test_the_anchor_rows_are_all_there():
    assert [(r.page, r.batch, r.length, r.s_q) for r in bf.ROWS] == [
        (16, 1, 4096, 1), (16, 1, 32768, 1), (16, 16, 4096, 1), (16, 64, 4096, 1), (16, 128, 8192, 1),
        (16, 256, 2048, 1)]
    assert [r.label for r in bf.ROWS] == ["p16 B1 L4K", "p16 B1 L32K", "p16 B16 L4K", "p16 B64 L4K", "p16 B128 L8K",
                                          "p16 B256 L2K"]
    big = bf.ROWS[4]
    assert big.kv_bytes() == 128 * 8192 * 2 * 8 * 128 * 2  # 4.3 GB of fp16 K+V
    assert bf.fp8_bytes(big) == 128 * 8192 * 2 * 8 * 128  # 1 byte per element
    assert bf.fp8_bytes(bf.ROWS[5]) == 256 * 2048 * 2 * 8 * 128
    assert big.pages_per_request == 512


def test_cli_offers_the_op_next_to_gqa_paged():
    p = cli.build_parser()
    assert p.parse_args(["bench"]).op == "gqa"
    args = p.parse_args(["bench", "--op", "gqa_fp8", "--no-peers", "--reps", "3", "--json", "x.json"])
    assert args.op == "gqa_fp8" and args.no_peers and args.reps == 3 and args.json == "x.json"
    assert not args.quick and args.rows is None
    assert {sp.name for sp in cli._bench_specs()} >= {"gqa", "gqa_paged", "gqa_fp8"}
    assert _rows() == [r.label for r in bf.ROWS]
    # the shared --rows / --quick still select gqa_paged's rows for --op gqa_paged
    args = p.parse_args(["bench", "--op", "gqa_paged", "--quick"])
    assert [r.label for r in bp.SPEC.rows(args)] == ["p1 B16 L4K", "p16 B16 L4K s_q4"]


def test_quick_and_row_filters():
    assert _rows("--quick") == ["p16 B1 L4K", "p16 B16 L4K"]
    assert _rows("--rows", "b1") == ["p16 B1 L4K", "p16 B1 L32K"]  # b1 is not b16 / b128
    assert _rows("--rows", "b256", "8k") == ["p16 B128 L8K", "p16 B256 L2K"]
    assert _rows("--rows", "4k,b64", "l2048") == ["p16 B64 L4K", "p16 B256 L2K"]
    assert _rows("--rows", "P16,SQ1") == [r.label for r in bf.ROWS]
    assert _rows("--quick", "--rows", "b16") == ["p16 B16 L4K"]
    with pytest.raises(ValueError, match=r"unknown tag\(s\) page1 .*b256"):  # a gqa_paged tag, the fp8 tag list
        _rows("--rows", "page1")
    with pytest.raises(ValueError, match="unknown tag"):
        _rows("--rows", "sq4")
    with pytest.raises(ValueError, match="no row"):
        _rows("--rows", "b256,4k")
    with pytest.raises(ValueError, match="no row"):
        _rows("--quick", "--rows", "b64")


def _row(label, batch, length, **results):
    r = bp.PagedRow(16, batch, length)
    return {"shape": label, "page": 16, "batch": batch, "length": length, "s_q": 1, "kv_bytes": bf.fp8_bytes(r),
            "kv_bytes_fp16": r.kv_bytes(), "results": results}


def _fp8(row_len, batch, hot, cold, **kw):
    return _t(hot, cold, bytes=bf.fp8_bytes(bp.PagedRow(16, batch, row_len)), **kw)


def _fake_rows():
    # p16 B64 L4K: 536,870,912 fp8 bytes, 1,073,741,824 fp16 bytes; B1 L4K 8,388,608 / 16,777,216
    return [
        _row("p16 B64 L4K", 64, 4096,
             gqadrv_fp8=_fp8(4096, 64, 120.0, 160.0, route="paged_tma_e4m3", num_splits=1, max_diff_vs_fp16=2.5e-2),
             gqadrv_fp8_dev=_t(124.0, 164.0, max_diff_vs_gqadrv=0.0), gqadrv_fp16=_t(240.0, 288.0),
             flashinfer_fp8=_t(360.0, 400.0, max_diff_vs_gqadrv=1e-3),
             flashinfer_fp8_tc=_t(180.0, 192.0, max_diff_vs_gqadrv=2e-3),
             flashinfer_fp16_tc=_t(100.0, 120.0, max_diff_vs_gqadrv=6.1e-5)),
        _row("p16 B1 L4K", 1, 4096, gqadrv_fp8=_fp8(4096, 1, 8.0, 16.0, route="paged_e4m3", num_splits=16),
             gqadrv_fp8_dev={"error": "boom"}, gqadrv_fp16=_t(8.5, 15.0), flashinfer_fp8={"error": "no JIT"}),
        _row("p16 B1 L32K", 1, 32768, gqadrv_fp8=_fp8(32768, 1, 30.0, 40.0, route="paged_e4m3", num_splits=16)),
        _row("p16 B16 L4K", 16, 4096, gqadrv_fp8={"error": "bad scale"}, gqadrv_fp16=_t(60.0, 70.0)),
    ]


def test_table_cells_and_ratios():
    lines = bf.format_table(META, _fake_rows()).splitlines()
    assert lines[0].startswith("GPU H200 (cc 9.0, 132 SMs), streaming-read ceiling 4.50 TB/s, paged GQA decode "
                               "FP8-e4m3 KV (fp16 q) Hq 32 Hkv 8 D 128, page 16")
    assert lines[1].count("|") == lines[2].count("|") == 16
    # TB/s: 536870912 B / 120 us = 4.47 (99.4 % of 4.5); fp16 1073741824 B / 240 us = 4.47; x fp16 = 240/120,
    # 288/160; x best FI fp8 = FI fp8 TC 180/120, 192/160 (FI fp16 TC is faster but not an fp8 peer)
    assert lines[3] == ("| p16 B64 L4K | 120.00 | 160.00 | 4.47 | 99.4 | 124.00 / 164.00 | 240.00 / 288.00 | 4.47 | "
                        "2.00 / 1.80 | 360.00 / 400.00 | 180.00 / 192.00 | 100.00 / 120.00 | 1.50 / 1.20 | "
                        "paged_tma_e4m3 / 1 | 0.0e+00 / 2.0e-03 / 6.1e-05 / 2.5e-02 |")
    assert lines[4] == ("| p16 B1 L4K | 8.00 | 16.00 | 1.05 | 23.3 | err | 8.50 / 15.00 | 1.97 | 1.06 / 0.94 | err | "
                        "- | - | - | paged_e4m3 / 16 | - / - / - / - |")
    assert lines[5] == ("| p16 B1 L32K | 30.00 | 40.00 | 2.24 | 49.7 | - | - | - | - | - | - | - | - | "
                        "paged_e4m3 / 16 | - / - / - / - |")
    assert lines[6] == "| p16 B16 L4K | error: bad scale |"
    assert lines[7] == ""
    for line in lines[3:6]:
        assert line.count("|") == 16


def test_target_lines():
    lines = bf.format_table(META, _fake_rows()).splitlines()[8:]
    assert lines == [
        "Targets (a row meets one when both its hot and cold ratio do):",
        "- B >= 64: fp8 speed >= 1.9 x our fp16 (x fp16): 0/1 rows; missed: p16 B64 L4K (2.00 / 1.80)",
        "- B >= 64: >= 4.4 TB/s (fp8 TB/s): 0/1 rows; missed: p16 B64 L4K (4.47 / 3.36)",
        "- B1 L32K: >= 3.8 TB/s (fp8 TB/s): 0/1 rows; missed: p16 B1 L32K (2.24 / 1.68)",
        "- B16 L4K: >= 4.2 TB/s (fp8 TB/s): 0/1 rows; not measured: p16 B16 L4K",
        "- B1 L4K: faster than our fp16 B1 L4K (x fp16 > 1): 0/1 rows; missed: p16 B1 L4K (1.06 / 0.94)",
    ]
    assert bf.target_lines([])[1] == "- B >= 64: fp8 speed >= 1.9 x our fp16 (x fp16): no row in this run"


def test_targets_met():
    rows = [_row("p16 B128 L8K", 128, 8192, gqadrv_fp8=_fp8(8192, 128, 450.0, 470.0), gqadrv_fp16=_t(900.0, 950.0)),
            _row("p16 B256 L2K", 256, 2048, gqadrv_fp8=_fp8(2048, 256, 240.0, 240.0), gqadrv_fp16=_t(480.0, 460.0)),
            _row("p16 B1 L32K", 1, 32768, gqadrv_fp8=_fp8(32768, 1, 17.0, 17.5)),
            _row("p16 B16 L4K", 16, 4096, gqadrv_fp8=_fp8(4096, 16, 31.0, 31.5)),
            _row("p16 B1 L4K", 1, 4096, gqadrv_fp8=_fp8(4096, 1, 6.0, 12.0), gqadrv_fp16=_t(8.5, 12.5))]
    # x fp16 2.00 / 2.02 and 2.00 / 1.92; B128 L8K 2147483648 B / 450, 470 us = 4.77, 4.57 TB/s; B256 L2K
    # 1073741824 B / 240 us = 4.47; B1 L32K 67108864 B / 17, 17.5 us = 3.95, 3.83; B16 L4K 134217728 B / 31,
    # 31.5 us = 4.33, 4.26; B1 L4K x fp16 1.42 / 1.04
    assert bf.target_lines(rows)[1:] == [
        "- B >= 64: fp8 speed >= 1.9 x our fp16 (x fp16): 2/2 rows",
        "- B >= 64: >= 4.4 TB/s (fp8 TB/s): 2/2 rows",
        "- B1 L32K: >= 3.8 TB/s (fp8 TB/s): 1/1 rows",
        "- B16 L4K: >= 4.2 TB/s (fp8 TB/s): 1/1 rows",
        "- B1 L4K: faster than our fp16 B1 L4K (x fp16 > 1): 1/1 rows",
    ]
    rows[1]["results"]["gqadrv_fp16"] = _t(450.0, 460.0)  # x fp16 1.88 hot: the 1.9x target misses
    assert bf.target_lines(rows)[1] == ("- B >= 64: fp8 speed >= 1.9 x our fp16 (x fp16): 1/2 rows; "
                                        "missed: p16 B256 L2K (1.88 / 1.92)")
