"""ops.workspace.pooled without a GPU (alloc replaced by a stand-in): ops with different buffer names
share one pool without evicting each other, only a buffer that is too small is reallocated (at least
doubling), the others keep their memory, and only regrown counters are zeroed."""

from __future__ import annotations

import itertools

from gqadrv.ops import workspace


class _Arr:
    def __init__(self, n):
        self.nbytes = 4 * n


def test_pool_regrows_only_what_does_not_fit(monkeypatch):
    ptrs = itertools.count(0x1000, 0x1000)
    calls = []

    def fake_alloc(device, stream, sizes, zero=()):
        calls.append((dict(sizes), tuple(zero)))
        arrays = {k: _Arr(n) for k, (n, _) in sizes.items()}
        return workspace.Workspace(arrays, {k: next(ptrs) for k in sizes}, {k: n for k, (n, _) in sizes.items()},
                                   sum(a.nbytes for a in arrays.values()), {k: dt for k, (_, dt) in sizes.items()})

    monkeypatch.setattr(workspace, "alloc", fake_alloc)
    monkeypatch.setattr(workspace, "_pool", {})
    monkeypatch.setattr(workspace, "_retired", [])
    dense = {"ws_o": (1000, "f32"), "ws_ml": (10, "f32"), "counters": (4, "u32")}
    a = workspace.pooled(0, 7, dense, ("counters",))
    assert calls[-1] == (dense, ("counters",))
    # a sparse call: new names join, the dense buffers are carried over untouched
    b = workspace.pooled(0, 7, {**dense, "sp_lists": (50, "i32")}, ("counters",))
    assert calls[-1] == ({"sp_lists": (50, "i32")}, ())
    assert b.ptrs["ws_o"] == a.ptrs["ws_o"] and b.sizes["ws_o"] == 1000 and b.fits(dense)
    # the dense call fits the grown pool: nothing is allocated
    n = len(calls)
    assert workspace.pooled(0, 7, dense, ("counters",)) is b and len(calls) == n
    # one buffer too small: only it regrows (at least doubling), its old copy retired with the old pool
    c = workspace.pooled(0, 7, {"sp_lists": (60, "i32"), "counters": (5, "u32")}, ("counters",))
    assert calls[-1] == ({"sp_lists": (100, "i32"), "counters": (8, "u32")}, ("counters",))
    assert c.ptrs["ws_o"] == a.ptrs["ws_o"] and c.sizes["sp_lists"] == 100 and c.sizes["ws_o"] == 1000
    assert workspace._retired == [a, b]
    # a new name of 0 elements still gets a buffer (kernels take its address)
    workspace.pooled(0, 7, {"sp_q": (0, "u32")}, ())
    assert calls[-1] == ({"sp_q": (0, "u32")}, ()) and "sp_q" in workspace._pool[(0, 7)].ptrs
    # repeated calls with a large buffer that fits never double it
    for _ in range(5):
        workspace.pooled(0, 7, {"ws_o": (999, "f32"), "sp_lists": (61, "i32")}, ("counters",))
    assert workspace._pool[(0, 7)].sizes["ws_o"] == 1000
