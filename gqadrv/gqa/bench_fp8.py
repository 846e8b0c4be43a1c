"""FP8-e4m3 KV paged GQA decode bench spec (run by ``ops.bench.run``): ``python -m gqadrv bench --op gqa_fp8``.

    python -m gqadrv bench --op gqa_fp8 [--quick] [--rows TAG[,TAG...] ...] [--no-peers] [--reps N] [--json out.json]

The rows of ANCHORS.md "FP8-e4m3 KV GQA decode" (B, L: 1,4K; 1,32K; 16,4K; 64,4K; 128,8K; 256,2K):
fp16 q, Hq 32, Hkv 8, D 128, page 16, NHD caches ``[num_pages, 16, Hkv, D]``, every request at its
full length L, each request's pages a random permutation of one pool (as ``bench --op gqa_paged``).
K and V are random normal fp16; ``quantize_kv_fp8`` turns each into uint8 e4m3 codes with one
per-tensor scale (amax / 448, read back as a host float). On those bytes, in one process, per row:
  gqadrv_fp8          ``prepare_gqa_decode_paged(kv_dtype="e4m3", k_scale=<float>, v_scale=<float>)``
  gqadrv_fp8_dev      the same codes with device per-KV-head scales (float32 [Hkv], every head the
                      per-tensor value: the same output, read through the per-head scale path)
  gqadrv_fp16         the prepared paged fp16 decode on the fp16 cache the codes came from
  flashinfer_fp8, flashinfer_fp8_tc   ``BatchDecodeWithPagedKVCacheWrapper`` NHD, kv_data_type
                      float8_e4m3fn, CUDA-core / tensor-core path; K and V are torch float8 views of
                      the code arrays (DLPack); ``run(q, (k, v), k_scale=<float>, v_scale=1.0)``:
                      FlashInfer 0.7.2 folds k_scale into sm_scale but applies a v_scale != 1.0 as a
                      second launch (out *= v_scale); it is timed without that launch (its output is
                      multiplied by v_scale for the comparison), so its FP8 time is the kernel alone
  flashinfer_fp16_tc  the tensor-core decode on the fp16 cache
Hot = per call inside a CUDA graph of N calls, cold = one call after an L2 flush (``ops.bench.Timer``).
TB/s counts the valid K+V bytes once: B * L * 2 * Hkv * D * 1 for FP8, * 2 for fp16. Ratio cells
hot / cold: ``x fp16`` = our fp16 time / our fp8 time; ``x best FI fp8`` = the best FlashInfer fp8
time / our fp8 time (> 1: gqadrv faster). Max |diff| per row: the device-scale output and FlashInfer's
fp8 outputs against gqadrv_fp8, FlashInfer's fp16 against gqadrv_fp16, and gqadrv_fp8 against
gqadrv_fp16 (the quantization error). Below the table, the FP8 issue's targets (``target_lines``).
"""

from __future__ import annotations

import sys

from ..ops.bench import BenchSpec, Timer, best_peer_times, log
from . import bench_paged as bp
from .bench_paged import HKV, HQ, D, PagedRow

PAGE = 16
SHAPES = ((1, 4096), (1, 32768), (16, 4096), (64, 4096), (128, 8192), (256, 2048))
ROWS = [PagedRow(PAGE, b, n) for b, n in SHAPES]
QUICK_ROWS = [PagedRow(PAGE, 1, 4096), PagedRow(PAGE, 16, 4096)]
TAG_HELP = "b1, b16, b64, b128, b256, 2k/l2048, 4k/l4096, 8k/l8192, 32k/l32768 (page16/p16, sq1: every row)"
FI_FP8 = ("flashinfer_fp8", "flashinfer_fp8_tc")


def fp8_bytes(row: PagedRow) -> int:
    """Valid K+V bytes one FP8 call reads (1 byte per element)."""
    return row.kv_bytes() // 2


def _rows(args) -> list:
    rows = list(QUICK_ROWS if getattr(args, "quick", False) else ROWS)
    filters = getattr(args, "rows", None)
    return bp.select_rows(rows, filters, universe=ROWS, tag_help=TAG_HELP) if filters else rows


def _add_arguments(p) -> None:
    """--rows / --quick / --no-peers / --backend come from the gqa_paged and gqa specs (one shared parser)."""


# ----------------------------------------------------------------------------- GPU side
def _flashinfer(row: PagedRow, q, caches: dict, table, lengths, refs: dict, scales, timer: Timer, res: dict) -> None:
    """FlashInfer's fp8 (CUDA-core, tensor-core) and fp16 tensor-core decode on the same bytes."""
    torch, fi = sys.modules["torch"], sys.modules["flashinfer"]
    tq = torch.from_dlpack(q)
    f8 = torch.float8_e4m3fn
    kv = {"fp16": tuple(torch.from_dlpack(x) for x in caches["fp16"]),
          "fp8": tuple(torch.from_dlpack(x).view(f8) for x in caches["fp8"])}
    tref = {k: torch.from_dlpack(v) for k, v in refs.items() if v is not None}
    dev = tq.device
    indptr, indices, last = (torch.from_numpy(x).to(dev) for x in bp.flashinfer_page_args(table, lengths, row.page))
    ws = torch.empty(bp.FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    ks, vs = scales
    for name, tc, kind in (("flashinfer_fp8", False, "fp8"), ("flashinfer_fp8_tc", True, "fp8"),
                           ("flashinfer_fp16_tc", True, "fp16")):
        try:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(indptr, indices, last, HQ, HKV, D, row.page, pos_encoding_mode="NONE", q_data_type=tq.dtype,
                   kv_data_type=f8 if kind == "fp8" else tq.dtype)
            kw = {"k_scale": ks, "v_scale": 1.0} if kind == "fp8" else {}  # v_scale applied below

            def fn(w=w, c=kv[kind], kw=kw):
                return w.run(tq, c, **kw)

            o = fn()
            torch.cuda.synchronize()
            ref = tref.get(kind)
            of = o.float() * (vs if kind == "fp8" else 1.0)
            diff = None if ref is None else float((of.reshape(ref.shape) - ref.float()).abs().max())
            res[name] = {"hot_us": timer.hot(fn, True), "cold_us": timer.cold(fn), "max_diff_vs_gqadrv": diff}
        except Exception as exc:  # noqa: BLE001 - optional peer
            bp._error(res, name, row.label, exc)


def _measure(row: PagedRow, timer: Timer, args) -> dict:
    import cupy as cp
    import numpy as np

    import gqadrv

    backend = getattr(args, "backend", None)
    rs = cp.random.RandomState(bp.SEED)
    q = bp._randn_fp16(rs, (row.batch, HQ, D))
    num_pages = row.batch * row.pages_per_request
    kc = bp._randn_fp16(rs, (num_pages, row.page, HKV, D))
    vc = bp._randn_fp16(rs, (num_pages, row.page, HKV, D))
    (k8, ks), (v8, vs) = gqadrv.quantize_kv_fp8(kc), gqadrv.quantize_kv_fp8(vc)
    ks, vs = float(ks.get()), float(vs.get())  # per-tensor amax / 448 as host floats
    ksd, vsd = cp.full((HKV,), ks, dtype=cp.float32), cp.full((HKV,), vs, dtype=cp.float32)
    table = bp.block_table(row.batch, row.pages_per_request)
    bt = cp.asarray(table)
    lengths = [row.length] * row.batch
    sl = cp.asarray(np.array(lengths, dtype=np.int32))
    cp.cuda.Device().synchronize()
    res: dict = {}
    outs = {name: cp.empty_like(q) for name in ("gqadrv_fp8", "gqadrv_fp8_dev", "gqadrv_fp16")}
    runs = (("gqadrv_fp8", k8, v8, {"kv_dtype": "e4m3", "k_scale": ks, "v_scale": vs}),
            ("gqadrv_fp8_dev", k8, v8, {"kv_dtype": "e4m3", "k_scale": ksd, "v_scale": vsd}),
            ("gqadrv_fp16", kc, vc, {}))
    ok = {}
    for name, k, v, kv in runs:
        ok[name] = bp._time_gqadrv(name, lambda k=k, v=v, o=outs[name], kv=kv: bp._paged(
            row, q, k, v, bt, sl, o, False, backend, **kv), timer, res, row.label)
    if ok["gqadrv_fp8"]:
        res["gqadrv_fp8"]["bytes"] = fp8_bytes(row)
        if ok["gqadrv_fp8_dev"]:
            res["gqadrv_fp8_dev"]["max_diff_vs_gqadrv"] = bp._max_diff(outs["gqadrv_fp8"], outs["gqadrv_fp8_dev"])
        if ok["gqadrv_fp16"]:
            res["gqadrv_fp8"]["max_diff_vs_fp16"] = bp._max_diff(outs["gqadrv_fp16"], outs["gqadrv_fp8"])
    if not getattr(args, "no_peers", False) and "torch" in sys.modules and "flashinfer" in sys.modules:
        refs = {"fp8": outs["gqadrv_fp8"] if ok["gqadrv_fp8"] else None,
                "fp16": outs["gqadrv_fp16"] if ok["gqadrv_fp16"] else None}
        _flashinfer(row, q, {"fp8": (k8, v8), "fp16": (kc, vc)}, table, lengths, refs, (ks, vs), timer, res)
        bp._free_memory()
    return {"shape": row.label, "page": row.page, "batch": row.batch, "length": row.length, "s_q": 1, "hq": HQ,
            "hkv": HKV, "d": D, "dtype": "float16", "kv_dtype": "e4m3", "kv_bytes": fp8_bytes(row),
            "kv_bytes_fp16": row.kv_bytes(), "k_scale": ks, "v_scale": vs, "results": res}


def _run_row(row: PagedRow, timer: Timer, args) -> dict:
    out = _measure(row, timer, args)
    bp._free_memory()  # _measure's arrays are gone: the next row starts with an empty pool
    ours = ", ".join(f"{k} {v['hot_us']:.2f}" for k, v in out["results"].items()
                     if k.startswith("gqadrv") and "hot_us" in v)
    log(f"[bench] {row.label}: {ours or 'no gqadrv timing'} us hot")  # (the harness's line looks for 'gqadrv')
    return out


# ----------------------------------------------------------------------------- table and targets
def _tbps(nbytes, us):
    return nbytes / (us * 1e-6) / 1e12 if nbytes and us else None


def _best_fi_fp8(res: dict) -> dict:
    """The best FlashInfer fp8 hot and cold times as a result entry ({} when neither ran)."""
    hot, cold = best_peer_times({k: res[k] for k in FI_FP8 if k in res})
    return {"hot_us": hot, "cold_us": cold} if hot else {}


def _diff_cell(res: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.1e}"

    fi8 = [res[k]["max_diff_vs_gqadrv"] for k in FI_FP8 if res.get(k, {}).get("max_diff_vs_gqadrv") is not None]
    return " / ".join((f(res.get("gqadrv_fp8_dev", {}).get("max_diff_vs_gqadrv")), f(max(fi8) if fi8 else None),
                       f(res.get("flashinfer_fp16_tc", {}).get("max_diff_vs_gqadrv")),
                       f(res.get("gqadrv_fp8", {}).get("max_diff_vs_fp16"))))


def format_table(meta: dict, rows: list) -> str:
    ceil = meta["ceiling_TBps"]
    out = [(f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {ceil:.2f} TB/s, "
            f"paged GQA decode FP8-e4m3 KV (fp16 q) Hq {HQ} Hkv {HKV} D {D}, page {PAGE} NHD pages in random order; "
            f"TB/s of the KV bytes (1 B fp8, 2 B fp16); hot = per call in a graph of {meta['graph_calls']} calls, "
            f"cold = L2 flushed single call; ratio cells hot / cold"),
           ("| row | fp8 hot us | fp8 cold us | TB/s | % ceil | fp8 dev-scale hot / cold | fp16 hot / cold | fp16 TB/s | "
            "x fp16 | FI fp8 hot / cold | FI fp8 TC hot / cold | FI fp16 TC hot / cold | x best FI fp8 | "
            "route / splits | max diff dev / FI fp8 / FI fp16 / fp8-fp16 |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["results"]
        g = res.get("gqadrv_fp8", {})
        if "hot_us" not in g:
            out.append(f"| {r['shape']} | error: {g.get('error', '?')[:80]} |")
            continue
        tbps = _tbps(r["kv_bytes"], g["hot_us"])
        t16 = _tbps(r.get("kv_bytes_fp16"), bp._t(res, "gqadrv_fp16", "hot_us"))
        out.append(f"| {r['shape']} | {g['hot_us']:.2f} | {g['cold_us']:.2f} | {tbps:.2f} | {100 * tbps / ceil:.1f} | "
                   f"{bp._pair(res, 'gqadrv_fp8_dev')} | {bp._pair(res, 'gqadrv_fp16')} | "
                   f"{'-' if t16 is None else f'{t16:.2f}'} | {bp._ratio_pair(res.get('gqadrv_fp16', {}), g)} | "
                   f"{bp._pair(res, 'flashinfer_fp8')} | {bp._pair(res, 'flashinfer_fp8_tc')} | "
                   f"{bp._pair(res, 'flashinfer_fp16_tc')} | {bp._ratio_pair(_best_fi_fp8(res), g)} | "
                   f"{g.get('route', '?')} / {g.get('num_splits', '?')} | {_diff_cell(res)} |")
    return "\n".join(out + [""] + bp.target_lines(rows, TARGETS))


def _x_fp16(res: dict, k: str):
    return bp._over(bp._t(res, "gqadrv_fp16", k), bp._t(res, "gqadrv_fp8", k))


def _fp8_tbps(res: dict, k: str):
    return _tbps(res.get("gqadrv_fp8", {}).get("bytes"), bp._t(res, "gqadrv_fp8", k))


def _shape(batch: int, length: int):
    return lambda r: r["batch"] == batch and r["length"] == length


# (text, row applies, value(res, key), value is good), as bench_paged.TARGETS; key is hot_us or cold_us
TARGETS = (
    ("B >= 64: fp8 speed >= 1.9 x our fp16 (x fp16)", lambda r: r["batch"] >= 64, _x_fp16, lambda x: x >= 1.9),
    ("B >= 64: >= 4.4 TB/s (fp8 TB/s)", lambda r: r["batch"] >= 64, _fp8_tbps, lambda x: x >= 4.4),
    ("B1 L32K: >= 3.8 TB/s (fp8 TB/s)", _shape(1, 32768), _fp8_tbps, lambda x: x >= 3.8),
    ("B16 L4K: >= 4.2 TB/s (fp8 TB/s)", _shape(16, 4096), _fp8_tbps, lambda x: x >= 4.2),
    ("B1 L4K: faster than our fp16 B1 L4K (x fp16 > 1)", _shape(1, 4096), _x_fp16, lambda x: x > 1.0),
)


def target_lines(rows: list) -> list[str]:
    return bp.target_lines(rows, TARGETS)


SPEC = BenchSpec(name="gqa_fp8", add_arguments=_add_arguments, rows=_rows, run_row=_run_row,
                 format_table=format_table, import_peers=bp._import_peers)
