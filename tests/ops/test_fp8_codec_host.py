"""The e4m3 codec on the host (gqadrv.ops.fp8), CPU only: the integer model of the device's software
path (e4m3_from_f32, the same algorithm as e4m3_from_f32_soft in kernels/common/fp8.cuh) against an
independent model on ml_dtypes' cast (round to nearest even, saturation and the NaN code applied
explicitly), over every fp32 of a representative sweep: every sign x exponent x top 12 mantissa bits x
low-bit patterns around each rounding point, every mantissa of the exponents where the rounding
changes regime (subnormal range, the subnormal/normal boundary, saturation), and random patterns.
Also: every finite code round trips, midpoints round to even, saturation, NaN, signed zeros, decoding,
bf16 rounding and pow2_ceil. The hardware path is compared with the software path on the GPU
(tests/ops/test_fp8_codec_gpu.py)."""

import ml_dtypes
import numpy as np
import pytest

from gqadrv.ops import fp8

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def codes_of(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = bits.astype(np.uint32).view(np.float32)
    return fp8.e4m3_from_f32(x), fp8.e4m3_from_f32_ml_dtypes(x)


def assert_same(bits: np.ndarray) -> None:
    a, b = codes_of(bits)
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, [(hex(int(bits[i])), int(a[i]), int(b[i])) for i in bad[:8]]


def test_structured_sweep_of_every_exponent():
    """sign x 256 exponents x 4096 top mantissa bits x 8 low-bit patterns (the bits below the kept
    ones: exact, just above / below a midpoint, the midpoint itself, all ones): 16.8 M values."""
    sign = np.array([0, 1], np.uint32)[:, None, None, None] << np.uint32(31)
    exp = np.arange(256, dtype=np.uint32)[None, :, None, None] << np.uint32(23)
    top = np.arange(4096, dtype=np.uint32)[None, None, :, None] << np.uint32(11)
    low = np.array([0, 1, 0x3FF, 0x400, 0x401, 0x7FF, 0x2AA, 0x555], np.uint32)[None, None, None, :]
    assert_same((sign | exp | top | low).reshape(-1))


@pytest.mark.parametrize("exponent", [-13, -11, -10, -7, -6, 0, 8, 9])
def test_every_mantissa_of_the_regime_boundaries(exponent):
    """All 2^23 mantissas (both signs) of 2^exponent: deep subnormal (-13, -11), the round-to-zero edge
    (-10), the subnormal/normal boundary (-7, -6), an ordinary binade (0), the top binade (8: [256,
    512), where 448 saturates) and beyond (9)."""
    m = np.arange(1 << 23, dtype=np.uint32)
    e = np.uint32(exponent + 127) << np.uint32(23)
    assert_same(np.concatenate([e | m, np.uint32(1 << 31) | e | m]))


def test_random_bit_patterns():
    rng = np.random.default_rng(0)
    assert_same(rng.integers(0, 2**32, size=4_000_000, dtype=np.uint64).astype(np.uint32))


def test_every_finite_code_round_trips_and_midpoints_round_to_even():
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    vals = fp8.e4m3_to_f32(finite)
    assert np.array_equal(fp8.e4m3_from_f32(vals), finite)
    # midpoints between consecutive positive codes: ties go to the even code
    pos = np.arange(0, 0x7F, dtype=np.uint8)
    v = fp8.e4m3_to_f32(pos).astype(np.float64)
    mids = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (v[:-1] + v[1:]) / 2)  # exact in float32
    got = fp8.e4m3_from_f32(mids)
    even = np.where(pos[:-1] % 2 == 0, pos[:-1], pos[1:])
    assert np.array_equal(got, even)
    assert np.array_equal(fp8.e4m3_from_f32(-mids), even | 0x80)
    # just above / below a midpoint
    up = np.nextafter(mids, np.float32(np.inf))
    assert np.array_equal(fp8.e4m3_from_f32(up), pos[1:])
    down = np.nextafter(mids, np.float32(-np.inf))
    assert np.array_equal(fp8.e4m3_from_f32(down), pos[:-1])


def test_saturation_nan_zero_and_tiny_values():
    f = np.float32
    x = np.array([448, 449, 463.99, 464, 465, 480, 1e6, 3.4e38, np.inf], f)
    assert list(fp8.e4m3_from_f32(x)) == [0x7E] * len(x)
    assert list(fp8.e4m3_from_f32(-x)) == [0xFE] * len(x)
    nan = np.array([np.nan, -np.nan, np.uint32(0x7F800001).view(f), np.uint32(0xFFFFFFFF).view(f)], f)
    assert list(fp8.e4m3_from_f32(nan)) == [0x7F] * 4
    assert list(fp8.e4m3_from_f32(np.array([0.0, -0.0, 1e-30, -1e-30, 2**-10, -(2**-10)], f))) == \
        [0x00, 0x80, 0x00, 0x80, 0x00, 0x80]  # 2^-10 = half of the smallest subnormal: ties to even (0)
    assert list(fp8.e4m3_from_f32(np.array([2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 7.5 * 2**-9, 2**-6], f))) == \
        [0x01, 0x02, 0x02, 0x08, 0x08]
    # ml_dtypes alone would give NaN for overflow: the explicit saturation matters
    assert np.array([465.0], f).astype(E4M3).view(np.uint8)[0] == 0x7F
    assert fp8.e4m3_from_f32_ml_dtypes(np.array([465.0], f))[0] == 0x7E


def test_decoding_is_exact():
    codes = np.arange(256, dtype=np.uint8)
    vals = fp8.e4m3_to_f32(codes)
    assert np.isnan(vals[0x7F]) and np.isnan(vals[0xFF])
    assert vals[0x7E] == 448 and vals[0xFE] == -448 and vals[0x08] == 2**-6 and vals[0x01] == 2**-9
    assert vals[0x80] == 0 and np.signbit(vals[0x80])
    # the definition: sign, exponent (bias 7), mantissa (3 bits), subnormals m * 2^-9
    for c in range(256):
        if c & 0x7F == 0x7F:
            continue
        e, m = (c >> 3) & 0xF, c & 7
        ref = (m / 8 + (1 if e else 0)) * 2.0 ** ((e or 1) - 7)
        assert vals[c] == (-ref if c & 0x80 else ref), c
    assert np.array_equal(fp8.e4m3_to_f32(codes.view(np.int8)), vals, equal_nan=True)
    assert np.array_equal(fp8.e4m3_to_f32(codes.view(E4M3)), vals, equal_nan=True)
    with pytest.raises(TypeError, match="uint8, int8 or float8_e4m3fn"):
        fp8.e4m3_to_f32(np.zeros(3, np.float16))
    with pytest.raises(TypeError, match="float32"):
        fp8.e4m3_from_f32(np.zeros(3, np.float64))


def test_bf16_bits_and_pow2_ceil():
    f = np.float32
    x = np.array([1.0, -2.5, np.nan, -np.nan, np.inf, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38], f)
    b = fp8.bf16_bits(x)
    assert list(b[:2]) == [0x3F80, 0xC020] and list(b[2:4]) == [0x7FFF, 0x7FFF] and b[4] == 0x7F80
    assert b[5] == 0x3F80 and b[6] == 0x3F82   # ties to even
    assert b[7] == 0x7F80                       # rounds up past the bf16 maximum: +Inf
    p = fp8.pow2_ceil(np.array([1.0, 1.0000001, 1.5, 2.0, 2**-13, 1e-4, 3e-4, 448.0, 2.0**120 * 1.1], f))
    assert list(p) == [1.0, 2.0, 2.0, 2.0, 2**-13, 2**-13, 2**-11, 512.0, 2.0**121]
