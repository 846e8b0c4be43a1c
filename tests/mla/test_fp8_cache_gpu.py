"""FP8 MLA cache kernels on the GPU (gqadrv.quantize_k_cache / dequantize_k_cache) bit-exact against
the numpy reference (gqadrv.mla.fp8_reference): random caches of many magnitudes, odd page counts,
zeros, tiny values (the 2^-13 scale floor), the largest bf16 values, NaN / Inf channels, NaN payloads in
RoPE; pages that are views of bigger pools (any stride(0)) on both sides, the element path (views
that are not 16-byte aligned), caller-given outputs typed uint8 / int8, foreign caches (non-power-of-
two, NaN, Inf, zero scales), CUDA-graph capture with the output given, determinism, torch and JAX
inputs."""

import ml_dtypes
import numpy as np
import pytest

from gqadrv.mla import fp8_reference as ref
from tests.helpers import record_error, to_device, to_host

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(1, 1), (3, 5), (2, 17), (7, 64), (1, 256)]     # (num_blocks, page_size)


def random_cache(rng, nb, page, spread=(-24, 16)):
    """bf16 [nb, page, 1, 576]: normal values, one magnitude 2^e per token, some per-tile extremes."""
    x = rng.standard_normal((nb, page, 1, 576)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(*spread, size=(nb, page, 1, 1)).astype(np.float32)
    return x.astype(BF16)


def specials(nb=2, page=9):
    """Tokens built to hit every rule: zero / tiny / huge tiles, amax at the 448 boundaries, NaN and
    Inf channels (ignored by the scale), a NaN payload in RoPE."""
    x = np.zeros((nb, page, 1, 576), np.float32)
    t = x.reshape(nb * page, 576)
    t[0, :] = 0.0
    t[1, :512] = 1e-6
    t[1, 128:256] = -3e-7
    t[2, :512] = 3.0e38
    t[3, :128] = np.linspace(-448, 448, 128)
    t[3, 128:256] = np.linspace(-450, 450, 128)
    t[3, 256:384] = 2.0**-130                     # a bf16 (and fp32) subnormal
    t[3, 384:512] = -(2.0**-133)                  # the smallest bf16 subnormal
    t[4, :512] = 1.0
    t[4, 3], t[4, 130], t[4, 260], t[4, 511] = np.nan, np.inf, -np.inf, np.nan
    t[5, :512] = np.inf                           # a tile of infinities only: scale floor, codes +-448
    t[6, :512] = np.nan
    t[7:, :] = np.random.default_rng(1).standard_normal((nb * page - 7, 576)) * 100
    t[:, 512:] = np.linspace(-3, 3, 64)
    kb = x.astype(BF16)
    kb.view(np.uint16).reshape(nb * page, 576)[4, 520] = 0x7FA1
    kb.view(np.uint16).reshape(nb * page, 576)[5, 575] = 0xFF80   # -Inf in RoPE: copied as is
    return kb


def check_quant(got, k_host, key):
    g = to_host(got) if not isinstance(got, np.ndarray) else got
    want = ref.quantize_k_cache_reference(k_host)
    assert g.shape == want.shape, (g.shape, want.shape)
    bad = np.flatnonzero(g.view(np.uint8).reshape(-1) != want.reshape(-1))
    assert bad.size == 0, f"{key}: {bad.size} bytes differ, first at {np.unravel_index(bad[0], want.shape)}"
    return want


def check_dequant(got, q_host, key):
    g = to_host(got) if not isinstance(got, np.ndarray) else got
    want = ref.dequantize_k_cache_reference(q_host)
    assert g.shape == want.shape and g.dtype == BF16
    bad = np.flatnonzero(g.view(np.uint16).reshape(-1) != want.view(np.uint16).reshape(-1))
    assert bad.size == 0, f"{key}: {bad.size} channels differ, first at {np.unravel_index(bad[0], want.shape)}"
    return want


# ----------------------------------------------------------------------------- bit-exact grid
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"nb{s[0]}_page{s[1]}")
@pytest.mark.parametrize("spread", [(-24, 16), (-60, -40), (40, 100)], ids=["mixed", "tiny", "huge"])
def test_quantize_and_dequantize_are_bit_exact(shape, spread):
    import gqadrv

    rng = np.random.default_rng(hash((shape, spread)) % 2**32)
    k = random_cache(rng, *shape, spread=spread)
    dk = to_device(k)
    q = gqadrv.quantize_k_cache(dk)
    assert q.shape == (*shape, 1, 656) and q.dtype == np.uint8
    qh = check_quant(q, k, f"quantize {shape} {spread}")
    back = gqadrv.dequantize_k_cache(q)
    assert back.shape == (*shape, 1, 576) and back.dtype == BF16
    bh = check_dequant(back, qh, f"dequantize {shape} {spread}")
    err = np.abs(bh.astype(np.float32)[..., :512] - k.astype(np.float32)[..., :512])
    s = np.repeat(ref.split_k_cache(qh)[1], 128, axis=-1)
    assert np.all(err <= s * 16)
    record_error("mla fp8 round trip / scale", float(np.max(err / s)))


def test_special_values():
    import gqadrv

    k = specials()
    q = gqadrv.quantize_k_cache(to_device(k))
    qh = check_quant(q, k, "specials")
    codes, scales, rope = ref.split_k_cache(qh.reshape(-1, 656))
    assert scales[0, 0] == 2.0**-13 and scales[2, 0] == 2.0**120 and scales[5, 0] == 2.0**-13
    assert codes[4, 3] == 0x7F and codes[4, 130] == 0x7E and codes[4, 260] == 0xFE
    assert np.all(codes[6] == 0x7F) and np.all(codes[5] == 0x7E)
    assert rope[4, 8] == 0x7FA1 and rope[5, 63] == 0xFF80
    check_dequant(gqadrv.dequantize_k_cache(q), qh, "specials dequantize")


def test_foreign_caches_dequantize_bit_exact():
    """Random bytes with non-power-of-two, zero, negative, NaN and Inf scales (and random NaN codes)."""
    import gqadrv

    rng = np.random.default_rng(7)
    q = rng.integers(0, 256, size=(4, 33, 1, 656), dtype=np.uint8)
    sc = (rng.standard_normal((4, 33, 1, 4)) * 10.0 ** rng.integers(-30, 30, size=(4, 33, 1, 4))).astype(np.float32)
    sc.reshape(-1)[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40]
    q[..., 512:528] = sc.astype("<f4").view(np.uint8).reshape(4, 33, 1, 16)
    check_dequant(gqadrv.dequantize_k_cache(to_device(q)), q, "foreign cache")


# ----------------------------------------------------------------------------- views and paths
def test_pages_of_bigger_pools_on_both_sides():
    """Input: every other page of a bf16 pool; output: every third page of an FP8 pool (stride(0) any,
    stride(1) == 656); the pool's other pages are never written."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(3)
    nb, page = 5, 16
    pool = random_cache(rng, 2 * nb, page)
    dpool = to_device(pool)
    fpool = cp.full((3 * nb, page, 1, 656), 0xAB, cp.uint8)
    out = fpool[1::3]
    r = gqadrv.quantize_k_cache(dpool[::2], out=out)
    assert r is out
    fp = to_host(fpool)
    check_quant(fp[1::3], pool[::2], "pool views")
    assert np.all(fp[0::3] == 0xAB) and np.all(fp[2::3] == 0xAB)
    # and back, into every other page of a bf16 pool
    bpool = cp.zeros((2 * nb, page, 1, 576), BF16)
    bpool.view(cp.uint16)[...] = 0x1234
    r = gqadrv.dequantize_k_cache(fpool[1::3], out=bpool[1::2])
    bp = to_host(bpool)
    check_dequant(bp[1::2], fp[1::3], "pool views dequantize")
    assert np.all(bp[0::2].view(np.uint16) == 0x1234)


def test_element_path_for_views_that_are_not_16_byte_aligned():
    """One bf16 element into a buffer (2-byte aligned input), an output page stride of 656 * page + 8
    bytes (8-byte aligned pages): byte loads and stores, same bytes."""
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(4)
    nb, page = 3, 7
    k = random_cache(rng, nb, page)
    n = k.size
    buf = cp.zeros(n + 8, BF16)
    view = buf[1:1 + n].reshape(k.shape)
    view[...] = to_device(k)
    assert view.data.ptr % 16
    stride0 = page * 656 + 8
    obuf = cp.full(nb * stride0 + 64, 0xCD, cp.uint8)
    out = cp.lib.stride_tricks.as_strided(obuf[3:], shape=(nb, page, 1, 656), strides=(stride0, 656, 656, 1))
    gqadrv.quantize_k_cache(view, out=out)
    qh = check_quant(out.copy(), k, "element path")
    ob = to_host(obuf)
    for b in range(nb):  # the 8 bytes between pages are never written
        gap = 3 + b * stride0 + page * 656
        assert np.all(ob[gap:gap + 8] == 0xCD), b
    assert np.all(ob[:3] == 0xCD)
    # dequantize from the unaligned pages into an unaligned bf16 view
    dbuf = cp.zeros(n + 8, BF16)
    dview = dbuf[3:3 + n].reshape(k.shape)
    gqadrv.dequantize_k_cache(out, out=dview)
    check_dequant(dview.copy(), qh, "element path dequantize")


def test_given_outputs_typed_int8_and_returned_as_given():
    import cupy as cp

    import gqadrv

    k = random_cache(np.random.default_rng(5), 2, 8)
    dk = to_device(k)
    new = gqadrv.quantize_k_cache(dk)
    out = cp.empty((2, 8, 1, 656), cp.int8)
    assert gqadrv.quantize_k_cache(dk, out=out) is out
    assert np.array_equal(to_host(out).view(np.uint8), to_host(new))
    back = cp.empty((2, 8, 1, 576), BF16)
    assert gqadrv.dequantize_k_cache(out, out=back) is back
    check_dequant(back, to_host(new), "int8 cache")
    buf = cp.zeros(2 * 8 * (1152 + 656), cp.uint8)
    src = buf[: 2 * 8 * 656].reshape(2, 8, 1, 656)
    alias = buf[: 2 * 8 * 1152].view(BF16).reshape(2, 8, 1, 576)
    with pytest.raises(ValueError, match="out must not overlap k_fp8"):
        gqadrv.dequantize_k_cache(src, out=alias)
    # zero tokens: nothing launched
    z = gqadrv.quantize_k_cache(cp.zeros((0, 8, 1, 576), BF16))
    assert z.shape == (0, 8, 1, 656)


def test_deterministic_and_repeatable():
    import gqadrv

    k = random_cache(np.random.default_rng(6), 4, 64)
    dk = to_device(k)
    a, b = to_host(gqadrv.quantize_k_cache(dk)), to_host(gqadrv.quantize_k_cache(dk))
    assert np.array_equal(a, b)


# ----------------------------------------------------------------------------- graphs
def test_cupy_graph_capture_with_output_given():
    import cupy as cp

    import gqadrv

    nb, page = 3, 16
    side = cp.cuda.Stream(non_blocking=True)
    dk = cp.zeros((nb, page, 1, 576), BF16)
    q = cp.empty((nb, page, 1, 656), cp.uint8)
    back = cp.empty((nb, page, 1, 576), BF16)
    with side:
        gqadrv.quantize_k_cache(dk, out=q, stream=side)
        gqadrv.dequantize_k_cache(q, out=back, stream=side)
    side.synchronize()
    with side:
        side.begin_capture()
        gqadrv.quantize_k_cache(dk, out=q, stream=side)
        gqadrv.dequantize_k_cache(q, out=back, stream=side)
        g = side.end_capture()
    for seed in (1, 2):
        k = random_cache(np.random.default_rng(seed), nb, page)
        dk[...] = to_device(k)
        cp.cuda.Device().synchronize()
        g.launch(side)
        side.synchronize()
        qh = check_quant(to_host(q), k, "graph quantize")
        check_dequant(to_host(back), qh, "graph dequantize")


# ----------------------------------------------------------------------------- torch and JAX
def _torch_bf16(torch, k):
    return torch.from_numpy(np.ascontiguousarray(k).view(np.int16).copy()).view(torch.bfloat16).cuda()


def test_torch_inputs_and_graph():
    torch = pytest.importorskip("torch")
    import gqadrv

    k = random_cache(np.random.default_rng(8), 3, 16)
    tk = _torch_bf16(torch, k)
    q = gqadrv.quantize_k_cache(tk)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.uint8 and tuple(q.shape) == (3, 16, 1, 656)
    torch.cuda.synchronize()
    qh = check_quant(q.cpu().numpy(), k, "torch")
    back = gqadrv.dequantize_k_cache(q)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and tuple(back.shape) == (3, 16, 1, 576)
    torch.cuda.synchronize()
    check_dequant(back.view(torch.int16).cpu().numpy().view(BF16), qh, "torch dequantize")
    # a pool view and a graph with the output given
    pool = torch.zeros((6, 16, 1, 576), dtype=torch.bfloat16, device="cuda")
    fpool = torch.zeros((9, 16, 1, 656), dtype=torch.uint8, device="cuda")
    gqadrv.quantize_k_cache(pool[::2], out=fpool[::3])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gqadrv.quantize_k_cache(pool[::2], out=fpool[::3], stream=torch.cuda.current_stream())
    pool[::2].copy_(tk)
    g.replay()
    torch.cuda.synchronize()
    check_quant(fpool[::3].cpu().numpy(), k, "torch graph")
    assert not fpool[1::3].any() and not fpool[2::3].any()
    with pytest.raises(ValueError, match="requires grad"):
        gqadrv.quantize_k_cache(tk.clone().requires_grad_(True))


def test_torch_float8_typed_cache():
    torch = pytest.importorskip("torch")
    import gqadrv

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    k = random_cache(np.random.default_rng(10), 2, 8)
    q = gqadrv.quantize_k_cache(_torch_bf16(torch, k))
    torch.cuda.synchronize()
    qh = q.cpu().numpy()
    try:
        back = gqadrv.dequantize_k_cache(q.view(torch.float8_e4m3fn))
        out8 = torch.empty((2, 8, 1, 656), dtype=torch.float8_e4m3fn, device="cuda")
        gqadrv.quantize_k_cache(_torch_bf16(torch, k), out=out8)
    except ValueError as exc:
        if "DLPack" in str(exc):
            pytest.skip(f"this torch cannot export float8_e4m3fn through DLPack: {exc}")
        raise
    torch.cuda.synchronize()
    check_dequant(back.view(torch.int16).cpu().numpy().view(BF16), qh, "torch float8 cache")
    assert np.array_equal(out8.view(torch.uint8).cpu().numpy(), qh)


def test_jax_inputs():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")

    import gqadrv

    k = random_cache(np.random.default_rng(9), 2, 32)
    jk = jnp.asarray(k)
    q = gqadrv.quantize_k_cache(jk)
    assert isinstance(q, jax.Array) and q.dtype == jnp.uint8
    qh = check_quant(np.asarray(q), k, "jax")
    back = gqadrv.dequantize_k_cache(q)
    assert isinstance(back, jax.Array) and back.dtype == jnp.bfloat16
    check_dequant(np.asarray(back), qh, "jax dequantize")
    try:
        back8 = gqadrv.dequantize_k_cache(q.view(jnp.float8_e4m3fn))
    except ValueError as exc:
        if "DLPack" not in str(exc):
            raise
    else:
        check_dequant(np.asarray(back8), qh, "jax float8 cache")
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        gqadrv.quantize_k_cache(jk, out=jnp.zeros((2, 32, 1, 656), jnp.uint8))
