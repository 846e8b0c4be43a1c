"""FP8-e4m3 KV quantizer on the GPU (gqadrv.quantize_kv_fp8) bit-exact against the numpy reference
(gqadrv.gqa.fp8_reference): fp16 / bf16 / fp32 inputs of many shapes (sizes that are not multiples
of the 16-element work item, 0-d, empty), every scale mode (computed, float, 0-d / one-element device
scale, per-head scales along several axes, including the last axis: per-element head indices), zeros
(the 2^-126 floor), NaN / Inf, values that saturate, fp32 subnormals, a large tensor (the amax
grid-stride loop and one atomic per CTA), the element path (views that are not 16-byte aligned),
caller-given outputs, CUDA-graph capture (computed scale with out / out_scale given; a device scale
updated between replays), torch and JAX inputs."""

import ml_dtypes
import numpy as np
import pytest

from gqadrv.gqa import fp8_reference as ref
from tests.helpers import record_error, to_device, to_host

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
SHAPES = [(2, 16, 8, 128), (3, 7, 2, 64), (5, 3), (17,), (1,), (4, 1, 1, 8)]


def npdt(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def make_x(rng, shape, dtype, scale=4.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x.astype(npdt(dtype))


def host(a):
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        return to_host(a)
    if mod == "torch":
        return a.cpu().numpy()
    return np.asarray(a)


def check_codes(got, x, scale, key, head_axis=None):
    codes, s = ref.quantize_kv_fp8_reference(x, scale, head_axis=head_axis)
    g = host(got).view(np.uint8)
    assert g.shape == codes.shape, (g.shape, codes.shape)
    bad = np.flatnonzero(g.reshape(-1) != codes.reshape(-1))
    assert bad.size == 0, (f"{key}: {bad.size} codes differ; first at flat {bad[0]}: x={x.reshape(-1)[bad[0]]!r} "
                           f"got 0x{g.reshape(-1)[bad[0]]:02x} want 0x{codes.reshape(-1)[bad[0]]:02x}")
    return codes, s


# ----------------------------------------------------------------------------- modes x dtypes x shapes
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_computed_scale(dtype, shape):
    import cupy as cp

    import gqadrv

    x = make_x(np.random.default_rng(len(shape) * 7 + shape[0]), shape, dtype)
    codes, s = gqadrv.quantize_kv_fp8(to_device(x))
    assert isinstance(codes, cp.ndarray) and codes.dtype == np.uint8 and codes.shape == shape
    assert isinstance(s, cp.ndarray) and s.dtype == np.float32 and s.shape == ()
    want_s = ref.computed_scale(x)
    assert to_host(s).reshape(()) == want_s, (float(to_host(s)), float(want_s))
    _, rs = check_codes(codes, x, None, f"computed {dtype} {shape}")
    back = ref.dequantize_kv_fp8_reference(host(codes), rs)
    record_error(f"kv fp8 round trip / scale {dtype}", float(np.max(np.abs(back - x.astype(np.float32))) / rs))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_given_per_tensor_scales(dtype, shape):
    import cupy as cp

    import gqadrv

    x = make_x(np.random.default_rng(3), shape, dtype, scale=30.0)
    dx = to_device(x)
    for value in (0.05, 0.0371, 1.0, 3):   # small enough that large values saturate
        codes, s = gqadrv.quantize_kv_fp8(dx, value)
        assert s == float(np.float32(value)) and isinstance(s, float)
        check_codes(codes, x, np.float32(value), f"float scale {value} {dtype} {shape}")
    for sh in ((), (1,)):
        ds = cp.full(sh, 0.0123, cp.float32)
        codes, s = gqadrv.quantize_kv_fp8(dx, ds)
        assert s is ds
        check_codes(codes, x, np.float32(0.0123), f"device scale {sh} {dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", [((2, 16, 8, 128), -2), ((2, 8, 16, 128), 1), ((3, 7, 4, 64), 0),
                                        ((5, 6, 12), -1), ((4, 3, 5, 24), 2), ((9, 8), 0), ((9, 8), 1)])
def test_per_head_scales(dtype, shape, axis):
    """Heads along several axes: inner % 16 == 0 (one scale per item) and not (the last axis, inner
    24 or 12: per-element head indices)."""
    import gqadrv

    rng = np.random.default_rng(sum(shape) + axis)
    x = make_x(rng, shape, dtype, scale=10.0)
    h = shape[axis]
    scales = (rng.uniform(0.005, 0.2, size=h)).astype(np.float32)
    ds = to_device(scales)
    codes, s = gqadrv.quantize_kv_fp8(to_device(x), ds, head_axis=axis)
    assert s is ds
    check_codes(codes, x, scales, f"per head {dtype} {shape} axis {axis}", head_axis=axis)


# ----------------------------------------------------------------------------- special values
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    import gqadrv

    f = np.float32
    base = np.array([0.0, -0.0, 1.0, -1.0, np.nan, -np.nan, np.inf, -np.inf, 1e-3, -2.5, 7.0, 60000.0],
                    f)
    x = np.tile(base, 7)[:77].astype(npdt(dtype))        # 77 elements: 4 full items and a short one
    dx = to_device(x)
    codes, s = gqadrv.quantize_kv_fp8(dx)
    _, rs = check_codes(codes, x, None, f"specials computed {dtype}")
    assert to_host(s).reshape(()) == rs
    c = host(codes)
    assert c[4] == 0x7F and c[5] == 0x7F and c[6] == 0x7E and c[7] == 0xFE and c[1] == 0x80
    for value in (1e-4, 0.5, 1e3):       # tiny scales saturate the large values
        codes, _ = gqadrv.quantize_kv_fp8(dx, value)
        check_codes(codes, x, np.float32(value), f"specials scale {value} {dtype}")
    z = to_device(np.zeros((3, 33), npdt(dtype)))
    codes, s = gqadrv.quantize_kv_fp8(z)
    assert to_host(s).reshape(()) == np.float32(2.0**-126) and not host(codes).any()
    nn = to_device(np.full((40,), np.nan, np.float32).astype(npdt(dtype)))
    codes, s = gqadrv.quantize_kv_fp8(nn)
    assert to_host(s).reshape(()) == np.float32(2.0**-126) and np.all(host(codes) == 0x7F)


def test_fp32_subnormals_and_extremes():
    import gqadrv

    f = np.float32
    x = np.array([1e-40, -3e-42, 1.4e-45, 1e-38, 3.4e38, -3.4e38, 2.0**-126, 5e-39] * 5, f)
    dx = to_device(x)
    codes, s = gqadrv.quantize_kv_fp8(dx)
    check_codes(codes, x, None, "fp32 extremes computed")
    tiny = to_device(np.array([1e-40, -3e-42, 1.4e-45, 5e-39] * 8, f))
    codes, s = gqadrv.quantize_kv_fp8(tiny)          # amax / 448 below the floor: scale 2^-126
    check_codes(codes, host(tiny), None, "fp32 subnormals computed")
    assert to_host(s).reshape(()) == f(2.0**-126)
    for value in (2.0**-126, 1e-30, 3e38):
        codes, _ = gqadrv.quantize_kv_fp8(tiny, value)
        check_codes(codes, host(tiny), f(value), f"fp32 subnormals scale {value}")


def test_large_tensor_amax_over_many_ctas(report):
    """48 M elements: the amax launch strides over its items (grid capped at the resident CTAs), one
    atomic per CTA; the maximum sits in the last item."""
    import cupy as cp

    import gqadrv

    n = 48 * 2**20 + 5
    rng = np.random.default_rng(12)
    x = rng.standard_normal(n).astype(np.float32)
    x[-1] = -1234.5
    x[n // 3] = np.nan
    dx = to_device(x)
    codes, s = gqadrv.quantize_kv_fp8(dx)
    assert to_host(s).reshape(()) == np.float32(np.float32(1234.5) / np.float32(448))
    want, _ = ref.quantize_kv_fp8_reference(x)
    assert np.array_equal(to_host(codes), want)
    # bandwidth note (not asserted): the computed-scale call reads x twice
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    gqadrv.quantize_kv_fp8(dx, out=codes, out_scale=s)
    start.record()
    for _ in range(5):
        gqadrv.quantize_kv_fp8(dx, out=codes, out_scale=s)
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop) / 5
    report(f"quantize_kv_fp8 fp32 {n} elements, computed scale: {ms:.3f} ms ({(9 * n) / ms / 1e9:.2f} TB/s counting "
           "2 reads + 1 byte written; not tuned)")


# ----------------------------------------------------------------------------- paths and outputs
@pytest.mark.parametrize("dtype", DTYPES)
def test_element_path_and_given_outputs(dtype):
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(13)
    shape = (6, 4, 40)
    x = make_x(rng, shape, dtype, scale=20.0)
    n = x.size
    buf = cp.zeros(n + 8, npdt(dtype))
    view = buf[1:1 + n].reshape(shape)
    view[...] = to_device(x)
    assert view.data.ptr % 16
    obuf = cp.full(n + 32, 0xEE, cp.uint8)
    out = obuf[5:5 + n].reshape(shape)
    sbuf = cp.full(4, -1.0, cp.float32)
    out_scale = sbuf[1:2]
    r, rs = gqadrv.quantize_kv_fp8(view, out=out, out_scale=out_scale)
    assert r is out and rs is out_scale
    check_codes(out.copy(), x, None, f"element path {dtype}")
    assert to_host(sbuf)[1] == ref.computed_scale(x) and to_host(sbuf)[0] == -1 and to_host(sbuf)[2] == -1
    ob = to_host(obuf)
    assert np.all(ob[:5] == 0xEE) and np.all(ob[5 + n:] == 0xEE)
    # per-head scales on the element path (the last axis is not 16-element aligned either)
    scales = rng.uniform(0.01, 0.3, size=4).astype(np.float32)
    r, _ = gqadrv.quantize_kv_fp8(view, to_device(scales), head_axis=1, out=out)
    check_codes(out.copy(), x, scales, f"element path per head {dtype}", head_axis=1)
    # int8 output, a 0-d input, an empty input
    o8 = cp.empty(shape, cp.int8)
    gqadrv.quantize_kv_fp8(to_device(x), 0.1, out=o8)
    check_codes(o8, x, np.float32(0.1), f"int8 out {dtype}")
    zero_d = to_device(np.array(3.0, npdt(dtype)))
    c, s = gqadrv.quantize_kv_fp8(zero_d)
    assert c.shape == () and to_host(c).reshape(()) == 0x7E
    e, s = gqadrv.quantize_kv_fp8(cp.zeros((0, 16), npdt(dtype)))
    assert e.shape == (0, 16) and to_host(s).reshape(()) == np.float32(2.0**-126)
    with pytest.raises(ValueError, match="out must not overlap x"):
        gqadrv.quantize_kv_fp8(view, out=buf.view(cp.uint8)[:n].reshape(shape))


def test_deterministic():
    import gqadrv

    x = to_device(make_x(np.random.default_rng(14), (64, 8, 128), "bfloat16"))
    a, sa = gqadrv.quantize_kv_fp8(x)
    b, sb = gqadrv.quantize_kv_fp8(x)
    assert np.array_equal(to_host(a), to_host(b)) and to_host(sa) == to_host(sb)


# ----------------------------------------------------------------------------- graphs
def test_cupy_graph_capture_computed_and_device_scale():
    import cupy as cp

    import gqadrv

    shape = (4, 16, 8, 64)
    side = cp.cuda.Stream(non_blocking=True)
    dx = cp.zeros(shape, cp.float16)
    out = cp.empty(shape, cp.uint8)
    out2 = cp.empty(shape, cp.uint8)
    out_scale = cp.empty((), cp.float32)
    dscale = cp.ones((1,), cp.float32)
    heads = cp.ones((8,), cp.float32)
    out3 = cp.empty(shape, cp.uint8)

    def calls():
        gqadrv.quantize_kv_fp8(dx, out=out, out_scale=out_scale, stream=side)
        gqadrv.quantize_kv_fp8(dx, dscale, out=out2, stream=side)
        gqadrv.quantize_kv_fp8(dx, heads, head_axis=-2, out=out3, stream=side)

    with side:
        calls()
    side.synchronize()
    with side:
        side.begin_capture()
        calls()
        g = side.end_capture()
    for seed in (1, 2, 3):
        rng = np.random.default_rng(seed)
        x = make_x(rng, shape, "float16", scale=seed * 3.0)
        sc = np.float32(0.01 * seed)
        hs = rng.uniform(0.01, 0.1, size=8).astype(np.float32)
        dx[...] = to_device(x)
        dscale[...] = sc
        heads[...] = to_device(hs)
        out[...] = 0
        cp.cuda.Device().synchronize()
        g.launch(side)
        side.synchronize()
        check_codes(out, x, None, f"graph computed {seed}")
        assert to_host(out_scale).reshape(()) == ref.computed_scale(x)
        check_codes(out2, x, sc, f"graph device scale {seed}")
        check_codes(out3, x, hs, f"graph per head {seed}", head_axis=-2)


# ----------------------------------------------------------------------------- torch and JAX
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_inputs(dtype):
    torch = pytest.importorskip("torch")
    import gqadrv

    x = make_x(np.random.default_rng(15), (3, 16, 4, 64), dtype)
    tx = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype)).cuda()
    codes, s = gqadrv.quantize_kv_fp8(tx)
    assert isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8 and isinstance(s, torch.Tensor)
    assert s.dtype == torch.float32 and tuple(s.shape) == ()
    torch.cuda.synchronize()
    check_codes(codes, x, None, f"torch {dtype}")
    assert s.item() == ref.computed_scale(x)
    ts = torch.tensor([0.02], dtype=torch.float32, device="cuda")
    c2, s2 = gqadrv.quantize_kv_fp8(tx, ts)
    assert s2 is ts
    torch.cuda.synchronize()
    check_codes(c2, x, np.float32(0.02), f"torch device scale {dtype}")
    if hasattr(torch, "float8_e4m3fn"):
        o8 = torch.empty(tx.shape, dtype=torch.float8_e4m3fn, device="cuda")
        try:
            gqadrv.quantize_kv_fp8(tx, 0.02, out=o8)
        except ValueError as exc:
            if "DLPack" not in str(exc):
                raise
        else:
            torch.cuda.synchronize()
            check_codes(o8.view(torch.uint8), x, np.float32(0.02), f"torch float8 out {dtype}")
    with pytest.raises(ValueError, match="x requires grad"):
        gqadrv.quantize_kv_fp8(tx.detach().clone().float().requires_grad_(True))


def test_torch_graph_capture():
    torch = pytest.importorskip("torch")
    import gqadrv

    shape = (2, 16, 8, 128)
    tx = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(shape, dtype=torch.uint8, device="cuda")
    sc = torch.empty((), dtype=torch.float32, device="cuda")
    gqadrv.quantize_kv_fp8(tx, out=out, out_scale=sc)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gqadrv.quantize_kv_fp8(tx, out=out, out_scale=sc, stream=torch.cuda.current_stream())
    for seed in (1, 2):
        x = make_x(np.random.default_rng(seed), shape, "bfloat16", scale=seed * 5.0)
        tx.copy_(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        check_codes(out, x, None, f"torch graph {seed}")
        assert sc.item() == ref.computed_scale(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_inputs(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gqadrv

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    x = make_x(np.random.default_rng(16), (5, 8, 2, 64), dtype)
    jx = jnp.asarray(x)
    codes, s = gqadrv.quantize_kv_fp8(jx)
    assert isinstance(codes, jax.Array) and codes.dtype == jnp.uint8 and isinstance(s, jax.Array)
    check_codes(codes, x, None, f"jax {dtype}")
    assert np.asarray(s).reshape(()) == ref.computed_scale(x)
    js = jnp.asarray(np.array([0.03, 0.05], np.float32))
    c2, s2 = gqadrv.quantize_kv_fp8(jx, js, head_axis=2)
    assert s2 is js
    check_codes(c2, x, np.array([0.03, 0.05], np.float32), f"jax per head {dtype}", head_axis=2)
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        gqadrv.quantize_kv_fp8(jx, 0.5, out=jnp.zeros(x.shape, jnp.uint8))
