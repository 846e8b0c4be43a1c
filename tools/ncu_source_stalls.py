"""Where a kernel's warps wait, from Nsight Compute's per-instruction source counters.

Reads the CSV that

    ncu --clock-control none -k regex:KERNEL --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --import-source yes \\
        --page source --csv --print-source sass  python3 ...  > src.csv

prints (the leading ==PROF== / warning lines are skipped), and reports:

* the kernel's regions split at its ``USETMAXREG`` instructions (warp-specialized kernels: the code
  before the first one, then one region per role) with their share of the stall samples and of the
  executed warp instructions;
* per region, the stall reasons summed over its instructions;
* the top instructions by samples, each with the two instructions before it (a ``TRYWAIT`` before a
  hot branch names the mbarrier: its shared-memory offset is printed as ``[R..+0x...]``).

    python tools/ncu_source_stalls.py src.csv [--top 25]

Used for docs/MLA.md, "Where seesaw_fp8's time goes" (2026-12-01). Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def load(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, r in enumerate(rows):
        if r and r[0] == "Address":
            hdr = r
            return hdr, [x for x in rows[i + 1:] if len(x) == len(hdr)]
    raise ValueError(f"{path}: no 'Address' header row (not an ncu --page source --csv output?)")


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def report(hdr: list[str], data: list[list[str]], top: int) -> str:
    ix = {h: i for i, h in enumerate(hdr)}
    samples = lambda r: number(r[ix["Warp Stall Sampling (All Samples)"]])  # noqa: E731
    executed = lambda r: number(r[ix["Instructions Executed"]])  # noqa: E731
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(samples(r) for r in data) or 1.0
    cuts = [0] + [i for i, r in enumerate(data) if "SETMAXREG" in r[ix["Source"]]] + [len(data)]
    out = [f"{len(data)} instructions, {int(total)} stall samples"]
    for a, b in zip(cuts, cuts[1:]):
        part = data[a:b]
        if not part:
            continue
        s, e = sum(samples(r) for r in part), sum(executed(r) for r in part)
        agg = collections.Counter()
        for r in part:
            for h in reasons:
                agg[h] += number(r[ix[h]])
        head = part[0][ix["Source"]].strip()[:40]
        out.append(f"region [{a}, {b}) from '{head}': {100 * s / total:.1f} % of samples, {int(e)} warp instructions")
        ps = sum(agg.values()) or 1.0
        out.append("  " + ", ".join(f"{k[6:]} {100 * v / ps:.0f} %" for k, v in agg.most_common(6)))
    out.append(f"top {top} instructions by samples:")
    for i in sorted(range(len(data)), key=lambda j: -samples(data[j]))[:top]:
        r = data[i]
        ctx = " | ".join(data[j][ix["Source"]].strip()[:64] for j in range(max(0, i - 2), i + 1))
        why = ", ".join(f"{h[6:]} {int(number(r[ix[h]]))}" for h in reasons if number(r[ix[h]]) > 0.1 * samples(r))
        out.append(f"  {i:6d} {100 * samples(r) / total:5.1f} % exec {int(executed(r)):8d}  {ctx}  [{why}]")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    hdr, data = load(args.csv)
    print(report(hdr, data, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
