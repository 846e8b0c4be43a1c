"""LSE state merge on the GPU (gqadrv.merge_state / merge_states) against a float64 oracle built from
real attention: random queries, keys and values per row; the key set split into K contiguous parts
(some parts may be empty); each part's (v_i, s_i) computed in float64 (ops.oracle.attend), v_i cast
to the tested dtype and s_i to float32; the merged state must match attention over all keys.
Also: empty states (+inf / -inf with NaN in their v), rows without any key, NaN propagation, the
element-load path (views that are not 16-byte aligned), caller-given outputs, CUDA-graph capture
(CuPy and torch), bitwise determinism, streams, torch and JAX arrays."""

import itertools

import numpy as np
import pytest

from gqadrv.ops import oracle
from tests.helpers import record_error, to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
KS = [1, 2, 3, 7]
SHAPES = [(1, 1, 64), (5, 8, 128), (3, 2, 4, 256)]      # per-state v shapes [..., H, D]
TOL = {"float16": (2e-3, 2e-3), "bfloat16": (2e-2, 1e-2), "float32": (1e-5, 1e-5)}   # (atol, rtol) on v
LSE_TOL = (1e-5, 1e-5)                                   # s is float32 for every dtype


def npdt(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def sid(s):
    return "x".join(map(str, s))


def attention_parts(shape, k, seed, n_keys=48):
    """(vs, ss, ref_v, ref_s): K partial states of real attention rows (float64, v_i of ``shape``,
    s_i of ``shape[:-1]``; a part with no keys has v_i = 0, s_i = +inf) and attention over all keys."""
    rng = np.random.default_rng(seed)
    lead, d = tuple(shape[:-1]), shape[-1]
    rows = int(np.prod(lead))
    dk = 32
    q = rng.standard_normal((rows, dk))
    keys = rng.standard_normal((rows, n_keys, dk))
    vals = rng.standard_normal((rows, n_keys, d))
    scores = np.einsum("rd,rnd->rn", q, keys) * (2.0 / np.sqrt(dk))  # sharper than 1/sqrt(dk): LSEs spread out
    cuts = np.sort(rng.integers(0, n_keys + 1, size=k - 1))
    bounds = [0, *cuts.tolist(), n_keys]
    vs, ss = [], []
    for a, b in itertools.pairwise(bounds):
        vi, si = oracle.attend(scores[:, a:b], True, vals[:, a:b])
        vs.append(vi.reshape(*lead, d))
        ss.append(si.reshape(lead))
    ref_v, ref_s = oracle.attend(scores, True, vals)
    return vs, ss, ref_v.reshape(*lead, d), ref_s.reshape(lead)


def upload_list(vs, ss, dtype):
    return [to_device(v.astype(npdt(dtype))) for v in vs], [to_device(s.astype(np.float32)) for s in ss]


def stack(vs, ss):
    """Per-state [..., H, D] / [..., H] -> stacked [N, K, H, D] / [N, K, H] (N = the leading dims)."""
    h, d = vs[0].shape[-2], vs[0].shape[-1]
    v = np.stack([x.reshape(-1, h, d) for x in vs], axis=1)
    s = np.stack([x.reshape(-1, h) for x in ss], axis=1)
    return v, s


def host(a) -> np.ndarray:
    """A device array of any framework as float64 numpy."""
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        return to_host(a).astype(np.float64)
    if mod == "torch":
        return a.float().cpu().numpy().astype(np.float64)
    return np.asarray(a).astype(np.float64)


def check(got_v, got_s, ref_v, ref_s, dtype, key, scale=1.0):
    gv, gs = host(got_v), host(got_s)
    assert gv.shape == ref_v.shape and gs.shape == ref_s.shape, (gv.shape, ref_v.shape, gs.shape, ref_s.shape)
    atol, rtol = TOL[dtype]
    err = np.abs(gv - ref_v)
    bad = ~(err <= scale * (atol + rtol * np.abs(ref_v)))
    assert not bad.any(), f"{key}: {bad.sum()} v elements off, max err {np.nanmax(err):.3e}"
    fin = np.isfinite(ref_s)
    assert np.array_equal(gs[~fin], ref_s[~fin]), f"{key}: empty rows must have s = +inf"
    lerr = np.abs(gs[fin] - ref_s[fin])
    assert np.all(lerr <= LSE_TOL[0] + LSE_TOL[1] * np.abs(ref_s[fin])), f"{key}: lse max err {lerr.max():.3e}"
    record_error(f"merge v {dtype}", float(err.max()) if err.size else 0.0)
    record_error("merge lse", float(lerr.max()) if lerr.size else 0.0)


# ----------------------------------------------------------------------------- oracle grid
@pytest.mark.parametrize("shape", SHAPES, ids=sid)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_stacked(dtype, k, shape):
    import gqadrv

    vs, ss, ref_v, ref_s = attention_parts(shape, k, seed=k * 31 + len(shape))
    v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
    n, h, d = v.shape[0], v.shape[2], v.shape[3]
    out_v, out_s = gqadrv.merge_states(to_device(v), to_device(s))
    assert out_v.shape == (n, h, d) and out_v.dtype == npdt(dtype) and out_s.shape == (n, h)
    assert out_s.dtype == np.float32
    check(out_v, out_s, ref_v.reshape(n, h, d), ref_s.reshape(n, h), dtype, f"stacked {dtype} K{k} {shape}")


@pytest.mark.parametrize("shape", SHAPES, ids=sid)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_list(dtype, k, shape):
    import gqadrv

    vs, ss, ref_v, ref_s = attention_parts(shape, k, seed=k * 17 + len(shape))
    dv, ds = upload_list(vs, ss, dtype)
    out_v, out_s = gqadrv.merge_states(dv, ds)
    assert out_v.shape == tuple(shape) and out_s.shape == tuple(shape[:-1]) and out_v.dtype == npdt(dtype)
    check(out_v, out_s, ref_v, ref_s, dtype, f"list {dtype} K{k} {shape}")
    out_v2, out_s2 = gqadrv.merge_states(tuple(dv), tuple(ds))  # a tuple is a list of states too
    assert np.array_equal(to_host(out_v2).view(np.uint8), to_host(out_v).view(np.uint8))
    assert np.array_equal(to_host(out_s2), to_host(out_s))


@pytest.mark.parametrize("shape", SHAPES, ids=sid)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_pair(dtype, shape):
    import gqadrv

    vs, ss, ref_v, ref_s = attention_parts(shape, 2, seed=5 + len(shape))
    (va, vb), (sa, sb) = upload_list(vs, ss, dtype)
    out_v, out_s = gqadrv.merge_state(va, sa, vb, sb)
    assert out_v.shape == tuple(shape) and out_v.dtype == npdt(dtype)
    check(out_v, out_s, ref_v, ref_s, dtype, f"pair {dtype} {shape}")
    # the pair call is the list form with two states: same bits
    lv, ls = gqadrv.merge_states([va, vb], [sa, sb])
    assert np.array_equal(to_host(lv).view(np.uint8), to_host(out_v).view(np.uint8))
    assert np.array_equal(to_host(ls), to_host(out_s))


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_folded_over_k_states(dtype, k):
    """merge_state applied K-1 times (each intermediate rounded to the dtype) = attention over all keys."""
    import gqadrv

    shape = (5, 8, 128)
    vs, ss, ref_v, ref_s = attention_parts(shape, k, seed=k)
    dv, ds = upload_list(vs, ss, dtype)
    acc_v, acc_s = dv[0], ds[0]
    for i in range(1, k):
        acc_v, acc_s = gqadrv.merge_state(acc_v, acc_s, dv[i], ds[i])
    check(acc_v, acc_s, ref_v, ref_s, dtype, f"folded {dtype} K{k}", scale=k - 1)


@pytest.mark.parametrize("d", [8, 16, 24, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_edges(dtype, d):
    """The smallest and largest D (one 16-byte chunk per row for fp16 D 8; 256 chunks for fp32 D 1024)."""
    import gqadrv

    shape = (3, 2, d)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=d)
    dv, ds = upload_list(vs, ss, dtype)
    check(*gqadrv.merge_states(dv, ds), ref_v, ref_s, dtype, f"D{d} {dtype}")
    v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
    check(*gqadrv.merge_states(to_device(v), to_device(s)), ref_v, ref_s, dtype, f"D{d} {dtype} stacked")


def test_many_states_stacked_and_the_list_limit():
    """Stacked arrays take any K (stride form, here 100 > the 64-entry table); a list of 64 works."""
    import gqadrv

    shape = (4, 2, 64)
    vs, ss, ref_v, ref_s = attention_parts(shape, 100, seed=100, n_keys=300)
    v, s = stack([x.astype(np.float32) for x in vs], [x.astype(np.float32) for x in ss])
    check(*gqadrv.merge_states(to_device(v), to_device(s)), ref_v.reshape(4, 2, 64), ref_s.reshape(4, 2),
          "float32", "stacked K100")
    vs, ss, ref_v, ref_s = attention_parts(shape, 64, seed=64, n_keys=200)
    dv, ds = upload_list(vs, ss, "float16")
    check(*gqadrv.merge_states(dv, ds), ref_v, ref_s, "float16", "list K64")
    with pytest.raises(ValueError, match="at most 64 states"):
        gqadrv.merge_states(dv + dv[:1], ds + ds[:1])


# ----------------------------------------------------------------------------- empty states and NaN
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_states_are_skipped_and_all_empty_rows_give_zero_and_inf(dtype):
    import cupy as cp

    import gqadrv

    shape = (6, 4, 64)
    vs, ss, ref_v, ref_s = attention_parts(shape, 2, seed=11)
    nan = np.full(shape, np.nan)
    # states 0 and 3 are empty everywhere (+inf / -inf), with NaN poison in their v
    all_v = [nan, vs[0], vs[1], nan]
    all_s = [np.full(shape[:-1], np.inf), ss[0], ss[1], np.full(shape[:-1], -np.inf)]
    # rows (n = 2, every h) and (n = 4, h = 1): every state empty, mixing +inf and -inf, NaN in every v
    for n, h in ((2, slice(None)), (4, 1)):
        for i in range(4):
            all_v[i] = all_v[i].copy()
            all_v[i][n, h] = np.nan
            all_s[i] = all_s[i].copy()
            all_s[i][n, h] = np.inf if i % 2 else -np.inf
    exp_v, exp_s = ref_v.copy(), ref_s.copy()
    for n, h in ((2, slice(None)), (4, 1)):
        exp_v[n, h] = 0.0
        exp_s[n, h] = np.inf
    dv, ds = upload_list(all_v, all_s, dtype)
    out_v, out_s = gqadrv.merge_states(dv, ds)
    check(out_v, out_s, exp_v, exp_s, dtype, f"empty states list {dtype}")
    assert np.all(host(out_v)[2] == 0) and np.all(host(out_s)[2] == np.inf)
    v, s = stack([x.astype(npdt(dtype)) for x in all_v], [x.astype(np.float32) for x in all_s])
    check(*gqadrv.merge_states(to_device(v), to_device(s)), exp_v, exp_s, dtype, f"empty states stacked {dtype}")
    # merge_state: an empty partner leaves the other state unchanged (v to its dtype's rounding)
    ov, os_ = gqadrv.merge_state(dv[1], ds[1], dv[0], ds[0])
    assert np.array_equal(host(ov)[np.isfinite(all_s[1])], host(dv[1])[np.isfinite(all_s[1])])
    np.testing.assert_array_equal(host(os_), host(ds[1]))
    # both empty: zero and +inf, whatever their v holds
    ov, os_ = gqadrv.merge_state(dv[0], ds[0], dv[3], ds[3])
    assert np.all(host(ov) == 0) and np.all(host(os_) == np.inf)
    assert not cp.isnan(ov).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_a_non_empty_state_propagates(dtype):
    import gqadrv

    shape = (4, 3, 64)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=13, n_keys=30)
    vs = [v.copy() for v in vs]
    ss = [s.copy() for s in ss]
    target = next(i for i in range(3) if np.isfinite(ss[i][1, 2]))
    vs[target][1, 2, 5] = np.nan           # one element of a non-empty state: that element turns NaN
    target_s = next(i for i in range(3) if np.isfinite(ss[i][3, 0]))
    ss[target_s][3, 0] = np.nan            # a NaN LSE: the whole row and its LSE turn NaN
    dv, ds = upload_list(vs, ss, dtype)
    out_v, out_s = gqadrv.merge_states(dv, ds)
    gv, gs = host(out_v), host(out_s)
    assert np.isnan(gv[1, 2, 5]) and np.isfinite(np.delete(gv[1, 2], 5)).all() and np.isfinite(gs[1, 2])
    assert np.isnan(gv[3, 0]).all() and np.isnan(gs[3, 0])
    keep = np.ones(shape[:-1], bool)
    keep[1, 2] = keep[3, 0] = False
    atol, rtol = TOL[dtype]
    assert np.all(np.abs(gv[keep] - ref_v[keep]) <= atol + rtol * np.abs(ref_v[keep]))
    assert np.all(np.abs(gs[keep] - ref_s[keep]) <= LSE_TOL[0] + LSE_TOL[1] * np.abs(ref_s[keep]))


# ----------------------------------------------------------------------------- paths and outputs
@pytest.mark.parametrize("dtype", DTYPES)
def test_views_that_are_not_16_byte_aligned_take_the_element_path(dtype):
    """Views one element into a buffer: element loads / stores (no MERGE_FLAG_VEC16), same values."""
    import cupy as cp

    import gqadrv

    shape = (5, 8, 128)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=21)
    size = int(np.prod(shape))
    views = []
    for v in vs:
        buf = cp.zeros(size + 8, dtype=npdt(dtype))
        view = buf[1:1 + size].reshape(shape)
        view[...] = to_device(v.astype(npdt(dtype)))
        assert view.data.ptr % 16 and view.flags.c_contiguous
        views.append(view)
    ds = [to_device(s.astype(np.float32)) for s in ss]
    check(*gqadrv.merge_states(views, ds), ref_v, ref_s, dtype, f"element path {dtype}")
    obuf = cp.full(size + 8, np.nan, dtype=npdt(dtype))
    out = obuf[3:3 + size].reshape(shape)
    lbuf = cp.full(size // shape[-1] + 1, np.nan, dtype=np.float32)
    lse = lbuf[1:].reshape(shape[:-1])
    r = gqadrv.merge_states([to_device(v.astype(npdt(dtype))) for v in vs], ds, out=out, out_lse=lse)
    assert r[0] is out and r[1] is lse
    check(out, lse, ref_v, ref_s, dtype, f"element path out {dtype}")
    assert np.isnan(host(obuf[:3])).all() and np.isnan(host(obuf[3 + size:])).all()  # nothing written outside


@pytest.mark.parametrize("dtype", DTYPES)
def test_given_outputs_are_filled_and_returned(dtype):
    import cupy as cp

    import gqadrv

    shape = (3, 2, 4, 256)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=31)
    dv, ds = upload_list(vs, ss, dtype)
    new_v, new_s = gqadrv.merge_states(dv, ds)
    out = cp.full(shape, np.nan, dtype=npdt(dtype))
    lse = cp.full(shape[:-1], np.nan, dtype=np.float32)
    r_v, r_s = gqadrv.merge_states(dv, ds, out=out, out_lse=lse)
    assert r_v is out and r_s is lse
    assert np.array_equal(to_host(out).view(np.uint8), to_host(new_v).view(np.uint8))
    assert np.array_equal(to_host(lse), to_host(new_s))
    # only one of them given: the other is allocated
    out2 = cp.full(shape, np.nan, dtype=npdt(dtype))
    r_v, r_s = gqadrv.merge_states(dv, ds, out=out2)
    assert r_v is out2 and isinstance(r_s, cp.ndarray) and r_s.shape == shape[:-1]
    check(r_v, r_s, ref_v, ref_s, dtype, f"out only {dtype}")
    lse2 = cp.full(shape[:-1], np.nan, dtype=np.float32)
    r_v, r_s = gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1], out_lse=lse2)
    assert r_s is lse2 and r_v.shape == shape
    # stacked form with outputs
    v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
    out3 = cp.empty((6, 4, 256), dtype=npdt(dtype))
    lse3 = cp.empty((6, 4), dtype=np.float32)
    r = gqadrv.merge_states(to_device(v), to_device(s), out=out3, out_lse=lse3)
    assert r[0] is out3 and r[1] is lse3
    check(out3, lse3, ref_v.reshape(6, 4, 256), ref_s.reshape(6, 4), dtype, f"stacked out {dtype}")
    # an output aliasing an input is refused before any launch
    with pytest.raises(ValueError, match="out must not overlap v"):
        gqadrv.merge_states(dv, ds, out=dv[1])
    with pytest.raises(ValueError, match="out_lse must not overlap s"):
        gqadrv.merge_states(dv, ds, out_lse=ds[0])


def test_zero_rows_launch_nothing():
    import cupy as cp

    import gqadrv

    v = cp.zeros((0, 3, 4, 64), np.float16)
    s = cp.zeros((0, 3, 4), np.float32)
    out_v, out_s = gqadrv.merge_states(v, s)
    assert out_v.shape == (0, 4, 64) and out_s.shape == (0, 4)


@pytest.mark.parametrize("k", [2, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_deterministic(dtype, k):
    import cupy as cp

    import gqadrv

    shape = (5, 8, 128)
    vs, ss, _, _ = attention_parts(shape, k, seed=41 + k)
    dv, ds = upload_list(vs, ss, dtype)
    a = gqadrv.merge_states(dv, ds)
    b = gqadrv.merge_states(dv, ds)
    out = cp.empty(shape, npdt(dtype))
    lse = cp.empty(shape[:-1], np.float32)
    c = gqadrv.merge_states(dv, ds, out=out, out_lse=lse)
    for x in (b, c):
        assert np.array_equal(to_host(x[0]).view(np.uint8), to_host(a[0]).view(np.uint8))
        assert np.array_equal(to_host(x[1]).view(np.uint8), to_host(a[1]).view(np.uint8))
    v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
    st1 = gqadrv.merge_states(to_device(v), to_device(s))
    st2 = gqadrv.merge_states(to_device(v), to_device(s))
    assert np.array_equal(to_host(st1[0]).view(np.uint8), to_host(st2[0]).view(np.uint8))
    # the stacked and the list form add in the same order: the same bits
    assert np.array_equal(to_host(st1[0]).view(np.uint8).reshape(-1), to_host(a[0]).view(np.uint8).reshape(-1))
    assert np.array_equal(to_host(st1[1]).reshape(-1), to_host(a[1]).reshape(-1))


# ----------------------------------------------------------------------------- streams and graphs
def test_explicit_stream_and_producer_ordering():
    """Inputs written on CuPy's current stream, the merge launched on another stream: the producer
    is ordered before the launch (no manual sync)."""
    import cupy as cp

    import gqadrv

    shape = (64, 8, 128)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=51)
    dv = [cp.zeros(shape, np.float16) for _ in vs]
    ds = [cp.zeros(shape[:-1], np.float32) for _ in ss]
    hv = [to_device(v.astype(np.float16)) for v in vs]
    hs = [to_device(s.astype(np.float32)) for s in ss]
    cp.cuda.Device().synchronize()
    side = cp.cuda.Stream(non_blocking=True)
    for i in range(3):  # producers on the current stream
        dv[i][...] = hv[i]
        ds[i][...] = hs[i]
    out_v, out_s = gqadrv.merge_states(dv, ds, stream=side)
    side.synchronize()
    check(out_v, out_s, ref_v, ref_s, "float16", "side stream")
    out_v, out_s = gqadrv.merge_states(dv, ds, stream=int(side.ptr))
    side.synchronize()
    check(out_v, out_s, ref_v, ref_s, "float16", "side stream handle")


@pytest.mark.parametrize("form", ["list", "stacked", "pair"])
def test_cupy_graph_capture_with_outputs_given(form):
    import cupy as cp

    import gqadrv

    shape, k, dtype = (5, 8, 128), (2 if form == "pair" else 3), "bfloat16"
    side = cp.cuda.Stream(non_blocking=True)
    if form == "stacked":
        dv = cp.zeros((5, k, 8, 128), npdt(dtype))
        ds = cp.zeros((5, k, 8), np.float32)
    else:
        dv = [cp.zeros(shape, npdt(dtype)) for _ in range(k)]
        ds = [cp.zeros(shape[:-1], np.float32) for _ in range(k)]
    out = cp.empty(shape, npdt(dtype))
    lse = cp.empty(shape[:-1], np.float32)

    def call():
        if form == "pair":
            return gqadrv.merge_state(dv[0], ds[0], dv[1], ds[1], out=out, out_lse=lse, stream=side)
        return gqadrv.merge_states(dv, ds, out=out, out_lse=lse, stream=side)

    with side:
        call()  # outside capture first: compiles / loads the kernel
    side.synchronize()
    with side:
        side.begin_capture()
        r = call()
        g = side.end_capture()
    assert r[0] is out and r[1] is lse
    for seed in (1, 2, 3):
        vs, ss, ref_v, ref_s = attention_parts(shape, k, seed=60 + seed)
        if form == "stacked":
            v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
            dv[...] = to_device(v)
            ds[...] = to_device(s)
        else:
            for i in range(k):
                dv[i][...] = to_device(vs[i].astype(npdt(dtype)))
                ds[i][...] = to_device(ss[i].astype(np.float32))
        out[...] = np.nan
        cp.cuda.Device().synchronize()
        g.launch(side)
        side.synchronize()
        check(out, lse, ref_v, ref_s, dtype, f"cupy graph {form}")


# ----------------------------------------------------------------------------- torch and JAX
def _torch_of(torch, a: np.ndarray, dtype: str):
    t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float32)))
    return t.to({"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_inputs(dtype):
    torch = pytest.importorskip("torch")
    import gqadrv

    shape = (3, 2, 4, 256)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=71)
    tv = [_torch_of(torch, v, dtype) for v in vs]
    ts = [_torch_of(torch, s, "float32") for s in ss]
    out_v, out_s = gqadrv.merge_states(tv, ts)
    assert isinstance(out_v, torch.Tensor) and isinstance(out_s, torch.Tensor)
    assert out_v.dtype == tv[0].dtype and out_s.dtype == torch.float32 and out_v.shape == tv[0].shape
    torch.cuda.synchronize()
    check(out_v, out_s, ref_v, ref_s, dtype, f"torch {dtype}")
    out_v, out_s = gqadrv.merge_state(tv[0], ts[0], tv[1], ts[1])
    assert isinstance(out_v, torch.Tensor)
    # on another current torch stream: launched there, outputs from torch's allocator
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        o_v, o_s = gqadrv.merge_states(tv, ts)
    st.synchronize()
    check(o_v, o_s, ref_v, ref_s, dtype, f"torch side stream {dtype}")
    grad = tv[0].detach().clone().requires_grad_(True)  # gqadrv has no backward pass: refused
    with pytest.raises(ValueError, match=r"v\[0\] requires grad"):
        gqadrv.merge_states([grad, *tv[1:]], ts)


def test_torch_graph_capture_with_outputs_given():
    torch = pytest.importorskip("torch")
    import gqadrv

    shape, k = (5, 8, 128), 3
    tv = [torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(k)]
    ts = [torch.zeros(shape[:-1], dtype=torch.float32, device="cuda") for _ in range(k)]
    out = torch.empty(shape, dtype=torch.float16, device="cuda")
    lse = torch.empty(shape[:-1], dtype=torch.float32, device="cuda")
    gqadrv.merge_states(tv, ts, out=out, out_lse=lse)  # load the kernel outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gqadrv.merge_states(tv, ts, out=out, out_lse=lse, stream=torch.cuda.current_stream())
    for seed in (1, 2):
        vs, ss, ref_v, ref_s = attention_parts(shape, k, seed=80 + seed)
        for i in range(k):
            tv[i].copy_(_torch_of(torch, vs[i], "float16"))
            ts[i].copy_(_torch_of(torch, ss[i], "float32"))
        g.replay()
        torch.cuda.synchronize()
        check(out, lse, ref_v, ref_s, "float16", "torch graph")


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_inputs(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gqadrv

    shape = (5, 8, 128)
    vs, ss, ref_v, ref_s = attention_parts(shape, 3, seed=91)
    jv = [jnp.asarray(v.astype(npdt(dtype))) for v in vs]
    js = [jnp.asarray(s.astype(np.float32)) for s in ss]
    out_v, out_s = gqadrv.merge_states(jv, js)
    assert isinstance(out_v, jax.Array) and isinstance(out_s, jax.Array)
    assert out_v.dtype == jv[0].dtype and out_s.dtype == jnp.float32
    check(out_v, out_s, ref_v, ref_s, dtype, f"jax {dtype}")
    v, s = stack([x.astype(npdt(dtype)) for x in vs], [x.astype(np.float32) for x in ss])
    out_v, out_s = gqadrv.merge_states(jnp.asarray(v), jnp.asarray(s))
    check(out_v, out_s, ref_v, ref_s, dtype, f"jax stacked {dtype}")
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        gqadrv.merge_states(jv, js, out=jnp.zeros(shape, jv[0].dtype))
