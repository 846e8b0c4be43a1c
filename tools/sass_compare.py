"""Prove that a restructuring of kernels/ leaves the machine code unchanged.

For every architecture in (sm_80, sm_90a, sm_100a, sm_110a) and every module that
`python -m gqadrv compile --arch ARCH` builds (the GQA and MLA variants of a *baseline* checkout's
route tables, plus the runtime proof kernels), and every MLA variant's watchdog build
(MLA_WATCHDOG=1, development only), compile the OLD source from the baseline kernels tree and
the NEW source (the old path mapped through OLD_TO_NEW) from this checkout's kernels tree, with the
same defines and the same NVRTC options, disassemble both cubins with `cuobjdump -sass` and compare
the instruction lines (function banners, header flags, every instruction with its address and its
encoding words). One line per module: name, arch, identical / DIFFERENT (+ first differing
instruction); exit status 0 only when every module is identical.

    git worktree add /tmp/sass_base <baseline commit>
    python tools/sass_compare.py --base /tmp/sass_base [--arch sm_90a ...] [--trace] [-j 2]

The baseline's variants (families, defines, entry names) come from the baseline package, imported
in a subprocess with PYTHONPATH=<base>, so the comparison does not depend on this checkout's route
table. Both sides are compiled by this checkout's gqadrv.runtime.compiler.compile_module with
``root=`` pointing at the respective kernels tree and a disabled disk cache.
cuobjdump: --cuobjdump, $CUOBJDUMP, the nvidia-cuda-cuobjdump wheel, or PATH; it needs nvdisasm
(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm: both land in site-packages/nvidia/cu13/bin).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["GQADRV_CACHE"] = "0"  # never read a stale cubin (each compile also gets its own cache)

ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")

# Source moves of the kernels/ restructuring (paths relative to the kernels root).
OLD_TO_NEW = {
    "sm90/gqa_decode_short.cu": "gqa/smxx/decode_short.cu",
    "sm90/gqa_decode_tma.cu": "gqa/sm90/decode_tma.cu",
    "sm80/gqa_decode_cpasync.cu": "gqa/sm80/decode_cpasync.cu",
    "sm100/gqa_decode_tc_short.cu": "gqa/sm100/decode_tc_short.cu",
    "sm100/gqa_decode_tc_long.cu": "gqa/sm100/decode_tc_long.cu",
    "runtime/tma_ring_reduce.cu": "runtime/tma_ring_reduce.cu",
    "runtime/stream_read.cu": "runtime/stream_read.cu",
}  # a source path that is not listed and exists in the new tree maps to itself (baselines after the move)

# Runs inside the baseline package: the module list of `gqadrv compile` for each arch, as JSON.
_ENUMERATE = r"""
import json, sys
from gqadrv.gqa import routes
from gqadrv.runtime.proof import PROOF_SOURCE
try:  # baselines before the MLA op have no gqadrv.mla
    from gqadrv.mla import kernel_spec as mla_spec, routes as mla_routes
except ImportError:
    mla_routes = None
out = []
for arch in sys.argv[1:]:
    for v in routes.variants_for_arch(arch):
        out.append([arch, v.name, v.family.source, v.family.entry, v.defines])
    if mla_routes is not None:
        for v in mla_routes.variants_for_arch(arch):
            out.append([arch, v.name, v.family.source, v.family.entry, v.defines])
            out.append([arch, v.name + "_watchdog", v.family.source, v.family.entry,
                        mla_spec.defines(v.dtype, v.family.name, watchdog=True)])
    if int(arch[3:].rstrip("af")) >= 90:
        for dt, name in ((0, "float16"), (1, "bfloat16"), (2, "float32")):
            out.append([arch, f"proof_tma_ring_reduce_{name}", PROOF_SOURCE, "tma_ring_reduce", {"PROOF_DT": dt}])
    out.append([arch, "bench_stream_read", "runtime/stream_read.cu", "stream_read", {}])
print(json.dumps(out))
"""


def enumerate_modules(base: Path, arches: tuple[str, ...], trace: bool) -> list[list]:
    env = dict(os.environ, PYTHONPATH=str(base), GQADRV_CACHE="0")
    env.pop("GQADRV_TILING", None)
    env.pop("GQADRV_SHORT_TILING", None)
    env["GQADRV_TRACE"] = "1" if trace else "0"
    res = subprocess.run([sys.executable, "-c", _ENUMERATE, *arches], env=env, cwd=str(base),
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"enumerating the baseline modules failed:\n{res.stderr}")
    mods = json.loads(res.stdout)
    imported = subprocess.run([sys.executable, "-c", "import gqadrv; print(gqadrv.__file__)"], env=env,
                              cwd=str(base), capture_output=True, text=True).stdout.strip()
    if not imported.startswith(str(base)):
        raise SystemExit(f"the baseline enumeration imported {imported}, not the package under {base}")
    return mods


def find_cuobjdump(explicit: str | None) -> str:
    for cand in (explicit, os.environ.get("CUOBJDUMP")):
        if cand:
            return cand
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            for p in sorted(Path(root).glob("**/bin/cuobjdump")):
                return str(p)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found:
        return found
    raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or pass --cuobjdump")


def sass_lines(cuobjdump: str, cubin: bytes) -> list[str]:
    """Instruction-level lines of `cuobjdump -sass`: function banners, header flags, instructions
    (address, text, encoding) and encoding continuation lines; whitespace-normalised."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        # cuobjdump -sass runs nvdisasm (the nvidia-cuda-nvdisasm wheel puts it next to cuobjdump)
        env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))
        res = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=False, env=env)
    finally:
        os.unlink(path)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {res.stderr.strip()}")
    keep = []
    for line in res.stdout.splitlines():
        s = " ".join(line.split())
        if not s:
            continue
        if s.startswith(("Function :", ".headerflags")) or s.startswith("/*"):
            keep.append(s)
    if not any(s.startswith("/*") for s in keep):
        raise RuntimeError("cuobjdump printed no instructions")
    return keep


def _compile_pair(job: dict) -> dict:
    from gqadrv.runtime import cache as _cache
    from gqadrv.runtime.compiler import CompileError, compile_module

    out = {"arch": job["arch"], "name": job["name"], "old": job["old"], "new": job["new"]}
    sides = {}
    for side, root, src in (("old", job["old_root"], job["old"]), ("new", job["new_root"], job["new"])):
        try:
            m = compile_module(src, job["arch"], job["defines"], root=Path(root),
                               cache=_cache.CubinCache(None, enabled=False))
        except CompileError as exc:
            out["status"] = f"COMPILE ERROR ({side}: {str(exc).splitlines()[0]})"
            out["log"] = getattr(exc, "log", "")
            return out
        if job["entry"] not in m.resources:
            out["status"] = f"MISSING ENTRY {job['entry']} ({side})"
            return out
        sides[side] = (sass_lines(job["cuobjdump"], m.cubin), m.resources[job["entry"]])
    (a, ra), (b, rb) = sides["old"], sides["new"]
    out["instructions"] = sum(1 for s in a if s.startswith("/*") and ";" in s)
    if a == b and ra == rb:
        out["status"] = "identical"
        return out
    if a == b:
        out["status"] = f"DIFFERENT resources: old {ra.to_dict()} new {rb.to_dict()}"
        return out
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    ol = a[i] if i < len(a) else "<end>"
    nl = b[i] if i < len(b) else "<end>"
    out["status"] = f"DIFFERENT at SASS line {i} ({len(a)} vs {len(b)} lines): old `{ol}` new `{nl}`"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="baseline checkout (a git worktree of the old commit)")
    ap.add_argument("--new-root", type=Path, default=REPO / "kernels", help="kernels tree of the new side")
    ap.add_argument("--arch", action="append", choices=ARCHES, help="only these arches (repeatable)")
    ap.add_argument("--only", default="", help="only modules whose name contains this string")
    ap.add_argument("--no-map", action="store_true", help="compile the old source paths on the new side too")
    ap.add_argument("--trace", action="store_true", help="compile every GQA variant with GQA_TRACE=1")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args(argv)

    base = args.base.resolve()
    old_root = base / "kernels"
    new_root = args.new_root.resolve()
    arches = tuple(args.arch or ARCHES)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    mods = enumerate_modules(base, arches, args.trace)
    jobs = []
    for arch, name, src, entry, defines in mods:
        if args.only and args.only not in name:
            continue
        if args.no_map:
            new = src
        elif src in OLD_TO_NEW:
            new = OLD_TO_NEW[src]
        elif (new_root / src).is_file():
            new = src
        else:
            raise SystemExit(f"{src} (module {name}) has no entry in OLD_TO_NEW")
        jobs.append(dict(arch=arch, name=name, entry=entry, defines=defines, old=src, new=new,
                         old_root=str(old_root), new_root=str(new_root), cuobjdump=cuobjdump))
    print(f"baseline {base} ({len(jobs)} modules), new kernels root {new_root}, cuobjdump {cuobjdump}", flush=True)

    results = []
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for r in ex.map(_compile_pair, jobs):
            results.append(r)
            extra = f" [{r['instructions']} instr]" if "instructions" in r else ""
            print(f"{r['name']:52s} {r['arch']:8s} {r['status']}{extra}", flush=True)

    print()
    print(f"{'arch':8s} {'identical':>9s} {'different':>9s}")
    total_bad = 0
    for arch in arches:
        rs = [r for r in results if r["arch"] == arch]
        ok = sum(r["status"] == "identical" for r in rs)
        total_bad += len(rs) - ok
        print(f"{arch:8s} {ok:9d} {len(rs) - ok:9d}")
    n = len(results)
    print(f"total: {n - total_bad} of {n} modules identical, {total_bad} different")
    return 0 if total_bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
