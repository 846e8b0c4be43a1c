"""MLA dense decode on FlashMLA's 656-byte FP8 cache against our bf16 MLA decode on the same shapes
(``python -m gqadrv bench --op mla_fp8``; run by ``ops.bench.run``).

Rows: b 128, page 64, s_q 1, uniform lengths L in {4K, 8K, 16K, 32K} at h_q 16 (memory-bound), 64 and
128 (compute-bound). Each row builds one bf16 cache, quantizes it on the GPU with
``quantize_k_cache`` and times both prepared launches hot (a CUDA graph of N calls) and cold (L2
flushed): ``gqadrv_fp8`` and ``gqadrv_bf16`` (the default routes). Columns: TFLOPS (FlashMLA's formula
2·h_q·s_q·Σlen·(576+512)), TB/s of the bytes each reads (KV 656 or 1152 bytes per token, plus q and
out), speed over bf16, and the max |fp8 − bf16| of the outputs (the quantization error, not a check).
No peer: FlashMLA and FlashInfer have no dense FP8 MLA decode. Below the table, the FP8 issue's MLA
targets: h_q 16 ≥ 1.7× our bf16, h_q 128 ≥ 90 % of our bf16 TFLOPS.
"""

from __future__ import annotations

import argparse

from ..ops.bench import BenchSpec, Timer, log
from ..ops.bench import target_lines as _target_lines
from .bench import _metrics

__all__ = ["SPEC", "format_table", "target_lines"]

ROWS = [(128, 1, h, L) for h in (16, 64, 128) for L in (4096, 8192, 16384, 32768)]
PAGE = 64


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mla-fp8-rows", nargs="*", default=None, help="MLA FP8 rows 'b,s_q,h_q,L' (default: the issue's table)")
    p.add_argument("--mla-fp8-also", nargs="*", default=[], metavar="BACKEND",
                   help="more FP8 routes forced in the same rows (e.g. seesaw_fp8 narrow16_fp8); rows they do not "
                        "serve record the error")


def _rows(args) -> list:
    if getattr(args, "mla_fp8_rows", None):
        return [tuple(int(x) for x in t.split(",")) for t in args.mla_fp8_rows]
    return list(ROWS)


def _import_peers(args) -> None:
    try:
        __import__("torch")
    except Exception as exc:  # noqa: BLE001
        log(f"[bench] torch not available ({type(exc).__name__}): CuPy graphs time the hot runs")


def _run_row(item, timer: Timer, args) -> dict:
    import sys

    import cupy as cp
    import numpy as np

    import gqadrv

    b, s_q, h_q, L = item
    lens = [L] * b
    max_blocks = -(-L // PAGE)
    nb = b * max_blocks
    rs = cp.random.RandomState(7)
    import ml_dtypes

    k = (rs.standard_normal((nb, PAGE, 1, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
    q = (rs.standard_normal((b, s_q, h_q, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
    bt = cp.arange(nb, dtype=cp.int32).reshape(b, max_blocks)
    sl = cp.asarray(np.array(lens, np.int32))
    k8 = gqadrv.quantize_k_cache(k)
    torch = sys.modules.get("torch")
    cur = (lambda: torch.cuda.current_stream()) if torch is not None else (lambda: None)  # noqa: E731
    res: dict = {}
    outs = {}
    runs = [("gqadrv_bf16", k, False, 1152, None), ("gqadrv_fp8", k8, True, 656, None)]
    runs += [(f"fp8:{be}", k8, True, 656, be) for be in getattr(args, "mla_fp8_also", None) or []]
    for name, cache, fp8, kvb, be in runs:
        try:
            out = cp.empty((b, s_q, h_q, 512), q.dtype)
            lse = cp.empty((b, h_q, s_q), cp.float32)
            p = gqadrv.prepare_mla_decode(q, cache, bt, sl, out=out, lse=lse, causal=s_q > 1, is_fp8_kvcache=fp8,
                                          stream=cur(), backend=be)
            # the current stream at call time: a torch graph captures on its own side stream
            fn = lambda p=p: gqadrv.launch_prepared(p, cur())  # noqa: E731
            hot, cold = timer.hot(fn, torch is not None), timer.cold(fn)
            fl_h, tb_h = _metrics(h_q, s_q, lens, b, hot, kvb)
            fl_c, tb_c = _metrics(h_q, s_q, lens, b, cold, kvb)
            res[name] = {"hot_us": hot, "cold_us": cold, "route": p.route, "num_splits": p.num_splits,
                         "hot_TFLOPS": fl_h, "hot_TBps": tb_h, "cold_TFLOPS": fl_c, "cold_TBps": tb_c}
            outs[name] = out
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}
    if "gqadrv_bf16" in outs:
        cp.cuda.Device().synchronize()
        for name, o in outs.items():
            if name != "gqadrv_bf16":
                d = cp.abs(o.astype(cp.float32) - outs["gqadrv_bf16"].astype(cp.float32))
                res[name]["max_diff_vs_bf16"] = float(d.max())
    return {"shape": f"b{b} s_q{s_q} h_q{h_q} L{L}", "b": b, "s_q": s_q, "h_q": h_q, "L": L, "results": res}


def _t(res: dict, name: str, key: str):
    v = res.get(name, {})
    return v.get(key) if "error" not in v else None


def _x_bf16(res: dict, key: str):
    a, f = _t(res, "gqadrv_bf16", key), _t(res, "gqadrv_fp8", key)
    return a / f if a and f else None


def format_table(meta: dict, rows: list) -> str:
    out = [f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {meta['ceiling_TBps']:.2f} TB/s; "
           f"MLA dense decode, page {PAGE}, bf16 q: FlashMLA's 656-byte FP8 cache vs our bf16 cache; hot = per call in a "
           f"graph of {meta['graph_calls']} calls, cold = L2 flushed",
           "| row | fp8 hot us | TFLOPS | TB/s | fp8 cold us | bf16 hot us | TFLOPS | TB/s | bf16 cold us | x bf16 hot / cold "
           "| max abs fp8 - bf16 | fp8 route / splits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["results"]
        f, g = res.get("gqadrv_fp8", {}), res.get("gqadrv_bf16", {})
        if "error" in f or "error" in g or not f or not g:
            out.append(f"| {r['shape']} | error: {f.get('error') or g.get('error')} |")
            continue
        xh, xc = _x_bf16(res, "hot_us"), _x_bf16(res, "cold_us")
        out.append(f"| {r['shape']} | {f['hot_us']:.1f} | {f['hot_TFLOPS']:.0f} | {f['hot_TBps']:.2f} | {f['cold_us']:.1f} | "
                   f"{g['hot_us']:.1f} | {g['hot_TFLOPS']:.0f} | {g['hot_TBps']:.2f} | {g['cold_us']:.1f} | "
                   f"{xh:.2f} / {xc:.2f} | {f.get('max_diff_vs_bf16', float('nan')):.2e} | {f['route']} / {f['num_splits']} |")
    also = sorted({n for r in rows for n in r["results"] if n.startswith("fp8:")})
    if also:
        out += ["", "Forced FP8 routes in the same rows (hot / cold us, x bf16 hot / cold, max abs vs bf16):", "",
                "| row | " + " | ".join(n[4:] for n in also) + " |", "|---|" + "---|" * len(also)]
        for r in rows:
            res, cells = r["results"], []
            g = res.get("gqadrv_bf16", {})
            for n in also:
                f = res.get(n, {})
                if "error" in f or not f or "error" in g or not g:
                    cells.append("error: " + str(f.get("error") or g.get("error"))[:60])
                else:
                    cells.append(f"{f['hot_us']:.1f} / {f['cold_us']:.1f} ({g['hot_us'] / f['hot_us']:.2f} / "
                                 f"{g['cold_us'] / f['cold_us']:.2f}, {f.get('max_diff_vs_bf16', float('nan')):.1e})")
            out.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(out + [""] + target_lines(rows))


# (text, row applies, value(res, key), value is good); a row meets a target when hot and cold do
TARGETS = (
    ("h_q 16: fp8 speed >= 1.7 x our bf16", lambda r: r["h_q"] == 16, _x_bf16, lambda x: x >= 1.7),
    ("h_q 128: fp8 TFLOPS >= 90 % of our bf16 (x bf16 >= 0.9)", lambda r: r["h_q"] == 128, _x_bf16,
     lambda x: x >= 0.9),
)


def target_lines(rows: list) -> list[str]:
    return _target_lines(rows, TARGETS)


SPEC = BenchSpec(name="mla_fp8", add_arguments=_add_arguments, rows=_rows, run_row=_run_row, format_table=format_table,
                 import_peers=_import_peers)
