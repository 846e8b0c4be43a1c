"""gqadrv.torch on the GPU: eager custom ops vs torch.compile(fullgraph=True) vs the float64 oracles,
torch.library.opcheck of the registrations, and torch.cuda.graph capture replayed with changed
lengths (eager and compiled)."""

from __future__ import annotations

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

torch = pytest.importorskip("torch")
gt = pytest.importorskip("gqadrv.torch")  # skips where torch < 2.4

Q_SCALE = 0.7
MLA_SCALE = 0.05


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def to_torch(a: np.ndarray):
    """Host array (bf16 from ml_dtypes included) -> CUDA tensor of the same dtype."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(t) -> np.ndarray:
    return t.float().cpu().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.cpu().numpy()


def lens_tensor(lengths) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int32, device="cuda")


def counting_inductor(graphs: list):
    """A torch.compile backend that records each graph it is given, then compiles it with Inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return backend


def custom_op_names(gm) -> set[str]:
    return {str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"}


def gqa_step(q, kv, lens):
    return gt.gqa_decode(q, kv, lens, q_scale=Q_SCALE)


def mla_step(q, k, bt, lens):
    return gt.flash_mla_with_kvcache(q, k, bt, lens, 512, None, None, MLA_SCALE, True)


# ----------------------------------------------------------------------------- eager vs compiled vs oracle
def test_gqa_eager_vs_compiled_vs_oracle():
    from torch._dynamo.utils import counters

    q, kv = gqa_inputs(1)
    tq, tkv, tl = to_torch(q), to_torch(kv), lens_tensor(GQA_LENGTHS[0])
    torch._dynamo.reset()
    counters.clear()
    graphs: list = []
    compiled = torch.compile(gqa_step, fullgraph=True, backend=counting_inductor(graphs))
    for lengths in GQA_LENGTHS:  # lengths change in place: one graph serves them all
        tl.copy_(lens_tensor(lengths))
        eager = gqa_step(tq, tkv, tl)
        got = compiled(tq, tkv, tl)
        assert isinstance(got, torch.Tensor) and got.dtype == tq.dtype and got.shape == tq.shape
        ref = gqa_ref(q, kv, lengths, Q_SCALE)
        check_gqa(host(eager), ref, "float16", "torch op eager")
        check_gqa(host(got), ref, "float16", "torch op compiled")
        torch.testing.assert_close(got, eager, atol=1e-3, rtol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled (recompiles or breaks)"
    assert "gqadrv.gqa_decode" in custom_op_names(graphs[0])


def test_mla_eager_vs_compiled_vs_oracle():
    from torch._dynamo.utils import counters

    q, k, bt = mla_inputs(2)
    tq, tk, tbt, tl = to_torch(q), to_torch(k), torch.from_numpy(bt).cuda(), lens_tensor(MLA_LENGTHS[0])
    torch._dynamo.reset()
    counters.clear()
    graphs: list = []
    compiled = torch.compile(mla_step, fullgraph=True, backend=counting_inductor(graphs))
    for lengths in MLA_LENGTHS:
        tl.copy_(lens_tensor(lengths))
        eo, el = mla_step(tq, tk, tbt, tl)
        co, cl = compiled(tq, tk, tbt, tl)
        assert co.dtype == torch.bfloat16 and cl.dtype == torch.float32 and cl.shape == (2, 16, 2)
        ref = mla_ref(q, k, bt, lengths, MLA_SCALE, True)
        check_mla(host(eo), host(el), ref, "bfloat16", "torch op eager")
        check_mla(host(co), host(cl), ref, "bfloat16", "torch op compiled")
        torch.testing.assert_close(co, eo, atol=1e-3, rtol=0)
        torch.testing.assert_close(cl, el, atol=1e-4, rtol=0)  # +inf rows equal
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1 and "gqadrv.flash_mla_with_kvcache" in custom_op_names(graphs[0])


def test_opcheck_registrations():
    """torch's own checks of a custom op: schema (no undeclared mutation or aliasing), fake tensor
    impl = real outputs' metadata, AOT dispatch with dynamic shapes, autograd registration."""
    q, kv = gqa_inputs(3)
    torch.library.opcheck(torch.ops.gqadrv.gqa_decode.default,
                          (to_torch(q), to_torch(kv), lens_tensor(GQA_LENGTHS[1]), Q_SCALE, None, None))
    mq, mk, mbt = mla_inputs(4)
    torch.library.opcheck(torch.ops.gqadrv.flash_mla_with_kvcache.default,
                          (to_torch(mq), to_torch(mk), torch.from_numpy(mbt).cuda(), lens_tensor(MLA_LENGTHS[2]), 512,
                           None, MLA_SCALE, True, None))


# ----------------------------------------------------------------------------- torch.cuda.graph
def capture(fn, *args):
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
def test_gqa_cuda_graph_replays_with_changed_lengths(compiled):
    q, kv = gqa_inputs(5)
    tq, tkv, tl = to_torch(q), to_torch(kv), lens_tensor(GQA_LENGTHS[0])
    torch._dynamo.reset()
    fn = torch.compile(gqa_step, fullgraph=True) if compiled else gqa_step
    g, out = capture(fn, tq, tkv, tl)
    for lengths in GQA_LENGTHS[1:] + GQA_LENGTHS[:1]:
        tl.copy_(lens_tensor(lengths))
        out.fill_(float("nan"))  # the replay must write every element
        g.replay()
        torch.cuda.synchronize()
        check_gqa(host(out), gqa_ref(q, kv, lengths, Q_SCALE), "float16", f"torch graph {'compiled' if compiled else 'eager'}")


def test_mla_cuda_graph_replays_with_changed_lengths():
    q, k, bt = mla_inputs(6)
    tq, tk, tbt, tl = to_torch(q), to_torch(k), torch.from_numpy(bt).cuda(), lens_tensor(MLA_LENGTHS[0])
    torch._dynamo.reset()
    g, (out, lse) = capture(torch.compile(mla_step, fullgraph=True), tq, tk, tbt, tl)
    for lengths in MLA_LENGTHS[1:] + MLA_LENGTHS[:1]:
        tl.copy_(lens_tensor(lengths))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_mla(host(out), host(lse), mla_ref(q, k, bt, lengths, MLA_SCALE, True), "bfloat16", "torch graph compiled")


def test_outputs_follow_torch_current_stream():
    """The op launches on torch's current stream: q is written on a side stream behind a long spin,
    and the op, called under ``torch.cuda.stream(side)``, must run after that write (launched on
    any other stream it would read the zeros)."""
    q, kv = gqa_inputs(7)
    tq, tkv, tl = to_torch(q), to_torch(kv), lens_tensor(GQA_LENGTHS[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2 = torch.zeros_like(tq)
        torch.cuda._sleep(50_000_000)  # keep the side stream busy (~tens of ms)
        q2.copy_(tq)
        out = gt.gqa_decode(q2, tkv, tl, q_scale=Q_SCALE)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check_gqa(host(out), gqa_ref(q, kv, GQA_LENGTHS[0], Q_SCALE), "float16", "torch side stream")
