// gqadrv — MLA dense decode (FlashMLA flash_mla_with_kvcache dense semantics): d_qk 576, d_v 512,
// V = the first 512 channels of every K row, paged K cache, split-KV with an in-kernel merge.
//
// Variants  MLA_MMA=1: wgmma (sm_90a only; SS operands through 128B-swizzle descriptors).
//           MLA_MMA=0: mma.sync m16n8k16 + ldmatrix from the same shared-memory layout (sm_80+,
//           builds for sm_90a and sm_100a). Both keep exactly the same accumulator layout, so the
//           loads, the softmax and the epilogue below are shared; only gemm_qk / gemm_pv differ.
//           MLA_DT: 0 fp16, 1 bf16. MLA_SMEM_BYTES: the dynamic shared memory the host launches with.
//
// CTA work  grid (nmb * S, h_kv, b): blockIdx.x = mb + nmb * split. One CTA = 64 packed query rows
//           (row r of the request/KV head = query token r / group, head kvh * group + r % group;
//           rows >= M = s_q * group are zero-filled and never stored) against the 64-token K tiles
//           [ntiles * split / S, ntiles * (split + 1) / S), ntiles = ceil(len / 64), len read on the
//           device and clamped to [0, max_blocks * page_size]. No host knowledge of lengths.
// Warps     256 threads = 2 warpgroups, no producer warp; every thread issues its share of the
//           cp.async loads (one tile row per 4 threads, 18 x 16 B each).
//           S = Q K^T: warpgroup w computes the 64 x 32 block of tile columns [32w, 32w + 32)
//           (m64n32k16 x 36). Row max exchanged through smem; P (64 x 64) written to smem by both.
//           O += P V: warpgroup w owns output columns [256w, 256w + 256) (m64n256k16 x 4,
//           128 fp32 accumulators per thread). Warp wi of a warpgroup owns rows 16wi .. 16wi + 15
//           in both GEMMs; lane 4g + t holds rows 16wi + g and 16wi + g + 8 (the wgmma / mma.sync
//           C layout), so both warpgroups hold the same rows and apply identical rescales.
// Smem map  (dynamic, base rounded up to 1024 B; every block below is 1024-aligned)
//           [0, 72K)          Q   64 rows x 576: 9 channel blocks of 64 rows x 128 B (8 KB each),
//                                 16-byte units XOR-swizzled by (row & 7) = the TMA/wgmma 128B swizzle
//           [72K, 144K)       K stage 0, same layout (64 tokens x 576)
//           [144K, 216K)      K stage 1
//           [216K, 224K)      P   64 rows x 64 tokens, one swizzled channel block (A of P V)
//           +512 B            row-max exchange [2][64] fp32; +512 B row-sum exchange [2][64]; +16 ticket
//           merge: the K ring holds the [64][S] merge weights once the main loop is over.
// Barriers  per tile (all __syncthreads, 256 threads):
//           B1 cp.async.wait_group 0 (+ fence.proxy.async for wgmma) then barrier: tile i landed
//              everywhere AND every thread finished tile i-1's GEMMs (wgmma waited), so the other
//              stage and P may be overwritten; tile i+1's loads are issued right after B1.
//           B2 row maxima of both warpgroups published.   B3 P tile written (+ proxy fence).
// d_qk 512 (MLA_NOPE=1): q and K rows of 512 channels; channel block 8 of the Q and K tiles is
//           neither loaded nor read (Q K^T over blocks 0..7).
// Masking   logits of tokens >= the row's limit (len, or len - (s_q - 1 - s) when causal) are set
//           to -1e33 (log2 domain) and the running max starts at -1e30, so no inf/NaN arithmetic;
//           K/V rows of tokens >= len are zero-filled by cp.async (src-size 0, no global read), so a
//           NaN in an unused page can never reach P V, and block_table[p] is read only for
//           p < ceil(len / page_size).
// Split     S == 1: out = O / l (q dtype), lse = ln 2 * (log2 l + m), +inf and zeros for l == 0.
//           With MLA_FLAG_MAX_LOGITS also max logit = ln 2 * m at lse + max_offset (-inf for l == 0).
//           With MLA_FLAG_SINK (S == 1 only; the host decides) out = O / (l + 2^(sink[head] log2 e - m)).
//           S > 1: unnormalised fp32 O and {m, l} of every valid row go to the workspace (empty
//           splits write m = -1e30, l = 0, O = 0), then __syncthreads, thread 0 takes a ticket
//           (atom.acq_rel.gpu on counters[b, kvh, mb]), __syncthreads; the CTA drawing S - 1 merges
//           the S partials with L2-only loads (ld.global.cg), writes out + lse and resets the counter
//           to 0 (next launch / graph replay needs no memset).
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/mma_sync.cuh"
#if MLA_MMA
#include "../common/wgmma_ops.cuh"
#endif
#ifndef MLA_FP8
#define MLA_FP8 0  // 1: k_cache in FlashMLA's 656-byte FP8 format (fp8_rows.cuh; see "FP8" above)
#endif
#if MLA_FP8
#include "../common/fp8_rows.cuh"
#endif
static_assert(!(MLA_NOPE && MLA_FP8), "MLA_NOPE (d_qk 512) is built for bf16 / fp16 rows");

namespace mla {
constexpr int DT = MLA_DT;
constexpr u32 CB_BYTES = 64u * 128u;      // one channel block of a 64-row tile
constexpr u32 TILE_BYTES = NCB * CB_BYTES;  // 73728
constexpr int NCB_QK = MLA_NOPE ? NCB - 1 : NCB;  // channel blocks of Q K^T (d_qk 512: no RoPE block)
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_K = TILE_BYTES;         // two stages
constexpr u32 OFF_P = 3 * TILE_BYTES;
constexpr u32 OFF_RED = OFF_P + CB_BYTES;
constexpr u32 OFF_LSUM = OFF_RED + 512;
constexpr u32 OFF_TICKET = OFF_LSUM + 512;
constexpr u32 SMEM_USED = OFF_TICKET + 16;
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the smem map (+1 KB alignment slack)");
static_assert(64u * MLA_MAX_SPLITS * 4u <= 2u * TILE_BYTES, "merge weights must fit in the K ring");
static_assert(MLA_THREADS == 256 && MLA_BLOCK_M == 64 && MLA_BLOCK_N == 64, "tiling is fixed");

// This thread's share of one 64-row x 576-channel tile: row tid / 4, 16-byte chunks (tid % 4) + 4i,
// i < 18, into the swizzled layout at `tile`. src == nullptr zero-fills the row (src-size 0: no
// global memory is read; `any` is only a well-formed address for the instruction).
GQADRV_DEVICE void load_tile_rows(u32 tile, const u16* src, const u16* any, int tid) {
  const int row = tid >> 2;
  const u32 nbytes = src != nullptr ? 16u : 0u;
#pragma unroll
  for (int i = 0; i < 2 * NCB_QK; ++i) {  // MLA_NOPE: channel block 8 is neither loaded nor read
    const int c = (tid & 3) + 4 * i;
    const u16* p = src != nullptr ? src + c * 8 : any;
    cp_async_16(tile + (u32)(c >> 3) * CB_BYTES + swz(row, c & 7), p, nbytes);
  }
}

// K tile of tokens [t0, t0 + 64) of request b, KV head kvh: token rows >= len are zero-filled and
// their block-table entries are not read.
GQADRV_DEVICE void load_k_tile(const MlaDecodeArgs& a, u32 tile, int b, int kvh, int len, int t0, int tid) {
  const int tok = t0 + (tid >> 2);
  const u16* src = nullptr;
  if (tok < len) {
    const int pg = tok >> a.page_shift, off = tok & (a.page_size - 1);
    const long long blk = a.block_table[(long long)b * a.bt_stride + pg];
    src = a.k_cache + blk * a.k_stride_block + (long long)off * a.k_stride_tok + (long long)kvh * a.k_stride_head;
  }
  load_tile_rows(tile, src, a.k_cache, tid);
}

#if MLA_FP8
// FP8 mode: thread tid dequantizes 16-code unit tid & 3 of every code block of token row tid >> 2.
GQADRV_DEVICE void fp8_store_tile(const fp8::CodeRows<0, 8, 1>& k8, u32 tile, int tid) {
  const int r = tid >> 2, cu = tid & 3;
  k8.template store_block<0>(tile, r, cu);
  k8.template store_block<1>(tile, r, cu);
  k8.template store_block<2>(tile, r, cu);
  k8.template store_block<3>(tile, r, cu);
  k8.template store_block<4>(tile, r, cu);
  k8.template store_block<5>(tile, r, cu);
  k8.template store_block<6>(tile, r, cu);
  k8.template store_block<7>(tile, r, cu);
}
#endif

#if MLA_MMA
// ---------------------------------------------------------------------------------- wgmma GEMMs
// S[64 x 32] = Q[64 x 576] * K[32w .. 32w+31][576]^T. Both operands K-major, 128B swizzle:
// k-step ks reads channel block ks / 4 at byte offset 32 * (ks % 4) inside the 128-byte rows.
GQADRV_DEVICE void gemm_qk(float (&s)[16], u32 q_base, u32 k_tile, int wg, int /*wi*/, int /*lane*/) {
  const u64 dq = wgmma_desc_sw128(q_base, 16, 1024);
  const u64 dk = wgmma_desc_sw128(k_tile + (u32)wg * 32u * 128u, 16, 1024);
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < NCB_QK * 4; ++ks) {
    const u64 off = (u64)(((u32)(ks >> 2) * CB_BYTES + (u32)(ks & 3) * 32u) >> 4);
    wgmma_m64n32k16_ss<DT, 0, 0>(s, dq + off, dk + off, ks > 0 ? 1 : 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(s);
}

// O[64 x 256] += P[64 x 64] * V[64 tokens][256w .. 256w+255]. P: K-major (one swizzled block).
// V is the K tile read MN-major: atoms of 8 tokens x 64 channels; LBO = 8 KB between channel
// blocks, SBO = 1 KB between 8-token groups; k-step kk starts 16 tokens (2 KB) further.
GQADRV_DEVICE void gemm_pv(float (&o)[128], u32 p_base, u32 k_tile, int wg, int /*wi*/, int /*lane*/) {
  const u64 dp = wgmma_desc_sw128(p_base, 16, 1024);
  const u64 dv = wgmma_desc_sw128(k_tile + (u32)wg * 4u * CB_BYTES, CB_BYTES, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_ss<DT, 0, 1>(o, dp + (u64)((kk * 32) >> 4), dv + (u64)((kk * 16 * 128) >> 4), 1);
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(o);
}
#else
// ------------------------------------------------------------------------- mma.sync GEMMs
// Same math and the same register layout as the wgmma variant, per warp: rows 16wi .. 16wi+15.
GQADRV_DEVICE void gemm_qk(float (&s)[16], u32 q_base, u32 k_tile, int wg, int wi, int lane) {
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = 0.f;
  const int mi = lane >> 3, lr = lane & 7;
  // A (Q) x4: matrices (rows +0/+8) x (k +0/+8); B (K rows = tokens) x4: (k +0/+8) x (tokens +0/+8)
  const int a_row = 16 * wi + lr + 8 * (mi & 1), a_u = mi >> 1;
  const int b_u = mi & 1;
  const u32 a_base = q_base + (u32)a_row * 128u;
  const u32 b_base0 = k_tile + (u32)(32 * wg + lr + 8 * (mi >> 1)) * 128u;  // tokens 32wg + [0, 16)
  const u32 b_base1 = b_base0 + 16u * 128u;                                 // tokens 32wg + [16, 32)
#pragma unroll 4
  for (int ks = 0; ks < NCB_QK * 4; ++ks) {
    const u32 cb = (u32)(ks >> 2) * CB_BYTES;
    const int u0 = (ks & 3) * 2;
    u32 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3;
    ldsm_x4(a_base + cb + (u32)(((u0 + a_u) ^ lr) << 4), a0, a1, a2, a3);
    ldsm_x4(b_base0 + cb + (u32)(((u0 + b_u) ^ lr) << 4), b0, b1, b2, b3);
    ldsm_x4(b_base1 + cb + (u32)(((u0 + b_u) ^ lr) << 4), c0, c1, c2, c3);
    mma16816<DT>(s[0], s[1], s[2], s[3], a0, a1, a2, a3, b0, b1);
    mma16816<DT>(s[4], s[5], s[6], s[7], a0, a1, a2, a3, b2, b3);
    mma16816<DT>(s[8], s[9], s[10], s[11], a0, a1, a2, a3, c0, c1);
    mma16816<DT>(s[12], s[13], s[14], s[15], a0, a1, a2, a3, c2, c3);
  }
}

GQADRV_DEVICE void gemm_pv(float (&o)[128], u32 p_base, u32 k_tile, int wg, int wi, int lane) {
  const int mi = lane >> 3, lr = lane & 7;
  const int a_row = 16 * wi + lr + 8 * (mi & 1), a_u = mi >> 1;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    u32 a0, a1, a2, a3;
    ldsm_x4(p_base + (u32)a_row * 128u + (u32)(((2 * kk + a_u) ^ lr) << 4), a0, a1, a2, a3);
    // B = V[token][channel] (row-major K x N): ldmatrix.trans, matrices
    // (tokens +0/+8) x (channels +0/+8); token & 7 == lr.
    const u32 v_row = k_tile + (u32)(16 * kk + lr + 8 * (mi & 1)) * 128u;
#pragma unroll
    for (int nn = 0; nn < 16; ++nn) {
      const int cblk = 4 * wg + (nn >> 2);              // channel block of channels 256wg + 16nn ..
      const int unit = 2 * (nn & 3) + (mi >> 1);
      u32 b0, b1, b2, b3;
      ldsm_x4_trans(v_row + (u32)cblk * CB_BYTES + (u32)((unit ^ lr) << 4), b0, b1, b2, b3);
      const int j = 2 * nn;
      mma16816<DT>(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3], a0, a1, a2, a3, b0, b1);
      mma16816<DT>(o[4 * j + 4], o[4 * j + 5], o[4 * j + 6], o[4 * j + 7], a0, a1, a2, a3, b2, b3);
    }
  }
}
#endif

}  // namespace mla

extern "C" __global__ void __launch_bounds__(MLA_THREADS, 1)
    mla_dense_decode(const __grid_constant__ MlaDecodeArgs a) {
  using namespace mla;
  const int tid = threadIdx.x;
  u8* smem;
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);  // base rounded up to 1 KB

  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
  const int nmb = a.num_m_blocks, S = a.num_splits;
  const int mb = (int)blockIdx.x % nmb, split = (int)blockIdx.x / nmb;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int M = a.m_rows, row0 = mb * MLA_BLOCK_M, group = a.group;

  pdl_wait();  // no-op unless launched with programmatic stream serialization
  const int len = clamped_len(a, b);
  const int ntiles = (len + MLA_BLOCK_N - 1) / MLA_BLOCK_N;
  const int t_beg = split_point(ntiles, split, S), t_end = split_point(ntiles, split + 1, S);

  // This thread's two rows (identical in both warpgroups) and the number of keys each may see.
  const int r_lo = 16 * wi + g, r_hi = r_lo + 8;
  const bool causal = (a.flags & MLA_FLAG_CAUSAL) != 0;
  auto row_limit = [&](int r) -> int {
    const int rg = row0 + r;
    if (rg >= M || !causal) return len;  // padding rows: zero Q, finite, never stored
    return len - (a.s_q - 1 - rg / group);
  };
  const int lim_lo = row_limit(r_lo), lim_hi = row_limit(r_hi);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_lo = M_INIT, m_hi = M_INIT, l_lo = 0.f, l_hi = 0.f;
  float* red = reinterpret_cast<float*>(smem + OFF_RED);

  if (t_beg < t_end) {
    {  // Q rows of this m-block (rows >= M zero-filled)
      const int r = tid >> 2, rg = row0 + r;
      const u16* src = nullptr;
      if (rg < M) {
        const int s = rg / group, h = rg - s * group;
        src = a.q + (long long)b * a.q_stride_b + (long long)s * a.q_stride_s +
              (long long)(kvh * group + h) * a.q_stride_h;
      }
      load_tile_rows(sb + OFF_Q, src, a.q, tid);
    }
#if MLA_FP8
    const i32* bt_row = a.block_table + (long long)b * a.bt_stride;
    {  // the first tile, dequantized right away
      const u8* row[1] = {fp8::row_at(a, bt_row, kvh, t_beg * MLA_BLOCK_N + (tid >> 2), len)};
      fp8::CodeRows<0, 8, 1> k8;
      k8.load(row, tid & 3);
      fp8::rope_rows(sb + OFF_K, row, a.k_cache, tid >> 2, tid & 3);
      fp8_store_tile(k8, sb + OFF_K, tid);
    }
#else
    load_k_tile(a, sb + OFF_K, b, kvh, len, t_beg * MLA_BLOCK_N, tid);
#endif
    cp_async_commit();

    const float sc = a.scale_log2;
    for (int it = t_beg; it < t_end; ++it) {
      const u32 st = (u32)((it - t_beg) & 1);
      const u32 kt = sb + OFF_K + st * TILE_BYTES;
      cp_async_wait<0>();
#if MLA_MMA
      fence_proxy_async_smem();  // cp.async (generic proxy) writes -> wgmma (async proxy) reads
#endif
      __syncthreads();  // B1
#if MLA_FP8
      // next tile: codes and scales into registers now, RoPE by cp.async, dequantized after Q K^T
      fp8::CodeRows<0, 8, 1> k8;
      const u8* row[1] = {fp8::row_at(a, bt_row, kvh, (it + 1) * MLA_BLOCK_N + (tid >> 2), it + 1 < t_end ? len : 0)};
      k8.load(row, tid & 3);
      if (it + 1 < t_end) fp8::rope_rows(sb + OFF_K + (st ^ 1u) * TILE_BYTES, row, a.k_cache, tid >> 2, tid & 3);
#else
      if (it + 1 < t_end) load_k_tile(a, sb + OFF_K + (st ^ 1u) * TILE_BYTES, b, kvh, len, (it + 1) * MLA_BLOCK_N, tid);
#endif
      cp_async_commit();

      float s[16];
      gemm_qk(s, sb + OFF_Q, kt, wg, wi, lane);
#if MLA_FP8
      if (it + 1 < t_end) fp8_store_tile(k8, sb + OFF_K + (st ^ 1u) * TILE_BYTES, tid);
#endif

      // scale, mask, row max over this warpgroup's 32 columns
      const int c0 = it * MLA_BLOCK_N + 32 * wg + 2 * t;
      float mx_lo = MASKED, mx_hi = MASKED;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = c0 + 8 * j + e;
          s[4 * j + e] = col < lim_lo ? s[4 * j + e] * sc : MASKED;
          s[4 * j + 2 + e] = col < lim_hi ? s[4 * j + 2 + e] * sc : MASKED;
          mx_lo = fmaxf(mx_lo, s[4 * j + e]);
          mx_hi = fmaxf(mx_hi, s[4 * j + 2 + e]);
        }
      }
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      if (t == 0) {
        red[wg * 64 + r_lo] = mx_lo;
        red[wg * 64 + r_hi] = mx_hi;
      }
      __syncthreads();  // B2
      const float mn_lo = fmaxf(m_lo, fmaxf(red[r_lo], red[64 + r_lo]));
      const float mn_hi = fmaxf(m_hi, fmaxf(red[r_hi], red[64 + r_hi]));
      const float al_lo = fast_exp2(m_lo - mn_lo), al_hi = fast_exp2(m_hi - mn_hi);
      m_lo = mn_lo;
      m_hi = mn_hi;
      float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[4 * j + e] = fast_exp2(s[4 * j + e] - mn_lo);
          s[4 * j + 2 + e] = fast_exp2(s[4 * j + 2 + e] - mn_hi);
          sum_lo += s[4 * j + e];
          sum_hi += s[4 * j + 2 + e];
        }
      }
      l_lo = l_lo * al_lo + sum_lo;
      l_hi = l_hi * al_hi + sum_hi;
      // P tile: columns 32wg + 8j + 2t (+1) = 16-byte unit 4wg + j, bytes 4t .. 4t+3
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        sts_u32(sb + OFF_P + swz(r_lo, 4 * wg + j) + 4u * t, pack2<DT>(s[4 * j], s[4 * j + 1]));
        sts_u32(sb + OFF_P + swz(r_hi, 4 * wg + j) + 4u * t, pack2<DT>(s[4 * j + 2], s[4 * j + 3]));
      }
#if MLA_MMA
      fence_proxy_async_smem();  // st.shared (generic) -> wgmma (async proxy)
#endif
      __syncthreads();  // B3
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= al_lo;
        o[4 * j + 1] *= al_lo;
        o[4 * j + 2] *= al_hi;
        o[4 * j + 3] *= al_hi;
      }
      gemm_pv(o, sb + OFF_P, kt, wg, wi, lane);
    }
  }
  pdl_launch_dependents();

  // Row sums: over the quad, then over the two warpgroups (both used the same running max).
  float L_lo, L_hi;
  sum_rows_2wg(reinterpret_cast<float*>(smem + OFF_LSUM), l_lo, l_hi, r_lo, r_hi, wg, t, [] { __syncthreads(); }, L_lo,
               L_hi);

  const bool v_lo = row0 + r_lo < M, v_hi = row0 + r_hi < M;
  // out row / lse element of packed row r (valid rows only)
  auto out_row = [&](int r) -> u16* {
    const int rg = row0 + r, s = rg / group, h = rg - s * group;
    return a.out + (long long)b * a.o_stride_b + (long long)s * a.o_stride_s + (long long)(kvh * group + h) * a.o_stride_h;
  };
  auto lse_at = [&](int r) -> float* {
    const int rg = row0 + r, s = rg / group, h = rg - s * group;
    return a.lse + ((long long)b * a.h_q + kvh * group + h) * a.s_q + s;
  };

  const RowPair rp{r_lo,  r_hi,  v_lo, v_hi, m_lo, m_hi, L_lo, L_hi, m_lo, m_hi,
                   sink_term(a, kvh, row0 + r_lo, m_lo), sink_term(a, kvh, row0 + r_hi, m_hi)};
  if (S == 1) {
    store_out_rows<DT>(a, o, rp, wg, t, out_row, lse_at);
    return;
  }

  // ---- split > 1: this split's partial (written even when empty), then the ticket
  const long long bhm = ((long long)b * a.h_kv + kvh) * nmb + mb;
  store_partial_rows(a, o, rp, (bhm * S + split) * MLA_BLOCK_M, wg, t);
  if (!last_to_arrive(a, bhm, reinterpret_cast<u32*>(smem + OFF_TICKET), S, tid, [] { __syncthreads(); }))
    return;

  // ---- last CTA: merge the S partials of the valid rows
  const int rows = M - row0 < MLA_BLOCK_M ? M - row0 : MLA_BLOCK_M;
  merge_partials_to<MLA_BLOCK_M, MLA_THREADS, DT>(a, reinterpret_cast<float*>(smem + OFF_K), bhm, S, rows, tid, out_row,
                                                 lse_at, [] { __syncthreads(); }, neg_inf());
}
