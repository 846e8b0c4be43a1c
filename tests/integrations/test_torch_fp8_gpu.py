"""gqadrv.torch FP8 ops on the GPU: quantize_kv_fp8 (computed, numeric, device and per-head scales),
quantize_k_cache / dequantize_k_cache and flash_mla_with_kvcache(is_fp8_kvcache=True). Eager custom
ops equal the plain gqadrv calls on the same tensors bit for bit, torch.compile(fullgraph=True) gives
the same bits in one graph without breaks, torch.library.opcheck passes, and the FP8 MLA decode of a
cache built by the wrapper equals the bf16 decode of its dequantization bit for bit (seesaw_fp8 vs
seesaw, same num_splits), and the float64 oracle on that cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integrations.cases import MLA_LENGTHS, check_mla, mla_inputs, mla_ref

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
gt = pytest.importorskip("gqadrv.torch")  # skips where torch < 2.4

MLA_SCALE = 0.05
SPLITS = 2


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def dev(a: np.ndarray) -> torch.Tensor:
    """Host array (bf16 from ml_dtypes included) -> CUDA tensor of the same dtype."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN payloads compare equal, -0 != +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def compile_counting(fn):
    """torch.compile(fullgraph=True) with Inductor, recording each graph it is given; Dynamo's
    counters cleared (counters['graph_break'] must stay empty)."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend), graphs, counters


def op_names(gm) -> set[str]:
    return {str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"}


def kv_input(seed: int = 51) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return dev((rng.standard_normal((3, 40, 4, 64)) * 3).astype(np.float16))   # [tokens..., Hkv, D]


def scale_case(mode: str):
    f32 = dict(dtype=torch.float32, device="cuda")
    return {"computed": (None, None), "value": (0.05, None), "tensor": (torch.tensor([0.03], **f32), None),
            "head": (torch.tensor([0.01, 0.02, 0.03, 0.04], **f32), -2)}[mode]


# ----------------------------------------------------------------------------- FP8 KV quantizer
@pytest.mark.parametrize("mode", ["computed", "value", "tensor", "head"])
def test_quantize_kv_fp8_equals_library_eager_and_compiled(mode):
    import gqadrv

    x = kv_input()
    scale, axis = scale_case(mode)
    codes, s = gt.quantize_kv_fp8(x, scale, head_axis=axis)
    want_c, want_s = gqadrv.quantize_kv_fp8(x, scale, head_axis=axis)
    torch.cuda.synchronize()
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and torch.equal(codes, want_c)
    assert s.dtype == torch.float32 and s.device == x.device
    if mode == "computed":
        assert s.shape == () and same_bits(s, want_s)
    elif mode == "value":
        assert s.shape == () and s.item() == want_s == float(np.float32(0.05))
    else:
        assert torch.equal(s, scale) and s.data_ptr() != scale.data_ptr()   # a copy, not the input
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:
        assert codes.view(f8).shape == x.shape

    if scale is None or isinstance(scale, float):
        compiled, graphs, counters = compile_counting(lambda x: gt.quantize_kv_fp8(x, scale))
        cc, cs = compiled(x)
    else:
        compiled, graphs, counters = compile_counting(lambda x, s: gt.quantize_kv_fp8(x, s, head_axis=axis))
        cc, cs = compiled(x, scale)
    assert torch.equal(cc, codes) and same_bits(cs, s)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1 and "gqadrv.quantize_kv_fp8" in op_names(graphs[0])


# ----------------------------------------------------------------------------- FP8 MLA cache
def bf16_cache(seed: int = 52, nb: int = 6, page: int = 16) -> torch.Tensor:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    k = rng.standard_normal((nb, page, 1, 576)).astype(np.float32)
    k *= np.float32(2.0) ** rng.integers(-8, 6, size=(nb, page, 1, 1)).astype(np.float32)   # tile scales vary
    return dev(k.astype(ml_dtypes.bfloat16))


def test_k_cache_ops_equal_library_eager_and_compiled():
    import gqadrv

    k = bf16_cache()
    k8 = gt.quantize_k_cache(k)
    want8 = gqadrv.quantize_k_cache(k)
    back = gt.dequantize_k_cache(k8)
    want_back = gqadrv.dequantize_k_cache(want8)
    torch.cuda.synchronize()
    assert k8.dtype == torch.uint8 and k8.shape == (6, 16, 1, 656) and torch.equal(k8, want8)
    assert back.dtype == torch.bfloat16 and back.shape == (6, 16, 1, 576) and same_bits(back, want_back)
    views = [k8.view(torch.int8)] + ([k8.view(torch.float8_e4m3fn)] if hasattr(torch, "float8_e4m3fn") else [])
    for v in views:
        assert same_bits(gt.dequantize_k_cache(v), back), v.dtype

    def roundtrip(k):
        k8 = gt.quantize_k_cache(k)
        return k8, gt.dequantize_k_cache(k8)

    compiled, graphs, counters = compile_counting(roundtrip)
    c8, cback = compiled(k)
    assert torch.equal(c8, k8) and same_bits(cback, back)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1 and {"gqadrv.quantize_k_cache", "gqadrv.dequantize_k_cache"} <= op_names(graphs[0])


# ----------------------------------------------------------------------------- FP8 MLA decode
def mla_fp8_step(q, k8, bt, lens):
    return gt.flash_mla_with_kvcache(q, k8, bt, lens, 512, None, SPLITS, MLA_SCALE, True, True, backend="seesaw_fp8")


def mla_bf16_step(q, k, bt, lens):
    return gt.flash_mla_with_kvcache(q, k, bt, lens, 512, None, SPLITS, MLA_SCALE, True, backend="seesaw")


def host_bf16(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def test_fp8_mla_equals_bf16_on_dequantized_cache_eager_and_compiled():
    q, k, bt = mla_inputs(53)
    tq, tk, tbt = dev(q), dev(k), torch.from_numpy(bt).cuda()
    tl = torch.tensor(MLA_LENGTHS[0], dtype=torch.int32, device="cuda")
    k8 = gt.quantize_k_cache(tk)
    kdq = gt.dequantize_k_cache(k8)
    compiled, graphs, counters = compile_counting(mla_fp8_step)
    kdq_host = host_bf16(kdq)
    for lengths in MLA_LENGTHS:   # lengths change in place: one graph serves them all
        tl.copy_(torch.tensor(lengths, dtype=torch.int32))
        o8, l8 = mla_fp8_step(tq, k8, tbt, tl)
        o16, l16 = mla_bf16_step(tq, kdq, tbt, tl)
        co, cl = compiled(tq, k8, tbt, tl)
        torch.cuda.synchronize()
        assert o8.dtype == torch.bfloat16 and o8.shape == (2, 2, 16, 512) and l8.shape == (2, 16, 2)
        assert same_bits(o8, o16) and same_bits(l8, l16), f"fp8 != bf16 on the dequantized cache, lengths {lengths}"
        assert same_bits(co, o8) and same_bits(cl, l8)
        check_mla(o8.float().cpu().numpy(), l8.cpu().numpy(), mla_ref(q, kdq_host, bt, lengths, MLA_SCALE, True),
                  "bfloat16", f"torch fp8 mla {lengths}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs) == 1 and "gqadrv.flash_mla_with_kvcache" in op_names(graphs[0])
    if hasattr(torch, "float8_e4m3fn"):   # FlashMLA's float8 spelling of the same bytes
        o, lse = mla_fp8_step(tq, k8.view(torch.float8_e4m3fn), tbt, tl)
        assert same_bits(o, o8) and same_bits(lse, l8)


def test_opcheck_fp8_registrations():
    """torch's checks of each registration: schema, fake impl = real metadata, AOT dispatch with dynamic
    shapes, autograd registration; for each scale form of quantize_kv_fp8 and the FP8 MLA decode."""
    x = kv_input(54)
    for mode in ("computed", "value", "tensor", "head"):
        scale, axis = scale_case(mode)
        args = (x, scale, None, axis) if isinstance(scale, torch.Tensor) else (x, None, scale, None)
        torch.library.opcheck(torch.ops.gqadrv.quantize_kv_fp8.default, args)
    k = bf16_cache(55, nb=3)
    torch.library.opcheck(torch.ops.gqadrv.quantize_k_cache.default, (k,))
    k8 = gt.quantize_k_cache(k)
    torch.library.opcheck(torch.ops.gqadrv.dequantize_k_cache.default, (k8,))
    q, kb, bt = mla_inputs(56)
    tq, tbt = dev(q), torch.from_numpy(bt).cuda()
    tl = torch.tensor(MLA_LENGTHS[2], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.gqadrv.flash_mla_with_kvcache.default,
                          (tq, gt.quantize_k_cache(dev(kb)), tbt, tl, 512, None, MLA_SCALE, True, None, True))


def test_fp8_ops_in_a_cuda_graph_follow_in_place_inputs():
    """quantize_kv_fp8 (computed scale: memset, amax, quantize) and the cache round trip captured by
    torch.cuda.graph after a side-stream warm-up; a replay after in-place input updates equals eager
    calls on the new inputs."""
    x, k = kv_input(57), bf16_cache(58)

    def step(x, k):
        codes, s = gt.quantize_kv_fp8(x)
        k8 = gt.quantize_k_cache(k)
        return codes, s, k8, gt.dequantize_k_cache(k8)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x, k)   # loads the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step(x, k)
    x.copy_(kv_input(59) * 0.25)
    k.copy_(bf16_cache(60))
    for o in outs:
        bits(o).fill_(0x7F)   # the replay must write every byte
    g.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step(x, k)):
        assert same_bits(got, want)
