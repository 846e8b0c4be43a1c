"""Tensor maps written from a learned class layout (runtime.tmap_geometry) without a GPU: fake
driver encoders with plain fields are learned and patched byte for byte; encoders with any other
behaviour (derived bytes, truncated fields, high stride bits elsewhere, refused probes, hashed
bodies) are never patched; on unless GQADRV_TMAP_PATCH=0; the one-geometry case costs no probes."""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest

from gqadrv.runtime import tensormap as tm
from gqadrv.runtime import tmap_geometry as g

BASE = tm.TmaSpec(dtype="float16", address=0x7000_0000_1000, dims=(128, 1000, 8, 4),
                  strides=(256, 1000 * 256, 8 * 1000 * 256), box=(64, 32, 1, 1), swizzle="128b")


def plain(spec: tm.TmaSpec, dim_width: int = 4) -> bytearray:
    """Address u64 at 0, strides >> 4 as u32 from 12 (bits 36+ at 80), dims - 1 from 32, a class byte."""
    b = bytearray(128)
    b[0:8] = spec.address.to_bytes(8, "little")
    for i, s in enumerate(spec.strides):
        struct.pack_into("<I", b, 12 + 4 * i, (s >> 4) & 0xFFFF_FFFF)
        b[80 + i] = (s >> 36) & 0xFF
    for i, d in enumerate(spec.dims):
        b[32 + 4 * i:32 + 4 * i + dim_width] = ((d - 1) & ((1 << 8 * dim_width) - 1)).to_bytes(dim_width, "little")
    b[100] = (len(spec.dims) * 7 + spec.box[1]) & 0xFF
    return b


def enc_plain(spec):
    return bytes(plain(spec))


def enc_box_flag(spec):
    """Plain, plus a byte that says whether dim 1 is below its box."""
    b = plain(spec)
    b[110] = spec.dims[1] < spec.box[1]
    return bytes(b)


def enc_dims16(spec):
    """Dims kept in 16 bits (a truncating encoder)."""
    return bytes(plain(spec, dim_width=2))


def enc_total(spec):
    """Plain, plus the product of the dims modulo 251 (a derived field)."""
    b = plain(spec)
    n = 1
    for d in spec.dims:
        n *= d
    b[120] = n % 251
    return bytes(b)


def enc_refuse_big(spec):
    if max(spec.dims) > 1 << 24:
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
    return enc_plain(spec)


def enc_hash(spec):
    import hashlib

    h = hashlib.sha512(repr((spec.address, spec.dims, spec.strides)).encode()).digest()
    return (h + h)[:128]


@pytest.fixture
def driver(monkeypatch):
    """Install a counting fake encoder; every test starts with nothing learned."""
    calls = []

    def use(fn):
        def counted(spec):
            calls.append(spec)
            return fn(spec)

        monkeypatch.setattr(tm, "_encode", counted)
        monkeypatch.setattr(tm, "_offset_state", [])  # the address field is probed again for this encoder
        monkeypatch.setenv("GQADRV_TMAP_PATCH", "1")
        g.reset()
        calls.clear()
        return calls

    yield use
    g.reset()


def members(n: int, seed: int = 0, max_c: int = 1 << 20):
    """GQA-like KV maps of a family: capacity C and batch B change, dims (D, C, Hkv, 2B)."""
    rng = random.Random(seed)
    for _ in range(n):
        C, B = rng.randint(1, max_c), rng.randint(1, 256)
        yield dataclasses.replace(BASE, address=rng.randrange(1 << 40, 1 << 48) & ~15, dims=(128, C, 8, 2 * B),
                                  strides=(256, C * 256, 8 * C * 256))


def second(spec):
    return dataclasses.replace(spec, dims=(128, 2000, 8, 4), strides=(256, 2000 * 256, 8 * 2000 * 256))


def test_plain_fields_are_learned_and_patched_byte_for_byte(driver):
    calls = driver(enc_plain)
    tm.encode_tiled(BASE)
    assert len(calls) == 1
    tm.encode_tiled(second(BASE))  # the class's second geometry: learned here
    assert len(calls) == 2 + 3 + 3 * 4 + 2  # two maps, the address probe (three), the class's probes
    n = len(calls)
    for spec in members(500):
        assert tm.encode_tiled(spec) == enc_plain(spec)
    assert len(calls) == n  # every member written, none encoded


def test_one_geometry_costs_no_probes(driver):
    calls = driver(enc_plain)
    for a in (0x1000, 0x2000, 0x3000):
        tm.encode_tiled(dataclasses.replace(BASE, address=a))
    assert len(calls) == 3
    assert not g._layouts


@pytest.mark.parametrize("fn", [enc_box_flag, enc_dims16, enc_total, enc_refuse_big, enc_hash],
                         ids=["derived-flag", "truncated-dims", "derived-total", "refused-probe", "hashed"])
def test_other_encoders_are_never_patched(driver, fn):
    calls = driver(fn)
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    assert list(g._layouts.values()) == [None]
    n = len(calls)
    specs = list(members(40, seed=3))
    for spec in specs:
        try:
            expect = fn(spec)
        except RuntimeError:
            continue
        assert tm.encode_tiled(spec) == expect
    assert len(calls) - n == len(specs)  # each one encoded by the "driver"


def test_strides_past_2_36_are_encoded(driver):
    calls = driver(enc_plain)
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    n = len(calls)
    big = dataclasses.replace(BASE, dims=(128, 1 << 24, 8, 2), strides=(256, 1 << 32, 1 << 36))
    assert tm.encode_tiled(big) == enc_plain(big)
    assert len(calls) == n + 1


def test_values_wider_than_checked_are_encoded(driver):
    calls = driver(enc_plain)
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    lay = g._layouts[(tm._encode, g.class_key(BASE))]
    assert lay is not None and lay.dim_bits[1] < 32  # dim 1's widest check was bounded by the strides
    n = len(calls)
    wide = dataclasses.replace(BASE, dims=(128, (1 << lay.dim_bits[1]) + 2, 8, 2), strides=(256, 256, 256))
    assert tm.encode_tiled(wide) == enc_plain(wide)
    assert len(calls) == n + 1


def test_a_base_with_strides_past_the_fields_is_replaced(driver):
    calls = driver(enc_plain)
    big = dataclasses.replace(BASE, dims=(128, 1 << 24, 8, 2), strides=(256, 1 << 32, 1 << 36))
    tm.encode_tiled(big)
    tm.encode_tiled(BASE)           # replaces the base: nothing learned yet
    assert not g._layouts
    tm.encode_tiled(second(BASE))   # learned from BASE
    assert g._layouts[(tm._encode, g.class_key(BASE))] is not None
    n = len(calls)
    spec = next(members(1, seed=9))
    assert tm.encode_tiled(spec) == enc_plain(spec) and len(calls) == n


def test_patching_is_off_when_switched_off(driver, monkeypatch):
    calls = driver(enc_plain)
    monkeypatch.setenv("GQADRV_TMAP_PATCH", "0")
    g.reset()
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    specs = list(members(10))
    for spec in specs:
        tm.encode_tiled(spec)
    assert len(calls) == 2 + len(specs) and not g._layouts


def test_patching_is_on_by_default(driver, monkeypatch):
    calls = driver(enc_plain)
    monkeypatch.delenv("GQADRV_TMAP_PATCH", raising=False)
    g.reset()
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    n = len(calls)
    specs = list(members(10))
    for spec in specs:
        assert tm.encode_tiled(spec) == enc_plain(spec)
    assert len(calls) == n and g._layouts


def test_classes_and_encoders_are_learned_apart(driver, monkeypatch):
    calls = driver(enc_plain)
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    other = dataclasses.replace(BASE, box=(64, 16, 1, 1))  # another class: its own base
    n = len(calls)
    tm.encode_tiled(other)
    assert len(calls) == n + 1
    # a different encoder (another driver module) learns for itself: nothing of enc_plain's applies
    monkeypatch.setattr(tm, "_encode", enc_total)
    assert tm.encode_tiled(second(BASE)) == enc_total(second(BASE))


def test_field_search_needs_one_place():
    a = bytes(128)
    b = bytearray(a)
    b[40] = 5
    assert g._field(a, bytes(b), 0, 5, 4) == 40
    assert g._field(a, a, 0, 0, 4) is None                        # nothing moved
    c = bytearray(b)
    c[90] = 1
    assert g._field(a, bytes(c), 0, 5, 4) is None                 # another byte moved too


def test_gpus_of_two_architectures_are_never_patched(driver, monkeypatch):
    from gqadrv.runtime import driver as _drv

    class Info:
        def __init__(self, cc):
            self.cc = cc

    calls = driver(enc_plain)
    monkeypatch.setattr(_drv, "device_count", lambda: 2)
    monkeypatch.setattr(_drv, "device_info", lambda i: Info((9, 0) if i == 0 else (10, 0)))
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    assert list(g._layouts.values()) == [None] and len(calls) == 2  # no probes either
    monkeypatch.setattr(_drv, "device_info", lambda i: Info((9, 0)))
    g.reset()
    tm.encode_tiled(BASE)
    tm.encode_tiled(second(BASE))
    assert list(g._layouts.values())[0] is not None
