// gqadrv — transposed warp decoder for e4m3 caches and at most 8 query rows per KV head
// (WarpDecoderT8; the paged kernels use it for GQA_KV8 builds with ROWS = 8 when GQA_KV8_T = 1).
//
// WarpDecoder<..., KV8> (warp.cuh) puts the query rows in the M dimension of m16n8k16, so with 8
// rows half of every MMA multiplies zeros and every A operand carries two zero registers. Here the
// roles are swapped, which fills all 16 MMA rows with tokens / head-dim channels:
//
//   S^T (TOK x 8)  = K (TOK x D) . Q^T       A = K codes -> fp16 (16 tokens per M-tile), B = Q (row g)
//   online softmax per column (query row) of S^T; C rows are tokens, so a row's max / sum run over
//   the 8 lanes g of a lane quad column (shuffles xor 4, 8, 16)
//   P^T C fragments -> B fragments of the next product by movmatrix.trans (two per 16 tokens)
//   O^T (D x 8)   += V^T (D x TOK) . P^T     A = V codes -> fp16 (16 channels per M-tile), B = P^T
//
// Half the MMAs of the 8-row WarpDecoder, no zero operands. Fragments (lane = 4g + t):
//   K (A): token row g / g + 8 of the M-tile, the lane's 16-byte chunks kv8_k_chunk(p, t) (16 dims); register
//          j of a chunk (dims d .. d + 3, d = 16c + 4j) is one k-step: cvt gives {d, d+1} (a0 / a1) and
//          {d+2, d+3} (a2 / a3). Q (B): query row g at the same dims (WarpDecoder's load_q8 order).
//   S^T (C): tokens g, g + 8 of the M-tile x query rows 2t, 2t + 1: each lane keeps the softmax state
//          (m, l, score scale, causal shift) of its two rows 2t and 2t + 1.
//   V (A): ldmatrix.x4.trans over chunk pair q (as warp.cuh) and byte permutes: M-tile (q, even)
//          has rows g -> dim 32q + 2g and g + 8 -> dim 32q + 16 + 2g; M-tile (q, odd) the dims + 1.
//   O^T (C): lane holds dims (row g / g + 8 of each M-tile) x query rows 2t, 2t + 1.
// Scales fold as in warp.cuh (per-row score scale, V scale on the stored state). Requires the
// cvt.rn.f16x2.e4m3x2 path (sm_89+). No shared memory of its own beyond the slot it reads (layout of
// kv8_chunk_offset in warp.cuh); no barriers (the kernel's ring protocol orders the slot).
#pragma once
#include "warp.cuh"

#if GQADRV_FP8_HW
GQADRV_DEVICE u32 movmatrix_trans(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

template <int DT, int D, int TOK, bool CAUSAL = true>
struct WarpDecoderT8 {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(TOK == 16 || TOK == 32 || TOK == 64, "tokens per sub-tile");
  static constexpr int ROWS = 8;
  static constexpr int DTYPE = DT, DIM = D, NROWS = ROWS;  // as WarpDecoder
  static constexpr bool IS_KV8 = true;
  static constexpr int MT = TOK / 16;      // token M-tiles of S^T (= P.V k-steps)
  static constexpr int NP8 = D / 64;       // 16-byte K chunks per lane and token row
  static constexpr int KSTEPS = D / 16;
  static constexpr int OT = D / 16;        // O^T M-tiles (2 per chunk pair)
  static constexpr int BOX_BYTES = TOK * 128;
  static constexpr int KV_BYTES = (D < 128 ? 128 : D) * TOK;  // K part of a slot (the KV8 layout)

  u32 qb[KSTEPS][2];     // B fragments of Q^T: query row g, dims {d, d+1} / {d+2, d+3}
  float o[OT][4];        // O^T: rows (dims) g / g + 8 x query rows 2t, 2t + 1
  float m0, m1;          // running max (log2 domain) of rows 2t, 2t + 1, uniform over g
  float l0, l1;          // partial sums of this lane's tokens
  float rs0, rs1;        // score scales of rows 2t, 2t + 1
  float out_scale;       // V scale
  int sh0 = 0, sh1 = 0, shift_max = 0;  // CAUSAL: rows 2t / 2t + 1 see keys [0, len - sh)
  int lane;

  GQADRV_DEVICE u32 kofs8() const {
    const int g = lane >> 2, t = lane & 3;
    return kv8_chunk_offset<D>(TOK, g, D == 64 ? t : 2 * t);
  }
  GQADRV_DEVICE u32 vofs8() const {
    return kv8_chunk_offset<D>(TOK, (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4);
  }

  GQADRV_DEVICE void init(int lane_id) {
    lane = lane_id;
    m0 = m1 = neg_inf();
    l0 = l1 = 0.f;
#pragma unroll
    for (int j = 0; j < OT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  }

  // Causal shifts: each lane passes its row g's (lo); rows 2t / 2t + 1 are fetched from lanes 8t / 8t + 4.
  GQADRV_DEVICE void set_causal(int lo, int /*hi*/, int max_shift) {
    const int t = lane & 3;
    sh0 = __shfl_sync(0xffffffffu, lo, 8 * t);
    sh1 = __shfl_sync(0xffffffffu, lo, 8 * t + 4);
    shift_max = max_shift;
  }

  // Q row g (null: padding) as B fragments (cvt pair order of warp.cuh's load_q8), the score scales of
  // rows 2t / 2t + 1 and the V scale.
  GQADRV_DEVICE void load_q8(const u16* __restrict__ row, const u16* /*row_hi*/, float scale_log2, float v_scale) {
    out_scale = v_scale;
    const int t = lane & 3;
    const float rscale = load_q8_row<DT, D, true>(row, qb, scale_log2, t);
    rs0 = __shfl_sync(0xffffffffu, rscale, 8 * t);      // row 2t lives in lanes 4 * (2t) + ...
    rs1 = __shfl_sync(0xffffffffu, rscale, 8 * t + 4);  // row 2t + 1
  }

  template <class Src>
  GQADRV_DEVICE void step(const Src& src, int tok0, int len, float /*scale_log2*/) {
    if (tok0 + TOK > len - (CAUSAL ? shift_max : 0))  // warp-uniform
      step_impl<true>(src, tok0, len);
    else
      step_impl<false>(src, tok0, len);
  }

  template <bool PARTIAL, class Src>
  GQADRV_DEVICE void step_impl(const Src& src, int tok0, int len) {
    float s[MT][4];
    scores(src, s);
    softmax<PARTIAL>(s, tok0, len);
    accumulate<PARTIAL>(src, s, tok0, len);
  }

  // ---- S^T = K . Q^T: per token M-tile, two accumulator chains (even / odd k-steps)
  template <class Src>
  GQADRV_DEVICE void scores(const Src& src, float (&s)[MT][4]) const {
    float s2[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      s2[i][0] = s2[i][1] = s2[i][2] = s2[i][3] = 0.f;
    }
#pragma unroll
    for (int p = 0; p < NP8; ++p) {
      U32x4 lo[MT], hi[MT];  // token rows g and g + 8 of each M-tile
      const u32 base = (kofs8() ^ ((p & 1) << 4)) + (p >> 1) * BOX_BYTES;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        lo[i] = *reinterpret_cast<const U32x4*>(src.base + base + i * 2048);
        hi[i] = *reinterpret_cast<const U32x4*>(src.base + base + i * 2048 + 1024);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const u32 xl = j == 0 ? lo[i].x : (j == 1 ? lo[i].y : (j == 2 ? lo[i].z : lo[i].w));
          const u32 xh = j == 0 ? hi[i].x : (j == 1 ? hi[i].y : (j == 2 ? hi[i].z : hi[i].w));
          u32 a0, a2, a1, a3;
          e4m3x4_to_f16x2x2(xl, a0, a2);
          e4m3x4_to_f16x2x2(xh, a1, a3);
          mma_16816<0>((j & 1) ? s2[i] : s[i], a0, a1, a2, a3, qb[4 * p + j][0], qb[4 * p + j][1]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] += s2[i][c];
  }

  // ---- online softmax per query row (C columns 2t / 2t + 1): raw scores in, P^T out
  template <bool PARTIAL>
  GQADRV_DEVICE void softmax(float (&s)[MT][4], int tok0, int len) {
    const int g = lane >> 2;
    float x0 = neg_inf(), x1 = neg_inf();
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // token 16i + g (+ 8)
        if constexpr (PARTIAL) {
          const int tk = tok0 + 16 * i + g + 8 * h;
          if (tk >= len - (CAUSAL ? sh0 : 0)) s[i][2 * h] = neg_inf();
          if (tk >= len - (CAUSAL ? sh1 : 0)) s[i][2 * h + 1] = neg_inf();
        }
        x0 = fmaxf(x0, s[i][2 * h]);
        x1 = fmaxf(x1, s[i][2 * h + 1]);
      }
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    const float n0 = fmaxf(m0, x0 * rs0), n1 = fmaxf(m1, x1 * rs1);
    const float b0 = n0 == neg_inf() ? 0.f : n0, b1 = n1 == neg_inf() ? 0.f : n1;
    const float al0 = fast_exp2(m0 - b0), al1 = fast_exp2(m1 - b1);
    const bool moved = (al0 != 1.f && m0 != neg_inf()) || (al1 != 1.f && m1 != neg_inf());
    m0 = n0;
    m1 = n1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[i][2 * h] = fast_exp2(fmaf(s[i][2 * h], rs0, -b0));  // -inf (masked) -> 0
        s[i][2 * h + 1] = fast_exp2(fmaf(s[i][2 * h + 1], rs1, -b1));
        sum0 += s[i][2 * h];
        sum1 += s[i][2 * h + 1];
      }
    }
    l0 = l0 * al0 + sum0;
    l1 = l1 * al1 + sum1;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int j = 0; j < OT; ++j) {
        o[j][0] *= al0;
        o[j][2] *= al0;
        o[j][1] *= al1;
        o[j][3] *= al1;
      }
    }
  }

  // ---- O^T += V^T . P^T
  template <bool PARTIAL, class Src>
  GQADRV_DEVICE void accumulate(const Src& src, const float (&s)[MT][4], int tok0, int len) {
    const int t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < MT; ++ks) {
      // B = P^T of tokens 16 ks .. 16 ks + 15: the C fragments of M-tile ks, transposed
      const u32 b0 = movmatrix_trans(pack2<0>(s[ks][0], s[ks][1]));
      const u32 b1 = movmatrix_trans(pack2<0>(s[ks][2], s[ks][3]));
      const int r0 = 16 * ks + 2 * t;  // V token halves of r0 / r1 (as warp.cuh)
      u32 z0 = 0xffffffffu, z1 = 0xffffffffu;
      if constexpr (PARTIAL) v_token_masks(tok0 + r0, len, z0, z1);
      const u32 vbase = smem_u32(src.base) + KV_BYTES + ks * 2048;
#pragma unroll
      for (int q = 0; q < D / 32; ++q) {
        u32 r0v, r1v, r2v, r3v;
        ldsm_v<PARTIAL>(vbase + ((vofs8() ^ ((q & 3) << 5)) + (q >> 2) * BOX_BYTES), z0, z1, r0v, r1v, r2v, r3v);
        u32 e0, e2, e1, e3, d0, d2, d1, d3;  // even / odd dims: a0 / a2 from chunk 2q, a1 / a3 from 2q + 1
        e4m3x4_to_f16x2x2(__byte_perm(r0v, r1v, 0x6420), e0, e2);
        e4m3x4_to_f16x2x2(__byte_perm(r2v, r3v, 0x6420), e1, e3);
        e4m3x4_to_f16x2x2(__byte_perm(r0v, r1v, 0x7531), d0, d2);
        e4m3x4_to_f16x2x2(__byte_perm(r2v, r3v, 0x7531), d1, d3);
        mma_16816<0>(o[2 * q], e0, e1, e2, e3, b0, b1);
        mma_16816<0>(o[2 * q + 1], d0, d1, d2, d3, b0, b1);
      }
    }
  }

  GQADRV_DEVICE void finish() {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
  }

  // This warp's state of rows < group into the MergeArea (as WarpDecoder::store_state): O^T M-tile
  // 2q (+1) row g -> dim 32q + 2g (+1), row g + 8 -> dim 32q + 16 + 2g (+1).
  GQADRV_DEVICE void store_state(float* __restrict__ ml, float* __restrict__ os, int group) const {
    constexpr int ST = StateLayout<D>::STRIDE;
    const int t = lane & 3, g = lane >> 2;
    const int r0 = 2 * t, r1 = 2 * t + 1;
    const bool ok0 = r0 < group, ok1 = r1 < group;
    if (g == 0) {
      if (ok0) {
        ml[2 * r0] = m0;
        ml[2 * r0 + 1] = l0;
      }
      if (ok1) {
        ml[2 * r1] = m1;
        ml[2 * r1 + 1] = l1;
      }
    }
    const float f = out_scale;
#pragma unroll
    for (int q = 0; q < D / 32; ++q) {
      const float(&ev)[4] = o[2 * q];
      const float(&od)[4] = o[2 * q + 1];
      const int dlo = 32 * q + 2 * g, dhi = dlo + 16;
      if (ok0) {
        *reinterpret_cast<F32x2*>(os + r0 * ST + dlo) = F32x2{ev[0] * f, od[0] * f};
        *reinterpret_cast<F32x2*>(os + r0 * ST + dhi) = F32x2{ev[2] * f, od[2] * f};
      }
      if (ok1) {
        *reinterpret_cast<F32x2*>(os + r1 * ST + dlo) = F32x2{ev[1] * f, od[1] * f};
        *reinterpret_cast<F32x2*>(os + r1 * ST + dhi) = F32x2{ev[3] * f, od[3] * f};
      }
    }
  }
};
#endif  // GQADRV_FP8_HW
