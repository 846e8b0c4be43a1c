"""MLA host side without a GPU: contract, argument-block layout, routes, static compile checks,
the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.mla import contract, kernel_spec, routes
from gqadrv.mla.reference import _self_check
from gqadrv.ops.registry import FeatureError
from tests.fakes import FakeCudaArray, fake
from tests.mla.cases import grid

B, SQ, HQ, HKV, PAGE, NB, MB = 2, 1, 16, 1, 64, 8, 4


def good(**over):
    t = dict(q=fake((B, SQ, HQ, 576)), k=fake((NB, PAGE, HKV, 576)), bt=fake((B, MB), np.int32),
             lens=fake((B,), np.int32), dv=512, scale=None, causal=False)
    t.update(over)
    return t


def run(t):
    return contract.validate(t["q"], t["k"], t["bt"], t["lens"], t["dv"], t["scale"], t["causal"], stream=None)


def test_valid_problem():
    p = run(good())
    assert (p.b, p.s_q, p.h_q, p.h_kv, p.group, p.page_size, p.max_blocks, p.capacity) == (B, 1, HQ, 1, 16, 64, MB, 256)
    assert abs(p.softmax_scale - 576 ** -0.5) < 1e-15


@pytest.mark.parametrize("over,exc,msg", [
    (dict(q=fake((B, HQ, 576))), ValueError, "q must have shape"),
    (dict(q=fake((B, SQ, HQ, 512))), ValueError, "q head dim must be 576"),
    (dict(q=fake((B, SQ, HQ, 576), np.float32)), TypeError, "q must have dtype"),
    (dict(q=fake((B, SQ, 129, 576))), ValueError, "h_q must be in"),
    (dict(q=fake((B, SQ, 3, 576)), k=fake((NB, PAGE, 2, 576))), ValueError, "multiple of h_kv"),
    (dict(k=fake((NB, 48, HKV, 576))), ValueError, "page_size"),
    (dict(k=fake((NB, PAGE, 9, 576))), ValueError, "h_kv"),
    (dict(k=fake((NB, PAGE, HKV, 576), np.float32)), TypeError, "k_cache must have the dtype of q"),
    (dict(k=FakeCudaArray(np.zeros((NB, PAGE, HKV, 580), np.float16)[..., :576])), ValueError, "multiples of 8"),
    (dict(q=FakeCudaArray(np.zeros((B, SQ, HQ, 1152), np.float16)[..., ::2])), ValueError, "contiguous last"),
    (dict(bt=fake((B, MB), np.int64)), TypeError, "block_table must have dtype int32"),
    (dict(bt=fake((B + 1, MB), np.int32)), ValueError, "block_table must have shape"),
    (dict(lens=fake((B,), np.int64)), TypeError, "cache_seqlens must have dtype int32"),
    (dict(lens=fake((B + 1,), np.int32)), ValueError, "cache_seqlens must have shape"),
    (dict(dv=576), ValueError, "head_dim_v must be 512"),
    (dict(scale=0.0), ValueError, "softmax_scale"),
    (dict(scale=float("nan")), ValueError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(k=fake((NB, PAGE, HKV, 576), device=1)), ValueError, "share one device"),
])
def test_contract_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        run(good(**over))


def test_sparse_arguments_without_indices_raise_before_any_gpu_work():
    """attn_sink / extra pool / topk_length belong to the sparse path: without indices they are a
    ValueError raised before the driver is touched (so this runs without a GPU)."""
    import gqadrv

    for kw in (dict(attn_sink=1), dict(extra_k_cache=1), dict(topk_length=1), dict(extra_indices_in_kvcache=1),
               dict(is_fp8_kvcache=True, extra_topk_length=1)):
        with pytest.raises(ValueError, match="sparse MLA path: pass indices"):
            gqadrv.flash_mla_with_kvcache(None, None, None, None, 512, None, **kw)
        with pytest.raises(ValueError, match="sparse MLA path: pass indices"):
            gqadrv.prepare_mla_decode(None, None, None, None, 512, **kw)
    with pytest.raises(ValueError, match="needs block_table and cache_seqlens"):
        gqadrv.flash_mla_with_kvcache(None, None)
    assert issubclass(FeatureError, NotImplementedError)


def test_argument_block_layout_matches_the_header():
    from gqadrv.mla.args import MLA_ARGS
    from gqadrv.runtime.compiler import kernels_root
    from tests.helpers import c_struct_fields, python_struct_fields

    text = (kernels_root() / "mla" / "common" / "args.cuh").read_text()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "MlaDecodeArgs")]
    assert c == python_struct_fields(MLA_ARGS)
    assert MLA_ARGS.size == kernel_spec.ARGS_BYTES


def test_narrow_routes_follow_the_dram_bandwidth_per_sm():
    """narrow_preferred: the narrow kernels serve M <= 16 from 30 GB/s of datasheet DRAM bandwidth per SM
    (H200: 2 x 3201 MHz x 6144 bit / 132 SMs = 37 GB/s), the seesaw below (H100 SXM: 2 x 2619 MHz x
    5120 bit / 132 = 25 GB/s); an unknown bandwidth keeps the narrow routes. DeviceInfo derives the
    bandwidth from the two driver attributes."""
    from gqadrv.runtime.driver import DeviceInfo

    def info(clock_khz, bits, sms=132):
        return DeviceInfo(0, "x", (9, 0), sms, 232448, 50 << 20, 80 << 30, clock_khz, bits)

    h200, h100 = info(3201000, 6144), info(2619000, 5120)
    assert abs(h200.peak_dram_bytes_per_s - 4.917e12) < 1e9 and abs(h100.peak_dram_bytes_per_s - 3.352e12) < 1e9
    assert routes.narrow_preferred(h200.peak_dram_bytes_per_s, h200.sm_count)
    assert not routes.narrow_preferred(h100.peak_dram_bytes_per_s, h100.sm_count)
    assert info(0, 0).peak_dram_bytes_per_s is None and routes.narrow_preferred(None, 132)
    assert routes.narrow_preferred(3.352e12, 78)  # fewer SMs, same memory: 43 GB/s per SM


def test_routes():
    assert routes.select_variant((9, 0), "bfloat16", 128).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 16).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 128, None, True).family.name == "seesaw_tma"
    assert routes.select_variant((9, 0), "bfloat16", 128, "seesaw", True).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 16, "narrow16_tma", True).family.name == "narrow16_tma"
    # M <= 16 on a TMA-describable cache: the two-warpgroup narrow kernel (balanced grid for large batches)
    assert routes.select_variant((9, 0), "bfloat16", 16, None, True).family.name == "narrow16x2_tma"
    assert routes.select_variant((9, 0), "float16", 8, None, True, large_batch=True).family.name == "narrow16_bal"
    assert routes.select_variant((9, 0), "bfloat16", 17, None, True, large_batch=True).family.name == "seesaw_bal"
    # GPUs with less DRAM bandwidth per SM (the H100): M <= 16 on the seesaw routes too, unless forced
    assert routes.select_variant((9, 0), "bfloat16", 16, None, True, narrow_ok=False).family.name == "seesaw_tma"
    assert routes.select_variant((9, 0), "float16", 8, None, True, large_batch=True,
                                 narrow_ok=False).family.name == "seesaw_bal"
    assert routes.select_variant((9, 0), "bfloat16", 16, "narrow16_bal", True, narrow_ok=False).family.name == "narrow16_bal"
    assert routes.select_variant((9, 0), "bfloat16", 16, None, False, narrow_ok=False).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 16, None, True, fp8=True, narrow_ok=False).family.name == "narrow16_fp8"
    with pytest.raises(ValueError, match="at most 16"):
        routes.select_variant((9, 0), "bfloat16", 17, "narrow16_bal", True)
    # no tensor map (pages of 1..32, the sparse lists): the cp.async seesaw, on the balanced grid at large batch
    assert routes.select_variant((9, 0), "bfloat16", 128, None, False, large_batch=True).family.name == "seesaw_bal_cp"
    assert routes.select_variant((9, 0), "bfloat16", 8, None, False, large_batch=True).family.name == "seesaw_bal_cp"
    assert routes.select_variant((9, 0), "bfloat16", 64, None, False, nope=True, large_batch=True).family.name == \
        "seesaw_nope_bal"
    assert routes.select_variant((9, 0), "bfloat16", 64, None, False, nope=True).family.name == "seesaw_nope"
    assert routes.select_variant((9, 0), "bfloat16", 64, "seesaw", False, large_batch=True).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 64, "seesaw_bal_cp", False, nope=True).family.name == \
        "seesaw_nope_bal"
    with pytest.raises(ValueError, match="d_qk 512 is served by"):
        routes.select_variant((9, 0), "bfloat16", 64, "wgmma", False, nope=True)
    ws = kernel_spec.workspace_sizes(4096, 1, 64, 1, 132, "seesaw_bal_cp")
    assert ws["ws_o"] == (132 + 4096) * 64 * 512 * 4  # cut requests: P + b partial slots per group
    ws = kernel_spec.workspace_sizes(4096, 1, 64, 1, 132, "seesaw_bal_cp", no_cut=True)
    assert ws["ws_o"] == ws["ws_ml"] == 0 and ws["counters"] == 4 * 4096
    assert kernel_spec.workspace_sizes(8, 1, 64, 1, 3, "seesaw", no_cut=True)["ws_o"] > 0  # split grids: unaffected
    with pytest.raises(ValueError, match="TMA-describable"):
        routes.select_variant((9, 0), "bfloat16", 128, "seesaw_tma", False)
    ks = kernel_spec
    assert ks.tma_eligible(64, 256, (73728, 1152, 576), 10) and not ks.tma_eligible(32, 256, (36864, 1152, 576), 10)
    assert not ks.tma_eligible(64, 8, (73728, 1152, 576), 10)  # base not 16-byte aligned
    assert not ks.tma_eligible(64, 256, (73728, 1156, 578), 10)  # strides not multiples of 16 bytes
    maps = ks.k_tensor_maps(64, 2, 10, (147456, 1152, 576))
    assert [m["box"] for m in maps] == [(64, 64, 4, 1, 1), (64, 64, 5, 1, 1)]
    assert maps[0]["dims"] == (64, 64, 9, 2, 10) and maps[0]["strides"] == (2304, 128, 1152, 294912)
    assert routes.select_variant((9, 0), "float16", 16, "mma").family.name == "mma"
    assert routes.select_variant((9, 0), "float16", 16, "narrow16").family.name == "narrow16"
    assert routes.select_variant((10, 0), "bfloat16", 128).family.name == "mma"
    assert routes.select_variant((11, 0), "bfloat16", 1).family.name == "mma"
    with pytest.raises(ValueError, match="at most 16 query rows"):
        routes.select_variant((9, 0), "bfloat16", 17, "narrow16")
    with pytest.raises(RuntimeError, match="not built for sm_100a"):
        routes.select_variant((10, 0), "bfloat16", 64, "seesaw")
    with pytest.raises(RuntimeError, match="compute capability 9.0, 10.0 or 11.0"):
        routes.select_variant((8, 0), "bfloat16", 64)
    with pytest.raises(TypeError, match="backend"):
        routes.select_variant((9, 0), "bfloat16", 64, 3)
    for arch in ("sm_90a", "sm_100a"):
        assert routes.variants_for_arch(arch)
    assert all(v.dynamic_smem <= 232448 for v in routes.variants_for_arch("sm_90a"))


@pytest.mark.parametrize("variant", routes.variants_for_arch("sm_90a") + routes.variants_for_arch("sm_100a"),
                         ids=lambda v: v.name)
def test_every_variant_compiles_without_spills(variant, isolated_cache):
    from gqadrv.runtime.compiler import compile_module

    for arch in variant.family.arches:
        m = compile_module(variant.family.source, arch, variant.defines, cache=isolated_cache)
        r = m.resources[variant.family.entry]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (arch, r)
        ptx = m.ptx.decode()
        assert "atom.acq_rel.gpu" in ptx or "atom.add.acq_rel.gpu" in ptx or "acq_rel" in ptx
        if variant.family.name in ("mma", "mma_fp8", "mma_nope"):
            assert "mma.sync" in ptx and "wgmma" not in ptx
        else:
            assert "wgmma.mma_async" in ptx


def test_oracle_against_direct_loop():
    _self_check(3)


def test_grid_covers_the_axes():
    cases = grid()
    assert len(cases) >= 300
    assert {c.b for c in cases} == {1, 2, 37, 128} and {c.s_q for c in cases} == {1, 2, 4}
    assert {c.h_q for c in cases} >= {1, 3, 16, 63, 64, 128} and {c.h_kv for c in cases} == {1, 2}
    assert {c.page for c in cases} == {1, 16, 32, 64, 128, 256} and {c.causal for c in cases} == {True, False}
    assert {c.lengths for c in cases} == {"0", "1", "63", "64", "65", "4096", "ragged"}
    assert {c.dtype for c in cases} == {"bfloat16", "float16"}
    assert {c.backend for c in cases} == {None, "seesaw", "mma", "wgmma", "narrow16", "narrow32", "narrow16_tma",
                                          "narrow32_tma", "narrow16x2_tma", "narrow16_bal"}
    # the default route on the H200 is a TMA kernel for pages >= 64 and the cp.async seesaw below
    assert {c.page for c in cases if c.backend is None} == {1, 16, 32, 64, 128, 256}


def test_layout_and_barrier_protocol_models():
    """tools/mla_dev_check.py's CPU models: every copy / descriptor / fragment of the seesaw and
    narrow kernels lands where the math expects, and the seesaw, seesaw_tma (half-tile barriers,
    tail zeroing), seesaw_bal (items: K phases over the CTA's pairs, q / q_empty, sM reset, merge
    weights after the last item), narrow, narrow2 (two consumer warpgroups over work items, the
    O^T hand-off through the Q region) and narrow16_fp8 (two consumer warpgroups on a stage ring,
    four producer warps, tail zeroing) barrier protocols run random interleavings without a hazard or
    a deadlock."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "mla_dev_check.py"
    spec = importlib.util.spec_from_file_location("mla_dev_check_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    problems = mod.layout_model_seesaw() + mod.layout_model_narrow(16) + mod.protocol_model(seeds=12)
    assert problems == []
    # the FP8 narrow ring catches injected protocol bugs
    for bug, msg in (("early_release", "in flight"), ("no_release", "deadlock"), ("parity", "holds")):
        with pytest.raises(mod.ModelError, match=msg):
            for seed in range(8):
                mod.narrow_fp8_model(9, 4, seed, True, bug)
    # ... and so does the two-warpgroup bf16 narrow protocol (the hand-off through the Q region)
    for bug, msg in (("no_first_barrier", "in-flight wgmma group|holds"), ("parity", "holds"),
                     ("early_q_empty", "holds|in flight")):
        with pytest.raises(mod.ModelError, match=msg):
            for seed in range(16):
                for items in ([(3, False), (3, False), (3, True)], [(1, False), (1, True), (2, False)]):
                    mod.narrow2_model(items, 18, seed, bug)
    # ... and so does the FP8 wide protocol (half stages, the V tile, the tile's closing barrier)
    for bug, msg in (("early_release", "in flight|holds"), ("parity", "holds"), ("no_end_barrier", "in-flight wgmma group|holds"),
                     ("own_wait_only", "in flight|holds")):
        with pytest.raises(mod.ModelError, match=msg):
            for seed in range(16):
                mod.wide_fp8_model(6, 3, seed, True, bug)
    # the model can fail: a consumer write to a K block that a wgmma group still reads is reported
    with pytest.raises(mod.ModelError, match="in-flight wgmma group"):
        m = mod.Machine(mod.random.Random(0))
        m.gemm("wg0", [(("K", 0, 0), None)], "qk")
        m.write(("K", 0, 0), "zero", "early zero")


def test_launch_parts_of_a_cp_async_route():
    """plan.launch_parts (shared by the prepared and the convenience launch): the variant's grid,
    block and smem, and the argument block as args_fields builds it (non-TMA family: no tensor map)."""
    from gqadrv.mla import plan

    p = run(good())
    v = routes.select_variant((9, 0), "float16", p.m_rows, "seesaw")
    grid, block, smem, values = plan.launch_parts(p, v, out_strides=(HQ * 512, HQ * 512, 512), out_ptr=0x1000,
                                                  lse_ptr=0x2000, ws=None, splits=3)
    assert (grid, block, smem) == kernel_spec.launch_geometry(B, SQ, HQ, HKV, 3, "seesaw")
    assert values == (plan.args_fields(p, v, (HQ * 512, HQ * 512, 512), 0x1000, 0x2000, None, 3),)
    assert values[0]["num_splits"] == 3 and values[0]["out"] == 0x1000 and values[0]["lse"] == 0x2000


def test_fp8_cache_routes():
    """is_fp8_kvcache=True routes to the FP8 builds (narrow16_fp8 for M <= 16 and wide64_fp8 above on sm_90,
    mma_fp8 on sm_100 / sm_110),
    FP8 and bf16 backends never cross, and the FP8 families build for bf16 q only."""
    from gqadrv.mla import kernel_spec, routes

    assert routes.select_variant((9, 0), "bfloat16", 16, None, True, fp8=True).family.name == "narrow16_fp8"
    assert routes.select_variant((9, 0), "bfloat16", 17, None, True, fp8=True).family.name == "wide64_fp8"
    assert routes.select_variant((9, 0), "bfloat16", 256, "auto", False, fp8=True).family.name == "wide64_fp8"
    assert routes.select_variant((9, 0), "bfloat16", 8, "wide64_fp8", False, fp8=True).family.name == "wide64_fp8"
    assert routes.select_variant((9, 0), "bfloat16", 16, "seesaw_fp8", True, fp8=True).family.name == "seesaw_fp8"
    assert routes.select_variant((10, 0), "bfloat16", 128, "auto", False, fp8=True).family.name == "mma_fp8"
    assert routes.select_variant((11, 0), "bfloat16", 1, None, False, fp8=True).family.name == "mma_fp8"
    assert routes.select_variant((9, 0), "bfloat16", 64, "mma_fp8", False, fp8=True).family.name == "mma_fp8"
    with pytest.raises(ValueError, match="reads bf16 / fp16 caches"):
        routes.select_variant((9, 0), "bfloat16", 64, "seesaw_tma", True, fp8=True)
    with pytest.raises(ValueError, match="pass is_fp8_kvcache=True"):
        routes.select_variant((9, 0), "bfloat16", 64, "seesaw_fp8", True)
    with pytest.raises(ValueError, match="bfloat16 q only"):
        kernel_spec.kernel("seesaw_fp8").defines("float16")
    fp8 = {v.name for v in routes.variants_for_arch("sm_90a") if v.family.fp8}
    assert fp8 == {"mla_decode_seesaw_fp8_bfloat16", "mla_decode_mma_fp8_bfloat16", "mla_decode_narrow16_fp8_bfloat16",
                   "mla_decode_wide64_fp8_bfloat16"}
    assert routes.select_variant((9, 0), "bfloat16", 16, "narrow16_fp8", False, fp8=True).family.name == "narrow16_fp8"
    with pytest.raises(ValueError, match="at most 16 query rows"):
        routes.select_variant((9, 0), "bfloat16", 17, "narrow16_fp8", False, fp8=True)
    assert {v.name for v in routes.variants_for_arch("sm_100a") if v.family.fp8} == {"mla_decode_mma_fp8_bfloat16"}
    assert all("fp8_kv" in f.features for f in routes.FAMILIES.values() if f.fp8)


def test_fp8_seesaw_register_budgets_fit_the_launch_allocation():
    """setmaxnreg.inc waits for free registers: the consumer and producer budgets of every seesaw build
    must fit 384 threads x 168 registers (216 / 80 deadlocked on the H200)."""
    from gqadrv.runtime.compiler import kernels_root

    text = (kernels_root() / "mla/sm90/dense_decode_seesaw.cu").read_text()
    assert "#define MLA_CONSUMER_REGS (MLA_FP8 ? 216 : 224)" in text
    assert "#define MLA_PRODUCER_REGS (MLA_FP8 ? 72 : 56)" in text
    for c, p in ((216, 72), (224, 56)):
        assert 256 * c + 128 * p <= 384 * 168
    assert "<= 384 * 168" in text


def test_mla_fp8_bench_table_and_targets():
    from gqadrv.mla import bench_fp8

    def row(h, f, g):
        r = {"gqadrv_fp8": {"hot_us": f, "cold_us": f, "hot_TFLOPS": 1.0, "hot_TBps": 1.0, "route": "r",
                            "num_splits": 1, "max_diff_vs_bf16": 1e-4},
             "gqadrv_bf16": {"hot_us": g, "cold_us": g, "hot_TFLOPS": 2.0, "hot_TBps": 2.0}}
        return {"shape": f"b128 s_q1 h_q{h} L4096", "b": 128, "s_q": 1, "h_q": h, "L": 4096, "results": r}

    rows = [row(16, 100.0, 180.0), row(128, 100.0, 50.0), row(64, 1.0, 1.0)]
    lines = bench_fp8.target_lines(rows)
    assert lines[1] == "- h_q 16: fp8 speed >= 1.7 x our bf16: 1/1 rows"
    assert lines[2].startswith("- h_q 128: fp8 TFLOPS >= 90 % of our bf16 (x bf16 >= 0.9): 0/1 rows; missed: "
                               "b128 s_q1 h_q128 L4096 (0.50 / 0.50)")
    meta = {"gpu": "G", "cc": "9.0", "sms": 132, "ceiling_TBps": 4.5, "graph_calls": 20}
    table = bench_fp8.format_table(meta, rows + [{"shape": "bad", "h_q": 16, "results": {"gqadrv_fp8": {"error": "E"}}}])
    assert "| b128 s_q1 h_q16 L4096 | 100.0 |" in table and "1.80 / 1.80" in table and "| bad | error: E |" in table
    assert [r[:3] for r in bench_fp8.ROWS][:1] == [(128, 1, 16)]


def test_fp8_cache_contract():
    """The FP8-cache rules (contract._fp8_cache) on fake arrays; numpy's DLPack has no bf16, so the
    q-dtype rule is checked with an fp16 q and the cache rules with a stand-in bf16 q view."""
    import types

    from gqadrv.runtime.tensors import as_view

    def v(a):
        return as_view(a, "k_cache", stream=None)

    q16 = types.SimpleNamespace(dtype="bfloat16")
    assert contract._fp8_cache(v(fake((NB, PAGE, HKV, 656), np.uint8)), q16) == (NB, PAGE, HKV)
    assert contract._fp8_cache(v(fake((NB, PAGE, HKV, 656), np.int8)), q16) == (NB, PAGE, HKV)
    assert contract._fp8_cache(v(FakeCudaArray(np.zeros((NB, PAGE, HKV, 672), np.uint8)[..., :656])), q16)[0] == NB
    cases = [
        (fake((NB, PAGE, HKV, 576), np.uint8), ValueError, "656 bytes"),
        (fake((NB, PAGE, HKV, 656), np.uint16), TypeError, "uint8 or int8 or float8_e4m3fn"),
        (fake((NB, PAGE, 656), np.uint8), ValueError, "must have shape"),
        (FakeCudaArray(np.zeros((NB, PAGE, HKV, 664), np.uint8)[..., :656]), ValueError, "multiples of 16"),
    ]
    for k, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            contract._fp8_cache(v(k), q16)
    t = good(k=fake((NB, PAGE, HKV, 656), np.uint8))
    args = (t["q"], t["k"], t["bt"], t["lens"], 512, None, False)
    with pytest.raises(TypeError, match="bfloat16 q"):
        contract.validate(*args, stream=None, is_fp8_kvcache=True)
    with pytest.raises(TypeError, match="is_fp8_kvcache must be a bool"):
        contract.validate(*args, stream=None, is_fp8_kvcache=1)
    with pytest.raises(TypeError, match="pass is_fp8_kvcache=True"):
        contract.validate(*args, stream=None)


def test_max_logits_launches_track_the_exact_max_beside_the_lazy_one():
    """The seesaw's lazy running max (MLA_LAZY_LOG2) lets the max lag behind the row's true max. Launches
    that report the max (the sparse prefill's max_logits, MLA_FLAG_MAX_LOGITS, set by plan.args_fields
    whenever a problem has max_offset) keep the lazy max for the softmax but fold every tile's row max into
    an exact one (x_lo / x_hi, both warpgroups, merged through sXM) that the epilogue reports; only items
    whose max_logits come from the split merge's {m, l} (nsplit > 1) run the exact running max
    (exact_max_item). Every update of the running max goes through lazy_max."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "kernels" / "mla" / "sm90" / "dense_decode_seesaw.cu").read_text()
    body = re.search(r"bool exact_max_item\(const MlaDecodeArgs& a, int nsplit\) \{(.*?)\n\}", src, re.S)
    assert body and "MLA_FLAG_MAX_LOGITS" in body.group(1) and "nsplit > 1" in body.group(1)
    lazy = re.search(r"float lazy_max\(bool exact, float m_old, float m_tile\) \{(.*?)\n\}", src, re.S)
    assert lazy and "exact ? 0.f" in lazy.group(1)
    updates = re.findall(r"const float mn_lo = (\w+\(\w+),", src)
    assert updates and set(updates) == {"lazy_max(exact"}, updates
    assert src.count("x_lo = fmaxf(x_lo, mx_lo);") == 2 and src.count("x_hi = fmaxf(x_hi, mx_hi);") == 2
    assert "x_lo = fmaxf(x_lo, sXM[r_lo]);" in src and "L_lo, L_hi, x_lo, x_hi," in src
    util = (Path(__file__).resolve().parents[2] / "kernels" / "mla" / "common" / "decode_util.cuh").read_text()
    assert "rp.L_lo, rp.m_lo, rp.x_lo)" in util and "? x * LN2 : neg_inf()" in util
    plan_src = (Path(__file__).resolve().parents[2] / "gqadrv" / "mla" / "plan.py").read_text()
    assert re.search(r"_ks\.FLAG_MAX_LOGITS if problem\.max_offset is not None", plan_src)


def test_l2_evict_first_experiment_variants(isolated_cache):
    """GQADRV_MLA_EXPERIMENTS=1 registers <variant>_ef for exactly the variants whose K tiles arrive by
    TMA (MLA_K_EVICT_FIRST=1 on top of their defines); their K loads carry an L2 cache policy, the
    default builds' do not."""
    from gqadrv.mla import kernel_spec
    from gqadrv.runtime.compiler import compile_module

    ef = kernel_spec.l2_experiments()
    tma = {k.name for k in kernel_spec.DEFAULT_VARIANTS if k.tma_boxes}
    assert {n[:-3] for n in ef} == tma and {"seesaw_bal", "narrow16_bal"} <= tma
    for name, v in ef.items():
        base = kernel_spec.KERNELS[name[:-3]]
        assert v.fixed_defines == base.fixed_defines + (("MLA_K_EVICT_FIRST", 1),)
        assert (v.source, v.entry, v.smem_bytes, v.tma_boxes) == (base.source, base.entry, base.smem_bytes, base.tma_boxes)
    for name in ("seesaw_bal", "narrow16_bal"):
        for v, hinted in ((kernel_spec.KERNELS[name], False), (ef[name + "_ef"], True)):
            m = compile_module(v.source, "sm_90a", v.defines("bfloat16"), cache=isolated_cache)
            ptx = m.ptx.decode()
            assert ("L2::cache_hint" in ptx and "createpolicy.fractional.L2::evict_first" in ptx) == hinted, name


def test_balanced_variants_keep_partials_in_l2_and_the_experiment_turns_it_off(isolated_cache):
    """The balanced variants build with MLA_PARTIAL_L2=1: their partial stores carry an L2 evict_last
    policy and their merges discard the partials' lines; the split-grid variants do neither.
    GQADRV_MLA_EXPERIMENTS=1 registers <variant>_nopl2 (MLA_PARTIAL_L2=0) for the balanced variants
    and their cut32 schedule experiments: neither hint, otherwise the same build."""
    from gqadrv.mla import kernel_spec
    from gqadrv.runtime.compiler import compile_module

    for v in kernel_spec.DEFAULT_VARIANTS:  # (KERNELS also holds the experiments under GQADRV_MLA_EXPERIMENTS=1)
        assert (("MLA_PARTIAL_L2", 1) in v.fixed_defines) == v.balanced, v.name
    sched = kernel_spec.schedule_experiments()
    off = kernel_spec.partial_l2_experiments(sched)
    assert set(off) == {"seesaw_bal_nopl2", "narrow16_bal_nopl2", "seesaw_bal_cut32_nopl2", "narrow16_bal_cut32_nopl2"}
    for name, v in off.items():
        base = kernel_spec.KERNELS.get(name[:-6]) or sched[name[:-6]]
        assert dict(v.fixed_defines) == dict(base.fixed_defines, MLA_PARTIAL_L2=0), name
        assert (v.source, v.entry, v.smem_bytes, v.balanced) == (base.source, base.entry, base.smem_bytes, True)
    for v, hinted in ((kernel_spec.KERNELS["narrow16_bal"], True), (off["narrow16_bal_cut32_nopl2"], False),
                      (kernel_spec.KERNELS["seesaw_bal"], True), (off["seesaw_bal_nopl2"], False),
                      (kernel_spec.KERNELS["narrow16x2_tma"], False)):
        m = compile_module(v.source, "sm_90a", v.defines("bfloat16"), cache=isolated_cache)
        ptx = m.ptx.decode()
        assert ("createpolicy.fractional.L2::evict_last" in ptx) == hinted, v.name
        assert ("discard.global.L2" in ptx) == hinted, v.name
        r = m.resources[next(iter(m.resources))]
        assert r.spill_stores == 0 and r.spill_loads == 0, (v.name, r)


def test_scale_handoffs_sync_by_default_and_the_arrive_experiments(isolated_cache):
    """The seesaw's scale hand-offs between its consumer warpgroups are full named-barrier syncs by default
    (MLA_SYNC_HANDOFF=2: compute-sanitizer racecheck reports the writer-arrive form as a race, docs/MLA.md);
    GQADRV_MLA_EXPERIMENTS=1 registers seesaw_bal_arrive (MLA_SYNC_HANDOFF=0) and seesaw_bal_arrive1 (1): same
    source, entry, shared memory and schedule, no spills, and one more bar.arrive (one fewer bar.sync) in the
    consumer loop per hand-off they leave arriving."""
    import re

    from gqadrv.mla import kernel_spec
    from gqadrv.runtime.compiler import compile_module

    exp = kernel_spec.arrive_handoff_experiments()
    assert set(exp) == {"seesaw_bal_arrive", "seesaw_bal_arrive1"}
    base = kernel_spec.KERNELS["seesaw_bal"]
    assert "MLA_SYNC_HANDOFF" not in dict(base.fixed_defines)  # the source's default (2)
    counts = {}
    for level, v in ((2, base), (1, exp["seesaw_bal_arrive1"]), (0, exp["seesaw_bal_arrive"])):
        if level < 2:
            assert dict(v.fixed_defines) == dict(base.fixed_defines, MLA_SYNC_HANDOFF=level)
            assert (v.source, v.entry, v.smem_bytes, v.balanced, v.tma_boxes) == (
                base.source, base.entry, base.smem_bytes, True, base.tma_boxes)
        m = compile_module(v.source, "sm_90a", v.defines("bfloat16"), cache=isolated_cache)
        r = m.resources[next(iter(m.resources))]
        assert r.spill_stores == 0 and r.spill_loads == 0, (v.name, r)
        ptx = m.ptx.decode()
        counts[level] = {op: len(re.findall(rf"\bbar(?:rier)?(?:\.cta)?\.{op}(?:\.aligned)?\s", ptx))
                         for op in ("arrive", "sync")}
    # default: only the P0 / P1 hand-offs arrive (their readers are wgmma, through the async proxy)
    assert counts[2]["arrive"] == 2, counts
    for level in (1, 0):
        assert counts[level]["arrive"] == 4 - level, counts
        assert counts[level]["sync"] == counts[2]["sync"] - (2 - level), counts


def _ex2_fed_by_fma(ptx: str) -> int:
    """How many ex2.approx instructions of a PTX listing take a register that an fma.rn.f32 wrote last."""
    import re

    last_op, n = {}, 0
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(%\w+)\s*,\s*(.*);", line)
        if not m:
            continue
        op, dst, rest = m.groups()
        if op.startswith("ex2.approx") and last_op.get(rest.split(",")[0].strip(), "").startswith("fma.rn.f32"):
            n += 1
        last_op[dst] = op
    return n


def test_seesaw_consumer_loop_is_lean(isolated_cache):
    """Every build of dense_decode_seesaw.cu runs the lean consumer loop (tile64_ops.cuh): the softmax
    scale folded into the exponential (each of the 32 logits of a tile and warpgroup reaches ex2
    through one FFMA, 2^(s sc - m), in both warpgroups' loops: 64), P stored by stmatrix.x4 (4 per P
    tile), wgmma descriptors as a base plus a constant (no masked 18-bit address field, 0x3FFF0), no
    spills. The builds before 2026-12-05 (a scaling pass, then 2^(s - m); 32-bit P stores; masked
    descriptors) had 0 / 0 / 76 of these and fail here."""
    from gqadrv.mla import kernel_spec
    from gqadrv.runtime.compiler import compile_module

    seesaw = {k.name: k for k in kernel_spec.DEFAULT_VARIANTS if k.source == "mla/sm90/dense_decode_seesaw.cu"}
    assert {"seesaw", "seesaw_tma", "seesaw_bal", "seesaw_fp8"} <= set(seesaw)
    for name in ("seesaw", "seesaw_bal", "seesaw_fp8"):
        v = seesaw[name]
        m = compile_module(v.source, "sm_90a", v.defines("bfloat16"), cache=isolated_cache)
        ptx = m.ptx.decode()
        r = m.resources[next(iter(m.resources))]
        assert r.spill_stores == 0 and r.spill_loads == 0, (name, r)
        assert _ex2_fed_by_fma(ptx) >= 64, (name, _ex2_fed_by_fma(ptx))
        assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") >= 8, name
        assert ptx.count("262128") == 0, name


def test_flag_bits_match_the_kernel_header():
    """kernel_spec.FLAG_* are the MLA_FLAG_* bits of kernels/mla/common/args.cuh, each a distinct bit."""
    import re
    from pathlib import Path

    from gqadrv.mla import kernel_spec as ks

    text = (Path(__file__).resolve().parents[2] / "kernels" / "mla" / "common" / "args.cuh").read_text()
    defs = {k: int(v) for k, v in re.findall(r"#define MLA_FLAG_(\w+) (\d+)", text)}
    py = {n[len("FLAG_"):]: getattr(ks, n) for n in dir(ks) if n.startswith("FLAG_")}
    assert defs == py, (defs, py)
    assert sorted(defs.values()) == [1, 2, 4, 8, 16]


def test_racecheck_handoff_tool_compiles_with_the_narrow2_shaped_variants(tmp_path):
    """tools/racecheck_handoff.py (run under compute-sanitizer on a GPU): its kernel, with the alt1 .. alt8
    variants that mimic narrow2's ring, alternate tiles and epilogue hand-offs, compiles for sm_90a without
    spills; the alt variants' expected output is warpgroup 1's round, warpgroup 0's round, the staging round,
    the ticket plus {m, L} and each consumer thread's sum over its tiles."""
    import sys
    from pathlib import Path

    from gqadrv.runtime import cache as _cache
    from gqadrv.runtime.compiler import compile_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    try:
        import racecheck_handoff as rh
    finally:
        sys.path.pop(0)
    assert all(rh.VARIANTS[f"alt{t}"] == 8 + t for t in range(1, 9))
    (tmp_path / "handoff.cu").write_text(rh.SOURCE.replace("ROUNDS", str(rh.ROUNDS)))
    m = compile_module("handoff.cu", "sm_90a", {}, root=tmp_path, cache=_cache.CubinCache(None, enabled=False))
    r = m.resources["handoff"]
    assert r.spill_stores == 0 and r.spill_loads == 0
    want = rh.alt_expect(5)
    assert want.shape == (768,) and want[0] == 1000 and want[128] == 2000 and want[256] == 3000 and want[511] == 18
    # thread i of warpgroup 0 sums tiles 0, 2, 4 (ring words k * 128 + i plus the exchanged k * 128 + i % 4),
    # warpgroup 1 tiles 1, 3; with one tile warpgroup 1 sums nothing
    assert want[512 + 5] == sum(2 * k * 128 + 5 + 1 for k in (0, 2, 4))
    assert want[640 + 5] == sum(2 * k * 128 + 5 + 1 for k in (1, 3))
    assert (rh.alt_expect(1)[640:] == 0).all()
    assert rh.ROUNDS * 128 >= want.size
