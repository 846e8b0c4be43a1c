"""gqadrv.jax's sparse MLA decode (``flash_mla_with_kvcache`` with ``indices``) on the GPU: eager calls
against the float64 oracle (gqadrv.mla.sparse_reference) for an FP8 cache (built on the host with
quantize_k_cache_reference), an FP8 cache with an extra pool and a bf16 cache with an extra pool
(invalid indices of every kind, a NaN page named only past topk_length, +-inf attention sinks, a row
without valid keys); jax.jit equal to eager with one compilation for changing indices, lengths and
sinks; the float8_e4m3fn spelling of the FP8 pools; and the op inside jax.lax.scan over two layers
(per-layer pools, indices, sinks and lengths) equal to per-layer eager calls and the oracle. The
cases are in tests/integrations/sparse_cases.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.integrations.cases import check_mla
from tests.integrations.sparse_cases import H_Q, KINDS, S_Q, B, build, redraw

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to gqadrv's CuPy pool
jax = pytest.importorskip("jax")
gj = pytest.importorskip("gqadrv.jax")  # skips where JAX < 0.7
jnp = jax.numpy


@pytest.fixture(autouse=True)
def _jax_gpu():
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")


def compiled_once(fn) -> None:
    size = getattr(fn, "_cache_size", None)
    if size is not None:
        assert size() == 1, f"jit compiled {size()} times"


def device_case(kind: str, seed: int):
    """(host case, q, k_cache, {name: array} of the sparse keywords given), on the default (GPU) device."""
    h = build(kind, seed)
    return h, jnp.asarray(h.q), jnp.asarray(h.k_cache), {n: jnp.asarray(a) for n, a in h.arrays().items()}


def make_step(names: tuple, fp8: bool, scale: float | None):
    def step(q, k, *arrays):
        return gj.flash_mla_with_kvcache(q, k, None, None, 512, None, None, scale, False, fp8,
                                         **dict(zip(names, arrays)))

    return step


def check(h, out, lse, label: str, ref=None) -> None:
    assert out.dtype == jnp.bfloat16 and out.shape == (B, S_Q, H_Q, 512), (out.dtype, out.shape)
    assert lse.dtype == jnp.float32 and lse.shape == (B, H_Q, S_Q), (lse.dtype, lse.shape)
    o = np.asarray(out).astype(np.float64)
    check_mla(o, np.asarray(lse), h.reference() if ref is None else ref, "bfloat16", label)
    assert not o[:, :, 0].any(), f"{label}: the +inf sink of head 0 must zero its output"


def assert_close_outputs(got, want, label: str) -> None:
    (go, gl), (wo, wl) = got, want
    np.testing.assert_allclose(np.asarray(go).astype(np.float32), np.asarray(wo).astype(np.float32), atol=1e-3,
                               rtol=0, err_msg=f"{label}: out")
    np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), atol=1e-4, rtol=0, err_msg=f"{label}: lse")


def f8(x):
    return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)


# ----------------------------------------------------------------------------- eager vs oracle vs jit
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_eager_vs_oracle_vs_jit(kind):
    h, q, k, a = device_case(kind, 21)
    names = tuple(a)
    step = make_step(names, h.fp8, h.scale)
    jstep = jax.jit(step)
    for it in range(3):   # new indices, lengths and sinks (operands): one compilation serves them all
        if it:
            a.update({n: jnp.asarray(v) for n, v in redraw(h, 300 + it).items()})
        eager = step(q, k, *a.values())
        check(h, *eager, f"jax sparse {kind} eager #{it}")
        got = jstep(q, k, *a.values())
        check(h, *got, f"jax sparse {kind} jit #{it}")
        assert_close_outputs(got, eager, f"{kind} jit vs eager #{it}")
    compiled_once(jstep)

    # block_table / cache_seqlens are ignored on the sparse path
    bt = jnp.zeros((B, 3), jnp.int32)
    got = gj.flash_mla_with_kvcache(q, k, bt, bt[:, 0], 512, None, None, h.scale, False, h.fp8, **a)
    assert_close_outputs(got, eager, f"{kind} with ignored tables")
    if h.fp8:   # the float8_e4m3fn / int8 spellings of the same bytes (bitcast to uint8 inside the wrapper)
        fa = {n: (f8(v) if n == "extra_k_cache" else v) for n, v in a.items()}
        assert_close_outputs(jstep(q, f8(k), *fa.values()), eager, f"{kind} float8_e4m3fn pools")
        i8 = jax.lax.bitcast_convert_type(k, jnp.int8)
        assert_close_outputs(step(q, i8, *a.values()), eager, f"{kind} int8 cache")


def test_sparse_quantize_and_decode_in_one_program():
    """gqadrv.jax.quantize_k_cache and the sparse FP8 decode in one jit (the callbacks are ordered on
    XLA's stream), against the oracle on the host quantization of the same bf16 pool (its spare page
    holds data here, but no counted index names it)."""
    h, q, _k8, a = device_case("fp8", 22)
    kb = jnp.asarray(h.k_src)
    names = tuple(a)

    def chain(q, kb, *arrays):
        return gj.flash_mla_with_kvcache(q, gj.quantize_k_cache(kb), None, None, 512, None, None, h.scale, False,
                                         True, **dict(zip(names, arrays)))

    got = jax.jit(chain)(q, kb, *a.values())
    check(h, *got, "jax sparse quantize + decode")


# ----------------------------------------------------------------------------- lax.scan over layers
@pytest.mark.parametrize("kind", ["fp8_extra", "bf16_extra"])
def test_sparse_inside_lax_scan_over_two_layers(kind):
    layers = [build(kind, 40 + i) for i in range(2)]
    h0 = layers[0]
    names = tuple(h0.arrays())
    q = jnp.asarray(h0.q)
    ks = jnp.stack([jnp.asarray(h.k_cache) for h in layers])
    per_layer = tuple(jnp.stack([jnp.asarray(h.arrays()[n]) for h in layers]) for n in names)
    step = make_step(names, h0.fp8, h0.scale)

    @jax.jit
    def model(q, ks, *stacked):
        def body(carry, xs):
            k, *arrays = xs
            o, lse = step(q, k, *arrays)
            return carry + 1, (o, lse)
        return jax.lax.scan(body, jnp.int32(0), (ks, *stacked))

    n, (outs, lses) = model(q, ks, *per_layer)
    assert int(n) == 2 and outs.shape == (2, B, S_Q, H_Q, 512) and lses.shape == (2, B, H_Q, S_Q)
    for i, h in enumerate(layers):
        check(h, outs[i], lses[i], f"jax sparse scan {kind} layer {i}", ref=h.reference(h0.q))
        eager = step(q, ks[i], *(x[i] for x in per_layer))
        assert_close_outputs((outs[i], lses[i]), eager, f"{kind} scan layer {i} vs eager")
    # new per-layer indices / lengths / sinks: the same compilation
    for i, h in enumerate(layers):
        redraw(h, 500 + i)
    per_layer = tuple(jnp.stack([jnp.asarray(h.arrays()[n]) for h in layers]) for n in names)
    _, (outs, lses) = model(q, ks, *per_layer)
    for i, h in enumerate(layers):
        check(h, outs[i], lses[i], f"jax sparse scan {kind} layer {i} redrawn", ref=h.reference(h0.q))
    compiled_once(model)
