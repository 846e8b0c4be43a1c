// gqadrv — the decode core shared by the tcgen05 GQA kernels (sm100/decode_tc_{long,short}.cu next
// to this directory), built on the op-neutral tcgen05 wrappers of kernels/common/tcgen05.cuh:
//   * fixed tile geometry (namespace tc, TcGeom) and the MMA issue sequences,
//   * the query staging into the swizzled B operand (tc_stage_q),
//   * the per-thread online softmax that owns one TMEM lane (= one token of S^T, one head-dim row
//     of O^T): TcSoftmax, with its per-tile barriers TcTileSync,
//   * the CTA prologue both kernels run (tc_cta_prologue): smem-map check, mbarrier
//     initialisation, TMEM allocation, the fences and the barrier that publish them; and the CTA
//     tail (tc_cta_epilogue): barrier, TMEM free, cta_epilogue of cta.cuh.
//
// Compiled only for GQADRV_ARCH >= 100. Compile-verified only: these kernels have never run.
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
#include "../../common/ptx.cuh"
#include "../../common/swizzle.cuh"
#include "../../common/softmax_state.cuh"
#include "../../common/tcgen05.cuh"
#include "cta.cuh"

#if GQADRV_ARCH >= 100

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
constexpr int NO_WARP = -1;  // tc_cta_prologue: no lane-0 work outside the MMA warp
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

// CTA prologue of the tcgen05 kernels, run by every thread before griddepcontrol.wait:
//   * trap unless the dynamic shared memory (at sbase) is 1 KB aligned (SW128 operands) and at
//     least smem_bytes long (the kernel's smem map),
//   * warp WARP_MMA: lane 0 initialises the kernel's mbarriers (init_barriers()) and fences them
//     for the async proxy; then the whole warp allocates tc::TMEM_COLS TMEM columns, writing their
//     base address to *s_tmem, and gives up its allocation permit (the same warp deallocates at the
//     end, after the last TMEM read),
//   * lane 0 of warp WARP_LANE0 (another warp; tc::NO_WARP for none) runs lane0_work() meanwhile
//     (work that needs no barrier, e.g. the TMA warp's descriptor and L2 prefetches); every warp
//     then reconverges with __syncwarp,
//   * fence::before_thread_sync, __syncthreads, fence::after_thread_sync: barriers initialised and
//     the TMEM address published to every thread.
// Returns the TMEM base address. The static shared memory (mbarriers, s_tmem, the reduction buffers
// and the ticket) stays declared in the kernels, in one order per kernel: gathered into a struct or
// declared in here, the variables change ptxas' addressing (and with it the machine code). The warp
// indices are template arguments for the same reason: as run-time arguments, the branch on them is
// compiled differently.
template <int WARP_MMA, int WARP_LANE0, class InitBarriers, class Lane0Work>
GQADRV_DEVICE u32 tc_cta_prologue(u32 sbase, u32 smem_bytes, u32* s_tmem, int warp, int lane,
                                  InitBarriers&& init_barriers, Lane0Work&& lane0_work) {
  if (threadIdx.x == 0 && ((sbase & 1023u) != 0u || dynamic_smem_bytes() < smem_bytes)) __trap();
  if (warp == WARP_MMA) {
    if (lane == 0) {
      init_barriers();
      fence_mbarrier_init();
    }
    __syncwarp();
    tmem_alloc(smem_u32(s_tmem), tc::TMEM_COLS);  // whole warp
    tmem_relinquish_alloc_permit();
  } else if (warp == WARP_LANE0 && lane == 0) {
    lane0_work();
  }
  if (WARP_LANE0 >= 0) __syncwarp();
  tc_fence_before_thread_sync();
  __syncthreads();  // barriers initialised, TMEM address published
  tc_fence_after_thread_sync();
  return *s_tmem;
}

// CTA tail of the tcgen05 kernels, run by every thread once its role is done (the softmax warps
// have written the CTA's single state to the merge area at `smem` with TcSoftmax::finish):
// __syncthreads (merge state written, every TMEM read done and fenced before it), warp WARP_MMA
// frees the TMEM columns of tc_cta_prologue, then all NTHREADS threads run cta_epilogue on the one
// state. Trace marks 4 (roles done) and 5 (after the barrier).
template <int DT, int D, int ROWS, int NTHREADS, int WARP_MMA, bool SPLITS = true>
GQADRV_DEVICE void tc_cta_epilogue(const GqaArgs& a, const CtaSchedule& sc, u8* smem, u32* s_ticket, u32 tmem,
                                   int warp) {
  GQA_MARK(a, 4);
  __syncthreads();  // merge state written, every TMEM read done (fenced before this barrier)
  GQA_MARK(a, 5);
  if (warp == WARP_MMA) {
    tc_fence_after_thread_sync();
    tmem_dealloc(tmem, tc::TMEM_COLS);  // the allocating warp, on every path
  }
  cta_epilogue<DT, D, ROWS, 1, NTHREADS, SPLITS>(a, sc, smem, s_ticket);
}

#endif  // GQADRV_ARCH >= 100
