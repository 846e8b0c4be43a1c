"""CPU tests of the FP8-e4m3 KV caches of the paged GQA decode (no GPU):

* the route tables: the e4m3 variants (kv8) of families "paged" (every head dim, every arch) and
  "paged_tma" (head dims >= 128, sm_90a / sm_100a / sm_110a), their names, defines, tilings and
  dynamic shared memory, the compile command's jobs, and select_paged_variant's choice;
* NVRTC builds of every kv8 module for every arch: no spills, no stack, no local memory, fp16 MMAs
  only (bf16 q too), the e4m3 conversion of the arch (integer ops on sm_80, cvt on sm_89+), shared
  memory within the limits;
* gqadrv/gqa/kv_dtype.py: fp8_args_given, kv_is_8bit, check_kv_dtype, KvScales, check_kv_scales;
* the contract with fake CUDA arrays (tests/fakes.py): kv_dtype spellings, scale forms resolved to
  the kernel's (value, pointer, stride), byte strides and the 16-byte rule, the contiguous cache,
  every FP8 argument error, the TMA description of e4m3 pools, the argument block's scale fields;
* the GPU grids' construction (tests/gqa/paged_fp8_cases.py): size and axis coverage, codes,
  scales, poison and table entries of the host cases, the device views (as numpy views).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import re
import struct
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from gqadrv.gqa import kv_dtype as kvd
from gqadrv.gqa import paged, paged_args, routes
from gqadrv.gqa.contract import STATE_ROW_PAD
from gqadrv.gqa.paged_contract import contiguous_problem, validate_paged
from gqadrv.gqa.reference import TABLE_POISON
from tests.fakes import FakeCudaArray, fake
from tests.gqa import paged_fp8_cases as fc

ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)


# ----------------------------------------------------------------------------- route tables
def _kv8(arch: str) -> list:
    return [v for v in routes.variants_for_arch(arch) if v.kv8]


@pytest.mark.parametrize("arch", ARCHES)
def test_kv8_variants_are_registered(arch):
    vs = routes.variants_for_arch(arch)
    got = sorted((v.family.name, v.dtype, v.head_dim, v.rows) for v in _kv8(arch))
    want = [("paged", dt, d, r) for dt in DTYPES for d in HEAD_DIMS for r in (8, 16)]
    if arch != "sm_80":
        want += [("paged_tma", dt, d, r) for dt in DTYPES for d in HEAD_DIMS if d >= 128 for r in (8, 16)]
    assert got == sorted(want)
    for v in vs:
        if v.kv8:
            assert v.family.name in routes.E4M3_FAMILIES and "fp8_e4m3_kv" in v.family.features
            assert "_kve4m3_" in v.name and v.defines["GQA_KV8"] == 1
            assert v.tiling == routes.tiling_for(v.family.name, v.head_dim, True)
        else:
            assert "kve4m3" not in v.name and "GQA_KV8" not in v.defines
    assert len({v.name for v in vs}) == len(vs)                                          # names are unique
    assert len({(v.family.source, tuple(sorted(v.defines.items()))) for v in vs}) == len(vs)  # so are modules


@pytest.mark.parametrize("arch", ARCHES)
def test_compile_command_builds_the_kv8_modules(arch):
    from gqadrv import cli

    names = {j[0] for j in cli.compile_jobs([arch])}
    assert {v.name for v in _kv8(arch)} <= names


def _ceil_kb(n: int) -> int:
    return (n + 1023) // 1024 * 1024


@pytest.mark.parametrize("arch", ARCHES)
def test_kv8_dynamic_smem_formula_and_limits(arch):
    """Ring: warps x stages x (K + V) x max(128, D) bytes x tok (one byte per element; D = 64 rows use
    half of a 128-byte swizzle row), rounded up to 1 KB, or the merge area when that is larger;
    within the portable budget (sm_86 / sm_89) for "paged", the arch's opt-in for "paged_tma"."""
    for v in _kv8(arch):
        t, D, R = v.tiling, v.head_dim, v.rows
        ring = t.warps * t.stages * 2 * max(128, D) * t.tok
        merge = (t.warps * R * 2 + t.warps * R * (D + STATE_ROW_PAD)) * 4
        assert v.dynamic_smem == max(_ceil_kb(ring), _ceil_kb(merge)), v.name
        assert routes.launch_geometry(v, 3, 2, 1)[2] == v.dynamic_smem
        limit = routes.PORTABLE_SMEM_LIMIT if v.family.name == "paged" else routes.ARCH_SMEM_OPTIN[arch]
        assert v.dynamic_smem + 1024 <= limit, (v.name, v.dynamic_smem)
        if v.family.name == "paged":
            assert t.tok in (16, 32)   # the cp.async kernel's offset shuffle: one row per lane


def test_kv8_tilings():
    assert set(routes._TILINGS_E4M3) == {("paged", d) for d in HEAD_DIMS} | {("paged_tma", d) for d in (128, 256)}
    for (fam, d), t in routes._TILINGS_E4M3.items():
        assert routes.tiling_for(fam, d, True) == t
        assert routes.tiling_for(fam, d) == routes._TILINGS[(fam, d)]
    assert routes.E4M3_TMA_MIN_HEAD_DIM == 128


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_paged_variant_for_e4m3_caches(dtype):
    sel = routes.select_paged_variant
    v = sel((9, 0), 64, dtype, 4, tma_ok=True, kv8=True)       # 64-byte e4m3 rows: cp.async
    assert v.family.name == "paged" and v.kv8 and "kve4m3" in v.name and v.tiling == routes.tiling_for("paged", 64, True)
    for d in (128, 256):
        v = sel((9, 0), d, dtype, 32, tma_ok=True, kv8=True)
        assert v.family.name == "paged_tma" and v.kv8 and v.rows == 16
        assert sel((9, 0), d, dtype, 4, tma_ok=False, kv8=True).family.name == "paged"
        assert sel((9, 0), d, dtype, 4, "portable", tma_ok=True, kv8=True).family.name == "paged"
    assert sel((9, 0), 64, dtype, 4, tma_ok=True).family.name == "paged_tma"   # fp16 / bf16 caches unchanged
    assert not sel((9, 0), 64, dtype, 4, tma_ok=True).kv8
    for cc in ((8, 0), (10, 0), (11, 0)):                       # no TMA paged family there (tcgen05: none for FP8)
        for d in HEAD_DIMS:
            v = sel(cc, d, dtype, 8, tma_ok=True, kv8=True)
            assert v.family.name == "paged" and v.kv8


@pytest.mark.parametrize("cc,arch", [((8, 0), "sm_80"), ((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((11, 0), "sm_110a")])
def test_selected_kv8_variants_are_built_by_the_compile_command(cc, arch):
    built = set(routes.variants_for_arch(arch))
    for d, rows, tma in itertools.product(HEAD_DIMS, (1, 8, 9, 64), (False, True)):
        for dt in DTYPES:
            assert routes.select_paged_variant(cc, d, dt, rows, tma_ok=tma, kv8=True) in built


# ----------------------------------------------------------------------------- NVRTC builds
def _compile_targets():
    return [pytest.param(arch, v.name, id=f"{arch}-{v.name}") for arch in ARCHES for v in _kv8(arch)]


@pytest.mark.parametrize("arch,name", _compile_targets())
def test_kv8_module_compiles_without_spills(arch, name, isolated_cache):
    from gqadrv.runtime.compiler import (
        arch_number,
        compile_module,
        nvrtc_supported_archs,
    )

    if arch_number(arch) not in nvrtc_supported_archs():
        pytest.skip(f"this NVRTC cannot target {arch}")
    v = next(x for x in _kv8(arch) if x.name == name)
    m = compile_module(v.family.source, arch, v.defines, cache=isolated_cache)
    r = m.resources[v.family.entry]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (name, r)
    assert 0 < r.registers <= 255, (name, r)
    ptx = m.ptx.decode()
    assert ".local" not in ptx, name
    assert re.findall(r"\.entry (\w+)", ptx) == [v.family.entry]
    mmas = set(re.findall(r"mma\.sync\.aligned\.[\w.]+", ptx))
    assert mmas == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}, mmas   # fp16 MMAs for bf16 q too
    # codes -> fp16: integer ops on sm_80 (no e4m3 cvt there), cvt.rn.f16x2.e4m3x2 by default on sm_89+
    # (kernels/gqa/common/warp.cuh, GQA_KV8_CVT; GQADRV_KV8_CVT=0 selects the integer ops)
    if arch == "sm_80" or os.environ.get("GQADRV_KV8_CVT") == "0":
        assert "e4m3" not in ptx, name
    elif not os.environ.get("GQADRV_KV8_CVT"):
        assert "cvt.rn.f16x2.e4m3x2" in ptx, name
    if v.family.uses_tma:
        assert "cp.async.bulk.tensor" in ptx
    else:
        assert "cp.async.cg.shared.global" in ptx and "cp.async.bulk.tensor" not in ptx
    limit = routes.PORTABLE_SMEM_LIMIT if v.family.name == "paged" else routes.ARCH_SMEM_OPTIN[arch]
    assert r.shared_bytes + v.dynamic_smem <= limit, (name, r.shared_bytes, v.dynamic_smem)


# ----------------------------------------------------------------------------- kv_dtype.py
def test_fp8_args_given():
    assert not kvd.fp8_args_given(None, None, None)
    for args in (("e4m3", None, None), (None, 1.0, None), (None, None, 0.5), ("e5m2", None, None)):
        assert kvd.fp8_args_given(*args)


@pytest.mark.parametrize("dtype,want", [
    ("uint8", True), ("int8", True), ("float8_e4m3fn", True), ("torch.float8_e5m2", True), ("torch.uint8", True),
    (np.dtype(np.uint8), True), (np.dtype(np.int8), True), (np.dtype(ml_dtypes.float8_e4m3fn), True),
    ("float16", False), ("bfloat16", False), (np.dtype(np.float32), False), ("int32", False), (None, False),
])
def test_kv_is_8bit(dtype, want):
    obj = SimpleNamespace() if dtype is None else SimpleNamespace(dtype=dtype)
    assert kvd.kv_is_8bit(obj) is want


def _view(dtype: str, name: str = "k_cache"):
    return SimpleNamespace(dtype=dtype, name=name)


@pytest.mark.parametrize("q_dtype", DTYPES)
def test_check_kv_dtype(q_dtype):
    q = _view(q_dtype, "q")
    for kv_dtype in (None, "e4m3", "E4M3", "float8_e4m3fn", "Float8_E4M3FN"):
        assert kvd.check_kv_dtype(_view("float8_e4m3fn"), q, kv_dtype) is True
    for code in ("uint8", "int8"):
        for kv_dtype in ("e4m3", "float8_e4m3fn", "E4M3"):
            assert kvd.check_kv_dtype(_view(code), q, kv_dtype) is True
        with pytest.raises(TypeError, match=f"k_cache has dtype {code}: for e4m3 codes pass kv_dtype='e4m3'"):
            kvd.check_kv_dtype(_view(code), q, None)
    assert kvd.check_kv_dtype(_view(q_dtype), q, None) is False
    other = "bfloat16" if q_dtype == "float16" else "float16"
    with pytest.raises(TypeError, match="must have the dtype of q"):
        kvd.check_kv_dtype(_view(other), q, None)
    with pytest.raises(TypeError, match="needs a float8_e4m3fn, uint8 or int8 cache"):
        kvd.check_kv_dtype(_view(q_dtype), q, "e4m3")
    for fmt in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        with pytest.raises(TypeError, match="the FP8 caches supported are float8_e4m3fn"):
            kvd.check_kv_dtype(_view(fmt), q, None)
    # dtype objects that spell e4m3fn are accepted like the strings
    for good in (np.dtype(ml_dtypes.float8_e4m3fn), ml_dtypes.float8_e4m3fn, "E4M3", "fp8_e4m3", "torch.float8_e4m3fn"):
        assert kvd.check_kv_dtype(_view("uint8"), q, good) is True
    for bad in ("e5m2", "fp8", "uint8", "", 8, np.uint8, np.dtype(ml_dtypes.float8_e5m2)):
        with pytest.raises(ValueError, match="kv_dtype must be None"):
            kvd.check_kv_dtype(_view("uint8"), q, bad)


def test_kv_scales_defaults_and_no_scales_for_16_bit_caches():
    s = kvd.KvScales()
    assert (s.k_value, s.v_value, s.k_ptr, s.v_ptr, s.k_stride, s.v_stride, s.views) == (1.0, 1.0, 0, 0, 0, 0, ())
    assert not s.per_head and kvd.KvScales(v_stride=1).per_head
    q = None  # not read for 16-bit caches without scales
    assert kvd.check_kv_scales(None, None, False, 4, q, None) == kvd.KvScales()
    assert kvd.check_kv_scales(None, None, True, 4, q, None) == kvd.KvScales()
    for k, v in ((1.0, None), (None, 2.0)):
        with pytest.raises(ValueError, match="apply to FP8"):
            kvd.check_kv_scales(k, v, False, 4, q, None)
    s = kvd.check_kv_scales(0.25, np.float32(3.0), True, 4, q, None)   # numbers: no device pointer
    assert (s.k_value, s.v_value, s.k_ptr, s.v_ptr, s.k_stride, s.v_stride) == (0.25, 3.0, 0, 0, 0, 0)


# ----------------------------------------------------------------------------- the contract with fakes
HKV = 4


def _paged(k_scale=None, v_scale=None, kv_dtype="e4m3", dtype=np.uint8, layout="NHD", combined=False, D=128,
           page=16, q_dtype=np.float16, k_cache=None, v_cache=None, hkv=HKV):
    inner = (page, hkv, D) if layout == "NHD" else (hkv, page, D)
    shape = (10, 2) + inner if combined else (10,) + inner
    k = k_cache if k_cache is not None else fake(shape, dtype)
    v = None if combined else (v_cache if v_cache is not None else fake(shape, dtype))
    return validate_paged(fake((2, 3, 8, D), q_dtype), k, v, fake((2, 5), np.int32), fake((2,), np.int32), layout,
                          None, None, 1.0, None, stream=None, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)


def _ptr(f: FakeCudaArray) -> int:
    return f.a.ctypes.data


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_e4m3_pools_use_byte_strides(layout, combined):
    p = _paged(layout=layout, combined=combined)
    page, D = 16, 128
    assert p.kv8 and p.k.itemsize == 1 and p.kv_bytes_per_token == 2 * HKV * D
    tok, head = (HKV * D, D) if layout == "NHD" else (D, page * D)
    assert (p.tok_stride, p.head_stride) == (tok, head)
    assert p.page_stride == (2 if combined else 1) * page * HKV * D
    if combined:
        assert p.v_ptr - p.k_ptr == page * HKV * D   # bytes: index 1 of dim 1


def test_kv_dtype_spellings_and_code_types():
    for kv_dtype in ("e4m3", "E4M3", "float8_e4m3fn"):
        for dt in (np.uint8, np.int8):
            assert _paged(kv_dtype=kv_dtype, dtype=dt).kv8
    assert not _paged(kv_dtype=None, dtype=np.float16).kv8
    assert _paged().dtype == "float16"   # (numpy's DLPack export has no bf16: fakes are fp16 only)


def test_e4m3_strides_are_16_byte_multiples():
    """The 16-byte rule counts bytes: a 72-element row stride is legal for fp16 (144 bytes), not for
    e4m3 codes; 80 is."""
    def sliced(width, dt):
        a = np.zeros((10, 16, HKV, width), dt)[..., :64]
        return FakeCudaArray(a)

    ok = _paged(D=64, k_cache=sliced(80, np.uint8), v_cache=sliced(80, np.uint8))
    assert ok.head_stride == 80 and ok.tok_stride == HKV * 80
    with pytest.raises(ValueError, match=r"multiples of 16 elements \(16 bytes\)"):
        _paged(D=64, k_cache=sliced(72, np.uint8), v_cache=sliced(72, np.uint8))
    assert _paged(D=64, kv_dtype=None, k_cache=sliced(72, np.float16), v_cache=sliced(72, np.float16)).head_stride == 72


@pytest.mark.parametrize("form", fc.SCALE_FORMS)
@pytest.mark.parametrize("hkv", [1, 4])
def test_scale_forms_resolve_to_value_pointer_stride(form, hkv):
    """None -> (1, null, 0); a number -> (value, null, 0); () / (1,) -> (1, ptr, 0); (Hkv,) -> (1, ptr,
    1), with Hkv = 1 the same as (1,) (stride 0). The device views are kept (prepared launches hold
    them)."""
    vec = np.linspace(0.5, 2.0, hkv).astype(np.float32)
    arg = fc.scale_arg(form, vec, lambda a: FakeCudaArray(np.array(a, np.float32)))
    s = _paged(k_scale=arg, v_scale=0.125, hkv=hkv).scales
    assert (s.v_value, s.v_ptr, s.v_stride) == (0.125, 0, 0)
    if form == "none":
        assert (s.k_value, s.k_ptr, s.k_stride, s.views) == (1.0, 0, 0, ())
    elif form == "float":
        assert (s.k_value, s.k_ptr, s.k_stride, s.views) == (float(vec[0]), 0, 0, ())
    else:
        assert s.k_value == 1.0 and s.k_ptr == _ptr(arg) and len(s.views) == 1
        assert s.k_stride == (1 if form == "head" and hkv > 1 else 0)
        assert s.per_head == (s.k_stride == 1)


def _fp8_bad_contract():
    """(changes to the valid _paged call, error class, message fragment)."""
    f32 = np.float32
    return {
        "k_scale-with-fp16-cache": ({"kv_dtype": None, "dtype": np.float16, "k_scale": 0.5}, ValueError, "apply to FP8"),
        "v_scale-device-with-fp16-cache": ({"kv_dtype": None, "dtype": np.float16, "v_scale": fake((), f32)},
                                           ValueError, "apply to FP8"),
        "uint8-without-kv_dtype": ({"kv_dtype": None}, TypeError, "pass kv_dtype='e4m3'"),
        "int8-without-kv_dtype": ({"kv_dtype": None, "dtype": np.int8}, TypeError, "pass kv_dtype='e4m3'"),
        "kv_dtype-e5m2": ({"kv_dtype": "e5m2"}, ValueError, "kv_dtype must be None"),
        "kv_dtype-with-fp16-cache": ({"dtype": np.float16}, TypeError, "needs a float8_e4m3fn, uint8 or int8"),
        "v-int8-k-uint8": ({"v_cache": fake((10, 16, HKV, 128), np.int8)}, TypeError, "must have the dtype of k_cache"),
        "v-fp16-k-uint8": ({"v_cache": fake((10, 16, HKV, 128), np.float16)}, TypeError,
                           "must have the dtype of k_cache"),
        "q-uint8": ({"q_dtype": np.uint8}, TypeError, "must have dtype float16 or bfloat16"),
        "k_scale-shape-(2,)": ({"k_scale": fake((2,), f32)}, ValueError, r"must have shape \(\) or \(1,\)"),
        "v_scale-shape-(1,1)": ({"v_scale": fake((1, 1), f32)}, ValueError, r"\(4,\) \(per KV head\)"),
        "k_scale-strided": ({"k_scale": FakeCudaArray(np.ones(8, f32)[::2])}, ValueError, "must be contiguous"),
        "k_scale-float16": ({"k_scale": fake((), np.float16)}, TypeError, "must have dtype float32"),
        "v_scale-float64": ({"v_scale": fake((HKV,), np.float64)}, TypeError, "must have dtype float32"),
        "k_scale-zero": ({"k_scale": 0.0}, ValueError, "finite number > 0"),
        "v_scale-negative": ({"v_scale": -1}, ValueError, "finite number > 0"),
        "k_scale-nan": ({"k_scale": math.nan}, ValueError, "finite number > 0"),
        "v_scale-inf": ({"v_scale": -math.inf}, ValueError, "finite number > 0"),
        "k_scale-huge": ({"k_scale": 1e39}, ValueError, "too large"),
        "k_scale-below-normal": ({"k_scale": 1e-39}, ValueError, "smallest normal float32"),
        "v_scale-bool": ({"v_scale": False}, TypeError, "must be None, a positive number"),
        "k_scale-list": ({"k_scale": [0.5]}, TypeError, "must be None, a positive number"),
        "k_scale-host-array": ({"k_scale": np.ones((), f32)}, ValueError, "CUDA array"),
    }


@pytest.mark.parametrize("name", list(_fp8_bad_contract()))
def test_fp8_contract_errors(name):
    change, exc, match = _fp8_bad_contract()[name]
    with pytest.raises(exc, match=match):
        _paged(**change)


def test_contiguous_e4m3_cache():
    B, C, D = 3, 77, 64
    lens = fake((B,), np.int32)
    p = contiguous_problem(fake((B, 4, 8, D)), fake((B, 2, HKV, C, D), np.uint8), lens, None, None, 1.0, None,
                           stream=None, kv_dtype="e4m3", k_scale=fake((HKV,), np.float32), v_scale=2.0)
    assert p.kv8 and p.layout == "contiguous" and p.table is None and p.capacity == C
    assert p.v_ptr - p.k_ptr == HKV * C * D and p.page_stride == 2 * HKV * C * D and p.tok_stride == D
    assert p.scales.k_stride == 1 and p.scales.v_value == 2.0
    for kw, exc, match in (({}, TypeError, "pass kv_dtype='e4m3'"),
                           ({"kv_dtype": "e4m3", "k_scale": fake((2,), np.float32)}, ValueError, "must have shape"),
                           ({"kv_dtype": "nope"}, ValueError, "kv_dtype must be None")):
        with pytest.raises(exc, match=match):
            contiguous_problem(fake((B, 4, 8, D)), fake((B, 2, HKV, C, D), np.uint8), lens, None, None, 1.0, None,
                               stream=None, **kw)
    with pytest.raises(ValueError, match="apply to FP8"):
        contiguous_problem(fake((B, 4, 8, D)), fake((B, 2, HKV, C, D)), lens, None, None, 1.0, None, stream=None,
                           v_scale=0.5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("D", [128, 256])
def test_tma_description_of_e4m3_pools(layout, D):
    """e4m3 boxes are 128 elements (128 bytes) wide, the map's element type uint8, strides bytes."""
    p = _paged(layout=layout, D=D)
    tok = routes.tiling_for("paged_tma", D, True).tok
    k, v = paged._tma_specs(p, tok)
    assert k.dtype == v.dtype == "uint8"
    if layout == "NHD":
        assert k.dims == (D, HKV, 16, 10) and k.box == (128, 1, 16, 1) and k.strides == (D, HKV * D, 16 * HKV * D)
    else:
        assert k.dims == (D, 16, HKV, 10) and k.box == (128, 16, 1, 1) and k.strides == (D, 16 * D, 16 * HKV * D)


def test_tma_maps_of_e4m3_pools(monkeypatch):
    """D 64 e4m3 pools are never described (64-byte rows: the cp.async route), whatever the page
    size; D 128 pools are, with uint8 maps (fake encoder)."""
    import contextlib

    calls = []
    monkeypatch.setattr(paged, "encode_tiled", lambda spec: calls.append(spec) or bytes([len(calls)]) * 128)
    monkeypatch.setattr(paged._drv, "device_scope", lambda dev: contextlib.nullcontext())
    paged._tmaps.clear()
    assert paged.tma_maps(_paged(D=64, page=16)) is None and paged.tma_maps(_paged(D=64, page=64)) is None
    assert calls == []
    maps = paged.tma_maps(_paged(D=128, page=32))
    assert maps is not None and len(calls) == 2 and {c.dtype for c in calls} == {"uint8"}
    assert calls[0].box == (128, 1, min(32, routes.tiling_for("paged_tma", 128, True).tok), 1)
    paged._tmaps.clear()


def test_argument_block_carries_the_scales(monkeypatch):
    """args_fields puts the scales in GqaPagedArgs: device pointers, float32 values, strides."""
    monkeypatch.setattr(paged, "_flags", lambda problem, spec=False, next_stride=0: 0)
    kdev = fake((HKV,), np.float32)
    p = _paged(k_scale=kdev, v_scale=0.1)
    v = routes.select_paged_variant((9, 0), 128, "float16", p.rows, tma_ok=False, kv8=True)
    f = paged.args_fields(p, v, out_ptr=0, lse_ptr=0, ws=None, status_ptr=0, splits=1, split_subs=0)
    assert (f["k_scale"], f["k_scale_value"], f["k_scale_stride"]) == (_ptr(kdev), 1.0, 1)
    assert (f["v_scale"], f["v_scale_value"], f["v_scale_stride"]) == (0, 0.1, 0)
    kind = paged_args.GQA_PAGED_ARGS
    names = [n for n, _, _ in kind.fields]
    back = dict(zip(names, struct.unpack(kind.fmt, struct.pack(kind.fmt, *[f[n] for n in names]))))
    assert back["v_scale_value"] == np.float32(0.1) and back["k_scale"] == _ptr(kdev)


# ----------------------------------------------------------------------------- the GPU grids' construction
def test_grid_size_and_axes():
    g = fc.grid()
    assert len(g) == fc.N_CASES >= 220 and len({c.id for c in g}) == len(g)
    n = len(g)

    def count(attr):
        return collections.Counter(getattr(c, attr) for c in g)

    balanced = {"layout": 2, "combined": 2, "page": 9, "s_q": 5, "group": 4, "d": 3, "dtype": 2, "call": 2,
                "lse_mode": 3, "scale": 3, "table": 3, "poison": 2, "k_form": 5, "v_form": 5}
    for attr, k in balanced.items():
        c = count(attr)
        assert min(c.values()) >= n // max(k, len(c)) - 1, (attr, c)
    assert count("codes")["special"] == n // 3
    cache = count("cache")
    assert cache["torch"] >= 15 and cache["int8"] >= 30
    spell = count("kv_dtype")
    assert spell[None] == cache["torch"] and all(spell[s] >= 40 for s in ("e4m3", "E4M3", "float8_e4m3fn"))
    assert count("backend")["portable"] >= 50 and count("deterministic")[True] >= 50
    assert all(count("splits")[s] >= 20 for s in (None, 1, 2, 3, 5, 8))
    assert all(count("pool")[p] >= 20 for p in ("dense", "offset", "strided", "kvpair"))
    assert sum(c.q3d for c in g) >= 20 and sum(bool(c.share) for c in g) >= 80
    assert sum(c.out_given for c in g) >= 40
    assert sum(c.k_form != c.v_form for c in g) >= 0.7 * n
    assert {(c.k_form, c.v_form) for c in g} == set(itertools.product(fc.SCALE_FORMS, fc.SCALE_FORMS))
    assert {(c.page, c.d) for c in g} == set(itertools.product((1, 2, 4, 8, 16, 32, 64, 128, 256), HEAD_DIMS))
    tma_shaped = [c for c in g if c.page >= 16 and c.d >= 128 and c.backend is None]
    assert len(tma_shaped) >= 40   # the TMA kernel's cases on an H200
    for c in g:
        cap = c.capacity
        assert c.batch <= 6 and cap <= fc.MAX_CAPACITY
        assert c.batch * c.hq * c.s_q * cap * c.d <= fc.WORK_MAX or c.batch == c.max_pages == 1   # one page at least
        assert any(x <= 0 or x >= cap for x in c.lengths)          # zero, negative, > or = capacity
        assert not (c.deterministic and c.splits is not None)
        assert c.call == "convenience" or not c.out_given


def _used_slots(h) -> np.ndarray:
    """[num_pages, page] True where some request keeps a key (t < its clamped length)."""
    c = h.case
    used = np.zeros((h.k_codes.shape[0], c.page), bool)
    for b, n in enumerate(h.seq_lens):
        n = min(max(int(n), 0), c.capacity)
        for t in range(0, n, c.page):
            used[h.block_table[b, t // c.page], : min(c.page, n - t)] = True
    return used


@pytest.mark.parametrize("case", fc.grid()[::6], ids=lambda c: c.id)
def test_host_case_codes_scales_and_poison(case):
    """Every sixth grid case: the stored codes are NaN codes exactly where no request keeps a key;
    the dequantized caches are code value x the head's scale (checked against ml_dtypes' own e4m3
    decoding); scales follow the forms; special cases hold the special code sets (V without +-448
    when its scale is 1); table entries past the used pages are TABLE_POISON; the oracle is finite;
    the device views (numpy here) hold the host caches."""
    h = fc.host_case(case)
    used = _used_slots(h)
    ha = 2 if case.layout == "NHD" else 1
    k = h.k_codes[:, 0] if case.combined else h.k_codes
    v = h.k_codes[:, 1] if case.combined else h.v_codes
    tok_axis = 1 if case.layout == "NHD" else 2
    for codes, deq, scale, form in ((k, h.k_deq, h.k_scale, case.k_form), (v, h.v_deq, h.v_scale, case.v_form)):
        tok_major = np.moveaxis(codes, tok_axis, 1)                          # [P, page, ...]
        nan_code = (tok_major & 0x7F) == 0x7F
        assert np.array_equal(nan_code.all(axis=(2, 3)), ~used) and not nan_code[used].any()
        shape = [1] * 4
        shape[ha] = -1
        want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale.astype(np.float64).reshape(shape)
        assert np.array_equal(np.isnan(deq), np.isnan(want)) and np.array_equal(deq[~np.isnan(deq)],
                                                                                want[~np.isnan(want)])
        if form == "none":
            assert np.all(scale == 1)
        elif form != "head":
            assert np.all(scale == scale[0]) and scale[0] > 0
        valid = tok_major[used]                                               # [keys, Hkv, D] codes
        if case.codes == "special":
            present = set(np.unique(valid).tolist())
            if form == "none" and codes is v:
                assert not present & {0x7E, 0xFE}
            # a whole token of +-0 per request with keys; the sprinkled 5% show every class in bigger caches
            assert valid.size == 0 or present & {0x00, 0x80}
            if valid.size >= 20000:
                assert {0x00, 0x80} <= present and present & set(range(1, 8)) and present & set(range(0x81, 0x88))
                assert codes is v and form == "none" or present & {0x7E, 0xFE}
    if case.poison == "alt" and (~used).any():
        assert np.any(k == 0xFF)
    assert fc.unused_table_entries_poisoned(h)
    assert np.all(np.isfinite(h.ref_out))
    empty = np.isposinf(h.ref_lse)
    assert np.all(h.ref_out[empty] == 0) and np.all(np.isfinite(h.ref_lse[~empty]))
    d = fc.device_case(h, framework="numpy")
    kview = d.k_cache.view(np.uint8)
    assert np.array_equal(kview, h.k_codes) and kview.dtype == np.uint8
    assert (d.k_cache.dtype == np.int8) == (case.cache == "int8")
    if not case.combined:
        assert np.array_equal(d.v_cache.view(np.uint8), h.v_codes)
    else:
        assert d.v_cache is None
    assert np.array_equal(d.block_table, h.block_table) and np.array_equal(d.seq_lens, h.seq_lens)
    for arg, form, scale in ((d.k_scale, case.k_form, h.k_scale), (d.v_scale, case.v_form, h.v_scale)):
        want_shape = {"dev0": (), "dev1": (1,), "head": (case.hkv,)}.get(form)
        if form == "none":
            assert arg is None
        elif form == "float":
            assert isinstance(arg, float) and arg == scale[0]
        else:
            assert arg.shape == want_shape and arg.dtype == np.float32 and np.all(arg == scale[: arg.size])
    assert d.kv_dtype == case.kv_dtype


def test_contiguous_grid_and_host_cases():
    g = fc.contiguous_grid()
    assert len(g) == fc.N_CONTIG and len({c.id for c in g}) == len(g)
    assert sum(c.q3d for c in g) >= 2 and sum(not c.q3d and c.s_q == 1 for c in g) >= 1
    assert {c.call for c in g} == {"convenience", "prepared"} and {c.lse_mode for c in g} == {"none", "return", "given"}
    assert {c.k_form for c in g} == set(fc.SCALE_FORMS) == {c.v_form for c in g}
    assert {c.cache for c in g} == {"uint8", "int8"} and any(c.deterministic for c in g)
    assert any(c.C & (c.C - 1) for c in g)    # capacities that are not powers of two
    for c in g:
        h = fc.contiguous_host_case(c)
        assert 0 in c.lengths and c.C in c.lengths and any(x > c.C for x in c.lengths)
        for b, n in enumerate(c.lengths):
            n = min(max(int(n), 0), c.C)
            assert np.all((h.kv_codes[b, :, :, n:] & 0x7F) == 0x7F)          # NaN codes past the length
            assert not np.any((h.kv_codes[b, :, :, :n] & 0x7F) == 0x7F)
        assert np.all(np.isfinite(h.ref_out))
        empty = np.isposinf(h.ref_lse)
        assert np.all(h.ref_out[empty] == 0)


def test_quantize_and_dequantize_helpers():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 40, 4, 64), dtype=np.float32) * np.array([0.1, 1, 10, 100], np.float32)[:, None]
    for form in fc.SCALE_FORMS:
        codes, s = fc.quantize(x, form, 2)
        assert codes.dtype == np.uint8 and s.shape == (4,) and s.dtype == np.float32
        back = fc.dequantize(codes, s, 2)
        amax = np.abs(x).max(axis=(0, 1, 3))
        if form == "head":
            np.testing.assert_allclose(s, amax / 448, rtol=1e-6)
            assert np.all(np.abs(back).max(axis=(0, 1, 3)) <= amax * (1 + 1e-6))     # nothing saturates
        elif form != "none":
            assert np.all(s == np.float32(amax.max() / np.float32(448)))
        if form != "none":   # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 (normal codes)
            big = np.abs(x) >= 2.0 ** -6 * s.reshape(1, 1, -1, 1)
            assert np.all(np.abs(back - x)[big] <= 2.0 ** -4 * np.abs(x)[big] + 1e-7)
    p = fc.poison_codes((2, 3, 6), "alt")
    assert np.all(p[..., ::2] == 0x7F) and np.all(p[..., 1::2] == 0xFF)
    assert np.all(fc.poison_codes((5,), "nan") == 0x7F)
    sp = fc.SPECIAL_CODES
    assert {0x7E, 0xFE, 0x00, 0x80} <= set(sp.tolist()) and all(c & 0x78 == 0 for c in sp if c not in (0x7E, 0xFE))


def test_table_poison_is_the_shared_constant():
    assert TABLE_POISON == 2147480000
