"""Development timing of the paged GQA decode routes under tuning switches (not a test, not the bench):

    python tools/paged_tune.py [--rows B,L,PAGE,LAYOUT[,TABLE_TOKENS] ...] [--configs NAME ...] [--reps 10]

Each config is a set of environment switches (they are part of the route key, so every config gets
its own module) plus an optional backend; each row is fp16, Hq 32, Hkv 8, D 128, every request at its
full length L, pages of one pool in random order; TABLE_TOKENS (default L) makes the block table that
many tokens wide (a table sized for a longer context than served). Prints hot (CUDA graph of 20
calls) / cold (L2 flushed) µs per config and row, and checks every config's output against the
default config's.

Configs: default, cp (backend 'portable': the cp.async kernel), plain (GQADRV_PAGED_COPY=plain: the
cp.async kernel's per-chunk copy, the default before 2026-12-06), tma2 (GQADRV_TILING=4,32,2 on the TMA
route), tma8 (8,32,1), det (deterministic=True), detall (deterministic=True with GQADRV_PAGED_DET_EXIT=0:
every split takes part in the ticket, the default before 2026-12-06), ticket (GQADRV_CLUSTER_MERGE=0: the
split merge through the workspace and the ticket, never in clusters), nospec (GQADRV_PAGED_SPEC=0: the TMA
kernel reads the length, then the table, then loads, as before 2026-12-07), detnospec (both);
next / next1 (GQADRV_PAGED_NEXT=3 / 1: in launches of several waves the TMA kernel's warps prefetch the first
3 / 1 sub-tiles of their successor CTA into L2 while their own rings drain, decode_paged_tma.cu);
multi / multi2 / multi4 (GQADRV_PAGED_MULTI=1 / 2 / 4: one-split launches of several waves on CTAs that each walk
several units with their warps' rings running on across them: the resident CTAs, or 2 / 4 units per CTA);
tma / tmamulti2 (backend "hopper": the TMA kernel also where the large-batch rule takes the cp.async one; without /
with GQADRV_PAGED_MULTI=2);
tiling=W,T,S (GQADRV_TILING=W,T,S on the TMA route: any warps x tokens x stages, e.g. tiling=8,16,2).
Any config name may end in ``:sN`` to force N splits (``num_splits=N``), e.g. ``tiling=4,32,3:s2``.

``--kv-dtype e4m3`` runs every row on FP8-e4m3 K / V codes (``quantize_kv_fp8`` of the fp16 caches, one
per-tensor scale each, as ``bench --op gqa_fp8``); the TMA route then takes the e4m3 tilings
(routes._TILINGS_E4M3) unless a config names one.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {  # name: (environment, backend, deterministic)
    "default": ({}, None, False),
    "cp": ({}, "portable", False),
    "plain": ({"GQADRV_PAGED_COPY": "plain"}, "portable", False),
    "tma2": ({"GQADRV_TILING": "4,32,2"}, "hopper", False),
    "tma8": ({"GQADRV_TILING": "8,32,1"}, "hopper", False),
    "det": ({}, None, True),
    "detall": ({"GQADRV_PAGED_DET_EXIT": "0"}, None, True),
    "ticket": ({"GQADRV_CLUSTER_MERGE": "0"}, None, False),
    "nospec": ({"GQADRV_PAGED_SPEC": "0"}, None, False),
    "next": ({"GQADRV_PAGED_NEXT": "3"}, None, False),
    "next1": ({"GQADRV_PAGED_NEXT": "1"}, None, False),
    "multi": ({"GQADRV_PAGED_MULTI": "1"}, None, False),
    "multi2": ({"GQADRV_PAGED_MULTI": "2"}, None, False),
    "multi4": ({"GQADRV_PAGED_MULTI": "4"}, None, False),
    "tma": ({}, "hopper", False),
    "tmamulti2": ({"GQADRV_PAGED_MULTI": "2"}, "hopper", False),
    "detnospec": ({"GQADRV_PAGED_SPEC": "0"}, None, True),
}
ROWS = ("16,4096,16,NHD", "64,4096,16,NHD", "64,4096,16,HND", "64,4096,1,NHD", "1,32768,16,NHD", "128,8192,16,NHD",
        "16,4096,16,NHD,131072")


def _tiling_config(name: str):
    """The config of ``tiling=W,T,S`` (the TMA route with that tiling), or None."""
    m = re.fullmatch(r"tiling=(\d+),(\d+),(\d+)", name)
    return ({"GQADRV_TILING": ",".join(m.groups())}, "hopper", False) if m else None


def _config(name: str):
    """(environment, backend, deterministic, num_splits) of a config name (``NAME[:sN]``), or None."""
    base, sep, tail = name.partition(":")
    splits = None
    if sep:
        m = re.fullmatch(r"s(\d+)", tail)
        if not m:
            return None
        splits = int(m.group(1))
    conf = CONFIGS.get(base) or _tiling_config(base)
    return None if conf is None else (*conf, splits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), help="B,L,PAGE,LAYOUT")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS),
                    help=f"{', '.join(CONFIGS)} or tiling=W,T,S; any of them :sN (N splits)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kv-dtype", choices=("float16", "e4m3"), default="float16",
                    help="the caches' element type: fp16, or FP8-e4m3 codes with per-tensor scales")
    a = ap.parse_args()
    for name in a.configs:
        if _config(name) is None:
            ap.error(f"unknown config {name!r}")
    import cupy as cp
    import numpy as np

    import gqadrv
    from gqadrv.ops.bench import Timer

    timer = Timer(20, a.reps)
    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    print("row | " + " | ".join(f"{c} hot / cold us" for c in a.configs))
    bad = 0
    for spec in a.rows:
        parts = spec.split(",")
        b, length, page, layout = int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
        table_tokens = int(parts[4]) if len(parts) > 4 else length
        mp = -(-length // page)
        width = max(mp, -(-table_tokens // page))
        shape = (b * mp, page, hkv, d) if layout == "NHD" else (b * mp, hkv, page, d)
        k = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        table = cp.full((b, width), 2147480000, cp.int32)   # entries past the pages: never read
        table[:, :mp] = cp.asarray(rng.permutation(b * mp).astype(np.int32).reshape(b, mp))
        lens = cp.full(b, length, cp.int32)
        q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
        kv_args = {}
        if a.kv_dtype == "e4m3":
            (k, ks), (v, vs) = gqadrv.quantize_kv_fp8(k), gqadrv.quantize_kv_fp8(v)
            kv_args = {"kv_dtype": "e4m3", "k_scale": float(ks.get()), "v_scale": float(vs.get())}
        cells, ref = [], None
        for name in a.configs:
            env, backend, det, splits = _config(name)
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                out = cp.empty_like(q)
                p = gqadrv.prepare_gqa_decode_paged(q=q, k_cache=k, v_cache=v, block_table=table, seq_lens=lens,
                                                    out=out, kv_layout=layout, backend=backend, deterministic=det,
                                                    num_splits=splits, **kv_args)
                fn = lambda: gqadrv.launch_prepared(p, cp.cuda.get_current_stream().ptr)  # noqa: E731
                hot, cold = timer.hot(fn, False), timer.cold(fn)
                got = cp.asnumpy(out.astype(cp.float32))
                if ref is None:
                    ref = got
                diff = float(np.abs(got - ref).max())
                bad += diff > 2e-3
                cells.append(f"{hot:.2f} / {cold:.2f} ({p.route} / {p.num_splits}, diff {diff:.0e})")
            except Exception as exc:  # noqa: BLE001 - a config a GPU cannot run is reported, not fatal
                cells.append(f"error: {str(exc).splitlines()[0][:60]}")
            finally:
                for key, val in saved.items():
                    if val is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = val
        print(f"{spec} | " + " | ".join(cells), flush=True)
        del k, v
        cp.get_default_memory_pool().free_all_blocks()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
