"""gqadrv.jax for the paged GQA decode, the contiguous LSE / multi-token call and the LSE state
merge: under jax.jit with lengths that change between calls (one compilation), against eager
gqadrv calls and the float64 oracles."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.integrations.paged_cases import (
    PAGED_LENGTHS,
    check_paged,
    fp8_paged_inputs,
    merge_inputs,
    paged_inputs,
    paged_ref,
)

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to gqadrv's CuPy pool
jax = pytest.importorskip("jax")
gj = pytest.importorskip("gqadrv.jax")  # skips where JAX < 0.7
jnp = jax.numpy

Q_SCALE = 0.7


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


@pytest.mark.parametrize("combined", [False, True])
def test_paged_jit_with_changing_lengths(combined):
    q, kc, vc, bt = paged_inputs(31, combined=combined)
    jq, jk, jb = jnp.asarray(q), jnp.asarray(kc), jnp.asarray(bt)
    jv = None if vc is None else jnp.asarray(vc)
    f = jax.jit(lambda q, k, v, b, l: gj.gqa_decode_paged(q, k, v, b, l, q_scale=Q_SCALE, return_lse=True))
    for lengths in PAGED_LENGTHS:
        out, lse = f(jq, jk, jv, jb, jnp.asarray(np.array(lengths, np.int32)))
        assert out.dtype == jnp.float16 and out.shape == q.shape and lse.shape == q.shape[:-1]
        check_paged(np.asarray(out), np.asarray(lse), paged_ref(q, kc, vc, bt, lengths, Q_SCALE), f"jax jit {lengths}")
    compiled_once(f)


def test_contiguous_lse_under_jit():
    rng = np.random.default_rng(32)
    q = rng.standard_normal((2, 3, 8, 64)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 2, 200, 64)).astype(np.float16)
    f = jax.jit(lambda q, kv, l: gj.gqa_decode(q, kv, l, q_scale=Q_SCALE, return_lse=True))
    jl = jnp.asarray(np.array([200, 40], np.int32))
    out, lse = f(jnp.asarray(q), jnp.asarray(kv), jl)
    import cupy as cp

    import gqadrv

    wo, wl = gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(np.array([200, 40], np.int32)),
                               q_scale=Q_SCALE, return_lse=True)
    assert np.array_equal(np.asarray(out), cp.asnumpy(wo)) and np.array_equal(np.asarray(lse), cp.asnumpy(wl))


def test_merge_under_jit():
    v, s, rv, rs = merge_inputs(33)
    mv, ms = jax.jit(gj.merge_states)(jnp.asarray(v), jnp.asarray(s))
    assert mv.shape == (6, 4, 64) and ms.dtype == jnp.float32
    assert np.abs(np.asarray(mv).astype(np.float64) - rv).max() < 5e-3
    assert np.abs(np.asarray(ms) - rs).max() < 1e-4
    pv, ps = jax.jit(gj.merge_state)(jnp.asarray(v[:, 0]), jnp.asarray(s[:, 0]), jnp.asarray(v[:, 1]),
                                     jnp.asarray(s[:, 1]))
    assert pv.shape == (6, 4, 64) and ps.shape == (6, 4)


def test_fp8_paged_jit_with_changing_lengths_and_scales():
    """uint8 e4m3 pages (kv_dtype='e4m3', static) with per-head scale arrays as operands: one jit
    compilation serves changing lengths and scales; results match the oracle on the dequantized cache."""
    q, k8, v8, bt, ks, vs, kd, vd = fp8_paged_inputs(43)
    jq, jk, jv, jb = jnp.asarray(q), jnp.asarray(k8), jnp.asarray(v8), jnp.asarray(bt)
    f = jax.jit(lambda q, k, v, b, l, ksc, vsc: gj.gqa_decode_paged(q, k, v, b, l, q_scale=Q_SCALE, return_lse=True,
                                                                    kv_dtype="e4m3", k_scale=ksc, v_scale=vsc))
    for i, lengths in enumerate(PAGED_LENGTHS):
        new_ks = ks * (1.0 + 0.5 * i)
        out, lse = f(jq, jk, jv, jb, jnp.asarray(np.array(lengths, np.int32)), jnp.asarray(new_ks), jnp.asarray(vs))
        ref = paged_ref(q, kd / ks[:, None] * new_ks[:, None], vd, bt, lengths, Q_SCALE)
        check_paged(np.asarray(out), np.asarray(lse), ref, f"jax fp8 jit {lengths}")
    compiled_once(f)
    # host-number scales are static
    out, lse = gj.gqa_decode_paged(jq, jk, jv, jb, jnp.asarray(np.array(PAGED_LENGTHS[0], np.int32)),
                                   q_scale=Q_SCALE, return_lse=True, kv_dtype="e4m3", k_scale=float(ks[0]),
                                   v_scale=float(vs[0]))
    ks0, vs0 = np.full_like(ks, ks[0]), np.full_like(vs, vs[0])
    ref = paged_ref(q, kd / ks[:, None] * ks0[:, None], vd / vs[:, None] * vs0[:, None], bt, PAGED_LENGTHS[0], Q_SCALE)
    check_paged(np.asarray(out), np.asarray(lse), ref, "jax fp8 host scales")
