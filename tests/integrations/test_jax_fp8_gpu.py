"""gqadrv.jax FP8 ops on the GPU: quantize_kv_fp8 (computed, static numeric, device and per-head
scales), quantize_k_cache / dequantize_k_cache and flash_mla_with_kvcache(is_fp8_kvcache=True) under
jax.jit and eagerly, equal bit for bit to the plain gqadrv calls on the same JAX arrays; the FP8 MLA
decode of a cache built by the wrapper equals the bf16 decode of its dequantization bit for bit
(seesaw_fp8 vs seesaw, same num_splits) and the float64 oracle on that cache, with one compilation
for changing lengths."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.integrations.cases import MLA_LENGTHS, check_mla, mla_inputs, mla_ref

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to gqadrv's CuPy pool
jax = pytest.importorskip("jax")
gj = pytest.importorskip("gqadrv.jax")  # skips where JAX < 0.7
jnp = jax.numpy

MLA_SCALE = 0.05
SPLITS = 2


@pytest.fixture(autouse=True)
def _jax_gpu():
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")


def bits(a) -> np.ndarray:
    """An array's bits as unsigned integers (NaN payloads compare equal)."""
    h = np.asarray(a)
    return h.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[h.dtype.itemsize])


def same_bits(a, b) -> bool:
    ha, hb = np.asarray(a), np.asarray(b)
    return ha.dtype == hb.dtype and ha.shape == hb.shape and np.array_equal(bits(ha), bits(hb))


def compiled_once(fn) -> None:
    size = getattr(fn, "_cache_size", None)
    if size is not None:
        assert size() == 1, f"jit compiled {size()} times"


def kv_input(seed: int = 61) -> jax.Array:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal((3, 40, 4, 64)) * 3).astype(ml_dtypes.bfloat16))   # [..., Hkv, D]


def bf16_cache(seed: int = 62, nb: int = 6, page: int = 16) -> jax.Array:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    k = rng.standard_normal((nb, page, 1, 576)).astype(np.float32)
    k *= np.float32(2.0) ** rng.integers(-8, 6, size=(nb, page, 1, 1)).astype(np.float32)   # tile scales vary
    return jnp.asarray(k.astype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------------- FP8 KV quantizer
@pytest.mark.parametrize("mode", ["computed", "value", "tensor", "head"])
def test_quantize_kv_fp8_jit_equals_library(mode):
    import gqadrv

    x = kv_input()
    scales = {"tensor": np.array([0.03], np.float32), "head": np.array([0.01, 0.02, 0.03, 0.04], np.float32)}
    axis = -2 if mode == "head" else None
    if mode in ("computed", "value"):
        scale = None if mode == "computed" else 0.05
        f = jax.jit(lambda x: gj.quantize_kv_fp8(x, scale))
        codes, s = f(x)
    else:
        scale = jnp.asarray(scales[mode])
        f = jax.jit(lambda x, s: gj.quantize_kv_fp8(x, s, head_axis=axis))
        codes, s = f(x, scale)
    eager_c, eager_s = gj.quantize_kv_fp8(x, scale, head_axis=axis)
    want_c, want_s = gqadrv.quantize_kv_fp8(x, scale, head_axis=axis)
    assert codes.dtype == jnp.uint8 and codes.shape == x.shape
    assert same_bits(codes, want_c) and same_bits(eager_c, want_c)
    assert s.dtype == jnp.float32
    if mode == "computed":
        assert s.shape == () and same_bits(s, want_s) and same_bits(eager_s, want_s)
    elif mode == "value":
        assert s.shape == () and float(s) == want_s == float(np.float32(0.05)) and float(eager_s) == want_s
    else:
        assert same_bits(s, scale) and same_bits(eager_s, scale)
        new = jnp.asarray(scales[mode] * 1.5)   # an operand: the same compilation follows new values
        codes2, _ = f(x, new)
        assert same_bits(codes2, gqadrv.quantize_kv_fp8(x, new, head_axis=axis)[0])
    compiled_once(f)


# ----------------------------------------------------------------------------- FP8 MLA cache
def test_k_cache_ops_jit_equal_library():
    import gqadrv

    k = bf16_cache()
    k8 = jax.jit(gj.quantize_k_cache)(k)
    want8 = gqadrv.quantize_k_cache(k)
    assert k8.dtype == jnp.uint8 and k8.shape == (6, 16, 1, 656) and same_bits(k8, want8)
    back = jax.jit(gj.dequantize_k_cache)(k8)
    want_back = gqadrv.dequantize_k_cache(want8)
    assert back.dtype == jnp.bfloat16 and back.shape == (6, 16, 1, 576) and same_bits(back, want_back)
    for dt in (jnp.int8, jnp.float8_e4m3fn):   # float8 is bitcast to its bytes inside the wrapper
        assert same_bits(gj.dequantize_k_cache(jax.lax.bitcast_convert_type(k8, dt)), back), dt

    def roundtrip(k):
        k8 = gj.quantize_k_cache(k)
        return k8, gj.dequantize_k_cache(k8)

    r8, rback = jax.jit(roundtrip)(k)
    assert same_bits(r8, k8) and same_bits(rback, back)


# ----------------------------------------------------------------------------- FP8 MLA decode
def test_fp8_mla_jit_equals_bf16_on_dequantized_cache():
    q, k, bt = mla_inputs(63)
    jq, jk, jbt = jnp.asarray(q), jnp.asarray(k), jnp.asarray(bt)
    k8 = gj.quantize_k_cache(jk)
    kdq = gj.dequantize_k_cache(k8)
    kdq_host = np.asarray(kdq)
    f8 = jax.jit(lambda q, k, b, n: gj.flash_mla_with_kvcache(q, k, b, n, 512, None, SPLITS, MLA_SCALE, True, True,
                                                              backend="seesaw_fp8"))
    f16 = jax.jit(lambda q, k, b, n: gj.flash_mla_with_kvcache(q, k, b, n, 512, None, SPLITS, MLA_SCALE, True,
                                                               backend="seesaw"))
    # quantize and decode in one XLA program: the callbacks are ordered on XLA's stream
    chain = jax.jit(lambda q, kb, b, n: gj.flash_mla_with_kvcache(q, gj.quantize_k_cache(kb), b, n, 512, None, SPLITS,
                                                                  MLA_SCALE, True, True, backend="seesaw_fp8"))
    for lengths in MLA_LENGTHS:
        jl = jnp.asarray(np.array(lengths, np.int32))
        o8, l8 = f8(jq, k8, jbt, jl)
        o16, l16 = f16(jq, kdq, jbt, jl)
        assert o8.dtype == jnp.bfloat16 and o8.shape == (2, 2, 16, 512) and l8.shape == (2, 16, 2)
        assert same_bits(o8, o16) and same_bits(l8, l16), f"fp8 != bf16 on the dequantized cache, lengths {lengths}"
        co, cl = chain(jq, jk, jbt, jl)
        assert same_bits(co, o8) and same_bits(cl, l8)
        check_mla(np.asarray(o8).astype(np.float64), np.asarray(l8), mla_ref(q, kdq_host, bt, lengths, MLA_SCALE, True),
                  "bfloat16", f"jax fp8 mla {lengths}")
    compiled_once(f8)
    compiled_once(f16)
    jl = jnp.asarray(np.array(MLA_LENGTHS[0], np.int32))
    o, lse = gj.flash_mla_with_kvcache(jq, jax.lax.bitcast_convert_type(k8, jnp.float8_e4m3fn), jbt, jl, 512, None,
                                       SPLITS, MLA_SCALE, True, True, backend="seesaw_fp8")   # eager, float8 spelling
    o8, l8 = f8(jq, k8, jbt, jl)
    assert same_bits(o, o8) and same_bits(lse, l8)
