"""Tensor maps written from a learned class layout (runtime.tmap_geometry) against the real driver:
for the map classes gqadrv encodes (the GQA KV cache, the paged K / V pools in both layouts and the
e4m3 pools, the MLA cache, the runtime proof's maps), the class is learned, and every map of a new
geometry written from it equals the driver's own encoding byte for byte."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytestmark = pytest.mark.gpu


def _classes():
    from gqadrv.runtime.tensormap import TmaSpec

    a = 0x7F00_0000_0000
    out = []
    for dt in ("float16", "bfloat16"):
        for tok in (16, 32, 64):  # the GQA KV cache: dims (D, C, Hkv, 2B)
            out.append(("gqa_kv", TmaSpec(dt, a, (128, 4096, 8, 2), (256, 4096 * 256, 8 * 4096 * 256), (64, tok, 1, 1))))
        out.append(("gqa_kv_d64", TmaSpec(dt, a, (64, 1000, 2, 8), (128, 128000, 256000), (64, 32, 1, 1))))
        for bt in (16, 32):  # paged pools: NHD (D, Hkv, page, P), HND (D, page, Hkv, P)
            out.append(("paged_nhd", TmaSpec(dt, a, (128, 8, 16, 999), (256, 2048, 32768), (64, 1, bt, 1))))
            out.append(("paged_hnd", TmaSpec(dt, a, (128, 64, 8, 999), (256, 16384, 131072), (64, bt, 1, 1))))
        out.append(("mla_k", TmaSpec(dt, a, (576, 64, 4000), (1152, 64 * 1152), (64, 64, 1))))
    out.append(("paged_e4m3", TmaSpec("uint8", a, (128, 8, 16, 999), (128, 1024, 16384), (128, 1, 16, 1))))
    out.append(("proof_f32", TmaSpec("float32", a, (200, 300, 2, 2), (800, 240000, 480000), (32, 32, 1, 1))))
    return out


CLASSES = _classes()


@pytest.mark.parametrize("name,base", CLASSES, ids=[f"{n}-{b.dtype}-{'x'.join(map(str, b.box))}" for n, b in CLASSES])
def test_written_maps_equal_the_drivers(name, base, monkeypatch):
    from gqadrv.runtime import driver as _drv
    from gqadrv.runtime import tensormap as tm
    from gqadrv.runtime import tmap_geometry as g
    from gqadrv.runtime.tensormap import ELEMENT_BYTES

    _drv.ensure_init()
    monkeypatch.delenv("GQADRV_TMAP_PATCH", raising=False)  # the default: on
    g.reset()
    try:
        with _drv.device_scope(0):
            _check_class(name, base, tm, g, ELEMENT_BYTES)
    finally:
        monkeypatch.undo()
        g.reset()


def _check_class(name, base, tm, g, ELEMENT_BYTES):
    """Learn ``base``'s class, then 150 maps of random packed geometries: written == the driver's."""
    rng = random.Random(hash(name) & 0xFFFF)
    es = ELEMENT_BYTES[base.dtype]
    tm.encode_tiled(base)
    d2 = base.dims[:-1] + (base.dims[-1] + 5,)
    tm.encode_tiled(dataclasses.replace(base, dims=d2))  # the class's second geometry: learned here
    lay = g._layouts.get((tm._encode, g.class_key(base)))
    assert lay is not None, f"{name}: this driver's encoding of the class was not learned (no patching)"
    written = 0
    for i in range(150):
        dims = list(base.dims)
        for k in range(1, len(dims)):
            dims[k] = rng.choice((1, rng.randint(1, 64), rng.randint(1, 1 << 14)))
        if i % 5 == 0:
            dims[-1] = rng.randint(1, 1 << 31)
        strides = g._packed(dims, es, rng, pad=True)
        while strides[-1] >= 1 << 36:
            dims = [dims[0]] + [max(1, d // 4) for d in dims[1:-1]] + [dims[-1]]
            strides = g._packed(dims, es, rng, pad=True)
        spec = dataclasses.replace(base, address=rng.randrange(1 << 32, 1 << 47) & ~15, dims=tuple(dims),
                                   strides=strides)
        got = tm.encode_tiled(spec)
        written += g.patch(spec, tm._encode) is not None
        assert got == tm._encode(spec), f"{name}: map {i} {spec} differs from the driver's"
    assert written >= 140, f"{name}: only {written} of 150 maps were written from the class layout"
