"""FP8-e4m3 KV quantizer (gqadrv.quantize_kv_fp8) without a GPU: the contract (every error before any
launch), the argument struct against kernels/gqa/smxx/kv_fp8.cu, the launch fields of each scale
mode, the CLI registration, an NVRTC compile of every module for every registered arch (no spills,
no local memory, the e4m3 cvt only where it exists) and the numpy reference (computed scale, per-head
scales, saturation, NaN / Inf, rounding)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from gqadrv.gqa import fp8_reference as ref
from gqadrv.gqa import kv_fp8
from gqadrv.ops import fp8
from gqadrv.runtime.compiler import kernels_root
from tests.fakes import FakeCudaArray, fake

SHAPE = (2, 5, 4, 64)      # [num_blocks, page, Hkv, D]


def run(x=None, scale=None, head_axis=None, out=None, out_scale=None):
    x = x if x is not None else fake(SHAPE)
    return kv_fp8.validate(x, scale, head_axis, out, out_scale, stream=None)


# ----------------------------------------------------------------------------- contract
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_scale_modes(dtype):
    p = run(fake(SHAPE, dtype))
    assert (p.mode, p.n, p.groups, p.heads, p.inner, p.dtype) == ("computed", 2560, 160, 1, 1, np.dtype(dtype).name)
    p = run(scale=0.5)
    assert (p.mode, p.scale_value) == ("value", 0.5)
    assert run(scale=np.float32(0.1)).scale_value == float(np.float32(0.1))
    assert run(scale=3).scale_value == 3.0
    for sh in ((), (1,), (1, 1)):
        p = run(scale=fake(sh, np.float32))
        assert p.mode == "tensor" and p.scale is not None
    p = run(scale=fake((4,), np.float32), head_axis=-2)
    assert (p.mode, p.heads, p.inner) == ("head", 4, 64)
    p = run(scale=fake((5,), np.float32), head_axis=1)
    assert (p.mode, p.heads, p.inner) == ("head", 5, 256)
    p = run(scale=fake((64,), np.float32), head_axis=3)
    assert (p.heads, p.inner) == (64, 1)
    p = run(scale=fake((2,), np.float32), head_axis=0)
    assert (p.heads, p.inner) == (2, 1280)
    p = run(scale=fake((1,), np.float32), head_axis=0, x=fake((1, 7)))   # one head: per head all the same
    assert (p.mode, p.heads, p.inner) == ("head", 1, 7)
    # outputs
    for dt in (np.uint8, np.int8):
        run(out=fake(SHAPE, dt), out_scale=fake((), np.float32))
    run(out_scale=fake((1,), np.float32))
    # any shape, including 0-d and empty
    assert run(fake((), np.float32)).n == 1
    p = run(fake((0, 8), np.float32))
    assert p.n == 0 and p.groups == 0
    assert run(fake((17,))).groups == 2


@pytest.mark.parametrize("kw,exc,msg", [
    ({"x": fake(SHAPE, np.float64)}, TypeError, "x must have dtype float16 or bfloat16 or float32, got float64"),
    ({"x": fake(SHAPE, np.int8)}, TypeError, "x must have dtype"),
    ({"x": FakeCudaArray(np.zeros((64, 4), np.float16).T)}, ValueError, "x must be contiguous"),
    ({"x": np.zeros(SHAPE, np.float16)}, ValueError, "x must be a CUDA array"),
    ({"scale": 0.0}, ValueError, "scale must be a finite number > 0"),
    ({"scale": -1.0}, ValueError, "scale must be a finite number > 0"),
    ({"scale": float("nan")}, ValueError, "finite number > 0"),
    ({"scale": float("inf")}, ValueError, "finite number > 0"),
    ({"scale": 1e39}, ValueError, "too large"),
    ({"scale": 1e-40}, ValueError, "not a normal float32 number"),
    ({"scale": True}, TypeError, "scale must be None, a number or a float32 device array"),
    ({"scale": "0.5"}, TypeError, "scale must be None, a number or a float32 device array"),
    ({"scale": [0.5]}, TypeError, "scale must be None, a number"),
    ({"scale": np.array(0.5, np.float32)}, ValueError, "scale must be a CUDA array"),
    ({"scale": fake((), np.float16)}, TypeError, "scale must have dtype float32, got float16"),
    ({"scale": fake((4,), np.float32)}, ValueError, r"per-tensor device scale has one element .* need head_axis"),
    ({"scale": fake((), np.float32, device=1)}, ValueError, "share one device"),
    ({"scale": 0.5, "head_axis": -2}, ValueError, "head_axis needs per-head scales as a device float32 array"),
    ({"head_axis": 1}, ValueError, "a computed scale is per tensor"),
    ({"scale": fake((4,), np.float32), "head_axis": 4}, ValueError, "head_axis 4 is out of range for x with 4"),
    ({"scale": fake((4,), np.float32), "head_axis": -5}, ValueError, "out of range"),
    ({"scale": fake((4,), np.float32), "head_axis": True}, TypeError, "head_axis must be None or an int"),
    ({"scale": fake((4,), np.float32), "head_axis": 2.0}, TypeError, "head_axis must be None or an int"),
    ({"scale": fake((5,), np.float32), "head_axis": -2}, ValueError, r"per-head scales must have shape \(4,\)"),
    ({"scale": fake((4, 1), np.float32), "head_axis": 2}, ValueError, r"per-head scales must have shape \(4,\)"),
    ({"scale": FakeCudaArray(np.zeros(8, np.float32)[::2]), "head_axis": 2}, ValueError, "scale must be contiguous"),
    ({"out": fake((2, 5, 4, 65), np.uint8)}, ValueError, r"out must have x's shape \(2, 5, 4, 64\)"),
    ({"out": fake(SHAPE, np.float16)}, TypeError, "out must have dtype uint8 or int8 or float8_e4m3fn"),
    ({"out": FakeCudaArray(np.zeros((2, 5, 64, 4), np.uint8).swapaxes(-1, -2))}, ValueError, "out must be contiguous"),
    ({"out": fake(SHAPE, np.uint8, device=2)}, ValueError, "share one device"),
    ({"scale": 0.5, "out_scale": fake((), np.float32)}, ValueError, "give it only with scale=None"),
    ({"scale": fake((), np.float32), "out_scale": fake((), np.float32)}, ValueError, "only with scale=None"),
    ({"out_scale": fake((), np.float16)}, TypeError, "out_scale must have dtype float32"),
    ({"out_scale": fake((2,), np.float32)}, ValueError, r"out_scale must hold one element"),
    ({"out_scale": fake((), np.float32, device=1)}, ValueError, "share one device"),
])
def test_contract_errors(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        run(**kw)


def test_outputs_must_not_overlap_the_inputs():
    buf = np.zeros(4096, np.float32)
    x = FakeCudaArray(buf[:1024].reshape(16, 64))
    with pytest.raises(ValueError, match="out must not overlap x"):
        run(x, out=FakeCudaArray(buf[512:768].view(np.uint8).reshape(16, 64)))
    with pytest.raises(ValueError, match="out must not overlap scale"):
        run(x, scale=FakeCudaArray(buf[2000:2001]), out=FakeCudaArray(buf[1950:2206].view(np.uint8).reshape(16, 64)))
    with pytest.raises(ValueError, match="out_scale must not overlap x"):
        run(x, out_scale=FakeCudaArray(buf[7:8]))
    with pytest.raises(ValueError, match="out_scale must not overlap out"):
        run(x, out=FakeCudaArray(buf[1024:1280].view(np.uint8).reshape(16, 64)),
            out_scale=FakeCudaArray(buf[1100:1101]))
    run(x, out=FakeCudaArray(buf[1024:1280].view(np.uint8).reshape(16, 64)), out_scale=FakeCudaArray(buf[3000:3001]))


def test_public_call_refuses_head_axis_without_scales_before_any_gpu_work():
    import gqadrv

    with pytest.raises(ValueError, match="a computed scale is per tensor"):
        gqadrv.quantize_kv_fp8(fake(SHAPE), head_axis=-2)


# ----------------------------------------------------------------------------- launch fields
def test_launch_fields_of_each_mode():
    p = run(scale=0.25)
    f = kv_fp8.args_fields(p, 0x20000, 0)
    vec = kv_fp8.KVFP8_FLAG_VEC16 if p.x.ptr % 16 == 0 else 0
    assert f == {"x": p.x.ptr, "out": 0x20000, "scale": 0, "n": 2560, "inner": 1, "groups": 160, "heads": 1,
                 "flags": vec, "scale_value": 0.25}
    p = run(scale=fake((), np.float32))
    f = kv_fp8.args_fields(p, 0x20000, 0x3000)
    assert f["flags"] == kv_fp8.KVFP8_FLAG_SCALE_PTR | vec and f["scale"] == 0x3000 and f["scale_value"] == 1.0
    p = run(scale=fake((4,), np.float32), head_axis=-2)
    f = kv_fp8.args_fields(p, 0x20008, 0x3000)   # an output that is not 16-byte aligned: element path
    assert f["flags"] == kv_fp8.KVFP8_FLAG_SCALE_PTR | kv_fp8.KVFP8_FLAG_PER_HEAD
    assert (f["heads"], f["inner"]) == (4, 64)
    p = run()
    f = kv_fp8.args_fields(p, 0x20000, 0x3000)
    assert f["flags"] == kv_fp8.KVFP8_FLAG_SCALE_PTR | vec
    raw = np.zeros(2 * 2560 + 8, np.float16)
    off = (-raw.ctypes.data % 16) // 2 + 1
    p = run(FakeCudaArray(raw[off:off + 2560].reshape(SHAPE)), scale=1.0)
    assert not kv_fp8.args_fields(p, 0x20000, 0)["flags"] & kv_fp8.KVFP8_FLAG_VEC16
    assert kv_fp8.grid_for(0, 100) == 1 and kv_fp8.grid_for(160, 100) == 1 and kv_fp8.grid_for(10**6, 100) == 100
    assert kv_fp8.grid_for(257 * 256, 2**31 - 1) == 257


# ----------------------------------------------------------------------------- kernel struct mirror
def _source() -> str:
    return (kernels_root() / "gqa" / "smxx" / "kv_fp8.cu").read_text()


def test_argument_struct_matches_the_kernel():
    from tests.helpers import c_struct_fields, python_struct_fields

    text = _source()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "KvFp8Args")]
    assert c == python_struct_fields(kv_fp8.KVFP8_ARGS)
    assert kv_fp8.KVFP8_ARGS.size == 64
    defs = {k: int(v, 0) for k, v in re.findall(r"#define (KVFP8_\w+) (0x[0-9a-fA-F]+|\d+)", text)}
    assert defs["KVFP8_THREADS"] == kv_fp8.THREADS and defs["KVFP8_GROUP"] == kv_fp8.GROUP
    assert defs["KVFP8_FLAG_SCALE_PTR"] == kv_fp8.KVFP8_FLAG_SCALE_PTR
    assert defs["KVFP8_FLAG_PER_HEAD"] == kv_fp8.KVFP8_FLAG_PER_HEAD
    assert defs["KVFP8_FLAG_VEC16"] == kv_fp8.KVFP8_FLAG_VEC16
    assert defs["KVFP8_SCALE_FLOOR"] == kv_fp8.KVFP8_SCALE_FLOOR
    assert np.uint32(kv_fp8.KVFP8_SCALE_FLOOR).view(np.float32) == ref.SCALE_FLOOR == np.float32(2.0**-126)
    entries = [ln for ln in text.splitlines() if ln.startswith('extern "C" __global__')]
    assert len(entries) == 2
    assert "kv_fp8_amax(const KvFp8Args args)" in entries[0] and "kv_fp8_quantize(const KvFp8Args args)" in entries[1]
    assert kv_fp8.SIGNATURE.names == ("args",) and kv_fp8.SIGNATURE.size == 64


def test_kernel_file_opens_with_the_header_comment():
    head = _source().split("#include")[0]
    for part in ("CTA work", "Warps", "Smem map", "Barriers", "Semantics", "Amax"):
        assert part in head, part


# ----------------------------------------------------------------------------- registry / CLI
def test_family_registration_and_cli_jobs():
    from gqadrv import cli

    for fam in (kv_fp8.AMAX, kv_fp8.QUANTIZE):
        assert fam.arches == ("sm_80", "sm_90a", "sm_100a", "sm_110a") and fam.source == "gqa/smxx/kv_fp8.cu"
    names = [f"kv_fp8_{op}_{dt}" for op in ("amax", "quantize") for dt in ("float16", "bfloat16", "float32")]
    vs = kv_fp8.variants_for_arch("sm_90a")
    assert [v.name for v in vs] == names
    assert [v.defines for v in vs] == [{"KVFP8_DT": dt, "KVFP8_OP": op} for op in (0, 1) for dt in (0, 1, 2)]
    assert kv_fp8.variants_for_arch("sm_75") == []
    assert kv_fp8.OP in cli._ops() and kv_fp8.OP.name == "kv_fp8"
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_110a", "sm_120"):
        jobs = [j for j in cli.compile_jobs([arch]) if j[2] == kv_fp8.SOURCE]
        assert [j[0] for j in jobs] == names, arch
        assert len({(j[2], tuple(sorted(j[4].items()))) for j in jobs}) == len(jobs)   # distinct modules
    assert "hardware cvt" in kv_fp8.OP.describe((10, 0)) and "software" in kv_fp8.OP.describe((8, 0))
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        kv_fp8.OP.describe((7, 0))
    import gqadrv

    assert "quantize_kv_fp8" in gqadrv.__all__ and gqadrv.quantize_kv_fp8 is kv_fp8.quantize_kv_fp8


def test_selftest_cpu_case():
    cases = kv_fp8.OP.selftest(np.random.default_rng(0), gpu=False)
    assert len(cases) == 1 and cases[0][2], cases


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a", "sm_110a"])
def test_every_module_compiles_for_every_registered_arch(arch, isolated_cache):
    from gqadrv.runtime.compiler import compile_module

    for v in kv_fp8.variants_for_arch(arch):
        m = compile_module(v.family.source, arch, v.defines, cache=isolated_cache)
        r = m.resources[v.family.entry]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (arch, v.name, r)
        assert r.registers <= 96, (arch, v.name, r)
        ptx = m.ptx.decode()
        assert ".local" not in ptx, v.name
        assert re.findall(r"\.entry (\w+)", ptx) == [v.family.entry]
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx, v.name
        assert ("griddepcontrol.wait" in ptx) == (arch != "sm_80"), v.name
        if v.family is kv_fp8.AMAX:
            assert r.shared_bytes == 32 and "max.u32" in ptx and "e4m3" not in ptx, v.name
        else:
            assert r.shared_bytes == 0 and "st.global.v4.u32" in ptx
            assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (arch != "sm_80"), (arch, v.name)
            assert "div.rn.f32" in ptx   # IEEE division: code = e4m3(x / s), as vLLM's cache writer


# ----------------------------------------------------------------------------- numpy reference
def test_computed_scale():
    f = np.float32
    x = np.array([[1.0, -3.5, 0.25], [np.nan, np.inf, -np.inf]], f)
    assert ref.computed_scale(x) == f(f(3.5) / f(448))
    assert ref.computed_scale(np.zeros(5, f)) == np.float32(2.0**-126)
    assert ref.computed_scale(np.array([np.nan, np.inf], f)) == np.float32(2.0**-126)
    assert ref.computed_scale(np.zeros(0, f)) == np.float32(2.0**-126)
    assert ref.computed_scale(np.array([1e-40], f)) == np.float32(2.0**-126)       # amax / 448 below the floor
    assert ref.computed_scale(np.array([3.0e38], f)) == f(f(3.0e38) / f(448))
    bf = np.array([1.0, -7.0], ml_dtypes.bfloat16)
    assert ref.computed_scale(bf) == f(f(7.0) / f(448))
    codes, s = ref.quantize_kv_fp8_reference(x)
    assert s.shape == () and s == ref.computed_scale(x)
    assert codes[1, 0] == 0x7F and codes[1, 1] == 0x7E and codes[1, 2] == 0xFE
    assert codes[0, 1] == 0xFE                     # amax maps to -448 exactly
    assert codes[0, 0] == fp8.e4m3_from_f32(np.array([f(1.0) / s], f))[0]


def test_given_scales_saturate_and_keep_nan():
    x = np.array([0.0, -0.0, 1.0, 300.0, -1000.0, np.nan, np.inf, 1e-9], np.float32)
    codes, s = ref.quantize_kv_fp8_reference(x, 0.5)
    assert float(s) == 0.5
    assert list(codes) == [0x00, 0x80, fp8.e4m3_from_f32(np.array([2.0], np.float32))[0], 0x7E, 0xFE, 0x7F, 0x7E, 0x00]
    back = ref.dequantize_kv_fp8_reference(codes, 0.5)
    assert back[2] == 1.0 and back[3] == 224.0 and back[4] == -224.0 and np.isnan(back[5])


def test_division_is_float32_then_e4m3():
    """code = e4m3(fl32(x / s)): the float32 quotient first (double rounding is part of the definition,
    as in the kernels and vLLM's writer); both e4m3 models agree on it."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(200_000) * 10).astype(np.float32)
    s = np.float32(0.0371)
    codes, _ = ref.quantize_kv_fp8_reference(x, s)
    q = (x / s).astype(np.float32)
    assert np.array_equal(codes, fp8.e4m3_from_f32(q))
    assert np.array_equal(codes, fp8.e4m3_from_f32_ml_dtypes(q))
    for dt in (np.float16, ml_dtypes.bfloat16):
        xd = x.astype(dt)
        c, _ = ref.quantize_kv_fp8_reference(xd, s)
        assert np.array_equal(c, fp8.e4m3_from_f32((xd.astype(np.float32) / s).astype(np.float32)))


def test_per_head_scales_index_the_head_axis():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 7, 4, 16)).astype(np.float32)
    scales = np.array([0.01, 0.02, 0.05, 0.1], np.float32)
    codes, s = ref.quantize_kv_fp8_reference(x, scales, head_axis=-2)
    assert s.shape == (4,)
    for h in range(4):
        assert np.array_equal(codes[:, :, h], ref.quantize_kv_fp8_reference(x[:, :, h], scales[h])[0])
    codes1, _ = ref.quantize_kv_fp8_reference(x.transpose(0, 2, 1, 3).copy(), scales, head_axis=1)
    assert np.array_equal(codes1, codes.transpose(0, 2, 1, 3))
    back = ref.dequantize_kv_fp8_reference(codes, scales, head_axis=2)
    inside = np.abs(x) <= 448 * scales[None, None, :, None]
    err = np.abs(back - x)
    bound = np.abs(x) * 2.0**-4 + scales[None, None, :, None] * 2.0**-10
    assert np.all(err[inside] <= bound[inside])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        ref.quantize_kv_fp8_reference(x, scales[:3], head_axis=2)
    with pytest.raises(ValueError, match="per-tensor scale has one element"):
        ref.quantize_kv_fp8_reference(x, scales)
    with pytest.raises(ValueError, match="head_axis needs per-head scales"):
        ref.quantize_kv_fp8_reference(x, None, head_axis=2)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        ref.quantize_kv_fp8_reference(x.astype(np.float64))


def test_round_trip_with_the_computed_scale():
    rng = np.random.default_rng(7)
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32):
        x = (rng.standard_normal((64, 128)) * 5).astype(dt)
        codes, s = ref.quantize_kv_fp8_reference(x)
        xf = x.astype(np.float32)
        back = ref.dequantize_kv_fp8_reference(codes, s)
        assert np.all(np.abs(back - xf) <= np.abs(xf) * 2.0**-4 * (1 + 2.0**-10) + s * 2.0**-9)
        assert np.max(np.abs(fp8.e4m3_to_f32(codes))) <= 448
        assert np.max(np.abs(fp8.e4m3_to_f32(codes))) >= 416   # the amax lands near the top of the range
