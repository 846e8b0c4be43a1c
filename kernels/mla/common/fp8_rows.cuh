// gqadrv — MLA decode on FlashMLA's V3.2 FP8 cache (656 bytes per token): the K-tile loaders shared by
// the FP8 builds of the seesaw (dense_decode_seesaw.cu, MLA_FP8=1) and of the original kernel
// (dense_decode.cu, MLA_FP8=1). The kernels' GEMMs are unchanged: these loaders write the same bf16,
// 128B-swizzled 64-token x 576-channel K tile their bf16 builds fill by cp.async.
//
// Row format  bytes [0, 512) e4m3 codes of latent channels 0..511, [512, 528) four fp32 scales (scale k
//             for channels [128k, 128k + 128)), [528, 656) the 64 bf16 RoPE channels. Dequantization
//             is bf16(float(code) * scale), the value mla_fp8_dequantize writes (kernels/common/fp8.cuh
//             e4m3x16_dequant_bf16; only NaN payloads may differ): the kernels see the cache
//             dequantize_k_cache returns (tests compare them with the bf16 kernels on it, bitwise).
// Addresses   k_row_ptr() of decode_util.cuh, k_cache strides in 2-byte units (the host passes byte
//             strides / 2; every stride is a multiple of 16 bytes). Tokens >= the split's end are never
//             read, nor their block-table entries: their codes and scales read as 0, so the tile rows
//             hold zeros (and their RoPE is cp.async zero-filled), as in the bf16 builds.
// Pieces      the dequantization of 8 codes (fast bf16x2 path for power-of-two scales, exact float32
//             path otherwise) and of a 64-code block row (dequant_block_row: the seesaw_fp8 producer,
//             whose staging and work split are described in dense_decode_seesaw.cu); the register
//             loaders of the mma_fp8 build (CodeRows, rope_rows): a 64-row "code block" c (channels
//             64c .. 64c + 63, one 128-byte swizzled channel block of the tile) is 64 rows x 4 units of
//             16 codes; thread x owns unit x & 3 of rows x >> 2 (+ 32 r), its scale is scale[c / 2] of
//             the row, and one 16-code unit becomes two 16-byte bf16 units (2 (x & 3), + 1) of the block.
#pragma once
#include "../../common/fp8.cuh"
#include "decode_util.cuh"

namespace mla {
namespace fp8 {

constexpr int SCALES_AT = 512;
constexpr int ROPE_AT = 528;

// Byte pointer of token `tok`'s 656-byte row (nullptr at or past tok_end: not read).
GQADRV_DEVICE const u8* row_at(const MlaDecodeArgs& a, const i32* bt_row, int kvh, int tok, int tok_end) {
  return tok < tok_end ? reinterpret_cast<const u8*>(k_row_ptr(a, bt_row, kvh, tok)) : nullptr;
}

// ---- e4m3 -> bf16 with the scale: bf16(float(code) * s), bit for bit as dequantize_k_cache.
// Fast path (integer and bf16x2 FMA-pipe ops only; the cvt path below needs six conversion-pipe
// instructions per two codes, which made that pipe the bottleneck of the FP8 decode): two codes (placed
// by PRMT as bytes [0, c0, 0, c1]) become one bf16x2 holding code * 2^-120 exactly (sign -> bit 15, the
// 7 exponent / mantissa bits -> bits 4..10; e4m3 subnormals become bf16 subnormals), then one
// mul.rn.bf16x2 by bf16(s * 2^120). For a power-of-two s (FlashMLA's scales) with |s| in [2^-100, 2^7]
// that factor is an exact bf16 normal and the product code * s (four significant bits, a normal number)
// is exact, as the reference's is (float32 product exact, bf16 rounding exact); s == 0 (rows past the
// end) multiplies by a signed zero, as the reference does. Any other scale (|s| > 2^7 included), or a
// NaN code (0x7F / 0xFF, which the bit placement would read as +-480) among the eight, takes the exact
// cvt path. (Until 2026-12-01: two multiplies, by 2^120 and by s, for |s| up to 2^100.)
GQADRV_DEVICE void sts_u32x4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
GQADRV_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
GQADRV_DEVICE u32 e4m3x2_placed_to_bf16x2_scaled(u32 p) { return (p & 0x80008000u) | ((p >> 4) & 0x07f007f0u); }
GQADRV_DEVICE bool scale_has_fast_path(float s) {
  const u32 b = __float_as_uint(s) & 0x7fffffffu, e = b >> 23;
  return b == 0u || ((b & 0x7fffffu) == 0u && e >= 27u && e <= 134u);
}
// NaN codes (0x7F / 0xFF) among the four codes of each word: nonzero if any.
GQADRV_DEVICE u32 nan_code_bits(u32 w) { return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }
// Fast path of eight codes (caller checked scale_has_fast_path(s) and no NaN code); s2 = fast_scale(s).
GQADRV_DEVICE void e4m3x8_to_bf16_fast(u32 w0, u32 w1, u32 s2, u32 (&o)[4]) {
  o[0] = bf16x2_mul(e4m3x2_placed_to_bf16x2_scaled(__byte_perm(w0, 0u, 0x1404)), s2);
  o[1] = bf16x2_mul(e4m3x2_placed_to_bf16x2_scaled(__byte_perm(w0, 0u, 0x3424)), s2);
  o[2] = bf16x2_mul(e4m3x2_placed_to_bf16x2_scaled(__byte_perm(w1, 0u, 0x1404)), s2);
  o[3] = bf16x2_mul(e4m3x2_placed_to_bf16x2_scaled(__byte_perm(w1, 0u, 0x3424)), s2);
}
// bf16x2 (s * 2^120, s * 2^120) of a fast-path scale (a power of two with |s| <= 2^7: exponent + 120
// stays a normal bf16 exponent), or the signed zero of s == 0.
GQADRV_DEVICE u32 fast_scale(float s) {
  const u32 b = __float_as_uint(s);
  const u32 sh = ((b & 0x7fffffffu) == 0u ? b : b + (120u << 23)) >> 16;
  return sh | (sh << 16);
}
// Exact path of eight codes (cvt to float32, float32 product, one rounding to bf16): any scale, NaN codes.
GQADRV_DEVICE void e4m3x8_to_bf16_exact(u32 w0, u32 w1, float s, u32 (&o)[4]) {
  float v0, v1, v2, v3;
  e4m3x4_to_f32(w0, v0, v1, v2, v3);
  o[0] = pack2<1>(__fmul_rn(v0, s), __fmul_rn(v1, s));
  o[1] = pack2<1>(__fmul_rn(v2, s), __fmul_rn(v3, s));
  e4m3x4_to_f32(w1, v0, v1, v2, v3);
  o[2] = pack2<1>(__fmul_rn(v0, s), __fmul_rn(v1, s));
  o[3] = pack2<1>(__fmul_rn(v2, s), __fmul_rn(v3, s));
}
// Eight codes (w0 bits 0..7 first) -> eight bf16 = bf16(float(code) * s) (o[0] = codes 0, 1).
GQADRV_DEVICE void e4m3x8_dequant_bf16(u32 w0, u32 w1, float s, u32 (&o)[4]) {
  if ((nan_code_bits(w0) | nan_code_bits(w1)) == 0u && scale_has_fast_path(s)) {
    e4m3x8_to_bf16_fast(w0, w1, fast_scale(s), o);
  } else {
    e4m3x8_to_bf16_exact(w0, w1, s, o);
  }
}

// The 8 bf16 units of one 64-code block row (fast path: s2 = fast_scale(s); exact path: s).
template <bool FAST>
GQADRV_DEVICE void block_row_units(const U32x4 (&c)[4], float s, u32 s2, u32 blk, int r) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 o[4];
    if (FAST) e4m3x8_to_bf16_fast(c[j].x, c[j].y, s2, o); else e4m3x8_to_bf16_exact(c[j].x, c[j].y, s, o);
    sts_u32x4(blk + swz(r, 2 * j), o[0], o[1], o[2], o[3]);
    if (FAST) e4m3x8_to_bf16_fast(c[j].z, c[j].w, s2, o); else e4m3x8_to_bf16_exact(c[j].z, c[j].w, s, o);
    sts_u32x4(blk + swz(r, 2 * j + 1), o[0], o[1], o[2], o[3]);
  }
}
// Four 16-code units (one 64-channel block of a row) -> the 8 swizzled bf16 units of row r of the block
// at blk; the fast / exact choice once for all 64 codes.
GQADRV_DEVICE void dequant_block_row(const U32x4 (&c)[4], float s, u32 blk, int r) {
  u32 nan = 0u;
#pragma unroll
  for (int j = 0; j < 4; ++j) nan |= nan_code_bits(c[j].x) | nan_code_bits(c[j].y) | nan_code_bits(c[j].z) | nan_code_bits(c[j].w);
  if (nan == 0u && scale_has_fast_path(s)) {
    block_row_units<true>(c, s, fast_scale(s), blk, r);
  } else {
    block_row_units<false>(c, s, 0u, blk, r);
  }
}

GQADRV_DEVICE void ld_f32x2_nc(const u8* p, float& x, float& y) {
  asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "l"(p));
}

// Codes of NB consecutive code blocks starting at C0 (this thread's 16-code unit `cu` of each) and the
// scales they use (scale C0 / 2 .. (C0 + NB - 1) / 2), for R rows; zeros for rows that are nullptr.
template <int C0, int NB, int R>
struct CodeRows {
  U32x4 c[R][NB];
  float s[R][NB / 2];

  GQADRV_DEVICE void load(const u8* const (&row)[R], int cu) {
    static_assert(NB % 4 == 0 && C0 % 4 == 0, "whole scale pairs: two scales per 8-byte load");
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row[r] != nullptr) {
#pragma unroll
        for (int k = 0; k < NB; ++k) c[r][k] = ld_global_nc_v4(row[r] + 64 * (C0 + k) + 16 * cu);
#pragma unroll
        for (int k = 0; k < NB / 2; k += 2) ld_f32x2_nc(row[r] + SCALES_AT + 4 * (C0 / 2 + k), s[r][k], s[r][k + 1]);
      } else {
#pragma unroll
        for (int k = 0; k < NB; ++k) c[r][k] = U32x4{0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < NB / 2; ++k) s[r][k] = 0.f;
      }
    }
  }

  // Dequantize and store code block C0 + k of every row into `tile` (a 64-row swizzled tile: block
  // C0 + k at tile + (C0 + k) * 8 KB), rows row0 + 32 r.
  template <int K>
  GQADRV_DEVICE void store_block(u32 tile, int row0, int cu) const {
#pragma unroll
    for (int r = 0; r < R; ++r) {  // 8 codes -> one 16-byte unit at a time (fewer live registers)
      const u32 blk = tile + (u32)(C0 + K) * 8192u;
      const int row = row0 + 32 * r;
      u32 o[4];
      e4m3x8_dequant_bf16(c[r][K].x, c[r][K].y, s[r][K / 2], o);
      sts_u32x4(blk + swz(row, 2 * cu), o[0], o[1], o[2], o[3]);
      e4m3x8_dequant_bf16(c[r][K].z, c[r][K].w, s[r][K / 2], o);
      sts_u32x4(blk + swz(row, 2 * cu + 1), o[0], o[1], o[2], o[3]);
    }
  }
};

// RoPE channels (block 8 of the tile, bf16 as stored): units 2 cu, 2 cu + 1 of rows row0 + 32 r by
// cp.async, zero-filled for nullptr rows (src-size 0; `any` is only a well-formed address).
template <int R>
GQADRV_DEVICE void rope_rows(u32 tile, const u8* const (&row)[R], const void* any, int row0, int cu) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int u = 2 * cu + j;
      const bool ok = row[r] != nullptr;
      cp_async_16(tile + 8u * 8192u + swz(row0 + 32 * r, u), ok ? (const void*)(row[r] + ROPE_AT + 16 * u) : any,
                  ok ? 16u : 0u);
    }
  }
}

}  // namespace fp8
}  // namespace mla
