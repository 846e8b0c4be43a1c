"""CPU tests of the FP8 wrappers of gqadrv.torch / gqadrv.jax (quantize_kv_fp8, quantize_k_cache,
dequantize_k_cache, flash_mla_with_kvcache(is_fp8_kvcache=True)) and of the rule that every public op
of gqadrv has a wrapper in both modules with the library's parameters.

Without a GPU: the op bodies run on CPU tensors / XLA:CPU buffers with the gqadrv calls replaced by
stand-ins built on the numpy references (gqadrv.gqa.fp8_reference, gqadrv.mla.fp8_reference), which
checks the plumbing (framework-allocated outputs handed over as ``out=`` / ``out_scale=``, the
framework's stream, static options, returned scales); the fake implementations and JAX abstract
evaluation check shapes and dtypes; Dynamo and JAX lowering check that each call is one node / one
custom call. GPU execution is in test_torch_fp8_gpu.py / test_jax_fp8_gpu.py."""

from __future__ import annotations

import ast
import contextlib
import inspect
import pathlib

import numpy as np
import pytest

import gqadrv
from gqadrv.gqa.fp8_reference import quantize_kv_fp8_reference
from gqadrv.mla.fp8_reference import dequantize_k_cache_reference, quantize_k_cache_reference

PKG = pathlib.Path(__file__).resolve().parents[2] / "gqadrv"

# ----------------------------------------------------------------------------- every public op is wrapped
# Public names of gqadrv that are not ops on framework arrays (docs/INTEGRATIONS.md, "Not registered"):
# types and errors (capitalised), the prepared API (prepare_* / launch_* / check_status: they allocate
# and synchronize at prepare time), float64 oracles (*_reference), the SM110-only entry points
# (sm110_*: use gqa_decode), FlashMLA's metadata call (host only; the wrappers accept and ignore it).
NOT_OPS_EXACT = {"__version__", "check_status", "get_mla_metadata"}
NOT_OPS_PREFIXES = ("prepare_", "launch_", "sm110_")
NOT_OPS_SUFFIXES = ("_reference",)
# Library parameters a wrapper does not take: outputs and the stream (the framework owns them). FlashMLA's
# sparse arguments of flash_mla_with_kvcache are wrapped (tests/integrations/test_integrations_sparse_host.py).
NOT_FORWARDED = {"out", "lse", "out_lse", "out_scale", "stats", "stream"}
EXPECTED_OPS = {"gqa_decode", "gqa_decode_paged", "merge_state", "merge_states", "flash_mla_with_kvcache",
                "quantize_kv_fp8", "quantize_k_cache", "dequantize_k_cache", "flash_mla_sparse_fwd"}


def public_ops() -> set[str]:
    return {n for n in gqadrv.__all__
            if not n[0].isupper() and n not in NOT_OPS_EXACT and not n.startswith(NOT_OPS_PREFIXES)
            and not n.endswith(NOT_OPS_SUFFIXES)}


def _module_api(name: str) -> tuple[set[str], dict[str, ast.FunctionDef]]:
    """(``__all__``, top-level functions) of gqadrv/<name>.py, read without importing the framework."""
    tree = ast.parse((PKG / name).read_text())
    exported: set[str] = set()
    funcs: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = set(ast.literal_eval(node.value))
        elif isinstance(node, ast.FunctionDef):
            funcs[node.name] = node
    return exported, funcs


def test_public_op_list_is_the_expected_one():
    # a new public name of gqadrv lands here first: wrap it in both modules (or exclude it above and in
    # docs/INTEGRATIONS.md), then extend EXPECTED_OPS
    assert public_ops() == EXPECTED_OPS
    excluded = set(gqadrv.__all__) - public_ops()
    assert {"prepare_mla_decode", "launch_prepared", "gqa_decode_reference", "sm110_gqa_decode",
            "get_mla_metadata", "FeatureError"} <= excluded


@pytest.mark.parametrize("module", ["torch.py", "jax.py"])
@pytest.mark.parametrize("op", sorted(EXPECTED_OPS))
def test_every_public_op_has_a_wrapper_with_the_library_parameters(module, op):
    exported, funcs = _module_api(module)
    assert op in exported and op in funcs, f"gqadrv/{module} does not wrap gqadrv.{op}"
    fn = funcs[op]
    wrapper_positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    wrapper = set(wrapper_positional) | {a.arg for a in fn.args.kwonlyargs}
    lib = inspect.signature(getattr(gqadrv, op)).parameters
    wanted = {n for n in lib if n not in NOT_FORWARDED}
    assert wrapper == wanted, f"gqadrv/{module}:{op} lacks {sorted(wanted - wrapper)}, extra {sorted(wrapper - wanted)}"
    lib_positional = [n for n, p in lib.items() if n in wanted and p.kind is p.POSITIONAL_OR_KEYWORD]
    assert wrapper_positional == lib_positional, f"{module}:{op} positional order differs from the library's"


# ----------------------------------------------------------------------------- torch
def _torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip(f"torch {torch.__version__} < 2.4")
    import gqadrv.torch as gt

    return torch, gt


def _meta(torch, shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_torch_every_public_op_is_a_functional_custom_op():
    torch, _gt = _torch()
    for name in EXPECTED_OPS:
        schema = getattr(torch.ops.gqadrv, name).default._schema
        assert not schema.is_mutable and all(a.alias_info is None for a in schema.arguments), schema
        assert all(r.alias_info is None for r in schema.returns), schema
    mla = torch.ops.gqadrv.flash_mla_with_kvcache.default._schema
    # is_fp8_kvcache stays the 10th argument (defaulted); only defaulted optional tensors (the sparse path) follow
    fp8 = mla.arguments[9]
    assert fp8.name == "is_fp8_kvcache" and str(fp8.type) == "bool" and fp8.default_value is False
    assert all(str(a.type) == "Optional[Tensor]" and a.default_value is None for a in mla.arguments[10:]), mla
    assert len(torch.ops.gqadrv.quantize_kv_fp8.default._schema.returns) == 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_quantize_kv_fp8_fake_shapes(dtype):
    torch, gt = _torch()
    x = _meta(torch, (3, 40, 4, 64), getattr(torch, dtype))
    for scale in (None, 0.05):
        codes, s = gt.quantize_kv_fp8(x, scale)
        assert codes.shape == x.shape and codes.dtype == torch.uint8 and codes.device.type == "meta"
        assert s.shape == () and s.dtype == torch.float32
    for st, axis in ((_meta(torch, (4,), torch.float32), -2), (_meta(torch, (1,), torch.float32), None),
                     (_meta(torch, (), torch.float32), None)):
        codes, s = gt.quantize_kv_fp8(x, st, head_axis=axis)
        assert codes.shape == x.shape and s.shape == st.shape and s.dtype == torch.float32


def test_torch_quantize_kv_fp8_rejections():
    torch, gt = _torch()
    x = _meta(torch, (2, 4, 8), torch.float16)
    with pytest.raises(ValueError, match="head_axis selects per-head scales"):
        gt.quantize_kv_fp8(x, head_axis=1)
    with pytest.raises(ValueError, match="head_axis selects per-head scales"):
        gt.quantize_kv_fp8(x, 0.5, head_axis=1)
    with pytest.raises(TypeError, match="float32"):
        gt.quantize_kv_fp8(x, _meta(torch, (), torch.float16))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        gt.quantize_kv_fp8(_meta(torch, (2, 4), torch.int32))
    with pytest.raises(TypeError, match="scale must be None, a number or a float32 tensor"):
        gt.quantize_kv_fp8(x, True)
    with pytest.raises(TypeError, match="head_axis must be None or an int"):
        gt.quantize_kv_fp8(x, _meta(torch, (4,), torch.float32), head_axis=1.0)


def test_torch_k_cache_fake_shapes_and_rejections():
    torch, gt = _torch()
    k = _meta(torch, (5, 16, 1, 576), torch.bfloat16)
    k8 = gt.quantize_k_cache(k)
    assert k8.shape == (5, 16, 1, 656) and k8.dtype == torch.uint8
    for dt in ("uint8", "int8", "float8_e4m3fn"):
        if not hasattr(torch, dt):
            continue
        back = gt.dequantize_k_cache(_meta(torch, (5, 16, 1, 656), getattr(torch, dt)))
        assert back.shape == (5, 16, 1, 576) and back.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="bfloat16"):
        gt.quantize_k_cache(_meta(torch, (5, 16, 1, 576), torch.float16))
    with pytest.raises(ValueError, match=r"\[num_blocks, page_size, 1, 576\]"):
        gt.quantize_k_cache(_meta(torch, (5, 16, 2, 576), torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[num_blocks, page_size, 1, 656\]"):
        gt.dequantize_k_cache(_meta(torch, (5, 16, 1, 576), torch.uint8))
    with pytest.raises(TypeError, match="uint8 or int8 or float8_e4m3fn"):
        gt.dequantize_k_cache(_meta(torch, (5, 16, 1, 656), torch.float16))


def _mla_fp8_meta(torch):
    return (_meta(torch, (2, 2, 16, 576), torch.bfloat16), _meta(torch, (10, 64, 1, 656), torch.uint8),
            _meta(torch, (2, 5), torch.int32), _meta(torch, (2,), torch.int32))


def test_torch_mla_fp8_fake_shapes_and_rejections():
    torch, gt = _torch()
    q, k8, bt, ln = _mla_fp8_meta(torch)
    out, lse = gt.flash_mla_with_kvcache(q, k8, bt, ln, 512, None, None, None, True, True)
    assert out.shape == (2, 2, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (2, 16, 2)
    out, _ = gt.flash_mla_with_kvcache(q, k8, bt, ln, is_fp8_kvcache=True, backend="seesaw_fp8")
    assert out.shape == (2, 2, 16, 512)
    with pytest.raises(TypeError, match="bfloat16 q"):
        gt.flash_mla_with_kvcache(q.to(torch.float16), k8, bt, ln, is_fp8_kvcache=True)
    with pytest.raises(ValueError, match="656"):
        gt.flash_mla_with_kvcache(q, _meta(torch, (10, 64, 1, 576), torch.bfloat16), bt, ln, is_fp8_kvcache=True)
    # the nine-argument schema call of the bf16 path still works (is_fp8_kvcache defaults to False)
    k = _meta(torch, (10, 64, 1, 576), torch.bfloat16)
    out, _ = torch.ops.gqadrv.flash_mla_with_kvcache(q, k, bt, ln, 512, None, None, True, None)
    assert out.shape == (2, 2, 16, 512)


def test_torch_fp8_step_compiles_without_graph_breaks():
    torch, gt = _torch()
    x = _meta(torch, (3, 40, 4, 64), torch.float16)
    hs = _meta(torch, (4,), torch.float32)
    kb = _meta(torch, (10, 64, 1, 576), torch.bfloat16)
    q, _k8, bt, ln = _mla_fp8_meta(torch)

    def step(x, hs, kb, q, bt, ln):
        c0, s0 = gt.quantize_kv_fp8(x)
        c1, s1 = gt.quantize_kv_fp8(x, 0.05)
        c2, s2 = gt.quantize_kv_fp8(x, hs, head_axis=-2)
        k8 = gt.quantize_k_cache(kb)
        back = gt.dequantize_k_cache(k8)
        o, lse = gt.flash_mla_with_kvcache(q, k8, bt, ln, 512, None, None, 0.05, True, True)
        return (c0.float().sum() + c1.float().sum() + c2.float().sum() + s0 + s1 + s2.sum() + back.float().sum()
                + o.float().sum() + lse.sum())

    args = (x, hs, kb, q, bt, ln)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    ops = {str(n.target).removesuffix(".default") for g in explain.graphs for n in g.graph.nodes
           if n.op == "call_function"}
    assert {f"gqadrv.{n}" for n in ("quantize_kv_fp8", "quantize_k_cache", "dequantize_k_cache",
                                    "flash_mla_with_kvcache")} <= ops, ops
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(*args).shape == ()


def _torch_bf16_to_numpy(torch, t):
    import ml_dtypes

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def test_torch_op_bodies_hand_torch_outputs_to_gqadrv(monkeypatch):
    """The real op bodies on CPU tensors, with the gqadrv calls replaced by reference stand-ins that
    check what the body passes: torch-allocated outputs as out= / out_scale=, torch's stream."""
    torch, gt = _torch()
    calls: list[dict] = []
    monkeypatch.setattr(gt, "_stream", lambda t: 4321)

    def kv_fp8(x, scale=None, *, head_axis=None, out=None, out_scale=None, stream=None):
        calls.append(dict(stream=stream, out=out, out_scale=out_scale, scale=scale, head_axis=head_axis))
        assert out is not None and out.dtype == torch.uint8 and tuple(out.shape) == tuple(x.shape)
        sc = scale if scale is None or isinstance(scale, float) else scale.numpy()
        codes, s = quantize_kv_fp8_reference(x.numpy(), sc, head_axis=head_axis)
        out.numpy()[...] = codes
        if scale is None:
            assert out_scale is not None and out_scale.dtype == torch.float32
            out_scale.numpy()[...] = s
            return out, out_scale
        assert out_scale is None
        return out, (float(np.float32(scale)) if isinstance(scale, float) else scale)

    monkeypatch.setattr(gt, "_quantize_kv_fp8", kv_fp8)
    x = torch.from_numpy((np.random.default_rng(0).standard_normal((3, 5, 4, 16)) * 3).astype(np.float16))
    body = gt._quantize_kv_fp8_op._init_fn
    codes, s = body(x, None, None, None)
    want, want_s = quantize_kv_fp8_reference(x.numpy())
    assert calls[-1]["out"] is codes and calls[-1]["out_scale"] is s and calls[-1]["stream"] == 4321
    assert codes.dtype == torch.uint8 and np.array_equal(codes.numpy(), want)
    assert s.shape == () and s.dtype == torch.float32 and s.item() == want_s
    codes, s = body(x, None, 0.05, None)
    assert calls[-1]["scale"] == 0.05 and calls[-1]["out"] is codes
    assert np.array_equal(codes.numpy(), quantize_kv_fp8_reference(x.numpy(), 0.05)[0])
    assert s.shape == () and s.dtype == torch.float32 and s.item() == float(np.float32(0.05))
    hs = torch.tensor([0.01, 0.02, 0.03, 0.04], dtype=torch.float32)
    codes, s = body(x, hs, None, -2)
    assert calls[-1]["head_axis"] == -2 and calls[-1]["out"] is codes
    assert np.array_equal(codes.numpy(), quantize_kv_fp8_reference(x.numpy(), hs.numpy(), head_axis=-2)[0])
    assert torch.equal(s, hs) and s.data_ptr() != hs.data_ptr()   # a copy: outputs alias no input

    def k_cache_q(k, *, out=None, stream=None):
        calls.append(dict(stream=stream, out=out))
        out.numpy()[...] = quantize_k_cache_reference(_torch_bf16_to_numpy(torch, k))
        return out

    def k_cache_dq(k, *, out=None, stream=None):
        calls.append(dict(stream=stream, out=out))
        src = k.view(torch.uint8) if k.dtype != torch.uint8 else k
        out.view(torch.int16).numpy()[...] = dequantize_k_cache_reference(src.numpy()).view(np.int16)
        return out

    monkeypatch.setattr(gt, "_quantize_k_cache", k_cache_q)
    monkeypatch.setattr(gt, "_dequantize_k_cache", k_cache_dq)
    import ml_dtypes

    kb = (np.random.default_rng(1).standard_normal((3, 4, 1, 576)) * 0.5).astype(ml_dtypes.bfloat16)
    tk = torch.from_numpy(kb.view(np.int16).copy()).view(torch.bfloat16)
    k8 = gt._quantize_k_cache_op._init_fn(tk)
    assert calls[-1]["out"] is k8 and calls[-1]["stream"] == 4321
    assert k8.dtype == torch.uint8 and k8.shape == (3, 4, 1, 656)
    assert np.array_equal(k8.numpy(), quantize_k_cache_reference(kb))
    f8 = (k8.view(torch.float8_e4m3fn),) if hasattr(torch, "float8_e4m3fn") else ()
    for view in (k8, k8.view(torch.int8), *f8):
        back = gt._dequantize_k_cache_op._init_fn(view)
        assert calls[-1]["out"] is back and back.dtype == torch.bfloat16 and back.shape == (3, 4, 1, 576)
        assert np.array_equal(back.view(torch.int16).numpy(), dequantize_k_cache_reference(k8.numpy()).view(np.int16))

    def mla(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, *,
            is_fp8_kvcache=False, out=None, lse=None, stream=None, backend=None):
        calls.append(dict(fp8=is_fp8_kvcache, out=out, lse=lse, stream=stream, backend=backend, splits=num_splits))
        out.zero_()
        lse.zero_()
        return out, lse

    monkeypatch.setattr(gt, "_flash_mla", mla)
    q = torch.zeros((2, 1, 16, 576), dtype=torch.bfloat16)
    bt, ln = torch.zeros((2, 2), dtype=torch.int32), torch.zeros((2,), dtype=torch.int32)
    out, lse = gt._flash_mla_op._init_fn(q, k8, bt, ln, 512, 3, None, True, "seesaw_fp8", True)
    c = calls[-1]
    assert c["fp8"] is True and c["out"] is out and c["lse"] is lse and c["stream"] == 4321
    assert c["backend"] == "seesaw_fp8" and c["splits"] == 3
    assert out.shape == (2, 1, 16, 512) and out.dtype == torch.bfloat16 and lse.shape == (2, 16, 1)
    gt._flash_mla_op._init_fn(q, tk, bt, ln, 512, None, None, False, None)   # the default: a bf16 cache
    assert calls[-1]["fp8"] is False


# ----------------------------------------------------------------------------- JAX
def _jax():
    jax = pytest.importorskip("jax")
    try:
        import gqadrv.jax as gj
    except ImportError as exc:
        pytest.skip(str(exc))
    return jax, gj


def _sds(jax, shape, dtype):
    return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype))


def test_jax_quantize_kv_fp8_abstract_shapes():
    jax, gj = _jax()
    jnp = jax.numpy
    for dt in ("float16", "bfloat16", "float32"):
        x = _sds(jax, (3, 40, 4, 64), dt)
        codes, s = jax.eval_shape(gj.quantize_kv_fp8, x)
        assert codes.shape == (3, 40, 4, 64) and codes.dtype == jnp.uint8 and s.shape == () and s.dtype == jnp.float32
        codes, s = jax.eval_shape(lambda a: gj.quantize_kv_fp8(a, 0.05), x)
        assert codes.dtype == jnp.uint8 and s.shape == () and s.dtype == jnp.float32
        codes, s = jax.eval_shape(lambda a, b: gj.quantize_kv_fp8(a, b, head_axis=2), x, _sds(jax, (4,), "float32"))
        assert codes.shape == (3, 40, 4, 64) and s.shape == (4,)
        codes, s = jax.eval_shape(lambda a, b: gj.quantize_kv_fp8(a, b), x, _sds(jax, (1,), "float32"))
        assert s.shape == (1,)


def test_jax_k_cache_and_mla_fp8_abstract_shapes():
    jax, gj = _jax()
    jnp = jax.numpy
    k8 = jax.eval_shape(gj.quantize_k_cache, _sds(jax, (5, 16, 1, 576), "bfloat16"))
    assert k8.shape == (5, 16, 1, 656) and k8.dtype == jnp.uint8
    for dt in ("uint8", "int8", "float8_e4m3fn"):
        back = jax.eval_shape(gj.dequantize_k_cache, _sds(jax, (5, 16, 1, 656), dt))
        assert back.shape == (5, 16, 1, 576) and back.dtype == jnp.bfloat16
        q, bt, ln = _sds(jax, (2, 2, 16, 576), "bfloat16"), _sds(jax, (2, 5), "int32"), _sds(jax, (2,), "int32")
        o, lse = jax.eval_shape(lambda a, b, c, d: gj.flash_mla_with_kvcache(a, b, c, d, 512, None, None, None, True,
                                                                             True), q, _sds(jax, (10, 64, 1, 656), dt),
                                bt, ln)
        assert o.shape == (2, 2, 16, 512) and o.dtype == jnp.bfloat16 and lse.shape == (2, 16, 2)


def test_jax_fp8_ops_lower_to_one_callback_each():
    jax, gj = _jax()
    x, hs = _sds(jax, (2, 8, 4, 32), "bfloat16"), _sds(jax, (4,), "float32")
    kb = _sds(jax, (4, 16, 1, 576), "bfloat16")
    q, bt, ln = _sds(jax, (2, 1, 16, 576), "bfloat16"), _sds(jax, (2, 2), "int32"), _sds(jax, (2,), "int32")
    cases = [(lambda a: gj.quantize_kv_fp8(a), (x,)), (lambda a: gj.quantize_kv_fp8(a, 0.5), (x,)),
             (lambda a, s: gj.quantize_kv_fp8(a, s, head_axis=-2), (x, hs)), (gj.quantize_k_cache, (kb,)),
             (lambda k: gj.dequantize_k_cache(gj.quantize_k_cache(k)), (kb,)),
             (lambda q, k, b, n: gj.flash_mla_with_kvcache(q, gj.quantize_k_cache(k), b, n, is_fp8_kvcache=True),
              (q, kb, bt, ln))]
    counts = [jax.jit(f).lower(*args).as_text().count("xla_buffer_python") for f, args in cases]
    assert counts == [1, 1, 1, 1, 2, 2]
    # float8 caches are bitcast to their uint8 bytes before the callback (same shape, no DLPack float8)
    f8 = _sds(jax, (4, 16, 1, 656), "float8_e4m3fn")
    text = jax.jit(gj.dequantize_k_cache).lower(f8).as_text()
    assert "bitcast_convert" in text and text.count("xla_buffer_python") == 1


def test_jax_fp8_equal_calls_share_one_callback():
    _, gj = _jax()
    a = gj._kv_fp8_callable((2, 8), "computed", None, None)
    assert gj._kv_fp8_callable((2, 8), "computed", None, None) is a
    assert gj._kv_fp8_callable((2, 8), "value", 0.5, None) is not a
    m = gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True)
    assert gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True) is m
    assert gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, False) is not m
    assert gj._k_cache_callable(4, 16, True) is gj._k_cache_callable(4, 16, True)


def test_jax_fp8_rejections():
    jax, gj = _jax()
    x = _sds(jax, (2, 8, 4, 32), "float16")
    with pytest.raises(ValueError, match="head_axis selects per-head scales"):
        jax.eval_shape(lambda a: gj.quantize_kv_fp8(a, head_axis=2), x)
    with pytest.raises(ValueError, match="not a number"):
        jax.eval_shape(lambda a: gj.quantize_kv_fp8(a, 0.5, head_axis=2), x)
    with pytest.raises(ValueError, match="per-head scales must have shape"):
        jax.eval_shape(lambda a, s: gj.quantize_kv_fp8(a, s, head_axis=2), x, _sds(jax, (3,), "float32"))
    with pytest.raises(ValueError, match="per-tensor scale has one element"):
        jax.eval_shape(lambda a, s: gj.quantize_kv_fp8(a, s), x, _sds(jax, (4,), "float32"))
    with pytest.raises(TypeError, match="must be float32"):
        jax.eval_shape(lambda a, s: gj.quantize_kv_fp8(a, s), x, _sds(jax, (), "float16"))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        jax.eval_shape(gj.quantize_kv_fp8, _sds(jax, (2, 8), "int32"))
    with pytest.raises(ValueError, match="scale"):
        jax.eval_shape(lambda a: gj.quantize_kv_fp8(a, -1.0), x)
    with pytest.raises(TypeError, match="bfloat16"):
        jax.eval_shape(gj.quantize_k_cache, _sds(jax, (4, 16, 1, 576), "float16"))
    with pytest.raises(ValueError, match=r"\[num_blocks, page_size, 1, 656\]"):
        jax.eval_shape(gj.dequantize_k_cache, _sds(jax, (4, 16, 1, 576), "uint8"))
    q, k8 = _sds(jax, (1, 1, 16, 576), "bfloat16"), _sds(jax, (4, 16, 1, 656), "uint8")
    bt, ln = _sds(jax, (1, 4), "int32"), _sds(jax, (1,), "int32")
    with pytest.raises(TypeError, match="bfloat16 q"):
        jax.eval_shape(lambda a, b, c, d: gj.flash_mla_with_kvcache(a, b, c, d, is_fp8_kvcache=True),
                       _sds(jax, (1, 1, 16, 576), "float16"), k8, bt, ln)
    with pytest.raises(ValueError, match="656"):
        jax.eval_shape(lambda a, b, c, d: gj.flash_mla_with_kvcache(a, b, c, d, is_fp8_kvcache=True), q,
                       _sds(jax, (4, 16, 1, 576), "bfloat16"), bt, ln)
    with pytest.raises(TypeError, match="is_fp8_kvcache must be a static Python bool"):
        jax.eval_shape(lambda a, b, c, d, f: gj.flash_mla_with_kvcache(a, b, c, d, is_fp8_kvcache=f), q, k8, bt, ln,
                       _sds(jax, (), "bool"))


def test_jax_fp8_callbacks_hand_xla_buffers_to_gqadrv(monkeypatch):
    """The buffer_callbacks executed by XLA:CPU, with the CUDA target and the gqadrv calls replaced by
    reference stand-ins: XLA's output buffers arrive as out= / out_scale=, the stream is the
    context's, static numbers and axes reach the library, results come back as JAX arrays."""
    jax, gj = _jax()
    jnp = jax.numpy
    import ml_dtypes

    calls: list[dict] = []
    monkeypatch.setattr(gj, "_cuda_target", lambda ctx, first: (4321, 0))
    monkeypatch.setattr(gj, "device_scope", lambda ordinal: contextlib.nullcontext())

    def kv_fp8(x, scale=None, *, head_axis=None, out=None, out_scale=None, stream=None):
        calls.append(dict(stream=stream, scale=scale, head_axis=head_axis, out=out is not None,
                          out_scale=out_scale is not None))
        sc = scale if scale is None or isinstance(scale, float) else np.asarray(scale)
        codes, s = quantize_kv_fp8_reference(np.asarray(x), sc, head_axis=head_axis)
        np.asarray(out)[...] = codes
        if out_scale is not None:
            np.asarray(out_scale)[...] = s

    monkeypatch.setattr(gj, "_quantize_kv_fp8", kv_fp8)
    cpu = jax.devices("cpu")[0]
    xh = (np.random.default_rng(2).standard_normal((3, 5, 4, 16)) * 3).astype(ml_dtypes.bfloat16)
    x = jax.device_put(xh, cpu)
    codes, s = jax.jit(gj.quantize_kv_fp8)(x)
    want, want_s = quantize_kv_fp8_reference(xh)
    assert calls[-1] == dict(stream=4321, scale=None, head_axis=None, out=True, out_scale=True)
    assert codes.dtype == jnp.uint8 and np.array_equal(np.asarray(codes), want) and np.asarray(s) == want_s
    codes, s = jax.jit(lambda a: gj.quantize_kv_fp8(a, 0.05))(x)
    assert calls[-1]["scale"] == float(np.float32(0.05)) and not calls[-1]["out_scale"]
    assert np.array_equal(np.asarray(codes), quantize_kv_fp8_reference(xh, 0.05)[0])
    assert s.dtype == jnp.float32 and np.asarray(s) == np.float32(0.05)
    hs = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    f = jax.jit(lambda a, b: gj.quantize_kv_fp8(a, b, head_axis=-2))
    codes, s = f(x, jax.device_put(hs, cpu))
    assert calls[-1]["head_axis"] == 2 and calls[-1]["out"]   # normalized: static, part of the callback's key
    assert np.array_equal(np.asarray(codes), quantize_kv_fp8_reference(xh, hs, head_axis=-2)[0])
    assert np.array_equal(np.asarray(s), hs)
    codes, _ = f(x, jax.device_put(hs * 2, cpu))   # the scales are an operand: the same compilation follows them
    assert np.array_equal(np.asarray(codes), quantize_kv_fp8_reference(xh, hs * 2, head_axis=-2)[0])

    def k_cache_q(k, *, out=None, stream=None):
        calls.append(dict(stream=stream, out=out is not None))
        np.asarray(out)[...] = quantize_k_cache_reference(np.asarray(k))

    def k_cache_dq(k, *, out=None, stream=None):
        src = np.asarray(k)
        calls.append(dict(stream=stream, out=out is not None, dtype=src.dtype.name))
        np.asarray(out)[...] = dequantize_k_cache_reference(src)

    monkeypatch.setattr(gj, "_quantize_k_cache", k_cache_q)
    monkeypatch.setattr(gj, "_dequantize_k_cache", k_cache_dq)
    kh = (np.random.default_rng(3).standard_normal((3, 4, 1, 576)) * 0.5).astype(ml_dtypes.bfloat16)
    k8 = jax.jit(gj.quantize_k_cache)(jax.device_put(kh, cpu))
    assert calls[-1] == dict(stream=4321, out=True)
    assert k8.dtype == jnp.uint8 and np.array_equal(np.asarray(k8), quantize_k_cache_reference(kh))
    want = dequantize_k_cache_reference(np.asarray(k8)).view(np.uint16)
    for view in (k8, jax.lax.bitcast_convert_type(k8, jnp.int8), jax.lax.bitcast_convert_type(k8, jnp.float8_e4m3fn)):
        back = jax.jit(gj.dequantize_k_cache)(view)
        assert calls[-1]["dtype"] in ("uint8", "int8")   # float8 arrives as its uint8 bytes
        assert back.dtype == jnp.bfloat16 and np.array_equal(np.asarray(back).view(np.uint16), want)

    def mla(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, *,
            is_fp8_kvcache=False, out=None, lse=None, stream=None, backend=None):
        calls.append(dict(fp8=is_fp8_kvcache, dtype=np.asarray(k_cache).dtype.name, stream=stream, backend=backend,
                          splits=num_splits, causal=causal))
        np.asarray(out)[...] = 0
        np.asarray(lse)[...] = 0

    monkeypatch.setattr(gj, "_flash_mla", mla)
    q = jax.device_put(np.zeros((2, 1, 16, 576), ml_dtypes.bfloat16), cpu)
    bt, ln = jax.device_put(np.zeros((2, 2), np.int32), cpu), jax.device_put(np.zeros(2, np.int32), cpu)
    o, lse = jax.jit(lambda q, k, b, n: gj.flash_mla_with_kvcache(q, k, b, n, 512, None, 3, None, True, True,
                                                                  backend="seesaw_fp8"))(
        q, jax.lax.bitcast_convert_type(k8, jnp.float8_e4m3fn), bt, ln)
    assert calls[-1] == dict(fp8=True, dtype="uint8", stream=4321, backend="seesaw_fp8", splits=3, causal=True)
    assert o.shape == (2, 1, 16, 512) and o.dtype == jnp.bfloat16 and lse.shape == (2, 16, 1)
    jax.jit(gj.flash_mla_with_kvcache)(q, jax.device_put(kh, cpu), bt, ln)
    assert calls[-1]["fp8"] is False and calls[-1]["dtype"] == "bfloat16"


def test_jax_fp8_on_a_cpu_backend_says_cuda_only():
    jax, gj = _jax()
    jnp = jax.numpy
    cpu = jax.devices("cpu")[0]
    with pytest.raises(Exception, match="gqadrv.jax runs on CUDA devices only"):
        jax.block_until_ready(gj.quantize_kv_fp8(jax.device_put(jnp.zeros((4, 8), jnp.float16), cpu)))
    with pytest.raises(Exception, match="gqadrv.jax runs on CUDA devices only"):
        jax.block_until_ready(gj.dequantize_k_cache(jax.device_put(jnp.zeros((1, 2, 1, 656), jnp.uint8), cpu)))
