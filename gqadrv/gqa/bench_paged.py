"""Paged GQA decode bench spec (run by ``ops.bench.run``): ``python -m gqadrv bench --op gqa_paged``.

    python -m gqadrv bench --op gqa_paged [--quick] [--rows TAG[,TAG...] ...] [--no-peers] [--reps N] [--json out.json]

fp16, Hq 32, Hkv 8, D 128, NHD page caches ``[num_pages, page, Hkv, D]`` for K and V, every request
at its full length L, each request's pages a random permutation of one pool (``block_table``). Rows:
page 16 and page 1 x B 1/16/64/128 x L 4K/32K at s_q 1, and s_q 4 at page 16, B 16/64, L 4K/32K.
On the same bytes, in one process, per row:
  gqadrv         ``prepare_gqa_decode_paged`` + ``launch_prepared`` (default mode)
  gqadrv_det     the same with ``deterministic=True``
  gqadrv_sq1     (s_q 4 rows) the paged launch with one query token per request, same cache
  gqadrv_contig  ``prepare_gqa_decode`` on a contiguous ``[B, 2, Hkv, L, D]`` copy of the pages
  flashinfer, flashinfer_tc   (s_q 1) ``BatchDecodeWithPagedKVCacheWrapper`` NHD, CUDA-core and
                 tensor-core paths, K and V given as the (k_cache, v_cache) tuple shared by DLPack
  flashinfer_prefill          (s_q 4) ``BatchPrefillWithPagedKVCacheWrapper``, 4 query tokens per
                 request, causal
Hot = per call inside a CUDA graph of N calls, cold = one call after an L2 flush (``ops.bench.Timer``).
TB/s counts the valid K+V bytes once (B * L * 2 * Hkv * D * 2). Ratio columns, hot / cold:
  x contig   contiguous time / paged time (the paged route's speed relative to the contiguous one)
  det/def    deterministic time / default time
  sq4/sq1    s_q 4 time / s_q 1 time (same cache)
  x best FI  best FlashInfer time / gqadrv paged time (> 1: gqadrv faster)
Below the table, each target of the paged-decode issue with the rows that meet it (``target_lines``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

from ..ops.bench import BenchSpec, Timer, best_peer_times, row_results, log, speedup_cell
from ..ops.bench import target_lines as _target_lines

HQ, HKV, D = 32, 8, 128
PAGES = (16, 1)
BATCHES = (1, 16, 64, 128)
LENGTHS = (4096, 32768)
SQ, SQ_BATCHES = 4, (16, 64)
SEED = 1234
FI_WORKSPACE_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class PagedRow:
    page: int
    batch: int
    length: int
    s_q: int = 1

    @property
    def label(self) -> str:
        s = f"p{self.page} B{self.batch} L{self.length // 1024}K"
        return s if self.s_q == 1 else f"{s} s_q{self.s_q}"

    @property
    def tags(self) -> frozenset:
        """What ``--rows`` matches (lower case): page16 / p16, b16, l4096 / 4k, sq1 / s_q1, ..."""
        k = f"{self.length // 1024}k"
        return frozenset({f"page{self.page}", f"p{self.page}", f"b{self.batch}", f"l{self.length}", k, f"l{k}",
                          f"sq{self.s_q}", f"s_q{self.s_q}"})

    @property
    def pages_per_request(self) -> int:
        return -(-self.length // self.page)

    def kv_bytes(self) -> int:
        """Valid K+V bytes one call reads (fp16)."""
        return self.batch * self.length * 2 * HKV * D * 2


ROWS = ([PagedRow(p, b, n) for p in PAGES for b in BATCHES for n in LENGTHS]
        + [PagedRow(16, b, n, SQ) for b in SQ_BATCHES for n in LENGTHS])
QUICK_ROWS = [PagedRow(1, 16, 4096), PagedRow(16, 16, 4096, SQ)]  # every code path, two rows


FORM_TITLES = {"hnd": "HND, random pages", "ordered": "NHD, pages in order"}  # --paged-also forms, table titles
PAGED_ALSO = tuple(FORM_TITLES)
TAG_HELP = "page16/p16, page1/p1, b1, b16, b64, b128, 4k/l4096, 32k/l32768, sq1, sq4"


def select_rows(rows: list, filters: list[str], universe: list | None = None, tag_help: str = TAG_HELP) -> list:
    """The rows having every tag of at least one filter (a comma list of tags), in ``rows`` order.
    A tag no row of ``universe`` (default: ``ROWS``) or ``rows`` has, or filters that select nothing,
    are a ValueError (exit status 2); ``tag_help`` lists the tags in that message."""
    known = frozenset().union(*(r.tags for r in list(ROWS if universe is None else universe) + list(rows)))
    groups = []
    for f in filters:
        tags = {t.strip().lower() for t in f.split(",") if t.strip()}
        unknown = sorted(tags - known)
        if unknown:
            raise ValueError(f"--rows {f}: unknown tag(s) {', '.join(unknown)} (tags: {tag_help}; "
                             f"comma = and, space = or)")
        groups.append(tags)
    out = [r for r in rows if any(g <= r.tags for g in groups)]
    if not out:
        raise ValueError(f"--rows {' '.join(filters)}: no row of this run has all the tags of one filter")
    return out


def block_table(batch: int, pages_per_request: int, seed: int = SEED):
    """int32 [batch, pages_per_request]: a random permutation of the pool 0 .. batch*pages-1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.permutation(batch * pages_per_request).astype(np.int32).reshape(batch, pages_per_request)


def flashinfer_page_args(table, lengths: list[int], page: int):
    """FlashInfer's (indptr, indices, last_page_len), numpy int32, from a block table and lengths >= 1."""
    import numpy as np

    used = [-(-int(n) // page) for n in lengths]
    indptr = np.zeros(len(used) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(used)
    indices = np.concatenate([np.asarray(table[b, :u]) for b, u in enumerate(used)]).astype(np.int32)
    last = np.array([int(n) - (u - 1) * page for n, u in zip(lengths, used)], dtype=np.int32)
    return indptr, indices, last


def fill_contiguous(kv, k_cache, v_cache, table, lengths: list[int]) -> None:
    """Copy request b's tokens 0..len-1 from the NHD pages to ``kv[b, 0|1, :, :len]`` ([B, 2, Hkv, C, D]).
    numpy or CuPy (``table`` of the caches' module); one request at a time (small temporaries)."""
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    for b, n in enumerate(lengths):
        u = -(-int(n) // page)
        for j, cache in enumerate((k_cache, v_cache)):
            tok = cache[table[b, :u]].reshape(u * page, hkv, d)[:n]
            kv[b, j, :, :n] = tok.transpose(1, 0, 2)


# ----------------------------------------------------------------------------- options and peers
def add_arguments(p: argparse.ArgumentParser) -> None:
    # --no-peers and --backend come from the gqa spec (one shared parser); read with getattr
    p.add_argument("--rows", nargs="+", default=None, metavar="TAGS",
                   help="--op gqa_paged / gqa_fp8: only rows with every tag of one of these comma lists, e.g. "
                        "'page16,b1 sq4' (gqa_paged tags: page16/p16, page1/p1, b1, b16, b64, b128, 4k, 32k, sq1, "
                        "sq4; gqa_fp8: b1, b16, b64, b128, b256, 2k, 4k, 8k, 32k)")
    p.add_argument("--quick", action="store_true",
                   help="--op gqa_paged: two smoke rows (p1 B16 L4K; p16 B16 L4K s_q4); --op gqa_fp8: two "
                        "rows (p16 B1 L4K; p16 B16 L4K)")
    p.add_argument("--paged-also", nargs="+", default=[], choices=PAGED_ALSO, metavar="FORM",
                   help="--op gqa_paged: also time the paged route on other forms of the same pages (diagnosis of "
                        "the gap to the contiguous route): 'hnd' (the pools as [pages, Hkv, page, D]: a head's "
                        "tokens of a page contiguous), 'ordered' (NHD pools with every request's pages in table "
                        "order: table = 0, 1, 2, ...); results gqadrv_hnd / gqadrv_ordered, a second table")


def _import_peers(args) -> None:
    mods = ("torch",) if getattr(args, "no_peers", False) else ("torch", "flashinfer")
    for mod in mods:
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001 - optional peer
            log(f"[bench] {mod} not available: {type(exc).__name__}: {str(exc)[:120]}")


def _rows(args) -> list:
    rows = list(QUICK_ROWS if getattr(args, "quick", False) else ROWS)
    filters = getattr(args, "rows", None)
    return select_rows(rows, filters) if filters else rows


# ----------------------------------------------------------------------------- GPU side
def _torch():
    return sys.modules.get("torch")


def _launch_stream():
    """The stream a launch goes to now: torch's current stream (the capture stream inside a torch
    graph), else CuPy's (the capture stream inside a CuPy graph)."""
    torch = _torch()
    if torch is not None:
        return torch.cuda.current_stream()
    import cupy as cp

    return cp.cuda.get_current_stream()


def _free_memory() -> None:
    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    torch = _torch()
    if torch is not None:
        torch.cuda.empty_cache()


def _randn_fp16(rs, shape, chunk: int = 1 << 27):
    """fp16 standard-normal array, generated in chunks (the float32 temporary stays <= 512 MiB)."""
    import cupy as cp

    out = cp.empty(shape, dtype=cp.float16)
    flat = out.reshape(-1)
    for s in range(0, flat.size, chunk):
        n = min(chunk, flat.size - s)
        flat[s:s + n] = rs.standard_normal(n, dtype=cp.float32).astype(cp.float16)
    return out


def _max_diff(a, b) -> float:
    import cupy as cp

    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32).reshape(a.shape)).max())


def _error(res: dict, name: str, label: str, exc: BaseException) -> None:
    res[name] = {"error": repr(exc)[:400]}
    log(f"[bench] {label} {name}: {repr(exc)[:200]}")


def _time_gqadrv(name: str, prepare, timer: Timer, res: dict, label: str) -> bool:
    """Prepare, launch once, time hot and cold; False (and an error entry) when anything fails."""
    import cupy as cp

    import gqadrv

    try:
        p = prepare()

        def fn():
            gqadrv.launch_prepared(p, _launch_stream())

        fn()
        cp.cuda.Device().synchronize()
        res[name] = {"hot_us": timer.hot(fn, _torch() is not None), "cold_us": timer.cold(fn),
                     "route": getattr(p, "route", "?"), "num_splits": getattr(p, "num_splits", None)}
        return True
    except Exception as exc:  # noqa: BLE001 - one failed measurement must not end the run
        _error(res, name, label, exc)
        return False


def _prepare_stream():
    torch = _torch()
    return torch.cuda.current_stream() if torch is not None else None


def _paged(row: PagedRow, q, kc, vc, bt, sl, out, deterministic: bool, backend, **kv):
    """The prepared paged decode (``kv``: kv_dtype / k_scale / v_scale of an FP8 cache)."""
    import gqadrv

    return gqadrv.prepare_gqa_decode_paged(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=sl, out=out,
                                           kv_layout="NHD", deterministic=deterministic, stream=_prepare_stream(),
                                           backend=backend, **kv)


def _flashinfer(row: PagedRow, q, kc, vc, table, lengths, ref, timer: Timer, res: dict) -> None:
    """FlashInfer on the same pages (torch views of the CuPy arrays); max |FlashInfer - gqadrv| per peer."""
    torch, fi = sys.modules["torch"], sys.modules["flashinfer"]
    tq, tk, tv = torch.from_dlpack(q), torch.from_dlpack(kc), torch.from_dlpack(vc)
    tref = torch.from_dlpack(ref) if ref is not None else None
    dev = tq.device
    indptr, indices, last = (torch.from_numpy(x).to(dev) for x in flashinfer_page_args(table, lengths, row.page))
    ws = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)

    def measure(name, fn):
        try:
            o = fn()
            torch.cuda.synchronize()
            diff = None if tref is None else float((o.float().reshape(tref.shape) - tref.float()).abs().max())
            res[name] = {"hot_us": timer.hot(fn, True), "cold_us": timer.cold(fn), "max_diff_vs_gqadrv": diff}
        except Exception as exc:  # noqa: BLE001 - optional peer
            _error(res, name, row.label, exc)

    if row.s_q == 1:
        for name, tc in (("flashinfer", False), ("flashinfer_tc", True)):
            try:
                w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                w.plan(indptr, indices, last, HQ, HKV, D, row.page, pos_encoding_mode="NONE",
                       q_data_type=tq.dtype, kv_data_type=tq.dtype)
            except Exception as exc:  # noqa: BLE001
                _error(res, name, row.label, exc)
                continue
            measure(name, lambda w=w: w.run(tq, (tk, tv)))
        return
    try:  # s_q tokens per request: FlashInfer's batch prefill (append) on the paged cache, causal
        qo_indptr = torch.arange(0, (row.batch + 1) * row.s_q, row.s_q, dtype=torch.int32, device=dev)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, row.page, causal=True, pos_encoding_mode="NONE",
               q_data_type=tq.dtype, kv_data_type=tq.dtype)
    except Exception as exc:  # noqa: BLE001
        _error(res, "flashinfer_prefill", row.label, exc)
        return
    tq2 = tq.reshape(row.batch * row.s_q, HQ, D)
    measure("flashinfer_prefill", lambda: w.run(tq2, (tk, tv)))


def _other_form(form: str, row: PagedRow, q, kc, vc, table, sl, ref, timer: Timer, res: dict, backend) -> None:
    """``--paged-also``: the paged route on the same keys in another form, as ``gqadrv_<form>`` (max diff
    against the default form's output). 'hnd': pools transposed to [pages, Hkv, page, D], same table;
    'ordered': NHD pools whose page b * pages_per_request + j holds request b's j-th page, table in order."""
    import cupy as cp
    import numpy as np

    import gqadrv

    _free_memory()
    need = 2 * kc.nbytes + (1 << 30)
    if need > cp.cuda.runtime.memGetInfo()[0]:
        res[f"gqadrv_{form}"] = {"error": f"skipped: the {form} copy needs {need / 1e9:.1f} GB"}
        return
    layout, bt = "NHD", cp.asarray(table)
    if form == "hnd":
        k2, v2, layout = cp.ascontiguousarray(kc.transpose(0, 2, 1, 3)), cp.ascontiguousarray(vc.transpose(0, 2, 1, 3)), "HND"
    else:
        flat = cp.asarray(table.reshape(-1))
        k2, v2 = kc[flat], vc[flat]
        bt = cp.asarray(np.arange(table.size, dtype=np.int32).reshape(table.shape))
    o2 = cp.empty_like(q)

    def prepare():
        return gqadrv.prepare_gqa_decode_paged(q=q, k_cache=k2, v_cache=v2, block_table=bt, seq_lens=sl, out=o2,
                                               kv_layout=layout, stream=_prepare_stream(), backend=backend)

    name = f"gqadrv_{form}"
    if _time_gqadrv(name, prepare, timer, res, row.label) and ref is not None:
        res[name]["max_diff_vs_default"] = _max_diff(ref, o2)


def _contiguous(row: PagedRow, q, kc, vc, bt, sl, lengths, ref, timer: Timer, res: dict, backend) -> None:
    """The contiguous route on a [B, 2, Hkv, L, D] copy of the pages (freed on return)."""
    import cupy as cp

    import gqadrv

    _free_memory()
    need = row.kv_bytes() + (1 << 30)
    free = cp.cuda.runtime.memGetInfo()[0]
    if need > free:
        res["gqadrv_contig"] = {"error": f"skipped: the contiguous copy needs {need / 1e9:.1f} GB, "
                                         f"{free / 1e9:.1f} GB free"}
        log(f"[bench] {row.label} gqadrv_contig: {res['gqadrv_contig']['error']}")
        return
    kv = cp.empty((row.batch, 2, HKV, row.length, D), dtype=cp.float16)
    fill_contiguous(kv, kc, vc, bt, lengths)
    oc = cp.empty_like(q)

    def prepare():
        return gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": oc, "sequence_lengths": sl}, backend=backend,
                                         stream=_prepare_stream())

    ok = _time_gqadrv("gqadrv_contig", prepare, timer, res, row.label)
    if ok and ref is not None:
        res["gqadrv"]["max_diff_vs_contig"] = _max_diff(ref, oc)


def _measure(row: PagedRow, timer: Timer, args) -> dict:
    import cupy as cp
    import numpy as np

    backend = getattr(args, "backend", None)
    rs = cp.random.RandomState(SEED)
    q = _randn_fp16(rs, (row.batch, HQ, D) if row.s_q == 1 else (row.batch, row.s_q, HQ, D))
    num_pages = row.batch * row.pages_per_request
    kc = _randn_fp16(rs, (num_pages, row.page, HKV, D))
    vc = _randn_fp16(rs, (num_pages, row.page, HKV, D))
    table = block_table(row.batch, row.pages_per_request)
    bt = cp.asarray(table)
    lengths = [row.length] * row.batch
    sl = cp.asarray(np.array(lengths, dtype=np.int32))
    res: dict = {}
    o = cp.empty_like(q)
    ok = _time_gqadrv("gqadrv", lambda: _paged(row, q, kc, vc, bt, sl, o, False, backend), timer, res, row.label)
    ref = o if ok else None
    od = cp.empty_like(q)
    ok = _time_gqadrv("gqadrv_det", lambda: _paged(row, q, kc, vc, bt, sl, od, True, backend), timer, res, row.label)
    if ok and ref is not None:
        res["gqadrv_det"]["max_diff_vs_default"] = _max_diff(ref, od)
    if row.s_q != 1:
        q1 = _randn_fp16(rs, (row.batch, HQ, D))
        o1 = cp.empty_like(q1)
        _time_gqadrv("gqadrv_sq1", lambda: _paged(row, q1, kc, vc, bt, sl, o1, False, backend), timer, res, row.label)
    for form in getattr(args, "paged_also", None) or []:
        _other_form(form, row, q, kc, vc, table, sl, ref, timer, res, backend)
    if not getattr(args, "no_peers", False) and "torch" in sys.modules and "flashinfer" in sys.modules:
        _flashinfer(row, q, kc, vc, table, lengths, ref, timer, res)
        _free_memory()
    _contiguous(row, q, kc, vc, bt, sl, lengths, ref, timer, res, backend)
    return {"shape": row.label, "page": row.page, "batch": row.batch, "length": row.length, "s_q": row.s_q,
            "hq": HQ, "hkv": HKV, "d": D, "dtype": "float16", "kv_bytes": row.kv_bytes(), "results": res}


def _run_row(row: PagedRow, timer: Timer, args) -> dict:
    out = _measure(row, timer, args)
    _free_memory()  # _measure's arrays are gone: the next row starts with an empty pool
    return out


# ----------------------------------------------------------------------------- table
def _pair(res: dict, name: str) -> str:
    v = res.get(name, {})
    if "hot_us" in v:
        return f"{v['hot_us']:.2f} / {v['cold_us']:.2f}"
    return "err" if "error" in v else "-"


def _ratio_pair(num: dict, den: dict) -> str:
    """num time / den time, hot and cold ('-' where either was not measured)."""
    if "hot_us" not in num or "hot_us" not in den:
        return "-"
    return f"{speedup_cell(num['hot_us'], den['hot_us'])} / {speedup_cell(num['cold_us'], den['cold_us'])}"


def _diff_cell(res: dict) -> str:
    c = res.get("gqadrv", {}).get("max_diff_vs_contig")
    peers = [v["max_diff_vs_gqadrv"] for k, v in res.items()
             if not k.startswith("gqadrv") and v.get("max_diff_vs_gqadrv") is not None]
    return f"{'-' if c is None else f'{c:.1e}'} / {f'{max(peers):.1e}' if peers else '-'}"


def format_table(meta: dict, rows: list) -> str:
    ceil = meta["ceiling_TBps"]
    out = [(f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {ceil:.2f} TB/s, "
            f"paged GQA decode fp16 Hq {HQ} Hkv {HKV} D {D}, NHD pages in random order; hot = per call in a graph "
            f"of {meta['graph_calls']} calls, cold = L2 flushed single call; ratio cells hot / cold"),
           ("| row | paged hot us | paged cold us | TB/s | % ceil | contig hot / cold | x contig | det/def | "
            "sq4/sq1 | FlashInfer hot / cold | FI TC hot / cold | FI prefill hot / cold | x best FI hot | "
            "x best FI cold | route / splits | max diff contig / FI |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res, g, error_line = row_results(r)
        if error_line is not None:
            out.append(error_line)
            continue
        tbps = r["kv_bytes"] / (g["hot_us"] * 1e-6) / 1e12
        best_hot, best_cold = best_peer_times(res)
        sq = _ratio_pair(g, res.get("gqadrv_sq1", {})) if r.get("s_q", 1) != 1 else "-"
        out.append(f"| {r['shape']} | {g['hot_us']:.2f} | {g['cold_us']:.2f} | {tbps:.2f} | {100 * tbps / ceil:.1f} | "
                   f"{_pair(res, 'gqadrv_contig')} | {_ratio_pair(res.get('gqadrv_contig', {}), g)} | "
                   f"{_ratio_pair(res.get('gqadrv_det', {}), g)} | {sq} | {_pair(res, 'flashinfer')} | "
                   f"{_pair(res, 'flashinfer_tc')} | {_pair(res, 'flashinfer_prefill')} | "
                   f"{speedup_cell(best_hot, g['hot_us'])} | {speedup_cell(best_cold, g['cold_us'])} | "
                   f"{g.get('route', '?')} / {g.get('num_splits', '?')} | {_diff_cell(res)} |")
    return "\n".join(out + [""] + target_lines(rows) + _forms_table(rows))


def _forms_table(rows: list) -> list[str]:
    """``--paged-also``: the paged route on the other forms of the same pages beside the default NHD form and the
    contiguous route (hot / cold µs; x contig = contiguous time / that form's time)."""
    forms = [f for f in PAGED_ALSO if any(f"gqadrv_{f}" in r.get("results", {}) for r in rows)]
    if not forms:
        return []
    out = ["", "Paged route on other forms of the same pages (hot / cold us; x contig hot / cold):", "",
           "| row | NHD, random pages | " + " | ".join(FORM_TITLES[f] for f in forms) + " | contiguous |",
           "|---|---|" + "---|" * len(forms) + "---|"]
    for r in rows:
        res = r.get("results", {})
        if "hot_us" not in res.get("gqadrv", {}):
            continue
        c = res.get("gqadrv_contig", {})
        cells = [f"{_pair(res, n)} ({_ratio_pair(c, res[n])})" if "hot_us" in res.get(n, {}) else _pair(res, n)
                 for n in ["gqadrv"] + [f"gqadrv_{f}" for f in forms]]
        out.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {_pair(res, 'gqadrv_contig')} |")
    return out


def _t(res: dict, name: str, key: str):
    v = res.get(name, {})
    return v.get(key) if "hot_us" in v else None


def _over(a, b):
    return a / b if a and b else None


# (text, row applies, ratio(res, key), ratio is good); key is hot_us or cold_us
TARGETS = (
    ("page >= 16, s_q 1: paged speed >= 0.97 x contiguous (x contig)",
     lambda r: r["page"] >= 16 and r["s_q"] == 1,
     lambda res, k: _over(_t(res, "gqadrv_contig", k), _t(res, "gqadrv", k)), lambda x: x >= 0.97),
    ("page >= 16, s_q 1: >= 1.00 x the best FlashInfer paged decode (x best FI)",
     lambda r: r["page"] >= 16 and r["s_q"] == 1,
     lambda res, k: _over(best_peer_times(res)[0 if k == "hot_us" else 1], _t(res, "gqadrv", k)),
     lambda x: x >= 1.0),
    ("page 1, B >= 16, s_q 1: paged speed >= 0.85 x contiguous (x contig)",
     lambda r: r["page"] == 1 and r["batch"] >= 16 and r["s_q"] == 1,
     lambda res, k: _over(_t(res, "gqadrv_contig", k), _t(res, "gqadrv", k)), lambda x: x >= 0.85),
    ("s_q 4, B >= 16: time <= 1.30 x the s_q 1 time (sq4/sq1)",
     lambda r: r["s_q"] != 1 and r["batch"] >= 16,
     lambda res, k: _over(_t(res, "gqadrv", k), _t(res, "gqadrv_sq1", k)), lambda x: x <= 1.30),
    ("B >= 16: deterministic time <= 1.10 x default (det/def)",
     lambda r: r["batch"] >= 16,
     lambda res, k: _over(_t(res, "gqadrv_det", k), _t(res, "gqadrv", k)), lambda x: x <= 1.10),
)


def target_lines(rows: list, targets: tuple = TARGETS) -> list[str]:
    """ops.bench.target_lines over ``targets`` (default: this bench's)."""
    return _target_lines(rows, targets)


SPEC = BenchSpec(name="gqa_paged", add_arguments=add_arguments, rows=_rows, run_row=_run_row,
                 format_table=format_table, import_peers=_import_peers)
