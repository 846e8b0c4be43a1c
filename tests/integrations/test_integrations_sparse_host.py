"""CPU tests of the sparse MLA path (``flash_mla_with_kvcache`` with ``indices``) in gqadrv.torch and
gqadrv.jax: the custom op's schema, the fake implementation's shapes and trace-time checks (meta
tensors and FakeTensorMode CUDA tensors), Dynamo tracing without graph breaks, JAX abstract evaluation
and lowering (one custom call, float8 pools bitcast, inside lax.scan), and the plumbing of the op
bodies / callbacks (which tensors reach gqadrv under which names, outputs handed over as out= / lse=)
with gqadrv replaced by a stand-in that writes the float64 oracle
(gqadrv.mla.sparse_reference.sparse_decode_reference). No GPU: GPU execution is in
test_torch_sparse_gpu.py / test_jax_sparse_gpu.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from gqadrv.mla.fp8_reference import (
    dequantize_k_cache_reference,
    quantize_k_cache_reference,
)
from gqadrv.mla.sparse_reference import sparse_decode_reference

SPARSE = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length")
B, S_Q, H_Q, TOPK, NB, PAGE = 2, 2, 16, 40, 9, 7
E_TOPK, E_NB, E_PAGE = 12, 3, 5


# ----------------------------------------------------------------------------- a tiny host case
def host_case(fp8: bool, seed: int = 0) -> dict:
    """Small host arrays of a sparse case (both pools, sinks with +-inf, topk_length with a clamped
    value, invalid indices) and the float64 oracle's numbers of the pools."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q = rng.standard_normal((B, S_Q, H_Q, 576)).astype(np.float32).astype(bf16)
    k = rng.standard_normal((NB, PAGE, 1, 576)).astype(np.float32).astype(bf16)
    ek = rng.standard_normal((E_NB, E_PAGE, 1, 576)).astype(np.float32).astype(bf16)
    idx = rng.integers(0, NB * PAGE, size=(B, S_Q, TOPK)).astype(np.int32)
    idx[0, 0, :5] = [-1, NB * PAGE, 2**31 - 1, -(2**31), NB * PAGE + 3]
    eidx = rng.integers(0, E_NB * E_PAGE, size=(B, S_Q, E_TOPK)).astype(np.int32)
    eidx[1, 1, 0] = -1
    sink = rng.standard_normal(H_Q).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    case = {"q": q, "indices": idx, "extra_indices_in_kvcache": eidx, "attn_sink": sink,
            "topk_length": np.array([TOPK - 9, TOPK + 5], np.int32),
            "extra_topk_length": np.array([E_TOPK, 3], np.int32)}
    if fp8:
        case.update(k_cache=quantize_k_cache_reference(k), extra_k_cache=quantize_k_cache_reference(ek))
        case.update(k_num=dequantize_k_cache_reference(case["k_cache"]),
                    ek_num=dequantize_k_cache_reference(case["extra_k_cache"]))
    else:
        case.update(k_cache=k, extra_k_cache=ek, k_num=k, ek_num=ek)
    return case


def oracle(q, k_num, kw: dict, ek_num=None, scale=None):
    """The float64 oracle of a call whose sparse keywords are ``kw`` (host arrays; the pools' numbers
    are ``k_num`` and, with an extra pool, ``ek_num``)."""
    def g(n):
        return None if kw.get(n) is None else np.asarray(kw[n])

    return sparse_decode_reference(q, k_num, g("indices"), scale, 512, g("attn_sink"), g("topk_length"), ek_num,
                                   g("extra_indices_in_kvcache"), g("extra_topk_length"))


# ----------------------------------------------------------------------------- torch
def _torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip(f"torch {torch.__version__} < 2.4")
    import gqadrv.torch as gt

    return torch, gt


def _t(torch, shape, dtype, device="meta"):
    return torch.empty(shape, dtype=dtype, device=device)


def _torch_sparse(torch, device="meta", kv="uint8", extra=True, q_dtype=None):
    """(q, k_cache, sparse keywords) of empty tensors on ``device``."""
    fp8 = kv in ("uint8", "int8", "float8_e4m3fn")
    q_dtype = q_dtype or (torch.float16 if kv == "float16" else torch.bfloat16)
    row = 656 if fp8 else 576
    kd = getattr(torch, kv)
    i32 = torch.int32
    kw = {"indices": _t(torch, (B, S_Q, TOPK), i32, device), "attn_sink": _t(torch, (H_Q,), torch.float32, device),
          "topk_length": _t(torch, (B,), i32, device)}
    if extra:
        kw.update(extra_k_cache=_t(torch, (E_NB, E_PAGE, 1, row), kd, device),
                  extra_indices_in_kvcache=_t(torch, (B, S_Q, E_TOPK), i32, device),
                  extra_topk_length=_t(torch, (B,), i32, device))
    return _t(torch, (B, S_Q, H_Q, 576), q_dtype, device), _t(torch, (NB, PAGE, 1, row), kd, device), kw, fp8


def test_torch_schema_takes_the_sparse_tensors():
    torch, _gt = _torch()
    schema = torch.ops.gqadrv.flash_mla_with_kvcache.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:10] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "num_splits", "softmax_scale",
                          "causal", "backend", "is_fp8_kvcache"]
    assert names[10:] == list(SPARSE)
    args = {a.name: a for a in schema.arguments}
    for n in ("block_table", "cache_seqlens", *SPARSE):
        assert str(args[n].type) == "Optional[Tensor]", schema
    assert all(args[n].default_value is None for n in SPARSE)
    assert not schema.is_mutable and all(a.alias_info is None for a in schema.arguments)


@pytest.mark.parametrize("kv", ["uint8", "int8", "float8_e4m3fn", "bfloat16", "float16"])
@pytest.mark.parametrize("device", ["meta", "fake_cuda"])
def test_torch_sparse_fake_shapes(kv, device):
    torch, gt = _torch()
    if not hasattr(torch, kv):
        pytest.skip(f"torch has no {kv}")
    ctx = contextlib.nullcontext()
    if device == "fake_cuda":   # FakeTensorMode's CUDA tensors need no GPU
        from torch._subclasses.fake_tensor import FakeTensorMode

        ctx = FakeTensorMode()
    with ctx:
        dev = "cuda" if device == "fake_cuda" else "meta"
        q, k, kw, fp8 = _torch_sparse(torch, dev, kv)
        for extra in (False, True):
            given = kw if extra else {n: v for n, v in kw.items() if not n.startswith("extra")}
            out, lse = gt.flash_mla_with_kvcache(q, k, None, None, 512, None, None, None, False, fp8, **given)
            assert out.shape == (B, S_Q, H_Q, 512) and out.dtype == q.dtype and out.device == q.device
            assert lse.shape == (B, H_Q, S_Q) and lse.dtype == torch.float32
        # only indices; block_table / cache_seqlens given (ignored); positional FlashMLA order
        bt, ln = _t(torch, (B, 3), torch.int32, dev), _t(torch, (B,), torch.int32, dev)
        out, lse = gt.flash_mla_with_kvcache(q, k, bt, ln, 512, None, 2, 0.05, False, fp8, kw["indices"])
        assert out.shape == (B, S_Q, H_Q, 512) and lse.shape == (B, H_Q, S_Q)
        out, _ = torch.ops.gqadrv.flash_mla_with_kvcache(q, k, None, None, 512, None, None, False, None, fp8,
                                                         kw["indices"])
        assert out.shape == (B, S_Q, H_Q, 512)


def test_torch_sparse_fake_rejections():
    torch, gt = _torch()
    q, k8, kw, _ = _torch_sparse(torch)
    _, kb, kwb, _ = _torch_sparse(torch, kv="bfloat16")
    i32, f32 = torch.int32, torch.float32

    def call(q=q, k=k8, fp8=True, causal=False, head_dim_v=512, bt=None, ln=None, **over):
        args = {**kw, **over} if fp8 else {**kwb, **over}
        return gt.flash_mla_with_kvcache(q, k, bt, ln, head_dim_v, None, None, None, causal, fp8, **args)

    call()
    with pytest.raises(ValueError, match="causal=True is not defined on the sparse path"):
        call(causal=True)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        call(head_dim_v=256)
    with pytest.raises(ValueError, match=r"q must have shape \[batch, s_q, h_q, 576\]"):
        call(q=_t(torch, (B, S_Q, H_Q, 512), torch.bfloat16))
    with pytest.raises(ValueError, match="rank 3"):
        call(q=_t(torch, (B, H_Q, 576), torch.bfloat16))
    with pytest.raises(TypeError, match="needs a bfloat16 q"):
        call(q=_t(torch, (B, S_Q, H_Q, 576), torch.float16))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        call(q=_t(torch, (B, S_Q, H_Q, 576), torch.float32), k=kb, fp8=False)
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, page_size, 1, 656\]"):
        call(k=_t(torch, (NB, PAGE, 1, 576), torch.uint8))
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, page_size, 1, 656\]"):
        call(k=_t(torch, (NB, PAGE, 2, 656), torch.uint8))
    with pytest.raises(TypeError, match="k_cache must have dtype uint8 or int8"):
        call(k=_t(torch, (NB, PAGE, 1, 656), torch.float16))
    with pytest.raises(TypeError, match="an FP8 cache needs is_fp8_kvcache=True"):
        call(k=_t(torch, (NB, PAGE, 1, 656), torch.uint8), fp8=False)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        call(k=_t(torch, (NB, PAGE, 1, 576), torch.float16), fp8=False)
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, page_size, 1, 576\]"):
        call(k=_t(torch, (NB, PAGE, 2, 576), torch.bfloat16), fp8=False)
    with pytest.raises(TypeError, match="extra_k_cache must have q's dtype"):
        call(k=kb, fp8=False, extra_k_cache=_t(torch, (E_NB, E_PAGE, 1, 576), torch.float16))
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        call(indices=_t(torch, (B, S_Q, TOPK), torch.int64))
    with pytest.raises(ValueError, match=r"indices must have shape \[2, 2, topk\]"):
        call(indices=_t(torch, (B, S_Q + 1, TOPK), i32))
    with pytest.raises(ValueError, match=r"indices must have shape"):
        call(indices=_t(torch, (B * S_Q, TOPK), i32))
    with pytest.raises(ValueError, match=r"topk_length must have shape \(2,\)"):
        call(topk_length=_t(torch, (B, 1), i32))
    with pytest.raises(TypeError, match="attn_sink must have dtype float32"):
        call(attn_sink=_t(torch, (H_Q,), torch.bfloat16))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(16,\)"):
        call(attn_sink=_t(torch, (H_Q + 1,), f32))
    with pytest.raises(ValueError, match="go together"):
        call(extra_indices_in_kvcache=None)
    with pytest.raises(ValueError, match="extra_topk_length needs extra_k_cache"):
        call(extra_k_cache=None, extra_indices_in_kvcache=None)
    with pytest.raises(ValueError, match=r"extra_indices_in_kvcache must have shape \[2, 2, extra_topk\]"):
        call(extra_indices_in_kvcache=_t(torch, (B + 1, S_Q, E_TOPK), i32))
    # the dense path: sparse arguments need indices; block_table and cache_seqlens are required there
    qd, kd = _t(torch, (B, S_Q, H_Q, 576), torch.bfloat16), _t(torch, (8, 64, 1, 576), torch.bfloat16)
    bt, ln = _t(torch, (B, 4), i32), _t(torch, (B,), i32)
    with pytest.raises(ValueError, match="attn_sink, topk_length belong to the sparse MLA path: pass indices"):
        gt.flash_mla_with_kvcache(qd, kd, bt, ln, attn_sink=kw["attn_sink"], topk_length=kw["topk_length"])
    with pytest.raises(ValueError, match="dense MLA decode needs block_table and cache_seqlens"):
        gt.flash_mla_with_kvcache(qd, kd)
    with pytest.raises(ValueError, match="dense MLA decode needs cache_seqlens"):
        gt.flash_mla_with_kvcache(qd, kd, bt)
    out, _ = gt.flash_mla_with_kvcache(qd, kd, bt, ln)   # unchanged dense path
    assert out.shape == (B, S_Q, H_Q, 512)


def test_torch_sparse_step_compiles_without_graph_breaks():
    torch, gt = _torch()
    q, k8, kw, _ = _torch_sparse(torch)
    _, kb, kwb, _ = _torch_sparse(torch, kv="bfloat16")
    kd = _t(torch, (8, 64, 1, 576), torch.bfloat16)
    bt, ln = _t(torch, (B, 4), torch.int32), _t(torch, (B,), torch.int32)

    def step(q, k8, kb, kd, bt, ln, idx, sink, tl, ek, eidx, etl, ekb):
        o1, l1 = gt.flash_mla_with_kvcache(q, k8, None, None, 512, None, None, None, False, True, idx, sink, ek, eidx,
                                           tl, etl)
        o2, l2 = gt.flash_mla_with_kvcache(q, kb, indices=idx, extra_k_cache=ekb, extra_indices_in_kvcache=eidx)
        o3, l3 = gt.flash_mla_with_kvcache(q, k8, bt, ln, is_fp8_kvcache=True, indices=idx, topk_length=tl)
        o4, l4 = gt.flash_mla_with_kvcache(q, kd, bt, ln, 512, None, None, 0.05, True)   # dense
        return sum(o.float().sum() + lse.sum() for o, lse in ((o1, l1), (o2, l2), (o3, l3), (o4, l4)))

    args = (q, k8, kb, kd, bt, ln, kw["indices"], kw["attn_sink"], kw["topk_length"], kw["extra_k_cache"],
            kw["extra_indices_in_kvcache"], kw["extra_topk_length"], kwb["extra_k_cache"])
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    calls = [n for g in explain.graphs for n in g.graph.nodes
             if n.op == "call_function" and str(n.target).removesuffix(".default") == "gqadrv.flash_mla_with_kvcache"]
    assert len(calls) == 4
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(*args).shape == ()


def _torch_from_host(torch, a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_torch_sparse_op_body_hands_the_given_tensors_to_gqadrv(monkeypatch, fp8):
    """The real op body on CPU tensors with gqadrv replaced by the float64 oracle: only the sparse
    tensors given reach the library, under their names and detached; torch's out / lse are written."""
    torch, gt = _torch()
    import ml_dtypes

    calls: list[dict] = []
    monkeypatch.setattr(gt, "_stream", lambda t: 4321)

    def mla(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, *,
            is_fp8_kvcache=False, out=None, lse=None, stream=None, backend=None, **sparse):
        calls.append({"k": k_cache, "bt": block_table, "ln": cache_seqlens, "fp8": is_fp8_kvcache, "out": out,
                      "lse": lse, "stream": stream, "backend": backend, "splits": num_splits, "scale": softmax_scale,
                      "sparse": sparse})
        assert set(sparse) <= set(SPARSE) and all(v is not None and not v.requires_grad for v in sparse.values())
        hq = q.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        ek = case["ek_num"] if "extra_k_cache" in sparse else None
        o, l = oracle(hq, case["k_num"], {n: v.numpy() for n, v in sparse.items() if n != "extra_k_cache"}, ek,
                      softmax_scale)
        out.copy_(torch.from_numpy(o).to(out.dtype))
        lse.copy_(torch.from_numpy(l).to(torch.float32))

    monkeypatch.setattr(gt, "_flash_mla", mla)
    case = host_case(fp8)
    t = {n: _torch_from_host(torch, case[n]) for n in ("q", "k_cache", *SPARSE)}
    body = gt._flash_mla_op._init_fn
    subsets = [("indices",), ("indices", "attn_sink", "topk_length"), SPARSE]
    for names in subsets:
        given = {n: t[n] for n in names}
        out, lse = body(t["q"], t["k_cache"], None, None, 512, 3, None, False, "auto", fp8, **given)
        c = calls[-1]
        assert set(c["sparse"]) == set(names) and c["bt"] is None and c["ln"] is None
        assert all(torch.equal(c["sparse"][n], t[n]) for n in names)
        assert c["out"] is out and c["lse"] is lse and c["stream"] == 4321 and c["fp8"] is fp8
        assert c["splits"] == 3 and c["backend"] == "auto"
        assert out.shape == (B, S_Q, H_Q, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (B, H_Q, S_Q) and lse.dtype == torch.float32
        ek = case["ek_num"] if "extra_k_cache" in names else None
        want_o, want_l = oracle(case["q"], case["k_num"], {n: case[n] for n in names}, ek)
        np.testing.assert_allclose(out.float().numpy(), want_o, atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(lse.numpy(), want_l.astype(np.float32))
    # the +inf sink of head 0 zeroes its rows
    assert not out[:, :, 0].any()
    # block_table / cache_seqlens given on the sparse path: forwarded as given (the library ignores them)
    bt, ln = torch.zeros((B, 2), dtype=torch.int32), torch.zeros((B,), dtype=torch.int32)
    body(t["q"], t["k_cache"], bt, ln, 512, None, None, False, None, fp8, t["indices"])
    assert torch.equal(calls[-1]["bt"], bt) and torch.equal(calls[-1]["ln"], ln)
    assert set(calls[-1]["sparse"]) == {"indices"}


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


def _jax_sparse(jax, kv="uint8", extra=True, q_dtype=None):
    """(q, k_cache, sparse keywords) as ShapeDtypeStructs."""
    fp8 = kv in ("uint8", "int8", "float8_e4m3fn")
    q_dtype = q_dtype or ("float16" if kv == "float16" else "bfloat16")
    row = 656 if fp8 else 576
    kw = {"indices": _sds(jax, (B, S_Q, TOPK), "int32"), "attn_sink": _sds(jax, (H_Q,), "float32"),
          "topk_length": _sds(jax, (B,), "int32")}
    if extra:
        kw.update(extra_k_cache=_sds(jax, (E_NB, E_PAGE, 1, row), kv),
                  extra_indices_in_kvcache=_sds(jax, (B, S_Q, E_TOPK), "int32"),
                  extra_topk_length=_sds(jax, (B,), "int32"))
    return _sds(jax, (B, S_Q, H_Q, 576), q_dtype), _sds(jax, (NB, PAGE, 1, row), kv), kw, fp8


def _eval(jax, gj, q, k, kw, *pos, **static):
    """jax.eval_shape of the wrapper with the arrays in ``kw`` as keyword operands."""
    names = tuple(kw)

    def f(q, k, *arrays):
        return gj.flash_mla_with_kvcache(q, k, *pos, **static, **dict(zip(names, arrays)))

    return jax.eval_shape(f, q, k, *kw.values())


@pytest.mark.parametrize("kv", ["uint8", "int8", "float8_e4m3fn", "bfloat16", "float16"])
def test_jax_sparse_abstract_shapes(kv):
    jax, gj = _jax()
    jnp = jax.numpy
    q, k, kw, fp8 = _jax_sparse(jax, kv)
    for extra in (False, True):
        given = kw if extra else {n: v for n, v in kw.items() if not n.startswith("extra")}
        o, lse = _eval(jax, gj, q, k, given, None, None, 512, None, None, None, False, fp8)
        assert o.shape == (B, S_Q, H_Q, 512) and o.dtype == jnp.dtype(q.dtype)
        assert lse.shape == (B, H_Q, S_Q) and lse.dtype == jnp.float32
    o, _ = _eval(jax, gj, q, k, {"indices": kw["indices"]}, is_fp8_kvcache=fp8)
    assert o.shape == (B, S_Q, H_Q, 512)


def test_jax_sparse_lowers_to_one_callback_and_scans():
    jax, gj = _jax()
    jnp = jax.numpy
    q, k, kw, _ = _jax_sparse(jax, "float8_e4m3fn")
    names = tuple(kw)

    def f(q, k, *arrays):
        return gj.flash_mla_with_kvcache(q, k, is_fp8_kvcache=True, **dict(zip(names, arrays)))

    text = jax.jit(f).lower(q, k, *kw.values()).as_text()
    assert text.count("xla_buffer_python") == 1
    assert text.count("bitcast_convert") == 2   # both float8 pools travel as their uint8 bytes

    # two layers: per-layer pools and indices, shared sinks and lengths; one callback inside the loop
    ks = _sds(jax, (2, NB, PAGE, 1, 656), "uint8")
    idxs = _sds(jax, (2, B, S_Q, TOPK), "int32")

    def layers(q, ks, idxs, sink, tl):
        def body(h, xs):
            k, idx = xs
            o, lse = gj.flash_mla_with_kvcache(h, k, None, None, 512, None, None, None, False, True, idx, sink,
                                               topk_length=tl)
            return h, (o, lse)
        return jax.lax.scan(body, q, (ks, idxs))

    args = (q, ks, idxs, kw["attn_sink"], kw["topk_length"])
    text = jax.jit(layers).lower(*args).as_text()
    assert text.count("xla_buffer_python") == 1 and "while" in text
    _, (o, lse) = jax.eval_shape(layers, *args)
    assert o.shape == (2, B, S_Q, H_Q, 512) and o.dtype == jnp.bfloat16 and lse.shape == (2, B, H_Q, S_Q)


def test_jax_sparse_callables_are_keyed_by_the_given_operands():
    _, gj = _jax()
    dense = gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True)
    a = gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True, ("indices",))
    assert a is not dense
    assert gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True, ("indices",)) is a
    assert gj._mla_callable((1, 1, 16, 576), "bfloat16", 512, None, None, False, None, True,
                            ("indices", "attn_sink")) is not a


def test_jax_sparse_rejections():
    jax, gj = _jax()
    q, k8, kw, _ = _jax_sparse(jax)
    _, _kb, kwb, _ = _jax_sparse(jax, "bfloat16")

    def call(q=q, k=k8, fp8=True, causal=False, head_dim_v=512, **over):
        args = {**kw, **over} if fp8 else {**kwb, **over}
        args = {n: v for n, v in args.items() if v is not None}
        return _eval(jax, gj, q, k, args, None, None, head_dim_v, None, None, None, causal, fp8)

    call()
    with pytest.raises(ValueError, match="causal=True is not defined on the sparse path"):
        call(causal=True)
    with pytest.raises(TypeError, match="causal must be a static Python bool"):
        call(causal=1)
    with pytest.raises(ValueError, match="head_dim_v must be 512"):
        call(head_dim_v=256)
    with pytest.raises(ValueError, match="rank 3"):
        call(q=_sds(jax, (B, H_Q, 576), "bfloat16"))
    with pytest.raises(ValueError, match=r"q must have shape \[batch, s_q, h_q, 576\]"):
        call(q=_sds(jax, (B, S_Q, H_Q, 512), "bfloat16"))
    with pytest.raises(TypeError, match="needs a bfloat16 q"):
        call(q=_sds(jax, (B, S_Q, H_Q, 576), "float16"))
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, page_size, 1, 656\]"):
        call(k=_sds(jax, (NB, PAGE, 1, 576), "uint8"))
    with pytest.raises(TypeError, match="an FP8 cache needs is_fp8_kvcache=True"):
        call(k=_sds(jax, (NB, PAGE, 1, 656), "uint8"), fp8=False)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        call(k=_sds(jax, (NB, PAGE, 1, 576), "float16"), fp8=False)
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        call(indices=_sds(jax, (B, S_Q, TOPK), "uint32"))
    with pytest.raises(ValueError, match=r"indices must have shape \[2, 2, topk\]"):
        call(indices=_sds(jax, (B, 1, TOPK), "int32"))
    with pytest.raises(TypeError, match="attn_sink must have dtype float32"):
        call(attn_sink=_sds(jax, (H_Q,), "float16"))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(16,\)"):
        call(attn_sink=_sds(jax, (1,), "float32"))
    with pytest.raises(ValueError, match=r"topk_length must have shape \(2,\)"):
        call(topk_length=_sds(jax, (3,), "int32"))
    with pytest.raises(ValueError, match="go together"):
        call(extra_k_cache=None)
    with pytest.raises(ValueError, match="extra_topk_length needs extra_k_cache"):
        call(extra_k_cache=None, extra_indices_in_kvcache=None)
    qd, kd = _sds(jax, (B, S_Q, H_Q, 576), "bfloat16"), _sds(jax, (8, 64, 1, 576), "bfloat16")
    bt, ln = _sds(jax, (B, 4), "int32"), _sds(jax, (B,), "int32")
    with pytest.raises(ValueError, match="attn_sink belong to the sparse MLA path: pass indices"):
        jax.eval_shape(lambda a, b, c, d, s: gj.flash_mla_with_kvcache(a, b, c, d, attn_sink=s), qd, kd, bt, ln,
                       kw["attn_sink"])
    with pytest.raises(ValueError, match="dense MLA decode needs block_table and cache_seqlens"):
        jax.eval_shape(gj.flash_mla_with_kvcache, qd, kd)
    o, _ = jax.eval_shape(gj.flash_mla_with_kvcache, qd, kd, bt, ln)   # unchanged dense path
    assert o.shape == (B, S_Q, H_Q, 512)


@pytest.mark.parametrize("kv", ["uint8", "float8_e4m3fn", "bfloat16"])
def test_jax_sparse_callbacks_hand_xla_buffers_to_gqadrv(monkeypatch, kv):
    """The buffer_callback executed by XLA:CPU with the CUDA target and gqadrv replaced by the float64
    oracle: only the arrays given reach the library, under their names (float8 pools as uint8 bytes),
    XLA's output buffers arrive as out= / lse=, and one compilation follows new operand values."""
    jax, gj = _jax()
    jnp = jax.numpy
    calls: list[dict] = []
    monkeypatch.setattr(gj, "_cuda_target", lambda ctx, first: (4321, 0))
    monkeypatch.setattr(gj, "device_scope", lambda ordinal: contextlib.nullcontext())
    fp8 = kv != "bfloat16"
    case = host_case(fp8, seed=1)

    def mla(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal, *,
            is_fp8_kvcache=False, out=None, lse=None, stream=None, backend=None, **sparse):
        host = {n: np.asarray(v) for n, v in sparse.items()}
        calls.append({"kdtype": np.asarray(k_cache).dtype.name, "bt": block_table, "ln": cache_seqlens,
                      "fp8": is_fp8_kvcache, "stream": stream, "backend": backend, "splits": num_splits,
                      "scale": softmax_scale, "sparse": host,
                      "edtype": host["extra_k_cache"].dtype.name if "extra_k_cache" in host else None})
        ek = case["ek_num"] if "extra_k_cache" in host else None
        o, l = oracle(np.asarray(q), case["k_num"], host, ek, softmax_scale)
        np.asarray(out)[...] = o.astype(np.asarray(out).dtype)
        np.asarray(lse)[...] = l

    monkeypatch.setattr(gj, "_flash_mla", mla)
    cpu = jax.devices("cpu")[0]
    arr = {n: jax.device_put(case[n], cpu) for n in ("q", "k_cache", "extra_k_cache", *SPARSE)}
    if kv == "float8_e4m3fn":
        for n in ("k_cache", "extra_k_cache"):
            arr[n] = jax.lax.bitcast_convert_type(arr[n], jnp.float8_e4m3fn)
    for names in [("indices",), ("indices", "attn_sink", "topk_length"), SPARSE]:
        def f(q, k, *arrays, names=names):
            return gj.flash_mla_with_kvcache(q, k, None, None, 512, None, 2, 0.05, False, fp8, backend="auto",
                                             **dict(zip(names, arrays)))

        jf = jax.jit(f)
        o, lse = jax.block_until_ready(jf(arr["q"], arr["k_cache"], *(arr[n] for n in names)))
        c = calls[-1]
        assert set(c["sparse"]) == set(names) and c["bt"] is None and c["ln"] is None
        assert all(np.array_equal(c["sparse"][n].view(np.uint8) if n == "extra_k_cache" and fp8 else c["sparse"][n],
                                  case[n]) for n in names)
        assert c["kdtype"] == ("uint8" if fp8 else "bfloat16") and c["fp8"] is fp8
        assert c["edtype"] in (None, "uint8" if fp8 else "bfloat16")
        assert (c["stream"], c["backend"], c["splits"], c["scale"]) == (4321, "auto", 2, 0.05)
        assert o.shape == (B, S_Q, H_Q, 512) and o.dtype == jnp.bfloat16
        assert lse.shape == (B, H_Q, S_Q) and lse.dtype == jnp.float32
        ek = case["ek_num"] if "extra_k_cache" in names else None
        want_o, want_l = oracle(case["q"], case["k_num"], {n: case[n] for n in names}, ek, 0.05)
        np.testing.assert_allclose(np.asarray(o).astype(np.float64), want_o, atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(np.asarray(lse), want_l.astype(np.float32))
        # new indices: the same compilation, the callback sees the new values
        new_idx = np.roll(case["indices"], 3, axis=-1)
        new = {**arr, "indices": jax.device_put(new_idx, cpu)}
        jax.block_until_ready(jf(new["q"], new["k_cache"], *(new[n] for n in names)))
        assert np.array_equal(calls[-1]["sparse"]["indices"], new_idx)
        size = getattr(jf, "_cache_size", None)
        if size is not None:
            assert size() == 1
    # eager (un-jitted) with block_table / cache_seqlens given: not operands of the sparse path
    bt = jax.device_put(np.zeros((B, 2), np.int32), cpu)
    jax.block_until_ready(gj.flash_mla_with_kvcache(arr["q"], arr["k_cache"], bt, bt[:, 0], 512, None, None, None,
                                                    False, fp8, arr["indices"]))
    assert calls[-1]["bt"] is None and set(calls[-1]["sparse"]) == {"indices"}
