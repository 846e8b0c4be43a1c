"""Sparse MLA prefill (DeepSeek V3.2 / MODEL1 top-k attention, FlashMLA's ``flash_mla_sparse_fwd``)
against DeepSeek's FlashMLA on the same data in the same process (``python -m gqadrv bench --op
mla_sparse_prefill``; run by ``ops.bench.run``).

Data per row (made on the GPU with CuPy): q bf16 ~ N(0, 1)/10 [s_q, h_q, d_qk]; kv bf16 ~ N(0, 1)/10
[s_kv, 1, d_qk]; indices int32 [s_q, 1, topk] = 64 random permutations of [0, s_kv) cut to topk,
repeated over the s_q query tokens (as shared/tools/peer_flashmla.py made them for the anchors; every
index valid); sm_scale d_qk^-0.5 (the speed does not depend on it); attn_sink (rows marked ``sink``)
fp32 [h_q] ~ N(0, 1). FlashMLA gets torch tensors made from the same CuPy arrays by DLPack. gqadrv is
timed through ``prepare_mla_sparse_fwd`` + ``launch_prepared``, FlashMLA through
``flash_mla_sparse_fwd(q, kv, indices, sm_scale, 512, attn_sink=...)``. Hot = per call in a CUDA
graph of ``--graph-calls`` calls (median of ``--reps`` replays), cold = L2 flushed before each call
(median). Every call of a row is prepared first; the row's first call then runs back to back for WARM_S
seconds, and all are timed ``--rounds`` times in an order that rotates by one each round (medians kept).

Rows (kind, s_q, h_q, d_qk, topk, s_kv, sink): ``peer`` (gqadrv vs FlashMLA, both with attn_sink):
V3.2 s_q 4096 h_q 128 d_qk 576 topk 2048 at s_kv 8K / 32K / 64K / 128K, MODEL1 h_q 64 d_qk 512 topk
512 at s_kv 8K / 32K (FlashMLA §5.4's performance grid is measured with attn_sink). If FlashMLA
fails with attn_sink, the error is recorded and both libraries are also timed without it (``plain``),
and FlashMLA / ours compares the plain pair. ``--mla-sparse-prefill-plain`` times the plain pair on
every sink row anyway (the ANCHORS.md FlashMLA numbers were measured without a sink). ``pad64``:
h_q 16 at d_qk 576 topk 2048 s_kv 32K, no sink: gqadrv at 16 heads vs the same work padded to 64
heads with zero queries (gqadrv and FlashMLA, which needs h_q % 64 == 0).

Formulas (FlashMLA's, shared/reference/flashmla.md §5.4): FLOPs = 2·s_q·topk·h_q·(d_qk + 512);
bytes = s_q·topk·d_qk·2 (every valid index read) + s_q·h_q·(d_qk + 512)·2 (q and out). The pad64
row's TFLOPS count the useful h_q heads for every variant (the padded ones execute 64 heads;
``exec_TFLOPS`` in the JSON); TB/s use the bytes each variant moves. Anchors on this H200
(shared/ANCHORS.md): FlashMLA 675 / 587 / 573 TFLOPS at s_kv 8K / 32K / 128K (V3.2, no sink); gqadrv
targets: faster than FlashMLA on every row, >= 660 TFLOPS at 32K and 128K, >= 3.5x the padded form at
h_q 16. Nothing here asserts a speed: the targets are reported.
"""

from __future__ import annotations

import argparse
import sys

from ..ops.bench import BenchSpec, Timer
from ..ops.bench import target_lines as _target_lines
from .bench import time_rounds
from .bench_peer import fmt, import_peers, tflops_over, time_over, us_of

__all__ = ["ROWS", "SPEC", "format_table", "parse_row", "prefill_bytes", "prefill_flops", "prefill_metrics",
           "target_lines"]

D_V = 512
D_QKS = (576, 512)
KINDS = ("peer", "pad64")
PAD_HEADS = 64   # FlashMLA's SM90 sparse prefill needs h_q % 64 == 0
PERMS = 64       # distinct index rows, repeated over the query tokens (peer_flashmla.py)
S_Q = 4096

# (kind, s_q, h_q, d_qk, topk, s_kv, sink)
ROWS = ([("peer", S_Q, 128, 576, 2048, s, True) for s in (8192, 32768, 65536, 131072)]
        + [("peer", S_Q, 64, 512, 512, s, True) for s in (8192, 32768)]
        + [("pad64", S_Q, 16, 576, 2048, 32768, False)])

# FlashMLA on this H200 (shared/ANCHORS.md, no sink): (s_q, h_q, d_qk, topk, s_kv) -> TFLOPS
ANCHORS = {(S_Q, 128, 576, 2048, 8192): 675.0, (S_Q, 128, 576, 2048, 32768): 587.0,
           (S_Q, 128, 576, 2048, 131072): 573.0}

# result names per kind, in table order; "gqadrv" is the row's subject (with the row's sink)
VARIANTS = {
    "peer": ("gqadrv", "flashmla", "gqadrv_plain", "flashmla_plain"),
    "pad64": ("gqadrv", "gqadrv_pad64", "flashmla_pad64"),
}


def _label_of(kind: str, name: str, sink: bool) -> str:
    s = " + sink" if sink else ""
    return {
        "gqadrv": f"gqadrv{s}" if kind == "peer" else f"gqadrv{s} (row's h_q)",
        "flashmla": f"FlashMLA{s}",
        "gqadrv_plain": "gqadrv plain (no sink)",
        "flashmla_plain": "FlashMLA plain (no sink)",
        "gqadrv_pad64": f"gqadrv{s} padded to h_q {PAD_HEADS}",
        "flashmla_pad64": f"FlashMLA{s} padded to h_q {PAD_HEADS}",
    }.get(name, name)


# ----------------------------------------------------------------------------- pure parts (CPU)
def prefill_flops(s_q: int, h_q: int, d_qk: int, topk: int) -> float:
    """FLOPs of one sparse prefill call (FlashMLA §5.4): 2·s_q·topk·h_q·(d_qk + 512)."""
    return 2.0 * s_q * topk * h_q * (d_qk + D_V)


def prefill_bytes(s_q: int, h_q: int, d_qk: int, topk: int) -> float:
    """Bytes of one call (FlashMLA §5.4): every valid index's KV row once per query token, q and out."""
    return 2.0 * s_q * topk * d_qk + 2.0 * s_q * h_q * (d_qk + D_V)


def prefill_metrics(s_q: int, h_q: int, d_qk: int, topk: int, us: float,
                    flops_h_q: int | None = None) -> tuple[float, float]:
    """(TFLOPS, TB/s) of one call of ``us`` microseconds at ``h_q`` executed heads; ``flops_h_q``:
    count the FLOPs of this many heads instead (the useful heads of a padded call)."""
    s = us * 1e-6
    return (prefill_flops(s_q, flops_h_q or h_q, d_qk, topk) / s / 1e12,
            prefill_bytes(s_q, h_q, d_qk, topk) / s / 1e12)


def parse_row(text: str) -> tuple:
    """'kind,s_q,h_q,d_qk,topk,s_kv[,sink|plain]' -> a row tuple (kind peer: sink by default, pad64:
    plain by default)."""
    parts = [t.strip() for t in text.split(",")]
    form = "'kind,s_q,h_q,d_qk,topk,s_kv[,sink|plain]'"
    if len(parts) not in (6, 7):
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: expected {form}")
    kind = parts[0]
    if kind not in KINDS:
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: kind must be one of {', '.join(KINDS)}")
    try:
        s_q, h_q, d_qk, topk, s_kv = (int(x) for x in parts[1:6])
    except ValueError:
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: s_q, h_q, d_qk, topk, s_kv must be integers") from None
    if min(s_q, h_q, topk, s_kv) < 1:
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: every size must be positive")
    if d_qk not in D_QKS:
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: d_qk must be 576 or 512")
    if h_q > (PAD_HEADS if kind == "pad64" else 128):
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: h_q must be <= "
                         f"{PAD_HEADS if kind == 'pad64' else 128} for kind {kind}")
    if topk > s_kv:
        raise ValueError(f"--mla-sparse-prefill-rows {text!r}: topk {topk} > s_kv {s_kv} (indices are "
                         "permutations of [0, s_kv))")
    sink = kind == "peer"
    if len(parts) == 7:
        if parts[6] not in ("sink", "plain"):
            raise ValueError(f"--mla-sparse-prefill-rows {text!r}: the last field must be 'sink' or 'plain'")
        sink = parts[6] == "sink"
    return (kind, s_q, h_q, d_qk, topk, s_kv, sink)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mla-sparse-prefill-rows", nargs="*", default=None, metavar="ROW",
                   help="--op mla_sparse_prefill rows 'kind,s_q,h_q,d_qk,topk,s_kv[,sink|plain]', kind peer "
                        "(vs FlashMLA; sink by default) or pad64 (vs the padded-to-64-heads forms; plain by "
                        "default) (default: the issue's table)")
    p.add_argument("--mla-sparse-prefill-backend", default=None,
                   help="--op mla_sparse_prefill: gqadrv backend (default: auto)")
    p.add_argument("--mla-sparse-prefill-also", nargs="*", default=[], metavar="BACKEND",
                   help="--op mla_sparse_prefill: also time gqadrv with these backends on every row, beside the "
                        "default (e.g. experiment builds under GQADRV_MLA_EXPERIMENTS=1; a seesaw_bal_cp_* name "
                        "stands for its seesaw_nope_bal_* twin on d_qk 512 rows; results 'gqadrv@NAME')")
    p.add_argument("--mla-sparse-prefill-plain", action="store_true",
                   help="--op mla_sparse_prefill: also time both libraries without attn_sink on sink rows (done "
                        "anyway where FlashMLA rejects the sink)")


def _rows(args) -> list:
    if getattr(args, "mla_sparse_prefill_rows", None):
        return [parse_row(t) for t in args.mla_sparse_prefill_rows]
    return list(ROWS)


def _label(item) -> str:
    kind, s_q, h_q, d_qk, topk, s_kv, sink = item
    return f"{kind} s_q{s_q} h_q{h_q} d{d_qk} topk{topk} s_kv{s_kv}" + (" sink" if sink else "")


# ----------------------------------------------------------------------------- GPU parts
def _indices(cp, rs, s_q: int, topk: int, s_kv: int):
    """int32 [s_q, 1, topk]: PERMS random permutations of [0, s_kv) cut to topk, repeated over the
    s_q query tokens (argsort of random keys, on the GPU)."""
    n = min(PERMS, s_q)
    keys = rs.random_sample((n, s_kv), dtype=cp.float32)
    perm = cp.argsort(keys, axis=1)[:, :topk].astype(cp.int32)
    del keys
    reps = -(-s_q // n)
    idx = cp.tile(perm, (reps, 1))[:s_q]
    return cp.ascontiguousarray(idx.reshape(s_q, 1, topk))


def _run_row(item, timer: Timer, args) -> dict:
    kind, s_q, h_q, d_qk, topk, s_kv, sink_on = item
    row = {"shape": _label(item), "kind": kind, "s_q": s_q, "h_q": h_q, "d_qk": d_qk, "topk": topk, "s_kv": s_kv,
           "sink": sink_on, "indices": f"{min(PERMS, s_q)} permutations of [0, s_kv) cut to topk, repeated",
           "flops": prefill_flops(s_q, h_q, d_qk, topk)}
    res: dict = {}
    row["results"] = res
    try:
        _measure(item, timer, args, row, res)
    except Exception as exc:  # noqa: BLE001  (data creation, e.g. out of memory: the row records it)
        res["gqadrv" if "gqadrv" not in res else "row"] = {"error": f"row setup: {exc!r}"[:300]}
    return row


def _measure(item, timer: Timer, args, row: dict, res: dict) -> None:
    import cupy as cp
    import ml_dtypes

    import gqadrv

    kind, s_q, h_q, d_qk, topk, s_kv, sink_on = item
    bf16 = ml_dtypes.bfloat16
    scale = d_qk ** -0.5
    rs = cp.random.RandomState(7)
    torch = sys.modules.get("torch")
    fm = None if getattr(args, "no_peers", False) else sys.modules.get("flash_mla")
    use_torch = torch is not None
    cur = (lambda: torch.cuda.current_stream()) if use_torch else (lambda: None)
    backend = getattr(args, "mla_sparse_prefill_backend", None)
    outs: dict = {}

    # data: q (and the zero-padded 64-head q of the pad64 row), kv, indices, sink
    kv = (rs.standard_normal((s_kv, 1, d_qk), dtype=cp.float32) / 10).astype(bf16)
    qf = rs.standard_normal((s_q, h_q, d_qk), dtype=cp.float32) / 10
    q = qf.astype(bf16)
    q_pad = None
    if kind == "pad64":
        qpf = cp.zeros((s_q, PAD_HEADS, d_qk), dtype=cp.float32)
        qpf[:, :h_q] = qf
        q_pad = qpf.astype(bf16)
        del qpf
    del qf
    idx = _indices(cp, rs, s_q, topk, s_kv)
    sink = rs.standard_normal((h_q,), dtype=cp.float32) if sink_on else None  # fp32 [h_q]
    sink_pad = None
    if sink_on and kind == "pad64":
        sink_pad = cp.zeros((PAD_HEADS,), dtype=cp.float32)
        sink_pad[:h_q] = sink
    cp.cuda.Device().synchronize()

    calls: dict = {}  # name -> (fn, uses a torch graph), timed together by time_rounds at the end
    heads_of: dict = {}  # name -> heads executed

    def register(name: str, fn, torch_graph: bool, heads: int, extra: dict | None = None) -> None:
        calls[name] = (fn, torch_graph)
        heads_of[name] = heads
        res[name] = dict(extra or {})

    def ours(name: str, qq, sk, use: str | None = backend) -> None:
        try:
            kw = {"attn_sink": sk, "stream": cur()}
            if use is not None:
                kw["backend"] = use
            p = gqadrv.prepare_mla_sparse_fwd(qq, kv, idx, scale, D_V, **kw)
            # the current stream at call time: a torch graph captures on its own side stream
            fn = lambda: gqadrv.launch_prepared(p, cur())
            o = fn()
            outs[name] = (o[0], o[2])  # out, lse
            register(name, fn, use_torch, qq.shape[1],
                     {"route": getattr(p, "route", None), "num_splits": getattr(p, "num_splits", None),
                      "workspace_bytes": getattr(p, "workspace_bytes", None)})
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}

    def peer(name: str, qq, sk) -> bool:
        """Register FlashMLA for timing; False when it raised (the error is recorded)."""
        if fm is None or not use_torch:
            why = "--no-peers" if getattr(args, "no_peers", False) else "flash_mla not importable"
            res[name] = {"error": why if use_torch else "torch not importable"}
            return False
        try:
            tq, tkv, tidx = torch.from_dlpack(qq), torch.from_dlpack(kv), torch.from_dlpack(idx)
            kw = {"attn_sink": torch.from_dlpack(sk)} if sk is not None else {}
            f = lambda: fm.flash_mla_sparse_fwd(tq, tkv, tidx, scale, D_V, **kw)
            o = f()
            torch.cuda.synchronize()
            outs[name] = (cp.from_dlpack(o[0].float().contiguous()), cp.from_dlpack(o[2].float().contiguous()))
            register(name, f, True, qq.shape[1])
            return True
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": repr(exc)[:300]}
            return False

    def also() -> None:
        """--mla-sparse-prefill-also: each extra backend on the row's q and sink, diffed against the default."""
        for name in getattr(args, "mla_sparse_prefill_also", None) or []:
            ours(f"gqadrv@{name}", q, sink, name)
            _diff(cp, res, outs, f"gqadrv@{name}", "gqadrv", "gqadrv")
            outs.pop(f"gqadrv@{name}", None)

    if kind == "peer":
        ours("gqadrv", q, sink)
        also()
        ok = peer("flashmla", q, sink)
        _diff(cp, res, outs, "gqadrv", "flashmla", "flashmla")
        if sink_on and (getattr(args, "mla_sparse_prefill_plain", False) or (fm is not None and use_torch and not ok)):
            if not ok:
                res["flashmla"]["note"] = "failed with attn_sink: both libraries also timed without it (plain rows)"
            ours("gqadrv_plain", q, None)
            peer("flashmla_plain", q, None)
            _diff(cp, res, outs, "gqadrv_plain", "flashmla_plain", "flashmla_plain")
            _diff(cp, res, outs, "gqadrv", "gqadrv_plain", "gqadrv_plain")
    elif kind == "pad64":
        ours("gqadrv", q, sink)
        also()
        ours("gqadrv_pad64", q_pad, sink_pad)
        peer("flashmla_pad64", q_pad, sink_pad)
        _diff(cp, res, outs, "gqadrv", "gqadrv_pad64", "gqadrv_pad64", heads=h_q)
        _diff(cp, res, outs, "gqadrv", "flashmla_pad64", "flashmla_pad64", heads=h_q)
    outs.clear()
    _time(calls, timer, args, res)
    for name, heads in heads_of.items():
        v = res.get(name, {})
        if "hot_us" not in v:
            continue
        for key in ("hot", "cold"):
            v[f"{key}_TFLOPS"], v[f"{key}_TBps"] = prefill_metrics(s_q, heads, d_qk, topk, v[f"{key}_us"], flops_h_q=h_q)
            if heads != h_q:
                v[f"{key}_exec_TFLOPS"] = prefill_metrics(s_q, heads, d_qk, topk, v[f"{key}_us"])[0]
        v["h_q_executed"] = heads


WARM_S = 0.2  # seconds of the row's first call before any timing (clocks up, caches and pools settled)


def _time(calls: dict, timer: Timer, args, res: dict) -> None:
    """Times the row's registered calls with ``time_rounds`` (``--rounds`` rounds, the order rotating by
    one each round, medians kept) after WARM_S of back-to-back calls of the first one: without the
    warm-up, whichever call ran first in a row measured up to 10 % slower than the same build later in
    the row (2026-12-06, H100)."""
    import time

    if not calls:
        return
    fn, torch_graph = next(iter(calls.values()))
    sync = (lambda: sys.modules["torch"].cuda.synchronize()) if torch_graph else timer.cp.cuda.Device().synchronize
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < WARM_S:
            for _ in range(4):
                fn()
            sync()
    except Exception:  # noqa: BLE001  (time_rounds records the error)
        pass
    time_rounds(calls, timer, max(1, int(getattr(args, "rounds", 1) or 1)), res)


def _diff(cp, res: dict, outs: dict, a: str, b: str, tag: str, heads: int | None = None) -> None:
    """res[a]['max_diff_vs_<tag>'] = max |out_a - out_b|, res[a]['max_lse_diff_vs_<tag>'] = max |lse_a -
    lse_b| over the first ``heads`` heads (sanity numbers, not checks)."""
    if a not in outs or b not in outs:
        return
    try:
        cp.cuda.Device().synchronize()
        for i, key in ((0, f"max_diff_vs_{tag}"), (1, f"max_lse_diff_vs_{tag}")):
            x = outs[a][i].astype(cp.float32)
            y = outs[b][i].astype(cp.float32)
            if heads is not None:
                x, y = x[:, :heads], y[:, :heads]
            res[a][key] = float(cp.abs(x - y).max())
            del x, y
    except Exception as exc:  # noqa: BLE001
        res[a][f"max_diff_vs_{tag}_error"] = repr(exc)[:200]


# ----------------------------------------------------------------------------- table
def _vs_flashmla(res: dict, key: str):
    """FlashMLA time / ours on a peer row: the row's pair (with its sink) when FlashMLA ran it, else the
    plain pair; None if neither pair is timed."""
    if us_of(res, "flashmla", key):
        return time_over("flashmla", "gqadrv")(res, key)
    return time_over("flashmla_plain", "gqadrv_plain")(res, key)


def _row_key(r: dict) -> tuple:
    return (r.get("s_q"), r.get("h_q"), r.get("d_qk"), r.get("topk"), r.get("s_kv"))


# (kind, name) -> (ratio(res, key), what the ratio is)
RATIOS = {
    ("peer", "gqadrv"): (time_over("flashmla", "gqadrv"), "FlashMLA / ours (time)"),
    ("peer", "gqadrv_plain"): (time_over("flashmla_plain", "gqadrv_plain"), "FlashMLA plain / ours plain (time)"),
    ("pad64", "gqadrv_pad64"): (time_over("gqadrv_pad64", "gqadrv"), "padded / ours (time)"),
    ("pad64", "flashmla_pad64"): (time_over("flashmla_pad64", "gqadrv"), "padded / ours (time)"),
}


def _ratio_of(kind: str, name: str):
    """The ratio of a table line: RATIOS, and for an extra backend 'gqadrv@NAME' its time / the default's."""
    if name.startswith("gqadrv@"):
        return time_over(name, "gqadrv"), "this build / default (time)"
    return RATIOS.get((kind, name))


def format_table(meta: dict, rows: list) -> str:
    out = [(f"GPU {meta.get('gpu')} (cc {meta.get('cc')}, {meta.get('sms')} SMs), streaming-read ceiling "
            f"{fmt(meta.get('ceiling_TBps'), '.2f')} TB/s; sparse MLA prefill (flash_mla_sparse_fwd, bf16 q and kv, "
            f"d_v {D_V}), indices {PERMS} permutations of [0, s_kv) cut to topk repeated over s_q; hot = per call in "
            f"a graph of {meta.get('graph_calls')} calls, cold = L2 flushed; TFLOPS = 2·s_q·topk·h_q·(d_qk + 512) "
            "(pad64 rows: the row's h_q, the useful heads, for every variant), TB/s = s_q·topk·d_qk·2 + "
            "s_q·h_q·(d_qk + 512)·2 (FlashMLA §5.4)"),
           ("| row | impl | hot us | hot TFLOPS | hot TB/s | cold us | cold TFLOPS | ratio hot / cold | ratio is "
            "| max abs diff (out; lse) | route / splits |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r.get("results", {})
        kind = r.get("kind")
        names = list(VARIANTS.get(kind, ())) + [n for n in res if n not in VARIANTS.get(kind, ())]
        for name in names:
            if name not in res:
                continue
            v = res[name]
            label = _label_of(kind, name, bool(r.get("sink")) and not name.endswith("_plain"))
            if "error" in v:
                out.append(f"| {r['shape']} | {label} | error: {str(v['error'])[:120].replace('|', '/')} |")
                continue
            rh = rc = None
            what = "-"
            ratio_fn = _ratio_of(kind, name)
            if ratio_fn is not None:
                fn, what = ratio_fn
                rh, rc = fn(res, "hot_us"), fn(res, "cold_us")
            ratio = f"{fmt(rh, '.2f')} / {fmt(rc, '.2f')}" if rh is not None or rc is not None else "-"
            diffs = []
            for k, val in v.items():
                if k.startswith("max_diff_vs_") and isinstance(val, float):
                    tag = k[len("max_diff_vs_"):]
                    lse = v.get(f"max_lse_diff_vs_{tag}")
                    diffs.append(f"{tag} {val:.2e}; {fmt(lse, '.2e')}")
            rt = f"{v['route']} / {v.get('num_splits')}" if v.get("route") is not None else "-"
            out.append(f"| {r['shape']} | {label} | {fmt(v.get('hot_us'), '.1f')} | {fmt(v.get('hot_TFLOPS'), '.0f')} | "
                       f"{fmt(v.get('hot_TBps'), '.2f')} | {fmt(v.get('cold_us'), '.1f')} | "
                       f"{fmt(v.get('cold_TFLOPS'), '.0f')} | {ratio} | {what if ratio != '-' else '-'} | "
                       f"{' / '.join(diffs) or '-'} | {rt} |")
    vers = meta.get("versions") or {}
    vtxt = ", ".join(f"{k} {v}" for k, v in vers.items())
    out += ["", (f"- {meta.get('gpu')} (cc {meta.get('cc')}, {meta.get('sms')} SMs); {vtxt}; {meta.get('date')}; "
                 f"`{meta.get('command')}`; sm_scale d_qk^-0.5; attn_sink fp32 [h_q] ~ N(0, 1) on sink rows")]
    notes = [f"- {r['shape']}: FlashMLA {v['note']}" for r in rows
             for n, v in r.get("results", {}).items() if n == "flashmla" and v.get("note")]
    return "\n".join(out + notes + [""] + target_lines(rows))


def _anchor_target(s_kv: int, anchor: float) -> tuple:
    key = (S_Q, 128, 576, 2048, s_kv)
    text = (f"V3.2 s_kv {s_kv // 1024}K: above FlashMLA's ANCHORS.md {anchor:.0f} TFLOPS on this H200 (ours TFLOPS / "
            f"{anchor:.0f} >= 1; the anchor has no sink, ours is the row's)")
    return (text, lambda r: r.get("kind") == "peer" and _row_key(r) == key, tflops_over(anchor), lambda x: x >= 1.0)


V32_660 = ((S_Q, 128, 576, 2048, 32768), (S_Q, 128, 576, 2048, 131072))

# (text, row applies, value(res, key), value is good); a row meets a target when hot and cold do
TARGETS = (
    (("every peer row: faster than FlashMLA (FlashMLA / ours time >= 1; the plain pair where FlashMLA rejects "
      "attn_sink)"), lambda r: r.get("kind") == "peer", _vs_flashmla, lambda x: x >= 1.0),
    (("V3.2 s_q 4096 h_q 128 topk 2048 s_kv 32K and 128K: >= 660 TFLOPS (ours TFLOPS / 660 >= 1; FlashMLA anchor "
      "587 / 573)"),
     lambda r: r.get("kind") == "peer" and _row_key(r) in V32_660, tflops_over(660.0), lambda x: x >= 1.0),
    *(_anchor_target(s, a) for (_, _, _, _, s), a in ANCHORS.items()),
    (f"pad64 (h_q 16): the faster padded-to-{PAD_HEADS}-heads form (FlashMLA or gqadrv) / ours >= 3.5 (time)",
     lambda r: r.get("kind") == "pad64", time_over(("flashmla_pad64", "gqadrv_pad64"), "gqadrv"), lambda x: x >= 3.5),
)


def target_lines(rows: list) -> list[str]:
    return _target_lines(rows, TARGETS)


SPEC = BenchSpec(name="mla_sparse_prefill", add_arguments=_add_arguments, rows=_rows, run_row=_run_row,
                 format_table=format_table, import_peers=import_peers)
