"""FP8 MLA cache (gqadrv.quantize_k_cache / dequantize_k_cache, FlashMLA's V3.2 656-byte format)
without a GPU: the contract (every error before any launch), the argument struct against
kernels/mla/smxx/fp8_cache.cu, the launch fields of dense and pool-view layouts, the CLI
registration, an NVRTC compile of every module for every registered arch (no spills, no local
memory, the e4m3 cvt only where it exists), and the numpy reference: byte layout, power-of-two
scales >= 2^-13, round-trip error bounds, RoPE bytes copied bit for bit, NaN / Inf / zero / tiny /
large tiles."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from gqadrv.mla import fp8_cache
from gqadrv.mla import fp8_reference as ref
from gqadrv.ops import fp8
from gqadrv.runtime import tensors
from gqadrv.runtime.compiler import kernels_root
from tests.fakes import FakeCudaArray, fake

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
NB, PAGE = 3, 4


@pytest.fixture(autouse=True)
def uint16_reads_as_bf16(monkeypatch):
    """numpy cannot export bf16 through DLPack: in these tests a uint16 array stands for bf16 storage
    (the dtype name cache of runtime.tensors maps it), so strided bf16 views can be faked."""
    monkeypatch.setitem(tensors._DT_NAMES, np.dtype(np.uint16), "bfloat16")


def bf16(shape, **kw):
    return fake(shape, np.uint16, **kw)


def u8(shape, **kw):
    return fake(shape, np.uint8, **kw)


def fp8_array(shape):
    """A float8_e4m3fn-typed array (numpy cannot export float8 through DLPack; a JAX CPU array can,
    and the fake claims a CUDA device for it, as torch / JAX CUDA arrays would)."""
    jnp = pytest.importorskip("jax.numpy")
    return FakeCudaArray(jnp.zeros(shape, jnp.float8_e4m3fn))


def quant(k=None, out=None):
    return fp8_cache.validate_quantize(k if k is not None else bf16((NB, PAGE, 1, 576)), out, stream=None)


def dequant(k=None, out=None):
    return fp8_cache.validate_dequantize(k if k is not None else u8((NB, PAGE, 1, 656)), out, stream=None)


# ----------------------------------------------------------------------------- contract
def test_valid_problems_and_pool_views():
    p = quant(out=u8((NB, PAGE, 1, 656)))
    assert (p.op, p.num_blocks, p.page_size, p.tokens, p.out_shape) == ("quantize", NB, PAGE, NB * PAGE, (NB, PAGE, 1, 656))
    assert p.src_strides == (PAGE * 576 * 2, 576 * 2) and p.out_dtype == "uint8"
    # every other page of a bigger bf16 pool, into every third page of a bigger FP8 pool
    pool = np.zeros((2 * NB, PAGE, 1, 576), np.uint16)
    fpool = np.zeros((3 * NB, PAGE, 1, 656), np.uint8)
    p = quant(FakeCudaArray(pool[::2]), FakeCudaArray(fpool[::3]))
    assert p.src_strides == (2 * PAGE * 576 * 2, 576 * 2)
    assert fp8_cache._byte_strides(p.out) == (3 * PAGE * 656, 656)
    # token rows of a wider row (any token stride on the input side)
    wide = np.zeros((NB, PAGE, 1, 640), np.uint16)
    p = quant(FakeCudaArray(wide[..., :576]))
    assert p.src_strides == (PAGE * 640 * 2, 640 * 2)
    # fp8 cache typed uint8, int8 or float8_e4m3fn
    for arr in (u8((NB, PAGE, 1, 656)), fake((NB, PAGE, 1, 656), np.int8), fp8_array((NB, PAGE, 1, 656))):
        p = dequant(arr, bf16((NB, PAGE, 1, 576)))
        assert p.op == "dequantize" and p.out_dtype == "bfloat16"
        quant(out=arr)
    p = dequant(FakeCudaArray(fpool[1::3]), FakeCudaArray(pool[1::2]))
    assert p.src_strides == (3 * PAGE * 656, 656)
    # size-1 dimensions: their strides are never stepped (0)
    p = quant(bf16((1, 1, 1, 576)))
    assert p.src_strides == (0, 0) and p.tokens == 1
    # zero tokens: valid (nothing is launched)
    assert quant(bf16((0, PAGE, 1, 576))).tokens == 0
    assert dequant(u8((NB, 0, 1, 656))).tokens == 0


@pytest.mark.parametrize("k,out,exc,msg", [
    (bf16((NB, PAGE, 576)), None, ValueError, r"k_bf16 must have shape \[num_blocks, page_size, 1, 576\]"),
    (bf16((NB, PAGE, 2, 576)), None, ValueError, r"\[num_blocks, page_size, 1, 576\]"),
    (bf16((NB, PAGE, 1, 512)), None, ValueError, r"\[num_blocks, page_size, 1, 576\]"),
    (fake((NB, PAGE, 1, 576), np.float16), None, TypeError, "k_bf16 must have dtype bfloat16"),
    (fake((NB, PAGE, 1, 576), np.float32), None, TypeError, "k_bf16 must have dtype bfloat16"),
    (FakeCudaArray(np.zeros((NB, PAGE, 1, 1152), np.uint16)[..., ::2]), None, ValueError, "contiguous token rows"),
    (np.zeros((NB, PAGE, 1, 576), np.uint16), None, ValueError, "k_bf16 must be a CUDA array"),
    ([[0.0]], None, TypeError, "k_bf16 must be a CUDA array supporting DLPack"),
    (None, u8((NB, PAGE, 1, 576)), ValueError, r"out must have shape \(3, 4, 1, 656\)"),
    (None, u8((NB + 1, PAGE, 1, 656)), ValueError, r"out must have shape"),
    (None, fake((NB, PAGE, 1, 656), np.float16), TypeError, "out must have dtype uint8 or int8 or float8_e4m3fn"),
    (None, FakeCudaArray(np.zeros((NB, PAGE, 1, 700), np.uint8)[..., :656]), ValueError, "656 bytes apart"),
    (None, FakeCudaArray(np.zeros((NB, 2 * PAGE, 1, 656), np.uint8)[:, ::2]), ValueError, "656 bytes apart"),
    (None, FakeCudaArray(np.zeros((NB, PAGE, 1, 1312), np.uint8)[..., ::2]), ValueError, "contiguous token rows"),
    (None, u8((NB, PAGE, 1, 656), device=1), ValueError, "share one device"),
])
def test_quantize_contract_errors(k, out, exc, msg):
    with pytest.raises(exc, match=msg):
        quant(k, out)


def test_quantize_out_pages_must_not_overlap_and_must_not_alias_the_input():
    buf = np.zeros(NB * PAGE * 656 + 656, np.uint8)
    # stride(0) of one token: pages overlap
    over = np.lib.stride_tricks.as_strided(buf, (NB, PAGE, 1, 656), (656, 656, 656, 1))
    with pytest.raises(ValueError, match="out's pages overlap"):
        quant(out=FakeCudaArray(over))
    # the output's bytes alias the input
    raw = np.zeros(NB * PAGE * 656 * 2, np.uint8)
    k = FakeCudaArray(raw[: NB * PAGE * 1152].view(np.uint16).reshape(NB, PAGE, 1, 576))
    o = FakeCudaArray(raw[: NB * PAGE * 656].reshape(NB, PAGE, 1, 656))
    with pytest.raises(ValueError, match="out must not overlap k_bf16"):
        quant(k, o)


@pytest.mark.parametrize("k,out,exc,msg", [
    (u8((NB, PAGE, 1, 576)), None, ValueError, r"k_fp8 must have shape \[num_blocks, page_size, 1, 656\]"),
    (u8((NB, PAGE, 656)), None, ValueError, r"\[num_blocks, page_size, 1, 656\]"),
    (fake((NB, PAGE, 1, 656), np.float16), None, TypeError, "k_fp8 must have dtype uint8 or int8 or float8_e4m3fn"),
    (bf16((NB, PAGE, 1, 656)), None, TypeError, "k_fp8 must have dtype"),
    (FakeCudaArray(np.zeros((NB, PAGE, 1, 1312), np.uint8)[..., ::2]), None, ValueError, "contiguous token rows"),
    (None, u8((NB, PAGE, 1, 576)), TypeError, "out must have dtype bfloat16"),
    (None, bf16((NB, PAGE, 1, 656)), ValueError, r"out must have shape \(3, 4, 1, 576\)"),
    (None, FakeCudaArray(np.lib.stride_tricks.as_strided(np.zeros(NB * PAGE * 576, np.uint16), (NB, PAGE, 1, 576),
                                                          (2 * 576 * PAGE, 2 * 300, 2, 2))), ValueError,
     "token rows overlap"),
    (None, bf16((NB, PAGE, 1, 576), device=3), ValueError, "share one device"),
])
def test_dequantize_contract_errors(k, out, exc, msg):
    with pytest.raises(exc, match=msg):
        dequant(k, out)


def test_too_many_tokens_for_one_launch():
    big = FakeCudaArray(np.lib.stride_tricks.as_strided(np.zeros(576, np.uint16), (2**16, 2**15, 1, 576),
                                                        (0, 0, 0, 2)))
    with pytest.raises(ValueError, match="at most 2147483647"):
        quant(big)


# ----------------------------------------------------------------------------- launch fields
def test_launch_fields_dense_views_and_misaligned():
    p = quant()
    f = fp8_cache.args_fields(p, 0x10000, fp8_cache._dense_strides(p.out_shape, 1))
    vec = fp8_cache.MLA_FP8_FLAG_VEC16 if p.src.ptr % 16 == 0 else 0
    assert f == {"src": p.src.ptr, "dst": 0x10000, "src_page_stride": PAGE * 1152, "src_row_stride": 1152,
                 "dst_page_stride": PAGE * 656, "dst_row_stride": 656, "num_blocks": NB, "page_size": PAGE,
                 "tokens": NB * PAGE, "flags": vec}
    assert fp8_cache.launch_geometry(p) == ((3, 1, 1), (128, 1, 1), 0)   # 12 tokens, 4 per CTA
    assert fp8_cache.launch_geometry(quant(bf16((1, 5, 1, 576))))[0] == (2, 1, 1)
    # a page stride that is not a multiple of 16 bytes (odd token count per page): element path
    pool = np.zeros((2 * NB, 5, 1, 576), np.uint16)
    base = pool.ctypes.data % 16 == 0
    p = quant(FakeCudaArray(pool[::2]))
    assert p.src_strides == (2 * 5 * 1152, 1152)
    assert bool(fp8_cache.args_fields(p, 0x10000, (5 * 656, 656))["flags"]) == base
    assert not fp8_cache.args_fields(p, 0x10000, (5 * 656 + 8, 656))["flags"]   # dst page stride % 16
    assert not fp8_cache.args_fields(p, 0x10008, (5 * 656, 656))["flags"]       # dst base
    odd = np.zeros((NB, 3, 1, 576), np.uint16)
    p = quant(FakeCudaArray(odd[:, :]), None)
    assert p.src_strides == (3 * 1152, 1152)
    # the dequantize output's dense strides
    assert fp8_cache._dense_strides((NB, PAGE, 1, 576), 2) == (PAGE * 1152, 1152)
    assert fp8_cache._dense_strides((1, 1, 1, 576), 2) == (0, 0)


# ----------------------------------------------------------------------------- kernel struct mirror
def _source() -> str:
    return (kernels_root() / "mla" / "smxx" / "fp8_cache.cu").read_text()


def test_argument_struct_matches_the_kernel():
    from tests.helpers import c_struct_fields, python_struct_fields

    text = _source()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "MlaFp8CacheArgs")]
    assert c == python_struct_fields(fp8_cache.MLA_FP8_ARGS)
    assert fp8_cache.MLA_FP8_ARGS.size == 64
    defs = {k: int(v) for k, v in re.findall(r"#define (MLA_FP8_\w+) (\d+)", text)}
    assert defs["MLA_FP8_WARPS"] == fp8_cache.WARPS
    assert defs["MLA_FP8_BYTES_PER_TOKEN"] == ref.BYTES_PER_TOKEN == 656
    assert defs["MLA_FP8_SCALES_OFFSET"] == ref.SCALES_OFFSET == 512
    assert defs["MLA_FP8_ROPE_OFFSET"] == ref.ROPE_OFFSET == 528
    assert defs["MLA_FP8_TILE"] == ref.TILE == 128
    assert defs["MLA_FP8_FLAG_VEC16"] == fp8_cache.MLA_FP8_FLAG_VEC16
    entries = [ln for ln in text.splitlines() if ln.startswith('extern "C" __global__')]
    assert len(entries) == 2
    assert "mla_fp8_quantize(const MlaFp8CacheArgs args)" in entries[0]
    assert "mla_fp8_dequantize(const MlaFp8CacheArgs args)" in entries[1]
    assert fp8_cache.SIGNATURE.names == ("args",) and fp8_cache.SIGNATURE.size == 64


def test_kernel_files_open_with_the_header_comment():
    head = _source().split("#include")[0]
    for part in ("CTA work", "Warps", "Smem map", "Barriers", "Format", "Quantize", "Dequantize"):
        assert part in head, part
    conv = (kernels_root() / "common" / "fp8.cuh").read_text().split("#pragma once")[0]
    for part in ("cvt.rn.satfinite.e4m3x2.f32", "software", "0x7F", "448", "GQADRV_FP8_SOFTWARE"):
        assert part in conv, part


# ----------------------------------------------------------------------------- registry / CLI
def test_family_registration_and_cli_jobs():
    from gqadrv import cli

    for fam in (fp8_cache.QUANTIZE, fp8_cache.DEQUANTIZE):
        assert fam.arches == ("sm_80", "sm_90a", "sm_100a", "sm_110a") and fam.source == "mla/smxx/fp8_cache.cu"
    names = ["mla_fp8_quantize", "mla_fp8_dequantize"]
    assert [v.name for v in fp8_cache.variants_for_arch("sm_90a")] == names
    assert [v.defines for v in fp8_cache.variants_for_arch("sm_80")] == [{"MLA_FP8_OP": 0}, {"MLA_FP8_OP": 1}]
    assert fp8_cache.variants_for_arch("sm_75") == []
    assert fp8_cache.OP in cli._ops() and fp8_cache.OP.name == "mla_fp8_cache"
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_110a", "sm_120"):
        jobs = [j for j in cli.compile_jobs([arch]) if j[2] == fp8_cache.SOURCE]
        assert [j[0] for j in jobs] == names and [j[3] for j in jobs] == names, arch
    assert "hardware cvt" in fp8_cache.OP.describe((9, 0)) and "software" in fp8_cache.OP.describe((8, 6))
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        fp8_cache.OP.describe((7, 5))
    v = fp8_cache.variants_for_arch("sm_80")[0]
    assert v.block == (128, 1, 1) and v.dynamic_smem == 0


def test_exported_from_gqadrv_and_gqadrv_mla():
    import gqadrv
    import gqadrv.mla

    for name in ("quantize_k_cache", "dequantize_k_cache"):
        assert name in gqadrv.__all__ and name in gqadrv.mla.__all__
        assert getattr(gqadrv, name) is getattr(gqadrv.mla, name) is getattr(fp8_cache, name)


def test_selftest_cpu_case():
    cases = fp8_cache.OP.selftest(np.random.default_rng(0), gpu=False)
    assert len(cases) == 1 and cases[0][2], cases


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a", "sm_110a"])
def test_every_module_compiles_for_every_registered_arch(arch, isolated_cache):
    from gqadrv.runtime.compiler import compile_module

    for v in fp8_cache.variants_for_arch(arch):
        m = compile_module(v.family.source, arch, v.defines, cache=isolated_cache)
        r = m.resources[v.family.entry]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (arch, v.name, r)
        assert r.shared_bytes == 0 and r.registers <= 64, (arch, v.name, r)
        ptx = m.ptx.decode()
        assert ".local" not in ptx, v.name
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx and "st.global.v4.u32" in ptx, v.name
        assert ("griddepcontrol.wait" in ptx) == (arch != "sm_80"), v.name
        entries = re.findall(r"\.entry (\w+)", ptx)
        assert entries == [v.family.entry], entries
        hw = arch != "sm_80"
        if v.family is fp8_cache.QUANTIZE:
            assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == hw, (arch, v.name)
            assert "st.global.v2.u32" in ptx
        else:
            assert ("cvt.rn.f16x2.e4m3x2" in ptx) == hw, (arch, v.name)
            assert "cvt.rn.bf16x2.f32" in ptx


def test_software_path_compiles_on_every_arch(isolated_cache):
    """GQADRV_FP8_SOFTWARE (what the GPU tests use to compare the two paths) leaves no e4m3 cvt."""
    from gqadrv.runtime.compiler import compile_module

    for arch in ("sm_90a", "sm_100a"):
        for op in (0, 1):
            m = compile_module(fp8_cache.SOURCE, arch, {"MLA_FP8_OP": op}, cache=isolated_cache,
                               extra_options=("-DGQADRV_FP8_SOFTWARE=1",))
            ptx = m.ptx.decode()
            assert "e4m3x2" not in ptx and ".local" not in ptx


# ----------------------------------------------------------------------------- numpy reference
def random_cache(rng, shape, spread=(-20, 12)):
    """bf16 [..., 576] with a different magnitude per token (2^spread)."""
    x = rng.standard_normal((*shape, 576)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(*spread, size=(*shape, 1)).astype(np.float32)
    return x.astype(BF16)


def test_layout_byte_offsets():
    k = np.zeros((1, 576), np.float32)
    k[0, :512] = np.arange(512) / 4.0 - 64          # tile amax 64, 31.75 ... exactly representable
    k[0, 512:] = np.arange(64) - 32.5
    kb = k.astype(BF16)
    q = ref.quantize_k_cache_reference(kb)
    assert q.shape == (1, 656) and q.dtype == np.uint8
    codes, scales, rope = ref.split_k_cache(q)
    assert np.array_equal(codes, q[:, :512])
    assert np.array_equal(scales, np.frombuffer(q[0, 512:528].tobytes(), "<f4")[None])
    assert np.array_equal(rope, np.frombuffer(q[0, 528:656].tobytes(), "<u2")[None])
    assert np.array_equal(rope, kb[:, 512:].view(np.uint16))   # RoPE bytes unchanged
    amax = np.abs(k[0, :512]).reshape(4, 128).max(axis=1)
    expect = [2.0 ** math.ceil(math.log2(max(a / 448, 1e-4))) for a in amax]
    assert list(scales[0]) == expect
    assert np.array_equal(codes[0], fp8.e4m3_from_f32((k[0, :512].reshape(4, 128) / scales[0][:, None])
                                                      .astype(np.float32).reshape(512)))


def test_scales_are_powers_of_two_at_least_2_to_minus_13():
    rng = np.random.default_rng(1)
    k = random_cache(rng, (64, 16), spread=(-40, 40))
    _, scales, _ = ref.split_k_cache(ref.quantize_k_cache_reference(k))
    bits = scales.view(np.uint32)
    assert np.all(bits & 0x7FFFFF == 0) and np.all(scales >= 2.0**-13) and np.all(np.isfinite(scales))
    # the definition through float64 logarithms (no amax lands within an ulp of a power of two here)
    amax = np.abs(k[..., :512].astype(np.float64)).reshape(64, 16, 4, 128).max(axis=-1)
    s64 = np.maximum(amax / 448.0, np.float64(np.float32(1e-4)))
    expect = 2.0 ** np.ceil(np.log2(s64))
    assert np.array_equal(scales.astype(np.float64), expect)
    # and every scaled value stays within e4m3's range: nothing saturates
    vals = fp8.e4m3_to_f32(ref.quantize_k_cache_reference(k)[..., :512])
    assert np.all(np.abs(vals) <= 448) and not np.isnan(vals).any()


@pytest.mark.parametrize("spread", [(-20, 12), (-60, -30), (20, 60)])
def test_round_trip_error_bounds(spread):
    """|dequant(quant(x)) - x| <= s * 2^4 (half an e4m3 step in the top binade [256, 448]), and
    <= 2^-4 |x| + s * 2^-10 in general (3 mantissa bits: relative half step 2^-4; subnormal steps
    s * 2^-9); RoPE channels exact."""
    rng = np.random.default_rng(2)
    k = random_cache(rng, (8, 32), spread=spread)
    q = ref.quantize_k_cache_reference(k)
    back = ref.dequantize_k_cache_reference(q)
    assert back.dtype == BF16 and back.shape == k.shape
    x = k.astype(np.float32)
    y = back.astype(np.float32)
    s = np.repeat(ref.split_k_cache(q)[1], 128, axis=-1)
    err = np.abs(y[..., :512] - x[..., :512])
    assert np.all(err <= s * 16)
    assert np.all(err <= np.abs(x[..., :512]) * 2.0**-4 + s * 2.0**-10)
    assert np.array_equal(back[..., 512:].view(np.uint16), k[..., 512:].view(np.uint16))
    # dequantized values are code * s exactly (power-of-two scales: exact in bf16)
    codes = fp8.e4m3_to_f32(q[..., :512]).astype(np.float64)
    assert np.array_equal(y[..., :512].astype(np.float64), codes * s)
    # the dequantized values survive another round trip exactly (the scale may halve: x / s stays an
    # e4m3 value)
    again = ref.dequantize_k_cache_reference(ref.quantize_k_cache_reference(back))
    assert np.array_equal(again.view(np.uint16), back.view(np.uint16))


def test_special_tiles_nan_inf_zero_tiny_large():
    f32 = np.float32
    k = np.zeros((6, 576), f32)
    k[0, :128] = 0.0                                  # all-zero tile: s = 2^-13, codes 0
    k[1, :128] = 1e-6                                 # tiny: the scale floor, subnormal codes
    k[2, :128] = np.linspace(-448, 448, 128)          # amax exactly 448: s = 1, codes = e4m3(x)
    k[3, :128] = np.linspace(-450, 450, 128)          # amax just above 448 (bf16 450): s = 2
    k[4, :128] = 3.0e38                               # huge: s = 2^120 (the largest bf16 tile)
    k[5, :128] = 1.0
    k[5, 3], k[5, 7], k[5, 9] = np.nan, np.inf, -np.inf   # ignored by amax: s from the finite 1.0s
    k[:, 512:] = 7.0
    kb = k.astype(BF16)
    kb.view(np.uint16)[5, 520] = 0x7FA1                # a NaN payload in RoPE: copied bit for bit
    q = ref.quantize_k_cache_reference(kb)
    codes, scales, rope = ref.split_k_cache(q)
    x = kb.astype(f32)
    assert scales[0, 0] == 2.0**-13 and not codes[0, :128].any()
    assert scales[1, 0] == 2.0**-13
    assert np.all(codes[1, :128] == fp8.e4m3_from_f32((x[1, :128] * f32(8192)).astype(f32)))
    assert codes[1, 0] == 0x04                        # 1e-6 * 8192 = 0.0082 = 4.2 * 2^-9
    assert scales[2, 0] == 1.0 and np.array_equal(codes[2, :128], fp8.e4m3_from_f32(x[2, :128]))
    assert codes[2, 0] == 0xFE and codes[2, 127] == 0x7E
    assert scales[3, 0] == 2.0 and codes[3, 127] == fp8.e4m3_from_f32(np.array([225.0], f32))[0]
    assert scales[4, 0] == 2.0**120 and np.all(np.isfinite(scales))
    assert scales[5, 0] == 2.0**-8                     # 1 / 448 -> 2^-8 (a power of two above 2.2e-3)
    assert codes[5, 3] == 0x7F and codes[5, 7] == 0x7E and codes[5, 9] == 0xFE
    assert codes[5, 0] == fp8.e4m3_from_f32(np.array([256.0], f32))[0]
    assert np.all(scales[:, 1:] == 2.0**-13)            # the zero tiles 1..3
    assert rope[5, 8] == 0x7FA1 and np.array_equal(rope, kb[:, 512:].view(np.uint16))
    back = ref.dequantize_k_cache_reference(q).view(np.uint16)
    assert back[5, 3] == 0x7FFF                         # NaN -> canonical bf16 NaN
    assert back[5, 7] == fp8.bf16_bits(np.array([448 * 2.0**-8], f32))[0]   # Inf saturated: 1.75
    assert back[5, 520] == 0x7FA1


def test_dequantize_of_foreign_caches():
    """Caches written elsewhere: non-power-of-two fp32 scales (FlashMLA's older amax/448 writer) round
    the fp32 product to bf16 (nearest even); NaN / Inf scales give NaN / Inf; int8 and float8 views."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 256, size=(5, 656), dtype=np.uint8)
    scales = np.array([[0.0123, 1.0 / 3.0, 2.0**-20, 7.5e30]] * 4 + [[np.nan, np.inf, 0.0, -1.0]], np.float32)
    q[:, 512:528] = scales.astype("<f4").view(np.uint8)
    back = ref.dequantize_k_cache_reference(q).view(np.uint16)
    vals = fp8.e4m3_to_f32(q[:, :512]).reshape(5, 4, 128)
    with np.errstate(invalid="ignore"):
        prod = (vals * scales[:, :, None]).astype(np.float32).reshape(5, 512)
    assert np.array_equal(back[:, :512], fp8.bf16_bits(prod))
    nan = np.isnan(prod)
    assert np.all(back[:, :512][nan] == 0x7FFF) and nan[4, :128].all()
    assert np.array_equal(ref.dequantize_k_cache_reference(q.view(np.int8)).view(np.uint16), back)
    assert np.array_equal(ref.dequantize_k_cache_reference(q.view(E4M3)).view(np.uint16), back)


def test_reference_input_checks():
    with pytest.raises(TypeError, match="bfloat16"):
        ref.quantize_k_cache_reference(np.zeros((2, 576), np.float32))
    with pytest.raises(ValueError, match="576 channels"):
        ref.quantize_k_cache_reference(np.zeros((2, 512), BF16))
    with pytest.raises(ValueError, match="656 bytes"):
        ref.dequantize_k_cache_reference(np.zeros((2, 576), np.uint8))
    k = random_cache(np.random.default_rng(4), (2, 3))
    assert np.array_equal(ref.quantize_k_cache_reference(k), ref.quantize_k_cache_reference(k.view(np.uint16)))
    assert ref.quantize_k_cache_reference(np.zeros((0, 576), BF16)).shape == (0, 656)
