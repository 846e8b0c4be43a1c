"""gqadrv.torch for the paged GQA decode, the contiguous LSE / multi-token call and the LSE state
merge: eager custom ops vs torch.compile(fullgraph=True) vs the float64 oracles, opcheck, and a
torch.cuda.graph replayed after in-place length updates."""

from __future__ import annotations

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

torch = pytest.importorskip("torch")
gt = pytest.importorskip("gqadrv.torch")  # skips where torch < 2.4

Q_SCALE = 0.7


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(t) -> np.ndarray:
    return t.float().cpu().numpy() if t.dtype in (torch.float16, torch.bfloat16) else t.cpu().numpy()


def lens(lengths) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int32, device="cuda")


def graph_breaks_and_graphs(fn):
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend), graphs, counters


@pytest.mark.parametrize("combined", [False, True])
def test_paged_eager_vs_compiled_vs_oracle(combined):
    q, kc, vc, bt = paged_inputs(21, combined=combined)
    tq, tk, tb, tl = dev(q), dev(kc), dev(bt), lens(PAGED_LENGTHS[0])
    tv = None if vc is None else dev(vc)

    def step(q, k, v, bt, l):
        return gt.gqa_decode_paged(q, k, v, bt, l, q_scale=Q_SCALE, return_lse=True)

    compiled, graphs, counters = graph_breaks_and_graphs(step)
    for lengths in PAGED_LENGTHS:
        tl.copy_(lens(lengths))
        eo, el = step(tq, tk, tv, tb, tl)
        co, cl = compiled(tq, tk, tv, tb, tl)
        ref = paged_ref(q, kc, vc, bt, lengths, Q_SCALE)
        check_paged(host(eo), host(el), ref, "torch paged op eager")
        check_paged(host(co), host(cl), ref, "torch paged op compiled")
        assert torch.equal(co, eo) and torch.equal(cl, el)   # the same kernel on the same data
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1


def test_contiguous_lse_and_deterministic_ops():
    rng = np.random.default_rng(22)
    q = rng.standard_normal((2, 3, 8, 64)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 2, 200, 64)).astype(np.float16)
    import gqadrv

    tq, tkv, tl = dev(q), dev(kv), lens([200, 40])
    out, lse = gt.gqa_decode(tq, tkv, tl, q_scale=Q_SCALE, return_lse=True)
    want_o, want_l = gqadrv.gqa_decode(tq, tkv, tl, q_scale=Q_SCALE, return_lse=True)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l) and lse.shape == (2, 3, 8)
    det = gt.gqa_decode(tq, tkv, tl, q_scale=Q_SCALE, deterministic=True)
    assert det.shape == tq.shape and torch.equal(det, gt.gqa_decode(tq, tkv, tl, q_scale=Q_SCALE, deterministic=True))
    compiled, graphs, counters = graph_breaks_and_graphs(
        lambda q, kv, l: gt.gqa_decode(q, kv, l, q_scale=Q_SCALE, return_lse=True))
    co, cl = compiled(tq, tkv, tl)
    assert torch.equal(co, out) and torch.equal(cl, lse)
    assert not counters["graph_break"] and len(graphs) == 1


def test_merge_ops_vs_oracle_and_compiled():
    v, s, rv, rs = merge_inputs(23)
    tv, ts = dev(v), dev(s)
    mv, ms = gt.merge_states(tv, ts)
    assert mv.shape == (6, 4, 64) and ms.dtype == torch.float32
    assert np.abs(host(mv) - rv).max() < 5e-3 and np.abs(host(ms) - rs).max() < 1e-4
    pv, ps = gt.merge_state(tv[:, 0], ts[:, 0], tv[:, 1], ts[:, 1])
    import gqadrv

    wv, ws = gqadrv.merge_state(tv[:, 0].contiguous(), ts[:, 0].contiguous(), tv[:, 1].contiguous(),
                                ts[:, 1].contiguous())
    assert torch.equal(pv, wv) and torch.equal(ps, ws)
    compiled, graphs, counters = graph_breaks_and_graphs(lambda v, s: gt.merge_states(v, s))
    cv, cs = compiled(tv, ts)
    assert torch.equal(cv, mv) and torch.equal(cs, ms)
    assert not counters["graph_break"] and len(graphs) == 1


def test_opcheck_new_registrations():
    q, kc, vc, bt = paged_inputs(24)
    torch.library.opcheck(torch.ops.gqadrv.gqa_decode_paged.default,
                          (dev(q), dev(kc), dev(vc), dev(bt), lens(PAGED_LENGTHS[1]), "NHD", Q_SCALE, None, False,
                           None, None))
    rng = np.random.default_rng(25)
    cq = rng.standard_normal((2, 2, 8, 64)).astype(np.float16)
    ckv = rng.standard_normal((2, 2, 2, 100, 64)).astype(np.float16)
    torch.library.opcheck(torch.ops.gqadrv.gqa_decode_lse.default,
                          (dev(cq), dev(ckv), lens([100, 3]), Q_SCALE, None, False, None))
    v, s, _, _ = merge_inputs(26)
    torch.library.opcheck(torch.ops.gqadrv.merge_states.default, (dev(v), dev(s)))
    torch.library.opcheck(torch.ops.gqadrv.merge_state.default,
                          (dev(v[:, 0]), dev(s[:, 0]), dev(v[:, 1]), dev(s[:, 1])))


def test_paged_cuda_graph_replays_with_changed_lengths():
    q, kc, vc, bt = paged_inputs(27)
    tq, tk, tv, tb, tl = dev(q), dev(kc), dev(vc), dev(bt), lens(PAGED_LENGTHS[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gt.gqa_decode_paged(tq, tk, tv, tb, tl, q_scale=Q_SCALE, return_lse=True)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = gt.gqa_decode_paged(tq, tk, tv, tb, tl, q_scale=Q_SCALE, return_lse=True)
    for lengths in PAGED_LENGTHS[1:] + PAGED_LENGTHS[:1]:
        tl.copy_(lens(lengths))
        g.replay()
        torch.cuda.synchronize()
        check_paged(host(out), host(lse), paged_ref(q, kc, vc, bt, lengths, Q_SCALE), f"torch graph {lengths}")


def test_fp8_paged_compiled_and_graph_follow_scales_and_lengths():
    """uint8 e4m3 pages with kv_dtype='e4m3' and per-head scale tensors: eager = compiled (no graph
    break) = oracle on the dequantized cache; a torch.cuda.graph replay follows in-place updates of
    the lengths and of the V scales."""
    q, k8, v8, bt, ks, vs, kd, vd = fp8_paged_inputs(41)
    tq, tk, tv, tb, tl = dev(q), dev(k8), dev(v8), dev(bt), lens(PAGED_LENGTHS[0])
    tks, tvs = dev(ks), dev(vs)

    def step(q, k, v, b, l, ksc, vsc):
        return gt.gqa_decode_paged(q, k, v, b, l, q_scale=Q_SCALE, return_lse=True, kv_dtype="e4m3",
                                   k_scale=ksc, v_scale=vsc)

    compiled, graphs, counters = graph_breaks_and_graphs(step)
    for lengths in PAGED_LENGTHS:
        tl.copy_(lens(lengths))
        eo, el = step(tq, tk, tv, tb, tl, tks, tvs)
        co, cl = compiled(tq, tk, tv, tb, tl, tks, tvs)
        ref = paged_ref(q, kd, vd, bt, lengths, Q_SCALE)
        check_paged(host(eo), host(el), ref, "torch fp8 paged eager")
        assert torch.equal(co, eo) and torch.equal(cl, el)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1
    # float8_e4m3fn pages (no kv_dtype) and host-number scales give the same output
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:
        o8, _ = gt.gqa_decode_paged(tq, tk.view(f8), tv.view(f8), tb, tl, q_scale=Q_SCALE, return_lse=True,
                                    k_scale=tks, v_scale=tvs)
        assert torch.equal(o8, eo)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(tq, tk, tv, tb, tl, tks, tvs)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        out, lse = step(tq, tk, tv, tb, tl, tks, tvs)
    for i, lengths in enumerate(PAGED_LENGTHS):
        tl.copy_(lens(lengths))
        new_vs = vs * (1.0 + i)
        tvs.copy_(dev(new_vs))
        g.replay()
        torch.cuda.synchronize()
        ref = paged_ref(q, kd, vd / vs[:, None] * new_vs[:, None], bt, lengths, Q_SCALE)
        check_paged(host(out), host(lse), ref, f"torch fp8 graph {lengths}")
