// gqadrv — 5th-generation tensor core (tcgen05, tensor memory) support for sm_100a / sm_110a:
//   1. inline-PTX wrappers (TMEM allocation, MMA, commit, TMEM loads/stores, waits, fences),
//   2. documented builders of the instruction descriptor and the shared-memory matrix descriptor,
//   3. the decode core shared by the tcgen05 GQA kernels (sm100/gqa_decode_tc_{long,short}.cu):
//      fixed tile geometry, the MMA issue sequences, and the per-thread online softmax that owns one
//      TMEM lane (= one token of S^T, one head-dim row of O^T).
//
// Everything below is compiled only for GQADRV_ARCH >= 100 (tcgen05 does not exist on sm_90a and is
// rejected by NVRTC on sm_120a). These kernels are compile-verified only: they have never run.
//
// Operand-swapped formulation (tokens on M, heads on N) used by the tcgen05 GQA kernels:
//   S^T[tok, head] = K[tok, 0:D] . Q^T[0:D, head]        M = 128 tokens, N = 16 heads, K = D
//                    A = K tile (smem, K-major, 128B swizzle, exactly the TMA box layout)
//                    B = Q rows  (smem, K-major, 128B swizzle, written by the kernel, rows >= g zero)
//   softmax over tokens: thread t of the 4 softmax warps owns TMEM lane t = token t of the tile
//   O^T[d, head]  += V^T[d, tok] . P^T[tok, head]        M = 128 head dims (64 for D = 64), N = 16
//                    A = V tile (smem, MN-major, 128B swizzle, the same TMA box layout)
//                    B = P^T     (smem, K-major, 128B swizzle, written by the softmax threads)
#pragma once
// gqa_warp.cuh brings ptx.cuh and swizzled_chunk_offset (the TMA 128B swizzle).
#include "gqa_warp.cuh"

#if GQADRV_ARCH >= 100

// ============================================================================ 1. PTX wrappers
// All tcgen05 instructions of a kernel must use the same .cta_group; gqadrv uses ::1 throughout.

// TMEM allocation (warp-collective: the whole warp executes it, .sync.aligned). Writes the TMEM base
// address (lane 0, first column) to shared memory at `dst_smem`. ncols: power of two in [32, 512].
GQADRV_DEVICE void tmem_alloc(u32 dst_smem, u32 ncols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(dst_smem),
               "r"(ncols)
               : "memory");
}
// Give up the right to allocate again (lets other CTAs on the SM allocate without waiting on us).
GQADRV_DEVICE void tmem_relinquish_alloc_permit() {
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;" ::: "memory");
}
// Warp-collective; must be executed by the warp that allocated, with the same column count.
GQADRV_DEVICE void tmem_dealloc(u32 taddr, u32 ncols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(taddr), "r"(ncols)
               : "memory");
}

// Ordering of asynchronous tcgen05 operations across a thread synchronisation (mbarrier, bar.sync):
// the producer side issues before_thread_sync before it arrives, the consumer side issues
// after_thread_sync after its wait and before its own tcgen05 operations.
GQADRV_DEVICE void tc_fence_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
GQADRV_DEVICE void tc_fence_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// Arrive (count 1) on the mbarrier once every tcgen05.mma issued so far by this thread completed.
// (Implies the before_thread_sync ordering of those MMAs.) The shared::cta address of our own CTA
// is a valid shared::cluster address.
GQADRV_DEVICE void tc_commit(u32 mbar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::"r"(mbar)
               : "memory");
}

// D[tmem] (=|+=) A[smem] * B[smem]; `accumulate` = 0 overwrites D. Single-thread issue.
GQADRV_DEVICE void tc_mma_ss(u32 d_tmem, u64 a_desc, u64 b_desc, u32 idesc, u32 accumulate) {
  asm volatile(
      "{\n"
      " .reg .pred acc;\n"
      " setp.ne.b32 acc, %4, 0;\n"
      " tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, acc;\n"
      "}\n" ::"r"(d_tmem),
      "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(accumulate)
      : "memory");
}

// Warp-collective TMEM -> registers, shape 32x32b, 16 repetitions: thread l of the warp receives 16
// consecutive 32-bit columns of TMEM lane (lane field of taddr) + l. Asynchronous: the registers
// may only be used after tc_wait_ld().
GQADRV_DEVICE void tmem_ld_32x32b_x16(u32 taddr, u32 (&r)[16]) {
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
      " [%16];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]),
        "=r"(r[15])
      : "r"(taddr)
      : "memory");
}
// Warp-collective registers -> TMEM, the same shape. Complete only after tc_wait_st().
GQADRV_DEVICE void tmem_st_32x32b_x16(u32 taddr, const u32 (&r)[16]) {
  asm volatile(
      "tcgen05.st.sync.aligned.32x32b.x16.b32 [%0],"
      " {%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16};" ::"r"(taddr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]),
      "r"(r[9]), "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15])
      : "memory");
}
GQADRV_DEVICE void tc_wait_ld() { asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory"); }
GQADRV_DEVICE void tc_wait_st() { asm volatile("tcgen05.wait::st.sync.aligned;" ::: "memory"); }

// Named barrier for a subset of warps (id 0 is __syncthreads). `count` = threads, multiple of 32.
GQADRV_DEVICE void named_bar_sync(u32 id, u32 count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Dynamic shared memory actually provided by the launch (bytes).
GQADRV_DEVICE u32 dynamic_smem_bytes() {
  u32 r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

GQADRV_DEVICE void st_shared_v4(u32 addr, U32x4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
GQADRV_DEVICE void st_shared_u16(u32 addr, u16 v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// ============================================================================ 2. descriptors
// ---- Instruction descriptor of tcgen05.mma .kind::f16 (32 bits, PTX ISA "Instruction descriptor"):
//   bits  0-1  sparsity selector            0 (dense)
//   bit   2    sparsity enable              0
//   bit   3    saturate (integer kinds)     0
//   bits  4-5  D type                       1 = F32 (0 = F16)
//   bit   6    reserved                     0
//   bits  7-9  A type                       0 = F16, 1 = BF16
//   bits 10-12 B type                       0 = F16, 1 = BF16
//   bit  13    negate A                     0
//   bit  14    negate B                     0
//   bit  15    transpose A                  0 = K-major A, 1 = MN-major A
//   bit  16    transpose B                  0 = K-major B, 1 = MN-major B
//   bits 17-22 N >> 3
//   bit  23    reserved                     0
//   bits 24-28 M >> 4
//   bit  29    reserved                     0
//   bits 30-31 max shift (.ws only)         0
// dt: 0 = fp16, 1 = bf16 inputs; fp32 accumulation always.
__host__ __device__ constexpr u32 tc_idesc_f16(int dt, int m, int n, bool a_mn_major, bool b_mn_major) {
  return (1u << 4) | ((u32)dt << 7) | ((u32)dt << 10) | ((a_mn_major ? 1u : 0u) << 15) |
         ((b_mn_major ? 1u : 0u) << 16) | ((u32)(n >> 3) << 17) | ((u32)(m >> 4) << 24);
}

// ---- Shared-memory matrix descriptor (64 bits, PTX ISA "Shared memory descriptor"):
//   bits  0-13  start address        (addr & 0x3FFFF) >> 4
//   bits 16-29  leading-dim byte offset (LBO) >> 4
//   bits 32-45  stride-dim byte offset  (SBO) >> 4
//   bits 46-48  fixed constant 0b001
//   bits 49-51  matrix base offset   0: every swizzle pattern starts on a 1024-byte boundary here
//   bit  52     LBO mode             0 = relative byte offset
//   bits 53-60  fixed constant 0
//   bits 61-63  swizzle mode         0 none, 1 128B/32B-atom, 2 128B, 4 64B, 6 32B
// Canonical SWIZZLE_128B layouts for 16-bit elements (T = 8 elements = 16 bytes), each 1024-byte
// atom = 8 rows of 128 bytes, 16-byte chunk index XOR (row & 7), as written by TMA SWIZZLE_128B:
//   K-major  ((8,m),(T,2k)) : ((8T,SBO),(1,T))   rows = M/N index, 64 K elements per 128-byte row;
//            SBO = distance of 8-row groups (1024 here); LBO unused (encoded 1). A K step of 16
//            elements inside the atom advances the start address by 32 bytes.
//   MN-major ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))  rows = K index, 64 MN elements per row;
//            LBO = distance of 64-element MN blocks (the next TMA box), SBO = distance of 8-row
//            K groups (1024 here). A K step of 16 rows advances the start address by 2048 bytes.
constexpr u32 TC_SWIZZLE_128B = 2;
GQADRV_DEVICE u64 tc_smem_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes, u32 swizzle = TC_SWIZZLE_128B) {
  const u64 lo = (u64)((smem_addr & 0x3FFFFu) >> 4) | ((u64)((lbo_bytes & 0x3FFFFu) >> 4) << 16);
  const u64 hi = (u64)((sbo_bytes & 0x3FFFFu) >> 4) | (1ull << 14) /* bit 46 */ | ((u64)swizzle << 29) /* bits 61-63 */;
  return lo | (hi << 32);
}

// ============================================================================ 3. decode core
// Geometry shared by both tcgen05 GQA kernels. TOK tokens per sub-tile is fixed by M = 128 of the
// QK MMA; the N = 16 head columns cover any group size 1..16 (columns >= group are zero-Q padding).
namespace tc {
constexpr int TOK = 128;       // tokens per sub-tile (TMA box rows, M of S^T)
constexpr int NH = 16;         // head columns (N of both MMAs)
constexpr int SOFTMAX_THREADS = 128;  // warps 0..3: one thread per TMEM lane
constexpr u32 NAMED_BAR_SOFTMAX = 1;
// TMEM columns (fp32, one column per head): S^T double buffer then O^T (one 16-column block per
// 128-row half of the head dim). 64 columns = power of two >= 32 covering 32 + 2 * 16.
constexpr u32 TMEM_COLS = 64;
constexpr u32 COL_S0 = 0;   // S^T buffer b at COL_S0 + 16 b
constexpr u32 COL_O = 32;   // O^T half h at COL_O + 16 h
}  // namespace tc

template <int DT, int D>
struct TcGeom {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static_assert(DT == 0 || DT == 1, "dtype");
  static constexpr int NB = D / 64;                        // 128-byte boxes per K/V/Q row
  static constexpr u32 TILE_BYTES = (u32)tc::TOK * D * 2;  // one K or V sub-tile (= TMA bytes)
  static constexpr u32 BOX_BYTES = (u32)tc::TOK * 128;     // one 64-column TMA box of a tile
  static constexpr u32 Q_BYTES = (u32)tc::NH * D * 2;      // NB boxes of 16 rows x 128 B
  static constexpr u32 P_BYTES = (u32)tc::NH * tc::TOK * 2;  // 2 boxes of 16 rows x 128 B
  static constexpr int QK_STEPS = D / 16;                  // K = 16 per MMA
  static constexpr int PV_M = D == 64 ? 64 : 128;          // M of the P.V MMA (head-dim rows)
  static constexpr int PV_HALVES = D == 256 ? 2 : 1;
  static constexpr int PV_STEPS = tc::TOK / 16;
  static constexpr u32 IDESC_QK = tc_idesc_f16(DT, 128, tc::NH, false, false);
  static constexpr u32 IDESC_PV = tc_idesc_f16(DT, PV_M, tc::NH, true, false);
  static_assert(tc::COL_O + 16 * PV_HALVES <= tc::TMEM_COLS, "TMEM map");

  // S^T[S buffer] = K_tile . Q^T  (D/16 MMAs, the first overwrites)
  static GQADRV_DEVICE void issue_qk(u32 tmem_s, u32 k_tile, u32 q_smem) {
#pragma unroll
    for (int k = 0; k < QK_STEPS; ++k) {
      const u32 koff = (u32)(k >> 2) * BOX_BYTES + (u32)(k & 3) * 32u;
      const u32 qoff = (u32)(k >> 2) * (tc::NH * 128u) + (u32)(k & 3) * 32u;
      tc_mma_ss(tmem_s, tc_smem_desc(k_tile + koff, 16, 1024), tc_smem_desc(q_smem + qoff, 16, 1024),
                IDESC_QK, k > 0 ? 1u : 0u);
    }
  }
  // O^T (+)= V_tile^T . P^T over the first `steps` 16-token k-steps (tokens beyond are never read).
  static GQADRV_DEVICE void issue_pv(u32 tmem_o, u32 v_tile, u32 p_smem, int steps, bool accumulate) {
#pragma unroll
    for (int h = 0; h < PV_HALVES; ++h) {
#pragma unroll
      for (int j = 0; j < PV_STEPS; ++j) {
        if (j < steps) {
          const u64 a = tc_smem_desc(v_tile + (u32)(2 * h) * BOX_BYTES + (u32)j * 2048u, BOX_BYTES, 1024);
          const u64 b = tc_smem_desc(p_smem + (u32)(j >> 2) * (tc::NH * 128u) + (u32)(j & 3) * 32u, 16, 1024);
          tc_mma_ss(tmem_o + 16u * h, a, b, IDESC_PV, (accumulate || j > 0) ? 1u : 0u);
        }
      }
    }
  }
  // 16-token k-steps of the P.V MMA for a sub-tile holding `valid` (>= 1) valid tokens.
  static GQADRV_DEVICE int pv_steps(int valid) {
    const int s = (valid + 15) >> 4;
    return s > PV_STEPS ? PV_STEPS : s;
  }
};

// Stage the query rows of one KV-head group into shared memory as the K-major, 128B-swizzled B
// operand of the QK MMA: NB boxes of 16 rows x 128 bytes, rows >= group zero. Called by `nthreads`
// threads with index `t`; the caller fences (fence.proxy.async) and synchronises.
template <int D>
GQADRV_DEVICE void tc_stage_q(u32 q_smem, const u16* __restrict__ qg, int group, int t, int nthreads) {
  constexpr int D8 = D / 8;
  for (int it = t; it < tc::NH * D8; it += nthreads) {
    const int row = it / D8, c = it - row * D8;
    U32x4 v = {0u, 0u, 0u, 0u};
    if (row < group) v = *reinterpret_cast<const U32x4*>(qg + (long long)row * D + 8 * c);
    st_shared_v4(q_smem + swizzled_chunk_offset(tc::NH, row, c), v);
  }
}

// Butterfly reduce-scatter of 16 per-head values over the 32 lanes of a warp: returns the reduction
// (max or sum) over all lanes of head (lane >> 1). 16 shuffles instead of 16 x 5.
template <bool MAX>
GQADRV_DEVICE float warp_reduce_scatter16(const float (&in)[16], int lane) {
  float v[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) v[j] = in[j];
#pragma unroll
  for (int w = 8, off = 16; w >= 1; w >>= 1, off >>= 1) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int j = 0; j < w; ++j) {
      const float send = upper ? v[j] : v[j + w];
      const float keep = upper ? v[j + w] : v[j];
      const float got = __shfl_xor_sync(0xffffffffu, send, off);
      v[j] = MAX ? fmaxf(keep, got) : keep + got;
    }
  }
  const float other = __shfl_xor_sync(0xffffffffu, v[0], 1);
  return MAX ? fmaxf(v[0], other) : v[0] + other;
}

// Barriers and buffers one softmax thread uses for one sub-tile (0 = not used).
struct TcTileSync {
  u32 s_full, s_full_parity;  // S^T of this tile is in TMEM (tcgen05.commit, count 1)
  u32 s_free;                 // arrive: this thread has read S^T (count 128); 0 = none
  u32 pv_done, pv_parity;     // P.V of the previous tile completed (commit); waited if has_prev
  bool has_prev;
  u32 v_full, v_parity;       // V tile landed (TMA); waited before zeroing rows >= len; 0 = none
  u32 p_full;                 // arrive: P^T written, O^T corrected (count 128)
};

// Online softmax of the 4 softmax warps. Thread t (warp w = t / 32) owns TMEM lane t: token t of
// every S^T tile and head-dim row t (or 16 w + lane for D = 64, M = 64) of O^T. The running maxima
// m_ref are identical in all 128 threads (they are computed from the same shared reductions); the
// denominators are kept as per-thread partial sums and reduced once at the end.
template <int DT, int D, int ROWS>
struct TcSoftmax {
  using G = TcGeom<DT, D>;
  float m_ref[tc::NH];   // reference max per head (log2 domain) of P = exp2(s - m_ref)
  float l_part[tc::NH];  // this thread's share of the denominators
  int warp, lane;

  GQADRV_DEVICE void init(int tid) {
    warp = tid >> 5;
    lane = tid & 31;
#pragma unroll
    for (int h = 0; h < tc::NH; ++h) {
      m_ref[h] = neg_inf();
      l_part[h] = 0.f;
    }
  }

  // One sub-tile starting at absolute token tok0; len = clamped length.
  //   tmem: TMEM base; sb: S buffer (0/1); red: shared [2][4][16] floats (double-buffered
  //   cross-warp max, buffer `red_buf`); p_smem / v_tile: shared addresses of P^T and of this
  //   tile's V (only touched when sy.v_full != 0).
  GQADRV_DEVICE void tile(const TcTileSync& sy, u32 tmem, int sb, int red_buf, float* red, u32 p_smem,
                          u32 v_tile, int tok0, int len, float scale_log2) {
    const u32 lane_base = (u32)(32 * warp) << 16;
    const int r = 32 * warp + lane;  // token row of the tile = TMEM lane
    const int tok = tok0 + r;
    // ---- S^T row of this token
    mbar_wait(sy.s_full, sy.s_full_parity);
    tc_fence_after_thread_sync();
    u32 raw[16];
    tmem_ld_32x32b_x16(tmem + lane_base + tc::COL_S0 + 16u * sb, raw);
    tc_wait_ld();
    if (sy.s_free != 0u) {
      tc_fence_before_thread_sync();
      mbar_arrive(sy.s_free);
    }
    const bool valid = tok < len;
    float s[16];
#pragma unroll
    for (int h = 0; h < 16; ++h) s[h] = valid ? __uint_as_float(raw[h]) * scale_log2 : neg_inf();

    // ---- tile max per head over the 128 tokens: warp reduce-scatter, then 4 warps via smem
    {
      const float wm = warp_reduce_scatter16<true>(s, lane);
      float* rb = red + red_buf * 64;
      if ((lane & 1) == 0) rb[warp * 16 + (lane >> 1)] = wm;
      named_bar_sync(tc::NAMED_BAR_SOFTMAX, tc::SOFTMAX_THREADS);
      float tmax[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 a = reinterpret_cast<const float4*>(rb)[q];
        tmax[4 * q] = a.x;
        tmax[4 * q + 1] = a.y;
        tmax[4 * q + 2] = a.z;
        tmax[4 * q + 3] = a.w;
      }
#pragma unroll
      for (int w = 1; w < 4; ++w) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float4 a = reinterpret_cast<const float4*>(rb + 16 * w)[q];
          tmax[4 * q] = fmaxf(tmax[4 * q], a.x);
          tmax[4 * q + 1] = fmaxf(tmax[4 * q + 1], a.y);
          tmax[4 * q + 2] = fmaxf(tmax[4 * q + 2], a.z);
          tmax[4 * q + 3] = fmaxf(tmax[4 * q + 3], a.w);
        }
      }
      // ---- lazy rescale: keep the reference max unless the tile max exceeds it by more than
      // 2^8 (so P <= 256, exact enough in fp16/bf16); a switch rescales l and O^T by alpha.
      bool any = false;
#pragma unroll
      for (int h = 0; h < 16; ++h) {
        const float mn = fmaxf(m_ref[h], tmax[h]);
        const bool sw = mn > m_ref[h] + 8.f;            // m_ref = -inf: any finite max switches
        const float alpha = sw ? fast_exp2(m_ref[h] - mn) : 1.f;  // exp2(-inf) = 0
        m_ref[h] = sw ? mn : m_ref[h];
        l_part[h] *= alpha;
        tmax[h] = alpha;  // reuse as alpha
        any |= sw;
      }
      // ---- P = exp2(s - m_ref) (masked tokens: exp2(-inf) = 0)
#pragma unroll
      for (int h = 0; h < 16; ++h) {
        const float base = m_ref[h] == neg_inf() ? 0.f : m_ref[h];
        s[h] = fast_exp2(s[h] - base);
        l_part[h] += s[h];
      }
      // ---- the previous P.V must be complete before P^T is overwritten and O^T is rescaled
      if (sy.has_prev) {
        mbar_wait(sy.pv_done, sy.pv_parity);
        tc_fence_after_thread_sync();
        if (any) {  // CTA-uniform: every thread computed the same alphas
#pragma unroll
          for (int hf = 0; hf < G::PV_HALVES; ++hf) {
            const u32 ta = tmem + lane_base + tc::COL_O + 16u * hf;
            u32 o[16];
            tmem_ld_32x32b_x16(ta, o);
            tc_wait_ld();
#pragma unroll
            for (int h = 0; h < 16; ++h) o[h] = __float_as_uint(__uint_as_float(o[h]) * tmax[h]);
            tmem_st_32x32b_x16(ta, o);
          }
          tc_wait_st();
        }
      }
    }
    // ---- V rows >= len of this tile are zeroed in shared memory (P = 0 there, but 0 * NaN/Inf
    // stored in padding would poison the MMA). Only the last sub-tile of a request has such rows.
    if (sy.v_full != 0u && tok0 + tc::TOK > len) {  // CTA-uniform condition
      mbar_wait(sy.v_full, sy.v_parity);             // TMA bytes landed before we overwrite them
      if (!valid) {                                  // whole 128-byte rows: the swizzle is irrelevant
        const U32x4 z = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int b = 0; b < G::NB; ++b)
#pragma unroll
          for (int c = 0; c < 8; ++c) st_shared_v4(v_tile + b * G::BOX_BYTES + (u32)r * 128u + c * 16u, z);
      }
    }
    // ---- P^T (K-major, 128B swizzle): element (head h, token r) in box r / 64, row h
    {
      const u32 col = p_smem + (u32)(r & 7) * 2u;
#pragma unroll
      for (int h = 0; h < 16; h += 2) {
        const u32 pk = pack2<DT>(s[h], s[h + 1]);
        st_shared_u16(col + swizzled_chunk_offset(tc::NH, h, r >> 3), (u16)(pk & 0xffffu));
        st_shared_u16(col + swizzled_chunk_offset(tc::NH, h + 1, r >> 3), (u16)(pk >> 16));
      }
    }
    fence_proxy_async_smem();       // generic smem writes (P, zeroed V) -> async proxy (MMA)
    tc_fence_before_thread_sync();  // TMEM stores of the O^T rescale -> MMA thread
    mbar_arrive(sy.p_full);
  }

  // After the last tile: reduce the denominators, read O^T (if any tile was processed) and write
  // this CTA's single softmax state into the merge area (ml[row] = {m, l}, os[row*(D+8)+d]).
  //   last_pv_done/parity: the commit of the last P.V (waited when has_o)
  GQADRV_DEVICE void finish(u32 tmem, bool has_o, u32 last_pv_done, u32 last_parity, float* red_l, float* ml,
                            float* os, int group) {
    const int t = 32 * warp + lane;
    const int rows = group < ROWS ? group : ROWS;
    // The merge area may overlay operand buffers: nothing is written before the last P.V completed.
    if (has_o) {
      mbar_wait(last_pv_done, last_parity);
      tc_fence_after_thread_sync();
    }
    {
      const float ws = warp_reduce_scatter16<false>(l_part, lane);
      if ((lane & 1) == 0) red_l[warp * 16 + (lane >> 1)] = ws;
      named_bar_sync(tc::NAMED_BAR_SOFTMAX, tc::SOFTMAX_THREADS);
      if (t < rows) {
        float m = neg_inf();
#pragma unroll
        for (int h = 0; h < 16; ++h)
          if (h == t) m = m_ref[h];
        ml[2 * t] = m;
        ml[2 * t + 1] = red_l[t] + red_l[16 + t] + red_l[32 + t] + red_l[48 + t];
      }
    }
    const u32 lane_base = (u32)(32 * warp) << 16;
#pragma unroll
    for (int hf = 0; hf < G::PV_HALVES; ++hf) {
      u32 o[16];
      if (has_o) {
        tmem_ld_32x32b_x16(tmem + lane_base + tc::COL_O + 16u * hf, o);
        tc_wait_ld();
      } else {
#pragma unroll
        for (int h = 0; h < 16; ++h) o[h] = 0u;
      }
      // O^T row -> head-dim element: M = 128 rows sit in lanes 0..127 (layout D); M = 64 rows
      // (D = 64) sit in lanes 0..15 of each 32-lane quadrant (layout F, lane alignment 0).
      int d;
      bool mine;
      if (G::PV_M == 128) {
        d = 128 * hf + t;
        mine = true;
      } else {
        d = 16 * warp + lane;
        mine = lane < 16;
      }
      if (mine) {
#pragma unroll
        for (int h = 0; h < ROWS; ++h)
          if (h < rows) os[h * StateLayout<D>::STRIDE + d] = __uint_as_float(o[h]);
      }
    }
    tc_fence_before_thread_sync();  // our TMEM loads are ordered before the dealloc (after a bar)
  }
};

#endif  // GQADRV_ARCH >= 100
