// gqadrv — GQA decode, pipelined TMA route (sm_90a; the same source also builds for sm_100a/sm_110a
// and is the host-side twin of the tcgen05 kernels). Entry point gqa_decode_tma(TmaDesc, GqaArgs).
//
// CTA work   one (batch b, KV head kvh, split s) of the grid B*Hkv*S (blockIdx.x = bh*S + s): the
//            output (one split) or the split's fp32 partial state of the group's query heads. The
//            split owns sub-tiles [nsub*s/S, nsub*(s+1)/S) of TOK tokens, nsub = ceil(len/TOK), with
//            len read on the device and clamped to [0, C] (make_schedule, gqa/common/args.cuh). No
//            host read of lengths, ever.
// Warps      GQA_WARPS identical consumer warps, no producer warp: warp w takes sub-tiles
//            begin+w, begin+w+W, ... and its lane 0 issues the TMA loads of its own private ring.
//            Each warp keeps a full online-softmax state (m, l, O fragments) in registers.
// Tiles      sub-tiles of GQA_TOK tokens (16 or 32), GQA_STAGES ring slots per warp; TMA box
//            {64, TOK, 1, 1} of the 4-D map [2B, Hkv, C, D], 128B swizzle; mma.sync m16n8k16 with
//            ROWS = 8 or 16 query rows (WarpDecoder, gqa/common/warp.cuh).
// Smem map   [0, W*STAGES*SLOT)  ring; slot = K then V of one sub-tile, each D/64 boxes of
//                                TOK rows x 128 B, 128B-swizzled (1024-byte aligned)
//            after the loop the same bytes hold the per-warp states (MergeArea) and then the
//            split-merge scratch; mbarriers full[W][STAGES] and the query rows s_q[ROWS][D]
//            (cp.async, padding rows zero-filled) are static shared memory.
//            Cluster launches add every CTA's receive area past the ring (RecvArea, cluster_merge.cuh).
// Barriers   full[w][slot]: count 1, lane 0 arrive.expect_tx(SLOT) + 2*D/64 TMA boxes complete it;
//            parity = (i / STAGES) & 1 for the warp's i-th sub-tile. A slot is refilled by the same
//            lane 0 after __syncwarp + fence.proxy.async (its readers are its own warp).
//            __syncthreads once Q has landed (cp.async.wait_group 0), before the warp-state merge
//            (cta_finish_and_epilogue); split ticket: see cta_epilogue in gqa/common/cta.cuh.
// Splits     a plain launch merges S > 1 splits through the split workspace and the ticket
//            (cta.cuh); a launch with clusters of S = num_splits CTAs (2..16, D <= 128; the host
//            decides, gqa/plan.launch_shape) merges them in the CTAs' shared memory instead, each CTA
//            the states of its chunk of the output: recv_bar and one cluster barrier, see
//            gqa/common/cluster_merge.cuh.
// L2         before griddepcontrol.wait (i.e. overlapping the previous kernel's tail) each warp
//            prefetches into L2 the first STAGES sub-tiles it would own if len == C, when the host
//            sets GQA_FLAG_L2_PREFETCH (one wave of long streams; GQA_PREFETCH=0 compiles it out);
//            L2 is the coherence point, so this is safe even if the previous kernel writes KV.
//            Ring loads carry an L2 evict-first policy when args.flags has GQA_FLAG_L2_EVICT_FIRST
//            (large KV footprints), evict-normal otherwise.
// PDL        barrier init, descriptor and L2 prefetches run before griddepcontrol.wait; after it
//            the length and Q loads are issued first, then the speculative ring fill; dependents
//            are released once all loads of this CTA are issued.
#include "../common/config.cuh"
#include "../common/cta.cuh"
#include "../common/cluster_merge.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK,
              STAGES = GQA_STAGES;
constexpr int NB = D / 64;
constexpr u32 SLOT_BYTES = 2u * D * TOK * 2u;
constexpr u32 RING_BYTES = (u32)W * STAGES * SLOT_BYTES;
using RA = RecvArea<D, ROWS, W, RING_BYTES>;
// The cluster merge is built for D <= 128 (routes.cluster_merge_applies): the D = 256 builds hold 255
// registers and would spill on sm_100a / sm_110a.
constexpr bool CLUSTER_MERGE = D <= 128;
#ifndef GQA_PREFETCH
#define GQA_PREFETCH 1
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(W * 32, 1)
    gqa_decode_tma(const __grid_constant__ TmaDesc kv_map, const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ __align__(8) u64 full_bar[W][STAGES];
  __shared__ u32 s_ticket;
  __shared__ __align__(8) u64 recv_bar;  // cluster launches: the split merge's receive barrier
  __shared__ __align__(16) u16 s_q[ROWS * D];  // this CTA's query rows, padding rows zero

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  // Cluster launches (S = num_splits CTAs of one (batch, KV head), rank = split) merge the splits in
  // the CTAs' shared memory (cluster_merge.cuh); the host sizes the receive area (a launch whose
  // cluster or shared memory does not match traps instead of writing out of bounds).
  const u32 ncl_launch = cluster_nctarank();
  if (ncl_launch > 1 && threadIdx.x == 0 &&
      (!CLUSTER_MERGE || ncl_launch != (u32)args.num_splits || ncl_launch > (u32)CLUSTER_MERGE_MAX ||
       dynamic_smem_bytes() < RA::OFFSET + RA::BYTES))
    __trap();
  const u32 ncl = CLUSTER_MERGE ? ncl_launch : 1u, crank = ncl > 1 ? cluster_ctarank() : 0u;
  // This warp's sub-tiles under the capacity-based split (no memory reads: usable before the
  // length is known); used by the L2 prefetch and the speculative ring fill.
  const int split0 = blockIdx.x % args.num_splits, bh0 = blockIdx.x / args.num_splits;
  const int b0 = bh0 / args.hkv, kvh0 = bh0 - b0 * args.hkv;
  int cap_beg, cap_end;
  capacity_split(args, TOK, split0, cap_beg, cap_end);
  const int first_c = cap_beg + warp;
  const int count_c = first_c < cap_end ? (cap_end - first_c + W - 1) / W : 0;
  const int spec = count_c < STAGES ? count_c : STAGES;
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&full_bar[warp][s]), 1);
    if (warp == 0 && ncl > 1) cluster_recv_init(smem_u32(&recv_bar), crank, ncl, args.group, D);
    fence_mbarrier_init();
    if (warp == 0) tma_prefetch_desc(&kv_map);
#if GQA_PREFETCH
    // L2 prefetch of this warp's first sub-tiles under the guess len == C
    const int n_pre = (args.flags & GQA_FLAG_L2_PREFETCH) ? spec : 0;
    for (int i = 0; i < n_pre; ++i) {
      const int sub = first_c + i * W;
#pragma unroll
      for (int box = 0; box < NB; ++box) {
        tma_prefetch_l2_4d(&kv_map, 64 * box, sub * TOK, kvh0, 2 * b0);
        tma_prefetch_l2_4d(&kv_map, 64 * box, sub * TOK, kvh0, 2 * b0 + 1);
      }
    }
#endif
  }
  __syncwarp();
  if (ncl > 1) cluster_arrive_relaxed();  // after the inits: see cluster_merge.cuh
  GQA_MARK(args, 0);
  pdl_wait();
  GQA_MARK(args, 1);

  // The length and Q are requested before the speculative ring fill: issued after it, they queue
  // behind up to STAGES sub-tiles per warp of TMA traffic and every warp's first step waits for
  // them (traced on the H200, B1 C4096: length known at 2.4 us after the CTA starts instead of 0.9
  // hot, 6.5 instead of 1.0 cold). Q goes to shared memory with cp.async (see stage_q_cp_async).
  const int raw_len = args.lengths[b0];
  stage_q_cp_async<ROWS, D, W * 32>(s_q, args.q + ((long long)b0 * args.hkv + kvh0) * args.group * D, args.group);
  cp_async_commit();

  // ---- speculative ring fill: the sub-tiles this warp owns under the capacity-based split (exact
  // whenever len >= 3C/4, see make_schedule), issued before the length is known.
  u8* ring = smem + (size_t)warp * STAGES * SLOT_BYTES;
  const u64 policy = (args.flags & GQA_FLAG_L2_EVICT_FIRST) ? l2_policy_evict_first() : l2_policy_evict_normal();
  auto issue = [&](int slot_idx, int sub) {  // lane 0 only
    const u32 slot = smem_u32(ring + (size_t)slot_idx * SLOT_BYTES);
    const u32 bar = smem_u32(&full_bar[warp][slot_idx]);
    const int tok0 = sub * TOK;
    mbar_arrive_expect_tx(bar, SLOT_BYTES);
#pragma unroll
    for (int box = 0; box < NB; ++box) {
      tma_load_4d(slot + box * TOK * 128, &kv_map, bar, 64 * box, tok0, kvh0, 2 * b0, policy);
      tma_load_4d(slot + SLOT_BYTES / 2 + box * TOK * 128, &kv_map, bar, 64 * box, tok0, kvh0, 2 * b0 + 1,
                  policy);
    }
  };
  if (lane == 0)
    for (int i = 0; i < spec; ++i) issue(i, first_c + i * W);

  const CtaSchedule sc = make_schedule(args, TOK, raw_len);
  GQA_MARK(args, 2);
  WarpDecoder<DT, D, ROWS, TOK> dec;
  dec.init(lane);
  cp_async_wait<0>();
  __syncthreads();  // every thread's Q chunks are in s_q
  {
    const int g = lane >> 2;
    dec.load_q(s_q + g * D, ROWS == 16 ? s_q + (g + 8) * D : nullptr);
  }
  const int first = sc.sub_begin + warp;
  const int count = first < sc.sub_end ? (sc.sub_end - first + W - 1) / W : 0;
  // Keep the speculative loads when this warp's first sub-tile matches (then every kept load is
  // the right one: same first, same stride). Otherwise wait them out and refill: the slots they
  // used are one phase ahead.
  const bool keep = spec > 0 && first == first_c;
  int shifted = 0;  // slots [0, shifted) carry one extra completed phase
  if (!keep) {
    for (int i = 0; i < spec; ++i) mbar_wait(smem_u32(&full_bar[warp][i]), 0u);
    shifted = spec;
    __syncwarp();
    if (lane == 0) {
      fence_proxy_async_smem();
      const int pre = count < STAGES ? count : STAGES;
      for (int i = 0; i < pre; ++i) issue(i, first + i * W);
    }
  }

  pdl_launch_dependents();

  for (int i = 0; i < count; ++i) {
    const int slot = i % STAGES;
    mbar_wait(smem_u32(&full_bar[warp][slot]), (u32)(((i / STAGES) + (slot < shifted ? 1 : 0)) & 1));
    if (i == 0) GQA_MARK(args, 3);
    SwizzledSmemChunks src{ring + (size_t)slot * SLOT_BYTES};
    dec.step(src, (first + i * W) * TOK, sc.len, args.scale_log2);
    __syncwarp();
    if (lane == 0 && i + STAGES < count) {
      fence_proxy_async_smem();
      issue(slot, first + (i + STAGES) * W);
    }
  }
  // Kept speculative loads beyond the real sub-tile count: let them land before smem is reused.
  if (keep)
    for (int i = count; i < spec; ++i) mbar_wait(smem_u32(&full_bar[warp][i]), 0u);
  if (ncl > 1)
    cta_finish_cluster<W, DT, D, ROWS, TOK, RING_BYTES>(dec, args, sc, smem, smem_u32(&recv_bar), warp, crank, ncl);
  else
    cta_finish_and_epilogue<W>(dec, args, sc, smem, &s_ticket, warp);  // the rings become the merge area
}
