"""Command line: python -m gqadrv info | compile | cache | demo | selftest | bench

The top floor: it iterates the op families' OP records (``_ops``) and is imported by nobody.

Errors are one line on stderr, ``gqadrv <command>: error: <message>``, never a traceback for an
expected failure (GQADRV_LOG=debug adds the traceback); the exit status says what happened
(EXIT_STATUS below, also in ``--help``). ``info --json`` and ``compile --json`` print one JSON
object with a versioned schema (``"schema": "gqadrv.info/1"`` / ``"gqadrv.compile/1"``, keys in
INFO_KEYS / COMPILE_KEYS / MODULE_KEYS); a new key may be added within a version, a key is never
renamed or removed without bumping it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SKIPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EXIT_STATUS = """\
exit status:
  0    success
  1    the work failed: a kernel did not compile, spills registers or lacks its ptxas report;
       nothing to compile; a selftest or demo result is wrong; a CUDA driver or file error
  2    usage: bad arguments or option values (unknown or unsupported --arch, unusable --out
       or --plot, unknown --op, an unreadable --from-json, --plot without matplotlib, ...),
       or no usable GPU for a command that needs one (demo, bench, compile --arch auto)
  3    selftest: the GPU half was skipped because there is no usable GPU (--cpu-only accepts
       a CPU-only check and exits 0 when it passes)
  130  interrupted (Ctrl-C)"""

INFO_SCHEMA = "gqadrv.info/1"
COMPILE_SCHEMA = "gqadrv.compile/1"
CACHE_SCHEMA = "gqadrv.cache/1"
INFO_KEYS = ("schema", "version", "versions", "cache", "gpu", "devices", "compile_arches")
DEVICE_KEYS = ("ordinal", "name", "cc", "target_arch", "sm_count", "total_memory", "l2_bytes", "smem_optin", "ops")
CACHE_KEYS = ("dir", "enabled", "entries", "bytes", "max_bytes")
COMPILE_KEYS = ("schema", "version", "nvrtc", "arches", "jobs", "out", "cache", "modules", "summary", "ok")
MODULE_KEYS = ("name", "arch", "source", "kernel", "key", "regs", "smem", "stack", "spill_stores", "spill_loads",
               "barriers", "seconds", "cached", "ok", "error")
SUMMARY_KEYS = ("modules", "compiled", "cached", "failed", "spilling", "seconds")


class UsageError(Exception):
    """A bad argument found after parsing: exit status 2."""


class WorkFailed(Exception):
    """The command ran but its work failed: exit status 1."""


def _ops() -> tuple:
    """The op families (each package's OP record); the CLI hard-codes none of their details."""
    from . import gqa, mla
    from .gqa import kv_fp8, merge
    from .mla import fp8_cache, sparse

    return (gqa.OP, merge.OP, kv_fp8.OP, mla.OP, fp8_cache.OP, sparse.OP)


def _bench_specs() -> list:
    """The ``bench --op`` choices: each op family's bench spec, then the paged GQA decode bench
    (``--op gqa_paged``, ``gqa/bench_paged.py``), its FP8-e4m3 KV form (``--op gqa_fp8``,
    ``gqa/bench_fp8.py``), the 64-layer decode step in one CUDA graph (``--op gqa_step``,
    ``gqa/bench_step.py``), MLA decode on the 656-byte FP8 cache (``--op mla_fp8``,
    ``mla/bench_fp8.py``), sparse MLA decode against FlashMLA (``--op mla_sparse``,
    ``mla/bench_sparse.py``) and sparse MLA prefill against FlashMLA (``--op mla_sparse_prefill``,
    ``mla/bench_sparse_prefill.py``)."""
    from .gqa.bench_fp8 import SPEC as gqa_fp8
    from .gqa.bench_paged import SPEC as gqa_paged
    from .gqa.bench_step import SPEC as gqa_step
    from .mla.bench_fp8 import SPEC as mla_fp8
    from .mla.bench_sparse import SPEC as mla_sparse
    from .mla.bench_sparse_prefill import SPEC as mla_sparse_prefill

    return [op.bench_spec() for op in _ops() if op.bench_spec is not None] + [gqa_paged, gqa_fp8, gqa_step, mla_fp8,
                                                                              mla_sparse, mla_sparse_prefill]


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


# ----------------------------------------------------------------------------- info
def _cache_info() -> dict:
    from .runtime import cache as _cache

    return _cache.default_cache().info()


def _accepted_arches() -> tuple[list, str | None]:
    from .runtime.compiler import target_arches

    try:
        return list(target_arches()), None
    except Exception as exc:  # noqa: BLE001 - NVRTC missing: info still works
        return [], str(exc)


def info_dict() -> dict:
    """The ``info --json`` object (schema gqadrv.info/1)."""
    from ._version import __version__, versions
    from .runtime import driver as _drv
    from .runtime.compiler import arch_for_cc

    ok, why = _drv.gpu_status()
    devices = []
    for i in range(_drv.device_count() if ok else 0):
        d = _drv.device_info(i)
        ops = {}
        for op in _ops():
            try:
                ops[op.name] = op.describe(d.cc)
            except RuntimeError as exc:
                ops[op.name] = f"unsupported: {exc}"
        devices.append({"ordinal": i, "name": d.name, "cc": list(d.cc), "target_arch": arch_for_cc(d.cc),
                        "sm_count": d.sm_count, "total_memory": d.total_memory, "l2_bytes": d.l2_bytes,
                        "smem_optin": d.smem_optin, "ops": ops})
    return {"schema": INFO_SCHEMA, "version": __version__, "versions": versions(), "cache": _cache_info(),
            "gpu": {"available": ok, "reason": why}, "devices": devices, "compile_arches": _accepted_arches()[0]}


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def cmd_info(args) -> int:
    from .runtime.compiler import arch_for_cc

    d = info_dict()
    if args.json:
        _print_json(d)
        return EXIT_OK
    print("gqadrv info")
    for k, v in d["versions"].items():
        print(f"  {k:14s} {v}")
    c = d["cache"]
    state = "enabled" if c["enabled"] else "disabled (GQADRV_CACHE=0)"
    cap = f", cap {_fmt_bytes(c['max_bytes'])}" if c["max_bytes"] else ""
    print(f"  cache          {c['dir']} ({state}; {c['entries']} entries, {_fmt_bytes(c['bytes'])}{cap})")
    if d["compile_arches"]:
        print(f"  compile arches {', '.join(d['compile_arches'])}")
    if not d["gpu"]["available"]:
        print(f"  GPU            none: {d['gpu']['reason']}")
        print("  kernels        can still be compiled here: python -m gqadrv compile --arch sm_90a")
        return EXIT_OK
    for dev in d["devices"]:
        cc = tuple(dev["cc"])
        print(f"  device {dev['ordinal']}       {dev['name']}: compute capability {cc[0]}.{cc[1]}, {dev['sm_count']} SMs, "
              f"{dev['total_memory'] / 2**30:.0f} GiB, L2 {dev['l2_bytes'] / 2**20:.0f} MiB, "
              f"smem opt-in {dev['smem_optin']} B")
        print(f"                 target {arch_for_cc(cc)}; runtime proof kernel: "
              f"{'yes' if cc[0] >= 9 else 'no (needs sm_90+)'}")
        for line in dev["ops"].values():
            print(f"                 {line}")
    return EXIT_OK


# ----------------------------------------------------------------------------- compile
def _resolve_arches(specs: list[str]) -> list[str]:
    """--arch values (repeatable, comma lists; 'all', 'auto') -> NVRTC targets, in order, deduplicated."""
    from .runtime import driver as _drv
    from .runtime.compiler import arch_for_cc, check_target_arch, target_arches

    out: list[str] = []
    for spec in specs:
        for tok in (t.strip() for t in spec.split(",")):
            if not tok:
                continue
            if tok.lower() == "all":
                arches = list(target_arches())
            elif tok.lower() == "auto":
                ok, why = _drv.gpu_status()
                if not ok:
                    raise UsageError(f"--arch auto needs a GPU (it compiles for GPU 0) and there is none: {why}; "
                                     f"name the target instead, e.g. --arch sm_90a, or --arch all")
                arches = [arch_for_cc(_drv.device_info(0).cc)]
            else:
                try:
                    arches = [check_target_arch(tok)]
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
            out.extend(a for a in arches if a not in out)
    if not out:
        raise UsageError("--arch: no architecture given")
    return out


def _prepare_out(out: str | None) -> Path | None:
    if not out:
        return None
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the directory ({exc.strerror or exc})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: the directory is not writable")
    return p


def compile_jobs(arches: list[str]) -> list[tuple]:
    """(name, arch, source, entry, defines) of every module ``compile`` builds for ``arches``: each
    op family's variants for the arch the routers load there (``build_arch``: sm_86, sm_120, ...
    load the families built for sm_80, compiled for their own target), and the runtime proof
    kernel on sm_90+. Same (source, arch, defines) as the runtime: the same cache keys."""
    from .runtime.compiler import arch_number, build_arch
    from .runtime.proof import PROOF_SOURCE

    jobs = []
    for arch in arches:
        fam_arch = build_arch(arch)
        for op in _ops():
            for v in op.variants_for_arch(fam_arch):
                jobs.append((v.name, arch, v.family.source, v.family.entry, v.defines))
        if arch_number(arch) >= 90:
            for dt, name in ((0, "float16"), (1, "bfloat16"), (2, "float32")):
                jobs.append((f"proof_tma_ring_reduce_{name}", arch, PROOF_SOURCE, "tma_ring_reduce", {"PROOF_DT": dt}))
    return jobs


def _compile_one(job) -> dict:
    from .runtime.compiler import CompileError, compile_module

    name, arch, src, entry, defines = job
    rec = dict.fromkeys(MODULE_KEYS)
    rec.update(name=name, arch=arch, source=src, kernel=entry, cached=False, ok=False)
    t0 = time.perf_counter()
    try:
        m = compile_module(src, arch, defines, label=name)
    except CompileError as exc:
        rec.update(error=str(exc), seconds=round(time.perf_counter() - t0, 3))
        return rec
    rec.update(key=m.key, seconds=round(m.seconds, 3), cached=m.from_cache, _module=m)
    r = m.resources.get(entry)
    if r is None:
        rec["error"] = f"missing ptxas resource report for {entry}"
        return rec
    rec.update(regs=r.registers, smem=r.shared_bytes, stack=r.stack_bytes, spill_stores=r.spill_stores,
               spill_loads=r.spill_loads, barriers=r.barriers, ok=not (r.spill_stores or r.spill_loads))
    if not rec["ok"]:
        rec["error"] = f"{entry} spills registers ({r.spill_stores} B stores, {r.spill_loads} B loads)"
    return rec


def cmd_compile(args) -> int:
    # On a machine with a driver, NVRTC may take a module from the driver's JIT cache and skip
    # ptxas, which leaves no resource report: bypass that cache for this process.
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from ._version import __version__
    from .runtime import cache as _cache
    from .runtime.compiler import nvrtc_version

    if args.jobs < 0:
        raise UsageError(f"--jobs {args.jobs}: expected a count >= 1, or 0 for one per CPU")
    arches = _resolve_arches(args.arch)
    out = _prepare_out(args.out)
    jobs = compile_jobs(arches)
    if args.only:
        jobs = [j for j in jobs if any(fnmatch.fnmatchcase(j[0], pat) for pat in args.only)]
        if not jobs:
            raise UsageError(f"--only {' '.join(args.only)}: no module of {', '.join(arches)} matches")
    if not jobs:
        raise WorkFailed(f"nothing to compile for {', '.join(arches)}: no kernel family builds for it")
    workers = args.jobs or os.cpu_count() or 1
    workers = max(1, min(workers, len(jobs)))
    # --json: the table and progress go to stderr, stdout carries only the JSON object
    tty = sys.stderr if args.json else sys.stdout
    many = len(arches) > 1
    n = len(jobs)
    w = len(str(n))
    pre = " " * (2 * w + 4)
    cache = _cache.default_cache()
    where = f"cache {cache.directory}" if cache.enabled else "disk cache disabled (GQADRV_CACHE=0): nothing is kept"
    arch_col = f"{'arch':8s}" if many else ""
    print(f"compiling {n} modules for {', '.join(arches)} with {workers} job(s); {where}", file=tty)
    print(f"{pre}{'module':48s} {arch_col}{'kernel':22s} {'regs':>5s} {'smem':>6s} {'stack':>6s} "
          f"{'spill st/ld':>12s} {'s':>6s}", file=tty, flush=True)

    results: list[dict | None] = [None] * n
    written = []
    t0 = time.perf_counter()

    def report(i: int, done: int, rec: dict) -> None:
        m = rec.pop("_module", None)
        results[i] = rec
        col = f"{rec['arch']:8s}" if many else ""
        head = f"[{done:>{w}}/{n}] {rec['name']:48s} {col}"
        if rec["regs"] is None:
            first = (rec["error"] or "").splitlines()[0]
            print(f"{head}FAILED: {first}", file=tty, flush=True)
            if rec["error"] and "\n" in rec["error"]:
                print(rec["error"], file=sys.stderr, flush=True)
        else:
            spill = f"{rec['spill_stores']}/{rec['spill_loads']}"
            print(f"{head}{rec['kernel']:22s} {rec['regs']:5d} {rec['smem']:6d} {rec['stack']:6d} {spill:>12s} "
                  f"{rec['seconds']:6.2f}{' (cached)' if rec['cached'] else ''}", file=tty, flush=True)
        if out is not None and m is not None:
            (out / f"{rec['name']}.{rec['arch']}.cubin").write_bytes(m.cubin)
            (out / f"{rec['name']}.{rec['arch']}.ptx").write_bytes(m.ptx)
            written.append(rec["name"])

    if workers == 1:
        for i, job in enumerate(jobs):
            report(i, i + 1, _compile_one(job))
    else:  # NVRTC compiles programs concurrently and releases the GIL: threads scale
        ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gqadrv-compile")
        try:
            futures = {ex.submit(_compile_one, job): i for i, job in enumerate(jobs)}
            for done, fut in enumerate(as_completed(futures), start=1):
                report(futures[fut], done, fut.result())
        finally:  # on an error or Ctrl-C, drop the queued modules instead of compiling them all
            ex.shutdown(wait=True, cancel_futures=True)
    wall = time.perf_counter() - t0

    failed = sum(r["regs"] is None for r in results)
    spilling = sum(r["regs"] is not None and not r["ok"] for r in results)
    cached = sum(bool(r["cached"]) for r in results)
    compiled = sum(not r["cached"] and r["key"] is not None for r in results)
    summary = {"modules": n, "compiled": compiled, "cached": cached, "failed": failed, "spilling": spilling,
               "seconds": round(wall, 3)}
    print(f"{n} modules for {', '.join(arches)}: {summary['compiled']} compiled, {cached} from the cache, "
          f"{failed} failed, {spilling} spilling; {wall:.1f} s with {workers} job(s)", file=tty)
    if out is not None:
        print(f"wrote PTX and cubin of {len(written)} modules to {out}", file=tty)
    ok = not failed and not spilling
    if args.json:
        doc = {"schema": COMPILE_SCHEMA, "version": __version__, "nvrtc": ".".join(map(str, nvrtc_version())),
               "arches": arches, "jobs": workers, "out": str(out) if out is not None else None,
               "cache": {"dir": str(cache.directory) if cache.directory is not None else None,
                         "enabled": cache.enabled},
               "modules": results, "summary": summary, "ok": ok}
        _print_json(doc)
    if not ok:
        raise WorkFailed(f"{failed} module(s) failed to compile or lack a resource report, {spilling} spill registers")
    return EXIT_OK


# ----------------------------------------------------------------------------- cache
def cmd_cache(args) -> int:
    from .runtime import cache as _cache

    c = _cache.default_cache()
    if args.cache_cmd == "clear":
        # clear also when GQADRV_CACHE=0: the directory is still gqadrv's
        target = c if c.enabled else _cache.CubinCache(_cache.cache_dir(), enabled=True)
        n, size = target.clear()
        c.clear_memory()
        if args.json:
            _print_json({"schema": CACHE_SCHEMA, "dir": str(target.directory), "removed_entries": n,
                         "removed_bytes": size})
        else:
            print(f"removed {n} entries ({_fmt_bytes(size)}) from {target.directory}")
        return EXIT_OK
    info = c.info()
    if not c.enabled:  # still describe what is on disk
        info.update({k: v for k, v in _cache.CubinCache(_cache.cache_dir()).info().items() if k in ("entries", "bytes")})
        info["dir"] = str(_cache.cache_dir())
    if args.json:
        _print_json({"schema": CACHE_SCHEMA, **info})
        return EXIT_OK
    print(f"dir        {info['dir']}")
    print(f"enabled    {'yes' if info['enabled'] else 'no (GQADRV_CACHE=0, or the directory is not usable)'}")
    print(f"entries    {info['entries']}")
    print(f"bytes      {info['bytes']} ({_fmt_bytes(info['bytes'])})")
    print(f"max bytes  {info['max_bytes'] if info['max_bytes'] else 'no cap (GQADRV_CACHE_MAX_BYTES unset)'}")
    return EXIT_OK


# ----------------------------------------------------------------------------- GPU commands
def _require_gpu() -> None:
    from .runtime.driver import NoGpuError, gpu_status

    ok, why = gpu_status()
    if not ok:
        raise NoGpuError(
            f"no usable NVIDIA GPU here ({why}). It needs a CUDA GPU of compute capability 8.0+ "
            "(the H200 is the tested one); on this machine you can still run `python -m gqadrv info` "
            "and `python -m gqadrv compile --arch sm_90a`")


def cmd_demo(args) -> int:
    if args.capacity < 1:
        raise UsageError(f"--capacity {args.capacity}: expected a positive token count")
    _require_gpu()
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
    return EXIT_OK if ok else EXIT_FAILED


def cmd_selftest(args) -> int:
    import numpy as np

    from .runtime.driver import gpu_status

    ok, why = gpu_status()
    gpu = ok and not args.cpu_only
    rng = np.random.default_rng(1)
    fails = 0
    for op in _ops():
        for name, err, good in op.selftest(rng, gpu=gpu):
            fails += not good
            print(f"selftest: {name}: max err {err:.3e} {'OK' if good else 'FAIL'}")
    if fails:
        print(f"gqadrv selftest: error: {fails} check(s) failed", file=sys.stderr)
        return EXIT_FAILED
    if args.cpu_only:
        print("selftest: CPU part passed (GPU part not requested: --cpu-only)")
        return EXIT_OK
    if not ok:
        print(f"selftest: GPU part skipped ({why})")
        print(f"gqadrv selftest: GPU part skipped: no usable GPU ({why}); exit status {EXIT_SKIPPED} "
              "(pass --cpu-only to check the CPU part alone)", file=sys.stderr)
        return EXIT_SKIPPED
    return EXIT_OK


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _plot_target(text: str) -> Path:
    """The ``--plot`` file, checked before any work: a .png / .svg / .pdf path in an existing,
    writable directory, and matplotlib importable (UsageError otherwise)."""
    from .ops.plot import require_matplotlib

    p = Path(text).expanduser()
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {text}: expected an image file name ending in {', '.join(PLOT_SUFFIXES)}")
    if p.is_dir():
        raise UsageError(f"--plot {text}: is a directory")
    parent = p.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"--plot {text}: the directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"--plot {text}: not writable")
    try:
        require_matplotlib()
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    return p


def _read_bench_json(text: str) -> dict:
    """A ``--from-json`` file as a checked bench result (UsageError naming the file otherwise)."""
    from .ops.plot import check_results

    p = Path(text).expanduser()
    if not p.exists():
        raise UsageError(f"--from-json {text}: no such file")
    if p.is_dir():
        raise UsageError(f"--from-json {text}: is a directory")
    try:
        with open(p) as f:
            doc = json.load(f)
    except OSError as exc:
        raise UsageError(f"--from-json {text}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--from-json {text}: not JSON ({exc})") from None
    try:
        return check_results(doc, f"--from-json {text}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_bench(args) -> int:
    for opt in ("graph_calls", "reps"):
        if getattr(args, opt, 1) < 1:
            raise UsageError(f"--{opt.replace('_', '-')} {getattr(args, opt)}: expected a positive count")
    if getattr(args, "ceiling_gib", 1.0) <= 0:
        raise UsageError(f"--ceiling-gib {args.ceiling_gib}: expected a positive size")
    if args.from_json and not args.plot:
        raise UsageError("--from-json re-plots saved results: give the image with --plot FILE.png")
    if args.from_json and args.json:
        raise UsageError("--json writes a new run's results, --from-json re-plots saved ones: give one of them")
    plot = _plot_target(args.plot) if args.plot else None
    if plot is not None:
        args.plot = str(plot)  # ~ expanded, for ops.bench.run
    if args.from_json:  # no GPU: draw the saved results and stop
        from .ops.plot import plot_results

        docs = [_read_bench_json(f) for f in args.from_json]
        plot_results(docs, plot)
        print(f"wrote {plot} from {len(docs)} result file(s)")
        return EXIT_OK
    if args.op == "gqa":
        from .gqa.bench import parse_shape

        for opt in ("shapes", "only"):
            for text in getattr(args, opt, None) or ():
                try:
                    parse_shape(text)
                except ValueError as exc:
                    raise UsageError(f"--{opt}: {exc}") from None
    _require_gpu()
    from .ops.bench import run

    spec = {sp.name: sp for sp in _bench_specs()}[args.op]
    return run(spec, args)


# ----------------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``gqadrv compile: error: ... (see --help)``, exit status 2."""

    def error(self, message):
        name = self.prog.replace("python -m ", "")
        self.exit(EXIT_USAGE, f"{name}: error: {message} (see: {self.prog} --help)\n")


def _jobs_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v}: expected a count >= 1, or 0 for one per CPU")
    return v


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="python -m gqadrv", description="gqadrv: driver-level GQA / MLA decode runtime",
                epilog=EXIT_STATUS, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"gqadrv {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    i = sub.add_parser("info", help="versions, devices, cache, kernel families", epilog=EXIT_STATUS,
                       formatter_class=fmt)
    i.add_argument("--json", action="store_true", help=f"print one JSON object (schema {INFO_SCHEMA})")
    i.set_defaults(fn=cmd_info)

    c = sub.add_parser(
        "compile", formatter_class=fmt, epilog=EXIT_STATUS,
        help="compile every kernel for an architecture (no GPU needed), print the resource report, warm the cache",
        description="Compile every module the runtime can load on a GPU of the given target, into the kernel "
                    "cache (GQADRV_CACHE_DIR): run it on a build machine to ship a warm cache. Fails (1) on "
                    "compile errors and register spills.")
    c.add_argument("--arch", required=True, action="append", metavar="ARCH",
                   help="NVRTC target(s), repeatable or comma-separated: the target the runtime picks for a GPU "
                        "(sm_80, sm_86, sm_87, sm_89, sm_90a, sm_100a, sm_103a, sm_110a, sm_120, ...; "
                        "see `info`), 'all' for every one, 'auto' for GPU 0's")
    c.add_argument("--out", help="also write the PTX and cubin of each module to this directory")
    c.add_argument("--jobs", "-j", type=_jobs_arg, default=1, metavar="N",
                   help="compile N modules at a time (threads; 0: one per CPU; default 1)")
    c.add_argument("--only", action="append", metavar="GLOB",
                   help="only modules whose name matches this shell pattern (repeatable), e.g. 'tma_*'")
    c.add_argument("--json", action="store_true",
                   help=f"print one JSON object (schema {COMPILE_SCHEMA}) on stdout; the table goes to stderr")
    c.set_defaults(fn=cmd_compile)

    k = sub.add_parser("cache", help="the kernel cache: info | clear", epilog=EXIT_STATUS, formatter_class=fmt,
                       description="The on-disk cubin cache (GQADRV_CACHE_DIR; GQADRV_CACHE_MAX_BYTES caps its size).")
    ks = k.add_subparsers(dest="cache_cmd", required=True, metavar="ACTION")
    ki = ks.add_parser("info", help="directory, enabled, entries, bytes, size cap")
    ki.add_argument("--json", action="store_true", help=f"print one JSON object (schema {CACHE_SCHEMA})")
    kc = ks.add_parser("clear", help="delete gqadrv's cache entries (nothing else in the directory)")
    kc.add_argument("--json", action="store_true", help=f"print one JSON object (schema {CACHE_SCHEMA})")
    k.set_defaults(fn=cmd_cache)

    d = sub.add_parser("demo", help="the seed README example on the GPU, checked against the oracle",
                       epilog=EXIT_STATUS, formatter_class=fmt)
    d.add_argument("--capacity", type=int, default=1024)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("selftest", help="oracle check (CPU) and a few GPU shapes; exit 3 if the GPU half was skipped",
                       epilog=EXIT_STATUS, formatter_class=fmt)
    s.add_argument("--cpu-only", action="store_true", help="check the CPU part only (exit 0 when it passes)")
    s.set_defaults(fn=cmd_selftest)

    b = sub.add_parser("bench", help="side-by-side benchmark against the bandwidth ceiling and the peers",
                       epilog=EXIT_STATUS, formatter_class=fmt)
    from .ops.bench import add_common_arguments

    specs = _bench_specs()
    b.add_argument("--op", choices=[sp.name for sp in specs], default=specs[0].name if specs else None,
                   help="op family to benchmark")
    add_common_arguments(b)
    for sp in specs:
        sp.add_arguments(b)
    b.set_defaults(fn=cmd_bench)
    return p


def _message(exc: BaseException) -> str:
    """The exception's text (an NVRTC error keeps its log on the lines after the first)."""
    return str(exc).strip() or type(exc).__name__


def main(argv=None) -> int:
    """Run the command; returns the exit status (EXIT_STATUS) instead of raising for expected errors."""
    args = build_parser().parse_args(argv)
    from .runtime.compiler import CompileError
    from .runtime.driver import CudaDriverError, NoGpuError
    from .runtime.log import get_logger

    name = f"gqadrv {args.cmd}" + (f" {args.cache_cmd}" if getattr(args, "cache_cmd", None) else "")

    def fail(exc: BaseException, status: int) -> int:
        get_logger("cli").debug("%s failed", name, exc_info=exc)
        try:
            sys.stdout.flush()
        except OSError:
            pass
        print(f"{name}: error: {_message(exc)}", file=sys.stderr)
        return status

    try:
        return int(args.fn(args) or 0)
    except (UsageError, NoGpuError, NotImplementedError) as exc:  # NotImplementedError: FeatureError
        return fail(exc, EXIT_USAGE)
    except (WorkFailed, CompileError, CudaDriverError) as exc:
        return fail(exc, EXIT_FAILED)
    except BrokenPipeError:  # `python -m gqadrv compile ... | head`
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_FAILED
    except (ValueError, TypeError) as exc:  # a bad option value found by the op (bench shapes, backend, ...)
        return fail(exc, EXIT_USAGE)
    except (OSError, RuntimeError) as exc:
        return fail(exc, EXIT_FAILED)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
