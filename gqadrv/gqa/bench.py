"""GQA decode bench spec (run by ``ops.bench.run``): bandwidth ceiling, gqadrv and peers, in one process.

    python -m gqadrv bench [--op gqa] [--shapes ...] [--json out.json] [--no-peers] [--sweep-splits 1,2,4,...]

For every shape the same tensors feed gqadrv (prepared launch), FlashInfer batch decode with and
without tensor cores (paged copy of the same KV, page 16) and torch SDPA with a length mask, when
they import. Columns:
  hot   per call inside a CUDA graph of N back-to-back calls (median of replays)
  cold  one call with L2 flushed before it, event-timed around the Python call (median)
  TB/s  valid K+V bytes / hot time; %ceil against the streaming-read ceiling measured in this run
  xpeer best peer hot time / gqadrv hot time (> 1: gqadrv faster); xcold the same for cold
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..ops.bench import BenchSpec, Timer, best_peer_times, row_results, log, speedup_cell

SEED_SHAPES = ["1,64,[1]", "4,256,[64;127;191;256]", "1,1024,[1024]", "1,4096,[3968]"]
LARGE_SHAPES = ["1,32768", "16,4096", "64,4096", "128,8192", "256,2048"]
GEOMETRY_SHAPES = [  # bf16 and other group sizes / head dims
    "16,4096,32,8,128,bfloat16", "16,4096,8,8,128", "16,4096,64,8,128", "16,4096,128,8,128",
    "16,4096,8,8,256", "16,4096,64,8,256", "16,4096,128,8,256",
]


@dataclasses.dataclass
class Shape:
    batch: int
    capacity: int
    lengths: list
    hq: int = 32
    hkv: int = 8
    d: int = 128
    dtype: str = "float16"

    @property
    def label(self) -> str:
        s = f"B{self.batch} C{self.capacity}"
        if any(x != self.capacity for x in self.lengths):
            s += " L" + ("[" + ",".join(map(str, self.lengths)) + "]" if len(self.lengths) <= 4 else "var")
        if (self.hq, self.hkv, self.d) != (32, 8, 128):
            s += f" {self.hq}/{self.hkv}/d{self.d}"
        if self.dtype != "float16":
            s += " " + {"bfloat16": "bf16"}.get(self.dtype, self.dtype)
        return s

    def kv_bytes(self) -> int:
        return sum(self.lengths) * 2 * self.hkv * self.d * 2


def parse_shape(text: str) -> Shape:
    """'B,C[,Hq,Hkv,D,dtype]' with C optionally followed by ',[l1;l2;...]' valid lengths (one per
    request). ValueError with the offending text for anything else."""
    parts = [p.strip() for p in text.split(",")]
    form = "expected 'B,C[,[l1;l2;...]][,Hq,Hkv,D[,dtype]]'"
    try:
        b, c = int(parts[0]), int(parts[1])
        rest = parts[2:]
        lengths = [c] * b
        if rest and rest[0].startswith("["):
            lengths = [int(x) for x in rest[0].strip("[]").split(";")]
            rest = rest[1:]
        geometry = [int(x) for x in rest[:3]]
    except (IndexError, ValueError):
        raise ValueError(f"shape {text!r}: {form}") from None
    if len(rest) not in (0, 3, 4):
        raise ValueError(f"shape {text!r}: {form} (a lengths list is written in brackets, e.g. '1,64,[1]')")
    if b < 1 or c < 1 or any(x < 1 for x in geometry):
        raise ValueError(f"shape {text!r}: batch, capacity and head counts / head dim must be positive")
    if len(lengths) != b:
        raise ValueError(f"shape {text!r}: {len(lengths)} lengths for batch {b}")
    if any(not 0 <= n <= c for n in lengths):
        raise ValueError(f"shape {text!r}: every length must lie in [0, {c}] (the capacity)")
    if len(rest) > 3 and rest[3] not in ("float16", "bfloat16"):
        raise ValueError(f"shape {text!r}: dtype {rest[3]!r}, expected float16 or bfloat16")
    s = Shape(b, c, lengths)
    if rest:
        s.hq, s.hkv, s.d = geometry
        if len(rest) > 3:
            s.dtype = rest[3]
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="*", default=None, help="extra shapes 'B,C[,[l1;l2]][,Hq,Hkv,D,dtype]'")
    p.add_argument("--only", nargs="*", default=None, help="run only these shapes (same syntax)")
    p.add_argument("--no-peers", action="store_true", help="skip FlashInfer and torch SDPA")
    p.add_argument("--no-geometry", action="store_true", help="skip the bf16 / group / head-dim rows")
    p.add_argument("--sweep-splits", default=None, help="comma list: also time gqadrv with these num_splits")
    p.add_argument("--backend", default=None, help="gqadrv backend: auto, hopper, portable")
    p.add_argument("--portable", action="store_true", help="also time the portable (sm_80) route on every shape")


def make_inputs(shape: Shape, seed: int):
    """CuPy q, kv, lengths of a bench shape (public: benchmarks/ and tools/ use it)."""
    import cupy as cp

    rs = cp.random.RandomState(seed)
    dt = cp.float16
    q = rs.standard_normal((shape.batch, shape.hq, shape.d), dtype=cp.float32)
    kv = rs.standard_normal((shape.batch, 2, shape.hkv, shape.capacity, shape.d), dtype=cp.float32)
    if shape.dtype == "bfloat16":
        import ml_dtypes

        q, kv = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
    else:
        q, kv = q.astype(dt), kv.astype(dt)
    lens = cp.asarray(shape.lengths, dtype=cp.int32)
    return q, kv, lens


def _peers(shape: Shape, q, kv, lens, timer: Timer, results: dict) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    import torch.nn.functional as F

    tq, tkv, tl = torch.from_dlpack(q), torch.from_dlpack(kv), torch.from_dlpack(lens)
    cap = shape.capacity
    mask = (torch.arange(cap, device=tq.device)[None, :] < tl[:, None])[:, None, None, :]

    def sdpa():
        return F.scaled_dot_product_attention(tq[:, :, None, :], tkv[:, 0], tkv[:, 1], attn_mask=mask, enable_gqa=True)

    try:
        results["torch_sdpa"] = {"hot_us": timer.hot(sdpa, True), "cold_us": timer.cold(sdpa)}
    except Exception as exc:  # noqa: BLE001
        results["torch_sdpa"] = {"error": repr(exc)[:300]}
    fi = sys.modules.get("flashinfer")
    if fi is None:
        return
    try:
        import itertools

        page = 16
        pages_per = -(-cap // page)
        pad = pages_per * page - cap
        src = tkv if pad == 0 else F.pad(tkv, (0, 0, 0, pad))
        kvp = (src.permute(0, 3, 1, 2, 4).reshape(shape.batch, pages_per, page, 2, shape.hkv, shape.d)
               .permute(0, 1, 3, 2, 4, 5).reshape(shape.batch * pages_per, 2, page, shape.hkv, shape.d).contiguous())
        used = [-(-ln // page) for ln in shape.lengths]
        indptr = torch.tensor([0] + list(itertools.accumulate(used)), dtype=torch.int32, device=tq.device)
        indices = torch.cat([torch.arange(i * pages_per, i * pages_per + u, dtype=torch.int32) for i, u in enumerate(used)]).to(tq.device)
        last = torch.tensor([ln - (u - 1) * page for ln, u in zip(shape.lengths, used)], dtype=torch.int32, device=tq.device)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=tq.device)
        for tc in (False, True):
            name = "flashinfer_tc" if tc else "flashinfer"
            try:
                w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                w.plan(indptr, indices, last, shape.hq, shape.hkv, shape.d, page, pos_encoding_mode="NONE",
                       q_data_type=tq.dtype, kv_data_type=tq.dtype)
                fn = lambda: w.run(tq, kvp)  # noqa: E731
                results[name] = {"hot_us": timer.hot(fn, True), "cold_us": timer.cold(fn)}
            except Exception as exc:  # noqa: BLE001
                results[name] = {"error": repr(exc)[:300]}
        del kvp
    except Exception as exc:  # noqa: BLE001
        results["flashinfer"] = {"error": repr(exc)[:300]}


def _gqadrv_runs(shape: Shape, q, kv, lens, timer: Timer, splits_list, backend, results: dict) -> None:
    import cupy as cp

    import gqadrv
    from .reference import gqa_decode_reference

    torch = sys.modules.get("torch")
    use_torch = torch is not None
    for ns in splits_list:
        key = "gqadrv" if ns is None else f"gqadrv_s{ns}"
        try:
            o = cp.empty_like(q)
            stream = torch.cuda.current_stream() if use_torch else None
            p = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, num_splits=ns,
                                          backend=backend, stream=stream)

            def fn(p=p):
                gqadrv.launch_prepared(p, torch.cuda.current_stream() if use_torch else None)

            fn()
            cp.cuda.Device().synchronize()
            got = cp.asnumpy(o).astype("float64")
            if ns is None and kv.size <= (64 << 20):
                ref = gqa_decode_reference(cp.asnumpy(q).astype("float64"), cp.asnumpy(kv).astype("float64"),
                                           cp.asnumpy(lens))
                err = float(abs(got - ref).max())
            else:
                err = None
            results[key] = {"hot_us": timer.hot(fn, use_torch), "cold_us": timer.cold(fn), "route": p.route,
                            "num_splits": p.num_splits, "max_err": err}
        except Exception as exc:  # noqa: BLE001
            results[key] = {"error": repr(exc)[:400]}


def _import_peers(args) -> None:
    try:  # optional peers: torch first (SDPA and FlashInfer need it)
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    if not args.no_peers:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            log(f"[bench] FlashInfer not available: {type(exc).__name__}: {str(exc)[:120]}")


def _rows(args) -> list:
    if args.only:
        shapes = [parse_shape(s) for s in args.only]
        peer_rows = {sh.label for sh in shapes}
    else:
        shapes = [parse_shape(s) for s in SEED_SHAPES + LARGE_SHAPES]
        peer_rows = {sh.label for sh in shapes}
        if not args.no_geometry:  # gqadrv only: each would make FlashInfer JIT-compile another module
            shapes += [parse_shape(s) for s in GEOMETRY_SHAPES]
        extra = [parse_shape(s) for s in (args.shapes or [])]
        peer_rows |= {sh.label for sh in extra}
        shapes += extra
    return [(i, sh, sh.label in peer_rows) for i, sh in enumerate(shapes)]


def _run_row(item, timer: Timer, args) -> dict:
    i, shape, with_peers = item
    splits_list = [None] + ([int(x) for x in args.sweep_splits.split(",")] if args.sweep_splits else [])
    q, kv, lens = make_inputs(shape, 1234 + i)
    res: dict = {}
    _gqadrv_runs(shape, q, kv, lens, timer, splits_list, args.backend, res)
    if args.portable:
        port: dict = {}
        _gqadrv_runs(shape, q, kv, lens, timer, [None], "portable", port)
        res["gqadrv_portable"] = port["gqadrv"]
    if not args.no_peers and with_peers:
        _peers(shape, q, kv, lens, timer, res)
    del q, kv, lens
    return {"shape": shape.label, "batch": shape.batch, "capacity": shape.capacity, "lengths": shape.lengths,
            "hq": shape.hq, "hkv": shape.hkv, "d": shape.d, "dtype": shape.dtype, "kv_bytes": shape.kv_bytes(),
            "results": res}


def format_table(meta: dict, rows: list) -> str:
    ceil = meta["ceiling_TBps"]
    out = [f"GPU {meta['gpu']} (cc {meta['cc']}, {meta['sms']} SMs), streaming-read ceiling {ceil:.2f} TB/s, "
           f"hot = per call in a graph of {meta['graph_calls']} calls, cold = L2 flushed single call",
           "| shape | gqadrv hot us | cold us | TB/s | % ceil | FlashInfer hot | FI tc hot | SDPA hot | best peer cold | x hot | x cold | route / splits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res, g, error_line = row_results(r)
        if error_line is not None:
            out.append(error_line)
            continue
        tbps = r["kv_bytes"] / (g["hot_us"] * 1e-6) / 1e12
        best_hot, best_cold = best_peer_times(res)

        def cell(name):
            v = res.get(name, {})
            return f"{v['hot_us']:.2f}" if "hot_us" in v else "-"

        bc = f"{best_cold:.2f}" if best_cold else "-"
        xh, xc = speedup_cell(best_hot, g["hot_us"]), speedup_cell(best_cold, g["cold_us"])
        out.append(f"| {r['shape']} | {g['hot_us']:.2f} | {g['cold_us']:.2f} | {tbps:.2f} | {100 * tbps / ceil:.1f} | "
                   f"{cell('flashinfer')} | {cell('flashinfer_tc')} | {cell('torch_sdpa')} | {bc} | {xh} | {xc} | "
                   f"{g['route']} / {g['num_splits']} |")
        pt = res.get("gqadrv_portable", {})
        if "hot_us" in pt:
            ptb = r["kv_bytes"] / (pt["hot_us"] * 1e-6) / 1e12
            xh_p, xc_p = speedup_cell(best_hot, pt["hot_us"]), speedup_cell(best_cold, pt["cold_us"])
            out.append(f"|   portable | {pt['hot_us']:.2f} | {pt['cold_us']:.2f} | {ptb:.2f} | {100 * ptb / ceil:.1f} | | | | | "
                       f"{xh_p} | {xc_p} | {pt['route']} / {pt['num_splits']} |")
        for k, v in res.items():
            if k.startswith("gqadrv_s") and "hot_us" in v:
                out.append(f"|   {k} | {v['hot_us']:.2f} | {v['cold_us']:.2f} | {r['kv_bytes'] / (v['hot_us'] * 1e-6) / 1e12:.2f} | | | | | | | | {v['num_splits']} |")
    return "\n".join(out)


SPEC = BenchSpec(name="gqa", add_arguments=add_arguments, rows=_rows, run_row=_run_row, format_table=format_table,
                 import_peers=_import_peers)
