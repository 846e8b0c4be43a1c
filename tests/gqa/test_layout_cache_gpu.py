"""Layout-keyed convenience plans on the GPU (issue #21 item 2): repeated ``gqa_decode`` calls with
the same layout and new tensors every call give each call's own result (no stale address, no stale
tensor map), for every route (short, TMA with and without splits, portable), with and without
``out=``, on CuPy's current stream and on another stream, for CuPy, torch and JAX; address checks
(alignment, out overlapping an input) refuse before any launch; one entry per layout."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu


def _sets(n, B, Hq, Hkv, C, D, seed, dtype=np.float16):
    """n host tensor sets of one layout with different data and lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = rng.standard_normal((B, Hq, D)).astype(dtype)
        kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(dtype)
        lens = np.array([max(1, C - 37 * i - 3 * b) for b in range(B)], np.int32)
        out.append((q, kv, lens))
    return out


# (B, Hq, Hkv, C, D, backend): short route, TMA unsplit / split, portable split
SHAPES = [(2, 32, 8, 64, 128, None), (4, 16, 4, 700, 128, None), (1, 32, 8, 4096, 128, None),
          (1, 16, 2, 3000, 64, None), (1, 32, 8, 2048, 256, None), (1, 32, 8, 4096, 128, "portable")]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_C{}_D{}_{}".format(*s))
@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
def test_new_tensors_every_call_give_their_own_results(shape, with_out, launches):
    """The stale-pointer / stale-tensor-map test: a cached plan that kept the first call's q, kv,
    lengths or KV tensor map would return the first set's result for the later sets."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import api

    B, Hq, Hkv, C, D, backend = shape
    sets = _sets(4, B, Hq, Hkv, C, D, seed=C + D)
    dev = [(cp.asarray(q), cp.asarray(kv), cp.asarray(lens)) for q, kv, lens in sets]
    refs = [gqa_decode_reference(q, kv, lens) for q, kv, lens in sets]
    outs = [cp.full((B, Hq, D), np.nan, np.float16) for _ in sets]
    api._layouts.clear()
    for rnd in range(2):  # second round: every address seen before, in a new order
        order = range(4) if rnd == 0 else (2, 0, 3, 1)
        for i in order:
            dq, dkv, dl = dev[i]
            kw = {"out": outs[i]} if with_out else {}
            got = gqadrv.gqa_decode(dq, dkv, dl, backend=backend, **kw)
            if with_out:
                assert got is outs[i]
            check(cp.asnumpy(got).astype(np.float64), refs[i], "float16", f"layout plan {shape} set {i}")
    assert len(api._layouts) == 1
    assert len(launches) == 8


def test_only_kv_changes_on_the_tma_route():
    """Same q, lengths and out; a second KV cache of the same layout: the TMA route reads K and V
    through the tensor map, so this is the case a stale map would get wrong."""
    import cupy as cp

    import gqadrv

    (q, kv1, lens), (_, kv2, _) = _sets(2, 2, 32, 8, 1000, 128, seed=11)
    dq, dl = cp.asarray(q), cp.asarray(lens)
    d1, d2 = cp.asarray(kv1), cp.asarray(kv2)
    o = cp.empty_like(dq)
    for kv, d in ((kv1, d1), (kv2, d2), (kv1, d1), (kv2, d2)):
        gqadrv.gqa_decode(dq, d, dl, out=o)
        check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "kv swap")


def test_address_checks_refuse_before_any_launch(launches):
    import cupy as cp

    import gqadrv

    (q, kv, lens), = _sets(1, 2, 32, 8, 1000, 128, seed=3)
    dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
    o = cp.full(dq.shape, np.nan, dq.dtype)
    gqadrv.gqa_decode(dq, dkv, dl, out=o)  # the layout is now known
    n = len(launches)
    # out aliasing q, same layout
    with pytest.raises(ValueError, match="must not overlap"):
        gqadrv.gqa_decode(dq, dkv, dl, out=dq)
    # out aliasing the KV cache (a view of the same shape, strides and dtype)
    with pytest.raises(ValueError, match="must not overlap"):
        gqadrv.gqa_decode(dq, dkv, dl, out=dkv.reshape(-1)[: dq.size].reshape(dq.shape))
    # a KV view 8 bytes into a buffer: same layout, misaligned for TMA
    raw = cp.empty(dkv.size + 8, cp.float16)
    mis = raw[4:4 + dkv.size].reshape(dkv.shape)
    mis[...] = dkv
    with pytest.raises(ValueError, match="16-byte aligned"):
        gqadrv.gqa_decode(dq, mis, dl, out=o)
    rawq = cp.empty(dq.size + 4, cp.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gqadrv.gqa_decode(rawq[2:2 + dq.size].reshape(dq.shape), dkv, dl, out=o)
    assert len(launches) == n
    # and the cached plan still works after the refusals
    o2 = cp.full(dq.shape, np.nan, dq.dtype)
    gqadrv.gqa_decode(dq, dkv, dl, out=o2)
    check(cp.asnumpy(o2).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "after refusals")


def test_streams_are_part_of_the_key():
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import api

    sets = _sets(3, 2, 16, 4, 900, 128, seed=21)
    api._layouts.clear()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for st in (None, s1, s2, s1, None):
        for q, kv, lens in sets:
            dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
            got = gqadrv.gqa_decode(dq, dkv, dl, stream=st)
            if st is not None:
                st.synchronize()
            check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", f"stream {st}")
    assert len(api._layouts) == 3
    with s1:  # CuPy's current stream is s1: the default stream of the call
        dq, dkv, dl = (cp.asarray(x) for x in sets[0])
        got = gqadrv.gqa_decode(dq, dkv, dl)
        s1.synchronize()
    check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(*sets[0]), "float16", "current stream s1")
    assert len(api._layouts) == 3  # the same key as stream=s1


def test_workspace_growth_keeps_earlier_plans_valid():
    """Split launches share a pooled workspace per (device, stream); when it grows, the old one is
    retired and kept (captured graphs may still address it). A remembered plan still points at the
    old workspace: were it freed, its counters would be reused memory (here: all bits set) and the
    split merge would never run."""
    import cupy as cp

    import gqadrv
    from gqadrv.ops import workspace as _ws

    small = _sets(2, 1, 16, 2, 2048, 128, seed=5)
    for q, kv, lens in small:
        gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(lens))
    dev, s = cp.cuda.Device().id, cp.cuda.get_current_stream().ptr
    for n in (1 << 22, 1 << 23):  # grow twice: both earlier workspaces are retired
        _ws.pooled(dev, s, {"ws_o": (n, "f32"), "ws_ml": (n // 16, "f32"), "counters": (1 << 14, "u32")},
                   ("counters",))
        cp.cuda.Device().synchronize()
    junk = [cp.full(1 << 18, 0xFFFFFFFF, cp.uint32) for _ in range(64)]  # reuse freed memory, if any
    for q, kv, lens in small:
        got = gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(lens))
        check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "after growth")
    del junk


def test_torch_new_tensors_every_call():
    torch = pytest.importorskip("torch")
    import gqadrv
    from gqadrv.gqa import api

    sets = _sets(4, 2, 32, 8, 1200, 128, seed=8)
    api._layouts.clear()
    for rnd in range(2):
        for q, kv, lens in sets:
            tq, tkv, tl = (torch.from_numpy(x).cuda() for x in (q, kv, lens))
            out = gqadrv.gqa_decode(tq, tkv, tl)
            assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float16
            check(out.cpu().numpy().astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "torch new")
            o = torch.full_like(tq, float("nan"))
            assert gqadrv.gqa_decode(tq, tkv, tl, out=o) is o
            check(o.cpu().numpy().astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "torch out=")
    assert len(api._layouts) == 2  # allocated / given output
    s = torch.cuda.Stream()
    q, kv, lens = sets[0]
    with torch.cuda.stream(s):
        tq, tkv, tl = (torch.from_numpy(x).cuda() for x in (q, kv, lens))
        out = gqadrv.gqa_decode(tq, tkv, tl)   # torch's current stream is s: a new key, torch output
    s.synchronize()
    check(out.cpu().numpy().astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "torch stream s")
    g = torch.zeros_like(tq, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        gqadrv.gqa_decode(g, tkv, tl)


def test_jax_new_arrays_every_call():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gqadrv
    from gqadrv.gqa import api

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    sets = _sets(4, 2, 32, 8, 1200, 128, seed=9)
    api._layouts.clear()
    for _ in range(2):
        for q, kv, lens in sets:
            jq, jkv, jl = jnp.asarray(q), jnp.asarray(kv), jnp.asarray(lens)
            jq = jq * 1  # produced by a JAX computation just dispatched (ordering through JAX)
            out = gqadrv.gqa_decode(jq, jkv, jl)
            assert isinstance(out, jax.Array)
            check(np.asarray(out).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "jax new")
    assert len(api._layouts) == 1


def test_jax_jit_callbacks_take_the_layout_plan(launches):
    """gqadrv.jax.gqa_decode under jax.jit: the callback's XLA buffers (kind 'xla', out given, XLA's
    stream) are served by one layout entry; each execution gets its own result (new buffers and
    lengths every call, some at addresses seen before)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from gqadrv.gqa import api

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    import gqadrv.jax as gj

    sets = _sets(4, 2, 32, 8, 1200, 128, seed=11)
    f = jax.jit(lambda q, kv, lens: gj.gqa_decode(q * 1, kv, lens))
    api._layouts.clear()
    for _ in range(2):
        for q, kv, lens in sets:
            out = f(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(lens))
            check(np.asarray(out).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "jax jit")
    keys = list(api._layouts._map._d)
    assert len(keys) == 1 and keys[0][0] == "xla", keys
    assert len(launches) == 8


def test_lse_and_multi_token_calls_of_a_contiguous_cache(launches):
    """gqa_decode with a 4-D q and return_lse (the paged kernels on the contiguous cache, layout
    "contiguous" of gqa/paged_layouts.py): new tensors every call give their own out and lse; one
    entry; one launch per call."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import paged_layouts
    from gqadrv.gqa.reference import gqa_decode_paged_reference
    from tests.gqa.paged_cases import check_paged

    B, s_q, Hq, Hkv, C, D = 2, 3, 16, 4, 700, 128
    rng = np.random.default_rng(31)
    sets = []
    for i in range(3):
        q = rng.standard_normal((B, s_q, Hq, D)).astype(np.float16)
        kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
        lens = np.array([C - 50 * i - 7 * b for b in range(B)], np.int32)
        table = np.arange(B, dtype=np.int32).reshape(B, 1)   # request b = page b of C tokens (HND)
        ro, rl = gqa_decode_paged_reference(q, kv[:, 0], kv[:, 1], table, lens, kv_layout="HND")
        sets.append((cp.asarray(q), cp.asarray(kv), cp.asarray(lens), ro, rl))
    paged_layouts.layouts.clear()
    for _ in range(2):
        for dq, dkv, dl, ro, rl in sets:
            o, lse = gqadrv.gqa_decode(dq, dkv, dl, return_lse=True)
            check_paged(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "float16", "contiguous LSE layout plan", record=False)
    assert len(paged_layouts.layouts) == 1
    assert len(launches) == 6
