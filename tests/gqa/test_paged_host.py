"""CPU tests of the paged GQA host side: the argument mirror, the contract (with fake CUDA arrays),
the address formula of every layout, the TMA map description, the split rules and routing."""

import re

import numpy as np
import pytest

from gqadrv.gqa import paged, paged_args, routes
from gqadrv.gqa.paged_contract import contiguous_problem, validate_paged
from tests.fakes import fake


def test_paged_argument_block_layout():
    from gqadrv.runtime.compiler import kernels_root
    from tests.helpers import c_struct_fields, python_struct_fields

    text = (kernels_root() / "gqa" / "common" / "paged_args.cuh").read_text()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "GqaPagedArgs")]
    assert c == python_struct_fields(paged_args.GQA_PAGED_ARGS)
    assert int(re.search(r"#define GQA_PAGED_FLAG_HND (\d+)", text).group(1)) == paged_args.GQA_PAGED_FLAG_HND
    assert int(re.search(r"#define GQA_PAGED_NEXT_SHIFT (\d+)", text).group(1)) == paged_args.GQA_PAGED_NEXT_SHIFT
    assert paged_args.SIG_PAGED_TMA.offsets[:2] == (0, 128)


def _element_offset(p, page, tok, head):
    return p.page_stride * page + p.tok_stride * tok + p.head_stride * head


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True])
def test_address_formula_matches_numpy_indexing(layout, combined):
    """The kernel's element address page*page_stride + tok*tok_stride + head*head_stride (+ d) is
    the numpy address of k[page, tok, head] (NHD) / k[page, head, tok] (HND) for every form."""
    P, page, Hkv, D = 5, 4, 3, 64
    inner = (page, Hkv, D) if layout == "NHD" else (Hkv, page, D)
    shape = (P, 2) + inner if combined else (P,) + inner
    data = np.arange(np.prod(shape)).reshape(shape)  # exact positions
    k = fake(shape)
    v = None if combined else fake(shape)
    q = fake((2, 6, D))
    p = validate_paged(q, k, v, fake((2, 3), np.int32), fake((2,), np.int32), layout, None, None, 1.0, None,
                       stream=None)
    flat = data.reshape(-1)
    kview = data[:, 0] if combined else data
    for pg, tok, h in [(0, 0, 0), (4, 3, 2), (2, 1, 1)]:
        want = kview[pg, tok, h, 0] if layout == "NHD" else kview[pg, h, tok, 0]
        assert flat[_element_offset(p, pg, tok, h)] == want
    if combined:
        assert (p.v_ptr - p.k_ptr) // 2 == int(np.prod(shape[2:]))


def test_contiguous_cache_is_one_page_per_request():
    B, Hkv, C, D = 3, 2, 40, 64
    kv = np.arange(B * 2 * Hkv * C * D).reshape(B, 2, Hkv, C, D)
    p = contiguous_problem(fake((B, 4, D)), fake((B, 2, Hkv, C, D)), fake((B,), np.int32), None, None, 1.0, None,
                           stream=None)
    assert p.table is None and p.num_pages == B and p.capacity == C and p.layout == "contiguous"
    flat = kv.reshape(-1)
    assert flat[_element_offset(p, 2, 7, 1)] == kv[2, 0, 1, 7, 0]
    assert flat[_element_offset(p, 2, 7, 1) + (p.v_ptr - p.k_ptr) // 2] == kv[2, 1, 1, 7, 0]


@pytest.mark.parametrize("bad, exc, match", [
    (dict(kv_layout="XYZ"), ValueError, "kv_layout"),
    (dict(page=3), ValueError, "power of two"),
    (dict(table_dtype=np.int64), TypeError, "int32"),
    (dict(s_q=17), ValueError, "s_q"),
    (dict(v_shape=(10, 16, 2, 128)), ValueError, "shape of k_cache"),
    (dict(lse_shape=(2, 8)), ValueError, "lse must have shape"),
    (dict(group=3), ValueError, "multiple of num_kv_heads"),
    (dict(lens_dtype=np.int64), TypeError, "int32"),
])
def test_paged_contract_errors(bad, exc, match):
    page = bad.get("page", 16)
    s_q = bad.get("s_q", 2)
    Hq = 6 if bad.get("group") else 8
    q = fake((2, s_q, Hq, 128))
    k = fake((10, page, 4, 128))
    v = fake(bad.get("v_shape", (10, page, 4, 128)))
    t = fake((2, 5), bad.get("table_dtype", np.int32))
    lens = fake((2,), bad.get("lens_dtype", np.int32))
    lse = fake(bad["lse_shape"], np.float32) if "lse_shape" in bad else None
    with pytest.raises(exc, match=match):
        validate_paged(q, k, v, t, lens, bad.get("kv_layout", "NHD"), None, lse, 1.0, None, stream=None)


def test_strides_must_be_16_byte_multiples():
    big = np.zeros((10, 16, 4, 136), np.float16)[:, :, :, :128]   # row stride 136: fine (multiple of 8)
    ok = validate_paged(fake((2, 8, 128)), _wrap(big), _wrap(big), fake((2, 3), np.int32), fake((2,), np.int32),
                        "NHD", None, None, 1.0, None, stream=None)
    assert ok.head_stride == 136
    odd = np.zeros((10, 16, 4, 132), np.float16)[:, :, :, :128]
    with pytest.raises(ValueError, match="multiples of 8"):
        validate_paged(fake((2, 8, 128)), _wrap(odd), _wrap(odd), fake((2, 3), np.int32), fake((2,), np.int32),
                       "NHD", None, None, 1.0, None, stream=None)


def _wrap(a):
    from tests.fakes import FakeCudaArray

    return FakeCudaArray(a)


def test_deterministic_split_size_is_fixed():
    # 2048 tokens per split whatever the capacity, until 64 splits are not enough
    assert paged.deterministic_split_subs(4096, 32) == (2, 64)
    assert paged.deterministic_split_subs(100, 32) == (1, 64)
    assert paged.deterministic_split_subs(2048 * 64, 16) == (64, 128)
    s, subs = paged.deterministic_split_subs(2048 * 64 + 1, 16)
    assert s <= 64 and s * subs * 16 >= 2048 * 64 + 1


def test_tma_map_description_per_layout():
    for layout, shape in (("NHD", (10, 16, 4, 128)), ("HND", (10, 4, 16, 128))):
        p = validate_paged(fake((2, 8, 128)), fake(shape), fake(shape), fake((2, 3), np.int32),
                           fake((2,), np.int32), layout, None, None, 1.0, None, stream=None)
        k, v = paged._tma_specs(p, 32)
        if layout == "NHD":
            assert k.dims == (128, 4, 16, 10) and k.box == (64, 1, 16, 1)
            assert k.strides == (256, 4 * 256, 16 * 4 * 256)
        else:
            assert k.dims == (128, 16, 4, 10) and k.box == (64, 16, 1, 1)
            assert k.strides == (256, 16 * 256, 16 * 4 * 256)
        assert v.dims == k.dims


def test_paged_routes():
    v = routes.select_paged_variant((9, 0), 128, "float16", 16, tma_ok=True)
    assert v.family.name == "paged_tma" and v.rows == 16
    assert routes.select_paged_variant((9, 0), 128, "float16", 4, tma_ok=False).family.name == "paged"
    assert routes.select_paged_variant((9, 0), 128, "float16", 4, "portable", tma_ok=True).family.name == "paged"
    assert routes.select_paged_variant((8, 0), 64, "bfloat16", 32).family.name == "paged"
    # sm_100 / sm_110: D 256 fp16 / bf16 takes the 16-row build for any row count (the 8-row one spills under
    # NVRTC 13.0 there); other head dims, e4m3 caches and sm_90 keep 8 rows
    assert routes.select_paged_variant((10, 0), 256, "float16", 8).rows == 16
    assert routes.select_paged_variant((11, 0), 256, "bfloat16", 1).rows == 16
    assert routes.select_paged_variant((10, 0), 128, "float16", 8).rows == 8
    assert routes.select_paged_variant((10, 0), 256, "float16", 8, kv8=True).rows == 8
    assert routes.select_paged_variant((9, 0), 256, "float16", 8, tma_ok=True).rows == 8
    assert routes.select_paged_variant((12, 0), 256, "float16", 8).rows == 8  # sm_120: the portable arches' rule
    for arch in ("sm_100a", "sm_110a"):
        listed = {(v.family.name, v.head_dim, v.rows, v.kv8) for v in routes.variants_for_arch(arch)}
        assert ("paged", 256, 8, False) not in listed and ("paged_tma", 256, 8, False) not in listed
        assert ("paged", 256, 16, False) in listed and ("paged_tma", 256, 16, False) in listed
        assert ("paged", 256, 8, True) in listed
    with pytest.raises(RuntimeError, match="compute capability"):
        routes.select_paged_variant((8, 6), 128, "float16", 4, "hopper")
    for arch in ("sm_80", "sm_90a", "sm_100a", "sm_110a"):
        names = {x.family.name for x in routes.variants_for_arch(arch)}
        assert "paged" in names and (("paged_tma" in names) == (arch != "sm_80"))


def test_hoisted_copy_is_the_default_and_plain_is_the_switch(monkeypatch):
    """The cp.async paged kernel's hoisted copy is the default build (no switch in the route key; the
    kernel's GQA_PAGED_HOISTED_COPY defaults to 1); GQADRV_PAGED_COPY=plain builds the per-chunk form
    as its own module (A/B). Both compile without spills (D 128, both row counts)."""
    from gqadrv.runtime.compiler import compile_module, kernels_root

    src = (kernels_root() / "gqa" / "sm80" / "decode_paged.cu").read_text()
    assert "#define GQA_PAGED_HOISTED_COPY 1" in src
    for env in (None, "plain"):
        if env:
            monkeypatch.setenv("GQADRV_PAGED_COPY", env)
        for rows in (4, 16):
            v = routes.select_paged_variant((9, 0), 128, "float16", rows)
            if env:
                assert ("GQA_PAGED_HOISTED_COPY", 0) in v.switches and "hoisted_copy0" in v.name
            else:
                assert v.switches == ()
            r = next(iter(compile_module(v.family.source, "sm_90a", v.defines).resources.values()))
            assert r.spill_stores == 0 and r.stack_bytes == 0
    monkeypatch.setenv("GQADRV_PAGED_COPY", "hoisted")  # any other value: the default build
    assert routes.select_paged_variant((9, 0), 128, "float16", 4).switches == ()


def test_det_exit_is_the_default_and_zero_is_the_switch(monkeypatch):
    """Idle batch-invariant splits leave before the ticket by default (GQA_PAGED_DET_EXIT defaults to 1
    in paged_args.cuh); GQADRV_PAGED_DET_EXIT=0 builds the old form as its own module for both paged
    families. Built without spills."""
    from gqadrv.runtime.compiler import compile_module, kernels_root

    src = (kernels_root() / "gqa" / "common" / "paged_args.cuh").read_text()
    assert "#define GQA_PAGED_DET_EXIT 1" in src
    for tma in (False, True):
        assert routes.select_paged_variant((9, 0), 128, "bfloat16", 16, tma_ok=tma).switches == ()
    monkeypatch.setenv("GQADRV_PAGED_DET_EXIT", "0")
    for tma in (False, True):
        v = routes.select_paged_variant((9, 0), 128, "bfloat16", 16, tma_ok=tma)
        assert ("GQA_PAGED_DET_EXIT", 0) in v.switches
        r = next(iter(compile_module(v.family.source, "sm_90a", v.defines).resources.values()))
        assert r.spill_stores == 0 and r.stack_bytes == 0


def test_a_switch_off_its_kernel_default_changes_the_variant_name():
    """Every development switch whose kernel default is not 0 (routes._SWITCH_DEFAULTS) appears in the variant's
    name when set to another value, so a development build never shows a default build's name (the paged
    switches' defaults became 1 on 2026-12-06)."""
    import dataclasses

    base = routes.select_paged_variant((9, 0), 128, "float16", 8)
    assert base.switches == ()
    names = {base.name}
    for macro, default in routes._SWITCH_DEFAULTS.items():
        v = dataclasses.replace(base, switches=((macro, 1 - default),))
        assert v.name not in names, macro
        names.add(v.name)
        assert dataclasses.replace(base, switches=((macro, default),)).name == base.name


def test_tma_maps_are_cached_including_not_describable(monkeypatch):
    """tma_maps encodes once per pool geometry and address (fake encoder), returns the two maps of the
    K and V pools, and remembers a pool TMA cannot describe (pages < 16: no map) as well."""
    import contextlib

    calls = []
    monkeypatch.setattr(paged, "encode_tiled", lambda spec: calls.append(spec) or bytes([len(calls)]) * 128)
    monkeypatch.setattr(paged._drv, "device_scope", lambda dev: contextlib.nullcontext())
    paged._tmaps.clear()
    shape = (12, 16, 4, 128)
    p = validate_paged(fake((2, 8, 128)), fake(shape), fake(shape), fake((2, 3), np.int32), fake((2,), np.int32),
                       "NHD", None, None, 1.0, None, stream=None)
    first = paged.tma_maps(p)
    assert first is not None and len(calls) == 2 and first[0] != first[1]
    assert calls[0].address == p.k_ptr and calls[1].address == p.v_ptr
    assert paged.tma_maps(p) == first and len(calls) == 2          # cached: nothing encoded again
    small = (12, 8, 4, 128)
    p8 = validate_paged(fake((2, 8, 128)), fake(small), fake(small), fake((2, 3), np.int32), fake((2,), np.int32),
                        "NHD", None, None, 1.0, None, stream=None)
    assert paged.tma_maps(p8) is None and len(calls) == 2         # pages < 16: the cp.async route

    def refuse(spec):
        calls.append(spec)
        raise paged.TensorMapError("not describable")

    monkeypatch.setattr(paged, "encode_tiled", refuse)
    hnd = (12, 4, 16, 128)
    other = validate_paged(fake((2, 8, 128)), fake(hnd), fake(hnd), fake((2, 3), np.int32),
                           fake((2,), np.int32), "HND", None, None, 1.0, None, stream=None)
    assert paged.tma_maps(other) is None and len(calls) == 3
    assert paged.tma_maps(other) is None and len(calls) == 3       # the refusal is remembered


def test_successor_prefetch_switch_and_stride(monkeypatch):
    """GQADRV_PAGED_NEXT=n builds the TMA kernel with GQA_PAGED_NEXT=n (the cp.async family ignores it),
    compiled without spills (n = 1 e4m3 8 rows, n = 3 fp16 16 rows); the host passes the successor
    stride (SMs x CTAs per SM) in the flags' high bits only for launches of more than one wave of such
    builds with a block table, and no stride without the switch."""
    import types

    from gqadrv.runtime import driver
    from gqadrv.runtime.compiler import compile_module

    monkeypatch.setattr(driver, "device_info", lambda d: types.SimpleNamespace(sm_count=132, l2_bytes=60 << 20))
    shape = (64 * 8, 16, 8, 128)

    def problem(batch):
        return validate_paged(fake((batch, 32, 128)), fake(shape), fake(shape), fake((batch, 8), np.int32),
                              fake((batch,), np.int32), "NHD", None, None, 1.0, None, stream=None)

    plain = routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True)
    assert paged.successor_stride(problem(64), plain, 1, 1) == 0
    monkeypatch.setenv("GQADRV_PAGED_NEXT", "1")
    assert routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=False).switches == ()
    v = routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True)
    assert ("GQA_PAGED_NEXT", 1) in v.switches and v.name.endswith("_paged_next1")
    assert paged.successor_stride(problem(64), v, 1, 1) == 132          # 512 CTAs on 132 resident
    assert paged.successor_stride(problem(64), v, 2, 1) == 264
    assert paged.successor_stride(problem(16), v, 1, 1) == 0            # 128 CTAs: one wave
    assert paged.successor_stride(problem(16), v, 1, 2) == 132          # 256 CTAs with two splits
    p = problem(64)
    flags = paged._flags(p, False, 132)
    assert flags >> paged_args.GQA_PAGED_NEXT_SHIFT == 132 and flags & ((1 << paged_args.GQA_PAGED_NEXT_SHIFT) - 1) \
        == paged._flags(p, False, 0)
    for n, kv8, rows in ((1, True, 8), (3, False, 16)):
        monkeypatch.setenv("GQADRV_PAGED_NEXT", str(n))
        v = routes.select_paged_variant((9, 0), 128, "float16", rows, tma_ok=True, kv8=kv8)
        assert ("GQA_PAGED_NEXT", n) in v.switches
        r = next(iter(compile_module(v.family.source, "sm_90a", v.defines).resources.values()))
        assert r.spill_stores == 0 and r.stack_bytes == 0, (v.name, r)


def test_multi_unit_switch_builds_and_grids(monkeypatch):
    """GQADRV_PAGED_MULTI=K builds the TMA kernel with GQA_PAGED_MULTI=K; paged.multi_build mirrors the
    kernel's MULTI_BUILD (D <= 128 and a warp's state fits one ring slot: not the 16-row e4m3 build at
    32 tokens); launch_shape gives one-split launches of several waves ceil(units / K) CTAs (K >= 2) or the
    resident CTAs (K = 1), and one-wave (speculating) or split launches one CTA per unit. Spill-free build."""
    import types

    from gqadrv.ops import kernels
    from gqadrv.runtime import driver
    from gqadrv.runtime.compiler import compile_module

    monkeypatch.setattr(driver, "device_info", lambda d: types.SimpleNamespace(sm_count=132, l2_bytes=60 << 20))
    loaded = types.SimpleNamespace(ctas_per_sm=1)
    monkeypatch.setattr(kernels, "max_active_clusters", lambda *a: 0)
    shape = (64 * 8, 16, 8, 128)

    def problem(batch):
        return validate_paged(fake((batch, 32, 128)), fake(shape), fake(shape), fake((batch, 8), np.int32),
                              fake((batch,), np.int32), "NHD", None, None, 1.0, None, stream=None)

    plain = routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True)
    assert not paged.multi_build(plain) and paged.launch_shape(problem(64), plain, loaded, 1, 0)[0] == (512, 1, 1)
    for k, grid in (("2", 256), ("4", 128), ("1", 132)):
        monkeypatch.setenv("GQADRV_PAGED_MULTI", k)
        v = routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True)
        assert ("GQA_PAGED_MULTI", int(k)) in v.switches and paged.multi_build(v)
        assert paged.launch_shape(problem(64), v, loaded, 1, 0)[0] == (grid, 1, 1)    # 512 units
        assert paged.launch_shape(problem(16), v, loaded, 1, 0)[0] == (128, 1, 1)     # one wave: speculates
        assert paged.launch_shape(problem(64), v, loaded, 2, 0)[0] == (1024, 1, 1)    # two splits
        assert paged.launch_shape(problem(64), v, loaded, 1, 3)[0] == (512, 1, 1)     # batch-invariant mode
    assert paged.multi_build(routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True, kv8=True))
    assert not paged.multi_build(routes.select_paged_variant((9, 0), 128, "float16", 16, tma_ok=True, kv8=True))
    assert not paged.multi_build(routes.select_paged_variant((9, 0), 256, "float16", 8, tma_ok=True))
    assert routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=False).switches == ()
    v = routes.select_paged_variant((9, 0), 128, "float16", 8, tma_ok=True, kv8=True)
    r = next(iter(compile_module(v.family.source, "sm_90a", v.defines).resources.values()))
    assert r.spill_stores == 0 and r.stack_bytes == 0, (v.name, r)
