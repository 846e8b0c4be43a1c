"""Command line: python -m gqadrv info | compile | demo | selftest | bench

The top floor: it iterates the op families' OP records (``_ops``) and is imported by nobody."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _ops() -> tuple:
    """The op families (each package's OP record); the CLI hard-codes none of their details."""
    from . import gqa, mla

    return (gqa.OP, mla.OP)


def cmd_info(args) -> int:
    from ._version import versions
    from .runtime import cache as _cache
    from .runtime import driver as _drv
    from .runtime.compiler import arch_for_cc

    print("gqadrv info")
    for k, v in versions().items():
        print(f"  {k:14s} {v}")
    c = _cache.default_cache()
    n, size = c.disk_usage()
    state = "enabled" if _cache.cache_enabled() else "disabled (GQADRV_CACHE=0)"
    print(f"  cache          {_cache.cache_dir()} ({state}; {n} entries, {size / 1e6:.1f} MB)")
    ok, why = _drv.gpu_status()
    if not ok:
        print(f"  GPU            none: {why}")
        print("  kernels        can still be compiled here: python -m gqadrv compile --arch sm_90a")
        return 0
    for i in range(_drv.device_count()):
        d = _drv.device_info(i)
        print(f"  device {i}       {d.name}: compute capability {d.arch}, {d.sm_count} SMs, "
              f"{d.total_memory / 2**30:.0f} GiB, L2 {d.l2_bytes / 2**20:.0f} MiB, smem opt-in {d.smem_optin} B")
        print(f"                 target {arch_for_cc(d.cc)}; runtime proof kernel: "
              f"{'yes' if d.cc[0] >= 9 else 'no (needs sm_90+)'}")
        for op in _ops():
            try:
                print(f"                 {op.describe(d.cc)}")
            except RuntimeError as exc:
                print(f"                 {op.name}: unsupported: {exc}")
    return 0


def cmd_compile(args) -> int:
    import os

    # On a machine with a driver, NVRTC may take a module from the driver's JIT cache and skip
    # ptxas, which leaves no resource report: bypass that cache for this process.
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    from .runtime.compiler import compile_module, normalize_arch
    from .runtime.proof import PROOF_SOURCE

    arch = normalize_arch(args.arch)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    jobs = [(v.name, v.family.source, v.family.entry, v.defines) for op in _ops() for v in op.variants_for_arch(arch)]
    if int(arch[3:].rstrip("af")) >= 90:
        for dt, name in ((0, "float16"), (1, "bfloat16"), (2, "float32")):
            jobs.append((f"proof_tma_ring_reduce_{name}", PROOF_SOURCE, "tma_ring_reduce", {"PROOF_DT": dt}))
    print(f"compiling {len(jobs)} modules for {arch}")
    print(f"{'module':48s} {'kernel':22s} {'regs':>5s} {'smem':>6s} {'stack':>6s} {'spill st/ld':>12s} {'s':>6s}")
    bad = 0
    for name, src, entry, defines in jobs:
        m = compile_module(src, arch, defines)
        r = m.resources.get(entry)
        if r is None:
            print(f"{name:48s} missing ptxas report for {entry}")
            bad += 1
            continue
        spill = f"{r.spill_stores}/{r.spill_loads}"
        if r.spill_stores or r.spill_loads:
            bad += 1
        print(f"{name:48s} {entry:22s} {r.registers:5d} {r.shared_bytes:6d} {r.stack_bytes:6d} {spill:>12s} "
              f"{m.seconds:6.2f}{' (cached)' if m.from_cache else ''}")
        if out:
            (out / f"{name}.{arch}.cubin").write_bytes(m.cubin)
            (out / f"{name}.{arch}.ptx").write_bytes(m.ptx)
    if out:
        print(f"wrote PTX and cubin of {len(jobs)} modules to {out}")
    if bad:
        print(f"{bad} module(s) spill registers or lack a resource report", file=sys.stderr)
        return 1
    return 0


def _no_gpu_exit(what: str) -> int:
    from .runtime.driver import gpu_status

    ok, why = gpu_status()
    if ok:
        return 0
    print(f"gqadrv {what}: no usable NVIDIA GPU here ({why}).\n"
          "It needs a CUDA GPU of compute capability 8.0+ (the H200 is the tested one). "
          "On this machine you can still run `python -m gqadrv info` and "
          "`python -m gqadrv compile --arch sm_90a`.", file=sys.stderr)
    return 2


def cmd_demo(args) -> int:
    rc = _no_gpu_exit("demo")
    if rc:
        return rc
    import cupy as cp
    import numpy as np

    import gqadrv
    from .runtime.driver import device_info

    B, Hq, Hkv, C, D = 1, 32, 8, args.capacity, 128
    rng = np.random.default_rng(0)
    qh = rng.standard_normal((B, Hq, D)).astype(np.float16)
    kvh = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
    lh = np.array([C], dtype=np.int32)
    q, kv, lens = cp.asarray(qh), cp.asarray(kvh), cp.asarray(lh)
    info = device_info(0)
    print(f"gqadrv demo on {info.name} (cc {info.arch}): q {qh.shape}, kv {kvh.shape}, lengths {lh.tolist()}, fp16")
    t0 = time.perf_counter()
    out = gqadrv.gqa_decode(q, kv, lens)
    cp.cuda.get_current_stream().synchronize()
    first = time.perf_counter() - t0
    ref = gqadrv.gqa_decode_reference(qh, kvh, lh)
    err = float(np.max(np.abs(cp.asnumpy(out).astype(np.float64) - ref)))
    o = cp.empty_like(q)
    prep = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens})
    for _ in range(10):
        gqadrv.launch_prepared(prep)
    s = cp.cuda.get_current_stream()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    n = 200
    e0.record(s)
    for _ in range(n):
        gqadrv.launch_prepared(prep)
    e1.record(s)
    e1.synchronize()
    per = cp.cuda.get_elapsed_time(e0, e1) * 1000 / n
    err2 = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ref)))
    ok = err <= 1e-2 + 1e-2 * np.max(np.abs(ref)) and err2 <= 1e-2 + 1e-2 * np.max(np.abs(ref))
    print(f"  first call (compile or cache load + launch): {first * 1e3:.1f} ms")
    print(f"  max |out - float64 oracle|: convenience {err:.3e}, prepared {err2:.3e}  -> {'OK' if ok else 'FAIL'}")
    print(f"  prepared route {prep.route}, num_splits {prep.num_splits}: {per:.2f} us per launch (back-to-back, event-timed)")
    return 0 if ok else 1


def cmd_selftest(args) -> int:
    import numpy as np

    from .runtime.driver import gpu_status

    ok, why = gpu_status()
    rng = np.random.default_rng(1)
    fails = 0
    for op in _ops():
        for name, err, good in op.selftest(rng, gpu=ok):
            fails += not good
            print(f"selftest: {name}: max err {err:.3e} {'OK' if good else 'FAIL'}")
    if not ok:
        print(f"selftest: GPU part skipped ({why})")
    return 1 if fails else 0


def cmd_bench(args) -> int:
    rc = _no_gpu_exit("bench")
    if rc:
        return rc
    from .ops.bench import run

    spec = {op.name: op.bench_spec() for op in _ops() if op.bench_spec is not None}[args.op]
    return run(spec, args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gqadrv", description="gqadrv: driver-level GQA decode runtime")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, devices, cache, kernel families").set_defaults(fn=cmd_info)
    c = sub.add_parser("compile", help="compile every kernel for an architecture and print the resource report")
    c.add_argument("--arch", required=True, help="sm_80, sm_90a, sm_100a, sm_110a, ...")
    c.add_argument("--out", help="write PTX and cubin files to this directory")
    c.set_defaults(fn=cmd_compile)
    d = sub.add_parser("demo", help="the seed README example on the GPU, checked against the oracle")
    d.add_argument("--capacity", type=int, default=1024)
    d.set_defaults(fn=cmd_demo)
    sub.add_parser("selftest", help="oracle check (CPU) and a few GPU shapes").set_defaults(fn=cmd_selftest)
    b = sub.add_parser("bench", help="side-by-side benchmark against the bandwidth ceiling and the peers")
    from .ops.bench import add_common_arguments

    specs = [op.bench_spec() for op in _ops() if op.bench_spec is not None]
    b.add_argument("--op", choices=[sp.name for sp in specs], default=specs[0].name, help="op family to benchmark")
    add_common_arguments(b)
    for sp in specs:
        sp.add_arguments(b)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)
