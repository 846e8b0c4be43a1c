"""Host cost of gqadrv's launch paths per framework (CuPy, torch, JAX: each when importable and
on the GPU), B1 Hq32 Hkv8 D128 C1024 fp16 unless told otherwise:

* exact replay: the same tensors every call (output allocated / given);
* same layout, new pointers: a pool of ``--pool`` pre-allocated tensor sets (q, kv, lengths[, out])
  cycled through, so every call sees other addresses than the call before (allocation is not timed);
* first call of a new layout: ``--layouts`` pre-allocated sets of distinct capacities, each called
  once after warm-up (kernels loaded), each call timed on its own (median): members of the layout
  family of the warm-up calls (gqa/layout_family.py); the first call after forgetting the layout
  plans (``api._layouts.clear()``, same tensors: routes and tensor maps warm; a family member
  again), and after forgetting the families too (the full path: validation and building), also
  timed per call;
* ``launch_prepared(p)`` (CuPy and torch; JAX outputs cannot be written in place);
* JAX only: a jitted ``gqadrv.jax.gqa_decode`` over the pool (XLA dispatch + the callback, whose XLA
  buffers take the layout plans), and a jitted trivial op on the same arrays (XLA's dispatch alone).
* MLA dense decode (``flash_mla_with_kvcache``, b ``--batch``, s_q 1, h_q ``--mla-heads``, page 64,
  ``--mla-len`` tokens): new pointers with out / lse allocated and given, the first call after
  forgetting the MLA layout plans, and for JAX the jitted ``gqadrv.jax.flash_mla_with_kvcache``.

Medians of ``--rounds`` x ``--calls`` calls (per-call timings for the first-call rows). Prints a
markdown table (rows: paths, columns: frameworks, microseconds per call) and with ``--json FILE``
writes the numbers (schema ``gqadrv.profile_convenience/1``).

    python tools/profile_convenience.py [--frameworks cupy,torch,jax] [--json out.json] [--label TEXT]
                                        [--pool 8] [--layouts 64] [--calls 1000] [--rounds 5] [--profile]

Older gqadrv versions (no ``sm_scale``, no ``api._layouts``) are measured too where they have the
call: rows they cannot run print "-". Run a baseline checkout with PYTHONPATH=... in the same GPU
session to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CASES = [
    ("replay_alloc", "exact replay, out allocated"),
    ("replay_out", "exact replay, out given"),
    ("newptr_alloc", "same layout, new pointers, out allocated"),
    ("newptr_out", "same layout, new pointers, out given"),
    ("first_layout", "first call of a new layout (new shapes)"),
    ("first_after_clear", "first call after clearing the layout plans (same tensors)"),
    ("first_new_family", "first call after clearing the layout plans and families (same tensors)"),
    ("launch_prepared", "launch_prepared(p)"),
    ("jit_call", "jax.jit(gqadrv.jax.gqa_decode), new arrays every call"),
    ("jit_baseline", "jax.jit(lambda q, kv, lens: q * 1) (XLA dispatch alone)"),
    ("mla_newptr_alloc", "MLA flash_mla_with_kvcache, same layout, new pointers, out / lse allocated"),
    ("mla_newptr_out", "MLA flash_mla_with_kvcache, same layout, new pointers, out / lse given"),
    ("mla_first_after_clear", "MLA first call after clearing the layout plans (same tensors)"),
    ("mla_jit_call", "MLA jax.jit(gqadrv.jax.flash_mla_with_kvcache), new arrays every call"),
]


# ----------------------------------------------------------------------------- frameworks
class Fw:
    """Allocation and synchronisation for one framework."""

    name = ""

    def zeros(self, shape, dtype):
        raise NotImplementedError

    def lens(self, B, C):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class CupyFw(Fw):
    name = "cupy"

    def __init__(self):
        import cupy as cp

        self.cp = cp

    def zeros(self, shape, dtype="float16"):
        if dtype == "bfloat16":
            import ml_dtypes

            return self.cp.zeros(shape, ml_dtypes.bfloat16)
        return self.cp.zeros(shape, dtype)

    def lens(self, B, C):
        return self.cp.full(B, C, self.cp.int32)

    def sync(self):
        self.cp.cuda.Device().synchronize()


class TorchFw(Fw):
    name = "torch"

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        self.torch = torch

    def zeros(self, shape, dtype="float16"):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype), device="cuda")

    def lens(self, B, C):
        return self.torch.full((B,), C, dtype=self.torch.int32, device="cuda")

    def sync(self):
        self.torch.cuda.synchronize()


class JaxFw(Fw):
    name = "jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp

        if not any(d.platform == "gpu" for d in jax.devices()):
            raise RuntimeError("JAX has no GPU backend")
        self.jnp = jnp

    def zeros(self, shape, dtype="float16"):
        return self.jnp.zeros(shape, getattr(self.jnp, dtype)).block_until_ready()

    def lens(self, B, C):
        return self.jnp.full((B,), C, self.jnp.int32).block_until_ready()

    def sync(self):
        import cupy as cp

        cp.cuda.Device().synchronize()


FRAMEWORKS = {"cupy": CupyFw, "torch": TorchFw, "jax": JaxFw}


# ----------------------------------------------------------------------------- timing
def _median_loop(fn, calls: int, rounds: int, sync) -> tuple[float, list[float]]:
    per = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / calls)
    sync()
    return statistics.median(per), per


def _median_cycle(fn, argsets: list, calls: int, rounds: int, sync) -> tuple[float, list[float]]:
    """``fn(*argsets[i % len])`` for i < calls: the argument list is built before the clock starts."""
    seq = [argsets[i % len(argsets)] for i in range(calls)]
    per = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for a in seq:
            fn(*a)
        per.append((time.perf_counter() - t0) * 1e6 / calls)
    sync()
    return statistics.median(per), per


def _median_each(fns: list, sync, before=None) -> tuple[float, list[float]]:
    """Each fn timed on its own (``before()`` untimed ahead of each); the median of those times."""
    times = []
    for fn in fns:
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times), [min(times), max(times)]


def measure(fw: Fw, a, gqadrv) -> dict:
    B, Hq, Hkv, C, D = a.batch, a.hq, a.hkv, a.capacity, a.head_dim
    dec = gqadrv.gqa_decode
    mutable = fw.name != "jax"
    q, kv, lens = fw.zeros((B, Hq, D)), fw.zeros((B, 2, Hkv, C, D)), fw.lens(B, C)
    o = fw.zeros((B, Hq, D)) if mutable else None
    pool = [(fw.zeros((B, Hq, D)), fw.zeros((B, 2, Hkv, C, D)), fw.lens(B, C)) for _ in range(a.pool)]
    pool_out = [(x, y, z, fw.zeros((B, Hq, D))) for x, y, z in pool] if mutable else None
    res: dict = {}

    def warm(fn, n=200):
        for _ in range(n):
            fn()
        fw.sync()

    def put(name, med_per):
        med, per = med_per
        res[name] = {"median_us": round(med, 3), "samples_us": [round(x, 3) for x in per]}
        print(f"{a.label}{fw.name:6s} {name:18s} {med:8.2f} us", flush=True)

    warm(lambda: dec(q, kv, lens))
    put("replay_alloc", _median_loop(lambda: dec(q, kv, lens), a.calls, a.rounds, fw.sync))
    if mutable:
        warm(lambda: dec(q, kv, lens, out=o))
        put("replay_out", _median_loop(lambda: dec(q, kv, lens, out=o), a.calls, a.rounds, fw.sync))
    for args in pool:
        dec(*args)
    put("newptr_alloc", _median_cycle(lambda x, y, z: dec(x, y, z), pool, a.calls, a.rounds, fw.sync))
    if mutable:
        for args in pool_out:
            dec(*args[:3], out=args[3])
        put("newptr_out", _median_cycle(lambda x, y, z, w: dec(x, y, z, out=w), pool_out, a.calls, a.rounds, fw.sync))
    def new_layouts(first: int) -> list:
        """a.layouts tensor sets of capacities C + 128 (first + 1), C + 128 (first + 2), ..., all pre-allocated"""
        sets = []
        for i in range(first, first + a.layouts):
            c = C + 128 * (i + 1)
            sets.append((fw.zeros((B, Hq, D)), fw.zeros((B, 2, Hkv, c, D)), fw.lens(B, c)))
        fw.sync()
        return sets

    # first calls of new layouts: distinct capacities
    firsts = [lambda t=t: dec(*t) for t in new_layouts(0)]
    put("first_layout", _median_each(firsts, fw.sync))
    try:
        from gqadrv.gqa import api

        layouts = api._layouts
    except (ImportError, AttributeError):
        layouts = None
    if layouts is not None:
        put("first_after_clear", _median_each([lambda: dec(q, kv, lens)] * a.layouts, fw.sync, before=layouts.clear))
        try:
            from gqadrv.gqa import layout_family
        except ImportError:
            layout_family = None
        if layout_family is not None:
            def forget():
                layouts.clear()
                layout_family.families.clear()

            put("first_new_family", _median_each([lambda: dec(q, kv, lens)] * a.layouts, fw.sync, before=forget))
    if mutable:
        p = gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens)
        warm(lambda: gqadrv.launch_prepared(p))
        put("launch_prepared", _median_loop(lambda: gqadrv.launch_prepared(p), a.calls, a.rounds, fw.sync))
    if fw.name == "jax":
        import jax

        import gqadrv.jax as gj

        f = jax.jit(gj.gqa_decode)
        for args in pool:
            f(*args)
        put("jit_call", _median_cycle(f, pool, a.calls, a.rounds, fw.sync))
        g = jax.jit(lambda x, y, z: x * 1)
        for args in pool:
            g(*args)
        put("jit_baseline", _median_cycle(g, pool, a.calls, a.rounds, fw.sync))
    measure_mla(fw, a, gqadrv, put)
    if a.profile and fw.name == a.profile_fw:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(2000):
            dec(*pool[i % len(pool)])
        prof.disable()
        fw.sync()
        print(f"cProfile of 2000 same-layout / new-pointer calls ({fw.name}):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if a.profile_first and fw.name == a.profile_fw:
        sets = new_layouts(a.layouts)  # capacities the first-call rows did not use
        prof = cProfile.Profile()
        prof.enable()
        for t in sets:
            dec(*t)
        prof.disable()
        fw.sync()
        print(f"cProfile of {a.layouts} first calls of new layouts ({fw.name}):")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
    return res


def measure_mla(fw: Fw, a, gqadrv, put) -> None:
    """The MLA rows (see the module docstring); bf16 tensors of zeros, lengths = the capacity."""
    B, H, L, page = a.batch, a.mla_heads, a.mla_len, 64
    nblk = -(-L // page)
    dec = gqadrv.flash_mla_with_kvcache

    def tset():  # every table entry is page 0 (the data are zeros: only the host path is timed)
        return (fw.zeros((B, 1, H, 576), "bfloat16"), fw.zeros((B * nblk, page, 1, 576), "bfloat16"),
                fw.lens(B * nblk, 0).reshape(B, nblk), fw.lens(B, L))

    pool = [tset() for _ in range(a.pool)]
    for args in pool:
        dec(*args, 512)
    if fw.name == "jax":
        import jax

        import gqadrv.jax as gj

        f = jax.jit(lambda q, k, bt, sl: gj.flash_mla_with_kvcache(q, k, bt, sl, 512))
        for args in pool:
            f(*args)
        put("mla_jit_call", _median_cycle(f, pool, a.calls, a.rounds, fw.sync))
    else:
        put("mla_newptr_alloc", _median_cycle(lambda *t: dec(*t, 512), pool, a.calls, a.rounds, fw.sync))
        outs = [(*t, fw.zeros((B, 1, H, 512), "bfloat16"), fw.zeros((B, H, 1), "float32")) for t in pool]
        for t in outs:
            dec(*t[:4], 512, out=t[4], lse=t[5])
        put("mla_newptr_out", _median_cycle(lambda q, k, bt, sl, o, lo: dec(q, k, bt, sl, 512, out=o, lse=lo), outs,
                                            a.calls, a.rounds, fw.sync))
    try:
        from gqadrv.mla import layout_plans
    except ImportError:  # an older gqadrv: no MLA layout plans
        return
    put("mla_first_after_clear", _median_each([lambda: dec(*pool[0], 512)] * a.layouts, fw.sync,
                                              before=layout_plans.layouts.clear))


def table(results: dict) -> str:
    fws = list(results)
    lines = ["| path | " + " | ".join(f"{f} µs" for f in fws) + " |", "|---|" + "---|" * len(fws)]
    for key, label in CASES:
        cells = []
        for f in fws:
            r = results[f]
            if isinstance(r, str):
                cells.append("-")
            else:
                cells.append(f"{r[key]['median_us']:.2f}" if key in r else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    skipped = [f"{f}: {r}" for f, r in results.items() if isinstance(r, str)]
    if skipped:
        lines.append("")
        lines.append("not measured: " + "; ".join(skipped))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="cupy,torch,jax", help="comma-separated subset of cupy,torch,jax")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--label", default="", help="printed in front of every progress line and stored in the JSON")
    ap.add_argument("--pool", type=int, default=8, help="tensor sets cycled through for the new-pointer rows")
    ap.add_argument("--layouts", type=int, default=64, help="distinct layouts (first-call rows)")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mla-heads", type=int, default=16, help="h_q of the MLA rows (h_kv 1)")
    ap.add_argument("--mla-len", type=int, default=1024, help="tokens per request of the MLA rows (page 64)")
    ap.add_argument("--profile", action="store_true", help="cProfile 2000 new-pointer calls (top 25 by own time)")
    ap.add_argument("--profile-first", action="store_true",
                    help="cProfile the first calls of --layouts new layouts (top 30 by own time, 40 by cumulative)")
    ap.add_argument("--profile-fw", default="cupy", help="framework profiled by --profile / --profile-first")
    a = ap.parse_args()
    import gqadrv

    results: dict = {}
    for name in [f.strip() for f in a.frameworks.split(",") if f.strip()]:
        if name not in FRAMEWORKS:
            print(f"unknown framework {name!r}; choose from {', '.join(FRAMEWORKS)}", file=sys.stderr)
            return 2
        try:
            fw = FRAMEWORKS[name]()
        except Exception as exc:  # noqa: BLE001 - not importable / no GPU: reported, not fatal
            results[name] = f"{type(exc).__name__}: {exc}"
            print(f"{a.label}{name}: skipped ({results[name]})", flush=True)
            continue
        try:
            results[name] = measure(fw, a, gqadrv)
        except Exception as exc:  # noqa: BLE001 - one framework failing must not hide the others
            import traceback

            traceback.print_exc()
            results[name] = f"failed: {type(exc).__name__}: {exc}"
    md = table(results)
    print()
    print(f"B{a.batch} Hq{a.hq} Hkv{a.hkv} C{a.capacity} D{a.head_dim} fp16; median µs of host time per call "
          f"({a.rounds} x {a.calls} calls; first-call rows: median of {a.layouts} single calls)")
    print(md)
    if a.json:
        try:
            from gqadrv._version import versions

            vers = versions()
        except Exception:  # noqa: BLE001
            vers = {}
        doc = {"schema": "gqadrv.profile_convenience/1", "label": a.label, "versions": vers,
               "params": {"batch": a.batch, "hq": a.hq, "hkv": a.hkv, "capacity": a.capacity, "head_dim": a.head_dim,
                          "pool": a.pool, "layouts": a.layouts, "calls": a.calls, "rounds": a.rounds},
               "cases": dict(CASES), "results": results, "table_md": md}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
