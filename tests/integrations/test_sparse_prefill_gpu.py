"""gqadrv.torch / gqadrv.jax's sparse MLA prefill (``flash_mla_sparse_fwd``) on the GPU, against the
float64 oracle (gqadrv.mla.sparse_reference.sparse_prefill_reference): out within 2e-2, max_logits /
lse within 1e-3, -inf / +inf exactly on rows without keys.

Cases (tests/integrations/sparse_prefill_cases.py): s_q 20, s_kv 300, topk 100, d_qk 576 and 512,
h_q 16 and 64; invalid indices of every kind, NaN KV rows named only past topk_length, a token whose
indices are all invalid and one with topk_length 0, a length past topk, attention sinks with +inf /
-inf entries; the varlen form (three requests, one without query tokens, request-relative indices).

torch: the eager custom op vs the oracle; torch.compile(fullgraph=True) (Inductor) equal to eager in
one graph without breaks and without recompiling when the indices, lengths and sinks change in place;
torch.library.opcheck of the registration; torch.cuda.graph capture (eager and compiled) replayed
into NaN-filled outputs after in-place updates. JAX: eager calls vs the oracle, jax.jit equal to
eager with one compilation for changing operands, the varlen form, the minimal call."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.integrations.sparse_prefill_cases import (
    S_Q,
    build,
    build_varlen,
    check,
    redraw,
)

pytestmark = pytest.mark.gpu

SHAPES = [(576, 16), (576, 64), (512, 16), (512, 64)]   # (d_qk, h_q)
IDS = [f"d{d}h{h}" for d, h in SHAPES]


# ----------------------------------------------------------------------------- torch
def _torch():
    torch = pytest.importorskip("torch")
    gt = pytest.importorskip("gqadrv.torch")  # skips where torch < 2.4
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch, gt


def to_torch(torch, a: np.ndarray):
    """Host array (bf16 from ml_dtypes included) -> CUDA tensor of the same dtype."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(torch, ts) -> tuple:
    return tuple(t.float().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy() for t in ts)


def torch_case(torch, h):
    """(q, kv, indices, {optional name: tensor}) on the GPU."""
    return (to_torch(torch, h.q), to_torch(torch, h.kv), to_torch(torch, h.indices),
            {n: to_torch(torch, a) for n, a in h.arrays().items()})


def check_torch(torch, h, got, label: str, **kw) -> None:
    out, ml, lse = got
    s_q, h_q = h.s_q, h.h_q
    assert out.dtype == torch.bfloat16 and out.shape == (s_q, h_q, 512), (out.dtype, out.shape)
    for x in (ml, lse):
        assert x.dtype == torch.float32 and x.shape == (s_q, h_q), (x.dtype, x.shape)
    assert out.device == ml.device == lse.device
    check(host(torch, got), h.reference(), label, **kw)


def torch_step(gt, h):
    """The prefill call of case ``h``: (q, kv, indices, *optional tensors in h.arrays() order)."""
    names, scale = tuple(h.arrays()), h.sm_scale

    def step(q, kv, indices, *arrays):
        return gt.flash_mla_sparse_fwd(q, kv, indices, scale, 512, **dict(zip(names, arrays)))

    return step


def update_in_place(torch, idx, t: dict, changed: dict) -> None:
    for n, a in changed.items():
        (idx if n == "indices" else t[n]).copy_(to_torch(torch, a))


def assert_same(torch, got, want, label: str) -> None:
    for name, g, w, tol in zip(("out", "max_logits", "lse"), got, want, (1e-3, 1e-4, 1e-4)):
        torch.testing.assert_close(g, w, atol=tol, rtol=0, msg=f"{label}: {name}")   # inf entries must match


def counting_inductor(graphs: list):
    """A torch.compile backend that records each graph it is given, then compiles it with Inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return backend


@pytest.mark.parametrize(("d_qk", "h_q"), SHAPES, ids=IDS)
def test_torch_eager_vs_oracle(d_qk, h_q):
    torch, gt = _torch()
    h = build(d_qk, h_q, 10 + h_q + d_qk)
    q, kv, idx, t = torch_case(torch, h)
    got = gt.flash_mla_sparse_fwd(q, kv, idx, h.sm_scale, 512, t["attn_sink"], t["topk_length"])
    check_torch(torch, h, got, f"torch d{d_qk} h{h_q} eager")
    # max_logits and lse are the two halves of one op output (views, no copy)
    out, stats = torch.ops.gqadrv.flash_mla_sparse_fwd(q, kv, idx, h.sm_scale, 512, t["attn_sink"],
                                                       t["topk_length"])
    assert stats.shape == (2, S_Q, h_q) and stats.is_contiguous()
    assert_same(torch, (out, stats[0], stats[1]), got, f"d{d_qk} h{h_q} op vs wrapper")


@pytest.mark.parametrize(("d_qk", "h_q"), [(576, 64), (512, 16)], ids=["d576h64", "d512h16"])
def test_torch_minimal_call(d_qk, h_q):
    """indices only: no sink, no topk_length (every position counts; no index names a NaN row)."""
    torch, gt = _torch()
    h = build(d_qk, h_q, 30 + d_qk, sink=False, lengths=False)
    q, kv, idx, _ = torch_case(torch, h)
    check_torch(torch, h, gt.flash_mla_sparse_fwd(q, kv, idx, h.sm_scale), f"torch d{d_qk} h{h_q} minimal",
                sink_head0_inf=False)


@pytest.mark.parametrize(("d_qk", "h_q"), [(576, 64), (512, 16)], ids=["d576h64", "d512h16"])
def test_torch_compiled_equals_eager(d_qk, h_q):
    torch, gt = _torch()
    from torch._dynamo.utils import counters

    h = build(d_qk, h_q, 40 + d_qk + h_q)
    q, kv, idx, t = torch_case(torch, h)
    step = torch_step(gt, h)
    torch._dynamo.reset()
    counters.clear()
    graphs: list = []
    compiled = torch.compile(step, fullgraph=True, backend=counting_inductor(graphs))
    for it in range(3):   # indices / lengths / sinks change in place: one graph serves them all
        if it:
            update_in_place(torch, idx, t, redraw(h, 100 + it))
        eager = step(q, kv, idx, *t.values())
        check_torch(torch, h, eager, f"torch d{d_qk} h{h_q} eager #{it}")
        got = compiled(q, kv, idx, *t.values())
        check_torch(torch, h, got, f"torch d{d_qk} h{h_q} compiled #{it}")
        assert_same(torch, got, eager, f"d{d_qk} h{h_q} compiled vs eager #{it}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled (recompiles or breaks)"
    ops = {str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "gqadrv.flash_mla_sparse_fwd" in ops, ops


def test_torch_opcheck():
    """torch's checks of the registration: schema (no mutation, no aliasing), fake impl = real outputs'
    metadata, AOT dispatch with dynamic shapes, autograd registration."""
    torch, _gt = _torch()
    op = torch.ops.gqadrv.flash_mla_sparse_fwd.default
    h = build(576, 16, 50)
    q, kv, idx, t = torch_case(torch, h)
    torch.library.opcheck(op, (q, kv, idx, h.sm_scale, 512, t["attn_sink"], t["topk_length"], None, None, None))
    v = build_varlen(512, 16, 51)
    q, kv, idx, t = torch_case(torch, v)
    torch.library.opcheck(op, (q, kv, idx, v.sm_scale, 512, t["attn_sink"], None, t["cu_seqlens_q"],
                               t["cu_seqlens_kv"], None))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_torch_varlen(d_qk):
    torch, gt = _torch()
    h = build_varlen(d_qk, 16, 60 + d_qk)
    q, kv, idx, t = torch_case(torch, h)
    got = gt.flash_mla_sparse_fwd(q, kv, idx, h.sm_scale, attn_sink=t["attn_sink"], cu_seqlens_q=t["cu_seqlens_q"],
                                  cu_seqlens_kv=t["cu_seqlens_kv"])
    check_torch(torch, h, got, f"torch varlen d{d_qk}")


def capture(torch, fn, *args):
    """torch's documented pattern: warm up on a side stream, then capture on torch's capture stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    return g, out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("d_qk", "h_q"), [(576, 64), (512, 16)], ids=["d576h64", "d512h16"])
def test_torch_cuda_graph_replays_with_changed_indices(d_qk, h_q, compiled):
    torch, gt = _torch()
    h = build(d_qk, h_q, 70 + d_qk + h_q)
    q, kv, idx, t = torch_case(torch, h)
    step = torch_step(gt, h)
    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True) if compiled else step
    g, got = capture(torch, fn, q, kv, idx, *t.values())
    label = f"torch graph d{d_qk} h{h_q} {'compiled' if compiled else 'eager'}"
    for it in range(1, 4):
        update_in_place(torch, idx, t, redraw(h, 200 + it))   # new indices, topk_length and sinks
        for x in got:   # the replay must write every element (max_logits / lse are views of one buffer)
            x.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_torch(torch, h, got, f"{label} replay #{it}")
        assert_same(torch, got, step(q, kv, idx, *t.values()), f"{label} replay #{it} vs eager")


# ----------------------------------------------------------------------------- JAX
def _jax():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to gqadrv's CuPy pool
    jax = pytest.importorskip("jax")
    gj = pytest.importorskip("gqadrv.jax")  # skips where JAX < 0.7
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")
    return jax, gj


def check_jax(jax, h, got, label: str, **kw) -> None:
    jnp = jax.numpy
    out, ml, lse = got
    assert out.dtype == jnp.bfloat16 and out.shape == (h.s_q, h.h_q, 512), (out.dtype, out.shape)
    for x in (ml, lse):
        assert x.dtype == jnp.float32 and x.shape == (h.s_q, h.h_q), (x.dtype, x.shape)
    check(tuple(np.asarray(x).astype(np.float64) for x in got), h.reference(), label, **kw)


def assert_same_jax(got, want, label: str) -> None:
    for name, g, w, tol in zip(("out", "max_logits", "lse"), got, want, (1e-3, 1e-4, 1e-4)):
        np.testing.assert_allclose(np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32), atol=tol,
                                   rtol=0, err_msg=f"{label}: {name}")   # inf entries must match


def compiled_once(fn) -> None:
    size = getattr(fn, "_cache_size", None)
    if size is not None:
        assert size() == 1, f"jit compiled {size()} times"


def jax_step(gj, h):
    names, scale = tuple(h.arrays()), h.sm_scale

    def step(q, kv, indices, *arrays):
        return gj.flash_mla_sparse_fwd(q, kv, indices, scale, 512, **dict(zip(names, arrays)))

    return step


@pytest.mark.parametrize(("d_qk", "h_q"), SHAPES, ids=IDS)
def test_jax_eager_vs_oracle_vs_jit(d_qk, h_q):
    jax, gj = _jax()
    jnp = jax.numpy
    h = build(d_qk, h_q, 80 + d_qk + h_q)
    q, kv = jnp.asarray(h.q), jnp.asarray(h.kv)
    a = {n: jnp.asarray(v) for n, v in h.arrays().items()}
    step = jax_step(gj, h)
    jstep = jax.jit(step)
    for it in range(3):   # new indices, lengths and sinks (operands): one compilation serves them all
        if it:
            a.update({n: jnp.asarray(v) for n, v in redraw(h, 300 + it).items() if n != "indices"})
        idx = jnp.asarray(h.indices)
        eager = step(q, kv, idx, *a.values())
        check_jax(jax, h, eager, f"jax d{d_qk} h{h_q} eager #{it}")
        got = jstep(q, kv, idx, *a.values())
        check_jax(jax, h, got, f"jax d{d_qk} h{h_q} jit #{it}")
        assert_same_jax(got, eager, f"d{d_qk} h{h_q} jit vs eager #{it}")
    compiled_once(jstep)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_jax_varlen(d_qk):
    jax, gj = _jax()
    jnp = jax.numpy
    h = build_varlen(d_qk, 64, 90 + d_qk)
    args = [jnp.asarray(x) for x in (h.q, h.kv, h.indices)]
    kw = {n: jnp.asarray(v) for n, v in h.arrays().items()}
    eager = gj.flash_mla_sparse_fwd(*args, h.sm_scale, **kw)
    check_jax(jax, h, eager, f"jax varlen d{d_qk} eager")
    got = jax.jit(jax_step(gj, h))(*args, *kw.values())
    check_jax(jax, h, got, f"jax varlen d{d_qk} jit")
    assert_same_jax(got, eager, f"varlen d{d_qk} jit vs eager")


def test_jax_minimal_call():
    """indices only: no sink, no topk_length (every position counts; no index names a NaN row)."""
    jax, gj = _jax()
    jnp = jax.numpy
    h = build(512, 64, 95, sink=False, lengths=False)
    got = gj.flash_mla_sparse_fwd(jnp.asarray(h.q), jnp.asarray(h.kv), jnp.asarray(h.indices), h.sm_scale)
    check_jax(jax, h, got, "jax minimal", sink_head0_inf=False)
