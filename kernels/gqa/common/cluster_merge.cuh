// gqadrv — the split merge of the TMA decode kernel through distributed shared memory (sm_90 and newer).
//
// A launch with clusters of S CTAs along x (S = num_splits, 2..CLUSTER_MERGE_MAX; blockIdx.x = bh*S + s,
// so the cluster rank is the split) merges the S splits of one (batch, KV head) without the split
// workspace, the ticket or a second pass through L2: every CTA but rank 0 pushes its merged warp
// states (fp32 numerators and {max, denominator} per row) with st.async into its own slot of rank 0's
// receive area, each store completing its bytes on rank 0's receive barrier, which rank 0's thread 0
// armed at kernel start with the bytes of S - 1 splits. Rank 0 writes its own slot locally, waits on
// the barrier, merges the S slots and stores the normalised output. A pushing CTA exits right after
// its stores (nobody reads its shared memory); rank 0 lives until every pushed byte has landed.
//
// Receive area  dynamic smem from RecvArea::OFFSET (past the ring and the warp-state merge area): a
//               MergeArea of CLUSTER_MERGE_MAX states, slot s = split s (slots from S on marked
//               empty by rank 0); host twin: routes.cluster_recv_bytes.
// Barriers      recv_bar (static smem, used in rank 0 only): count 1, arrive.expect_tx of the S - 1
//               pushes right after its init; phase 0 completes when they have all landed.
//               The cluster barrier: every thread arrives once (relaxed) after the inits and their
//               fence.mbarrier_init, and waits before the first push, so no push can reach an
//               uninitialised barrier.
// Launches without clusters (cluster_nctarank() == 1) never enter this file's functions: they take
// the ticket merge of cta.cuh.
#pragma once
#include "cta.cuh"

#if GQADRV_ARCH >= 90
constexpr int CLUSTER_MERGE_MAX = 8;  // the largest portable cluster; routes.CLUSTER_MERGE_MAX

// Rank 0's receive area: a MergeArea of CLUSTER_MERGE_MAX states (slot = split), placed in dynamic
// smem past what routes.Variant.dynamic_smem reserves for the ring and the warp-state merge area.
template <int D, int ROWS, int W, u32 RING_BYTES>
struct RecvArea {
  using Slots = MergeArea<D, ROWS, CLUSTER_MERGE_MAX>;
  static constexpr u32 MERGE_BYTES = (u32)MergeArea<D, ROWS, W>::BYTES;
  static constexpr u32 OFFSET = ((RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES) + 1023u) / 1024u * 1024u;
  static constexpr u32 BYTES = (u32)Slots::BYTES;  // host twin: routes.cluster_recv_bytes
};

// The bytes one pushing CTA sends: 8-float numerator chunks and {m, l} of the group's rows.
GQADRV_DEVICE u32 cluster_push_bytes(int group, int D) { return (u32)group * (u32)(D + 2) * 4u; }

// Kernel start, one thread per CTA, before fence_mbarrier_init: rank 0 initialises and arms its
// receive barrier.
GQADRV_DEVICE void cluster_recv_init(u32 recv_bar, u32 rank, u32 S, int group, int D) {
  if (rank == 0) {
    mbar_init(recv_bar, 1);
    mbar_arrive_expect_tx(recv_bar, (S - 1) * cluster_push_bytes(group, D));
  }
}

// Tail of the TMA kernel in a cluster launch: per-warp states -> merge area (as
// cta_finish_and_epilogue) -> this CTA's merged item states pushed to rank 0 (kept, in rank 0) ->
// rank 0 merges the S slots and stores the output. Called by all W * 32 threads. Trace marks 4, 5
// as in cta.cuh; 6 pushed / kept, 7 every push landed (rank 0), 9 output stored.
template <int W, int DT, int D, int ROWS, int TOK, u32 RING_BYTES>
GQADRV_DEVICE void cta_finish_cluster(WarpDecoder<DT, D, ROWS, TOK>& dec, const GqaArgs& a, const CtaSchedule& sc,
                                      u8* smem, u32 recv_bar, int warp, u32 rank, u32 S) {
  using MA = MergeArea<D, ROWS, W>;
  using RA = RecvArea<D, ROWS, W, RING_BYTES>;
  using Slots = typename RA::Slots;
  constexpr int D8 = D / 8;
  u8* recv = smem + RA::OFFSET;
  dec.finish();
  GQA_MARK(a, 4);
  if (rank == 0)  // slots S.. hold no split: empty states, skipped by the merge
    for (int i = threadIdx.x; i < (CLUSTER_MERGE_MAX - (int)S) * ROWS; i += W * 32)
      Slots::ml(recv, (int)S + i / ROWS)[2 * (i % ROWS)] = neg_inf();
  __syncthreads();  // every warp has read its slots: the bytes become the merge area
  dec.store_state(MA::ml(smem, warp), MA::os(smem, warp), a.group);
  __syncthreads();
  GQA_MARK(a, 5);
  write_request_status(a, sc);
  cluster_wait();  // rank 0's receive barrier is initialised and armed

  const u32 remote = map_shared_rank(smem_u32(recv), 0), remote_bar = map_shared_rank(recv_bar, 0);
  const int items = a.group * D8;
  for (int it = threadIdx.x; it < items; it += W * 32) {
    const int row = it / D8, d0 = (it - row * D8) * 8;
    float M = neg_inf(), den = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    merge_area_item<D, ROWS, W>(smem, row, d0, M, den, acc);
    const U32x4 lo{__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]), __float_as_uint(acc[3])};
    const U32x4 hi{__float_as_uint(acc[4]), __float_as_uint(acc[5]), __float_as_uint(acc[6]), __float_as_uint(acc[7])};
    // byte offsets of this split's slot in the receive area
    const u32 o = (u32)(reinterpret_cast<u8*>(Slots::os(recv, (int)rank) + row * Slots::STRIDE + d0) - recv);
    const u32 ml = (u32)(reinterpret_cast<u8*>(Slots::ml(recv, (int)rank) + 2 * row) - recv);
    if (rank != 0) {
      st_async_v4(remote + o, lo, remote_bar);
      st_async_v4(remote + o + 16, hi, remote_bar);
      if (d0 == 0) st_async_v2(remote + ml, __float_as_uint(M), __float_as_uint(den), remote_bar);
    } else {
      *reinterpret_cast<U32x4*>(recv + o) = lo;
      *reinterpret_cast<U32x4*>(recv + o + 16) = hi;
      if (d0 == 0) *reinterpret_cast<F32x2*>(recv + ml) = F32x2{M, den};
    }
  }
  GQA_MARK(a, 6);
  if (rank != 0) return;

  __syncthreads();  // rank 0's own slot is complete
  mbar_wait(recv_bar, 0u);
  GQA_MARK(a, 7);
  const long long out_row0 = (long long)sc.b * a.hkv * a.group + (long long)sc.kvh * a.group;
  for (int it = threadIdx.x; it < items; it += W * 32) {
    const int row = it / D8, d0 = (it - row * D8) * 8;
    float M = neg_inf(), den = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    merge_area_item<D, ROWS, CLUSTER_MERGE_MAX>(recv, row, d0, M, den, acc);
    store_row8<DT>(a.out + (out_row0 + row) * D + d0, acc, den > 0.f ? 1.f / den : 0.f);
  }
  GQA_MARK(a, 9);
}
#endif
