// gqadrv — CTA pieces shared by the paged GQA kernels (sm80/decode_paged.cu, cp.async;
// sm90/decode_paged_tma.cu, TMA):
//   * PagedDecoder: the warp decoder type of a build,
//   * paged_load_q: this lane's two query rows of the CTA's row block (row r = j * group + h of the
//     request's s_q x group rows) into the WarpDecoder, with their causal shifts s_q - 1 - j (e4m3
//     caches: with the KV head's K / V scales),
//   * paged_cta_tail: warp states -> merge area -> status words -> cta_epilogue_rows (output rows
//     of [B, s_q, Hq, D], natural-log LSE, split partials and the ordered merge of the
//     batch-invariant mode), or in a cluster launch of the TMA kernel cluster_epilogue_rows
//     (cluster_merge.cuh: the splits merged in shared memory).
#pragma once
#include "paged_args.cuh"
#include "cta.cuh"
#include "cluster_merge.cuh"
#include "warp_t8.cuh"

// The warp decoder of a paged kernel build: WarpDecoder<..., CAUSAL = true, KV8>, or for e4m3 builds
// with 8 rows on sm_89+ the transposed WarpDecoderT8 (warp_t8.cuh; H200: 1-3 % faster with half the
// MMAs). GQA_KV8_T = 0 (development, GQADRV_KV8_T=0) keeps WarpDecoder there.
#ifndef GQA_KV8_T
#define GQA_KV8_T 1
#endif
template <int DT, int D, int ROWS, int TOK, bool KV8, bool T8 = KV8 && ROWS == 8 && GQA_KV8_T != 0 && GQADRV_FP8_HW>
struct PagedDecoderSel {
  using type = WarpDecoder<DT, D, ROWS, TOK, true, KV8>;
};
#if GQADRV_FP8_HW
template <int DT, int D, int ROWS, int TOK, bool KV8>
struct PagedDecoderSel<DT, D, ROWS, TOK, KV8, true> {
  using type = WarpDecoderT8<DT, D, TOK, true>;
};
#endif
template <int DT, int D, int ROWS, int TOK, bool KV8>
using PagedDecoder = typename PagedDecoderSel<DT, D, ROWS, TOK, KV8>::type;

// The global address of query row r (r < ROWS) of the unit's row block, or null past the rows
// (paged_stage_q; paged_load_q keeps its own copy of this arithmetic, its SASS predating this helper).
template <int D, int ROWS>
GQADRV_DEVICE const u16* paged_q_row(const GqaPagedArgs& a, const PagedSchedule& sc, int r) {
  const int gr = sc.rb * ROWS + r;
  if (gr >= a.rows) return nullptr;
  const int j = gr / a.group;
  return a.q + (((long long)sc.b * a.s_q + j) * (a.hkv * a.group) + (long long)sc.kvh * a.group + (gr - j * a.group)) * D;
}

// The lane's query rows through `q_row(r)` (a row pointer or null), the KV head's scales (e4m3) and the
// rows' causal shifts into the decoder.
template <class Dec, class QRow>
GQADRV_DEVICE void paged_load_q_with(Dec& dec, const GqaPagedArgs& a, const PagedSchedule& sc, int lane, QRow q_row) {
  constexpr int ROWS = Dec::NROWS;
  constexpr bool KV8 = Dec::IS_KV8;
  const int row0 = sc.rb * ROWS;
  auto shift = [&](int r) -> int {
    const int gr = row0 + r;
    return gr >= a.rows ? 0 : a.s_q - 1 - gr / a.group;
  };
  const int g = lane >> 2;
  if constexpr (KV8) {  // the KV head's scales fold into the score scale and the stored state
    const float ks = a.k_scale_value * (a.k_scale ? a.k_scale[(long long)sc.kvh * a.k_scale_stride] : 1.f);
    const float vs = a.v_scale_value * (a.v_scale ? a.v_scale[(long long)sc.kvh * a.v_scale_stride] : 1.f);
    dec.load_q8(q_row(g), ROWS == 16 ? q_row(g + 8) : nullptr, a.scale_log2 * ks, vs);
  } else {
    dec.load_q(q_row(g), ROWS == 16 ? q_row(g + 8) : nullptr);
  }
  dec.set_causal(shift(g), ROWS == 16 ? shift(g + 8) : 0, a.s_q - 1 - row0 / a.group);
}

template <class Dec>
GQADRV_DEVICE void paged_load_q(Dec& dec, const GqaPagedArgs& a, const PagedSchedule& sc, int lane) {
  constexpr int D = Dec::DIM, ROWS = Dec::NROWS;
  const int hq = a.hkv * a.group;
  const int row0 = sc.rb * ROWS;
  auto q_row = [&](int r) -> const u16* {
    const int gr = row0 + r;
    if (gr >= a.rows) return nullptr;
    const int j = gr / a.group;
    return a.q + (((long long)sc.b * a.s_q + j) * hq + (long long)sc.kvh * a.group + (gr - j * a.group)) * D;
  };
  paged_load_q_with(dec, a, sc, lane, q_row);
}

// GQA_PAGED_MULTI of the TMA kernel: the row block's rows from the copy paged_stage_q made in shared memory
// (row r at staged + r * D; rows past the request's rows stay null).
template <class Dec>
GQADRV_DEVICE void paged_load_q_staged(Dec& dec, const GqaPagedArgs& a, const PagedSchedule& sc, int lane,
                                       const u16* staged) {
  constexpr int D = Dec::DIM, ROWS = Dec::NROWS;
  const int row0 = sc.rb * ROWS;
  paged_load_q_with(dec, a, sc, lane, [&](int r) -> const u16* { return row0 + r < a.rows ? staged + r * D : nullptr; });
}

// GQA_PAGED_MULTI: copy the query rows of unit `sc` (its row block) into `dst` (ROWS x D u16 of shared
// memory) with cp.async, 16 bytes per thread (threads tid, tid + nthreads, ...); the caller commits,
// waits and orders them before the reads (a CTA barrier). Rows past the request's rows are skipped.
template <int D, int ROWS>
GQADRV_DEVICE void paged_stage_q(const GqaPagedArgs& a, const PagedSchedule& sc, u16* dst, int tid, int nthreads) {
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  for (int c = tid; c < ROWS * CHUNKS; c += nthreads) {
    const int r = c / CHUNKS, k = c - r * CHUNKS;
    const u16* g = paged_q_row<D, ROWS>(a, sc, r);
    if (g != nullptr) cp_async_16(smem_u32(dst + r * D + k * 8), g + k * 8, 16u);
  }
}

// GQA_PAGED_MULTI: the output rows (and LSE) of one unit of a one-split launch from the W warp states
// (merge_area_item's rule, over per-warp slot bases instead of one contiguous MergeArea) that the warps
// stored in their free ring slots (s_free[w] = slot index, -1: the warp had no sub-tile,
// an empty state): slot base {m, l} x ROWS, then ROWS rows of numerators at StateLayout<D>::STRIDE.
// All W * 32 threads, after a CTA barrier that follows every state store.
template <int DT, int D, int ROWS, int W, int STAGES, u32 SLOT_BYTES>
GQADRV_DEVICE void paged_multi_store_unit(const GqaPagedArgs& a, const PagedSchedule& sc, u8* ring, const int* s_free,
                                          int rows_here) {
  constexpr int D8 = D / 8, ST = StateLayout<D>::STRIDE;
  EpilogueTarget tg;
  tg.out_row0 = (long long)sc.b * a.s_q * (a.hkv * a.group) + (long long)sc.kvh * a.group;
  tg.first_row = sc.rb * ROWS;
  tg.group = a.group;
  tg.row_step = a.hkv * a.group;
  for (int it = threadIdx.x; it < rows_here * D8; it += W * 32) {
    const int row = it / D8, d0 = (it - row * D8) * 8;
    float M = neg_inf(), den = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const int f = s_free[w];
      if (f >= 0) M = fmaxf(M, reinterpret_cast<const float*>(ring + (size_t)(w * STAGES + f) * SLOT_BYTES)[2 * row]);
    }
    if (M != neg_inf()) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const int f = s_free[w];
        if (f < 0) continue;
        const float* ml = reinterpret_cast<const float*>(ring + (size_t)(w * STAGES + f) * SLOT_BYTES);
        const float mw = ml[2 * row];
        if (mw == neg_inf()) continue;
        const float wt = softmax_weight(mw, M);
        den += wt * ml[2 * row + 1];
        const U32x4* src = reinterpret_cast<const U32x4*>(ml + ROWS * 2 + row * ST + d0);
        const U32x4 h[2] = {src[0], src[1]};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const u32 x = (i & 3) == 0 ? h[i >> 2].x : ((i & 3) == 1 ? h[i >> 2].y : ((i & 3) == 2 ? h[i >> 2].z : h[i >> 2].w));
          acc[i] += wt * __uint_as_float(x);
        }
      }
    }
    const long long orow = target_row<true>(tg, row);
    store_row8<DT>(a.out + orow * D + d0, acc, den > 0.f ? 1.f / den : 0.f);
    if (a.lse != nullptr && d0 == 0) a.lse[orow] = state_lse(M, den);
  }
}

// Start of a CTA, before its schedule reads the request's length: prefetch what the next two round
// trips need, so they overlap the length's: lanes 0..ROWS-1 the query rows of the CTA's row block
// (into L1; every lane reads its chunks of them in paged_load_q), lane 31 the first 128 bytes of the
// request's block-table row from the split's first table entry of a one-split launch (into L2; the
// page ids of the first sub-tiles). Only addresses inside q and inside the table row are touched.
// D = 256 builds skip it (the registers of its address arithmetic spill the sm_100a cp.async kernel).
template <int ROWS, int D>
GQADRV_DEVICE void paged_prefetch(const GqaPagedArgs& a, int lane) {
  if constexpr (D > 128) return;
  const int unit = (int)blockIdx.x / a.num_splits;
  const int rb = unit % a.row_blocks, bh = unit / a.row_blocks;
  const int b = bh / a.hkv, kvh = bh - b * a.hkv;
  const int gr = rb * ROWS + lane;
  if (lane < ROWS && gr < a.rows) {
    const int j = gr / a.group;
    const u16* row = a.q + (((long long)b * a.s_q + j) * a.hkv * a.group + (long long)kvh * a.group +
                            (gr - j * a.group)) * D;
#pragma unroll
    for (int k = 0; k < D * 2; k += 128) prefetch_l1(reinterpret_cast<const u8*>(row) + k);
  }
  if (lane == 31 && a.table != nullptr && (int)blockIdx.x % a.num_splits == 0)
    prefetch_l2(a.table + (long long)b * a.table_stride);
}

// A split past the request's tokens under GQA_PAGED_DET_EXIT (sc.split >= sc.splits_used): it takes
// no part in the ticket; it only clears its bad-page status word. Returns true when the CTA is done.
GQADRV_DEVICE bool paged_idle_split(const GqaPagedArgs& a, const PagedSchedule& sc) {
  if (sc.split < sc.splits_used) return false;
  if (!GQA_TRACE && a.status != nullptr && sc.kvh == 0 && sc.rb == 0 && threadIdx.x == 0)
    a.status[(long long)sc.b * (1 + a.num_splits) + 1 + sc.split] = 0u;
  return true;
}

// A cluster launch of the TMA kernel (cluster_merge.cuh): n CTAs per cluster (1: none), this CTA's
// rank and its receive barrier; RING_BYTES (the kernel's template argument of paged_cta_tail) places
// the receive area.
struct ClusterMergeCtx {
  u32 n, rank, recv_bar;
};

// Called by all W * 32 threads after every warp's last step (no copy in flight). `bad` = this
// lane met a page id outside [0, num_pages); `s_bad` is W words of static shared memory. With
// cm.n > 1 (sm_90 builds, RING_BYTES > 0) the splits merge in the cluster instead of the ticket.
template <int W, u32 RING_BYTES = 0, class Dec>
GQADRV_DEVICE void paged_cta_tail(Dec& dec, const GqaPagedArgs& a, const PagedSchedule& sc, u8* smem, u32* s_ticket,
                                  u32* s_bad, bool bad, int warp, int lane,
                                  ClusterMergeCtx cm = ClusterMergeCtx{1u, 0u, 0u}) {
  constexpr int DT = Dec::DTYPE, D = Dec::DIM, ROWS = Dec::NROWS;
  {
    const bool any_bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) s_bad[warp] = any_bad ? 1u : 0u;
  }
  dec.finish();
  __syncthreads();  // every warp has read its slots: the bytes become the merge area
  using MA = MergeArea<D, ROWS, W>;
  const int row0 = sc.rb * ROWS;
  const int rows_here = a.rows - row0 < ROWS ? a.rows - row0 : ROWS;
  dec.store_state(MA::ml(smem, warp), MA::os(smem, warp), rows_here);
  __syncthreads();
  GQA_MARK(a, 5);
  // GQA_TRACE builds use the status buffer for the trace (tools/trace_decode.py --paged): no status word.
  if (!GQA_TRACE && a.status != nullptr && sc.kvh == 0 && sc.rb == 0 && threadIdx.x == 0) {
    u32* st = a.status + (long long)sc.b * (1 + a.num_splits);
    if (sc.split == 0) st[0] = sc.raw_len <= 0 ? 1u : (sc.raw_len > a.capacity ? 2u : 0u);
    u32 b = 0u;
#pragma unroll
    for (int w = 0; w < W; ++w) b |= s_bad[w];
    st[1 + sc.split] = b;
  }
  const int hq = a.hkv * a.group;
  EpilogueTarget tg;
  tg.out = a.out;
  tg.lse = a.lse;
  tg.ws_o = a.ws_o;
  tg.ws_ml = a.ws_ml;
  tg.counters = a.counters;
  tg.trace = a.status;
  tg.out_row0 = (long long)sc.b * a.s_q * hq + (long long)sc.kvh * a.group;
  tg.unit = sc.unit;
  tg.split = sc.split;
  tg.S = sc.splits_used;
  tg.S_stride = a.num_splits;
  tg.rows = rows_here;
  tg.ws_rows = ROWS;
  tg.first_row = row0;
  tg.group = a.group;
  tg.row_step = hq;
  tg.fixed_order = a.split_subs > 0;
#if GQADRV_ARCH >= 90
  if constexpr (RING_BYTES > 0) {
    if (cm.n > 1) {
      cluster_epilogue_rows<DT, D, ROWS, W, true, RING_BYTES>(tg, smem, cm.recv_bar, cm.rank, cm.n);
      return;
    }
  }
#endif
  cta_epilogue_rows<DT, D, ROWS, W, W * 32, true, true>(tg, smem, s_ticket);
}
