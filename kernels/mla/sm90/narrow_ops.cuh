// gqadrv — MLA dense decode with tokens as the wgmma M dimension (bf16 / fp16 cache): the geometry and
// the wgmma steps shared by dense_decode_narrow.cu (one consumer warpgroup) and
// dense_decode_narrow2.cu (two consumer warpgroups on alternate tiles, split or balanced grid).
//
// A piece is one 64-channel block (64 tokens x 128 B, 128B-swizzled) of a 64-token tile; Q is 9
// channel blocks of NQ rows x 128 B, P is NQ rows x 64 tokens (K-major). The including file defines
// MLA_NQ (16 or 32) and MLA_DT.
#pragma once
#include "../../common/ptx.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"

#ifndef MLA_NQ
#error "MLA_NQ not defined (16 or 32: packed query rows per CTA)"
#endif

namespace mla {
namespace narrow {
constexpr int DT = MLA_DT;
constexpr int NQ = MLA_NQ;
constexpr int NACC = NQ / 2;                  // fp32 accumulators per thread of one m64nNQ result
constexpr int NJ = NQ / 8;                    // 8-column chunks of the result
constexpr u32 PIECE = 64u * 128u;             // 8 KB
constexpr u32 QCB = (u32)NQ * 128u;           // one channel block of Q
static_assert(NQ == 16 || NQ == 32, "NQ is 16 or 32");

template <int D>
GQADRV_DEVICE u16 half_bits(float x) {
  return (u16)(pack2<D>(x, 0.f) & 0xffffu);
}

// m64nNQk16 SS, picked by the accumulator array size (8: N = 16, 16: N = 32).
template <int TA, int TB>
GQADRV_DEVICE void wgmma_nq(float (&d)[8], u64 da, u64 db, int scale_d) {
  wgmma_m64n16k16_ss<DT, TA, TB>(d, da, db, scale_d);
}
template <int TA, int TB>
GQADRV_DEVICE void wgmma_nq(float (&d)[16], u64 da, u64 db, int scale_d) {
  wgmma_m64n32k16_ss<DT, TA, TB>(d, da, db, scale_d);
}

// S^T += K(piece)[64 x 64 ch] Q(cb)^T: 4 k16 steps (issue only), alternating between two partial
// accumulators (even k16 steps into st0, odd into st1; S^T = st0 + st1) so that consecutive wgmmas
// do not depend on each other's accumulator (36 dependent m64nNQ steps otherwise).
GQADRV_DEVICE void qk_piece(float (&st0)[NACC], float (&st1)[NACC], u32 piece, u32 qcb, bool first) {
  const u64 da = wgmma_desc_sw128(piece, 16, 1024);
  const u64 db = wgmma_desc_sw128(qcb, 16, 1024);
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    wgmma_nq<0, 0>(st0, da + (u64)(k * 2), db + (u64)(k * 2), (first && k == 0) ? 0 : 1);
    wgmma_nq<0, 0>(st1, da + (u64)(k * 2 + 2), db + (u64)(k * 2 + 2), (first && k == 0) ? 0 : 1);
  }
}
// O^T(cb) += V^T(piece: 64 channels x 64 tokens, MN-major) P^T (K-major): 4 k16 steps of 16 tokens
// (+2 KB in the piece, +32 B in the P rows).
GQADRV_DEVICE void pv_step(float (&ot)[NACC], u32 piece, u32 p_base, int kk) {
  const u64 da = wgmma_desc_sw128(piece, PIECE, 1024);
  const u64 db = wgmma_desc_sw128(p_base, 16, 1024);
  wgmma_nq<1, 0>(ot, da + (u64)(kk * 128), db + (u64)(kk * 2), 1);
}

// Online softmax of one 64-token tile, per query row (a column of S^T), for one consumer warpgroup:
// scale sv, mask keys >= the row's limit, column max (shuffles over g, then red[4][NQ] and named
// barrier `bar` of the warpgroup's 128 threads), running max / sum update, P (16-bit) into the
// K-major P block at p_base, O^T rescaled by alpha. Thread (w, g, t) holds tokens 16w + g (+8) of
// the tile and rows 8j + 2t + e.
GQADRV_DEVICE void softmax_tile(const float (&sv)[NACC], int tile, int w, int g, int t, const int (&lim)[NJ][2],
                                int lim_min, float sc, float* red, u32 bar, float (&m_run)[NJ][2],
                                float (&l_run)[NJ][2], u32 p_base, float (&ot)[8][NACC]) {
  const int tok_lo = tile * 64 + 16 * w + g;
  float x[NJ][2][2];  // [j][e][h]: row 8j + 2t + e, token tok_lo + 8h
  float mx[NJ][2];
  const bool need_mask = (tile + 1) * 64 > lim_min;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = sv[4 * j + 2 * h + e] * sc;
        x[j][e][h] = (need_mask && tok_lo + 8 * h >= lim[j][e]) ? MASKED : v;
      }
      float m = fmaxf(x[j][e][0], x[j][e][1]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      mx[j][e] = m;
    }
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) red[w * NQ + 8 * j + 2 * t + e] = mx[j][e];
  }
  named_bar_sync(bar, 128);
  float alpha[NJ][2];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
      const float mt = fmaxf(fmaxf(red[n], red[NQ + n]), fmaxf(red[2 * NQ + n], red[3 * NQ + n]));
      const float mn = fmaxf(m_run[j][e], mt);
      alpha[j][e] = fast_exp2(m_run[j][e] - mn);
      m_run[j][e] = mn;
      const float p0 = fast_exp2(x[j][e][0] - mn), p1 = fast_exp2(x[j][e][1] - mn);
      l_run[j][e] = l_run[j][e] * alpha[j][e] + (p0 + p1);
      const int tl = 16 * w + g;  // token within the tile (h = 0); h = 1 is the next 16-byte unit
      sts_u16(p_base + swz(n, tl >> 3) + 2u * (tl & 7), half_bits<DT>(p0));
      sts_u16(p_base + swz(n, (tl >> 3) + 1) + 2u * (tl & 7), half_bits<DT>(p1));
    }
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        ot[m][4 * j + e] *= alpha[j][e];
        ot[m][4 * j + 2 + e] *= alpha[j][e];
      }
}

// A consumer thread's fresh softmax state for one work item: O^T zeroed, running maxima M_INIT, row sums
// 0, and the key limits of its rows row0 + 8 j + 2 t + e (clamped to tok_end, the item's token end).
// Returns the block's smallest limit (that of row0), the first token any row masks.
GQADRV_DEVICE int init_row_state(const MlaDecodeArgs& a, int len, int tok_end, int row0, int t, float (&ot)[8][NACC],
                                 float (&m_run)[NJ][2], float (&l_run)[NJ][2], int (&lim)[NJ][2]) {
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int i = 0; i < NACC; ++i) ot[m][i] = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_run[j][e] = M_INIT;
      l_run[j][e] = 0.f;
      lim[j][e] = min(row_key_limit(a, len, row0 + 8 * j + 2 * t + e), tok_end);
    }
  return min(row_key_limit(a, len, row0), tok_end);
}

// Row sums of one consumer warpgroup: l_run over the 8 lanes g of a row (shuffles), then over the 4
// warps through lred[4][NQ] and named barrier `bar` (128 threads). Every thread gets its rows' sums.
GQADRV_DEVICE void row_sums(const float (&l_run)[NJ][2], int w, int g, int t, float* lred, u32 bar, float (&Lr)[NJ][2]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[j][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) lred[w * NQ + 8 * j + 2 * t + e] = l;
    }
  named_bar_sync(bar, 128);
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
      Lr[j][e] = lred[n] + lred[NQ + n] + lred[2 * NQ + n] + lred[3 * NQ + n];
    }
}

// The 9 pieces of one 64-token tile (page `page`, first token `off` in it) by TMA from the one
// producer thread, in ring order: per piece wait empty (parity starts at 1), arrive.expect_tx(8 KB)
// on full, one 5-D box of one channel block (k_cb map). full[s] / empty[s] are the mbarriers at
// full0 / empty0 + 8 s, slot s lies at ring + s * PIECE; (slot, ph) is the producer's ring position.
template <int NSLOT>
GQADRV_DEVICE void tma_tile_pieces(u32 ring, u32 full0, u32 empty0, const TmaDesc* k_cb, int off, int kvh, int page,
                                   int& slot, u32& ph) {
#pragma unroll 1
  for (int c = 0; c < NCB; ++c) {
    const u32 full = full0 + 8u * (u32)slot;
    mbar_wait_wd(empty0 + 8u * (u32)slot, ph ^ 1u);
    mbar_arrive_expect_tx(full, PIECE);
    mla_tma_k_5d(ring + (u32)slot * PIECE, k_cb, full, 0, off, c, kvh, page);
    if (++slot == NSLOT) {
      slot = 0;
      ph ^= 1u;
    }
  }
}

}  // namespace narrow
}  // namespace mla
