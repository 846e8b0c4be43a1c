"""The bench tables (GQA and MLA) from synthetic rows: best-peer speed ratios, rows without peers,
error rows. CPU only: the formatting does not touch the GPU."""

from __future__ import annotations

from gqadrv.gqa import bench as gqa_bench
from gqadrv.mla import bench as mla_bench
from gqadrv.ops.bench import best_peer_times, speedup_cell

META = {"gpu": "H200", "cc": "9.0", "sms": 132, "ceiling_TBps": 4.56, "graph_calls": 20}


def _t(hot, cold, **kw):
    return {"hot_us": hot, "cold_us": cold, **kw}


def test_best_peer_times_ignore_gqadrv_results_and_failed_peers():
    res = {"gqadrv": _t(1.0, 1.0), "gqadrv_portable": _t(0.5, 0.5), "a": _t(3.0, 9.0), "b": _t(4.0, 7.0),
           "c": {"error": "no wheel"}}
    assert best_peer_times(res) == (3.0, 7.0)
    assert best_peer_times({"gqadrv": _t(1.0, 1.0)}) == (None, None)
    assert speedup_cell(3.0, 2.0) == "1.50" and speedup_cell(None, 2.0) == "-"


def test_gqa_table():
    rows = [{"shape": "1,64", "kv_bytes": 1e6, "results": {
                "gqadrv": _t(2.4, 5.5, route="short", num_splits=1), "flashinfer": _t(2.2, 5.8),
                "flashinfer_tc": _t(5.2, 8.7), "torch_sdpa": _t(7.5, 13.8),
                "gqadrv_portable": _t(3.0, 6.0, route="portable", num_splits=2)}},
            {"shape": "4,256", "kv_bytes": 2e6, "results": {"gqadrv": _t(3.7, 9.1, route="tma", num_splits=1)}},
            {"shape": "x", "kv_bytes": 1, "results": {"gqadrv": {"error": "boom"}}}]
    lines = gqa_bench.format_table(META, rows).splitlines()
    assert lines[3] == "| 1,64 | 2.40 | 5.50 | 0.42 | 9.1 | 2.20 | 5.20 | 7.50 | 5.80 | 0.92 | 1.05 | short / 1 |"
    assert lines[4] == "|   portable | 3.00 | 6.00 | 0.33 | 7.3 | | | | | 0.73 | 0.97 | portable / 2 |"
    assert lines[5] == "| 4,256 | 3.70 | 9.10 | 0.54 | 11.9 | - | - | - | - | - | - | tma / 1 |"
    assert lines[6] == "| x | error: boom |"


def test_mla_table():
    def m(hot, cold, **kw):
        return _t(hot, cold, hot_TFLOPS=500.0, hot_TBps=2.0, cold_TFLOPS=480.0, cold_TBps=1.9, **kw)

    rows = [{"shape": "b128", "results": {"gqadrv": m(271.7, 290.3, route="seesaw_tma", num_splits=1),
                                          "flashmla": m(240.1, 260.5), "flashinfer": m(261.5, 291.8)}},
            {"shape": "b128 s_q2", "results": {"gqadrv": m(561.7, 590.6, route="seesaw_tma", num_splits=1)}}]
    lines = mla_bench.format_table(META, rows).splitlines()
    assert lines[3] == ("| b128 | 271.7 | 500 | 2.00 | 290.3 | 240.1 / 500 / 2.00 | 261.5 / 500 / 2.00 | 0.88 | 0.90 | "
                        "seesaw_tma / 1 |")
    assert lines[4] == "| b128 s_q2 | 561.7 | 500 | 2.00 | 590.6 | - | - | - | - | seesaw_tma / 1 |"


def test_mla_rounds_rotate_the_provider_order_and_keep_medians():
    """Each round starts with the next provider (no provider always runs first); medians per provider;
    a provider that raises is reported and not timed again."""
    seen = []

    class Timer:
        def hot(self, fn, graph_torch):
            return fn()

        def cold(self, fn):
            return 10.0

    vals = {"a": iter([1.0, 3.0, 2.0]), "b": iter([5.0, 4.0, 6.0]), "c": iter([7.0, 7.0, 7.0])}

    def provider(name):
        def fn():
            seen.append(name)
            if name == "boom":
                raise RuntimeError("no")
            return next(vals[name])
        return fn

    calls = {n: (provider(n), False) for n in ("a", "b", "c")}
    res: dict = {"a": {"route": "r"}}
    mla_bench.time_rounds(calls, Timer(), 3, res)
    assert seen == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the order rotated each round
    assert res["a"]["route"] == "r"
    assert res["a"]["hot_us"] == 2.0 and res["b"]["hot_us"] == 5.0 and res["c"]["hot_us"] == 7.0
    assert res["a"]["hot_rounds_us"] == [1.0, 3.0, 2.0]
    assert res["b"]["hot_rounds_us"] == [5.0, 4.0, 6.0]  # b's rounds, in b's own order

    seen.clear()
    vals["c"] = iter([7.0, 7.0])
    res = {}
    mla_bench.time_rounds({"boom": (provider("boom"), False), "c": (provider("c"), False)}, Timer(), 2, res)
    assert "error" in res["boom"] and "hot_us" not in res["boom"]
    assert seen.count("boom") == 1
    assert res["c"]["hot_rounds_us"] == [7.0, 7.0]


def test_flashinfer_page_lists_of_unequal_lengths():
    """FlashInfer's MLA plan takes CSR page lists whose counts must be ceil(len / page) per request
    (its varlen rows failed with the full block-table rows as lists)."""
    from gqadrv.mla.bench import flashinfer_csr

    indptr, indices = flashinfer_csr([64, 65, 1, 128], max_blocks=3, page=64)
    assert indptr.tolist() == [0, 1, 3, 4, 6]
    assert indices.tolist() == [0, 3, 4, 6, 9, 10]
    indptr, indices = flashinfer_csr([4096] * 3, max_blocks=64, page=64)
    assert indptr.tolist() == [0, 64, 128, 192] and indices.tolist() == list(range(192))


def test_mla_bench_block_tables_sequential_and_shuffled():
    """--mla-pages: sequential gives request i the pages i * max_blocks ... in order; shuffled fills the same
    slots with one fixed permutation of every page (each page once), and FlashInfer's page lists follow the
    table the other providers read."""
    import numpy as np
    import pytest

    from gqadrv.mla.bench import bench_block_table, flashinfer_csr

    seq = bench_block_table(3, 4)
    assert seq.dtype == np.int32 and seq.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    sh = bench_block_table(3, 4, "shuffled")
    assert sh.dtype == np.int32 and sh.shape == (3, 4) and sorted(sh.ravel().tolist()) == list(range(12))
    assert not np.array_equal(sh, seq) and np.array_equal(sh, bench_block_table(3, 4, "shuffled"))
    indptr, indices = flashinfer_csr([64, 65, 1], max_blocks=4, page=64, table=sh)
    assert indptr.tolist() == [0, 1, 3, 4]
    assert indices.tolist() == [sh[0, 0], sh[1, 0], sh[1, 1], sh[2, 0]]
    with pytest.raises(ValueError, match="page order"):
        bench_block_table(3, 4, "random")


def test_mla_hot_caches_are_disjoint_pool_slices_called_in_turn():
    """--hot-caches N: cache i's table is the row's table moved up by i * (pages per cache), so the N
    caches are disjoint slices of one pool; the providers' calls alternate between them in order
    (a graph captured from the cycle replays them in turn); a non-positive count is refused."""
    import argparse

    import numpy as np
    import pytest

    from gqadrv.mla.bench import add_arguments, bench_block_table, cache_tables, cycle

    for order in ("sequential", "shuffled"):
        base = bench_block_table(3, 4, order)
        tabs = cache_tables(base, 3, 12)
        assert len(tabs) == 3 and all(t.dtype == np.int32 and t.shape == (3, 4) for t in tabs)
        assert np.array_equal(tabs[0], base)
        assert sorted(np.concatenate([t.ravel() for t in tabs]).tolist()) == list(range(36))
        assert np.array_equal(tabs[2] - tabs[1], np.full((3, 4), 12))
    seen = []
    f = cycle([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        f()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    one = cycle([lambda: "only"])
    assert one() == "only" and one() == "only"
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).hot_caches == 1 and p.parse_args(["--hot-caches", "2"]).hot_caches == 2
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--hot-caches", bad])


def test_mla_also_entries_may_force_the_split_count():
    import pytest

    assert mla_bench.also_backend("narrow16x2_tma") == ("narrow16x2_tma", None)
    assert mla_bench.also_backend("narrow16x2_tma@2") == ("narrow16x2_tma", 2)
    for bad in ("seesaw_bal@", "seesaw_bal@0", "seesaw_bal@x"):
        with pytest.raises(SystemExit, match="NAME@S"):
            mla_bench.also_backend(bad)
