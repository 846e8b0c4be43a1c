"""CPU tests of the framework integrations (gqadrv.torch, gqadrv.jax): clear ImportErrors without the
framework, a core that never imports torch / JAX, and, where torch / JAX are importable, the traced
side (fake implementations, schemas, Dynamo graph breaks, JAX abstract evaluation and lowering).
GPU execution is in test_torch_gpu.py / test_jax_gpu.py; the FP8 wrappers' CPU tests are in
test_integrations_fp8_host.py."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import subprocess
import sys
import types

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "gqadrv"
INTEGRATIONS = {"torch.py", "jax.py"}
# `python -m gqadrv bench` compares with optional peers (torch SDPA, FlashInfer): it tries to import torch
# inside functions, under try/except, and uses it only when that worked. Not a dependency of the core.
ALLOWED = {"gqa/bench.py": {"torch", "torch.nn.functional"}}


# ----------------------------------------------------------------------------- without the framework
def _import_fresh(monkeypatch: pytest.MonkeyPatch, name: str, blocked: dict[str, object]) -> Exception:
    """Import ``gqadrv.<name>`` afresh with ``blocked`` modules replaced (None = not installed);
    returns the exception it raised. monkeypatch restores sys.modules afterwards."""
    monkeypatch.delitem(sys.modules, f"gqadrv.{name}", raising=False)
    for mod, value in blocked.items():
        monkeypatch.setitem(sys.modules, mod, value)
    with pytest.raises(ImportError) as info:
        importlib.import_module(f"gqadrv.{name}")
    return info.value


@pytest.mark.parametrize("name, extra", [("torch", "gqadrv[torch]"), ("jax", "gqadrv[jax]")])
def test_import_without_the_framework_names_the_extra(monkeypatch, name, extra):
    err = _import_fresh(monkeypatch, name, {name: None})
    assert f"pip install '{extra}'" in str(err) and f"gqadrv.{name} needs" in str(err)
    assert isinstance(err.__cause__, ImportError)  # the original error is kept


def test_import_with_torch_too_old(monkeypatch):
    old = types.ModuleType("torch")
    old.__version__ = "2.3.1"  # type: ignore[attr-defined]
    old.library = types.ModuleType("torch.library")  # type: ignore[attr-defined]  # no custom_op before 2.4
    err = _import_fresh(monkeypatch, "torch", {"torch": old})
    assert "found torch 2.3.1" in str(err) and "torch >= 2.4" in str(err).replace("PyTorch", "torch")


def test_import_with_jax_too_old(monkeypatch):
    old = types.ModuleType("jax")
    old.__version__ = "0.6.2"  # type: ignore[attr-defined]
    old.__path__ = []  # type: ignore[attr-defined]  # a package, so that jax.numpy / jax.experimental resolve
    jnp = types.ModuleType("jax.numpy")
    exp = types.ModuleType("jax.experimental")
    exp.__path__ = []  # type: ignore[attr-defined]
    err = _import_fresh(monkeypatch, "jax", {"jax": old, "jax.numpy": jnp, "jax.experimental": exp,
                                             "jax.experimental.buffer_callback": None})
    assert "found jax 0.6.2" in str(err) and "JAX >= 0.7" in str(err)


# ----------------------------------------------------------------------------- the core stays framework-free
def _framework_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        found.update(n for n in names if n.split(".")[0] in ("torch", "jax", "jaxlib"))
    return found


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.relative_to(PKG).as_posix() not in INTEGRATIONS),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_core_modules_never_import_a_framework(path):
    rel = path.relative_to(PKG).as_posix()
    found = _framework_imports(path) - ALLOWED.get(rel, set())
    assert not found, f"{rel} imports {found}"


def test_the_integrations_do_import_their_framework():
    # the negative control of the test above: the parser does see these imports
    assert "torch" in _framework_imports(PKG / "torch.py")
    assert {"jax", "jax.experimental.buffer_callback"} <= _framework_imports(PKG / "jax.py")


def test_import_gqadrv_loads_no_framework():
    code = "import sys, gqadrv, gqadrv.gqa, gqadrv.mla; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent, env=dict(os.environ, PYTHONPATH=str(PKG.parent)))
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


# ----------------------------------------------------------------------------- torch: the traced side
def _torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip(f"torch {torch.__version__} < 2.4")
    import gqadrv.torch as gt

    return torch, gt


def _gqa_meta(torch, B=3, Hq=16, Hkv=4, C=300, D=128, dtype=None):
    dtype = dtype or torch.float16
    return (torch.empty(B, Hq, D, dtype=dtype, device="meta"), torch.empty(B, 2, Hkv, C, D, dtype=dtype, device="meta"),
            torch.empty(B, dtype=torch.int32, device="meta"))


def _mla_meta(torch, b=2, s_q=2, h_q=16, page=64, blocks=4, dtype=None):
    dtype = dtype or torch.bfloat16
    return (torch.empty(b, s_q, h_q, 576, dtype=dtype, device="meta"),
            torch.empty(b * blocks, page, 1, 576, dtype=dtype, device="meta"),
            torch.empty(b, blocks, dtype=torch.int32, device="meta"), torch.empty(b, dtype=torch.int32, device="meta"))


def test_torch_ops_are_registered_functional():
    torch, _gt = _torch()  # registers the ops
    for op in (torch.ops.gqadrv.gqa_decode.default, torch.ops.gqadrv.flash_mla_with_kvcache.default,
               torch.ops.gqadrv.gqa_decode_lse.default, torch.ops.gqadrv.gqa_decode_paged.default,
               torch.ops.gqadrv.merge_state.default, torch.ops.gqadrv.merge_states.default,
               torch.ops.gqadrv.quantize_kv_fp8.default, torch.ops.gqadrv.quantize_k_cache.default,
               torch.ops.gqadrv.dequantize_k_cache.default):
        schema = op._schema
        assert schema.name.startswith("gqadrv::")
        assert not schema.is_mutable, f"{schema} must not mutate its arguments"
        assert all(a.alias_info is None for a in schema.arguments), schema
        assert all(r.alias_info is None for r in schema.returns), schema  # fresh outputs, no views
    assert len(torch.ops.gqadrv.flash_mla_with_kvcache.default._schema.returns) == 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_gqa_fake_shapes(dtype):
    torch, gt = _torch()
    q, kv, lens = _gqa_meta(torch, dtype=getattr(torch, dtype))
    out = gt.gqa_decode(q, kv, lens, q_scale=0.5)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"
    assert out.is_contiguous()


def test_torch_mla_fake_shapes():
    torch, gt = _torch()
    q, k, bt, lens = _mla_meta(torch, b=3, s_q=2, h_q=16)
    out, lse = gt.flash_mla_with_kvcache(q, k, bt, lens, 512, None, causal=True)
    assert out.shape == (3, 2, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 16, 2) and lse.dtype == torch.float32
    out, _ = gt.flash_mla_with_kvcache(q, k, bt, lens, head_dim_v=256)
    assert out.shape == (3, 2, 16, 256)


def test_torch_fakes_reject_wrong_ranks():
    torch, gt = _torch()
    q, kv, lens = _gqa_meta(torch)
    with pytest.raises(ValueError, match=r"q \[B, Hq, D\]"):
        gt.gqa_decode(q[0], kv, lens)
    qm, k, bt, ln = _mla_meta(torch)
    with pytest.raises(ValueError, match="rank 3"):
        gt.flash_mla_with_kvcache(qm[:, 0], k, bt, ln)


def test_torch_paged_lse_and_merge_fake_shapes():
    torch, gt = _torch()
    f16 = dict(dtype=torch.float16, device="meta")
    q = torch.empty(3, 2, 16, 128, **f16)
    k = torch.empty(40, 16, 4, 128, **f16)
    bt = torch.empty(3, 10, dtype=torch.int32, device="meta")
    ln = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = gt.gqa_decode_paged(q, k, k, bt, ln, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (3, 2, 16) and lse.dtype == torch.float32
    assert gt.gqa_decode_paged(q[:, 0], torch.empty(40, 2, 16, 4, 128, **f16), None, bt, ln).shape == (3, 16, 128)
    kv = torch.empty(3, 2, 4, 300, 128, **f16)
    out, lse = gt.gqa_decode(q, kv, ln, return_lse=True)
    assert out.shape == q.shape and lse.shape == (3, 2, 16)
    assert gt.gqa_decode(q[:, 0], kv, ln, deterministic=True).shape == (3, 16, 128)
    v, sv = torch.empty(5, 3, 4, 64, **f16), torch.empty(5, 3, 4, dtype=torch.float32, device="meta")
    mv, ms = gt.merge_states(v, sv)
    assert mv.shape == (5, 4, 64) and ms.shape == (5, 4) and ms.dtype == torch.float32
    pv, ps = gt.merge_state(v[:, 0], sv[:, 0], v[:, 1], sv[:, 1])
    assert pv.shape == (5, 4, 64) and ps.shape == (5, 4)
    with pytest.raises(ValueError, match="stacked states"):
        gt.merge_states(v[:, 0], sv[:, 0])


def test_torch_compile_fullgraph_has_no_graph_breaks():
    torch, gt = _torch()
    q, kv, lens = _gqa_meta(torch)
    qm, k, bt, ln = _mla_meta(torch)

    def step(q, kv, lens, qm, k, bt, ln):
        o = gt.gqa_decode(q, kv, lens, q_scale=0.7)
        mo, lse = gt.flash_mla_with_kvcache(qm, k, bt, ln, 512, None, None, 0.05, True)
        return o.float().sum() + mo.float().sum() + lse.sum()

    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(q, kv, lens, qm, k, bt, ln)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"gqadrv.gqa_decode", "gqadrv.flash_mla_with_kvcache"} <= {o.removesuffix(".default") for o in ops}, ops
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(q, kv, lens, qm, k, bt, ln).shape == ()


# ----------------------------------------------------------------------------- JAX: the traced side
def _jax():
    jax = pytest.importorskip("jax")
    try:
        import gqadrv.jax as gj
    except ImportError as exc:
        pytest.skip(str(exc))
    return jax, gj


def _sds(jax, shape, dtype):
    return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype))


def test_jax_abstract_shapes():
    jax, gj = _jax()
    q, kv, lens = _sds(jax, (3, 16, 128), "bfloat16"), _sds(jax, (3, 2, 4, 300, 128), "bfloat16"), _sds(jax, (3,), "int32")
    out = jax.eval_shape(lambda a, b, c: gj.gqa_decode(a, b, c, q_scale=0.5), q, kv, lens)
    assert out.shape == (3, 16, 128) and out.dtype == jax.numpy.bfloat16
    qm, k, bt = _sds(jax, (2, 2, 16, 576), "float16"), _sds(jax, (8, 64, 1, 576), "float16"), _sds(jax, (2, 4), "int32")
    o, lse = jax.eval_shape(lambda a, b, c, d: gj.flash_mla_with_kvcache(a, b, c, d, 512, causal=True), qm, k, bt,
                            _sds(jax, (2,), "int32"))
    assert o.shape == (2, 2, 16, 512) and o.dtype == jax.numpy.float16
    assert lse.shape == (2, 16, 2) and lse.dtype == jax.numpy.float32


def test_jax_paged_lse_and_merge_abstract_shapes():
    jax, gj = _jax()
    q, k = _sds(jax, (3, 2, 16, 128), "float16"), _sds(jax, (40, 16, 4, 128), "float16")
    bt, ln = _sds(jax, (3, 10), "int32"), _sds(jax, (3,), "int32")
    out, lse = jax.eval_shape(lambda a, b, c, d, e: gj.gqa_decode_paged(a, b, c, d, e, return_lse=True), q, k, k, bt, ln)
    assert out.shape == (3, 2, 16, 128) and lse.shape == (3, 2, 16) and lse.dtype == jax.numpy.float32
    kc = _sds(jax, (40, 2, 4, 16, 128), "float16")
    out = jax.eval_shape(lambda a, b, d, e: gj.gqa_decode_paged(a, b, None, d, e, kv_layout="HND"), q, kc, bt, ln)
    assert out.shape == (3, 2, 16, 128)
    kv = _sds(jax, (3, 2, 4, 300, 128), "float16")
    out, lse = jax.eval_shape(lambda a, b, c: gj.gqa_decode(a, b, c, return_lse=True), q, kv, ln)
    assert out.shape == (3, 2, 16, 128) and lse.shape == (3, 2, 16)
    v, s = _sds(jax, (5, 3, 4, 64), "float16"), _sds(jax, (5, 3, 4), "float32")
    mv, ms = jax.eval_shape(gj.merge_states, v, s)
    assert mv.shape == (5, 4, 64) and ms.shape == (5, 4)
    va, sa = _sds(jax, (5, 4, 64), "float16"), _sds(jax, (5, 4), "float32")
    pv, ps = jax.eval_shape(gj.merge_state, va, sa, va, sa)
    assert pv.shape == (5, 4, 64) and ps.shape == (5, 4)


def test_jax_jit_and_scan_lower_to_one_callback_each():
    jax, gj = _jax()
    jnp = jax.numpy
    q, lens = _sds(jax, (2, 8, 64), "float16"), _sds(jax, (2,), "int32")
    kvs = _sds(jax, (3, 2, 2, 2, 100, 64), "float16")

    def layers(q, kvs, lens):
        def body(h, kv):
            o = gj.gqa_decode(h, kv, lens)
            return o, o
        return jax.lax.scan(body, q, kvs)

    text = jax.jit(layers).lower(q, kvs, lens).as_text()
    assert text.count("xla_buffer_python") == 1  # one custom call, inside the scan's while loop
    assert "while" in text
    assert jnp.dtype(jax.eval_shape(layers, q, kvs, lens)[1].dtype) == jnp.float16


def test_jax_equal_calls_share_one_callback():
    _, gj = _jax()
    a = gj._gqa_callable((1, 8, 64), "float16", 1.0, None, None)
    assert gj._gqa_callable((1, 8, 64), "float16", 1.0, None, None) is a
    assert gj._gqa_callable((1, 8, 64), "float16", 0.5, None, None) is not a


def test_jax_rejects_traced_scales_and_wrong_ranks():
    jax, gj = _jax()
    q, kv, lens = _sds(jax, (2, 8, 64), "float16"), _sds(jax, (2, 2, 2, 100, 64), "float16"), _sds(jax, (2,), "int32")
    with pytest.raises(TypeError, match="q_scale must be a static Python number"):
        jax.eval_shape(lambda a, b, c, s: gj.gqa_decode(a, b, c, q_scale=s), q, kv, lens, _sds(jax, (), "float32"))
    with pytest.raises(ValueError, match=r"q \[B, Hq, D\]"):
        jax.eval_shape(gj.gqa_decode, _sds(jax, (2, 8, 1, 1, 64), "float16"), kv, lens)  # 4-D q is s_q
    qm, k, bt = _sds(jax, (1, 1, 16, 576), "float16"), _sds(jax, (4, 64, 1, 576), "float16"), _sds(jax, (1, 4), "int32")
    with pytest.raises(TypeError, match="num_splits must be None or a static int"):
        jax.eval_shape(lambda a, b, c, d: gj.flash_mla_with_kvcache(a, b, c, d, num_splits=2.0), qm, k, bt,
                       _sds(jax, (1,), "int32"))


def test_jax_on_a_cpu_backend_says_cuda_only():
    jax, gj = _jax()
    jnp = jax.numpy
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(x, cpu) for x in (jnp.zeros((1, 8, 64), jnp.float16), jnp.zeros((1, 2, 2, 16, 64), jnp.float16),
                                             jnp.ones((1,), jnp.int32))]
    with pytest.raises(Exception, match="gqadrv.jax runs on CUDA devices only"):
        jax.block_until_ready(gj.gqa_decode(*args))
