"""Host cost of the convenience calls' Python paths on a machine without a GPU.

The full path of a convenience call (first call of a layout: ingestion, validation, routing, split
count, argument packing, tensor map, the layout entry) and the layout-plan path of repeated calls are
run on fake device arrays (tests/fakes.py: numpy buffers that say they live on a CUDA device), read the
way CuPy arrays are read (attributes, no DLPack capsule), with every GPU-facing step stubbed
(tests/host_stubs.py): the
driver (init, device facts, launch configuration, cuLaunchKernelEx), module loading, tensor-map
encoding (a fixed 128-byte pattern holding the address), workspace allocation and stream queries.
What is left is the Python work that dominates these paths on the GPU host too, so relative changes
measured here carry over; absolute numbers do not (a different CPU, and the stubbed driver calls cost
a few microseconds each there). `tools/profile_convenience.py` measures the real thing on a GPU.

    python tools/profile_host_cpu.py [--op gqa|mla|paged|merge] [--calls 200] [--profile]

Prints the median µs per call of: the first call of each of ``--calls`` new layouts (distinct
capacities for GQA: members of a known layout family, gqa/layout_family.py, unless ``--no-families``, batch sizes for MLA, pool sizes for the paged decode, row counts for the merge),
the same calls again and a third time (layout plans; for GQA family members the second call of a
layout builds the layout its own entry, since the route side's re-sizable entry holds the last
layout's sizes by then, and the third is a plain replay); ``--profile`` adds a cProfile of the
first-call loop (top 25 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.fakes import aligned  # noqa: E402
from tests.host_stubs import FakeT, stub_gpu  # noqa: E402


def gqa_sets(n: int) -> list:
    B, Hq, Hkv, D = 1, 32, 8, 128
    return [(FakeT(aligned((B, Hq, D))), FakeT(aligned((B, 2, Hkv, 1024 + 128 * i, D))),
             FakeT(aligned((B,), np.int32)), FakeT(aligned((B, Hq, D)))) for i in range(n)]


def mla_sets(n: int) -> list:
    out = []
    for i in range(n):
        b, nblk = 1 + i, 4
        out.append((FakeT(aligned((b, 1, 16, 576))), FakeT(aligned((b * nblk, 64, 1, 576))),
                    FakeT(aligned((b, nblk), np.int32)), FakeT(aligned((b,), np.int32)),
                    FakeT(aligned((b, 1, 16, 512))), FakeT(aligned((b, 16, 1), np.float32))))
    return out


def paged_sets(n: int) -> list:
    """q [B, Hq, D], K / V pools of page 16 (NHD), table, lengths, out, lse: a new pool size per layout."""
    B, Hq, Hkv, D, page, mp = 2, 32, 8, 128, 16, 16
    out = []
    for i in range(n):
        P = B * mp + 1 + i
        out.append((FakeT(aligned((B, Hq, D))), FakeT(aligned((P, page, Hkv, D))), FakeT(aligned((P, page, Hkv, D))),
                    FakeT(aligned((B, mp), np.int32)), FakeT(aligned((B,), np.int32)), FakeT(aligned((B, Hq, D))),
                    FakeT(aligned((B, Hq), np.float32))))
    return out


def merge_sets(n: int) -> list:
    """Two states [N, 32, 128] fp16 with their LSEs and both outputs: a new N per layout."""
    out = []
    for i in range(n):
        N, H, D = 1 + i, 32, 128
        out.append((FakeT(aligned((N, H, D))), FakeT(aligned((N, H), np.float32)), FakeT(aligned((N, H, D))),
                    FakeT(aligned((N, H), np.float32)), FakeT(aligned((N, H, D))), FakeT(aligned((N, H), np.float32))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("gqa", "mla", "paged", "merge"), default="gqa")
    ap.add_argument("--calls", type=int, default=200, help="new layouts timed (first calls), then again")
    ap.add_argument("--profile", action="store_true", help="cProfile the first-call loop (top 25 by own time)")
    ap.add_argument("--no-families", action="store_true",
                    help="gqa: forget the layout families before every first call (the full path every time)")
    a = ap.parse_args()
    mp = pytest.MonkeyPatch()
    stub_gpu(mp)
    import gqadrv
    from gqadrv.gqa import api as gqa_api
    from gqadrv.gqa import layout_family, merge_layouts, paged_layouts
    from gqadrv.mla import layout_plans

    if a.op == "paged":
        sets = paged_sets(a.calls + 5)

        def call(t):
            gqadrv.gqa_decode_paged(*t[:5], out=t[5], lse=t[6], stream=7)

        layouts = paged_layouts.layouts
    elif a.op == "merge":
        sets = merge_sets(a.calls + 5)

        def call(t):
            gqadrv.merge_state(*t[:4], out=t[4], out_lse=t[5], stream=7)

        layouts = merge_layouts.layouts
    elif a.op == "gqa":
        sets = gqa_sets(a.calls + 5)

        def call(t):
            gqadrv.gqa_decode(*t[:3], out=t[3], stream=7)

        layouts = gqa_api._layouts
    else:
        sets = mla_sets(a.calls + 5)

        def call(t):
            gqadrv.flash_mla_with_kvcache(*t[:4], 512, out=t[4], lse=t[5], stream=7)

        layouts = layout_plans.layouts
    for t in sets[:5]:  # warm-up: imports, caches of everything that does not depend on the layout
        call(t)
    layouts.clear()
    prof = cProfile.Profile() if a.profile else None

    forget = layout_family.families.clear if a.no_families and a.op == "gqa" else (lambda: None)

    def each(ts, first=False):
        out = []
        for t in ts:
            if first:
                forget()
            t0 = time.perf_counter()
            call(t)
            out.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(out)

    first = each(sets[5:], first=True)
    again = each(sets[5:])
    third = each(sets[5:])
    print(f"{a.op}: first call of a new layout {first:.1f} us, the same layouts again {again:.1f} us, and a third "
          f"time {third:.1f} us (median of {a.calls}; CPU, GPU steps stubbed)")
    if prof is not None:
        layouts.clear()
        prof.enable()
        for t in sets[5:]:
            forget()
            call(t)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    mp.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
