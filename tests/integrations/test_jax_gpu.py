"""gqadrv.jax on the GPU: buffer_callback ops under jax.jit with lengths that change between calls
(one compilation), eager calls, and jax.lax.scan over 3 layers against per-layer eager calls and the
float64 oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.integrations.cases import (
    GQA_LENGTHS,
    MLA_LENGTHS,
    check_gqa,
    check_mla,
    gqa_inputs,
    gqa_ref,
    mla_inputs,
    mla_ref,
)

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to gqadrv's CuPy pool
jax = pytest.importorskip("jax")
gj = pytest.importorskip("gqadrv.jax")  # skips where JAX < 0.7
jnp = jax.numpy

Q_SCALE = 0.7
MLA_SCALE = 0.05
LAYERS = 3


@pytest.fixture(autouse=True)
def _jax_gpu():
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")


def host(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def compiled_once(fn) -> None:
    size = getattr(fn, "_cache_size", None)
    if size is not None:
        assert size() == 1, f"jit compiled {size()} times"


def test_gqa_jit_with_changing_lengths():
    q, kv = gqa_inputs(11)
    jq, jkv = jnp.asarray(q), jnp.asarray(kv)
    f = jax.jit(lambda q, kv, lens: gj.gqa_decode(q, kv, lens, q_scale=Q_SCALE))
    for lengths in GQA_LENGTHS:
        jl = jnp.asarray(np.array(lengths, np.int32))
        got = f(jq, jkv, jl)
        assert isinstance(got, jax.Array) and got.dtype == jnp.float16 and got.shape == q.shape
        ref = gqa_ref(q, kv, lengths, Q_SCALE)
        check_gqa(host(got), ref, "float16", "jax jit")
        eager = gj.gqa_decode(jq, jkv, jl, q_scale=Q_SCALE)  # the same op outside jit
        check_gqa(host(eager), ref, "float16", "jax eager")
        np.testing.assert_allclose(host(got), host(eager), atol=1e-3, rtol=0)
    compiled_once(f)


def test_gqa_jit_fuses_with_jax_ops_on_its_stream():
    """JAX work before and after the callback (a scale of q, a reduction of the output) runs on the
    same stream in order: the result equals the oracle of the scaled q."""
    q, kv = gqa_inputs(12)
    lengths = GQA_LENGTHS[3]

    @jax.jit
    def f(q, kv, lens):
        o = gj.gqa_decode(q * jnp.float16(2), kv, lens)
        return o, jnp.sum(o.astype(jnp.float32), axis=-1)

    o, s = f(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(np.array(lengths, np.int32)))
    ref = gqa_ref(q.astype(np.float64) * 2, kv, lengths)
    check_gqa(host(o), ref, "float16", "jax jit + xla ops")
    np.testing.assert_allclose(host(s), host(o).sum(-1), rtol=1e-3, atol=1e-2)


def test_mla_jit_with_changing_lengths():
    q, k, bt = mla_inputs(13)
    jq, jk, jbt = jnp.asarray(q), jnp.asarray(k), jnp.asarray(bt)
    f = jax.jit(lambda q, k, bt, lens: gj.flash_mla_with_kvcache(q, k, bt, lens, 512, None, None, MLA_SCALE, True))
    for lengths in MLA_LENGTHS:
        out, lse = f(jq, jk, jbt, jnp.asarray(np.array(lengths, np.int32)))
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32 and lse.shape == (2, 16, 2)
        check_mla(host(out), host(lse), mla_ref(q, k, bt, lengths, MLA_SCALE, True), "bfloat16", "jax jit")
    compiled_once(f)


def test_gqa_scan_over_layers_matches_per_layer_eager_calls():
    """Three layers in one jitted lax.scan (each layer's output is the next layer's q) against the
    same chain of eager calls and against the oracle of each layer; the lengths change between two
    calls of the compiled scan."""
    q, kvs = gqa_inputs(14, layers=LAYERS)
    jq, jkvs = jnp.asarray(q), jnp.asarray(kvs)

    @jax.jit
    def model(q, kvs, lens):
        def layer(h, kv):
            o = gj.gqa_decode(h, kv, lens, q_scale=Q_SCALE)
            return o, o
        return jax.lax.scan(layer, q, kvs)

    for lengths in (GQA_LENGTHS[0], GQA_LENGTHS[2]):
        jl = jnp.asarray(np.array(lengths, np.int32))
        last, per_layer = model(jq, jkvs, jl)
        assert per_layer.shape == (LAYERS, *q.shape)
        h = jq
        for i in range(LAYERS):
            ref = gqa_ref(np.asarray(h), kvs[i], lengths, Q_SCALE)  # oracle of this layer from its actual input
            h = gj.gqa_decode(h, jnp.asarray(kvs[i]), jl, q_scale=Q_SCALE)
            check_gqa(host(h), ref, "float16", "jax eager layer")
            check_gqa(host(per_layer[i]), ref, "float16", "jax scan layer")
            np.testing.assert_allclose(host(per_layer[i]), host(h), atol=1e-3, rtol=0)
        np.testing.assert_array_equal(np.asarray(last), np.asarray(per_layer[-1]))
    compiled_once(model)
