// gqadrv — the split merge of the TMA decode kernels (sm90/decode_tma.cu, sm90/decode_paged_tma.cu)
// through distributed shared memory (sm_90 and newer).
//
// A launch with clusters of S CTAs along x (S = num_splits, 2..CLUSTER_MERGE_MAX = 16; blockIdx.x =
// unit*S + s, so the cluster rank is the split) merges the S splits of one unit (batch, KV head; the
// paged kernel: and row block) without the split workspace, the ticket or a second pass through L2.
// The output's items (row, 8 dims) are dealt out to the ranks in contiguous chunks (ItemChunks).
// Every CTA merges its warps' states item by item and
// pushes each item's state (8 fp32 numerators and {max, denominator}) with st.async into its own
// entry of the owning rank's receive area, each store completing its bytes on the owner's receive
// barrier (its own items it keeps locally); then it waits on its own receive barrier, armed at kernel
// start with the bytes the other S - 1 CTAs push into its chunk, merges the S states of each owned
// item (one lane per split, a butterfly of shuffles) and stores the normalised output. Every CTA
// receives only the bytes it waits for, so none can exit while another still writes into it.
//
// Receive area  dynamic smem from RecvArea::OFFSET (past the ring and the warp-state merge area):
//               S x J entries of 32 + 8 bytes; host twin: routes.cluster_recv_bytes.
// Barriers      recv_bar (static smem, every CTA): count 1, arrive.expect_tx of the S - 1 pushes into
//               its chunk right after its init; phase 0 completes when they have all landed.
//               The cluster barrier: every thread arrives once (relaxed) after the inits and their
//               fence.mbarrier_init, and waits before the first push, so no push can reach an
//               uninitialised barrier.
// Launches without clusters (cluster_nctarank() == 1) never enter this file's functions: they take
// the ticket merge of cta.cuh.
#pragma once
#include "cta.cuh"

#if GQADRV_ARCH >= 90
// Clusters of up to 8 CTAs are portable; 9..16 need the kernel's non-portable-cluster attribute, which
// the host sets before it asks the driver for residency (ops.kernels.max_active_clusters).
constexpr int CLUSTER_MERGE_MAX = 16;  // routes.CLUSTER_MERGE_MAX

// Item ownership: the merged output's items (row, 8 dims), it = 0 .. items-1, in contiguous chunks of
// J = ceil(items / S): item it belongs to rank it / J, at index it % J of that rank's chunk.
struct ItemChunks {
  int items, J;
  GQADRV_DEVICE ItemChunks(int group, int D8, u32 S) : items(group * D8), J((group * D8 + (int)S - 1) / (int)S) {}
  GQADRV_DEVICE int owned(u32 rank) const {  // items of rank's chunk (0 for ranks past the last chunk)
    const int n = items - (int)rank * J;
    return n < 0 ? 0 : (n < J ? n : J);
  }
};

// A CTA's receive area: S x J pushed item states, entry e = split * J + j, as 8 fp32 numerators
// (32 B) and {m, l} (8 B) in two arrays. S * J <= items + S - 1, so ROWS * D / 8 + CLUSTER_MERGE_MAX
// entries bound it for any group and S; it lives in dynamic smem past what routes.Variant.dynamic_smem
// reserves for the ring and the warp-state merge area.
template <int D, int ROWS, int W, u32 RING_BYTES>
struct RecvArea {
  static constexpr u32 MERGE_BYTES = (u32)MergeArea<D, ROWS, W>::BYTES;
  static constexpr u32 OFFSET = ((RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) + 1023u) / 1024u * 1024u;
  static constexpr u32 ENTRIES = (u32)(ROWS * D / 8 + CLUSTER_MERGE_MAX);
  static constexpr u32 ML_OFFSET = ENTRIES * 32u;
  static constexpr u32 BYTES = ENTRIES * 40u;  // host twin: routes.cluster_recv_bytes
};

// Kernel start, one thread per CTA, before fence_mbarrier_init: initialise this CTA's receive barrier
// and arm it with the bytes the other S - 1 CTAs push into its chunk (40 per item each) of the
// `rows` state rows every CTA of the cluster merges (the same for all of them).
GQADRV_DEVICE void cluster_recv_init(u32 recv_bar, u32 rank, u32 S, int rows, int D) {
  mbar_init(recv_bar, 1);
  mbar_arrive_expect_tx(recv_bar, (S - 1) * (u32)ItemChunks(rows, D / 8, S).owned(rank) * 40u);
}

// The split merge of a cluster launch, once the CTA's warp states are in the merge area (`smem`, a
// MergeArea<D, ROWS, W>, after a __syncthreads): each item (row < tg.rows, 8 dims) merged over the
// warps and pushed to the rank that owns it (kept when that is this CTA), then every CTA merges the
// S states of its own items and stores them normalised at target_row<MULTI> (and their LSE when
// tg.lse is set). The ticket form of the same step is cta_epilogue_rows (cta.cuh); tg's workspace
// fields are not used. Called by all W * 32 threads. Trace marks 6 pushed, 7 every push into this
// CTA landed, 9 output stored.
template <int DT, int D, int ROWS, int W, bool MULTI, u32 RING_BYTES>
GQADRV_DEVICE void cluster_epilogue_rows(const EpilogueTarget& tg, u8* smem, u32 recv_bar, u32 rank, u32 S) {
  using RA = RecvArea<D, ROWS, W, RING_BYTES>;
  constexpr int D8 = D / 8;
  constexpr int NT = W * 32;
  u8* recv = smem + RA::OFFSET;
  const ItemChunks ch(tg.rows, D8, S);
  cluster_wait();  // every CTA's receive barrier is initialised and armed

  const u32 recv_u32 = smem_u32(recv);
  for (int it = threadIdx.x; it < ch.items; it += NT) {
    const int row = it / D8, d0 = (it - row * D8) * 8;
    float M = neg_inf(), den = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    merge_area_item<D, ROWS, W>(smem, row, d0, M, den, acc);
    const U32x4 lo{__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]), __float_as_uint(acc[3])};
    const U32x4 hi{__float_as_uint(acc[4]), __float_as_uint(acc[5]), __float_as_uint(acc[6]), __float_as_uint(acc[7])};
    const u32 owner = (u32)(it / ch.J);
    const u32 e = rank * (u32)ch.J + (u32)(it - (int)owner * ch.J);  // entry in the owner's area
    if (owner != rank) {
      const u32 dst = map_shared_rank(recv_u32, owner), bar = map_shared_rank(recv_bar, owner);
      st_async_v4(dst + e * 32u, lo, bar);
      st_async_v4(dst + e * 32u + 16u, hi, bar);
      st_async_v2(dst + RA::ML_OFFSET + e * 8u, __float_as_uint(M), __float_as_uint(den), bar);
    } else {
      *reinterpret_cast<U32x4*>(recv + e * 32u) = lo;
      *reinterpret_cast<U32x4*>(recv + e * 32u + 16u) = hi;
      *reinterpret_cast<F32x2*>(recv + RA::ML_OFFSET + e * 8u) = F32x2{M, den};
    }
  }
  GQA_MARK_T(tg, 6);
  __syncthreads();  // this CTA's own entries are written
  mbar_wait(recv_bar, 0u);
  GQA_MARK_T(tg, 7);

  // Merge the owned items: P = the power of two >= S lanes per item, lane k holding split k's state
  // (empty for k >= S), combined by a butterfly of shuffles; CTA-uniform trip count.
  int lp = 0;
  while ((1u << lp) < S) ++lp;
  const int P = 1 << lp, per_pass = NT >> lp, k = threadIdx.x & (P - 1);
  const int owned = ch.owned(rank), first = (int)rank * ch.J;
  for (int base = 0; base < owned; base += per_pass) {
    const int j = base + (threadIdx.x >> lp);
    ItemState st{neg_inf(), 0.f, {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};
    if (j < owned && k < (int)S) {
      const u32 e = (u32)k * (u32)ch.J + (u32)j;
      const F32x2 ml = *reinterpret_cast<const F32x2*>(recv + RA::ML_OFFSET + e * 8u);
      const U32x4 lo = *reinterpret_cast<const U32x4*>(recv + e * 32u);
      const U32x4 hi = *reinterpret_cast<const U32x4*>(recv + e * 32u + 16u);
      st = ItemState{ml.x, ml.y, {__uint_as_float(lo.x), __uint_as_float(lo.y), __uint_as_float(lo.z), __uint_as_float(lo.w),
                                   __uint_as_float(hi.x), __uint_as_float(hi.y), __uint_as_float(hi.z), __uint_as_float(hi.w)}};
    }
    for (int off = 1; off < P; off <<= 1) {  // butterfly inside each group of P lanes
      ItemState o;
      o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
      o.l = __shfl_xor_sync(0xffffffffu, st.l, off);
#pragma unroll
      for (int i = 0; i < 8; ++i) o.v[i] = __shfl_xor_sync(0xffffffffu, st.v[i], off);
      combine_states(st, o);
    }
    if (j < owned && k == 0) {
      const int it = first + j, row = it / D8, d0 = (it - row * D8) * 8;
      store_state_row8<DT, D, MULTI>(tg, row, d0, st);
    }
  }
  GQA_MARK_T(tg, 9);
}

// Tail of the TMA kernel (GqaArgs) in a cluster launch: per-warp states -> merge area
// (cta_states_to_merge_area, as the ticket tail) -> the request's status word ->
// cluster_epilogue_rows over the group's rows. Called by all W * 32 threads.
template <int W, int DT, int D, int ROWS, int TOK, u32 RING_BYTES>
GQADRV_DEVICE void cta_finish_cluster(WarpDecoder<DT, D, ROWS, TOK>& dec, const GqaArgs& a, const CtaSchedule& sc,
                                      u8* smem, u32 recv_bar, int warp, u32 rank, u32 S) {
  cta_states_to_merge_area<W>(dec, a, smem, warp);
  write_request_status(a, sc);
  cluster_epilogue_rows<DT, D, ROWS, W, false, RING_BYTES>(gqa_epilogue_target(a, sc), smem, recv_bar, rank, S);
}
#endif
