"""DeepSeek sparse MLA decode (``flash_mla_with_kvcache`` / ``prepare_mla_decode`` with ``indices``) on
the GPU against the float64 oracle (gqadrv.mla.sparse_reference):

* the case grid of tests/mla/sparse_decode_cases.py (FP8 uint8 / int8, bf16 and fp16 caches, NaN
  poison in every unreferenced byte and in the padding, every invalid index kind, topk_length, the
  extra pool, sinks, every backend that reads gathered rows) and determinism (a second call with
  the same metadata object is bitwise equal);
* FlashMLA's production shape, small (b 4, s_q 2, h_q 128, topk 2048, page 64);
* a prepared call captured in a CuPy graph, replayed after indices, topk_length, attn_sink and q
  changed in place (topk_length 0, rows and whole batches without a valid index);
* metadata reuse and the configuration mismatch error; caller-given out / lse;
* FP8 equals bf16 on the dequantized cache bitwise (seesaw_fp8 / seesaw, mma_fp8 / mma);
* duplicate indices counted as often as they appear; in-order indices equal the dense decode;
  narrow16 / narrow32 agree with seesaw; out-of-range indices never read (finite rows right
  before and after the pool in the same allocation);
* the contract errors raised before any launch, and torch inputs (when torch is installed).

Tolerances: ``check`` of tests/mla/test_mla_gpu.py (the dense MLA tolerances), plus a tight LSE
bound (LSE_TIGHT): with topk 2048 the dense bound (1e-3 + 1e-3 |lse|) cannot see one key dropped or
counted twice (~5e-4), while the dense kernels' LSE is within ~1.5e-6 of the oracle (test logs).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gqadrv.mla.reference import mla_decode_reference
from tests.mla.sparse_decode_cases import (
    INT_MAX,
    INT_MIN,
    SCALE_055,
    Layout,
    Pool,
    build,
    data_oracle,
    device_args,
    device_cache,
    device_indices,
    device_q,
    draw_indices,
    draw_q,
    draw_sink,
    fill_invalid,
    fill_pool,
    grid,
    is_fp8,
    make_layout,
    make_pool,
    np_dtype,
    oracle,
    ordered_indices,
    q_dtype,
)
from tests.mla.test_mla_gpu import check

pytestmark = pytest.mark.gpu

LSE_TIGHT = (3e-5, 3e-6)  # |lse - oracle| <= abs + rel * |oracle| (finite rows)


# ----------------------------------------------------------------------------- helpers
def check_sparse(got_o, got_l, ref_o, ref_l, dtype, label):
    """``check`` (dense MLA tolerances), the tight LSE bound, and exact zeros where the oracle's
    output row is zero (no valid key, or a +inf sink)."""
    got_o, got_l = _host(got_o), _host(got_l)
    check(got_o, got_l, ref_o, ref_l, dtype, label)
    gl = np.asarray(got_l, np.float64)
    fin = np.isfinite(ref_l)
    if fin.any():
        err = np.abs(gl[fin] - ref_l[fin])
        bound = LSE_TIGHT[0] + LSE_TIGHT[1] * np.abs(ref_l[fin])
        assert (err <= bound).all(), f"{label}: lse off by {err.max():.3e} (tight bound {LSE_TIGHT})"
    zero = (ref_o == 0).all(axis=-1)
    g = np.asarray(got_o, np.float64)
    assert (g[zero] == 0).all(), f"{label}: rows without keys (or with a +inf sink) not exactly 0"


def _host(x):
    import cupy as cp

    return cp.asnumpy(x) if isinstance(x, cp.ndarray) else x


def _bits(x):
    import cupy as cp

    return x.view({1: cp.uint8, 2: cp.uint16, 4: cp.uint32}[x.dtype.itemsize])


def same_bits(a, b) -> bool:
    import cupy as cp

    return a.shape == b.shape and a.dtype == b.dtype and bool(cp.array_equal(_bits(a), _bits(b)))


def sparse_call(args: dict, **kw):
    import gqadrv

    return gqadrv.flash_mla_with_kvcache(**args, **kw)


def pool_args(p: Pool, kv: str, prefix: str = "", page_pad: int = 1, idx_pad: int = 0) -> dict:
    """Device keyword arguments of one pool: k_cache / indices / topk_length, or with prefix 'extra_'
    extra_k_cache / extra_indices_in_kvcache / extra_topk_length."""
    import cupy as cp

    k = device_cache(p.cache, kv, page_pad=page_pad)
    idx = device_indices(p.indices, idx_pad, p.pad_slot)
    tl = None if p.topk_length is None else cp.asarray(p.topk_length)
    if prefix:
        return {"extra_k_cache": k, "extra_indices_in_kvcache": idx, "extra_topk_length": tl}
    return {"k_cache": k, "indices": idx, "topk_length": tl}


def small_setup(kv="fp8_u8", b=2, s_q=2, h_q=16, main=(300, 64, 16), extra=None, seed=5, sink=True,
                topk_length=True, fill_all=False):
    """(host q, main pool, extra pool or None, sink or None, device kwargs)."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    q = draw_q(rng, b, s_q, h_q, kv)
    mp = make_pool(rng, b, s_q, main, kv, varlen=True, with_topk_length=topk_length, fill_all=fill_all)
    ep = make_pool(rng, b, s_q, extra, kv, with_topk_length=topk_length, kind_offset=3,
                   fill_all=fill_all) if extra else None
    sk = draw_sink(rng, h_q) if sink else None
    args = dict(q=cp.asarray(q), is_fp8_kvcache=is_fp8(kv), attn_sink=None if sk is None else cp.asarray(sk),
                **pool_args(mp, kv))
    if ep is not None:
        args.update(pool_args(ep, kv, "extra_", page_pad=2))
    return q, mp, ep, sk, args


# ----------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("case", grid(), ids=lambda c: c.label)
def test_sparse_oracle_grid(case):
    import cupy as cp

    import gqadrv

    d = build(case)
    args = device_args(case, d)
    meta, _ = gqadrv.get_mla_metadata()
    o, lse = gqadrv.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, num_splits=case.splits,
                                           backend=case.backend)
    assert isinstance(o, cp.ndarray) and isinstance(lse, cp.ndarray)
    assert o.shape == (case.b, case.s_q, case.h_q, 512) and o.dtype == np_dtype(case.kv)
    assert lse.shape == (case.b, case.h_q, case.s_q) and lse.dtype == cp.float32
    ro, rl = data_oracle(d)
    check_sparse(o, lse, ro, rl, case.dtype, f"sparse grid {case.kv} {case.backend or 'auto'}")
    # the same call again, the metadata object reused: bitwise identical
    o2, lse2 = gqadrv.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, num_splits=case.splits,
                                             backend=case.backend)
    assert same_bits(o2, o) and same_bits(lse2, lse), f"{case.label}: not deterministic"


@pytest.mark.parametrize("kv", ["fp8_u8", "bf16"])
def test_production_shape_small(kv):
    """FlashMLA's V3.2 production shape with a small batch: b 4, s_q 2, h_q 128, topk 2048, page 64,
    varlen lengths up to 8192 (one request empty), sinks, softmax_scale 576 ** -0.55."""
    import cupy as cp

    rng = np.random.default_rng(64)
    b, s_q, h_q = 4, 2, 128
    q = draw_q(rng, b, s_q, h_q, kv)
    mp = make_pool(rng, b, s_q, (8192, 2048, 64), kv, varlen=True)
    sink = draw_sink(rng, h_q)
    args = {"q": device_q(q, "tokens"), "is_fp8_kvcache": is_fp8(kv), "attn_sink": cp.asarray(sink),
            **pool_args(mp, kv)}
    o, lse = sparse_call(args, softmax_scale=SCALE_055)
    ro, rl = oracle(q, mp, None, sink, SCALE_055)
    check_sparse(o, lse, ro, rl, "bfloat16", f"sparse production {kv}")
    o2, lse2 = sparse_call(args, softmax_scale=SCALE_055)
    assert same_bits(o, o2) and same_bits(lse, lse2)


# ----------------------------------------------------------------------------- graphs and prepared calls
_GRAPH = [  # (kv, with extra pool, splits, q view)
    ("fp8_u8", False, None, "tokens"),
    ("fp8_i8", True, 3, "wide"),
    ("bf16", True, None, "tokens"),
    ("bf16", False, 1, "dense"),
]


@pytest.mark.parametrize("kv,with_extra,splits,q_view", _GRAPH, ids=lambda v: str(v))
def test_graph_replay_follows_indices_lengths_sink_and_q(kv, with_extra, splits, q_view):
    """One prepared sparse decode captured in a CuPy graph; indices, topk_length, attn_sink and q (and
    the extra pool's indices / lengths) change in place between replays; every replay matches the
    oracle, including topk_length 0, a request without valid indices and a batch without any."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(17 + 2 * with_extra + len(q_view))
    b, s_q, h_q = 3, 2, 64
    q0 = draw_q(rng, b, s_q, h_q, kv)
    mp = make_pool(rng, b, s_q, (700, 130, 61), kv, with_topk_length=True, fill_all=True, lengths=[700, 333, 5])
    ep = make_pool(rng, b, s_q, (300, 70, 16), kv, with_topk_length=True, fill_all=True, kind_offset=2,
                   lengths=[0, 300, 41]) if with_extra else None
    sink0 = draw_sink(rng, h_q)
    dq = device_q(q0, q_view)
    dsink = cp.asarray(sink0)
    args = dict(q=dq, is_fp8_kvcache=is_fp8(kv), attn_sink=dsink, **pool_args(mp, kv, idx_pad=3))
    if ep is not None:
        args.update(pool_args(ep, kv, "extra_", page_pad=2))
    o = cp.full((b, s_q, h_q, 512), np.nan, np_dtype(kv))
    lse = cp.full((b, h_q, s_q), np.nan, cp.float32)
    st = cp.cuda.Stream(non_blocking=True)
    p = gqadrv.prepare_mla_decode(**args, out=o, lse=lse, num_splits=splits, stream=st)
    r = gqadrv.launch_prepared(p)
    assert r[0] is o and r[1] is lse
    st.synchronize()
    check_sparse(o, lse, *oracle(q0, mp, ep, sink0), q_dtype(kv), "sparse prepared")
    with st:
        st.begin_capture()
        gqadrv.launch_prepared(p)
        g = st.end_capture()

    topk = mp.indices.shape[-1]
    etopk = ep.indices.shape[-1] if ep else 0
    alt = np.where(np.arange(h_q) % 2 == 0, np.inf, -np.inf).astype(np.float32)
    states = []
    # 1: new permutations, topk_length with 0, finite sinks
    idx = draw_indices(rng, mp.layout, s_q, topk, 1)
    eidx = draw_indices(rng, ep.layout, s_q, etopk, 4) if ep else None
    states.append((q0, idx, [topk, 0, 5], rng.standard_normal(h_q).astype(np.float32), eidx, [etopk, 7, 0]))
    # 2: request 1 without a valid index, topk_length clamped from both sides, +-inf sinks, a new q
    idx = draw_indices(rng, mp.layout, s_q, topk, 2)
    fill_invalid(idx[1], np.ones((s_q, topk), bool), mp.layout.slots, 5)
    states.append((draw_q(rng, b, s_q, h_q, kv), idx, [10**6, topk, -3], alt, eidx, [-1, etopk + 9, 3]))
    # 3: no valid index anywhere (out 0, lse +inf everywhere)
    dead = np.zeros_like(mp.indices)
    fill_invalid(dead, np.ones(dead.shape, bool), mp.layout.slots, 0)
    edead = None
    if ep:
        edead = np.zeros_like(ep.indices)
        fill_invalid(edead, np.ones(edead.shape, bool), ep.layout.slots, 3)
    states.append((states[-1][0], dead, [topk] * 3, sink0, edead, [etopk] * 3))
    # 4: topk_length 0 for every request (only the extra pool counts, when there is one)
    states.append((q0, mp.indices, [0, 0, 0], sink0, ep.indices if ep else None, [etopk, 2, 70]))
    # 5: back to the first state
    states.append((q0, mp.indices, mp.topk_length, sink0, ep.indices if ep else None,
                   ep.topk_length if ep else None))
    for n, (qh, idx, tl, sk, eidx, etl) in enumerate(states):
        tl = np.asarray(tl, np.int32)
        dq[...] = cp.asarray(qh)
        args["indices"][...] = cp.asarray(idx)
        args["topk_length"].set(tl)
        dsink.set(np.asarray(sk, np.float32))
        m = dataclasses.replace(mp, indices=np.asarray(idx, np.int32), topk_length=tl)
        e = None
        if ep:
            etl = np.asarray(etl, np.int32)
            args["extra_indices_in_kvcache"][...] = cp.asarray(eidx)
            args["extra_topk_length"].set(etl)
            e = dataclasses.replace(ep, indices=np.asarray(eidx, np.int32), topk_length=etl)
        cp.cuda.Device().synchronize()
        g.launch(st)
        st.synchronize()
        ro, rl = oracle(qh, m, e, sk)
        if n == 1 and not ep:
            assert np.isposinf(rl[1]).all()                     # request 1 without a valid index
        if n == 2 or (n == 3 and not ep):
            assert np.isposinf(rl).all() and (ro == 0).all()    # no valid index anywhere
        check_sparse(o, lse, ro, rl, q_dtype(kv), f"sparse graph replay {kv}")


def test_metadata_reuse_and_mismatch():
    """One metadata object serves calls of one configuration whatever the index values; another
    topk, h_q, page, extra pool or a dense call with it raises before any launch."""
    import cupy as cp

    import gqadrv

    q, mp, _, sink, args = small_setup("bf16", main=(300, 64, 64), fill_all=True)
    meta, _ = gqadrv.get_mla_metadata()
    assert not meta.have_initialized
    o1, l1 = sparse_call(args, tile_scheduler_metadata=meta)
    assert meta.have_initialized
    check_sparse(o1, l1, *oracle(q, mp, None, sink), "bfloat16", "sparse metadata")
    # new index values and lengths, same shapes: the same object serves
    rng = np.random.default_rng(9)
    idx = draw_indices(rng, mp.layout, 2, 64, 1)
    args["indices"][...] = cp.asarray(idx)
    args["topk_length"].set(np.array([64, 13], np.int32))
    o2, l2 = sparse_call(args, tile_scheduler_metadata=meta)
    m2 = dataclasses.replace(mp, indices=idx, topk_length=np.array([64, 13], np.int32))
    check_sparse(o2, l2, *oracle(q, m2, None, sink), "bfloat16", "sparse metadata")
    o3, l3 = sparse_call(args, tile_scheduler_metadata=meta)
    assert same_bits(o2, o3) and same_bits(l2, l3)
    match = "tile_scheduler_metadata was initialised"
    with pytest.raises(ValueError, match=match):  # another topk
        sparse_call({**args, "indices": args["indices"][..., :63]}, tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match=match):  # another h_q
        sparse_call({**args, "q": args["q"][:, :, :8], "attn_sink": args["attn_sink"][:8]},
                    tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match=match):  # another page size
        k2 = cp.ascontiguousarray(args["k_cache"]).reshape(-1, 32, 1, 576)
        sparse_call({**args, "k_cache": k2}, tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match=match):  # an extra pool
        sparse_call({**args, **pool_args(mp, "bf16", "extra_")}, tile_scheduler_metadata=meta)
    with pytest.raises(ValueError, match=match):  # dense decode with the sparse call's metadata
        gqadrv.flash_mla_with_kvcache(args["q"], args["k_cache"], cp.asarray(mp.layout.table),
                                      cp.asarray(mp.layout.lengths), 512, meta)
    # a fresh object for the other configuration works
    meta2, _ = gqadrv.get_mla_metadata()
    sparse_call({**args, "indices": args["indices"][..., :63]}, tile_scheduler_metadata=meta2)


@pytest.mark.parametrize("s_q", [1, 3])
def test_caller_given_out_and_lse(s_q):
    """out (a view of a wider buffer) and lse given: filled, returned as the same objects, by the
    convenience call and by a prepared call; both paths bitwise equal."""
    import cupy as cp

    import gqadrv

    q, mp, ep, sink, args = small_setup("fp8_u8", b=3, s_q=s_q, h_q=32, main=(512, 130, 69), extra=(100, 9, 5))
    ro, rl = oracle(q, mp, ep, sink)

    def buffers():
        ow = cp.full((3, s_q, 32, 640), np.nan, np_dtype("fp8_u8"))
        return ow[..., :512], cp.full((3, 32, s_q), np.nan, cp.float32)

    o, lse = buffers()
    r = sparse_call(args, out=o, lse=lse)
    assert r[0] is o and r[1] is lse
    check_sparse(o, lse, ro, rl, "bfloat16", "sparse out=")
    o2, lse2 = buffers()
    p = gqadrv.prepare_mla_decode(**args, out=o2, lse=lse2)
    r2 = gqadrv.launch_prepared(p)
    assert r2[0] is o2 and r2[1] is lse2
    cp.cuda.Device().synchronize()
    assert same_bits(o2, o) and same_bits(lse2, lse)
    # a prepared call without buffers returns its own, the same arrays at every launch
    p3 = gqadrv.prepare_mla_decode(**args)
    a = gqadrv.launch_prepared(p3)
    a2 = gqadrv.launch_prepared(p3)
    assert a[0] is a2[0] and a[1] is a2[1]
    cp.cuda.Device().synchronize()
    assert same_bits(a[0], o) and same_bits(a[1], lse)


# ----------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("fp8_backend,bf16_backend", [("seesaw_fp8", "seesaw"), ("mma_fp8", "mma")])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_equals_bf16_on_dequantized_cache(fp8_backend, bf16_backend, splits):
    """The FP8 kernels write exactly the bf16 tile dequantize_k_cache gives: sparse decode on the FP8
    pools is bitwise equal to sparse decode on their dequantized copies (both pools, sinks,
    topk_length; scales of every third page not powers of two: the exact dequantization path)."""
    import cupy as cp

    from gqadrv.mla import dequantize_k_cache

    rng = np.random.default_rng(23)
    b, s_q, h_q = 3, 2, 64
    q = draw_q(rng, b, s_q, h_q, "fp8_u8")
    pools = []
    for triple, off in (((650, 200, 53), 0), ((300, 40, 16), 3)):
        p = make_pool(rng, b, s_q, triple, "fp8_u8", varlen=True, with_topk_length=True, kind_offset=off)
        k8 = p.cache.copy()
        live = ~(k8[..., 512:528] == 0xFF).all(axis=-1)                  # not the NaN poison
        sc = np.ascontiguousarray(k8[..., 512:528]).view("<f4").copy()
        sel = live[..., None] & (np.arange(k8.shape[0]) % 3 == 0)[:, None, None, None]
        sc = np.where(sel, sc * np.float32(1.37), sc).astype("<f4")
        k8[..., 512:528] = sc.view(np.uint8)
        pools.append(dataclasses.replace(p, cache=k8))
    sink = draw_sink(rng, h_q)
    common = {"q": cp.asarray(q), "attn_sink": cp.asarray(sink), "num_splits": splits}
    a8 = {**pool_args(pools[0], "fp8_u8"), **pool_args(pools[1], "fp8_u8", "extra_", page_pad=2)}
    o8, l8 = sparse_call({**common, **a8}, is_fp8_kvcache=True, backend=fp8_backend)
    a16 = dict(a8, k_cache=dequantize_k_cache(a8["k_cache"]), extra_k_cache=dequantize_k_cache(a8["extra_k_cache"]))
    o16, l16 = sparse_call({**common, **a16}, backend=bf16_backend)
    cp.cuda.Device().synchronize()
    assert same_bits(o8, o16), f"{fp8_backend} vs {bf16_backend}: out differs"
    assert same_bits(l8, l16), f"{fp8_backend} vs {bf16_backend}: lse differs"
    # and both match the oracle on the numbers of the modified bytes
    from gqadrv.mla.fp8_reference import dequantize_k_cache_reference

    m, e = (dataclasses.replace(p, numbers=dequantize_k_cache_reference(p.cache)) for p in pools)
    check_sparse(o8, l8, *oracle(q, m, e, sink), "bfloat16", f"sparse fp8 exact {fp8_backend}")


@pytest.mark.parametrize("kv", ["fp8_u8", "bf16"])
def test_duplicate_indices_count_twice(kv):
    """An index listed n times is n keys (FlashMLA's semantics, the oracle's): rows of 40 distinct
    slots, 40 more drawn from them with replacement, one slot 16 times more; topk_length cuts inside
    the duplicates."""
    import cupy as cp

    rng = np.random.default_rng(31)
    b, s_q, h_q, topk = 2, 2, 32, 96
    layout = make_layout(rng, b, 200, 16, False)
    cache, numbers = fill_pool(rng, layout, layout.all_slots(), kv)
    idx = np.zeros((b, s_q, topk), np.int64)
    dedup = np.full((b, s_q, topk), -1, np.int64)
    for i in range(b):
        for t in range(s_q):
            base = layout.slot(i, rng.choice(200, 40, replace=False))
            row = np.concatenate([base, rng.choice(base, 40), np.full(16, base[t])])
            idx[i, t] = rng.permutation(row)
            u = np.unique(row)
            dedup[i, t, : u.size] = u
    tl = np.array([topk, 70], np.int32)
    q = draw_q(rng, b, s_q, h_q, kv)
    pool = Pool(layout, cache, numbers, idx.astype(np.int32), tl)
    ro, rl = oracle(q, pool)
    _, rl_dedup = oracle(q, dataclasses.replace(pool, indices=dedup.astype(np.int32), topk_length=None))
    assert np.abs(rl - rl_dedup).max() > 1e-2  # the duplicates matter
    o, lse = sparse_call(dict(q=cp.asarray(q), is_fp8_kvcache=is_fp8(kv), **pool_args(pool, kv)))
    check_sparse(o, lse, ro, rl, "bfloat16", f"sparse duplicates {kv}")


@pytest.mark.parametrize("kv", ["fp8_u8", "bf16"])
@pytest.mark.parametrize("lengths", [[320, 320, 320], [320, 257, 64, 1, 0]], ids=["full", "ragged"])
def test_in_order_indices_equal_dense_decode(kv, lengths):
    """Indices naming every token < len of each request in order (then -1) on the dense decode's own
    paged cache: the sparse result equals the dense decode (block_table / cache_seqlens) within the
    tolerances, and both equal the oracle."""
    import cupy as cp

    rng = np.random.default_rng(41 + len(lengths))
    b, s_q, h_q, page, s_k = len(lengths), 2, 64, 64, 320
    layout = make_layout(rng, b, s_k, page, False, lengths)
    cache, numbers = fill_pool(rng, layout, layout.all_slots(), kv)
    pool = Pool(layout, cache, numbers, ordered_indices(layout, s_q, s_k), None)
    q = draw_q(rng, b, s_q, h_q, kv)
    dq, dk = cp.asarray(q), device_cache(cache, kv)
    ro, rl = oracle(q, pool)
    do, _ = mla_decode_reference(q, numbers, layout.table, layout.lengths, 512, None, False)
    np.testing.assert_allclose(do, ro, rtol=1e-9, atol=1e-12)  # the two oracles agree
    import gqadrv

    so, sl = gqadrv.flash_mla_with_kvcache(dq, dk, None, None, 512, is_fp8_kvcache=is_fp8(kv),
                                           indices=device_indices(pool.indices))
    o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, cp.asarray(layout.table), cp.asarray(layout.lengths), 512,
                                           is_fp8_kvcache=is_fp8(kv))
    check_sparse(so, sl, ro, rl, "bfloat16", f"sparse in-order {kv}")
    check(cp.asnumpy(o), cp.asnumpy(lse), ro, rl, "bfloat16", f"dense for sparse in-order {kv}")
    check(cp.asnumpy(so), cp.asnumpy(sl), cp.asnumpy(o).astype(np.float64), cp.asnumpy(lse).astype(np.float64),
          "bfloat16", f"sparse vs dense {kv}")


@pytest.mark.parametrize("narrow,h_q,s_q", [("narrow16", 16, 2), ("narrow16", 5, 1), ("narrow32", 32, 3),
                                            ("narrow32", 17, 1)])
def test_narrow_kernels_agree_with_seesaw(narrow, h_q, s_q):
    """h_q <= 16 (narrow16) / <= 32 (narrow32) through the narrow kernels and through seesaw: both
    within tolerance of the oracle and of each other (any s_q: each query token is its own row)."""
    q, mp, ep, sink, args = small_setup("bf16", b=5, s_q=s_q, h_q=h_q, main=(512, 200, 2), extra=(300, 37, 16),
                                        seed=h_q)
    ro, rl = oracle(q, mp, ep, sink)
    no, nl = sparse_call(args, backend=narrow)
    so, sl = sparse_call(args, backend="seesaw")
    check_sparse(no, nl, ro, rl, "bfloat16", f"sparse {narrow}")
    check_sparse(so, sl, ro, rl, "bfloat16", "sparse seesaw (narrow twin)")
    check(_host(no), _host(nl), _host(so).astype(np.float64), _host(sl).astype(np.float64), "bfloat16",
          f"sparse {narrow} vs seesaw")


@pytest.mark.parametrize("kv", ["fp8_u8", "bf16"])
@pytest.mark.parametrize("pre", [0, 2])
def test_out_of_range_indices_are_never_read(kv, pre):
    """k_cache = pages [pre, pre + 4) of one allocation, extra_k_cache = the 3 pages right after, every
    row of the allocation finite data. Indices just past each pool's end, at the next pool's rows,
    negative, INT_MIN / INT_MAX...: with only such indices the result is the all-invalid one (out 0,
    lse +inf, whatever the sink); mixed with valid ones, the oracle's."""
    import cupy as cp

    rng = np.random.default_rng(53 + pre)
    b, s_q, h_q, page, nb, post, topk = 2, 2, 16, 64, 4, 3, 77
    total = pre + nb + post
    whole = Layout(page, total, np.array([total * page], np.int32), np.arange(total, dtype=np.int32)[None],
                   np.zeros(0, np.int64))
    cache, numbers = fill_pool(rng, whole, np.arange(total * page), kv)
    full = device_cache(cache, kv, page_pad=0)
    assert full.flags.c_contiguous
    dk, dek = full[pre: pre + nb], full[pre + nb:]
    n, en = nb * page, post * page
    bad = [n, n + 1, n + page - 1, n + page, n + en - 1, 2 * n, 2147480000, INT_MAX, -1, -2, -page,
           -(pre * page) if pre else -3, -n, -123456, INT_MIN]
    ebad = [en, en + 1, -1, -n, -n - pre * page if pre else -5, INT_MAX, INT_MIN, 2147480000]
    idx = np.resize(np.array(bad, np.int64), (b, s_q, topk))
    eidx = np.resize(np.array(ebad, np.int64), (b, s_q, 13))
    q = draw_q(rng, b, s_q, h_q, kv)
    sink = draw_sink(rng, h_q)
    common = {"q": cp.asarray(q), "k_cache": dk, "extra_k_cache": dek, "is_fp8_kvcache": is_fp8(kv),
              "attn_sink": cp.asarray(sink)}
    o, lse = sparse_call(dict(common, indices=device_indices(idx), extra_indices_in_kvcache=device_indices(eidx)))
    assert bool((o.astype(cp.float32) == 0).all()), "an out-of-range index was read"
    assert bool(cp.isposinf(lse).all()), "an out-of-range index was read"
    # mixed: every third entry valid (request i: pages 2i and 2i + 1 of the pool)
    main_slots = np.arange(n)
    idx2, eidx2 = idx.copy(), eidx.copy()
    idx2[..., ::3] = rng.choice(main_slots, size=idx2[..., ::3].shape)
    eidx2[..., 1::4] = rng.choice(en, size=eidx2[..., 1::4].shape)
    mp = Pool(whole, None, numbers.reshape(total, page, 1, 576)[pre: pre + nb], idx2.astype(np.int32), None)
    ep = Pool(whole, None, numbers.reshape(total, page, 1, 576)[pre + nb:], eidx2.astype(np.int32), None)
    o, lse = sparse_call(dict(common, indices=device_indices(idx2), extra_indices_in_kvcache=device_indices(eidx2)))
    check_sparse(o, lse, *oracle(q, mp, ep, sink), "bfloat16", f"sparse out-of-range mixed {kv}")


# ----------------------------------------------------------------------------- contract
def _set(**kw):
    def f(a, cp):
        a.update({k: (v(a, cp) if callable(v) else v) for k, v in kw.items()})
    return f


def _i32(*shape):
    return lambda a, cp: cp.zeros(shape, cp.int32)


_ERRORS = [  # (id, cache, change of the valid arguments, exception, match); b 2, s_q 2, h_q 16, topk 10
    ("indices-int64", "fp8_u8", _set(indices=lambda a, cp: a["indices"].astype(cp.int64)), TypeError, "indices"),
    ("indices-float", "bf16", _set(indices=lambda a, cp: a["indices"].astype(cp.float32)), TypeError, "indices"),
    ("indices-batch", "fp8_u8", _set(indices=_i32(3, 2, 10)), ValueError, "indices"),
    ("indices-s_q", "fp8_u8", _set(indices=_i32(2, 1, 10)), ValueError, "indices"),
    ("indices-topk0", "fp8_u8", _set(indices=_i32(2, 2, 0)), ValueError, "indices"),
    ("indices-2d", "bf16", _set(indices=_i32(2, 10)), ValueError, "indices"),
    ("indices-last-dim-strided", "fp8_u8", _set(indices=lambda a, cp: cp.zeros((2, 2, 20), cp.int32)[..., ::2]),
     ValueError, "indices"),
    ("sink-float64", "fp8_u8", _set(attn_sink=lambda a, cp: cp.zeros(16, cp.float64)), TypeError, "attn_sink"),
    ("sink-float16", "bf16", _set(attn_sink=lambda a, cp: cp.zeros(16, cp.float16)), TypeError, "attn_sink"),
    ("sink-shape", "fp8_u8", _set(attn_sink=lambda a, cp: cp.zeros(15, cp.float32)), ValueError, "attn_sink"),
    ("sink-2d", "bf16", _set(attn_sink=lambda a, cp: cp.zeros((1, 16), cp.float32)), ValueError, "attn_sink"),
    ("topk_length-int64", "fp8_u8", _set(topk_length=lambda a, cp: cp.zeros(2, cp.int64)), TypeError,
     "topk_length"),
    ("topk_length-shape", "bf16", _set(topk_length=_i32(3)), ValueError, "topk_length"),
    ("topk_length-2d", "fp8_u8", _set(topk_length=_i32(2, 2)), ValueError, "topk_length"),
    ("extra-indices-alone", "fp8_u8", _set(extra_indices_in_kvcache=_i32(2, 2, 4)), ValueError, "extra"),
    ("extra-cache-alone", "fp8_u8", _set(extra_k_cache=lambda a, cp: a["k_cache"]), ValueError, "extra"),
    ("extra-topk_length-alone", "bf16", _set(extra_topk_length=_i32(2)), ValueError, "extra_topk_length"),
    ("extra-indices-batch", "fp8_u8", _set(extra_k_cache=lambda a, cp: a["k_cache"],
                                           extra_indices_in_kvcache=_i32(1, 2, 4)), ValueError, "extra_indices"),
    ("extra-topk_length-shape", "fp8_u8", _set(extra_k_cache=lambda a, cp: a["k_cache"],
                                               extra_indices_in_kvcache=_i32(2, 2, 4), extra_topk_length=_i32(4)),
     ValueError, "extra_topk_length"),
    ("extra-dtype", "bf16", _set(extra_k_cache=lambda a, cp: cp.zeros((3, 5, 1, 576), cp.float16),
                                 extra_indices_in_kvcache=_i32(2, 2, 4)), TypeError, "extra_k_cache"),
    ("extra-format", "fp8_u8", _set(extra_k_cache=lambda a, cp: cp.zeros((3, 5, 1, 576), np_dtype("bf16")),
                                    extra_indices_in_kvcache=_i32(2, 2, 4)), (TypeError, ValueError), "extra_k_cache"),
    ("fp16-q-fp8-cache", "fp8_u8", _set(q=lambda a, cp: a["q"].astype(cp.float16)), TypeError, "bfloat16"),
    ("q-cache-dtypes", "bf16", _set(q=lambda a, cp: a["q"].astype(cp.float16)), TypeError, "k_cache"),
    ("q-float32", "bf16", _set(q=lambda a, cp: a["q"].astype(cp.float32)), TypeError, "q"),
    ("h_kv-2-fp8", "fp8_u8", _set(k_cache=lambda a, cp: cp.zeros((3, 5, 2, 656), cp.uint8)), ValueError, "h_kv"),
    ("h_kv-2-bf16", "bf16", _set(k_cache=lambda a, cp: cp.zeros((3, 5, 2, 576), np_dtype("bf16"))), ValueError,
     "h_kv"),
    ("fp8-row-640", "fp8_u8", _set(k_cache=lambda a, cp: cp.zeros((3, 5, 1, 640), cp.uint8)), ValueError, "656"),
    ("bf16-row-512", "bf16", _set(k_cache=lambda a, cp: cp.zeros((3, 5, 1, 512), np_dtype("bf16"))), ValueError,
     "576"),
    ("fp8-row-stride-664", "fp8_u8", _set(k_cache=lambda a, cp: cp.zeros((3, 5, 1, 664), cp.uint8)[..., :656]),
     ValueError, "16"),
    ("fp8-cache-without-flag", "fp8_u8", _set(is_fp8_kvcache=False), (TypeError, ValueError), "is_fp8_kvcache|576"),
    ("bf16-cache-with-flag", "bf16", _set(is_fp8_kvcache=True), (TypeError, ValueError), "k_cache|bfloat16|656"),
    ("causal", "fp8_u8", _set(causal=True), ValueError, "causal"),
    ("head_dim_v", "bf16", _set(head_dim_v=256), ValueError, "head_dim_v"),
    ("tma-seesaw", "bf16", _set(backend="seesaw_tma"), (ValueError, NotImplementedError), "(?i)tma"),
    ("tma-narrow16", "bf16", _set(backend="narrow16_tma"), (ValueError, NotImplementedError), "(?i)tma"),
    ("tma-narrow32", "bf16", _set(backend="narrow32_tma"), (ValueError, NotImplementedError), "(?i)tma"),
    ("narrow16-h_q-32", "bf16", _set(q=lambda a, cp: cp.zeros((2, 2, 32, 576), np_dtype("bf16")), attn_sink=None,
                                     backend="narrow16"), ValueError, "narrow16"),
    ("fp8-backend-bf16-cache", "bf16", _set(backend="seesaw_fp8"), ValueError, "seesaw_fp8"),
    ("bf16-backend-fp8-cache", "fp8_u8", _set(backend="mma"), ValueError, "mma"),
    ("num_splits-0", "fp8_u8", _set(num_splits=0), ValueError, "num_splits"),
    ("out-shape", "fp8_u8", _set(out=lambda a, cp: cp.zeros((2, 2, 16, 576), np_dtype("bf16"))), ValueError, "out"),
    ("lse-dtype", "bf16", _set(lse=lambda a, cp: cp.zeros((2, 16, 2), cp.float16)), TypeError, "lse"),
]


@pytest.mark.parametrize("entry", ["call", "prepare"])
@pytest.mark.parametrize("err", _ERRORS, ids=lambda e: e[0])
def test_contract_errors(err, entry):
    import cupy as cp

    import gqadrv

    _, kv, change, exc, match = err
    _, _, _, _, args = small_setup(kv, b=2, s_q=2, h_q=16, main=(30, 10, 5))
    args["head_dim_v"] = 512
    change(args, cp)
    f = gqadrv.flash_mla_with_kvcache if entry == "call" else gqadrv.prepare_mla_decode
    with pytest.raises(exc, match=match):
        f(**args)


def test_valid_small_setup_runs():
    """The unchanged arguments of test_contract_errors are valid (so each error above is the change's)."""
    import gqadrv

    for kv in ("fp8_u8", "bf16"):
        q, mp, _, sink, args = small_setup(kv, b=2, s_q=2, h_q=16, main=(30, 10, 5))
        o, lse = gqadrv.flash_mla_with_kvcache(**args, head_dim_v=512)
        check_sparse(o, lse, *oracle(q, mp, None, sink), "bfloat16", f"sparse contract base {kv}")
        p = gqadrv.prepare_mla_decode(**args, head_dim_v=512)
        o2, lse2 = gqadrv.launch_prepared(p)
        check_sparse(o2, lse2, *oracle(q, mp, None, sink), "bfloat16", f"sparse contract base {kv}")


# ----------------------------------------------------------------------------- torch
@pytest.mark.parametrize("cache_dtype", ["uint8", "float8_e4m3fn", "bfloat16"])
def test_torch_inputs_match_cupy(cache_dtype):
    """torch bf16 q, a torch uint8 / float8_e4m3fn FP8 cache (or a bf16 cache), torch indices, lengths
    and sinks: torch outputs, bitwise equal to the CuPy path."""
    torch = pytest.importorskip("torch")
    if cache_dtype == "float8_e4m3fn" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    import cupy as cp

    import gqadrv

    kv = "bf16" if cache_dtype == "bfloat16" else "fp8_u8"
    q, mp, ep, sink, args = small_setup(kv, b=2, s_q=2, h_q=16, main=(300, 64, 16), extra=(100, 20, 3))
    co, cl = sparse_call(args)

    def t(a):
        a = np.ascontiguousarray(a)
        if a.dtype == np_dtype("bf16"):
            return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(a).cuda()

    def cache(c):
        tc = t(c)
        return tc.view(torch.float8_e4m3fn) if cache_dtype == "float8_e4m3fn" else tc

    o, lse = gqadrv.flash_mla_with_kvcache(
        t(q), cache(mp.cache), None, None, 512, None, is_fp8_kvcache=is_fp8(kv), indices=t(mp.indices),
        attn_sink=t(sink), topk_length=t(mp.topk_length), extra_k_cache=cache(ep.cache),
        extra_indices_in_kvcache=t(ep.indices), extra_topk_length=t(ep.topk_length))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert o.shape == (2, 2, 16, 512) and lse.shape == (2, 16, 2)
    torch.cuda.synchronize()
    assert np.array_equal(o.view(torch.int16).cpu().numpy(), cp.asnumpy(co.view(cp.int16)))
    assert np.array_equal(lse.view(torch.int32).cpu().numpy(), cp.asnumpy(cl.view(cp.int32)))
    check_sparse(o.float().cpu().numpy(), lse.cpu().numpy(), *oracle(q, mp, ep, sink), "bfloat16",
                 f"sparse torch {cache_dtype}")
