// gqadrv — float8_e4m3fn ("e4m3") conversions shared by the FP8 quantizers (op-neutral).
//
// e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities; 0x7F / 0xFF are NaN,
// the largest finite value is 448 (0x7E), the smallest normal 2^-6 (0x08), subnormals m * 2^-9.
//
// Encoding f32 -> e4m3, the one definition every path implements bit for bit (host model:
// gqadrv/ops/fp8.py, which tests it against ml_dtypes for every fp32 of a representative sweep):
//   NaN (either sign)              -> 0x7F (the canonical e4m3fn NaN)
//   |x| >= 448, including +-Inf    -> sign | 0x7E (+-448: saturation, never NaN)
//   otherwise                      -> round to nearest, ties to even, sign kept (-0 and tiny negatives
//                                     give 0x80)
// Paths:
//   * e4m3_from_f32_soft: integer/bit arithmetic, every arch (the only path on sm_80 / sm_86, where the
//     e4m3 cvt does not exist). Normal range: round the 23-bit mantissa to 3 bits with the
//     add-half-minus-one-plus-lsb trick and re-bias the exponent (the carry of a round-up moves into
//     the exponent, which is exactly right); subnormal range: |x| * 512 is exact and
//     __float2int_rn rounds half to even.
//   * e4m3x2_from_f32 on sm_89+ (GQADRV_ARCH >= 89): cvt.rn.satfinite.e4m3x2.f32 on inputs clamped to
//     [-448, 448] first (so the result never depends on how .satfinite treats infinities), then NaN
//     lanes forced to 0x7F (so it never depends on the NaN sign either). Defining GQADRV_FP8_SOFTWARE
//     selects the software path on every arch (tests compare the two paths on the GPU).
// Decoding e4m3 -> f32 is exact: cvt.rn.f16x2.e4m3x2 (sm_89+) then f16 -> f32, or bit arithmetic.
// No shared memory, no barriers: plain per-thread register code.
#pragma once

#include "ptx.cuh"

#if GQADRV_ARCH >= 89 && !defined(GQADRV_FP8_SOFTWARE)
#define GQADRV_FP8_HW 1
#else
#define GQADRV_FP8_HW 0
#endif

#define GQADRV_E4M3_MAX 448.0f
#define GQADRV_E4M3_NAN 0x7fu

// The software encoder (every arch): one e4m3 code in bits 0..7.
GQADRV_DEVICE u32 e4m3_from_f32_soft(float x) {
  const u32 u = __float_as_uint(x);
  const u32 sign = (u >> 24) & 0x80u;
  const u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return GQADRV_E4M3_NAN;  // NaN of either sign
  if (a >= 0x43e00000u) return sign | 0x7eu;    // |x| >= 448 (Inf too): saturate
  if (a >= 0x3c800000u) {                        // |x| >= 2^-6: normal; RNE of the low 20 mantissa bits
    return sign | (((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
  }
  // |x| < 2^-6: a multiple of 2^-9 (0..8; 8 is the smallest normal, code 0x08)
  return sign | (u32)__float2int_rn(__uint_as_float(a) * 512.0f);
}

// Two values -> two codes: lo in bits 0..7, hi in bits 8..15.
GQADRV_DEVICE u32 e4m3x2_from_f32(float lo, float hi) {
#if GQADRV_FP8_HW
  const float cl = fminf(fmaxf(lo, -GQADRV_E4M3_MAX), GQADRV_E4M3_MAX);
  const float ch = fminf(fmaxf(hi, -GQADRV_E4M3_MAX), GQADRV_E4M3_MAX);
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(ch), "f"(cl));
  u32 v = (u32)r;
  if (lo != lo) v = (v & 0xff00u) | GQADRV_E4M3_NAN;
  if (hi != hi) v = (v & 0x00ffu) | (GQADRV_E4M3_NAN << 8);
  return v;
#else
  return e4m3_from_f32_soft(lo) | (e4m3_from_f32_soft(hi) << 8);
#endif
}

// Four values -> four codes in one register (x[0] in bits 0..7).
GQADRV_DEVICE u32 e4m3x4_from_f32(float a, float b, float c, float d) {
  return e4m3x2_from_f32(a, b) | (e4m3x2_from_f32(c, d) << 16);
}

// The software decoder (every arch): exact; 0x7F / 0xFF give a NaN.
GQADRV_DEVICE float e4m3_to_f32_soft(u32 code) {
  const u32 mag = code & 0x7fu;
  float v = mag < 8u ? (float)mag * 0.001953125f : __uint_as_float((mag << 20) + (120u << 23));
  if (mag == 0x7fu) v = __uint_as_float(0x7fffffffu);
  return __uint_as_float(__float_as_uint(v) | ((code & 0x80u) << 24));
}

// Four codes (bits 0..7 first) -> four floats, exact.
GQADRV_DEVICE void e4m3x4_to_f32(u32 codes, float& a, float& b, float& c, float& d) {
#if GQADRV_FP8_HW
  u32 h01, h23;
  const u16 c01 = (u16)(codes & 0xffffu), c23 = (u16)(codes >> 16);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h01) : "h"(c01));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h23) : "h"(c23));
  unpack2<0>(h01, a, b);
  unpack2<0>(h23, c, d);
#else
  a = e4m3_to_f32_soft(codes & 0xffu);
  b = e4m3_to_f32_soft((codes >> 8) & 0xffu);
  c = e4m3_to_f32_soft((codes >> 16) & 0xffu);
  d = e4m3_to_f32_soft(codes >> 24);
#endif
}

// |x| for a finite x, 0 for NaN and +-Inf (the amax of a quantizer ignores non-finite values).
GQADRV_DEVICE float finite_abs(float x) {
  const float a = fabsf(x);
  return a <= 3.40282347e38f ? a : 0.0f;
}

// Two floats -> bf16x2 (round to nearest even; lo in bits 0..15), every NaN as the canonical 0x7FFF.
GQADRV_DEVICE u32 bf16x2_canonical(float lo, float hi) {
  u32 r = pack2<1>(lo, hi);
  if (lo != lo) r = (r & 0xffff0000u) | 0x7fffu;
  if (hi != hi) r = (r & 0x0000ffffu) | 0x7fff0000u;
  return r;
}

// Sixteen codes (c.x bits 0..7 first) -> sixteen bf16 = bf16(float(code) * s), round to nearest even,
// every NaN stored as the canonical 0x7FFF (o[0] holds codes 0 and 1): FlashMLA's V3.2 dequantization,
// exact for power-of-two scales; the cache dequantizer, which must match the host model bit for bit.
GQADRV_DEVICE void e4m3x16_dequant_bf16(const U32x4& c, float s, u32 (&o)[8]) {
  const u32 cw[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v0, v1, v2, v3;
    e4m3x4_to_f32(cw[i], v0, v1, v2, v3);
    o[2 * i] = bf16x2_canonical(__fmul_rn(v0, s), __fmul_rn(v1, s));
    o[2 * i + 1] = bf16x2_canonical(__fmul_rn(v2, s), __fmul_rn(v3, s));
  }
}

// ---- e4m3 -> f16 for tensor-core operands (the FP8 KV decode kernels, kernels/gqa/common/warp.cuh)
// Two codes of a register become one f16x2 holding code value * 2^-8, exactly: the e4m3 sign moves to
// bit 15, the 7 exponent / mantissa bits to bits 7..13 of an f16 (f16 bias 15 vs e4m3 bias 7: the
// factor 2^-8; e4m3 subnormals become f16 subnormals). Integer ops only (every arch, no cvt):
//   odd:  codes of bytes 1 and 3 (lo, hi half)     2 ops
//   even: codes of bytes 0 and 2                    3 ops
// The NaN codes 0x7F / 0xFF read as +-480 * 2^-8 (finite): callers mask invalid positions themselves.
GQADRV_DEVICE u32 e4m3x2_odd_to_f16x2_scaled(u32 x) { return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u); }
GQADRV_DEVICE u32 e4m3x2_even_to_f16x2_scaled(u32 x) {
  return ((x << 8) & 0x80008000u) | ((x << 7) & 0x3f803f80u);
}

#if GQADRV_FP8_HW
// Four codes -> two f16x2, exactly (sm_89+: two cvt; NaN codes give NaN): lo = codes (0, 1), hi = (2, 3).
GQADRV_DEVICE void e4m3x4_to_f16x2x2(u32 x, u32& lo, u32& hi) {
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}
#endif
