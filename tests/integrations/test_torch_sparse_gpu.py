"""gqadrv.torch's sparse MLA decode (``flash_mla_with_kvcache`` with ``indices``) on the GPU: the eager
custom op against the float64 oracle (gqadrv.mla.sparse_reference) for an FP8 cache (built on the host
with quantize_k_cache_reference), an FP8 cache with an extra pool and a bf16 cache with an extra pool
(invalid indices of every kind, a NaN page named only past topk_length, +-inf attention sinks, a row
without valid keys); torch.compile(fullgraph=True) equal to eager in one graph without breaks and
without recompiling when the indices change in place; torch.library.opcheck of the sparse
registration; torch.cuda.graph capture (eager and compiled) replayed after in-place updates of the
indices, lengths and sinks. The cases are in tests/integrations/sparse_cases.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations.cases import check_mla
from tests.integrations.sparse_cases import (
    H_Q,
    KINDS,
    MAIN,
    S_Q,
    SPARE,
    SPARSE_NAMES,
    B,
    build,
    redraw,
)

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
gt = pytest.importorskip("gqadrv.torch")  # skips where torch < 2.4


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def to_torch(a: np.ndarray) -> torch.Tensor:
    """Host array (bf16 from ml_dtypes included) -> CUDA tensor of the same dtype."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(t: torch.Tensor) -> np.ndarray:
    return t.float().cpu().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.cpu().numpy()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def counting_inductor(graphs: list):
    """A torch.compile backend that records each graph it is given, then compiles it with Inductor."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    return backend


def custom_op_names(gm) -> set[str]:
    return {str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"}


def device_case(kind: str, seed: int):
    """(host case, q, k_cache, {name: tensor} of the sparse keywords given)."""
    h = build(kind, seed)
    return h, to_torch(h.q), to_torch(h.k_cache), {n: to_torch(a) for n, a in h.arrays().items()}


def make_step(names: tuple, fp8: bool, scale: float | None):
    """The decode step of one case: q, k_cache and the sparse tensors ``names`` (in that order)."""
    def step(q, k, *arrays):
        return gt.flash_mla_with_kvcache(q, k, None, None, 512, None, None, scale, False, fp8,
                                         **dict(zip(names, arrays)))

    return step


def update_in_place(t: dict, changed: dict) -> None:
    for n, a in changed.items():
        t[n].copy_(to_torch(a))


def check(h, out, lse, label: str) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == (B, S_Q, H_Q, 512), (out.dtype, out.shape)
    assert lse.dtype == torch.float32 and lse.shape == (B, H_Q, S_Q), (lse.dtype, lse.shape)
    check_mla(host(out), host(lse), h.reference(), "bfloat16", label)
    assert not out[:, :, 0].any(), f"{label}: the +inf sink of head 0 must zero its output"


def assert_close_outputs(got, want, label: str) -> None:
    (go, gl), (wo, wl) = got, want
    torch.testing.assert_close(go, wo, atol=1e-3, rtol=0, msg=f"{label}: out")
    torch.testing.assert_close(gl, wl, atol=1e-4, rtol=0, msg=f"{label}: lse")   # +inf rows equal


# ----------------------------------------------------------------------------- eager vs oracle vs compiled
@pytest.mark.parametrize("kind", KINDS)
def test_sparse_eager_vs_oracle_vs_compiled(kind):
    from torch._dynamo.utils import counters

    h, tq, tk, t = device_case(kind, 11)
    names = tuple(t)
    step = make_step(names, h.fp8, h.scale)
    torch._dynamo.reset()
    counters.clear()
    graphs: list = []
    compiled = torch.compile(step, fullgraph=True, backend=counting_inductor(graphs))
    for it in range(3):   # indices / lengths / sinks change in place: one graph serves them all
        if it:
            update_in_place(t, redraw(h, 100 + it))
        eager = step(tq, tk, *t.values())
        check(h, *eager, f"torch sparse {kind} eager #{it}")
        got = compiled(tq, tk, *t.values())
        check(h, *got, f"torch sparse {kind} compiled #{it}")
        assert_close_outputs(got, eager, f"{kind} compiled vs eager #{it}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled (recompiles or breaks)"
    assert "gqadrv.flash_mla_with_kvcache" in custom_op_names(graphs[0])

    # block_table / cache_seqlens are ignored on the sparse path
    bt = torch.zeros((B, 3), dtype=torch.int32, device="cuda")
    o, lse = gt.flash_mla_with_kvcache(tq, tk, bt, bt[:, 0].contiguous(), 512, None, None, h.scale, False, h.fp8, **t)
    assert_close_outputs((o, lse), eager, f"{kind} with ignored tables")
    if h.fp8 and hasattr(torch, "float8_e4m3fn"):   # other spellings of the same FP8 bytes
        f8 = {n: (v.view(torch.float8_e4m3fn) if n == "extra_k_cache" else v) for n, v in t.items()}
        got = step(tq, tk.view(torch.float8_e4m3fn), *f8.values())
        assert_close_outputs(got, eager, f"{kind} float8_e4m3fn cache")
        got = step(tq, tk.view(torch.int8), *t.values())
        assert_close_outputs(got, eager, f"{kind} int8 cache")


def test_sparse_only_indices_equals_oracle():
    """The minimal sparse call (indices only: no sink, no topk_length, no extra pool)."""
    h, tq, tk, _t = device_case("fp8", 12)
    h.attn_sink, h.topk_length = None, None
    spare, page = SPARE[MAIN], MAIN[1]   # without topk_length every position counts: no index of the NaN page
    h.indices[(h.indices >= spare * page) & (h.indices < (spare + 1) * page)] = -1
    idx = to_torch(h.indices)
    out, lse = gt.flash_mla_with_kvcache(tq, tk, indices=idx, is_fp8_kvcache=True)
    assert out.shape == (B, S_Q, H_Q, 512) and lse.shape == (B, H_Q, S_Q)
    check_mla(host(out), host(lse), h.reference(), "bfloat16", "torch sparse indices only")


def test_opcheck_sparse_registration():
    """torch's checks of the registration with the sparse arguments: schema (no mutation, no
    aliasing), fake impl = real outputs' metadata, AOT dispatch with dynamic shapes, autograd."""
    op = torch.ops.gqadrv.flash_mla_with_kvcache.default
    for kind in ("fp8", "bf16_extra"):
        h, tq, tk, t = device_case(kind, 13)
        sparse = tuple(t.get(n) for n in SPARSE_NAMES)
        torch.library.opcheck(op, (tq, tk, None, None, 512, None, h.scale, False, None, h.fp8, *sparse))


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
@pytest.mark.parametrize("kind", ["fp8_extra", "bf16_extra"])
def test_sparse_cuda_graph_replays_with_changed_indices(kind, compiled):
    h, tq, tk, t = device_case(kind, 14)
    step = make_step(tuple(t), h.fp8, h.scale)
    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True) if compiled else step
    g, (out, lse) = capture(fn, tq, tk, *t.values())
    label = f"torch sparse graph {kind} {'compiled' if compiled else 'eager'}"
    for it in range(1, 4):
        update_in_place(t, redraw(h, 200 + it))   # new indices, topk_length, sinks, extra indices / lengths
        out.fill_(float("nan"))   # the replay must write every element
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(h, out, lse, f"{label} replay #{it}")
        assert_close_outputs((out, lse), step(tq, tk, *t.values()), f"{label} replay #{it} vs eager")
