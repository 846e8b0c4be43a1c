"""Instruction mix of a kernel's main loops, from its SASS (static counts; no GPU needed).

A *main loop* is the body of a backward branch that holds at least ``--min-hgmma`` wgmma instructions
(HGMMA) and at most ``--max-len`` instructions (the out-of-line retry blocks of mbarrier waits
branch back into the function from its end and would otherwise count as loops around everything);
loops that contain another main loop are dropped. For each: its address range, the number of
instructions and the count per opcode (the first word of the instruction, predicates and modifiers
stripped), the classes that differ between the seesaw builds and FlashMLA first.

    python tools/sass_loop_stats.py seesaw_bal seesaw_tma             # MLA variants, compiled by NVRTC
    python tools/sass_loop_stats.py --dtype float16 seesaw_tma
    python tools/sass_loop_stats.py path/to/kernel.cubin              # any cubin, e.g. FlashMLA's

MLA experiment variants (``<variant>_nopl2`` & co.) need GQADRV_MLA_EXPERIMENTS=1, which this tool sets.
cuobjdump: $CUOBJDUMP, PATH, or the nvidia-cuda-cuobjdump wheel (site-packages/nvidia/cu13/bin).
Counts are static: a branch that is rarely taken (e.g. the masking of a request's last tile) counts
as much as the path every tile takes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GQADRV_MLA_EXPERIMENTS", "1")

FIRST = ("HGMMA", "FMUL", "FFMA", "FADD", "MUFU", "FMNMX", "FSEL", "F2FP", "STSM", "STS", "LDS", "MEMBAR", "BAR",
         "SYNCS", "ISETP", "UIADD3", "IADD3", "VIADD", "IMAD", "LOP3", "ULOP3", "WARPSYNC", "BSSY", "BRA")
_INS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"BRA\b.*?0x([0-9a-f]+)")


def cuobjdump() -> str:
    exe = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if exe:
        return exe
    import site

    for d in site.getsitepackages():
        p = Path(d) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if p.exists():
            return str(p)
    raise SystemExit("cuobjdump not found: set $CUOBJDUMP or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def opcode(text: str) -> str:
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def main_loops(sass: str, min_hgmma: int, max_len: int) -> list[tuple[int, int, collections.Counter]]:
    ins = [(int(m.group(1), 16), m.group(2)) for m in _INS.finditer(sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        m = _TARGET.search(text)
        if not m:
            continue
        j = index.get(int(m.group(1), 16))
        if j is None or j >= i or i - j + 1 > max_len:
            continue
        ops = collections.Counter(opcode(t) for _, t in ins[j:i + 1])
        if ops["HGMMA"] >= min_hgmma:
            found.append((j, i, ops))
    keep = [f for f in found if not any(g is not f and f[0] <= g[0] and g[1] <= f[1] for g in found)]
    keep.sort(key=lambda f: f[0])
    return [(ins[j][0], ins[i][0], ops) for j, i, ops in keep]


def sass_of(target: str, dtype: str) -> tuple[str, str]:
    """(label, SASS text) of a cubin path or an MLA variant compiled for sm_90a."""
    exe = cuobjdump()
    if target.endswith(".cubin"):
        return target, subprocess.run([exe, "-sass", target], capture_output=True, text=True, check=True).stdout
    from gqadrv.mla import kernel_spec
    from gqadrv.runtime.compiler import compile_module

    k = kernel_spec.kernel(target)
    m = compile_module(k.source, "sm_90a", k.defines(dtype))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(m.cubin)
        f.flush()
        text = subprocess.run([exe, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = next(iter(m.resources.values())).registers
    return f"{target} ({dtype}, sm_90a, {regs} registers)", text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", help="MLA variant names or .cubin paths")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--min-hgmma", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1500)
    a = ap.parse_args()
    for t in a.targets:
        label, text = sass_of(t, a.dtype)
        print(label)
        for lo, hi, ops in main_loops(text, a.min_hgmma, a.max_len):
            total = sum(ops.values())
            first = " ".join(f"{k} {ops[k]}" for k in FIRST)
            rest = " ".join(f"{k} {n}" for k, n in ops.most_common() if k not in FIRST)
            print(f"  loop {lo:#x}-{hi:#x}: {total} instructions; {first}; other: {rest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
