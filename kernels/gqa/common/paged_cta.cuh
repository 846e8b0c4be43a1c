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

template <class Dec>
GQADRV_DEVICE void paged_load_q(Dec& dec, const GqaPagedArgs& a, const PagedSchedule& sc, int lane) {
  constexpr int D = Dec::DIM, ROWS = Dec::NROWS;
  constexpr bool KV8 = Dec::IS_KV8;
  const int hq = a.hkv * a.group;
  const int row0 = sc.rb * ROWS;
  auto q_row = [&](int r) -> const u16* {
    const int gr = row0 + r;
    if (gr >= a.rows) return nullptr;
    const int j = gr / a.group;
    return a.q + (((long long)sc.b * a.s_q + j) * hq + (long long)sc.kvh * a.group + (gr - j * a.group)) * D;
  };
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
