"""The head / tail experiment (narrow16x2_tma_ht, MLA_HEAD_TAIL) on the CPU: its split points, and
prepare_mla_decode building its two PDL-chained launches (GPU steps stubbed, experiments registered in
a subprocess: GQADRV_MLA_EXPERIMENTS=1 is read at import). Not yet run on a GPU (docs/MLA.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def head_tail_point(n: int, k: int, S: int, head64: int) -> int:
    """Python mirror of kernels/mla/common/work_items.cuh head_tail_point."""
    if k <= 0:
        return 0
    if k >= S:
        return n
    head = min(n, (n * head64 + 63) // 64)
    return head + (n - head) * (k - 1) // (S - 1)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 31, 32, 64, 256, 1000])
@pytest.mark.parametrize("S", [1, 2, 4, 9])
def test_split_points_cover_every_pair_once(n, S):
    pts = [head_tail_point(n, k, S, 52) for k in range(S + 1)]
    assert pts[0] == 0 and pts[-1] == n and all(a <= b for a, b in zip(pts, pts[1:]))
    if S > 1 and n:
        assert pts[1] == min(n, -(-n * 52 // 64))  # the head: 52 / 64 of the pairs, rounded up


def test_kernel_mirror_matches_the_source():
    src = (ROOT / "kernels" / "mla" / "common" / "work_items.cuh").read_text()
    assert "const int head = min(n, (n * head64 + 63) / 64);" in src
    assert "return head + (int)(((long long)(n - head) * (k - 1)) / (S - 1));" in src


SCRIPT = textwrap.dedent("""
    import numpy as np, pytest
    from tests.host_stubs import FakeT, stub_gpu
    from tests.fakes import aligned
    mp = pytest.MonkeyPatch()
    stub_gpu(mp)
    import gqadrv
    from gqadrv.mla import api, kernel_spec as ks
    mp.setattr(api, "is_capturing", lambda s: False)  # prepare's stream checks and final sync (not stubbed)
    mp.setattr(api, "_sync", lambda s, device: None)
    from gqadrv.ops import workspace
    mp.setattr(api._workspace, "alloc", lambda *a, **k: workspace.pooled())  # the stubbed workspace
    b, nblk = 3, 8
    q = FakeT(aligned((b, 1, 16, 576))); k = FakeT(aligned((b * nblk, 64, 1, 576)))
    bt = FakeT(aligned((b, nblk), np.int32)); sl = FakeT(aligned((b,), np.int32))
    o = FakeT(aligned((b, 1, 16, 512))); l = FakeT(aligned((b, 16, 1), np.float32))
    kw = dict(out=o, lse=l, stream=7)
    p = gqadrv.prepare_mla_decode(q, k, bt, sl, 512, backend="narrow16x2_tma_ht", **kw)
    assert len(p.plans) == 2 and p.num_splits == ks.HEAD_TAIL_SPLITS, p
    head, tail = p.plans
    nmb = 1
    assert head.grid == (nmb, 1, b) and tail.grid == (nmb * (ks.HEAD_TAIL_SPLITS - 1), 1, b), (head.grid, tail.grid)
    assert head.pdl and tail.pdl and head.kernel is tail.kernel
    fh, ft = head.args.get_field("args.flags"), tail.args.get_field("args.flags")
    assert fh == ks.HEAD_TAIL_HEAD64 << ks.HEAD64_SHIFT and ft == fh | ks.FLAG_TAIL_GRID, (fh, ft)
    assert head.args.get_field("args.num_splits") == tail.args.get_field("args.num_splits") == ks.HEAD_TAIL_SPLITS
    p5 = gqadrv.prepare_mla_decode(q, k, bt, sl, 512, num_splits=5, backend="narrow16x2_tma_ht", **kw)
    assert p5.plans[1].grid == (4, 1, b)
    for bad, exc in ((dict(num_splits=1), ValueError),):
        try:
            gqadrv.prepare_mla_decode(q, k, bt, sl, 512, backend="narrow16x2_tma_ht", **kw, **bad)
        except exc as e:
            assert "num_splits >= 2" in str(e)
        else:
            raise AssertionError("num_splits=1 accepted")
    try:  # the convenience call cannot run two launches: refused before any launch
        gqadrv.flash_mla_with_kvcache(q, k, bt, sl, 512, backend="narrow16x2_tma_ht", **kw)
    except ValueError as e:
        assert "prepare_mla_decode" in str(e), e
    else:
        raise AssertionError("the convenience call accepted the two-launch experiment")
    q64 = FakeT(aligned((b, 1, 64, 576))); o64 = FakeT(aligned((b, 1, 64, 512))); l64 = FakeT(aligned((b, 64, 1), np.float32))
    p = gqadrv.prepare_mla_decode(q64, k, bt, sl, 512, backend="seesaw_tma_ht", out=o64, lse=l64, stream=7)
    assert len(p.plans) == 2 and p.plans[0].grid == (1, 1, b) and p.plans[1].grid == (ks.HEAD_TAIL_SPLITS - 1, 1, b)
    assert p.plans[1].args.get_field("args.flags") & ks.FLAG_TAIL_GRID
    print("OK")
""")


def test_prepare_builds_the_two_chained_launches():
    env = dict(os.environ, GQADRV_MLA_EXPERIMENTS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
