// gqadrv — CTA-level pieces of the GQA decode kernels, shared by every route:
//   * the merge of the per-warp softmax states in shared memory (MergeArea of
//     kernels/common/softmax_state.cuh),
//   * the epilogue: normalised fp16/bf16 output (one split) or fp32 partials plus an atomic ticket
//     per (batch, KV head) whose last arrival merges all splits and resets the counter to zero, so
//     ordered launches and CUDA-graph replays need no reset kernel,
//   * the tail of the mma.sync kernels (cta_finish_and_epilogue): per-warp WarpDecoder state ->
//     merge area -> epilogue.
// The argument block and the tile schedule of a CTA are in args.cuh.
#pragma once
#include "config.cuh"
#include "args.cuh"
#include "warp.cuh"
#include "../../common/softmax_state.cuh"

// Store 8 values times `scale` as 8 fp16/bf16 (DT) elements: one 16-byte store (dst 16-byte aligned).
template <int DT>
GQADRV_DEVICE void store_row8(u16* dst, const float (&v)[8], float scale) {
  U32x4 p;
  p.x = pack2<DT>(v[0] * scale, v[1] * scale);
  p.y = pack2<DT>(v[2] * scale, v[3] * scale);
  p.z = pack2<DT>(v[4] * scale, v[5] * scale);
  p.w = pack2<DT>(v[6] * scale, v[7] * scale);
  *reinterpret_cast<U32x4*>(dst) = p;
}

// Where a CTA's merged softmax states go: the output rows (and their natural-log LSE), or this
// split's fp32 partials in the split workspace plus the ticket of its unit. Filled by the kernels'
// wrappers (cta_epilogue below for GqaArgs, paged_epilogue in paged.cuh).
//   output row of state row r:  MULTI = false: out_row0 + r
//                               MULTI = true:  g = first_row + r, j = g / group,
//                                              out_row0 + j * row_step + g % group
//   (row units of D elements; the LSE index is the same row index)
//   workspace slot of row r:    (unit * S_stride + split) * ws_rows + r  (S_stride = the launch's
//                               split count; S = the splits that take part in this unit's ticket)
struct EpilogueTarget {
  u16* out;
  float* lse;          // natural-log LSE per output row (+inf for a row without keys), or null
  float* ws_o;         // split partial numerators (S > 1)
  float* ws_ml;        // split {max (log2 domain), denominator} pairs
  u32* counters;       // one arrival ticket per unit, zero between launches
  void* trace;         // GQA_TRACE builds: the trace buffer (kernels/common/trace.cuh)
  long long out_row0;
  long long unit;
  int split, S;
  int S_stride;        // splits per unit in the workspace (>= S)
  int rows;            // state rows written (rows >= this are padding)
  int ws_rows;         // rows per (unit, split) in the workspace
  int first_row, group, row_step;  // MULTI mapping
  bool fixed_order;    // merge the splits one after another (batch-invariant results)
};
#if GQA_TRACE
#define GQA_MARK_T(t, i) GQADRV_TRACE_STAMP((t).trace, i)
#else
#define GQA_MARK_T(t, i) GQADRV_TRACE_NOP()
#endif

template <bool MULTI>
GQADRV_DEVICE long long target_row(const EpilogueTarget& t, int r) {
  if constexpr (!MULTI) {
    return t.out_row0 + r;
  } else {
    const int g = t.first_row + r, j = g / t.group;
    return t.out_row0 + (long long)j * t.row_step + (g - j * t.group);
  }
}

// Natural-log LSE of a merged state (m in the log2 domain, l its denominator); +inf without keys.
GQADRV_DEVICE float state_lse(float m, float l) {
  return l > 0.f ? (m + __log2f(l)) * 0.69314718055994531f : __int_as_float(0x7f800000);
}

// Store a merged state of item (row, the 8 dims from d0) normalised at target_row<MULTI>, and its
// natural-log LSE when tg.lse is set (once per row: d0 == 0).
template <int DT, int D, bool MULTI>
GQADRV_DEVICE void store_state_row8(const EpilogueTarget& tg, int row, int d0, const ItemState& st) {
  const long long orow = target_row<MULTI>(tg, row);
  store_row8<DT>(tg.out + orow * D + d0, st.v, st.l > 0.f ? 1.f / st.l : 0.f);
  if (tg.lse != nullptr && d0 == 0) tg.lse[orow] = state_lse(st.m, st.l);
}

// Merge item (row, the 8 dims from d0) over the W softmax states in `area` (a MergeArea) into M, den
// and acc, which the caller sets to -inf, 0 and zeros: common maximum, denominator and numerators
// (unnormalised), unchanged when every state is empty. States with m = -inf are skipped (their
// numerators are never read).
template <int D, int ROWS, int W>
GQADRV_DEVICE void merge_area_item(u8* area, int row, int d0, float& M, float& den, float (&acc)[8]) {
  using MA = MergeArea<D, ROWS, W>;
#pragma unroll
  for (int w = 0; w < W; ++w) M = fmaxf(M, MA::ml(area, w)[2 * row]);
  if (M != neg_inf()) {
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float mw = MA::ml(area, w)[2 * row];
      if (mw == neg_inf()) continue;
      const float wt = softmax_weight(mw, M);
      den += wt * MA::ml(area, w)[2 * row + 1];
      const U32x4* src = reinterpret_cast<const U32x4*>(MA::os(area, w) + row * MA::STRIDE + d0);
      const U32x4 lo = src[0], hi = src[1];
      acc[0] += wt * __uint_as_float(lo.x);
      acc[1] += wt * __uint_as_float(lo.y);
      acc[2] += wt * __uint_as_float(lo.z);
      acc[3] += wt * __uint_as_float(lo.w);
      acc[4] += wt * __uint_as_float(hi.x);
      acc[5] += wt * __uint_as_float(hi.y);
      acc[6] += wt * __uint_as_float(hi.z);
      acc[7] += wt * __uint_as_float(hi.w);
    }
  }
}

// Merge the W softmax states in `area` (W = states, e.g. one per warp), then either store the
// normalised output (one split) or this split's partial and take part in the last-CTA merge. Must
// be called by all NTHREADS threads of the CTA after a __syncthreads() that follows every
// store_state(). NTHREADS defaults to one warp per state. Kernels whose route never splits
// (num_splits == 1 always, routes.Family.splittable) pass SPLITS = false: no merge is compiled.
template <int DT, int D, int ROWS, int W, int NTHREADS = W * 32, bool SPLITS = true, bool MULTI = false>
GQADRV_DEVICE void cta_epilogue_rows(const EpilogueTarget& tg, u8* area, u32* s_ticket) {
  constexpr int D8 = D / 8;
  const int tid = threadIdx.x;
  const int group = tg.rows;
  const int items = group * D8;
  const int S = SPLITS ? tg.S : 1;

  for (int it = tid; it < items; it += NTHREADS) {
    const int row = it / D8, d0 = (it - row * D8) * 8;
    float M = neg_inf(), den = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    merge_area_item<D, ROWS, W>(area, row, d0, M, den, acc);
    if (S == 1) {
      const float inv = den > 0.f ? 1.f / den : 0.f;
      const long long orow = target_row<MULTI>(tg, row);
      store_row8<DT>(tg.out + orow * D + d0, acc, inv);
      if (tg.lse != nullptr && d0 == 0) tg.lse[orow] = state_lse(M, den);
    } else {
      const long long slot = ((long long)tg.unit * tg.S_stride + tg.split) * tg.ws_rows + row;
      if (d0 == 0) {
        tg.ws_ml[2 * slot] = M;
        tg.ws_ml[2 * slot + 1] = den;
      }
      {  // written even for an empty split (zeros), so the merge never reads unwritten memory
        float* dst = tg.ws_o + slot * D + d0;
        *reinterpret_cast<U32x4*>(dst) = U32x4{__float_as_uint(acc[0]), __float_as_uint(acc[1]),
                                               __float_as_uint(acc[2]), __float_as_uint(acc[3])};
        *reinterpret_cast<U32x4*>(dst + 4) = U32x4{__float_as_uint(acc[4]), __float_as_uint(acc[5]),
                                                   __float_as_uint(acc[6]), __float_as_uint(acc[7])};
      }
    }
  }
  GQA_MARK_T(tg, 6);
  if (S == 1) return;

  // Merge geometry: P lanes per (row, 8 dims) item, P a power of two, as many as the CTA's threads
  // allow, at most 16 and at most S. Lane j of an item merges splits j, j + P, ... with an online
  // rescale, loading {m, l} and the 8 partial values of BATCH of its splits at a time (independent
  // L2 loads in flight: usually every split of the item in one round trip); the P lane states are
  // then combined with a butterfly of shuffles and lane 0 stores. Shifts and pointer increments
  // only: no integer division between the ticket and the loads (there were three). With
  // fixed_order, P = 1: one thread merges an item's splits in split order, so the result does not
  // depend on S or on the CTA size (batch-invariant mode).
  constexpr int BATCH = 8;
  int lp = 0;  // log2(P)
  while (!tg.fixed_order && lp < 4 && (2 << lp) <= S && items * (2 << lp) <= NTHREADS) ++lp;
  const int P = 1 << lp, per_pass = NTHREADS >> lp, lane_j = tid & (P - 1);
  const int wr = tg.ws_rows;
  const long long ml_step = 2LL * P * wr, po_step = (long long)P * wr * D;  // floats per j
  const float* ml_lane = tg.ws_ml + ((long long)tg.unit * tg.S_stride + lane_j) * wr * 2;
  const float* po_lane = tg.ws_o + ((long long)tg.unit * tg.S_stride + lane_j) * wr * D;

  // ---- ticket: the last of the S CTAs of this (batch, KV head) merges
  // The CTA barrier orders every thread's partial stores before thread 0's release (the acq_rel
  // ticket); the last CTA's acquire (same atomic) plus the barrier below order its L2-only loads.
  __syncthreads();
  if (tid == 0) *s_ticket = atomic_add_acq_rel_gpu(tg.counters + tg.unit, 1u);
  __syncthreads();
  GQA_MARK_T(tg, 7);
  if (*s_ticket != (u32)(S - 1)) return;

  for (int base = 0; base < items; base += per_pass) {  // CTA-uniform trip count
    const int it = base + (tid >> lp);
    const int row = it / D8, d0 = (it - row * D8) * 8;
    ItemState st{neg_inf(), 0.f, {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};
    const float* mlp = ml_lane + 2 * row;
    const float* pop = po_lane + row * D + d0;
    for (int s0 = lane_j; it < items && s0 < S; s0 += BATCH * P) {
      const int nj = (S - s0 + P - 1) >> lp;  // splits s0, s0 + P, ... below S (>= 1)
      float v[BATCH][8], ms[BATCH], ls[BATCH];
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        if (j < nj) {
          ld_cg_f32x2(mlp + j * ml_step, ms[j], ls[j]);
          ld_cg_f32x4(pop + j * po_step, v[j][0], v[j][1], v[j][2], v[j][3]);
          ld_cg_f32x4(pop + j * po_step + 4, v[j][4], v[j][5], v[j][6], v[j][7]);
        }
      }
      mlp += BATCH * ml_step;
      pop += BATCH * po_step;
      float bm = st.m;
#pragma unroll
      for (int j = 0; j < BATCH; ++j)
        if (j < nj) bm = fmaxf(bm, ms[j]);
      if (bm == neg_inf()) continue;  // every split so far is empty
      const float r = softmax_weight(st.m, bm);  // 0 when st.m == -inf
      st.l *= r;
#pragma unroll
      for (int i = 0; i < 8; ++i) st.v[i] *= r;
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        if (j < nj && ms[j] != neg_inf()) {
          const float w = softmax_weight(ms[j], bm);
          st.l += w * ls[j];
#pragma unroll
          for (int i = 0; i < 8; ++i) st.v[i] += w * v[j][i];
        }
      }
      st.m = bm;
    }
    for (int off = 1; off < P; off <<= 1) {  // butterfly inside each group of P lanes
      ItemState o;
      o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
      o.l = __shfl_xor_sync(0xffffffffu, st.l, off);
#pragma unroll
      for (int i = 0; i < 8; ++i) o.v[i] = __shfl_xor_sync(0xffffffffu, st.v[i], off);
      combine_states(st, o);
    }
    if (it < items && lane_j == 0) store_state_row8<DT, D, MULTI>(tg, row, d0, st);
  }
  GQA_MARK_T(tg, 9);
  if (tid == 0) store_relaxed_gpu(tg.counters + tg.unit, 0u);
  GQA_MARK_T(tg, 8);
}

// The request's status word of a GqaArgs launch (empty 1, clamped 2, else 0), written by thread 0 of
// the request's first CTA (KV head 0, split 0) after every input load was issued, so no store
// precedes the loads. GQA_TRACE builds use the status buffer for the trace: nothing is written.
GQADRV_DEVICE void write_request_status(const GqaArgs& a, const CtaSchedule& sc) {
#if !GQA_TRACE
  if (a.status != nullptr && sc.kvh == 0 && sc.split == 0 && threadIdx.x == 0)
    a.status[sc.b] = sc.raw_len <= 0 ? 1u : (sc.raw_len > a.capacity ? 2u : 0u);
#endif
}

// The EpilogueTarget of a GqaArgs kernel's CTA (one query token, rows = the group's heads, no LSE).
GQADRV_DEVICE EpilogueTarget gqa_epilogue_target(const GqaArgs& a, const CtaSchedule& sc) {
  EpilogueTarget tg;
  tg.out = a.out;
  tg.lse = nullptr;
  tg.ws_o = a.ws_o;
  tg.ws_ml = a.ws_ml;
  tg.counters = a.counters;
  tg.trace = a.status;
  tg.out_row0 = (long long)sc.b * a.hkv * a.group + (long long)sc.kvh * a.group;
  tg.unit = sc.bh;
  tg.split = sc.split;
  tg.S = a.num_splits;
  tg.S_stride = a.num_splits;
  tg.rows = a.group;
  tg.ws_rows = a.group;
  tg.first_row = 0;
  tg.group = a.group;
  tg.row_step = 0;
  tg.fixed_order = false;
  return tg;
}

// cta_epilogue_rows for the GqaArgs kernels: also writes the request's status word
// (write_request_status).
template <int DT, int D, int ROWS, int W, int NTHREADS = W * 32, bool SPLITS = true>
GQADRV_DEVICE void cta_epilogue(const GqaArgs& a, const CtaSchedule& sc, u8* area, u32* s_ticket) {
  write_request_status(a, sc);
  cta_epilogue_rows<DT, D, ROWS, W, NTHREADS, SPLITS, false>(gqa_epilogue_target(a, sc), area, s_ticket);
}

// The first half of the mma.sync kernels' tail, called by all W * 32 threads once every warp has
// issued its last step (and its last copy has landed): reduce each warp's denominators
// (WarpDecoder::finish), wait until every warp is done with its K/V slots (they become the
// MergeArea of W states) and store each warp's state there. Trace marks 4 (states reduced) and 5
// (merge area written).
template <int W, int DT, int D, int ROWS, int TOK>
GQADRV_DEVICE void cta_states_to_merge_area(WarpDecoder<DT, D, ROWS, TOK>& dec, const GqaArgs& a, u8* smem, int warp) {
  dec.finish();
  GQA_MARK(a, 4);
  __syncthreads();  // every warp has read its slots: the bytes become the merge area
  using MA = MergeArea<D, ROWS, W>;
  dec.store_state(MA::ml(smem, warp), MA::os(smem, warp), a.group);
  __syncthreads();
  GQA_MARK(a, 5);
}

// Tail of the mma.sync kernels (smxx/decode_short.cu, sm90/decode_tma.cu, sm80/decode_cpasync.cu),
// called by all W * 32 threads: cta_states_to_merge_area, then cta_epilogue.
template <int W, bool SPLITS = true, int DT, int D, int ROWS, int TOK>
GQADRV_DEVICE void cta_finish_and_epilogue(WarpDecoder<DT, D, ROWS, TOK>& dec, const GqaArgs& a,
                                           const CtaSchedule& sc, u8* smem, u32* s_ticket, int warp) {
  cta_states_to_merge_area<W>(dec, a, smem, warp);
  cta_epilogue<DT, D, ROWS, W, W * 32, SPLITS>(a, sc, smem, s_ticket);
}
