"""GQA host side without a GPU: contract validation, route registry, argument layout, oracle."""

import math
import re

import numpy as np
import pytest

from tests.fakes import FakeCudaArray, fake
from gqadrv.gqa import contract, routes
from gqadrv.gqa.reference import gqa_decode_reference

B, HQ, HKV, C, D = 2, 32, 8, 100, 128


def good(**over):
    t = dict(q=fake((B, HQ, D)), kv=fake((B, 2, HKV, C, D)), lens=fake((B,), np.int32), out=None, q_scale=1.0)
    t.update(over)
    return t


def run(t):
    return contract.validate(t["q"], t["kv"], t["lens"], t["out"], t["q_scale"], stream=None)


def test_valid_problem():
    p = run(good(out=fake((B, HQ, D))))
    assert (p.batch, p.num_q_heads, p.num_kv_heads, p.group, p.capacity, p.head_dim, p.dtype) == (B, HQ, HKV, 4, C, D, "float16")


@pytest.mark.parametrize("over,exc,msg", [
    (dict(q=fake((B, HQ))), ValueError, "q must have shape"),
    (dict(q=fake((0, HQ, D))), ValueError, "batch must be positive"),
    (dict(q=fake((B, HQ, D), np.float32)), TypeError, "q must have dtype float16 or bfloat16, got float32"),
    (dict(q=FakeCudaArray(np.zeros((B, D, HQ), np.float16)[:, ::1].transpose(0, 2, 1))), ValueError, "q must be contiguous"),
    (dict(kv=fake((B, HKV, C, D))), ValueError, "kv must have shape"),
    (dict(kv=fake((B + 1, 2, HKV, C, D))), ValueError, "kv batch 3 does not match"),
    (dict(kv=fake((B, 3, HKV, C, D))), ValueError, "dim 1 must be 2"),
    (dict(kv=fake((B, 2, HKV, 0, D))), ValueError, "capacity must be positive"),
    (dict(kv=fake((B, 2, HKV, C, 64))), ValueError, "head_dim 64 does not match"),
    (dict(kv=fake((B, 2, HKV, C, D), np.float32)), TypeError, "kv must have the dtype of q"),
    (dict(kv=fake((B, 2, HKV, C, D), device=1)), ValueError, "all tensors must share one device"),
    (dict(kv=fake((B, 2, 5, C, D))), ValueError, "multiple of num_kv_heads"),
    (dict(q=fake((B, 34, D)), kv=fake((B, 2, 2, C, D))), ValueError, "group size .* 17 is not supported; supported: 1..16"),
    (dict(q=fake((B, HQ, 96)), kv=fake((B, 2, HKV, C, 96))), ValueError, "head_dim 96 is not supported; supported: 64, 128, 256"),
    (dict(lens=fake((B,), np.int64)), TypeError, "sequence_lengths must have dtype int32"),
    (dict(lens=fake((B, 1), np.int32)), ValueError, r"sequence_lengths must have shape \(2,\)"),
    (dict(lens=fake((B,), np.int32, device=2)), ValueError, "share one device"),
    (dict(out=fake((B, HQ, 64))), ValueError, "out must have the shape of q"),
    (dict(out=fake((B, HQ, D), np.float32)), TypeError, "out must have the dtype of q"),
    (dict(q_scale=0.0), ValueError, "q_scale must be a finite number > 0"),
    (dict(q_scale=-1.0), ValueError, "q_scale"),
    (dict(q_scale=float("nan")), ValueError, "q_scale"),
    (dict(q_scale=float("inf")), ValueError, "q_scale"),
    (dict(q_scale="1.0"), ValueError, "q_scale"),
    (dict(q_scale=None), ValueError, "q_scale"),
    (dict(q_scale=True), ValueError, "q_scale"),
    (dict(q=np.zeros((B, HQ, D), np.float16)), ValueError, "q must be a CUDA array; got a CPU array"),
    (dict(kv=[[1.0]]), TypeError, "kv must be a CUDA array supporting DLPack"),
])
def test_contract_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        run(good(**over))


def test_out_overlapping_inputs_is_rejected():
    buf = np.zeros(B * HQ * D * 2, np.float16)
    q = FakeCudaArray(buf[: B * HQ * D].reshape(B, HQ, D))
    whole = FakeCudaArray(buf[: B * HQ * D].reshape(B, HQ, D))
    partial = FakeCudaArray(buf[B * HQ * D // 2: B * HQ * D // 2 + B * HQ * D].reshape(B, HQ, D))
    disjoint = FakeCudaArray(buf[B * HQ * D:].reshape(B, HQ, D))
    with pytest.raises(ValueError, match="out must not overlap q"):
        run(good(q=q, out=whole))
    with pytest.raises(ValueError, match="out must not overlap q"):
        run(good(q=q, out=partial))
    run(good(q=q, out=disjoint))
    kvbuf = np.zeros(B * 2 * HKV * C * D, np.float16)
    with pytest.raises(ValueError, match="out must not overlap kv"):
        run(good(kv=FakeCudaArray(kvbuf.reshape(B, 2, HKV, C, D)), out=FakeCudaArray(kvbuf[128:128 + B * HQ * D].reshape(B, HQ, D))))


def test_misaligned_views_are_rejected():
    buf = np.zeros(B * HQ * D + 8, np.float16)
    off = (-buf.ctypes.data % 16) // 2 + 1  # 2-byte aligned, not 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        run(good(q=FakeCudaArray(buf[off:off + B * HQ * D].reshape(B, HQ, D))))


@pytest.mark.parametrize("value,ok", [(None, True), (1, True), (64, True), (0, False), (65, False), (-2, False),
                                      (True, False), (2.0, False), ("4", False)])
def test_num_splits_rule(value, ok):
    if ok:
        assert contract.check_num_splits(value) == value
    else:
        with pytest.raises(ValueError, match="num_splits must be None or an int in"):
            contract.check_num_splits(value)


def test_q_scale_accepts_numpy_scalars():
    assert contract.check_q_scale(np.float32(0.5)) == 0.5 and contract.check_q_scale(2) == 2.0


# ----------------------------------------------------------------------------- routes
@pytest.mark.parametrize("cc,cap,backend,family", [
    ((9, 0), 64, None, "short"), ((9, 0), 65, None, "tma"), ((9, 0), 1, None, "short"),
    ((9, 0), 4096, "portable", "portable"), ((8, 0), 4096, None, "portable"), ((8, 9), 65, None, "portable"),
    ((12, 0), 100, None, "portable"), ((8, 6), 10, None, "short"),
    ((10, 0), 64, None, "tc_short"), ((10, 0), 65, None, "tc_long"), ((11, 0), 4096, None, "tc_long"),
    ((11, 0), 4096, "portable", "portable"), ((10, 3), 4096, None, "portable"),
])
def test_routing(cc, cap, backend, family):
    assert routes.select_variant(cc, cap, 128, "float16", 4, backend).family.name == family


def test_large_batch_rule_prefers_the_portable_route_on_sm90():
    def fam(ctas, d=128, backend=None, cc=(9, 0), cap=4096):
        return routes.select_variant(cc, cap, d, "float16", 4, backend, ctas, 132).family.name

    assert fam(128) == "tma"                  # B16 x 8 KV heads: one wave
    assert fam(263) == "tma"
    assert fam(264) == "portable"             # two waves of one TMA-route CTA per SM
    assert fam(512) == "portable"             # B64 x 8
    assert fam(512, d=256) == "tma" and fam(512, d=64) == "tma"
    assert fam(512, backend="hopper") == "tma"  # a forced backend wins
    assert fam(512, cap=64) == "short"
    assert fam(512, cc=(10, 0)) == "tc_long" and fam(512, cc=(8, 0)) == "portable"
    assert routes.select_variant((9, 0), 4096, 128, "float16", 4).family.name == "tma"  # no grid size given
    assert routes.prefers_portable((9, 0), 128, 2 * 132, 132) and not routes.prefers_portable((9, 0), 128, 264, 0)


def test_routing_errors(monkeypatch):
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer"):
        routes.select_variant((7, 5), 100, 128, "float16", 4)
    with pytest.raises(RuntimeError, match="backend 'hopper' needs compute capability 9.0"):
        routes.select_variant((8, 0), 100, 128, "float16", 4, "hopper")
    with pytest.raises(RuntimeError, match="backend 'tcgen05' needs compute capability 10.0 or 11.0"):
        routes.select_variant((9, 0), 100, 128, "float16", 4, "tcgen05")
    with pytest.raises(ValueError, match="backend must be one of"):
        routes.select_variant((9, 0), 100, 128, "float16", 4, "cuda")
    monkeypatch.setenv("GQADRV_BACKEND", "portable")
    assert routes.select_variant((9, 0), 100, 128, "float16", 4).family.name == "portable"


def test_rows_follow_group():
    assert routes.select_variant((9, 0), 100, 128, "float16", 8).rows == 8
    assert routes.select_variant((9, 0), 100, 128, "float16", 9).rows == 16


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a", "sm_110a"])
def test_every_variant_fits_shared_memory(arch):
    vs = routes.variants_for_arch(arch)
    assert vs
    for v in vs:
        limit = routes.ARCH_SMEM_OPTIN[arch]
        if v.family.name in ("portable", "short"):
            limit = min(limit, routes.PORTABLE_SMEM_LIMIT)
        assert v.dynamic_smem + 1024 <= limit, v.name
        assert v.family.name != "short" or v.tiling.tokens_per_round >= routes.SHORT_CAPACITY_MAX


def test_split_heuristic():
    v = routes.select_variant((9, 0), 32768, 128, "float16", 4)
    assert routes.default_splits(v, 1, 8, 32768, 132, 1) == 16      # batch 1 fills 132 SMs in one wave
    assert routes.default_splits(v, 1, 8, 32768, 132, 3) == 49      # three CTAs per SM
    assert routes.default_splits(v, 64, 8, 4096, 132, 1) == 1        # large batch: no split
    assert routes.default_splits(v, 1, 8, 65, 132, 1) == 1           # one sub-tile round: nothing to split
    assert routes.default_splits(v, 4, 8, 256, 132, 1) == 1          # two rounds: splitting costs more
    assert routes.default_splits(v, 1, 8, 384, 132, 1) == 1          # three rounds: still unsplit
    assert routes.default_splits(v, 1, 8, 512, 132, 1) == 4          # four rounds: one per split
    assert routes.default_splits(v, 1, 8, 1024, 132, 1) == 8         # one round of sub-tiles per split
    assert routes.default_splits(v, 1, 1, 32768, 132, 1) == 64       # one head: capped at MAX_SPLITS
    short = routes.select_variant((9, 0), 64, 128, "float16", 4)
    assert routes.default_splits(short, 1, 8, 64, 132, 1) == 1
    grid, block, smem = routes.launch_geometry(v, 3, 8, 5)
    assert grid == (120, 1, 1) and block == (128, 1, 1) and smem == v.dynamic_smem


def test_l2_prefetch_rule():
    v = routes.select_variant((9, 0), 4096, 128, "float16", 4)
    pays = routes.l2_prefetch_pays
    assert pays(v, 16, 8, 4096, 1, 132, 1)         # one wave, 32 rounds per CTA
    assert pays(v, 1, 8, 32768, 16, 132, 1)        # one wave, 16 rounds per split
    assert not pays(v, 1, 8, 4096, 16, 132, 1)     # 2 rounds per split
    assert not pays(v, 4, 8, 256, 1, 132, 1)       # 2 rounds
    assert not pays(v, 64, 8, 4096, 1, 132, 1)     # 512 CTAs: several waves
    assert not pays(v, 256, 8, 2048, 1, 132, 1)
    portable = routes.select_variant((9, 0), 4096, 128, "float16", 4, backend="portable")
    assert not pays(portable, 16, 8, 4096, 1, 132, 1)  # no TMA prefetch in the cp.async kernel
    tc_long = routes.select_variant((10, 0), 4096, 128, "float16", 4)
    assert tc_long.family.name == "tc_long" and not pays(tc_long, 16, 8, 4096, 1, 148, 1)  # flag not read there


def test_kernel_argument_block_layout():
    """gqa/args.py mirrors struct GqaArgs of kernels/gqa/common/args.cuh: same field names, order,
    offsets and types; the TMA signature puts the 128-byte tensor map first."""
    from gqadrv.gqa import args
    from gqadrv.runtime.compiler import kernels_root
    from tests.helpers import c_struct_fields, python_struct_fields

    text = (kernels_root() / "gqa" / "common" / "args.cuh").read_text()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "GqaArgs")]
    assert c == python_struct_fields(args.GQA_ARGS)
    assert args.GQA_ARGS.size == 88
    assert args.SIG_TMA.offsets == (0, 128) and args.SIG_TMA.size == 216
    assert args.SIG_TMA.field_offsets["args.out"] == (128 + 16, "<Q")
    flags = dict(re.findall(r"#define (GQA_FLAG_\w+) (\d+)", text))
    assert int(flags["GQA_FLAG_L2_EVICT_FIRST"]) == args.GQA_FLAG_L2_EVICT_FIRST
    assert int(flags["GQA_FLAG_L2_PREFETCH"]) == args.GQA_FLAG_L2_PREFETCH


def test_layout_test_catches_a_renamed_or_moved_field():
    from gqadrv.runtime.module import NamedStruct
    from tests.helpers import c_struct_fields, python_struct_fields

    hdr = "struct S {\n  const u16* q;   // [B]\n  float s;\n  int n;\n};\n"
    assert c_struct_fields(hdr, "S") == python_struct_fields(NamedStruct("S", ("q", "Q"), ("s", "f"), ("n", "i")))
    assert c_struct_fields(hdr, "S") != python_struct_fields(NamedStruct("S", ("q", "Q"), ("n", "i"), ("s", "f")))
    assert c_struct_fields(hdr, "S") != python_struct_fields(NamedStruct("S", ("q", "Q"), ("scale", "f"), ("n", "i")))


# ----------------------------------------------------------------------------- oracle
def test_oracle_against_direct_formula():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 6, 64))
    kv = rng.standard_normal((3, 2, 2, 11, 64))
    lens = np.array([11, 4, 1])
    out = gqa_decode_reference(q, kv, lens, 1.5)
    for b in range(3):
        for h in range(6):
            k, v = kv[b, 0, h // 3, : lens[b]], kv[b, 1, h // 3, : lens[b]]
            s = k @ q[b, h] * 1.5 / math.sqrt(64)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, h], (p / p.sum()) @ v, rtol=1e-12, atol=1e-12)


def test_oracle_clamps_and_ignores_padding():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 2, 64))
    kv = rng.standard_normal((4, 2, 1, 8, 64))
    kv[:, :, :, 5:] = np.nan
    out = gqa_decode_reference(q, kv, np.array([5, 0, -3, 5]), 1.0)
    assert np.all(out[1] == 0) and np.all(out[2] == 0) and np.all(np.isfinite(out))
    kv2 = rng.standard_normal((1, 2, 1, 8, 64))
    np.testing.assert_allclose(gqa_decode_reference(q[:1], kv2, np.array([99])), gqa_decode_reference(q[:1], kv2, np.array([8])))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_110a"])
def test_short_kernel_start_order(arch, isolated_cache):
    """The short kernel's start (docs/GQA.md, "Start of the short kernel"): before griddepcontrol.wait it
    issues L2 prefetches only (the length, q, each warp's first K / V rows: its addresses are computed
    there) and griddepcontrol.launch_dependents, which comes once, right before the wait; no load, copy or
    store of global memory precedes the wait (the previous grid may still be writing q, the KV cache or
    the lengths)."""
    from gqadrv.runtime.compiler import compile_module

    shorts = [v for v in routes.variants_for_arch(arch) if v.family.name == "short"]
    assert len(shorts) == 12
    for v in shorts:
        m = compile_module(v.family.source, arch, v.defines, cache=isolated_cache)
        ptx = m.ptx.decode()
        assert ptx.count("griddepcontrol.wait;") == 1 and ptx.count("griddepcontrol.launch_dependents;") == 1, v.name
        before = ptx[:ptx.index("griddepcontrol.wait;")]
        assert "griddepcontrol.launch_dependents;" in before, v.name
        assert len(re.findall(r"prefetch\.global\.L2", before)) >= 3, v.name
        memory_ops = re.findall(r"^\s*(?:@%p\d+\s+)?((?:ld|st|cp\.async|atom|red)\.[\w.:]*)", before, re.M)
        assert [op for op in memory_ops if not op.startswith(("ld.param", "ld.shared", "st.shared"))] == [], \
            (v.name, memory_ops)
