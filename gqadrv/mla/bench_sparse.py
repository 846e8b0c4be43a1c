"""Sparse MLA decode (DeepSeek V3.2 top-k attention) against DeepSeek's FlashMLA on the same data in
the same process (``python -m gqadrv bench --op mla_sparse``; run by ``ops.bench.run``).

Data per row: b requests of s_k tokens each in pages of 64 (request i owns pages
[i·s_k/page, (i+1)·s_k/page)); a bf16 cache ~ N(0, 1)/10 [num_blocks, page, 1, 576], quantized on
the GPU by ``gqadrv.quantize_k_cache`` into FlashMLA's 656-byte V3.2 FP8 cache (FlashMLA reads the same
bytes, viewed as float8_e4m3fn); q bf16 ~ N(0, 1)/10 [b, s_q, h_q, 576]; indices int32
[b, s_q, topk] = random positions below s_k drawn with replacement (as shared/tools/peer_flashmla.py
does for the anchors; ``--mla-sparse-unique``: without replacement per query token) mapped to slots
page_id·page + offset; softmax_scale 576^-0.5. gqadrv is timed through ``prepare_mla_decode`` +
``launch_prepared``, FlashMLA through ``flash_mla_with_kvcache(q, kc, None, None, 512, meta, None,
softmax_scale=..., is_fp8_kvcache=True, indices=idx)`` with a fresh ``get_mla_metadata()`` per
variant. Hot = per call in a CUDA graph of ``--graph-calls`` calls (median of ``--reps`` replays),
cold = L2 flushed before each call (median).

Rows (kind, b, s_q, h_q, topk, s_k): ``fp8`` b 128 s_q 2 s_k 32768 at h_q 128 / 64 and topk 2048 /
16384 (gqadrv vs FlashMLA); ``h16`` h_q 16 topk 2048 (gqadrv at 16 heads vs the same work padded to 64
heads with zero queries, gqadrv and FlashMLA, FlashMLA's smallest head count); ``bf16`` the bf16-KV
sparse decode (is_fp8_kvcache=False; FlashMLA has none) with our FP8 beside it; ``sink`` attn_sink
(random fp32 [h_q]) and topk_length (= topk for every request, so the work is unchanged and the
difference is the features' cost) against the plain call, and FlashMLA with attn_sink (FlashMLA's
SM90 V3.2 path rejects topk_length, so it is not asked for).

Formulas (FlashMLA's, shared/reference/flashmla.md §5.3): FLOPs = 2·h_q·N·(576 + 512), N = b·s_q·topk
(s_q·Σ topk_length with topk_length); bytes = 2·b·s_q·h_q·576 (q) + U·kv_bytes + 2·b·s_q·h_q·512
(out), U = the number of distinct indices of the batch, kv_bytes = 656 (FP8) or 1152 (bf16). The h16
row's TFLOPS count the useful 16 heads for every variant (the padded ones execute 4x those FLOPs;
``exec_TFLOPS`` in the JSON); TB/s use the bytes each variant moves. Anchors on this H200
(shared/ANCHORS.md): FlashMLA 388 / 434 TFLOPS at h_q 128, topk 2048 / 16384; gqadrv targets ≥ 430 /
≥ 480 and ≥ 3.5x the padded form at h_q 16. Nothing here asserts a speed: the targets are reported.
"""

from __future__ import annotations

import argparse
import sys

from ..ops.bench import BenchSpec, Timer
from ..ops.bench import target_lines as _target_lines
from .bench_peer import fmt, import_peers, tflops_over, time_over

__all__ = ["ROWS", "SPEC", "format_table", "parse_row", "sparse_metrics", "target_lines"]

PAGE = 64
D_QK, D_V = 576, 512
KV_BYTES = {"fp8": 656, "bf16": 2 * D_QK}
SCALE = D_QK ** -0.5
KINDS = ("fp8", "h16", "bf16", "sink")
PAD_HEADS = 64  # FlashMLA's sparse decode takes h_q 64 or 128 only

# (kind, b, s_q, h_q, topk, s_k, page)
ROWS = ([("fp8", 128, 2, h, t, 32768, PAGE) for h in (128, 64) for t in (2048, 16384)]
        + [("h16", 128, 2, 16, 2048, 32768, PAGE), ("bf16", 128, 2, 128, 2048, 32768, PAGE),
           ("sink", 128, 2, 128, 2048, 32768, PAGE)])

# result names per kind, in table order; the first is gqadrv's subject of the row
VARIANTS = {
    "fp8": ("gqadrv", "flashmla"),
    "h16": ("gqadrv", "gqadrv_pad64", "flashmla_pad64"),
    "bf16": ("gqadrv", "gqadrv_fp8"),
    "sink": ("gqadrv", "gqadrv_sink", "gqadrv_plain", "flashmla_sink", "flashmla"),
}
LABELS = {
    ("fp8", "gqadrv"): "gqadrv fp8", ("fp8", "flashmla"): "FlashMLA fp8",
    ("h16", "gqadrv"): "gqadrv fp8 h_q 16", ("h16", "gqadrv_pad64"): "gqadrv fp8 padded to h_q 64",
    ("h16", "flashmla_pad64"): "FlashMLA fp8 padded to h_q 64",
    ("bf16", "gqadrv"): "gqadrv bf16 KV", ("bf16", "gqadrv_fp8"): "gqadrv fp8",
    ("sink", "gqadrv"): "gqadrv fp8 + sink + topk_length", ("sink", "gqadrv_sink"): "gqadrv fp8 + sink",
    ("sink", "gqadrv_plain"): "gqadrv fp8 plain", ("sink", "flashmla_sink"): "FlashMLA fp8 + sink",
    ("sink", "flashmla"): "FlashMLA fp8 plain",
}


# ----------------------------------------------------------------------------- pure parts (CPU)
def sparse_flops(h_q: int, attended: int) -> float:
    """FLOPs of one sparse decode call: 2·h_q·N·(576 + 512), N = attended (query token, key) pairs."""
    return 2.0 * h_q * attended * (D_QK + D_V)


def sparse_bytes(h_q: int, b: int, s_q: int, unique_tokens: int, kv_bytes: int) -> float:
    """Bytes of one call: q and out in bf16 plus every distinct KV token once."""
    return 2.0 * b * s_q * h_q * D_QK + float(unique_tokens) * kv_bytes + 2.0 * b * s_q * h_q * D_V


def sparse_metrics(h_q: int, b: int, s_q: int, attended: int, unique_tokens: int, kv_bytes: int, us: float,
                   flops_h_q: int | None = None) -> tuple[float, float]:
    """(TFLOPS, TB/s) of one call of ``us`` microseconds; ``flops_h_q``: count the FLOPs of this many
    heads instead of ``h_q`` (the useful heads of a padded call)."""
    s = us * 1e-6
    return (sparse_flops(flops_h_q or h_q, attended) / s / 1e12,
            sparse_bytes(h_q, b, s_q, unique_tokens, kv_bytes) / s / 1e12)


def parse_row(text: str) -> tuple:
    """'kind,b,s_q,h_q,topk[,s_k[,page]]' (s_k 32768, page 64 by default) -> a row tuple."""
    parts = [t.strip() for t in text.split(",")]
    if len(parts) < 5 or len(parts) > 7:
        raise ValueError(f"--mla-sparse-rows {text!r}: expected 'kind,b,s_q,h_q,topk[,s_k[,page]]'")
    kind = parts[0]
    if kind not in KINDS:
        raise ValueError(f"--mla-sparse-rows {text!r}: kind must be one of {', '.join(KINDS)}")
    try:
        nums = [int(x) for x in parts[1:]]
    except ValueError:
        raise ValueError(f"--mla-sparse-rows {text!r}: b, s_q, h_q, topk, s_k, page must be integers") from None
    b, s_q, h_q, topk = nums[:4]
    s_k = nums[4] if len(nums) > 4 else 32768
    page = nums[5] if len(nums) > 5 else PAGE
    if min(b, s_q, h_q, topk, s_k, page) < 1:
        raise ValueError(f"--mla-sparse-rows {text!r}: every size must be positive")
    return (kind, b, s_q, h_q, topk, s_k, page)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mla-sparse-rows", nargs="*", default=None, metavar="ROW",
                   help="--op mla_sparse rows 'kind,b,s_q,h_q,topk[,s_k[,page]]', kind fp8 (vs FlashMLA), h16 (vs "
                        "the padded-to-64-heads forms), bf16 (bf16-KV sparse, with our fp8), sink (attn_sink + "
                        "topk_length cost) (default: the issue's table)")
    p.add_argument("--mla-sparse-backend", default=None, help="--op mla_sparse: gqadrv backend (default: auto)")
    p.add_argument("--mla-sparse-unique", action="store_true",
                   help="--op mla_sparse: draw each query token's indices without replacement (default: with "
                        "replacement, as FlashMLA's anchors were measured)")


def _rows(args) -> list:
    if getattr(args, "mla_sparse_rows", None):
        return [parse_row(t) for t in args.mla_sparse_rows]
    return list(ROWS)


def _label(item) -> str:
    kind, b, s_q, h_q, topk, s_k, page = item
    return f"{kind} b{b} s_q{s_q} h_q{h_q} topk{topk} s_k{s_k}" + (f" page{page}" if page != PAGE else "")


# ----------------------------------------------------------------------------- GPU parts
def _indices(cp, rs, b: int, s_q: int, topk: int, s_k: int, page: int, unique: bool):
    """int32 [b, s_q, topk] slots of random positions below s_k of each request (identity block table)."""
    if unique:
        if topk > s_k:
            raise ValueError(f"--mla-sparse-unique: topk {topk} > s_k {s_k}")
        keys = rs.random_sample((b * s_q, s_k), dtype=cp.float32)
        pos = cp.argsort(keys, axis=1)[:, :topk].astype(cp.int32).reshape(b, s_q, topk)
        del keys
    else:
        pos = rs.randint(0, s_k, size=(b, s_q, topk), dtype=cp.int32)
    blocks = -(-s_k // page)
    base = (cp.arange(b, dtype=cp.int32) * (blocks * page)).reshape(b, 1, 1)
    return cp.ascontiguousarray((pos + base).astype(cp.int32))


def _run_row(item, timer: Timer, args) -> dict:
    import cupy as cp
    import ml_dtypes

    import gqadrv

    kind, b, s_q, h_q, topk, s_k, page = item
    bf16 = ml_dtypes.bfloat16
    blocks = -(-s_k // page)
    nb = b * blocks
    rs = cp.random.RandomState(7)
    torch = sys.modules.get("torch")
    fm = None if getattr(args, "no_peers", False) else sys.modules.get("flash_mla")
    use_torch = torch is not None
    cur = (lambda: torch.cuda.current_stream()) if use_torch else (lambda: None)  # noqa: E731
    backend = getattr(args, "mla_sparse_backend", None)
    row = {"shape": _label(item), "kind": kind, "b": b, "s_q": s_q, "h_q": h_q, "topk": topk, "s_k": s_k,
           "page": page, "indices": "unique" if getattr(args, "mla_sparse_unique", False) else "with replacement"}
    res: dict = {}
    row["results"] = res
    outs: dict = {}

    # data: the bf16 cache, its FP8 form, q (and the zero-padded 64-head q of the h16 row), indices
    k = (rs.standard_normal((nb, page, 1, D_QK), dtype=cp.float32) / 10).astype(bf16)
    k8 = gqadrv.quantize_k_cache(k)
    if kind != "bf16":
        del k
        k = None
    qf = rs.standard_normal((b, s_q, h_q, D_QK), dtype=cp.float32) / 10
    q = qf.astype(bf16)
    q_pad = None
    if kind == "h16":
        qpf = cp.zeros((b, s_q, PAD_HEADS, D_QK), dtype=cp.float32)
        qpf[:, :, :h_q] = qf
        q_pad = qpf.astype(bf16)
        del qpf
    del qf
    idx = _indices(cp, rs, b, s_q, topk, s_k, page, getattr(args, "mla_sparse_unique", False))
    cp.cuda.Device().synchronize()
    row["unique_tokens"] = unique = int(cp.unique(idx.reshape(-1)).size)
    sink = rs.standard_normal((h_q,), dtype=cp.float32) if kind == "sink" else None  # fp32 [h_q]
    tlen = cp.full((b,), topk, dtype=cp.int32) if kind == "sink" else None
    attended = b * s_q * topk  # topk_length = topk where given

    def record(name: str, hot: float, cold: float, heads: int, kv: str, extra: dict | None = None) -> None:
        v = {"hot_us": hot, "cold_us": cold, "h_q_executed": heads, "kv_bytes_per_token": KV_BYTES[kv]}
        for key, us in (("hot", hot), ("cold", cold)):
            v[f"{key}_TFLOPS"], v[f"{key}_TBps"] = sparse_metrics(heads, b, s_q, attended, unique, KV_BYTES[kv], us,
                                                                  flops_h_q=h_q)
            if heads != h_q:
                v[f"{key}_exec_TFLOPS"] = sparse_metrics(heads, b, s_q, attended, unique, KV_BYTES[kv], us)[0]
        v.update(extra or {})
        res[name] = v

    def ours(name: str, qq, cache, fp8: bool, with_sink: bool = False, with_len: bool = False) -> None:
        try:
            kw = {"softmax_scale": SCALE, "is_fp8_kvcache": fp8, "indices": idx, "stream": cur()}
            if with_sink:
                kw["attn_sink"] = sink
            if with_len:
                kw["topk_length"] = tlen
            if backend is not None:
                kw["backend"] = backend
            p = gqadrv.prepare_mla_decode(qq, cache, None, None, D_V, **kw)
            # the current stream at call time: a torch graph captures on its own side stream
            fn = lambda: gqadrv.launch_prepared(p, cur())  # noqa: E731
            hot, cold = timer.hot(fn, use_torch), timer.cold(fn)
            o = fn()
            outs[name] = o[0] if isinstance(o, tuple) else o
            record(name, hot, cold, qq.shape[2], "fp8" if fp8 else "bf16",
                   {"route": getattr(p, "route", None), "num_splits": getattr(p, "num_splits", None)})
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}

    def peer(name: str, qq, with_sink: bool = False) -> None:
        if fm is None or not use_torch:
            why = "--no-peers" if getattr(args, "no_peers", False) else "flash_mla not importable"
            res[name] = {"error": why if use_torch else "torch not importable"}
            return
        try:
            tq, tidx = torch.from_dlpack(qq), torch.from_dlpack(idx)
            tk = torch.from_dlpack(k8)
            f8 = getattr(torch, "float8_e4m3fn", None)
            if f8 is not None:  # FlashMLA's own quantizer returns float8_e4m3fn; uint8 is accepted too
                tk = tk.view(f8)
            kw = {"attn_sink": torch.from_dlpack(sink)} if with_sink else {}
            meta, _ = fm.get_mla_metadata()
            f = lambda: fm.flash_mla_with_kvcache(tq, tk, None, None, D_V, meta, None, softmax_scale=SCALE,  # noqa: E731
                                                  is_fp8_kvcache=True, indices=tidx, **kw)
            hot, cold = timer.hot(f, True), timer.cold(f)
            o = f()[0]
            torch.cuda.synchronize()
            outs[name] = cp.from_dlpack(o.float().contiguous())
            record(name, hot, cold, qq.shape[2], "fp8")
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}

    if kind == "fp8":
        ours("gqadrv", q, k8, True)
        peer("flashmla", q)
        _diff(cp, res, outs, "gqadrv", "flashmla", "max_diff_vs_flashmla")
    elif kind == "h16":
        ours("gqadrv", q, k8, True)
        ours("gqadrv_pad64", q_pad, k8, True)
        peer("flashmla_pad64", q_pad)
        _diff(cp, res, outs, "gqadrv", "gqadrv_pad64", "max_diff_vs_gqadrv_pad64", heads=h_q)
        _diff(cp, res, outs, "gqadrv", "flashmla_pad64", "max_diff_vs_flashmla_pad64", heads=h_q)
    elif kind == "bf16":
        ours("gqadrv", q, k, False)
        ours("gqadrv_fp8", q, k8, True)
        _diff(cp, res, outs, "gqadrv_fp8", "gqadrv", "max_diff_vs_bf16_kv")
    elif kind == "sink":
        ours("gqadrv", q, k8, True, with_sink=True, with_len=True)
        ours("gqadrv_sink", q, k8, True, with_sink=True)
        ours("gqadrv_plain", q, k8, True)
        peer("flashmla_sink", q, with_sink=True)
        peer("flashmla", q)
        _diff(cp, res, outs, "gqadrv_sink", "flashmla_sink", "max_diff_vs_flashmla_sink")
        _diff(cp, res, outs, "gqadrv", "gqadrv_sink", "max_diff_vs_gqadrv_sink")
    outs.clear()
    return row


def _diff(cp, res: dict, outs: dict, a: str, b: str, key: str, heads: int | None = None) -> None:
    """res[a][key] = max |out_a - out_b| over the first ``heads`` heads (a sanity number, not a check)."""
    if a not in outs or b not in outs:
        return
    try:
        cp.cuda.Device().synchronize()
        x = outs[a].astype(cp.float32)
        y = outs[b].astype(cp.float32)
        if heads is not None:
            x, y = x[:, :, :heads], y[:, :, :heads]
        res[a][key] = float(cp.abs(x - y).max())
    except Exception as exc:  # noqa: BLE001
        res[a][key + "_error"] = repr(exc)[:200]


# ----------------------------------------------------------------------------- table
# (kind, name) -> (ratio(res, key), what the ratio is)
RATIOS = {
    ("fp8", "gqadrv"): (time_over("flashmla", "gqadrv"), "ours / FlashMLA (speed)"),
    ("h16", "gqadrv_pad64"): (time_over("gqadrv_pad64", "gqadrv"), "padded / ours (time)"),
    ("h16", "flashmla_pad64"): (time_over("flashmla_pad64", "gqadrv"), "padded / ours (time)"),
    ("bf16", "gqadrv_fp8"): (time_over("gqadrv", "gqadrv_fp8"), "fp8 / bf16 KV (speed)"),
    ("sink", "gqadrv"): (time_over("gqadrv", "gqadrv_plain"), "time / plain"),
    ("sink", "gqadrv_sink"): (time_over("gqadrv_sink", "gqadrv_plain"), "time / plain"),
    ("sink", "flashmla_sink"): (time_over("flashmla_sink", "flashmla"), "time / FlashMLA plain"),
}


def format_table(meta: dict, rows: list) -> str:
    out = [(f"GPU {meta.get('gpu')} (cc {meta.get('cc')}, {meta.get('sms')} SMs), streaming-read ceiling "
            f"{fmt(meta.get('ceiling_TBps'), '.2f')} TB/s; sparse MLA decode (V3.2, d_qk 576, d_v 512), bf16 q, indices "
            f"into a paged cache (page {PAGE} unless named); hot = per call in a graph of {meta.get('graph_calls')} "
            "calls, cold = L2 flushed; TFLOPS = 2·h_q·b·s_q·topk·1088 (h16 rows: the row's h_q, the useful heads, for "
            "every variant), TB/s = q + distinct KV tokens + out"),
           ("| row | impl | hot us | hot TFLOPS | hot TB/s | cold us | cold TFLOPS | ratio hot / cold | ratio is "
            "| max abs diff | route / splits |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r.get("results", {})
        kind = r.get("kind")
        for name in VARIANTS.get(kind, tuple(res)):
            if name not in res:
                continue
            v = res[name]
            label = LABELS.get((kind, name), name)
            if "error" in v:
                out.append(f"| {r['shape']} | {label} | error: {str(v['error'])[:120].replace('|', '/')} |")
                continue
            rh = rc = None
            what = "-"
            if (kind, name) in RATIOS:
                fn, what = RATIOS[(kind, name)]
                rh, rc = fn(res, "hot_us"), fn(res, "cold_us")
            ratio = f"{fmt(rh, '.2f')} / {fmt(rc, '.2f')}" if rh is not None or rc is not None else "-"
            diffs = [f"{k[len('max_diff_vs_'):]} {val:.2e}" for k, val in v.items()
                     if k.startswith("max_diff_vs_") and isinstance(val, float)]
            rt = f"{v['route']} / {v.get('num_splits')}" if v.get("route") is not None else "-"
            out.append(f"| {r['shape']} | {label} | {fmt(v.get('hot_us'), '.1f')} | {fmt(v.get('hot_TFLOPS'), '.0f')} | "
                       f"{fmt(v.get('hot_TBps'), '.2f')} | {fmt(v.get('cold_us'), '.1f')} | "
                       f"{fmt(v.get('cold_TFLOPS'), '.0f')} | {ratio} | {what if ratio != '-' else '-'} | "
                       f"{'; '.join(diffs) or '-'} | {rt} |")
    vers = meta.get("versions") or {}
    vtxt = ", ".join(f"{k} {v}" for k, v in vers.items())
    out += ["", (f"- {meta.get('gpu')} (cc {meta.get('cc')}, {meta.get('sms')} SMs); {vtxt}; {meta.get('date')}; "
                 f"`{meta.get('command')}`; indices {rows[0].get('indices', '?') if rows else '?'}")]
    return "\n".join(out + [""] + target_lines(rows))


# (text, row applies, value(res, key), value is good); a row meets a target when hot and cold do
TARGETS = (
    ("FP8 h_q 64 / 128: faster than FlashMLA (ours / FlashMLA speed >= 1)",
     lambda r: r.get("kind") == "fp8" and r.get("h_q") in (64, 128), time_over("flashmla", "gqadrv"), lambda x: x >= 1.0),
    ("FP8 h_q 128 s_q 2 topk 2048: >= 430 TFLOPS (ours TFLOPS / 430 >= 1; FlashMLA anchor 388)",
     lambda r: r.get("kind") == "fp8" and (r.get("h_q"), r.get("s_q"), r.get("topk")) == (128, 2, 2048),
     tflops_over(430.0), lambda x: x >= 1.0),
    ("FP8 h_q 128 s_q 2 topk 16384: >= 480 TFLOPS (ours TFLOPS / 480 >= 1; FlashMLA anchor 434)",
     lambda r: r.get("kind") == "fp8" and (r.get("h_q"), r.get("s_q"), r.get("topk")) == (128, 2, 16384),
     tflops_over(480.0), lambda x: x >= 1.0),
    ("h_q 16: the faster padded-to-64-heads form (FlashMLA or gqadrv) / ours >= 3.5 (time)",
     lambda r: r.get("kind") == "h16", time_over(("flashmla_pad64", "gqadrv_pad64"), "gqadrv"), lambda x: x >= 3.5),
)


def target_lines(rows: list) -> list[str]:
    return _target_lines(rows, TARGETS)


SPEC = BenchSpec(name="mla_sparse", add_arguments=_add_arguments, rows=_rows, run_row=_run_row,
                 format_table=format_table, import_peers=import_peers)
