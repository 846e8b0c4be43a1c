"""CPU tests of the sparse MLA prefill (``flash_mla_sparse_fwd``) in gqadrv.torch and gqadrv.jax: the
custom op's schema, the fake implementation's shapes and trace-time checks (meta tensors and
FakeTensorMode CUDA tensors), Dynamo tracing without graph breaks, JAX abstract evaluation and
lowering (one custom call, inside lax.scan), the plumbing of the op body / callback (which tensors
reach gqadrv under which names, the framework's buffers handed over as out / stats) with gqadrv
replaced by a stand-in that writes the float64 oracle
(gqadrv.mla.sparse_reference.sparse_prefill_reference), and that the wrappers' ``_sparse_fwd_into``
is the library's ``flash_mla_sparse_fwd`` with the framework's buffers as out / stats. No GPU: GPU
execution is in test_sparse_prefill_gpu.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tests.integrations.sparse_prefill_cases import build, build_varlen

S_Q, H_Q, S_KV, TOPK, SPARE = 8, 16, 45, 12, 5   # tiny host sizes
OPTIONAL = ("attn_sink", "topk_length", "cu_seqlens_q", "cu_seqlens_kv")


def tiny(d_qk: int = 576, seed: int = 0, **kw):
    return build(d_qk, H_Q, seed, s_q=S_Q, s_kv=S_KV, topk=TOPK, spare=SPARE, **kw)


def tiny_varlen(d_qk: int = 576, seed: int = 0):
    return build_varlen(d_qk, H_Q, seed, s_q=S_Q, s_kv=S_KV, topk=TOPK)


# ----------------------------------------------------------------------------- torch
def _torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch.library, "custom_op"):
        pytest.skip(f"torch {torch.__version__} < 2.4")
    import gqadrv.torch as gt

    return torch, gt


def _t(torch, shape, dtype, device="meta"):
    return torch.empty(shape, dtype=dtype, device=device)


def _torch_case(torch, device="meta", d_qk=576, h_q=H_Q, s_q=S_Q, s_kv=S_KV, topk=TOPK):
    """(q, kv, indices, {optional name: tensor}) of empty tensors on ``device`` (a 3-request varlen
    split)."""
    bf, i32 = torch.bfloat16, torch.int32
    opt = {"attn_sink": _t(torch, (h_q,), torch.float32, device), "topk_length": _t(torch, (s_q,), i32, device),
           "cu_seqlens_q": _t(torch, (4,), i32, device), "cu_seqlens_kv": _t(torch, (4,), i32, device)}
    return (_t(torch, (s_q, h_q, d_qk), bf, device), _t(torch, (s_kv, 1, d_qk), bf, device),
            _t(torch, (s_q, 1, topk), i32, device), opt)


def test_torch_schema():
    torch, _gt = _torch()
    schema = torch.ops.gqadrv.flash_mla_sparse_fwd.default._schema
    args = {a.name: a for a in schema.arguments}
    assert list(args) == ["q", "kv", "indices", "sm_scale", "d_v", *OPTIONAL, "backend"]
    assert [str(args[n].type) for n in ("q", "kv", "indices", "sm_scale", "d_v")] == ["Tensor"] * 3 + ["float", "int"]
    assert args["sm_scale"].default_value is None and args["d_v"].default_value == 512
    for n in OPTIONAL:
        assert str(args[n].type) == "Optional[Tensor]" and args[n].default_value is None, schema
    assert str(args["backend"].type) == "Optional[str]"
    assert len(schema.returns) == 2   # (out, stats [2, s_q, h_q]): the wrapper splits stats
    assert not schema.is_mutable and all(a.alias_info is None for a in schema.arguments)
    assert all(r.alias_info is None for r in schema.returns)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("device", ["meta", "fake_cuda"])
def test_torch_fake_shapes(device, d_qk):
    torch, gt = _torch()
    ctx = contextlib.nullcontext()
    if device == "fake_cuda":   # FakeTensorMode's CUDA tensors need no GPU
        from torch._subclasses.fake_tensor import FakeTensorMode

        ctx = FakeTensorMode()
    with ctx:
        dev = "cuda" if device == "fake_cuda" else "meta"
        for h_q in (1, 16, 64, 128):
            q, kv, idx, opt = _torch_case(torch, dev, d_qk, h_q)
            for names in ((), ("attn_sink",), ("attn_sink", "topk_length"), OPTIONAL):
                given = {n: opt[n] for n in names}
                pos = [given.pop(n, None) for n in ("attn_sink", "topk_length")]
                out, ml, lse = gt.flash_mla_sparse_fwd(q, kv, idx, d_qk ** -0.5, 512, *pos, **given)
                assert out.shape == (S_Q, h_q, 512) and out.dtype == torch.bfloat16 and out.device == q.device
                for x in (ml, lse):
                    assert x.shape == (S_Q, h_q) and x.dtype == torch.float32 and x.device == q.device
            out, stats = torch.ops.gqadrv.flash_mla_sparse_fwd(q, kv, idx, 0.1)   # the op: (out, stats)
            assert out.shape == (S_Q, h_q, 512) and stats.shape == (2, S_Q, h_q) and stats.dtype == torch.float32


def test_torch_fake_rejections():
    torch, gt = _torch()
    q, kv, idx, opt = _torch_case(torch)
    bf, i32, f32 = torch.bfloat16, torch.int32, torch.float32

    def call(q=q, kv=kv, idx=idx, sm_scale=0.1, d_v=512, **over):
        given = {**{n: None for n in OPTIONAL}, **over}
        return gt.flash_mla_sparse_fwd(q, kv, idx, sm_scale, d_v, given.pop("attn_sink"), given.pop("topk_length"),
                                       **given)

    call()
    with pytest.raises(TypeError, match="sm_scale is required"):
        call(sm_scale=None)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
            call(sm_scale=bad)
    with pytest.raises(ValueError, match="d_v must be 512"):
        call(d_v=576)
    with pytest.raises(ValueError, match=r"q must have shape \[s_q, h_q, d_qk\] with d_qk 576 or 512"):
        call(q=_t(torch, (S_Q, H_Q, 128), bf))
    with pytest.raises(ValueError, match=r"q must have shape \[s_q, h_q, d_qk\]"):
        call(q=_t(torch, (1, S_Q, H_Q, 576), bf))
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        call(q=_t(torch, (S_Q, H_Q, 576), torch.float16))
    with pytest.raises(ValueError, match=r"h_q must be in \[1, 128\]"):
        call(q=_t(torch, (S_Q, 129, 576), bf))
    with pytest.raises(ValueError, match=r"kv must have shape \[s_kv, 1, 576\]"):
        call(kv=_t(torch, (S_KV, 1, 512), bf))
    with pytest.raises(ValueError, match=r"kv must have shape \[s_kv, 1, 576\]"):
        call(kv=_t(torch, (S_KV, 2, 576), bf))
    with pytest.raises(TypeError, match="kv must have dtype bfloat16"):
        call(kv=_t(torch, (S_KV, 1, 576), torch.uint8))
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        call(idx=_t(torch, (S_Q, 1, TOPK), torch.int64))
    with pytest.raises(ValueError, match=r"indices must have shape \[8, 1, topk\]"):
        call(idx=_t(torch, (S_Q + 1, 1, TOPK), i32))
    with pytest.raises(ValueError, match=r"indices must have shape \[8, 1, topk\]"):
        call(idx=_t(torch, (S_Q, TOPK), i32))
    with pytest.raises(TypeError, match="attn_sink must have dtype float32"):
        call(attn_sink=_t(torch, (H_Q,), bf))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(16,\)"):
        call(attn_sink=_t(torch, (H_Q + 1,), f32))
    with pytest.raises(TypeError, match="topk_length must have dtype int32"):
        call(topk_length=_t(torch, (S_Q,), torch.int64))
    with pytest.raises(ValueError, match=r"topk_length must have shape \(8,\)"):
        call(topk_length=_t(torch, (S_Q, 1), i32))
    with pytest.raises(ValueError, match="go together"):
        call(cu_seqlens_q=opt["cu_seqlens_q"])
    with pytest.raises(ValueError, match="go together"):
        call(cu_seqlens_kv=opt["cu_seqlens_kv"])
    with pytest.raises(TypeError, match="cu_seqlens_kv must have dtype int32"):
        call(cu_seqlens_q=opt["cu_seqlens_q"], cu_seqlens_kv=_t(torch, (4,), torch.int64))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have shape \[n \+ 1\]"):
        call(cu_seqlens_q=_t(torch, (4, 1), i32), cu_seqlens_kv=opt["cu_seqlens_kv"])
    with pytest.raises(ValueError, match="must have the same length"):
        call(cu_seqlens_q=opt["cu_seqlens_q"], cu_seqlens_kv=_t(torch, (3,), i32))
    # d_qk 512: kv must follow q's
    with pytest.raises(ValueError, match=r"kv must have shape \[s_kv, 1, 512\]"):
        call(q=_t(torch, (S_Q, H_Q, 512), bf))


def test_torch_step_compiles_without_graph_breaks():
    torch, gt = _torch()
    q, kv, idx, opt = _torch_case(torch)
    q5, kv5, _, _ = _torch_case(torch, d_qk=512)

    def step(q, kv, idx, sink, tl, cq, ck, q5, kv5):
        o1, m1, l1 = gt.flash_mla_sparse_fwd(q, kv, idx, 0.05, 512, sink, tl)
        o2, m2, l2 = gt.flash_mla_sparse_fwd(q, kv, idx, 0.04, attn_sink=sink, cu_seqlens_q=cq, cu_seqlens_kv=ck)
        o3, m3, l3 = gt.flash_mla_sparse_fwd(q5, kv5, idx, 0.03, backend="mma")
        return sum(o.float().sum() + m.sum() + lse.sum() for o, m, lse in ((o1, m1, l1), (o2, m2, l2), (o3, m3, l3)))

    args = (q, kv, idx, opt["attn_sink"], opt["topk_length"], opt["cu_seqlens_q"], opt["cu_seqlens_kv"], q5, kv5)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    calls = [n for g in explain.graphs for n in g.graph.nodes
             if n.op == "call_function" and str(n.target).removesuffix(".default") == "gqadrv.flash_mla_sparse_fwd"]
    assert len(calls) == 3
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert compiled(*args).shape == ()


def _torch_from_host(torch, a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _host_bf16(torch, t) -> np.ndarray:
    import ml_dtypes

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _oracle_stand_in(calls: list, to_host):
    """A stand-in for ``_sparse_fwd_into`` that records its arguments and writes the float64 oracle
    into out / stats (``to_host``: framework buffer -> writable host array)."""
    from gqadrv.mla.sparse_reference import sparse_prefill_reference

    def into(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv, *, out, stats,
             stream, backend):
        given = dict(zip(OPTIONAL, (attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv)))
        calls.append({"q": q, "kv": kv, "indices": indices, "sm_scale": sm_scale, "d_v": d_v, "given": given,
                      "out": out, "stats": stats, "stream": stream, "backend": backend})
        host = {n: None if v is None else to_host(v) for n, v in given.items()}
        o, m, lse = sparse_prefill_reference(to_host(q), to_host(kv), to_host(indices), sm_scale, d_v, **host)
        ho, hs = to_host(out), to_host(stats)
        ho[...] = o.astype(ho.dtype)
        hs[0], hs[1] = m, lse

    return into


@pytest.mark.parametrize("d_qk", [576, 512])
def test_torch_op_body_hands_the_given_tensors_to_gqadrv(monkeypatch, d_qk):
    """The real op body on CPU tensors with gqadrv replaced by the float64 oracle: the tensors reach
    the library detached and under their names (None where not given), torch's out / stats are written
    and returned, on torch's stream, with sm_scale / d_v / backend as given."""
    torch, gt = _torch()
    calls: list[dict] = []
    monkeypatch.setattr(gt, "_stream", lambda t: 4321)

    def to_host(t):
        return _host_bf16(torch, t) if t.dtype == torch.bfloat16 else t.numpy()

    monkeypatch.setattr(gt, "_sparse_fwd_into", _oracle_stand_in(calls, to_host))
    body = gt._sparse_fwd_op._init_fn
    for h in (tiny(d_qk), tiny(d_qk, 1, sink=False, lengths=False), tiny_varlen(d_qk)):
        t = {n: _torch_from_host(torch, a) for n, a in h.arrays().items()}
        q, kv, idx = (_torch_from_host(torch, a) for a in (h.q, h.kv, h.indices))
        q.requires_grad_(True)   # detached before reaching gqadrv
        out, stats = body(q, kv, idx, h.sm_scale, 512, t.get("attn_sink"), t.get("topk_length"),
                          t.get("cu_seqlens_q"), t.get("cu_seqlens_kv"), "mma")
        c = calls[-1]
        assert c["out"] is out and c["stats"] is stats and c["stream"] == 4321 and c["backend"] == "mma"
        assert c["sm_scale"] == h.sm_scale and c["d_v"] == 512
        assert {n for n, v in c["given"].items() if v is not None} == set(t)
        assert all(torch.equal(c["given"][n], t[n]) for n in t)
        assert all(not x.requires_grad for x in (c["q"], c["kv"], c["indices"]))
        assert out.shape == (S_Q, H_Q, 512) and out.dtype == torch.bfloat16
        assert stats.shape == (2, S_Q, H_Q) and stats.dtype == torch.float32
        want_o, want_m, want_l = h.reference()
        np.testing.assert_allclose(out.float().numpy(), want_o, atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(stats[0].numpy(), want_m.astype(np.float32))
        np.testing.assert_array_equal(stats[1].numpy(), want_l.astype(np.float32))
    # the op body rejects what the fake implementation rejects, before allocating or calling gqadrv
    n = len(calls)
    with pytest.raises(ValueError, match="d_v must be 512"):
        body(q, kv, idx, 0.1, 256, None, None, None, None, None)
    assert len(calls) == n


@pytest.mark.parametrize("module", ["torch", "jax"])
def test_sparse_fwd_into_forwards_to_the_library(monkeypatch, module):
    """``_sparse_fwd_into`` (torch and JAX) is the library's ``flash_mla_sparse_fwd`` with the
    framework's buffers as ``out`` / ``stats`` and the framework's stream: every argument reaches it
    unchanged."""
    if module == "torch":
        _, mod = _torch()
    else:
        _, mod = _jax()
    import gqadrv.mla.sparse_prefill as spf

    calls = []
    monkeypatch.setattr(spf, "flash_mla_sparse_fwd", lambda *a, **k: calls.append((a, k)))
    mod._sparse_fwd_into("Q", "KV", "IDX", 0.1, 512, "SINK", "TL", "CQ", "CK", out="O", stats="S", stream=77,
                         backend="seesaw")
    assert calls == [(("Q", "KV", "IDX", 0.1, 512, "SINK", "TL"),
                      {"cu_seqlens_q": "CQ", "cu_seqlens_kv": "CK", "out": "O", "stats": "S", "stream": 77,
                       "backend": "seesaw"})]



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


def _jax_case(jax, d_qk=576, h_q=H_Q, s_q=S_Q, s_kv=S_KV, topk=TOPK):
    opt = {"attn_sink": _sds(jax, (h_q,), "float32"), "topk_length": _sds(jax, (s_q,), "int32"),
           "cu_seqlens_q": _sds(jax, (4,), "int32"), "cu_seqlens_kv": _sds(jax, (4,), "int32")}
    return (_sds(jax, (s_q, h_q, d_qk), "bfloat16"), _sds(jax, (s_kv, 1, d_qk), "bfloat16"),
            _sds(jax, (s_q, 1, topk), "int32"), opt)


def _eval(jax, gj, q, kv, idx, opt: dict, sm_scale=0.1, d_v=512, **static):
    names = tuple(opt)

    def f(q, kv, idx, *arrays):
        return gj.flash_mla_sparse_fwd(q, kv, idx, sm_scale, d_v, **static, **dict(zip(names, arrays)))

    return jax.eval_shape(f, q, kv, idx, *opt.values())


@pytest.mark.parametrize("d_qk", [576, 512])
def test_jax_abstract_shapes(d_qk):
    jax, gj = _jax()
    jnp = jax.numpy
    for h_q in (1, 16, 64, 128):
        q, kv, idx, opt = _jax_case(jax, d_qk, h_q)
        for names in ((), ("attn_sink",), ("attn_sink", "topk_length"), OPTIONAL):
            out, ml, lse = _eval(jax, gj, q, kv, idx, {n: opt[n] for n in names}, backend="mma")
            assert out.shape == (S_Q, h_q, 512) and out.dtype == jnp.bfloat16
            assert ml.shape == lse.shape == (S_Q, h_q) and ml.dtype == lse.dtype == jnp.float32
    # positional FlashMLA order: (q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    out, ml, lse = jax.eval_shape(lambda q, kv, i, s, t: gj.flash_mla_sparse_fwd(q, kv, i, 0.1, 512, s, t), q, kv, idx,
                                  opt["attn_sink"], opt["topk_length"])
    assert out.shape == (S_Q, 128, 512) and lse.shape == (S_Q, 128)


def test_jax_lowers_to_one_callback_and_scans():
    jax, gj = _jax()
    jnp = jax.numpy
    q, kv, idx, opt = _jax_case(jax)
    names = tuple(opt)

    def f(q, kv, idx, *arrays):
        return gj.flash_mla_sparse_fwd(q, kv, idx, 0.1, **dict(zip(names, arrays)))

    text = jax.jit(f).lower(q, kv, idx, *opt.values()).as_text()
    assert text.count("xla_buffer_python") == 1
    assert "tensor<2x8x16xf32>" in text   # the callback's stats output, sliced into max_logits / lse

    # two layers: per-layer kv and indices, shared sinks; one callback inside the loop
    kvs = _sds(jax, (2, S_KV, 1, 576), "bfloat16")
    idxs = _sds(jax, (2, S_Q, 1, TOPK), "int32")

    def layers(q, kvs, idxs, sink):
        def body(h, xs):
            kv, idx = xs
            o, m, lse = gj.flash_mla_sparse_fwd(h, kv, idx, 0.1, 512, sink)
            return h, (o, m, lse)
        return jax.lax.scan(body, q, (kvs, idxs))

    args = (q, kvs, idxs, opt["attn_sink"])
    text = jax.jit(layers).lower(*args).as_text()
    assert text.count("xla_buffer_python") == 1 and "while" in text
    _, (o, m, lse) = jax.eval_shape(layers, *args)
    assert o.shape == (2, S_Q, H_Q, 512) and o.dtype == jnp.bfloat16
    assert m.shape == lse.shape == (2, S_Q, H_Q)


def test_jax_callables_are_keyed_by_the_static_options_and_given_operands():
    _, gj = _jax()
    a = gj._sparse_fwd_callable(8, 16, 0.1, 512, None, ("attn_sink",))
    assert gj._sparse_fwd_callable(8, 16, 0.1, 512, None, ("attn_sink",)) is a
    assert gj._sparse_fwd_callable(8, 16, 0.1, 512, None, ()) is not a
    assert gj._sparse_fwd_callable(8, 16, 0.2, 512, None, ("attn_sink",)) is not a
    assert gj._sparse_fwd_callable(8, 16, 0.1, 512, "mma", ("attn_sink",)) is not a


def test_jax_rejections():
    jax, gj = _jax()
    q, kv, idx, opt = _jax_case(jax)

    def call(q=q, kv=kv, idx=idx, sm_scale=0.1, d_v=512, **over):
        given = {n: v for n, v in over.items() if v is not None}
        return _eval(jax, gj, q, kv, idx, given, sm_scale, d_v)

    call()
    with pytest.raises(TypeError, match="sm_scale is required"):
        call(sm_scale=None)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
            call(sm_scale=bad)
    with pytest.raises(TypeError, match="sm_scale must be a static Python number"):
        jax.eval_shape(lambda q, kv, i, s: gj.flash_mla_sparse_fwd(q, kv, i, s), q, kv, idx, _sds(jax, (), "float32"))
    with pytest.raises(ValueError, match="d_v must be 512"):
        call(d_v=576)
    with pytest.raises(TypeError, match="d_v must be a static int"):
        call(d_v=512.0)
    with pytest.raises(ValueError, match=r"q must have shape \[s_q, h_q, d_qk\] with d_qk 576 or 512"):
        call(q=_sds(jax, (S_Q, H_Q, 128), "bfloat16"))
    with pytest.raises(ValueError, match=r"q must have shape \[s_q, h_q, d_qk\]"):
        call(q=_sds(jax, (1, S_Q, H_Q, 576), "bfloat16"))
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        call(q=_sds(jax, (S_Q, H_Q, 576), "float16"))
    with pytest.raises(ValueError, match=r"h_q must be in \[1, 128\]"):
        call(q=_sds(jax, (S_Q, 129, 576), "bfloat16"))
    with pytest.raises(ValueError, match=r"kv must have shape \[s_kv, 1, 576\]"):
        call(kv=_sds(jax, (S_KV, 1, 512), "bfloat16"))
    with pytest.raises(TypeError, match="kv must have dtype bfloat16"):
        call(kv=_sds(jax, (S_KV, 1, 576), "float32"))
    with pytest.raises(TypeError, match="indices must have dtype int32"):
        call(idx=_sds(jax, (S_Q, 1, TOPK), "uint32"))
    with pytest.raises(ValueError, match=r"indices must have shape \[8, 1, topk\]"):
        call(idx=_sds(jax, (S_Q, 2, TOPK), "int32"))
    with pytest.raises(TypeError, match="attn_sink must have dtype float32"):
        call(attn_sink=_sds(jax, (H_Q,), "bfloat16"))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(16,\)"):
        call(attn_sink=_sds(jax, (1,), "float32"))
    with pytest.raises(ValueError, match=r"topk_length must have shape \(8,\)"):
        call(topk_length=_sds(jax, (S_Q + 1,), "int32"))
    with pytest.raises(TypeError, match="topk_length must have dtype int32"):
        call(topk_length=_sds(jax, (S_Q,), "int16"))
    with pytest.raises(ValueError, match="go together"):
        call(cu_seqlens_q=opt["cu_seqlens_q"])
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must have shape \[n \+ 1\]"):
        call(cu_seqlens_q=opt["cu_seqlens_q"], cu_seqlens_kv=_sds(jax, (4, 1), "int32"))
    with pytest.raises(ValueError, match="must have the same length"):
        call(cu_seqlens_q=opt["cu_seqlens_q"], cu_seqlens_kv=_sds(jax, (5,), "int32"))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_jax_callbacks_hand_xla_buffers_to_gqadrv(monkeypatch, d_qk):
    """The buffer_callback executed by XLA:CPU with the CUDA target and gqadrv replaced by the float64
    oracle: the arrays given reach the library under their names (None where not given), XLA's output
    buffers arrive as out / stats, sm_scale / d_v / backend as given, the results are the oracle's,
    and one compilation follows new operand values."""
    jax, gj = _jax()
    jnp = jax.numpy
    calls: list[dict] = []
    monkeypatch.setattr(gj, "_cuda_target", lambda ctx, first: (4321, 0))
    monkeypatch.setattr(gj, "device_scope", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(gj, "_sparse_fwd_into", _oracle_stand_in(calls, np.asarray))
    cpu = jax.devices("cpu")[0]
    for h in (tiny(d_qk, 2), tiny(d_qk, 3, sink=False, lengths=False), tiny_varlen(d_qk, 4)):
        names = tuple(h.arrays())

        def f(q, kv, idx, *arrays, names=names, scale=h.sm_scale):
            return gj.flash_mla_sparse_fwd(q, kv, idx, scale, backend="mma", **dict(zip(names, arrays)))

        jf = jax.jit(f)
        args = [jax.device_put(a, cpu) for a in (h.q, h.kv, h.indices, *h.arrays().values())]
        out, ml, lse = jax.block_until_ready(jf(*args))
        c = calls[-1]
        assert {n for n, v in c["given"].items() if v is not None} == set(names)
        assert all(np.array_equal(np.asarray(c["given"][n]), a) for n, a in h.arrays().items())
        assert (c["stream"], c["backend"], c["sm_scale"], c["d_v"]) == (4321, "mma", h.sm_scale, 512)
        assert np.asarray(c["out"]).shape == (S_Q, H_Q, 512) and np.asarray(c["stats"]).shape == (2, S_Q, H_Q)
        assert out.shape == (S_Q, H_Q, 512) and out.dtype == jnp.bfloat16
        assert ml.shape == lse.shape == (S_Q, H_Q) and ml.dtype == lse.dtype == jnp.float32
        want_o, want_m, want_l = h.reference()
        np.testing.assert_allclose(np.asarray(out).astype(np.float64), want_o, atol=1e-2, rtol=1e-2)
        np.testing.assert_array_equal(np.asarray(ml), want_m.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(lse), want_l.astype(np.float32))
        # new indices: the same compilation, the callback sees the new values
        new_idx = np.roll(h.indices, 3, axis=-1)
        args[2] = jax.device_put(new_idx, cpu)
        jax.block_until_ready(jf(*args))
        assert np.array_equal(np.asarray(calls[-1]["indices"]), new_idx)
        size = getattr(jf, "_cache_size", None)
        if size is not None:
            assert size() == 1
    # eager (un-jitted), positional order
    h = tiny(d_qk, 5)
    args = [jax.device_put(a, cpu) for a in (h.q, h.kv, h.indices, h.attn_sink, h.topk_length)]
    out, ml, lse = gj.flash_mla_sparse_fwd(args[0], args[1], args[2], h.sm_scale, 512, args[3], args[4])
    np.testing.assert_array_equal(np.asarray(lse), h.reference()[2].astype(np.float32))
    assert calls[-1]["backend"] is None and {n for n, v in calls[-1]["given"].items() if v is not None} == {
        "attn_sink", "topk_length"}


def test_jax_on_xla_cpu_reports_cuda_only():
    """Without the stand-ins, the callback refuses XLA:CPU buffers with gqadrv's message."""
    jax, gj = _jax()
    h = tiny()
    cpu = jax.devices("cpu")[0]
    q, kv, idx = (jax.device_put(a, cpu) for a in (h.q, h.kv, h.indices))
    with pytest.raises(Exception, match="CUDA devices only"):
        jax.block_until_ready(gj.flash_mla_sparse_fwd(q, kv, idx, 0.1))
