"""Layout families on the GPU (issue #21 item 2, gqa/layout_family.py): first calls of new (batch,
capacity) layouts of one family, on every route side (short, TMA unsplit and split, the large-batch
portable rule), give their own results for CuPy and torch, with and without ``out=``, both when their
entry is built and when a re-sizable entry is rewritten for them; every member's next call with new
tensors replays an entry of its own. The CPU test (test_layout_family_host.py) shows the
launches equal the full path's byte for byte; this one shows the kernels read what those bytes say
(grid, sizes, split workspace, the KV tensor map of the new geometry)."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu

Hq, Hkv, D = 32, 8, 128
TEMPLATE = (2, 1024)
# TMA unsplit, split (B 1), short (both sides of C 64), large batch (B * Hkv >= 2 waves of 132 SMs),
# one token, a long split row; then new capacities of batch sizes seen before, which re-size the entry
# of their route side and batch size in place (gqa/layout_family.py): B 2 from 8 splits (C 1000) to
# one (C 333), B 1 from 16 splits to 12 (C 1500) and to one (C 300), the short side (B 3, C 20), the
# large-batch rule (B 40, C 700)
MEMBERS = [(2, 1000), (1, 4096), (3, 48), (1, 64), (5, 65), (40, 512), (7, 1), (1, 20000),
           (2, 333), (1, 1500), (3, 20), (40, 700), (1, 300)]


def _host(B, C, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, D)).astype(np.float16)
    kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
    lens = np.array([max(0, C - 5 * b) for b in range(B)], np.int32)
    return q, kv, lens


def _fresh_caches():
    from gqadrv.gqa import api
    from gqadrv.gqa import layout_family

    api._layouts.clear()
    layout_family.families.clear()
    return api, layout_family


@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
def test_cupy_members_give_their_own_results(with_out, launches):
    import cupy as cp

    import gqadrv

    api, family = _fresh_caches()
    for rnd in range(2):  # the second round: every layout known, new tensors (layout replays, own entries)
        for i, (B, C) in enumerate([TEMPLATE] + MEMBERS):
            q, kv, lens = _host(B, C, seed=100 * rnd + i)
            dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
            kw = {"out": cp.full(dq.shape, np.nan, dq.dtype)} if with_out else {}
            got = gqadrv.gqa_decode(dq, dkv, dl, **kw)
            check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16",
                  f"member B{B} C{C} round {rnd}")
        assert len(family.families) == 1
        assert len(api._layouts) == 1 + len(MEMBERS)
        entries = {id(e) for e in api._layouts._map.values()}
        # round 1: six layouts were served by re-sizing an entry another layout had (B 1: C 20000, 1500,
        # 300; B 2: C 333; B 3: C 20; B 40: C 700); round 2: each layout whose sizes its entry no longer
        # held got an entry of its own
        assert len(entries) == (len(api._layouts) - 6 if rnd == 0 else len(api._layouts))
    (fam,) = family.families.values()
    assert set(fam.built) == {(False, False), (True, False), (False, True)}
    assert len(launches) == 2 * (1 + len(MEMBERS))


def test_torch_members_give_their_own_results():
    torch = pytest.importorskip("torch")

    import gqadrv

    _api, family = _fresh_caches()
    for i, (B, C) in enumerate([TEMPLATE] + MEMBERS):
        q, kv, lens = _host(B, C, seed=7 + i)
        tq, tkv, tl = (torch.from_numpy(x).cuda() for x in (q, kv, lens))
        got = gqadrv.gqa_decode(tq, tkv, tl)
        assert isinstance(got, torch.Tensor)
        torch.cuda.synchronize()
        check(got.cpu().numpy().astype(np.float64), gqa_decode_reference(q, kv, lens), "float16",
              f"torch member B{B} C{C}")
    assert len(family.families) == 1


def test_a_member_with_a_misaligned_cache_is_refused_before_any_launch(launches):
    import cupy as cp

    import gqadrv

    _fresh_caches()
    q, kv, lens = _host(*TEMPLATE, seed=1)
    gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(lens))
    q, kv, lens = _host(3, 700, seed=2)
    dq, dl = cp.asarray(q), cp.asarray(lens)
    raw = cp.empty(kv.size + 8, cp.float16)
    mis = raw[4:4 + kv.size].reshape(kv.shape)
    mis[...] = cp.asarray(kv)
    n = len(launches)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gqadrv.gqa_decode(dq, mis, dl)
    assert len(launches) == n
    got = gqadrv.gqa_decode(dq, cp.asarray(kv), dl)
    check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "after the refusal")
