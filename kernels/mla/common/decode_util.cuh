// gqadrv — MLA dense decode: pieces shared by the three kernels (dense_decode.cu, the seesaw and the
// narrow kernel). dense_decode.cu keeps its own row limit, Q / out / lse row pointers and K row
// loads: calling the helpers below for those changes its SASS (it keeps `group` in a register and
// does not clamp the causal limit), and its SASS must stay as measured.
//
// Row geometry: packed row rg of (request b, KV head kvh) is query token s = rg / group, head
// kvh * group + rg % group; rows rg >= M = s_q * group are padding (zero Q, never stored).
// Key limits: row rg may see keys [0, len) (or [0, len - (s_q - 1 - s)) with the bottom-right causal
// mask); a CTA additionally stops at its split's token end, so every limit is min(row limit, tok_end).
#pragma once
#include "../../common/ptx.cuh"
#include "args.cuh"
#include "sync.cuh"

// Development timing (MLA_TRACE=1 builds only, GQADRV_MLA_TRACE=1 on the host; tools/mla_trace.py):
// MLA_MARK(a, i, cond): the thread for which cond holds writes %globaltimer (ns) into stamp i (< 16)
// of its CTA, CTA index x + X (y + Y z), in a u64 array that starts right after the lse elements
// (b * h_kv * m_rows fp32, rounded up to 8 bytes): the tool passes an lse view of a larger buffer.
// MLA_MARK_SM(a, i, cond): the same slot gets the SM the CTA runs on (%smid) instead of a time.
#if MLA_TRACE
#define MLA_TRACE_PUT(a, i, v)                                                                           \
  reinterpret_cast<unsigned long long*>((a).lse + (((long long)(a).b * (a).h_kv * (a).m_rows + 1) & ~1LL)) \
      [(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * 16 + (i)] = (v)
#define MLA_MARK(a, i, cond)                                                                             \
  do {                                                                                                   \
    if (cond) {                                                                                          \
      unsigned long long t_;                                                                             \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                            \
      MLA_TRACE_PUT(a, i, t_);                                                                           \
    }                                                                                                    \
  } while (0)
#define MLA_MARK_SM(a, i, cond)                                                                          \
  do {                                                                                                   \
    if (cond) {                                                                                          \
      unsigned int s_;                                                                                   \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(s_));                                                   \
      MLA_TRACE_PUT(a, i, (unsigned long long)s_);                                                       \
    }                                                                                                    \
  } while (0)
#else
#define MLA_MARK(a, i, cond) \
  do {                       \
  } while (0)
#define MLA_MARK_SM(a, i, cond) \
  do {                          \
  } while (0)
#endif

#ifndef MLA_CPASYNC_FENCE
#define MLA_CPASYNC_FENCE 1
#endif

namespace mla {

// After an mbarrier wait that observed cp.async data (generic-proxy writes by other threads), before
// wgmma reads it (async proxy): fence.proxy.async.shared::cta (MEMBAR.CTA + FENCE.VIEW.ASYNC in SASS;
// cheap here because the waiting consumer threads have no copies of their own in flight).
// MLA_CPASYNC_FENCE=0 drops it (FlashMLA's cp.async kernels do without); kept on by default.
GQADRV_DEVICE void cpasync_to_wgmma_fence() {
#if MLA_CPASYNC_FENCE
  fence_proxy_async_smem();
#endif
}

constexpr float MASKED = -1e33f;  // masked logit (log2 domain, already scaled)
constexpr float M_INIT = -1e30f;  // running max before any key; exp2(MASKED - M_INIT) == 0
constexpr float LN2 = 0.69314718055994530942f;
constexpr float LOG2E = 1.44269504088896340736f;  // natural units -> the kernels' log2 domain
constexpr int D_QK = MLA_D_QK;
constexpr int D_V = MLA_D_V;
constexpr int NCB = D_QK / 64;              // 9 channel blocks of 64 channels (128 bytes)

// Byte offset of 16-byte unit `unit` (0..7) of row `row` in a 128B-swizzled block of 128-byte rows.
GQADRV_DEVICE u32 swz(int row, int unit) { return (u32)(row * 128 + ((unit ^ (row & 7)) << 4)); }

// One 5-D TMA load of K (the TMA seesaw's half tiles, the narrow kernels' channel-block pieces):
// with MLA_K_EVICT_FIRST the lines carry an L2 evict-first policy (every tile is streamed once per
// row block, as FlashMLA's K loads are), else no cache hint.
GQADRV_DEVICE void mla_tma_k_5d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3, int c4) {
#if MLA_K_EVICT_FIRST
  tma_load_5d(dst, desc, bar, c0, c1, c2, c3, c4, l2_policy_evict_first());
#else
  tma_load_5d(dst, desc, bar, c0, c1, c2, c3, c4);
#endif
}

// floor(n * s / S) without 64-bit division (r * s < S * S <= MLA_MAX_SPLITS^2 fits 32 bits).
GQADRV_DEVICE int split_point(int n, int s, int S) {
  const int q = n / S, r = n - q * S;
  return q * s + (r * s) / S;
}
GQADRV_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
GQADRV_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }
// The dynamic shared memory with its base rounded up to 1024 B (the 128B swizzle needs 1 KB-aligned
// blocks): sets `smem` (generic pointer) and returns the shared-window address. Declared 16-byte
// aligned only, so that the round-up is computed at run time and never folded away on an alignment
// promise. Thread 0 (tid) traps when the launch provides fewer than `used` bytes past the round-up.
GQADRV_DEVICE u32 aligned_dynamic_smem(u8*& smem, u32 used, int tid) {
  extern __shared__ __align__(16) u8 smem_raw[];
  const u32 raw = smem_u32(smem_raw);
  const u32 pad = (1024u - (raw & 1023u)) & 1023u;
  smem = smem_raw + pad;
  const u32 sb = raw + pad;
  if (tid == 0 && pad + used > dynamic_smem_bytes()) __trap();
  return sb;
}

// Cache length of request b, clamped to [0, max_blocks * page_size]; read on the device only.
GQADRV_DEVICE int clamped_len(const MlaDecodeArgs& a, int b) {
  int len = a.cache_seqlens[b];
  const long long cap = (long long)a.max_blocks * a.page_size;
  return len < 0 ? 0 : ((long long)len > cap ? (int)cap : len);
}
// Keys visible to packed row rg (padding rows: len).
GQADRV_DEVICE int row_key_limit(const MlaDecodeArgs& a, int len, int rg) {
  if (rg >= a.m_rows || (a.flags & MLA_FLAG_CAUSAL) == 0) return len;
  const int lim = len - (a.s_q - 1 - rg / a.group);
  return lim < 0 ? 0 : lim;
}
// Pointer to row rg of q (valid rows only).
GQADRV_DEVICE const u16* q_row_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.q + (long long)b * a.q_stride_b + (long long)s * a.q_stride_s + (long long)(kvh * a.group + h) * a.q_stride_h;
}
GQADRV_DEVICE u16* out_row_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.out + (long long)b * a.o_stride_b + (long long)s * a.o_stride_s + (long long)(kvh * a.group + h) * a.o_stride_h;
}
GQADRV_DEVICE float* lse_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.lse + ((long long)b * a.h_q + kvh * a.group + h) * a.s_q + s;
}
// First element of token `tok` (< len, so its block-table entry is in range) of KV head kvh,
// channel 0; bt_row = block_table row of the request.
// k_row_at: the same from the token's block-table entry `blk`, for callers that read the entries ahead.
GQADRV_DEVICE const u16* k_row_at(const MlaDecodeArgs& a, long long blk, int kvh, int tok) {
  return a.k_cache + blk * a.k_stride_block + (long long)(tok & (a.page_size - 1)) * a.k_stride_tok +
         (long long)kvh * a.k_stride_head;
}
GQADRV_DEVICE const u16* k_row_ptr(const MlaDecodeArgs& a, const i32* bt_row, int kvh, int tok) {
  return k_row_at(a, bt_row[tok >> a.page_shift], kvh, tok);
}

// ------------------------------------------------- epilogue of the 64-row, two-warpgroup kernels
// dense_decode.cu and dense_decode_seesaw.cu: warpgroup wg (0, 1) holds output columns
// [256 wg, 256 wg + 256) of the thread's rows lo = 16 wi + g and hi = lo + 8 in the wgmma C layout:
// o[4j], o[4j + 1] = row lo, columns 256 wg + 8j + 2t (+1); o[4j + 2], o[4j + 3] = row hi.

// Row sums of the thread's rows lo / hi: its partial sums l_lo / l_hi over the quad (lanes
// 4g .. 4g + 3), then over the two warpgroups through lsum[2][64] (shared memory; sync() is a barrier
// over both warpgroups). Both warpgroups' sums must be relative to the same running max.
template <class Sync>
GQADRV_DEVICE void sum_rows_2wg(float* lsum, float l_lo, float l_hi, int lo, int hi, int wg, int t, Sync sync,
                                float& L_lo, float& L_hi) {
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  if (t == 0) {
    lsum[wg * 64 + lo] = l_lo;
    lsum[wg * 64 + hi] = l_hi;
  }
  sync();
  L_lo = lsum[lo] + lsum[64 + lo];
  L_hi = lsum[hi] + lsum[64 + hi];
}
// A finished row's statistics: lse = ln 2 * (log2 L + m) (+inf when L == 0, no key), and with
// MLA_FLAG_MAX_LOGITS its max logit ln 2 * m (-inf when L == 0) at lse + max_offset. m: the running
// max of the row's scaled logits in the log2 domain; L: the row sum relative to it.
// x: the row's exact max scaled logit when m is a lazy running max (below it by at most the kernel's
// slack; the seesaw tracks both), else m.
GQADRV_DEVICE void store_row_stats(const MlaDecodeArgs& a, float* lse, float L, float m, float x) {
  *lse = L > 0.f ? (fast_log2(L) + m) * LN2 : pos_inf();
  if (a.flags & MLA_FLAG_MAX_LOGITS) lse[a.max_offset] = L > 0.f ? x * LN2 : neg_inf();
}
GQADRV_DEVICE void store_row_stats(const MlaDecodeArgs& a, float* lse, float L, float m) {
  store_row_stats(a, lse, L, m, m);
}

// The thread's two rows, as the stores below need them.
struct RowPair {
  int lo, hi;        // rows of the block
  bool v_lo, v_hi;   // valid rows (row0 + r < M): the only ones stored
  float m_lo, m_hi;  // running max (log2 domain)
  float L_lo, L_hi;  // row sums
  float x_lo, x_hi;  // exact max scaled logit (log2 domain; max_logits), = m_* where the running max is exact
  float d_lo, d_hi;  // added to L in out's normaliser: the attention sink's 2^(sink log2 e - m) (sink_term), or 0
};
// The attention sink's share of a row's normaliser (MLA_FLAG_SINK): exp(sink) in the row's units,
// 2^(sink[head] log2 e - m) for packed row `row` of KV head kvh (head kvh * group + row % group); +inf
// for a sink of +inf (out 0), 0 for -inf (out unchanged); 0 without the flag.
GQADRV_DEVICE float sink_term(const MlaDecodeArgs& a, int kvh, int row, float m) {
  if (!(a.flags & MLA_FLAG_SINK)) return 0.f;
  return fast_exp2(a.sink[kvh * a.group + row % a.group] * LOG2E - m);
}
// The same in two steps, for kernels that read the sink once: sink_log2() = sink[head] log2 e of packed
// row `row` (0 without the flag: not read), sink_term_log2() = 2^(that - m), or 0 without the flag.
GQADRV_DEVICE float sink_log2(const MlaDecodeArgs& a, int kvh, int row) {
  return (a.flags & MLA_FLAG_SINK) ? a.sink[kvh * a.group + row % a.group] * LOG2E : 0.f;
}
GQADRV_DEVICE float sink_term_log2(const MlaDecodeArgs& a, float s2, float m) {
  return (a.flags & MLA_FLAG_SINK) ? fast_exp2(s2 - m) : 0.f;
}
#ifndef MLA_OUT_V16
#define MLA_OUT_V16 1  // store_out_rows: 16-byte chunks after a quad transpose (0: one 4-byte store per pair)
#endif
#ifndef MLA_OUT_EVICT_FIRST
#define MLA_OUT_EVICT_FIRST 0  // experiment (_oef): the 16-byte out stores carry an L2 evict_first policy
#endif
// Measured (H100, 2026-12-06, tools/mla_trace.py): the seesaw's per-item epilogue 8-11 -> 3-6 us, b 4096 x 512
// tokens at h_q 64 7.5 % faster, the sparse prefill 2-9 % (docs/RESULTS.md); outputs bit-identical.
// One row's 256 channels of a warpgroup (its columns 8j + 2t, 8j + 2t + 1 of j = 0..31 held by lane t of
// the row's quad as packed pairs p(j)) as 16-byte stores: per four j a 4 x 4 transpose inside the quad
// (two shfl_xor stages) gives lane t the four pairs of j = 4k + t, i.e. columns 8(4k + t) .. + 7.
// Every lane of the warp runs the shuffles; `store` (quad-uniform: one row per quad) gates the stores.
// Rows must be 16-byte aligned (the output contracts require it).
template <class Pair>
GQADRV_DEVICE void store_row_v16(u16* row, int t, bool store, Pair p) {
  const bool odd = t & 1, upper = t & 2;
#if MLA_OUT_EVICT_FIRST
  const u64 pol = l2_policy_evict_first();
#endif
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    u32 a0 = p(4 * k), a1 = p(4 * k + 1), a2 = p(4 * k + 2), a3 = p(4 * k + 3);
    // stage 1 (lanes t, t ^ 1): the elements whose index bit 0 differs from t's are the partner's i ^ 1
    u32 r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 1), r1 = __shfl_xor_sync(0xffffffffu, odd ? a2 : a3, 1);
    if (odd) { a0 = r0; a2 = r1; } else { a1 = r0; a3 = r1; }
    // stage 2 (lanes t, t ^ 2): the same for index bit 1
    r0 = __shfl_xor_sync(0xffffffffu, upper ? a0 : a2, 2);
    r1 = __shfl_xor_sync(0xffffffffu, upper ? a1 : a3, 2);
    if (upper) { a0 = r0; a1 = r1; } else { a2 = r0; a3 = r1; }
#if MLA_OUT_EVICT_FIRST
    if (store) st_u32x4_l2hint(row + 8 * (4 * k + t), U32x4{a0, a1, a2, a3}, pol);
#else
    if (store) *reinterpret_cast<U32x4*>(row + 8 * (4 * k + t)) = U32x4{a0, a1, a2, a3};
#endif
  }
}
// S == 1: out = O / (L + d) (q dtype; d: the sink's term, RowPair); lse (and max_logits, both without the
// sink) by store_row_stats (+inf and zeros for L == 0),
// written by warpgroup 0. out_row(r) / lse_at(r): the out row / lse element of the block's row r.
template <int DT, class OutRow, class LseAt>
GQADRV_DEVICE void store_out_rows(const MlaDecodeArgs& a, const float (&o)[128], const RowPair& rp, int wg, int t,
                                  OutRow out_row, LseAt lse_at) {
  const float inv_lo = rp.L_lo > 0.f ? 1.f / (rp.L_lo + rp.d_lo) : 0.f;
  const float inv_hi = rp.L_hi > 0.f ? 1.f / (rp.L_hi + rp.d_hi) : 0.f;
#if MLA_OUT_V16
  store_row_v16(rp.v_lo ? out_row(rp.lo) + 256 * wg : nullptr, t, rp.v_lo,
                [&](int j) { return pack2<DT>(o[4 * j] * inv_lo, o[4 * j + 1] * inv_lo); });
  store_row_v16(rp.v_hi ? out_row(rp.hi) + 256 * wg : nullptr, t, rp.v_hi,
                [&](int j) { return pack2<DT>(o[4 * j + 2] * inv_hi, o[4 * j + 3] * inv_hi); });
#else
  if (rp.v_lo) {
    u16* dst = out_row(rp.lo) + 256 * wg + 2 * t;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<u32*>(dst + 8 * j) = pack2<DT>(o[4 * j] * inv_lo, o[4 * j + 1] * inv_lo);
  }
  if (rp.v_hi) {
    u16* dst = out_row(rp.hi) + 256 * wg + 2 * t;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<u32*>(dst + 8 * j) = pack2<DT>(o[4 * j + 2] * inv_hi, o[4 * j + 3] * inv_hi);
  }
#endif
  if (wg == 0 && t == 0) {
    if (rp.v_lo) store_row_stats(a, lse_at(rp.lo), rp.L_lo, rp.m_lo, rp.x_lo);
    if (rp.v_hi) store_row_stats(a, lse_at(rp.hi), rp.L_hi, rp.m_hi, rp.x_hi);
  }
}
// S > 1: the unnormalised fp32 O and {m, L} of the valid rows to the workspace, partial row slot0 + r
// (written even when the split was empty).
// MLA_PARTIAL_L2=1 (the balanced variants): the stores carry an L2 evict_last policy, so that a partial
// written early in the launch is still in L2 when the merging CTA reads it at the end, and the merge
// drops the lines afterwards (discard: never written back to DRAM). 1.5-4.5 % faster on rows with cut
// requests on the H200 and the H100 (docs/RESULTS.md, 2026-12-05); the split grids store plainly.
GQADRV_DEVICE void store_partial2(float* p, float x, float y) {
#if MLA_PARTIAL_L2
  st_f32x2_l2hint(p, x, y, l2_policy_evict_last());
#else
  *reinterpret_cast<F32x2*>(p) = F32x2{x, y};
#endif
}
GQADRV_DEVICE void store_partial1(float* p, float x) {
#if MLA_PARTIAL_L2
  st_f32_l2hint(p, x, l2_policy_evict_last());
#else
  *p = x;
#endif
}
GQADRV_DEVICE void store_partial_rows(const MlaDecodeArgs& a, const float (&o)[128], const RowPair& rp, long long slot0,
                                      int wg, int t) {
  if (rp.v_lo) {
    float* dst = a.ws_o + (slot0 + rp.lo) * D_V + 256 * wg + 2 * t;
#pragma unroll
    for (int j = 0; j < 32; ++j) store_partial2(dst + 8 * j, o[4 * j], o[4 * j + 1]);
  }
  if (rp.v_hi) {
    float* dst = a.ws_o + (slot0 + rp.hi) * D_V + 256 * wg + 2 * t;
#pragma unroll
    for (int j = 0; j < 32; ++j) store_partial2(dst + 8 * j, o[4 * j + 2], o[4 * j + 3]);
  }
  if (wg == 0 && t == 0) {
    if (rp.v_lo) store_partial2(a.ws_ml + 2 * (slot0 + rp.lo), rp.m_lo, rp.L_lo);
    if (rp.v_hi) store_partial2(a.ws_ml + 2 * (slot0 + rp.hi), rp.m_hi, rp.L_hi);
  }
}

// Split-KV ticket, after this CTA wrote its partial: every thread's partial stores precede thread 0's
// release (the acq_rel ticket on counters[unit]) through the first sync(); the last CTA's acquire plus
// the second sync() order its L2-only loads after them. True in the CTA that draws ticket S - 1 (it
// merges, then resets the counter to 0). `s_ticket`: 4 bytes of shared memory; sync(): a barrier
// over the CTA's threads that hold partial rows.
template <class Sync>
GQADRV_DEVICE bool last_to_arrive(const MlaDecodeArgs& a, long long unit, u32* s_ticket, int S, int tid, Sync sync) {
  sync();
  if (tid == 0) *s_ticket = atomic_add_acq_rel_gpu(a.counters + unit, 1u);
  sync();
  return *s_ticket == (u32)(S - 1);
}

// ------------------------------------------------------------------------- split-KV merge
// The last of the S CTAs of one (request, KV head, row block) merges the S partials of its `rows`
// valid rows (ws_o / ws_ml row index (unit * S + split) * BM + r, unit = (b * h_kv + kvh) * nmb + mb),
// then resets counters[unit] to 0.
// Partial maxima are finite (>= M_INIT) and empty partials carry l = 0, O = 0. `wts` is a
// [BM][S] fp32 scratch in shared memory (generic pointer), `sync()` a barrier over the NT threads;
// out_row(r) / lse_at(r): the out row / lse element of the block's row r; mmax0: the start of the
// max over the partial maxima (any value <= M_INIT gives the same result; dense_decode.cu passes
// -inf, which keeps its SASS as measured).
// merge_partials_from: the same with the partials at rows part0 + split * BM + r and the ticket at
// counters[counter] (the balanced schedule's consecutive slots, kernels/mla/common/work_items.cuh).
template <int BM, int NT, int DT, int IPT_MAX = 8, class OutRow, class LseAt, class Sync>
GQADRV_DEVICE void merge_partials_from(const MlaDecodeArgs& a, float* wts, long long part0, long long counter, int S,
                                       int rows, int tid, OutRow out_row, LseAt lse_at, Sync sync, float mmax0) {
  if (tid < rows) {
    const float* ml = a.ws_ml + 2 * (part0 + tid);
    float mmax = mmax0;
    for (int sp = 0; sp < S; ++sp) {
      float m, l;
      ld_cg_f32x2(ml + 2LL * BM * sp, m, l);
      mmax = fmaxf(mmax, m);
    }
    float L = 0.f;
    for (int sp = 0; sp < S; ++sp) {
      float m, l;
      ld_cg_f32x2(ml + 2LL * BM * sp, m, l);
      const float w = fast_exp2(m - mmax);
      L += w * l;
      wts[tid * S + sp] = w;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int sp = 0; sp < S; ++sp) wts[tid * S + sp] *= inv;
    store_row_stats(a, lse_at(tid), L, mmax);
  }
  sync();
  // Each thread owns IPT items (8 channels of one row) per batch, NT items apart (IPT_MAX: 8, 4 in
  // kernels whose consumers have fewer registers), and loads all of them for one split before it
  // multiplies any: IPT x 32 B of L2 reads in flight per thread, so a
  // merge costs S round trips per batch instead of one per item (BM 64, NT 256, S 2: 4 round trips
  // instead of 16; the partials were written by other SMs and are read from L2 with ld.cg).
  constexpr int ITEMS = BM * (D_V / 8);
  constexpr int IPT = (ITEMS + NT - 1) / NT < IPT_MAX ? (ITEMS + NT - 1) / NT : IPT_MAX;
#pragma unroll 1
  for (int base = tid; base < rows * (D_V / 8); base += NT * IPT) {
    float acc[IPT][8];
#pragma unroll
    for (int k = 0; k < IPT; ++k)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[k][i] = 0.f;
#pragma unroll 1
    for (int sp = 0; sp < S; ++sp) {
      float v[IPT][8];
#pragma unroll
      for (int k = 0; k < IPT; ++k) {
        const int item = base + k * NT;
        if (item < rows * (D_V / 8)) {
          const float* p = a.ws_o + (part0 + (long long)sp * BM + (item >> 6)) * D_V + (item & 63) * 8;
          ld_cg_f32x4(p, v[k][0], v[k][1], v[k][2], v[k][3]);
          ld_cg_f32x4(p + 4, v[k][4], v[k][5], v[k][6], v[k][7]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[k][i] = 0.f;
        }
      }
#pragma unroll
      for (int k = 0; k < IPT; ++k) {
        const int item = base + k * NT;
        const float w = item < rows * (D_V / 8) ? wts[(item >> 6) * S + sp] : 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[k][i] += w * v[k][i];
      }
    }
#pragma unroll
    for (int k = 0; k < IPT; ++k) {
      const int item = base + k * NT;
      if (item < rows * (D_V / 8)) {
        U32x4 pk;
        pk.x = pack2<DT>(acc[k][0], acc[k][1]);
        pk.y = pack2<DT>(acc[k][2], acc[k][3]);
        pk.z = pack2<DT>(acc[k][4], acc[k][5]);
        pk.w = pack2<DT>(acc[k][6], acc[k][7]);
        *reinterpret_cast<U32x4*>(out_row(item >> 6) + (item & 63) * 8) = pk;
      }
    }
  }
#if MLA_PARTIAL_L2
  // the S partials are dead: drop their L2 lines (ws_o rows of 2 KB, ws_ml blocks of BM x 8 bytes; the
  // workspace arrays and every slot are 128-byte aligned: BM is a multiple of 16)
  sync();  // every thread's loads of the partials are done
  static_assert(BM % 16 == 0, "ws_ml blocks must fill whole 128-byte lines");
  for (int i = tid; i < S * rows * (D_V / 32); i += NT) {
    const int sp = i / (rows * (D_V / 32)), rem = i - sp * (rows * (D_V / 32));
    discard_l2_line(a.ws_o + (part0 + (long long)sp * BM + rem / (D_V / 32)) * D_V + (rem % (D_V / 32)) * 32);
  }
  for (int i = tid; i < S * (BM / 16); i += NT)
    discard_l2_line(a.ws_ml + 2 * (part0 + (long long)(i / (BM / 16)) * BM) + 32 * (i % (BM / 16)));
#endif
  if (tid == 0) store_relaxed_gpu(a.counters + counter, 0u);  // the next launch / graph replay needs no memset
}
template <int BM, int NT, int DT, class OutRow, class LseAt, class Sync>
GQADRV_DEVICE void merge_partials_to(const MlaDecodeArgs& a, float* wts, long long unit, int S, int rows, int tid,
                                     OutRow out_row, LseAt lse_at, Sync sync, float mmax0) {
  merge_partials_from<BM, NT, DT>(a, wts, unit * S * BM, unit, S, rows, tid, out_row, lse_at, sync, mmax0);
}
// The same for a block whose rows start at packed row row0 of (request b, KV head kvh).
template <int BM, int NT, int DT, class Sync>
GQADRV_DEVICE void merge_partials(const MlaDecodeArgs& a, float* wts, long long unit, int S, int b, int kvh,
                                  int row0, int rows, int tid, Sync sync) {
  merge_partials_to<BM, NT, DT>(
      a, wts, unit, S, rows, tid, [&](int r) { return out_row_ptr(a, b, kvh, row0 + r); },
      [&](int r) { return lse_ptr(a, b, kvh, row0 + r); }, sync, M_INIT);
}

}  // namespace mla
