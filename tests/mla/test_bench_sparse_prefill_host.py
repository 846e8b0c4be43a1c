"""The sparse prefill bench's pure parts (gqadrv/mla/bench_sparse_prefill.py) on the CPU: row parsing and its
errors, FlashMLA's FLOP / byte formulas, and the table from synthetic results, including the extra builds of
``--mla-sparse-prefill-also`` (lines ``gqadrv@NAME`` with their time over the default's)."""

from __future__ import annotations

import argparse

import pytest

from gqadrv.mla import bench_sparse_prefill as bsp

META = {"gpu": "H100", "cc": "9.0", "sms": 132, "ceiling_TBps": 3.2, "graph_calls": 5}


def _t(hot, cold, **kw):
    return {"hot_us": hot, "cold_us": cold, **kw}


def test_rows_parse_and_reject_bad_text():
    assert bsp.parse_row("peer,4096,64,512,512,8192") == ("peer", 4096, 64, 512, 512, 8192, True)
    assert bsp.parse_row("peer,16,128,576,2048,8192,plain") == ("peer", 16, 128, 576, 2048, 8192, False)
    assert bsp.parse_row("pad64,4096,16,576,2048,32768") == ("pad64", 4096, 16, 576, 2048, 32768, False)
    for bad, why in (("peer,1,2,3", "expected"), ("x,1,64,512,64,128", "kind"), ("peer,1,64,500,64,128", "d_qk"),
                     ("peer,1,64,512,512,128", "topk"), ("pad64,1,65,576,64,128", "h_q"),
                     ("peer,1,64,512,64,128,maybe", "last field"), ("peer,0,64,512,64,128", "positive")):
        with pytest.raises(ValueError, match=why):
            bsp.parse_row(bad)


def test_flashmla_formulas():
    assert bsp.prefill_flops(4096, 128, 576, 2048) == 2.0 * 4096 * 2048 * 128 * (576 + 512)
    assert bsp.prefill_bytes(4096, 64, 512, 512) == 2.0 * 4096 * 512 * 512 + 2.0 * 4096 * 64 * (512 + 512)
    tf, tb = bsp.prefill_metrics(4096, 64, 512, 512, 1000.0)
    assert tf == pytest.approx(bsp.prefill_flops(4096, 64, 512, 512) / 1e-3 / 1e12)
    assert tb == pytest.approx(bsp.prefill_bytes(4096, 64, 512, 512) / 1e-3 / 1e12)
    # a padded call's TFLOPS count the useful heads
    assert bsp.prefill_metrics(4096, 64, 576, 2048, 1000.0, flops_h_q=16)[0] == pytest.approx(
        bsp.prefill_metrics(4096, 16, 576, 2048, 1000.0)[0])


def test_table_with_extra_builds_and_targets():
    row = {"shape": bsp._label(("peer", 4096, 64, 512, 512, 8192, True)), "kind": "peer", "s_q": 4096, "h_q": 64,
           "d_qk": 512, "topk": 512, "s_kv": 8192, "sink": True,
           "results": {"gqadrv": _t(600.0, 610.0, hot_TFLOPS=458.0, route="r", num_splits=132),
                       "gqadrv@seesaw_bal_cp_xmax": _t(630.0, 622.2, route="rx", num_splits=132,
                                                       max_diff_vs_gqadrv=1e-4, max_lse_diff_vs_gqadrv=0.0),
                       "gqadrv@broken": {"error": "ValueError('no such build')"},
                       "flashmla": _t(540.0, 549.0)}}
    text = bsp.format_table(META, [row])
    lines = [ln for ln in text.splitlines() if ln.startswith("| peer")]
    assert len(lines) == 4
    ours, peer, extra, broken = lines  # the row's own variants first, then the extra builds
    assert "| 0.90 / 0.90 | FlashMLA / ours (time) |" in ours
    assert "gqadrv@seesaw_bal_cp_xmax" in extra and "| 1.05 / 1.02 | this build / default (time) |" in extra
    assert "gqadrv 1.00e-04; 0.00e+00" in extra and "rx / 132" in extra
    assert "error: ValueError('no such build')" in broken and peer.split("|")[2].strip() == "FlashMLA + sink"
    assert "every peer row: faster than FlashMLA" in text and "0/1 rows" in text


def test_also_option_is_registered():
    p = argparse.ArgumentParser()
    bsp._add_arguments(p)
    a = p.parse_args(["--mla-sparse-prefill-also", "seesaw_bal_cp_xmax", "seesaw_nope_bal_nb9"])
    assert a.mla_sparse_prefill_also == ["seesaw_bal_cp_xmax", "seesaw_nope_bal_nb9"]
    assert p.parse_args([]).mla_sparse_prefill_also == []


def test_rows_are_timed_in_rotating_rounds_after_a_warm_up(monkeypatch):
    """_time: the row's first call runs back to back for WARM_S before any timing, then every call is
    timed once per round in an order that rotates by one, and the medians land in res."""
    from types import SimpleNamespace

    from gqadrv.mla import bench_sparse_prefill as bsp

    monkeypatch.setattr(bsp, "WARM_S", 0.01)
    ran = {"a": 0, "b": 0}
    order = []

    class FakeTimer:
        cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda: SimpleNamespace(synchronize=lambda: None)))

        def hot(self, fn, torch_graph):
            name = fn()
            order.append(name)
            return {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]}[name][sum(1 for x in order if x == name) - 1]

        def cold(self, fn):
            return 10.0 if fn() == "a" else 20.0

    def call(name):
        def fn():
            ran[name] += 1
            return name
        return fn

    calls = {"a": (call("a"), False), "b": (call("b"), False)}
    res = {"a": {"route": "r"}, "b": {}}
    bsp._time(calls, FakeTimer(), SimpleNamespace(rounds=3), res)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert res["a"]["hot_us"] == 2.0 and res["b"]["hot_us"] == 5.0
    assert res["a"]["cold_us"] == 10.0 and res["a"]["route"] == "r"
    assert res["a"]["hot_rounds_us"] == [3.0, 1.0, 2.0]
    assert ran["a"] > ran["b"] + 3  # the warm-up ran only the first call
