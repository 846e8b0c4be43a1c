// gqadrv — tile operations of the sm_90a MLA kernels that hold 64 query rows per CTA in two consumer
// warpgroups splitting the 512 output columns (dense_decode_seesaw.cu, all its builds):
// the Q K^T product of one 64-token tile (m64n64k16, SS), the P V products (m64n256k16, RS and SS),
// the scaled / masked row maxima, exp2, packing P to bf16 / fp16 fragments or to a swizzled 64 x 64
// shared-memory block, and O rescaling. Layouts: Q / K tiles are 9 channel blocks (cb) of 64 rows x
// 128 B with the 128B swizzle (swz), CB = 8 KB apart; the thread's rows are r_lo = 16 wi + g and
// r_hi = r_lo + 8 of the wgmma C layout (lane 4g + t).
// The consumer loop is kept short, as FlashMLA's consumers run it (docs/MLA.md "Lean consumer loop"):
// (1) the logits stay unscaled until the exponential, which folds the scale into one FFMA per logit
// (2^(s sc - m)); masked logits become -inf (never NaN: the running max starts finite, M_INIT, and
// sc > 0), and the row maxima are scaled after the reduction (max(s) sc == max(s sc) for sc > 0);
// (2) P goes to its shared-memory block by stmatrix (4 per thread and tile instead of 16 32-bit
// stores); (3) wgmma descriptors are a loop-invariant base plus a constant (desc_at).
#pragma once
#include "../../common/ptx.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"

namespace mla {
namespace seesaw {
constexpr int DT = MLA_DT;
constexpr u32 CB = 64u * 128u;            // one channel block of a 64-row tile (8 KB)

// One arrival per warp on an empty barrier, after the warp's wgmma reads of the blocks retired.
GQADRV_DEVICE void release(u32 bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(bar);
}

// wgmma_desc_sw128(base + off, lbo, sbo) for a 16-byte aligned base whose shared window lies below
// 2^18: the address field is then base / 16 + off / 16 without masking, so each descriptor is one
// 32-bit add to a loop-invariant value and the upper word a constant (the default builds mask every
// block's address and add the k-step in 64 bits). True for every launch here (none uses clusters); in a
// cluster launch a CTA's shared::cta addresses carry its rank from bit 24 up (SASS: 0x400 + (SR_CgaCtaId
// << 24)), which would land in the LBO field (bits 16..29) and misplace the MN-major V atoms of P V in
// CTAs of rank > 0: mask the base there (experiment/fp8-crossover, docs/MLA.md "FP8 crossover").
GQADRV_DEVICE u64 desc_at(u32 base, u32 off, u32 lbo, u32 sbo) {
  const u64 fixed = wgmma_desc_sw128(0, lbo, sbo);  // LBO, SBO, swizzle: a constant
  return (fixed & ~0xFFFFFFFFull) | (u32)((u32)fixed + (base >> 4) + (off >> 4));
}

GQADRV_DEVICE void qk_block(float (&s)[32], u32 q_base, u32 k_slot, int c, bool first) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    wgmma_m64n64k16_ss<DT, 0, 0>(s, desc_at(q_base, (u32)c * CB + 32u * k, 16, 1024),
                                 desc_at(k_slot, (u32)c * CB + 32u * k, 16, 1024), (first && k == 0) ? 0 : 1);
}
GQADRV_DEVICE void pv_rs(float (&o)[128], const u32 (&pa)[16], u32 v_base) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_rs<DT, 1>(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                               desc_at(v_base, 2048u * kk, CB, 1024), 1);
}
GQADRV_DEVICE void pv_ss(float (&o)[128], u32 p_base, u32 v_base) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_ss<DT, 0, 1>(o, desc_at(p_base, 32u * kk, 16, 1024), desc_at(v_base, 2048u * kk, CB, 1024), 1);
}

// Mask the logits of one tile at keys >= the row limits (-inf; only when the tile reaches past
// lim_min) and return the two row maxima of this thread's rows, quad-reduced and scaled by sc. The
// logits themselves stay unscaled: exp_rows applies sc.
GQADRV_DEVICE void mask_row_max(float (&s)[32], float sc, int tile, int t, int lim_lo, int lim_hi, int lim_min,
                                  float& mx_lo, float& mx_hi) {
  const float masked = neg_inf();
  mx_lo = masked;
  mx_hi = masked;
  if ((tile + 1) * 64 > lim_min) {
    const int c0 = tile * 64 + 2 * t;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = c0 + 8 * j + e;
        s[4 * j + e] = col < lim_lo ? s[4 * j + e] : masked;
        s[4 * j + 2 + e] = col < lim_hi ? s[4 * j + 2 + e] : masked;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[4 * j], s[4 * j + 1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
  mx_lo *= sc;
  mx_hi *= sc;
}

// s <- 2^(s sc - m) in place (one FFMA per logit); returns this thread's partial row sums.
GQADRV_DEVICE void exp_rows(float (&s)[32], float sc, float m_lo, float m_hi, float& sum_lo, float& sum_hi) {
  sum_lo = 0.f;
  sum_hi = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], sc, -m_lo));
      s[4 * j + 2 + e] = fast_exp2(fmaf(s[4 * j + 2 + e], sc, -m_hi));
      sum_lo += s[4 * j + e];
      sum_hi += s[4 * j + 2 + e];
    }
  }
}

// Pack P (fp32, C layout of m64n64) into the 16 A-fragment registers of the RS P V product,
// multiplying row lo by f_lo and row hi by f_hi.
GQADRV_DEVICE void pack_pa(u32 (&pa)[16], const float (&s)[32], float f_lo, float f_hi) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[4 * kk + 0] = pack2<DT>(s[8 * kk + 0] * f_lo, s[8 * kk + 1] * f_lo);
    pa[4 * kk + 1] = pack2<DT>(s[8 * kk + 2] * f_hi, s[8 * kk + 3] * f_hi);
    pa[4 * kk + 2] = pack2<DT>(s[8 * kk + 4] * f_lo, s[8 * kk + 5] * f_lo);
    pa[4 * kk + 3] = pack2<DT>(s[8 * kk + 6] * f_hi, s[8 * kk + 7] * f_hi);
  }
}
// Store the packed P (same registers as pack_pa) to a swizzled 64 x 64 K-major block, one
// stmatrix.x4 per k16 step: the four registers of step kk are its four 8 x 8 matrices (rows r_lo / r_hi
// x 16-byte units 2 kk / 2 kk + 1), lane l giving the address of row 16 wi + l % 8 (+ 8 for matrices 1, 3)
// of matrix l / 8.
GQADRV_DEVICE void store_pa(u32 p_base, const u32 (&pa)[16], int r_lo) {
  const int lane = threadIdx.x & 31, mi = lane >> 3, j = lane & 7;
  const int row = (r_lo & ~15) + j + 8 * (mi & 1);   // r_lo & ~15 = 16 wi
  const u32 rbase = p_base + (u32)row * 128u;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    stsm_x4(rbase + ((u32)((2 * kk + (mi >> 1)) ^ j) << 4), pa[4 * kk + 0], pa[4 * kk + 1], pa[4 * kk + 2],
            pa[4 * kk + 3]);
}
GQADRV_DEVICE void scale_o(float (&o)[128], float f_lo, float f_hi) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= f_lo;
    o[4 * j + 1] *= f_lo;
    o[4 * j + 2] *= f_hi;
    o[4 * j + 3] *= f_hi;
  }
}

GQADRV_DEVICE void reg_fence_u(u32 (&r)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(r[i])::"memory");
}


}  // namespace seesaw
}  // namespace mla
