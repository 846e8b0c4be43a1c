// gqadrv — warp-level GQA decode core, shared by the short, TMA (sm_90a), portable (sm_80) and
// tcgen05-family host paths.
//
// One warp owns the query heads of one KV-head group (rows 0..g-1 of an m16n8k16 A operand; rows
// g..ROWS-1 are zero padding) and streams sub-tiles of TOK tokens of K and V through mma.sync:
//
//   S (ROWS x TOK)  = Q (ROWS x D) . K^T      A = Q fragments (registers), B = K rows
//   online softmax in the log2 domain on S's C fragments (quad shuffles only)
//   O (ROWS x D)   += P (ROWS x TOK) . V      A = P (re-packed C fragments), B = V rows
//
// K (QK^T): a dot product may sum its terms in any order, so the head dimension of Q and K is
// permuted per lane such that every lane reads whole 16-byte chunks (8 elements) of a K row:
//   K/Q chunk read by lane quad t (= lane % 4) in k-step pair p:  c = 2t + (p & 1) + 8 (p >> 1)
//   (chunks 2t and 2t+1 of a 128-byte swizzle row never share a bank group: conflict-free)
// V (P.V) from the same 128B-swizzled shared-memory slot (SwizzledSmemChunks of
// kernels/common/swizzle.cuh, written by TMA or cp.async): one ldmatrix.x4.trans per (16 tokens,
// 16 head-dim columns) yields the B fragments of two O n-tiles; O n-tile j holds head-dim columns
// 8j..8j+7.
// Shared-memory addresses are per-lane offsets computed once (init) plus compile-time constants,
// so the inner loop has no address arithmetic. Full sub-tiles (tok0 + TOK <= len, warp-uniform)
// run a copy of the step without any masking.
//
// Softmax state (running max m and partial sum l, both per row; kernels/common/softmax_state.cuh)
// lives in registers; l is kept per lane and reduced across the quad once at the end. Positions
// >= len get score -inf, and the V halves of tokens >= len are zeroed in the ldmatrix fragments
// before P.V, so NaN/Inf stored in padding never reaches O.
// CAUSAL = true (multi-token queries, kernels/gqa/sm80/decode_paged.cu): row g of the lane may see
// fewer keys than the sub-tile's `len`: set_causal gives each of the lane's two rows a shift, and
// keys >= len - shift get score -inf for that row (V rows are still zeroed from `len` on, the
// largest limit). The unmasked copy of the step runs only when the whole sub-tile is below
// len - max_shift. CAUSAL = false compiles to the code above. The CTA-level pieces (merge of the
// warps' states, output, split merge) are in cta.cuh next to this file.
//
// KV8 = true (FP8-e4m3 caches, the paged kernels): K and V are one byte per element in a slot of
// the same 128B swizzle (kv8_chunk_offset below: rows of D bytes, D/128 boxes; D = 64 uses one half
// of each 128-byte row). The MMAs stay fp16 m16n8k16 (fp32 accumulation); codes become f16 in
// registers, by cvt.rn.f16x2.e4m3x2 on sm_89+ (exact) or by integer ops (value * 2^-8,
// e4m3x2_{even,odd}_to_f16x2_scaled in common/fp8.cuh; GQA_KV8_CVT below), and that factor, the K
// scale and the softmax scale are folded into a per-row score scale, the V scale into the stored
// state. Since a dot product and P.V may sum in any order, both operands are permuted:
//   K: lane quad t reads whole 16-byte chunks c = k_chunk(p, t) (16 dims) of its token row; register
//      j of a chunk (dims d = 16c + 4j .. d + 3) is one k-step: b0 = codes (d, d + 1), b1 = (d + 2,
//      d + 3) by cvt, (d, d + 2) / (d + 1, d + 3) by the integer ops; Q's A registers hold the same
//      pairs (load_q8).
//   V: ldmatrix.x4.trans on byte pairs gives a lane tokens (2t, 2t + 1) x dims (2g, 2g + 1) of a
//      16-dim chunk c per register; the even codes make the B fragment of n-tile 2c (column g = dim
//      16c + 2g), the odd codes that of n-tile 2c + 1 (dim 16c + 2g + 1) (cvt: after a byte permute
//      that pairs the codes of one dim). O's C fragment of lane t
//      then holds dims 16c + 4t .. 16c + 4t + 3 of n-tiles 2c / 2c + 1 (o_dim).
// bf16 queries are converted to fp16 with a power-of-two multiplier per row (its largest |q| to
// [2^14, 2^15)), undone by the row's score scale; P is fp16.
#pragma once
#include "../../common/ptx.cuh"
#include "../../common/fp8.cuh"
#include "../../common/swizzle.cuh"
#include "../../common/softmax_state.cuh"

// e4m3 decoders (WarpDecoder<..., KV8>, WarpDecoderT8): the 16-byte K chunk (16 dims) a lane of quad
// position t reads in its p-th load of a token row (the chunk pairs of a 128B swizzle row never share a
// bank group; D = 64 rows have one chunk per lane).
template <int D>
GQADRV_DEVICE int kv8_k_chunk(int p, int t) {
  return D == 64 ? t : 2 * t + (p & 1) + 8 * (p >> 1);
}

// e4m3 decoders: query row `row` (null: a padding row, zeros) as fp16 MMA registers in the K-chunk
// order, k-step 4p + j of chunk kv8_k_chunk(p, t), dims d = 16c + 4j .. d + 3: CVT_PAIRS (the cvt
// conversion pairs codes (0, 1) / (2, 3)): {q[d], q[d+1]} / {q[d+2], q[d+3]}; else (the integer path
// pairs (0, 2) / (1, 3)): {q[d], q[d+2]} / {q[d+1], q[d+3]}. bf16 rows are multiplied by 2^k first (k
// per row: its largest finite |q| to [2^14, 2^15), k in [-100, 100], the max taken over the lane quad),
// so they fit fp16; returns the row's score scale `rscale` * 2^-k.
template <int DT, int D, bool CVT_PAIRS, int N>
GQADRV_DEVICE float load_q8_row(const u16* __restrict__ row, u32 (&qr)[N][2], float rscale, int t) {
  constexpr int NP8 = D / 64;
  static_assert(N == 4 * NP8, "one register pair per k-step");
  float mult = 1.f;
  if constexpr (DT == 1) {  // bf16: a power of two per row keeps it inside fp16's range
    float mx = 0.f;
#pragma unroll
    for (int p = 0; p < NP8; ++p) {
      if (!row) break;
      const U32x4* src = reinterpret_cast<const U32x4*>(row + 16 * kv8_k_chunk<D>(p, t));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const U32x4 v = src[h];
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float a, b;
          unpack2<1>(w[i], a, b);
          mx = fmaxf(mx, fmaxf(finite_abs(a), finite_abs(b)));
        }
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    int k = 14 - ((int)(__float_as_uint(mx) >> 23) - 127);  // mx in [2^e, 2^(e+1)) -> 2^k mx in [2^14, 2^15)
    k = k < -100 ? -100 : (k > 100 ? 100 : k);
    mult = __uint_as_float((u32)(127 + k) << 23);
    rscale *= __uint_as_float((u32)(127 - k) << 23);
  }
#pragma unroll
  for (int p = 0; p < NP8; ++p) {
    u32 w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (row) {
      const U32x4* src = reinterpret_cast<const U32x4*>(row + 16 * kv8_k_chunk<D>(p, t));
      const U32x4 v0 = src[0], v1 = src[1];
      w[0] = v0.x; w[1] = v0.y; w[2] = v0.z; w[3] = v0.w;
      w[4] = v1.x; w[5] = v1.y; w[6] = v1.z; w[7] = v1.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // dims 4j .. 4j + 3 of the chunk: w[2j] = (4j, 4j + 1), w[2j + 1]
      float a, b, c, d;
      unpack2<DT>(w[2 * j], a, b);
      unpack2<DT>(w[2 * j + 1], c, d);
      if constexpr (CVT_PAIRS) {
        qr[4 * p + j][0] = pack2<0>(a * mult, b * mult);
        qr[4 * p + j][1] = pack2<0>(c * mult, d * mult);
      } else {
        qr[4 * p + j][0] = pack2<0>(a * mult, c * mult);
        qr[4 * p + j][1] = pack2<0>(b * mult, d * mult);
      }
    }
  }
  return rscale;
}

// The V rows a lane's ldmatrix.x4.trans registers hold are tokens (tr, tr + 1) (registers 0 / 2) and
// (tr + 8, tr + 9) (registers 1 / 3), one per 16-bit half: masks that keep the tokens below `len`.
GQADRV_DEVICE void v_token_masks(int tr, int len, u32& z0, u32& z1) {
  z0 = (tr < len ? 0x0000ffffu : 0u) | (tr + 1 < len ? 0xffff0000u : 0u);
  z1 = (tr + 8 < len ? 0x0000ffffu : 0u) | (tr + 9 < len ? 0xffff0000u : 0u);
}

// ldmatrix.x4.trans of V rows; PARTIAL: tokens at or past the length zeroed (v_token_masks), so NaN /
// Inf stored in padding never reaches P.V.
template <bool PARTIAL>
GQADRV_DEVICE void ldsm_v(u32 addr, u32 z0, u32 z1, u32& r0, u32& r1, u32& r2, u32& r3) {
  ldsm_x4_trans(addr, r0, r1, r2, r3);
  if constexpr (PARTIAL) {
    r0 &= z0;
    r1 &= z1;
    r2 &= z0;
    r3 &= z1;
  }
}

// Byte offset of 16-byte chunk `c` (16 e4m3 elements) of row `r` in an FP8 slot of `rows` rows of D
// bytes: the 128B swizzle of SwizzledSmemChunks (what TMA writes for D >= 128); D = 64 rows use chunk
// positions c ^ 4 (r & 1), so that rows 2i and 2i + 1 fill different halves of the banks.
template <int D>
GQADRV_DEVICE u32 kv8_chunk_offset(int rows, int r, int c) {
  return swizzled_chunk_offset(rows, r, D == 64 ? c ^ ((r & 1) << 2) : c);
}

// GQA_KV8_CVT: how e4m3 codes become fp16 operands. 0: integer ops (value * 2^-8, 7 ops per four
// codes; the only way on sm_80 / sm_86); 1: cvt.rn.f16x2.e4m3x2 for K and V (2 per four codes, V
// pairs its tokens with two byte permutes per register pair first); 2: cvt for K, integer ops for V
// (the two halves on different pipes). Default 1 where the cvt exists (sm_89+), 0 elsewhere;
// GQADRV_KV8_CVT=N overrides (development).
#if !GQADRV_FP8_HW
#undef GQA_KV8_CVT
#define GQA_KV8_CVT 0
#elif !defined(GQA_KV8_CVT)
#define GQA_KV8_CVT 1
#endif

template <int DT, int D, int ROWS, int TOK, bool CAUSAL = false, bool KV8 = false>
struct WarpDecoder {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(ROWS == 8 || ROWS == 16, "rows");
  static_assert(TOK == 16 || TOK == 32 || TOK == 64, "tokens per sub-tile");
  static constexpr int KP = D / 32;   // QK k-step pairs (one 16-byte chunk per pair)
  static constexpr int NJ = D / 8;    // O n-tiles
  static constexpr int NT = TOK / 8;  // S n-tiles per sub-tile
  static constexpr int KS = TOK / 16; // P.V k-steps per sub-tile
  static constexpr int NB = D / 64;   // 128-byte boxes per row
  static constexpr bool R16 = ROWS == 16;
  // Accumulator floats kept per n-tile. With 8 rows the C rows 8..15 only ever accumulate zeros (A
  // rows 8..15 are zero), but keeping them saves re-zeroing two registers per MMA; only D = 256
  // cannot afford the extra registers.
  static constexpr int OC = (R16 || D <= 128) ? 4 : 2;
  static constexpr int BOX_BYTES = TOK * 128;
  // K part of a shared-memory slot (V follows): D/64 (fp16/bf16) or max(1, D/128) (e4m3) boxes
  static constexpr int KV_BYTES = KV8 ? (D < 128 ? 128 : D) * TOK : D * TOK * 2;
  static constexpr int DTYPE = DT, DIM = D, NROWS = ROWS;  // for code templated on the decoder type
  static constexpr bool IS_KV8 = KV8;
  static constexpr int MDT = KV8 ? 0 : DT;  // MMA input type: the query's, or fp16 for e4m3 caches
  static constexpr int NP8 = D / 64;        // KV8: 16-byte K chunks per lane and token row
  static constexpr bool K_CVT = KV8 && GQA_KV8_CVT >= 1;  // K codes by cvt (exact) or integer ops (* 2^-8)
  static constexpr bool V_CVT = KV8 && GQA_KV8_CVT == 1;
  static constexpr float K_FOLD = K_CVT ? 1.f : 256.f;  // undoes the 2^-8 of the integer path
  static constexpr float V_FOLD = V_CVT ? 1.f : 256.f;

  u32 q_lo[2 * KP][2];               // A regs 0/2 (row g)
  u32 q_hi[R16 ? 2 * KP : 1][2];     // A regs 1/3 (row g + 8), only with 16 rows
  float o[NJ][OC];
  float m_lo, m_hi;                  // running max (log2 domain), quad-uniform
  float l_lo, l_hi;                  // partial sums of this lane
  int lane;
  int shift_lo = 0, shift_hi = 0, shift_max = 0;  // CAUSAL only: keys visible to a row: [0, len - shift)
  float rs_lo, rs_hi;  // KV8 only: per-row score scale (log2 domain; set by load_q8)
  float out_scale;     // KV8 only: V scale * 2^8, applied to the stored state (set by load_q8)
  // Shared-memory path: this lane's byte offsets in a slot for k-step pair p = 0 (K chunk) and n-tile
  // pair q = 0 (ldmatrix row). The other pairs differ only in the swizzle bits 4..6:
  //   K (p): kofs ^ ((p & 1) << 4) + (p >> 1) * BOX_BYTES + i * 1024     (row 8i + g)
  //   V (q): vofs ^ ((q & 3) << 5) + (q >> 2) * BOX_BYTES + ks * 2048    (k-step ks)
  // (the added terms are multiples of 128, so XOR and addition commute with them). K row 8i + g has
  // swizzle phase g for every i and chunk 2t + (p & 1) stays inside its box; for ldmatrix.x4.trans
  // of k-step ks and n-tile pair q (chunks 2q, 2q + 1) lane l addresses token
  // 16 ks + (l % 8) + 8 ((l / 8) % 2), chunk 2q + l / 16. Both are recomputed from the lane id where
  // used (two registers fewer for the D = 256 variants).
  GQADRV_DEVICE u32 kofs() const { return swizzled_chunk_offset(TOK, lane >> 2, 2 * (lane & 3)); }
  GQADRV_DEVICE u32 vofs() const {
    return swizzled_chunk_offset(TOK, (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4);
  }

  // KV8: offsets of K chunk k_chunk(p = 0, t) of row g and of the lane's ldmatrix row (as kofs / vofs)
  GQADRV_DEVICE u32 kofs8() const {
    const int g = lane >> 2, t = lane & 3;
    return kv8_chunk_offset<D>(TOK, g, D == 64 ? t : 2 * t);
  }
  GQADRV_DEVICE u32 vofs8() const {
    return kv8_chunk_offset<D>(TOK, (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4);
  }

  static GQADRV_DEVICE int k_chunk(int p, int t) { return KV8 ? kv8_k_chunk<D>(p, t) : 2 * t + (p & 1) + 8 * (p >> 1); }
  // head-dim element of O n-tile j, column n
  static GQADRV_DEVICE int o_dim(int j, int n) { return KV8 ? 16 * (j >> 1) + 2 * n + (j & 1) : 8 * j + n; }

  GQADRV_DEVICE void init(int lane_id) {
    lane = lane_id;
    m_lo = m_hi = neg_inf();
    l_lo = l_hi = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < OC; ++c) o[j][c] = 0.f;
  }

  // CAUSAL: this lane's rows g and g + 8 see keys [0, len - lo) and [0, len - hi); `max_shift` >= both
  // (warp-uniform).
  GQADRV_DEVICE void set_causal(int lo, int hi, int max_shift) {
    shift_lo = lo;
    shift_hi = hi;
    shift_max = max_shift;
  }

  // Q rows (heads) of this group; `row_lo` / `row_hi` are null for padding rows.
  GQADRV_DEVICE void load_q(const u16* __restrict__ row_lo, const u16* __restrict__ row_hi) {
    const int t = lane & 3;
#pragma unroll
    for (int p = 0; p < KP; ++p) {
      const int c = k_chunk(p, t);
      U32x4 v = {0u, 0u, 0u, 0u};
      if (row_lo) v = *reinterpret_cast<const U32x4*>(row_lo + 8 * c);
      q_lo[2 * p][0] = v.x;
      q_lo[2 * p][1] = v.y;
      q_lo[2 * p + 1][0] = v.z;
      q_lo[2 * p + 1][1] = v.w;
      if constexpr (R16) {
        U32x4 h = {0u, 0u, 0u, 0u};
        if (row_hi) h = *reinterpret_cast<const U32x4*>(row_hi + 8 * c);
        q_hi[2 * p][0] = h.x;
        q_hi[2 * p][1] = h.y;
        q_hi[2 * p + 1][0] = h.z;
        q_hi[2 * p + 1][1] = h.w;
      }
    }
  }

  // KV8: Q rows (null: padding) as fp16 A registers (load_q8_row above) and the rows' score scales
  // from `scale_log2` (softmax scale * K scale / ln 2) times K_FOLD.
  GQADRV_DEVICE void load_q8(const u16* __restrict__ row_lo, const u16* __restrict__ row_hi, float scale_log2,
                             float v_scale) {
    static_assert(KV8, "FP8 caches only");
    out_scale = v_scale * V_FOLD;
    rs_lo = load_q8_row<DT, D, K_CVT>(row_lo, q_lo, scale_log2 * K_FOLD, lane & 3);
    if constexpr (R16) rs_hi = load_q8_row<DT, D, K_CVT>(row_hi, q_hi, scale_log2 * K_FOLD, lane & 3);
  }

  GQADRV_DEVICE void mma_qk(float (&s)[4], int ks, u32 b0, u32 b1) const {
    if constexpr (R16)
      mma_16816<MDT>(s, q_lo[ks][0], q_hi[ks][0], q_lo[ks][1], q_hi[ks][1], b0, b1);
    else
      mma_16816<MDT>(s, q_lo[ks][0], 0u, q_lo[ks][1], 0u, b0, b1);
  }

  // Process one sub-tile of TOK tokens starting at absolute token `tok0`; `src` is a
  // SwizzledSmemChunks slot (K then V, see copy_tile_cp_async below). `len` is the (clamped) valid
  // length: tokens >= len are masked and their V rows zeroed. D = 256 keeps one (masked) copy of
  // the step: a second copy pushes the 16-row variants into spills.
  template <class Src>
  GQADRV_DEVICE void step(const Src& src, int tok0, int len, float scale_log2) {
    if (D == 256 || tok0 + TOK > len - (CAUSAL ? shift_max : 0))  // warp-uniform
      step_impl<true>(src, tok0, len, scale_log2);
    else
      step_impl<false>(src, tok0, len, scale_log2);
  }

  template <bool PARTIAL, class Src>
  GQADRV_DEVICE void step_impl(const Src& src, int tok0, int len, float scale_log2) {
    float s[NT][4];
    scores(src, s);
    softmax<PARTIAL>(s, tok0, len, scale_log2);
    accumulate<PARTIAL>(src, s, tok0, len);
  }

  // ---- S = Q K^T: even and odd k-steps accumulate separately (two chains of D/32 MMAs each),
  // except for D = 256, where the second set of accumulators would spill.
  template <class Src>
  GQADRV_DEVICE void scores(const Src& src, float (&s)[NT][4]) const {
    constexpr bool SPLIT_QK = D != 256;
    float s2[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      s2[i][0] = s2[i][1] = s2[i][2] = s2[i][3] = 0.f;
    }
    if constexpr (KV8) {
      // one 16-byte chunk = four k-steps (register j: dims 16c + 4j .. + 3, see load_q8)
#pragma unroll
      for (int p = 0; p < NP8; ++p) {
        U32x4 kc[NT];
#pragma unroll
        for (int i = 0; i < NT; ++i)
          kc[i] = *reinterpret_cast<const U32x4*>(src.base + ((kofs8() ^ ((p & 1) << 4)) + (p >> 1) * BOX_BYTES + i * 1024));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int i = 0; i < NT; ++i) {
            const u32 x = j == 0 ? kc[i].x : (j == 1 ? kc[i].y : (j == 2 ? kc[i].z : kc[i].w));
            u32 b0, b1;
            if constexpr (K_CVT) {
#if GQADRV_FP8_HW
              e4m3x4_to_f16x2x2(x, b0, b1);
#endif
            } else {
              b0 = e4m3x2_even_to_f16x2_scaled(x);
              b1 = e4m3x2_odd_to_f16x2_scaled(x);
            }
            mma_qk((SPLIT_QK && (j & 1)) ? s2[i] : s[i], 4 * p + j, b0, b1);
          }
        }
      }
    } else {
#pragma unroll
      for (int p = 0; p < KP; ++p) {
        U32x4 kc[NT];
#pragma unroll
        for (int i = 0; i < NT; ++i)
          kc[i] = *reinterpret_cast<const U32x4*>(src.base + ((kofs() ^ ((p & 1) << 4)) + (p >> 1) * BOX_BYTES + i * 1024));
#pragma unroll
        for (int i = 0; i < NT; ++i) mma_qk(s[i], 2 * p, kc[i].x, kc[i].y);
#pragma unroll
        for (int i = 0; i < NT; ++i) mma_qk(SPLIT_QK ? s2[i] : s[i], 2 * p + 1, kc[i].z, kc[i].w);
      }
    }
    if constexpr (SPLIT_QK) {
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] += s2[i][c];
    }
  }

  // ---- online softmax (log2 domain): raw scores in, probabilities P out; rescales O and l.
  // scale_log2 > 0 (validated on the host), so the max of the raw scores is the max of the scaled.
  template <bool PARTIAL>
  GQADRV_DEVICE void softmax(float (&s)[NT][4], int tok0, int len, float scale_log2) {
    const int t = lane & 3;
    const float sc_lo = KV8 ? rs_lo : scale_log2, sc_hi = KV8 ? rs_hi : scale_log2;
    float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (PARTIAL && CAUSAL) {
          const int tk = tok0 + 8 * i + 2 * t + e;
          if (tk >= len - shift_lo) s[i][e] = neg_inf();
          if (tk >= len - shift_hi) s[i][2 + e] = neg_inf();
        } else if constexpr (PARTIAL) {
          if (tok0 + 8 * i + 2 * t + e >= len) {
            s[i][e] = neg_inf();
            s[i][2 + e] = neg_inf();
          }
        }
        mx_lo = fmaxf(mx_lo, s[i][e]);
        if constexpr (R16) mx_hi = fmaxf(mx_hi, s[i][2 + e]);
      }
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    const float mold_lo = m_lo;
    const float mnew_lo = fmaxf(m_lo, mx_lo * sc_lo);
    const float base_lo = mnew_lo == neg_inf() ? 0.f : mnew_lo;
    const float alpha_lo = fast_exp2(m_lo - base_lo);
    m_lo = mnew_lo;
    float alpha_hi = 1.f, base_hi = 0.f, mold_hi = neg_inf();
    if constexpr (R16) {
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      mold_hi = m_hi;
      const float mnew_hi = fmaxf(m_hi, mx_hi * sc_hi);
      base_hi = mnew_hi == neg_inf() ? 0.f : mnew_hi;
      alpha_hi = fast_exp2(m_hi - base_hi);
      m_hi = mnew_hi;
    }
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[i][e] = fast_exp2(fmaf(s[i][e], sc_lo, -base_lo));  // -inf (masked) -> 0
        sum_lo += s[i][e];
        if constexpr (R16) {
          s[i][2 + e] = fast_exp2(fmaf(s[i][2 + e], sc_hi, -base_hi));
          sum_hi += s[i][2 + e];
        }
      }
    }
    l_lo = l_lo * alpha_lo + sum_lo;
    if constexpr (R16) l_hi = l_hi * alpha_hi + sum_hi;
    // Rescale O only when some row's max moved, and (except for D = 256, where the two registers
    // this needs would spill) only after the row held a value: O is still zero while the max is
    // -inf, e.g. on the first sub-tile.
    constexpr bool SKIP_EMPTY = D != 256;
    const bool moved = (alpha_lo != 1.f && (!SKIP_EMPTY || mold_lo != neg_inf())) ||
                       (R16 && alpha_hi != 1.f && (!SKIP_EMPTY || mold_hi != neg_inf()));
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        o[j][0] *= alpha_lo;
        o[j][1] *= alpha_lo;
        if constexpr (R16) {
          o[j][2] *= alpha_hi;
          o[j][3] *= alpha_hi;
        }  // (8 rows: o[j][2..3] hold the zero rows 8..15, nothing to rescale)
      }
    }
  }

  GQADRV_DEVICE void mma_pv(int j, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (OC == 4) {
      mma_16816<MDT>(o[j], a0, a1, a2, a3, b0, b1);
    } else {
      float acc[4] = {o[j][0], o[j][1], 0.f, 0.f};
      mma_16816<MDT>(acc, a0, a1, a2, a3, b0, b1);
      o[j][0] = acc[0];
      o[j][1] = acc[1];
    }
  }

  // ---- O += P V
  template <bool PARTIAL, class Src>
  GQADRV_DEVICE void accumulate(const Src& src, const float (&s)[NT][4], int tok0, int len) {
    const int t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const u32 a0 = pack2<MDT>(s[2 * ks][0], s[2 * ks][1]);
      const u32 a2 = pack2<MDT>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      u32 a1 = 0u, a3 = 0u;
      if constexpr (R16) {
        a1 = pack2<MDT>(s[2 * ks][2], s[2 * ks][3]);
        a3 = pack2<MDT>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      }
      const int r0 = 16 * ks + 2 * t;  // this lane's tokens r0, r0+1 (b0) and r0+8, r0+9 (b1)
      // 16-bit masks of the token halves of b0 / b1 (all ones on a full sub-tile)
      u32 z0 = 0xffffffffu, z1 = 0xffffffffu;
      if constexpr (PARTIAL) v_token_masks(tok0 + r0, len, z0, z1);
      const u32 vbase = smem_u32(src.base) + KV_BYTES + ks * 2048;
      if constexpr (KV8) {
        // ldmatrix.x4.trans over chunks 2q, 2q + 1: r0 / r1 tokens (2t, 2t+1) / (2t+8, 2t+9) x dims
        // (2g, 2g+1) of chunk 2q, r2 / r3 of chunk 2q + 1; the masks clear whole tokens (16-bit halves)
#pragma unroll
        for (int q = 0; q < D / 32; ++q) {
          u32 r0, r1, r2, r3;
          ldsm_v<PARTIAL>(vbase + ((vofs8() ^ ((q & 3) << 5)) + (q >> 2) * BOX_BYTES), z0, z1, r0, r1, r2, r3);
          if constexpr (V_CVT) {
#if GQADRV_FP8_HW
            // even dims: bytes 0, 2 of r0 / r1 (tokens 2t, 2t+1 / 2t+8, 2t+9); odd dims: bytes 1, 3
            u32 e0, e1, o0, o1;
            e4m3x4_to_f16x2x2(__byte_perm(r0, r1, 0x6420), e0, e1);
            e4m3x4_to_f16x2x2(__byte_perm(r0, r1, 0x7531), o0, o1);
            mma_pv(4 * q, a0, a1, a2, a3, e0, e1);
            mma_pv(4 * q + 1, a0, a1, a2, a3, o0, o1);
            e4m3x4_to_f16x2x2(__byte_perm(r2, r3, 0x6420), e0, e1);
            e4m3x4_to_f16x2x2(__byte_perm(r2, r3, 0x7531), o0, o1);
            mma_pv(4 * q + 2, a0, a1, a2, a3, e0, e1);
            mma_pv(4 * q + 3, a0, a1, a2, a3, o0, o1);
#endif
          } else {
            mma_pv(4 * q, a0, a1, a2, a3, e4m3x2_even_to_f16x2_scaled(r0), e4m3x2_even_to_f16x2_scaled(r1));
            mma_pv(4 * q + 1, a0, a1, a2, a3, e4m3x2_odd_to_f16x2_scaled(r0), e4m3x2_odd_to_f16x2_scaled(r1));
            mma_pv(4 * q + 2, a0, a1, a2, a3, e4m3x2_even_to_f16x2_scaled(r2), e4m3x2_even_to_f16x2_scaled(r3));
            mma_pv(4 * q + 3, a0, a1, a2, a3, e4m3x2_odd_to_f16x2_scaled(r2), e4m3x2_odd_to_f16x2_scaled(r3));
          }
        }
        continue;
      }
#pragma unroll
      for (int q = 0; q < NJ / 2; ++q) {
        u32 b0, b1, b2, b3;
        ldsm_v<PARTIAL>(vbase + ((vofs() ^ ((q & 3) << 5)) + (q >> 2) * BOX_BYTES), z0, z1, b0, b1, b2, b3);
        mma_pv(2 * q, a0, a1, a2, a3, b0, b1);
        mma_pv(2 * q + 1, a0, a1, a2, a3, b2, b3);
      }
    }
  }

  // Reduce the per-lane partial sums across the quad (call once after the last step).
  GQADRV_DEVICE void finish() {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    if constexpr (R16) {
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    }
  }

  // Normalise this warp's state and write it as output rows (row r of the group at out + r * D, rows
  // < group; a row without keys, l == 0, gives zeros): for a CTA whose keys all fell in this warp, where
  // the CTA merge would multiply by exp2(0) = 1 and give the same values. fp16 / bf16 caches only.
  GQADRV_DEVICE void store_output(u16* __restrict__ out, int group) const {
    static_assert(!KV8, "store_output: fp16 / bf16 caches only");
    const int t = lane & 3, g = lane >> 2;
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f;
    if (g < group) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        *reinterpret_cast<u32*>(out + g * D + o_dim(j, 2 * t)) = pack2<DT>(o[j][0] * inv_lo, o[j][1] * inv_lo);
    }
    if constexpr (R16) {
      const float inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
      if (g + 8 < group) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
          *reinterpret_cast<u32*>(out + (g + 8) * D + o_dim(j, 2 * t)) = pack2<DT>(o[j][2] * inv_hi, o[j][3] * inv_hi);
      }
    }
  }

  // Write this warp's state (rows < group) into the CTA merge area (MergeArea,
  // kernels/common/softmax_state.cuh): ml[row] = {m, l}, o[row * StateLayout<D>::STRIDE + d].
  GQADRV_DEVICE void store_state(float* __restrict__ ml, float* __restrict__ os, int group) const {
    constexpr int ST = StateLayout<D>::STRIDE;
    const int t = lane & 3, g = lane >> 2;
    const bool lo_ok = g < group, hi_ok = R16 && (g + 8 < group);
    if (t == 0) {
      if (lo_ok) {
        ml[2 * g] = m_lo;
        ml[2 * g + 1] = l_lo;
      }
      if (hi_ok) {
        ml[2 * (g + 8)] = m_hi;
        ml[2 * (g + 8) + 1] = l_hi;
      }
    }
    if constexpr (KV8) {  // n-tiles 2c / 2c + 1: dims 16c + 4t + {0, 2} / {1, 3}: one 16-byte store per row
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const int d0 = 16 * c + 4 * t;
        const float (&ev)[OC] = o[2 * c];
        const float (&od)[OC] = o[2 * c + 1];
        const float f = out_scale;
        if (lo_ok) *reinterpret_cast<U32x4*>(os + g * ST + d0) =
            U32x4{__float_as_uint(ev[0] * f), __float_as_uint(od[0] * f), __float_as_uint(ev[1] * f), __float_as_uint(od[1] * f)};
        if constexpr (R16) {
          if (hi_ok) *reinterpret_cast<U32x4*>(os + (g + 8) * ST + d0) =
              U32x4{__float_as_uint(ev[2] * f), __float_as_uint(od[2] * f), __float_as_uint(ev[3] * f), __float_as_uint(od[3] * f)};
        }
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d0 = o_dim(j, 2 * t);  // columns d0, d0 + 1: one 64-bit store per row
      if (lo_ok) *reinterpret_cast<F32x2*>(os + g * ST + d0) = F32x2{o[j][0], o[j][1]};
      if constexpr (R16) {
        if (hi_ok) *reinterpret_cast<F32x2*>(os + (g + 8) * ST + d0) = F32x2{o[j][2], o[j][3]};
      }
    }
  }
};

// Source of K and V for WarpDecoder::step: a SwizzledSmemChunks (kernels/common/swizzle.cuh) slot
// holding K then V of one sub-tile, each as D/64 boxes of TOK rows x 128 B with the 128B swizzle
// (the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B, and the cp.async copies below write by
// hand). Read by a WarpDecoder through its precomputed per-lane offsets (K: 16-byte loads, V:
// ldmatrix.x4.trans).
//
// Fill a slot of this layout with rows [tok0, tok0 + TOK) of a K and a V plane (row stride D
// elements) by cp.async, 16 bytes per lane per copy: no register result, so nothing waits until
// cp.async.wait_group. Rows >= limit are zero-filled without reading global memory.
template <int TOK, int D>
GQADRV_DEVICE void copy_tile_cp_async(u32 slot, const u16* kbase, const u16* vbase, int tok0, int limit, int lane) {
  constexpr int NB = D / 64, CHUNKS = TOK * NB * 8;  // 16-byte chunks of K (or V)
#pragma unroll
  for (int k = 0; k < CHUNKS / 32; ++k) {
    const int idx = lane + 32 * k;
    const int r = idx / (NB * 8), c = idx - r * (NB * 8);
    const bool ok = tok0 + r < limit;
    const long long off = ok ? (long long)(tok0 + r) * D + 8 * c : 0;
    const u32 dst = slot + swizzled_chunk_offset(TOK, r, c);
    cp_async_16(dst, kbase + off, ok ? 16u : 0u);
    cp_async_16(dst + TOK * D * 2, vbase + off, ok ? 16u : 0u);
  }
}

// Copy the ROWS x D query rows of a (batch, KV head) into shared memory by cp.async, rows >= group
// zero-filled (all NTHREADS threads of the CTA take part; read after wait_group + __syncthreads).
// Loaded into registers instead, Q is moved into MMA operand registers right after its load, and
// those moves hold back every later instruction, loads included, for a full round trip.
template <int ROWS, int D, int NTHREADS>
GQADRV_DEVICE void stage_q_cp_async(u16* s_q, const u16* q_rows, int group) {
  for (int i = threadIdx.x; i < ROWS * D / 8; i += NTHREADS) {
    const bool ok = i / (D / 8) < group;
    cp_async_16(smem_u32(s_q + 8 * i), q_rows + (ok ? 8 * i : 0), ok ? 16u : 0u);
  }
}
