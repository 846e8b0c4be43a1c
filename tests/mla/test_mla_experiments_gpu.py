"""The MLA experiment builds (GQADRV_MLA_EXPERIMENTS=1) on the GPU. The balanced variants keep split
partials in L2 (stored evict_last, discarded from L2 once merged: MLA_PARTIAL_L2=1); the experiment
``<variant>_nopl2`` builds them without those cache policies. Both must give bit-identical outputs
on every launch of a prepared object (a discarded line must never be read again by a later launch).
It runs in a subprocess, since the experiment variants are registered when gqadrv.mla.kernel_spec is
imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import cupy as cp, numpy as np, gqadrv
    rs = np.random.default_rng(3)
    failures = []
    cases = [  # (b, h_q, lengths, page): uniform (whole mode), spread and skewed batches (cuts)
        (128, 64, [4096] * 128, 64),
        (128, 64, [1024 + (3 * 4096 // 2) * i // 127 for i in range(128)], 64),
        (64, 16, [16 * 2048] + [2048] * 63, 64),
        (37, 16, [int(x) for x in rs.integers(0, 3000, 37)], 128),
        (20, 128, [int(x) for x in rs.integers(1, 5000, 20)], 64),
    ]
    for b, h_q, lens, page in cases:
        mb = -(-max(lens) // page)
        k = cp.asarray((rs.standard_normal((b * mb, page, 1, 576)) / 10).astype(np.float16))
        q = cp.asarray((rs.standard_normal((b, 1, h_q, 576)) / 10).astype(np.float16))
        bt = cp.asarray(rs.permutation(b * mb).astype(np.int32).reshape(b, mb))
        sl = cp.asarray(np.array(lens, np.int32))
        fam = "narrow16_bal" if h_q <= 16 else "seesaw_bal"
        for base in (fam, fam + "_cut32"):
            res = {}
            for v in (base, base + "_nopl2"):
                p = gqadrv.prepare_mla_decode(q, k, bt, sl, backend=v)
                runs = []
                for _ in range(3):
                    o, l = gqadrv.launch_prepared(p)
                    runs.append((cp.asnumpy(o).view(np.uint16).copy(), cp.asnumpy(l).copy()))
                res[v] = runs
            ref = res[base][0]
            for v, runs in res.items():
                for i, (o, l) in enumerate(runs):
                    if not (np.array_equal(o, ref[0]) and np.array_equal(l, ref[1], equal_nan=True)):
                        failures.append(f"b{b} h_q{h_q} {v} launch {i}")
    print("FAILURES:", failures)
    raise SystemExit(1 if failures else 0)
""")


def test_partial_l2_cache_policies_leave_outputs_bit_identical_on_every_launch():
    env = dict(os.environ, GQADRV_MLA_EXPERIMENTS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
