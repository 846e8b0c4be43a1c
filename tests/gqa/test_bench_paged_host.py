"""The paged GQA decode bench (``bench --op gqa_paged``) without a GPU: the row list, ``--rows`` /
``--quick`` through the CLI parser, the block table and FlashInfer's page arguments, the contiguous
copy of the pages (numpy), the table and its ratio cells, and the target lines, from fake timings."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv import cli
from gqadrv.gqa import bench_paged as bp

META = {"gpu": "H200", "cc": "9.0", "sms": 132, "ceiling_TBps": 4.5, "graph_calls": 20}


def _t(hot, cold, **kw):
    return {"hot_us": hot, "cold_us": cold, **kw}


def _rows(*argv):
    args = cli.build_parser().parse_args(["bench", "--op", "gqa_paged", *argv])
    return [r.label for r in bp.SPEC.rows(args)]


def test_the_issue_rows_are_all_there():
    got = {(r.page, r.batch, r.length, r.s_q) for r in bp.ROWS}
    want = {(p, b, n, 1) for p in (16, 1) for b in (1, 16, 64, 128) for n in (4096, 32768)}
    want |= {(16, b, n, 4) for b in (16, 64) for n in (4096, 32768)}
    assert got == want and len(bp.ROWS) == len(want) == 20
    assert len({r.label for r in bp.ROWS}) == 20
    assert bp.ROWS[0].label == "p16 B1 L4K" and bp.ROWS[-1].label == "p16 B64 L32K s_q4"
    big = bp.PagedRow(1, 128, 32768)
    assert big.pages_per_request == 32768 and big.kv_bytes() == 128 * 32768 * 2 * 8 * 128 * 2  # 17.2 GB
    assert bp.PagedRow(16, 1, 4100).pages_per_request == 257


def test_cli_offers_the_op_and_keeps_gqa_the_default():
    p = cli.build_parser()
    assert p.parse_args(["bench"]).op == "gqa"
    args = p.parse_args(["bench", "--op", "gqa_paged"])
    assert args.op == "gqa_paged" and not args.quick and args.rows is None and not args.no_peers
    assert _rows() == [r.label for r in bp.ROWS]


def test_quick_and_row_filters():
    assert _rows("--quick") == ["p1 B16 L4K", "p16 B16 L4K s_q4"]
    assert _rows("--rows", "page16,b1") == ["p16 B1 L4K", "p16 B1 L32K"]  # b1 is not b16 / b128
    assert _rows("--rows", "P1,B128", "sq4,32k") == ["p1 B128 L4K", "p1 B128 L32K", "p16 B16 L32K s_q4",
                                                     "p16 B64 L32K s_q4"]
    assert _rows("--rows", "sq4") == ["p16 B16 L4K s_q4", "p16 B16 L32K s_q4", "p16 B64 L4K s_q4",
                                      "p16 B64 L32K s_q4"]
    assert _rows("--quick", "--rows", "page1") == ["p1 B16 L4K"]
    assert len(_rows("--rows", "l4096")) == len(_rows("--rows", "4k")) == 10
    with pytest.raises(ValueError, match="unknown tag"):
        _rows("--rows", "page8")
    with pytest.raises(ValueError, match="no row"):
        _rows("--rows", "page1,sq4")


def test_block_table_and_flashinfer_page_args():
    t = bp.block_table(3, 5)
    assert t.dtype == np.int32 and t.shape == (3, 5)
    assert sorted(t.reshape(-1).tolist()) == list(range(15))
    assert not np.array_equal(t.reshape(-1), np.arange(15))  # shuffled
    assert np.array_equal(t, bp.block_table(3, 5))  # seeded
    indptr, indices, last = bp.flashinfer_page_args(t, [80, 33, 1], 16)
    assert indptr.tolist() == [0, 5, 8, 9]
    assert indices.tolist() == t[0].tolist() + t[1, :3].tolist() + t[2, :1].tolist()
    assert last.tolist() == [16, 1, 1]
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    indptr, indices, last = bp.flashinfer_page_args(np.arange(8, dtype=np.int32).reshape(2, 4), [4, 4], 1)
    assert indptr.tolist() == [0, 4, 8] and indices.tolist() == list(range(8)) and last.tolist() == [1, 1]


@pytest.mark.parametrize("page", [1, 4])
def test_fill_contiguous_copies_the_pages_in_table_order(page):
    rng = np.random.default_rng(0)
    b, hkv, d, cap = 3, 2, 4, 12
    lengths = [12, 7, 1]
    per = -(-cap // page)
    table = bp.block_table(b, per, seed=5)
    k = rng.standard_normal((b * per, page, hkv, d)).astype(np.float16)
    v = rng.standard_normal((b * per, page, hkv, d)).astype(np.float16)
    kv = np.full((b, 2, hkv, cap, d), np.nan, np.float16)
    bp.fill_contiguous(kv, k, v, table, lengths)
    for i, n in enumerate(lengths):
        for tok in range(cap):
            for j, cache in enumerate((k, v)):
                got = kv[i, j, :, tok]
                if tok < n:
                    assert np.array_equal(got, cache[table[i, tok // page], tok % page]), (i, j, tok)
                else:
                    assert np.isnan(got).all()


def _row(label, page, batch, s_q=1, kv_bytes=4.5e8, **results):
    return {"shape": label, "page": page, "batch": batch, "length": 4096, "s_q": s_q, "kv_bytes": kv_bytes,
            "results": results}


def _fake_rows():
    return [
        _row("p16 B16 L4K", 16, 16,
             gqadrv=_t(100.0, 110.0, route="tma_paged", num_splits=1, max_diff_vs_contig=0.0),
             gqadrv_det=_t(105.0, 120.0), gqadrv_contig=_t(98.0, 110.0),
             flashinfer=_t(150.0, 160.0, max_diff_vs_gqadrv=1e-3), flashinfer_tc=_t(120.0, 108.0,
                                                                                  max_diff_vs_gqadrv=2e-3)),
        _row("p1 B16 L4K", 1, 16, gqadrv=_t(110.0, 120.0, route="cp_paged", num_splits=2),
             gqadrv_det=_t(110.0, 120.0), gqadrv_contig=_t(99.0, 100.0), flashinfer={"error": "no JIT"}),
        _row("p16 B16 L4K s_q4", 16, 16, s_q=4, gqadrv=_t(120.0, 130.0, route="tma_paged", num_splits=1),
             gqadrv_sq1=_t(100.0, 100.0), gqadrv_det=_t(120.0, 130.0), gqadrv_contig={"error": "4-D q"},
             flashinfer_prefill=_t(240.0, 260.0)),
        _row("p16 B1 L4K", 16, 1, gqadrv={"error": "boom"}),
    ]


def test_table_cells_and_ratios():
    lines = bp.format_table(META, _fake_rows()).splitlines()
    assert lines[0].startswith("GPU H200 (cc 9.0, 132 SMs), streaming-read ceiling 4.50 TB/s, paged GQA decode")
    assert lines[1].count("|") == lines[2].count("|") == 17
    # x contig = contig / paged; det/def = det / default; x best FI = best FlashInfer / paged (tc hot, tc cold)
    assert lines[3] == ("| p16 B16 L4K | 100.00 | 110.00 | 4.50 | 100.0 | 98.00 / 110.00 | 0.98 / 1.00 | 1.05 / 1.09 | "
                        "- | 150.00 / 160.00 | 120.00 / 108.00 | - | 1.20 | 0.98 | tma_paged / 1 | 0.0e+00 / 2.0e-03 |")
    assert lines[4] == ("| p1 B16 L4K | 110.00 | 120.00 | 4.09 | 90.9 | 99.00 / 100.00 | 0.90 / 0.83 | 1.00 / 1.00 | "
                        "- | err | - | - | - | - | cp_paged / 2 | - / - |")
    assert lines[5] == ("| p16 B16 L4K s_q4 | 120.00 | 130.00 | 3.75 | 83.3 | err | - | 1.00 / 1.00 | 1.20 / 1.30 | "
                        "- | - | 240.00 / 260.00 | 2.00 | 2.00 | tma_paged / 1 | - / - |")
    assert lines[6] == "| p16 B1 L4K | error: boom |"
    assert lines[7] == ""
    for line in lines[3:6]:
        assert line.count("|") == 17


def test_target_lines():
    lines = bp.format_table(META, _fake_rows()).splitlines()[8:]
    assert lines == [
        "Targets (a row meets one when both its hot and cold ratio do):",
        "- page >= 16, s_q 1: paged speed >= 0.97 x contiguous (x contig): 1/2 rows; not measured: p16 B1 L4K",
        ("- page >= 16, s_q 1: >= 1.00 x the best FlashInfer paged decode (x best FI): 0/2 rows; "
         "missed: p16 B16 L4K (1.20 / 0.98); not measured: p16 B1 L4K"),
        "- page 1, B >= 16, s_q 1: paged speed >= 0.85 x contiguous (x contig): 0/1 rows; missed: p1 B16 L4K (0.90 / 0.83)",
        "- s_q 4, B >= 16: time <= 1.30 x the s_q 1 time (sq4/sq1): 1/1 rows",
        "- B >= 16: deterministic time <= 1.10 x default (det/def): 3/3 rows",
    ]
    assert bp.target_lines([])[1] == "- page >= 16, s_q 1: paged speed >= 0.97 x contiguous (x contig): no row in this run"


def test_deterministic_target_misses_above_ten_percent():
    rows = [_row("p16 B64 L4K", 16, 64, gqadrv=_t(100.0, 100.0), gqadrv_det=_t(111.0, 105.0))]
    assert bp.target_lines(rows)[-1] == ("- B >= 16: deterministic time <= 1.10 x default (det/def): 0/1 rows; "
                                         "missed: p16 B64 L4K (1.11 / 1.05)")


def test_other_forms_table_only_with_paged_also():
    """--paged-also hnd / ordered: a second table with the paged route on the other forms of the same pages beside
    the default form and the contiguous route; without those results the output has no such table, and the gqadrv_*
    results never count as peers (x best FI unchanged)."""
    args = cli.build_parser().parse_args(["bench", "--op", "gqa_paged", "--paged-also", "hnd", "ordered"])
    assert args.paged_also == ["hnd", "ordered"]
    assert cli.build_parser().parse_args(["bench", "--op", "gqa_paged"]).paged_also == []
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--op", "gqa_paged", "--paged-also", "chd"])
    plain = bp.format_table(META, _fake_rows())
    assert "other forms" not in plain
    rows = _fake_rows()
    rows[0]["results"].update(gqadrv_hnd=_t(98.0, 110.0, max_diff_vs_default=0.0), gqadrv_ordered=_t(80.0, 100.0))
    text = bp.format_table(META, rows)
    assert text.splitlines()[3] == plain.splitlines()[3]  # same main row, same best-FlashInfer ratios
    tail = text.split("Paged route on other forms of the same pages")[1].splitlines()
    assert tail[2] == "| row | NHD, random pages | HND, random pages | NHD, pages in order | contiguous |"
    assert tail[4] == ("| p16 B16 L4K | 100.00 / 110.00 (0.98 / 1.00) | 98.00 / 110.00 (1.00 / 1.00) | "
                       "80.00 / 100.00 (1.23 / 1.10) | 98.00 / 110.00 |")
    assert tail[5] == "| p1 B16 L4K | 110.00 / 120.00 (0.90 / 0.83) | - | - | 99.00 / 100.00 |"
    assert len(tail) == 7  # title, blank, header, rule + the three rows whose gqadrv ran (not the error row)
