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


def test_sparse_arguments_raise_feature_error_before_any_gpu_work():
    import gqadrv

    for kw in (dict(indices=1), dict(attn_sink=1), dict(extra_k_cache=1), dict(topk_length=1),
               dict(is_fp8_kvcache=True)):
        with pytest.raises(NotImplementedError, match="sparse / FP8"):
            gqadrv.flash_mla_with_kvcache(None, None, None, None, 512, None, **kw)
    assert issubclass(FeatureError, NotImplementedError)


def test_argument_block_layout_matches_the_header():
    from gqadrv.mla.args import MLA_ARGS
    from gqadrv.runtime.compiler import kernels_root
    from tests.helpers import c_struct_fields, python_struct_fields

    text = (kernels_root() / "mla" / "common" / "args.cuh").read_text()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "MlaDecodeArgs")]
    assert c == python_struct_fields(MLA_ARGS)
    assert MLA_ARGS.size == kernel_spec.ARGS_BYTES


def test_routes():
    assert routes.select_variant((9, 0), "bfloat16", 128).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 16).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 128, None, True).family.name == "seesaw_tma"
    assert routes.select_variant((9, 0), "bfloat16", 128, "seesaw", True).family.name == "seesaw"
    assert routes.select_variant((9, 0), "bfloat16", 16, "narrow16_tma", True).family.name == "narrow16_tma"
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
        if variant.family.name == "mma":
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
                                          "narrow32_tma"}
    # the default route on the H200 is seesaw_tma for pages >= 64 and the cp.async seesaw below
    assert {c.page for c in cases if c.backend is None} == {1, 16, 32, 64, 128, 256}


def test_layout_and_barrier_protocol_models():
    """tools/mla_dev_check.py's CPU models: every copy / descriptor / fragment of the seesaw and
    narrow kernels lands where the math expects, and the seesaw, seesaw_tma (half-tile barriers,
    tail zeroing) and narrow barrier protocols run random interleavings without a hazard or a
    deadlock."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "mla_dev_check.py"
    spec = importlib.util.spec_from_file_location("mla_dev_check_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    problems = mod.layout_model_seesaw() + mod.layout_model_narrow(16) + mod.protocol_model(seeds=12)
    assert problems == []
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
