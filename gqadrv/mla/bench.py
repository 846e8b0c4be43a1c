"""MLA decode bench spec (run by ``ops.bench.run``: ``python -m gqadrv bench --op mla``).

Rows: b 128, page 64, bf16, uniform lengths L in {4K, 8K, 16K, 32K} at h_q 16, 64 and 128 (s_q 1),
s_q 2 at h_q 64 / 128 (L 8K), and one varlen row (lengths L + 2i). For each row gqadrv's prepared
launch is timed hot (CUDA graph of N calls) and cold (L2 flushed), with the peers that import in
the same process on the same tensors: DeepSeek's FlashMLA (``flash_mla``, built from source) and
FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backend fa3). FlashMLA's formulas: FLOPs =
2·h_q·s_q·Σlen·(576+512); bytes = q + KV (576 channels per token) + out.

``--hot-caches N`` gives every provider N caches of the row (one pool of N times the pages, block
table i offset by i pages-per-cache) and makes consecutive calls use them in turn, so that a hot call
does not find the previous call's last tiles in L2 (as in a model, whose consecutive layers read
different caches); the default 1 repeats one cache, as the peers' own benchmarks do.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ..ops.bench import BenchSpec, Timer, best_peer_times, row_results, log, speedup_cell

ROWS = ([(128, 1, h, L, "uniform") for h in (128, 64, 16) for L in (4096, 8192, 16384, 32768)]
        + [(128, 2, h, 8192, "uniform") for h in (64, 128)] + [(128, 1, 128, 8192, "varlen"), (128, 1, 16, 8192, "varlen")])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mla-rows", nargs="*", default=None,
                   help="MLA rows 'b,s_q,h_q,L[,varlen|skew|spread]' (default: the issue's table)")
    p.add_argument("--mla-backend", default=None, help="gqadrv MLA backend: auto, wgmma, mma")
    p.add_argument("--mla-also", nargs="*", default=[],
                   help="more gqadrv MLA backends timed in the same rows (results 'gqadrv:NAME'); NAME@S forces "
                        "num_splits S (split grids: CTAs per request and row block; balanced grids: CTAs)")
    p.add_argument("--mla-pages", choices=("sequential", "shuffled"), default="sequential",
                   help="page order of the rows' block table: request i owns pages i * max_blocks ... in order "
                        "(sequential, the tables' default), or one random permutation of all pages (shuffled, "
                        "seed 11: requests no longer stream equally strided regions in step); every provider "
                        "reads the same table")
    p.add_argument("--hot-caches", type=_positive_int, default=1,
                   help="caches per row that consecutive calls of every provider use in turn (one pool, N block "
                        "tables; default 1: every call reads the same cache, so a hot call may find the previous "
                        "call's tiles in L2; 2 or more: it cannot, as in a model whose layers read different caches)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every provider of a row this many times in turn and keep the median of the rounds; "
                        "the providers' order rotates by one each round (spreads clock and order effects evenly)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _import_peers(args) -> None:
    for mod in ("torch", "flash_mla", "flashinfer"):
        if getattr(args, "no_peers", False) and mod != "torch":
            continue
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001
            log(f"[bench] {mod} not available: {type(exc).__name__}: {str(exc)[:100]}")


def _rows(args) -> list:
    if args.mla_rows:
        out = []
        for t in args.mla_rows:
            parts = t.split(",")
            out.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]),
                        parts[4] if len(parts) > 4 else "uniform"))
        return out
    return list(ROWS)


def also_backend(name: str) -> tuple[str, int | None]:
    """(backend, num_splits) of an --mla-also entry: NAME, or NAME@S to force num_splits S."""
    backend, at, splits = name.partition("@")
    if not at:
        return backend, None
    if not splits.isdigit() or int(splits) < 1:
        raise SystemExit(f"--mla-also {name!r}: expected NAME@S with S a positive integer")
    return backend, int(splits)


def row_lengths(b: int, L: int, kind: str) -> list[int]:
    """A bench row's cache lengths: uniform L; varlen L + 2i; skew: request 0 holds 16 L tokens, the
    others L (one long request in a batch); spread: a linear ramp from L / 4 to 7 L / 4 in a shuffled
    order (mean L)."""
    if kind == "varlen":
        return [L + 2 * i for i in range(b)]
    if kind == "skew":
        return [16 * L] + [L] * (b - 1)
    if kind == "spread":
        ramp = [L // 4 + (3 * L // 2) * i // max(1, b - 1) for i in range(b)]
        return [ramp[(37 * i) % b] for i in range(b)] if b % 37 else ramp
    return [L] * b


def _metrics(h_q, s_q, lens, b, us, kv_bytes_per_token=576 * 2):
    """(TFLOPS, TB/s) of one call: FlashMLA's formulas (q and out in 2-byte elements, KV per token)."""
    tot = sum(lens)
    flops = 2.0 * h_q * s_q * tot * (576 + 512)
    nbytes = (b * s_q * h_q * 576 + b * s_q * h_q * 512) * 2 + tot * kv_bytes_per_token
    return flops / (us * 1e-6) / 1e12, nbytes / (us * 1e-6) / 1e12


def bench_block_table(b: int, max_blocks: int, order: str = "sequential"):
    """The rows' block table, int32 numpy [b, max_blocks]: request i owns pages i * max_blocks ... in order
    (sequential), or the same slots filled with one permutation of all b * max_blocks pages (shuffled,
    seed 11)."""
    import numpy as np

    pages = np.arange(b * max_blocks, dtype=np.int32)
    if order == "shuffled":
        pages = np.random.default_rng(11).permutation(pages).astype(np.int32)
    elif order != "sequential":
        raise ValueError(f"page order must be 'sequential' or 'shuffled', got {order!r}")
    return pages.reshape(b, max_blocks)


def cache_tables(table, ncache: int, pages_per_cache: int) -> list:
    """The block tables of ``--hot-caches``: cache i is ``table`` with every page id moved up by i pool
    slices of ``pages_per_cache`` pages (the caches are disjoint slices of one pool)."""
    import numpy as np

    return [(table + np.int32(i * pages_per_cache)).astype(np.int32) for i in range(ncache)]


def cycle(fns: list):
    """One callable that calls ``fns`` in turn (a graph captured from it alternates between them)."""
    if len(fns) == 1:
        return fns[0]
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % len(fns)
        return fns[i]()

    return call


def flashinfer_csr(lens: list[int], max_blocks: int, page: int, table=None):
    """FlashInfer's CSR page lists of the bench's block table (``table``, [b, max_blocks]; None: request i
    owns pages i * max_blocks ... in order): kv_indptr (b + 1) counts each request's ceil(len / page) pages,
    kv_indices lists them in the table's order; int32 numpy arrays."""
    import numpy as np

    if table is None:
        table = bench_block_table(len(lens), max_blocks)
    counts = [-(-n // page) for n in lens]
    indptr = np.zeros(len(lens) + 1, np.int32)
    indptr[1:] = np.cumsum(counts)
    indices = np.concatenate([np.asarray(table[i, :c], np.int32)
                              for i, c in enumerate(counts)]) if lens else np.zeros(0, np.int32)
    return indptr, indices


def _run_row(item, timer: Timer, args) -> dict:
    import cupy as cp
    import numpy as np

    import gqadrv

    b, s_q, h_q, L, kind = item
    page = 64
    lens = row_lengths(b, L, kind)
    max_blocks = -(-max(lens) // page)
    nb = b * max_blocks
    ncache = int(getattr(args, "hot_caches", 1) or 1)
    rs = cp.random.RandomState(7)
    k = (rs.standard_normal((ncache * nb, page, 1, 576), dtype=cp.float32) / 10).astype(cp.float16)
    q = (rs.standard_normal((b, s_q, h_q, 576), dtype=cp.float32) / 10).astype(cp.float16)
    import ml_dtypes  # bf16 like the peers' tables

    k = k.astype(ml_dtypes.bfloat16)
    q = q.astype(ml_dtypes.bfloat16)
    pages = getattr(args, "mla_pages", "sequential") or "sequential"
    table = bench_block_table(b, max_blocks, pages)
    tables = cache_tables(table, ncache, nb)
    bts = [cp.asarray(t) for t in tables]
    sl = cp.asarray(np.array(lens, np.int32))
    causal = s_q > 1
    res: dict = {}
    torch = sys.modules.get("torch")
    use_torch = torch is not None
    calls: dict = {}  # provider -> (callable, uses a torch graph)

    def ours(name, backend, num_splits=None):
        try:
            out = cp.empty((b, s_q, h_q, 512), q.dtype)
            lse = cp.empty((b, h_q, s_q), cp.float32)
            ps = [gqadrv.prepare_mla_decode(q, k, bt, sl, out=out, lse=lse, causal=causal, backend=backend,
                                            num_splits=num_splits,
                                            stream=torch.cuda.current_stream() if use_torch else None)
                  for bt in bts]
            calls[name] = (cycle([lambda p=p: gqadrv.launch_prepared(p, torch.cuda.current_stream() if use_torch
                                                                     else None) for p in ps]), use_torch)
            res[name] = {"route": ps[0].route, "num_splits": ps[0].num_splits}
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}

    ours("gqadrv", args.mla_backend)
    for extra in getattr(args, "mla_also", None) or []:
        ours(f"gqadrv:{extra}", *also_backend(extra))
    if use_torch and not getattr(args, "no_peers", False):
        tq, tk, tsl = (torch.from_dlpack(x) for x in (q, k, sl))
        tbts = [torch.from_dlpack(x) for x in bts]
        fm = sys.modules.get("flash_mla")
        if fm is not None:
            try:
                meta, _ = fm.get_mla_metadata()
                calls["flashmla"] = (cycle([lambda tbt=tbt: fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, meta, None,
                                                                                     causal=causal)
                                            for tbt in tbts]), True)
                res["flashmla"] = {}
            except Exception as exc:  # noqa: BLE001
                res["flashmla"] = {"error": repr(exc)[:300]}
        fi = sys.modules.get("flashinfer")
        if fi is not None and s_q == 1:
            try:
                import flashinfer.mla as fmla

                qo = torch.arange(b + 1, dtype=torch.int32, device=tq.device)
                qn, qp = tq[:, 0, :, :512].contiguous(), tq[:, 0, :, 512:].contiguous()
                ckv, kpe = tk[:, :, 0, :512].contiguous(), tk[:, :, 0, 512:].contiguous()
                runs = []
                for t in tables:
                    ws = torch.empty(256 << 20, dtype=torch.uint8, device=tq.device)
                    w = fmla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
                    indptr, indices = flashinfer_csr(lens, max_blocks, page, t)
                    kvp = torch.from_numpy(indptr).to(tq.device)
                    kvi = torch.from_numpy(indices).to(tq.device)
                    # FlashInfer 0.7 keyword plan (CSR form) and split (nope, rope) query / cache pairs
                    w.plan(qo_indptr=qo, kv_indptr=kvp, kv_indices=kvi, kv_len_arr=tsl, num_heads=h_q,
                           head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=False, sm_scale=576 ** -0.5,
                           q_data_type=tq.dtype, kv_data_type=tq.dtype)
                    runs.append(lambda w=w: w.run(query=(qn, qp), kv_cache=(ckv, kpe)))
                calls["flashinfer"] = (cycle(runs), True)
                res["flashinfer"] = {}
            except Exception as exc:  # noqa: BLE001
                res["flashinfer"] = {"error": repr(exc)[:300]}
    time_rounds(calls, timer, max(1, int(getattr(args, "rounds", 1) or 1)), res)
    for v in res.values():
        if "hot_us" in v:
            v["hot_TFLOPS"], v["hot_TBps"] = _metrics(h_q, s_q, lens, b, v["hot_us"])
            v["cold_TFLOPS"], v["cold_TBps"] = _metrics(h_q, s_q, lens, b, v["cold_us"])
    label = f"b{b} s_q{s_q} h_q{h_q} L{L}{'' if kind == 'uniform' else ' ' + kind}"
    if pages != "sequential":
        label += f" pages-{pages}"
    if ncache > 1:
        label += f" caches-{ncache}"
    return {"shape": label, "b": b, "s_q": s_q, "h_q": h_q, "L": L, "lens": kind, "pages": pages,
            "hot_caches": ncache, "results": res}


def time_rounds(calls: dict, timer, rounds: int, res: dict) -> None:
    """Time every provider of ``calls`` (name -> (fn, uses a torch graph)) hot and cold once per round
    and store the medians in ``res[name]`` (plus the per-round lists when rounds > 1). The providers'
    order rotates by one each round, so that no provider always runs first: with a fixed order, two
    identical schedules differed by up to 3.5 % depending on their place in it. A provider that raises
    gets ``res[name] = {"error": ...}`` and is not timed again."""
    order = list(calls)
    times: dict = {name: ([], []) for name in order}
    for rnd in range(rounds):
        k = rnd % len(order) if order else 0
        for name in order[k:] + order[:k]:
            if "error" in res.get(name, {}):
                continue
            fn, graph_torch = calls[name]
            try:
                times[name][0].append(timer.hot(fn, graph_torch))
                times[name][1].append(timer.cold(fn))
            except Exception as exc:  # noqa: BLE001
                res[name] = {"error": repr(exc)[:300]}
    for name, (hot, cold) in times.items():
        if "error" not in res.get(name, {}) and hot:
            res.setdefault(name, {}).update({"hot_us": statistics.median(hot), "cold_us": statistics.median(cold)})
            if rounds > 1:
                res[name].update({"hot_rounds_us": hot, "cold_rounds_us": cold})


def format_table(meta: dict, rows: list) -> str:
    out = [f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {meta['ceiling_TBps']:.2f} TB/s, "
           f"MLA decode bf16 page 64; hot = per call in a graph of {meta['graph_calls']} calls, cold = L2 flushed",
           "| row | gqadrv hot us | TFLOPS | TB/s | cold us | FlashMLA hot us / TFLOPS / TB/s | FlashInfer hot us / TFLOPS / TB/s | x best peer hot | x best peer cold | route / splits |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res, g, error_line = row_results(r)
        if error_line is not None:
            out.append(error_line)
            continue

        def peer(name):
            v = res.get(name, {})
            return f"{v['hot_us']:.1f} / {v['hot_TFLOPS']:.0f} / {v['hot_TBps']:.2f}" if "hot_us" in v else "-"

        best_hot, best_cold = best_peer_times(res)
        xh, xc = speedup_cell(best_hot, g["hot_us"]), speedup_cell(best_cold, g["cold_us"])
        extra = "".join(f" {k.split(':', 1)[1]}: {v['hot_us']:.1f} / {v['cold_us']:.1f} us "
                        f"(x best peer {speedup_cell(best_hot, v['hot_us'])} / {speedup_cell(best_cold, v['cold_us'])});"
                        for k, v in res.items() if k.startswith("gqadrv:") and "hot_us" in v)
        out.append(f"| {r['shape']} | {g['hot_us']:.1f} | {g['hot_TFLOPS']:.0f} | {g['hot_TBps']:.2f} | "
                   f"{g['cold_us']:.1f} | {peer('flashmla')} | {peer('flashinfer')} | {xh} | {xc} | "
                   f"{g['route']} / {g['num_splits']} |{extra}")
    return "\n".join(out)


SPEC = BenchSpec(name="mla", add_arguments=add_arguments, rows=_rows, run_row=_run_row, format_table=format_table,
                 import_peers=_import_peers)
