// gqadrv — GQA decode, pipelined TMA route (sm_90a; the same source also builds for sm_100a/sm_110a
// and is the host-side twin of the tcgen05 kernels).
//
// CTA work   one (batch b, KV head kvh, split s) of the grid B*Hkv*S (blockIdx.x = bh*S + s). The
//            split owns sub-tiles [nsub*s/S, nsub*(s+1)/S) of TOK tokens, nsub = ceil(len/TOK), with
//            len read on the device and clamped to [0, C]. No host read of lengths, ever.
// Warps      GQA_WARPS identical consumer warps, no producer warp: warp w takes sub-tiles
//            begin+w, begin+w+W, ... and its lane 0 issues the TMA loads of its own private ring.
//            Each warp keeps a full online-softmax state (m, l, O fragments) in registers.
// Smem map   [0, W*STAGES*SLOT)  ring; slot = K then V of one sub-tile, each D/64 boxes of
//                                TOK rows x 128 B, 128B-swizzled (1024-byte aligned)
//            after the loop the same bytes hold the per-warp states (MergeArea) and then the
//            split-merge scratch; mbarriers full[W][STAGES] are static shared memory.
// Barriers   full[w][slot]: count 1, lane 0 arrive.expect_tx(SLOT) + 2*D/64 TMA boxes complete it;
//            parity = (i / STAGES) & 1 for the warp's i-th sub-tile. A slot is refilled by the same
//            lane 0 after __syncwarp + fence.proxy.async (its readers are its own warp).
//            __syncthreads before the warp-state merge; split ticket: see gqa_cta.cuh.
// L2         before griddepcontrol.wait (i.e. overlapping the previous kernel's tail) each warp
//            prefetches into L2 the first STAGES sub-tiles it would own if len == C (GQA_PREFETCH);
//            L2 is the coherence point, so this is safe even if the previous kernel writes KV.
//            GQA_L2_EVICT_FIRST=1 tags the ring loads evict-first (streaming), 0 loads them plainly.
// PDL        barrier init, descriptor and L2 prefetches run before griddepcontrol.wait; dependents
//            are released once all loads of this CTA are issued.
#include "../common/gqa_config.cuh"
#include "../common/gqa_cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK,
              STAGES = GQA_STAGES;
constexpr int NB = D / 64;
constexpr u32 SLOT_BYTES = 2u * D * TOK * 2u;
#ifndef GQA_PREFETCH
#define GQA_PREFETCH 1
#endif
#ifndef GQA_L2_EVICT_FIRST
#define GQA_L2_EVICT_FIRST 0
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(W * 32, 1)
    gqa_decode_tma(const __grid_constant__ TmaDesc kv_map, const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ __align__(8) u64 full_bar[W][STAGES];
  __shared__ u32 s_ticket;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&full_bar[warp][s]), 1);
    fence_mbarrier_init();
    if (warp == 0) tma_prefetch_desc(&kv_map);
#if GQA_PREFETCH
    {  // L2 prefetch of this warp's first sub-tiles under the guess len == C
      const int split = blockIdx.x % args.num_splits, bh = blockIdx.x / args.num_splits;
      const int b = bh / args.hkv, kvh = bh - b * args.hkv;
      const int nsub = (args.capacity + TOK - 1) / TOK;
      const int beg = (int)(((long long)nsub * split) / args.num_splits);
      const int end = (int)(((long long)nsub * (split + 1)) / args.num_splits);
      for (int i = 0; i < STAGES; ++i) {
        const int sub = beg + warp + i * W;
        if (sub >= end) break;
#pragma unroll
        for (int box = 0; box < NB; ++box) {
          tma_prefetch_l2_4d(&kv_map, 64 * box, sub * TOK, kvh, 2 * b);
          tma_prefetch_l2_4d(&kv_map, 64 * box, sub * TOK, kvh, 2 * b + 1);
        }
      }
    }
#endif
  }
  __syncwarp();
  pdl_wait();

  const CtaSchedule sc = make_schedule(args, TOK);
  const int first = sc.sub_begin + warp;
  const int count = first < sc.sub_end ? (sc.sub_end - first + W - 1) / W : 0;
  u8* ring = smem + (size_t)warp * STAGES * SLOT_BYTES;
  const int plane_k = 2 * sc.b, plane_v = 2 * sc.b + 1;
#if GQA_L2_EVICT_FIRST
  const u64 policy = l2_policy_evict_first();
#endif

  auto issue = [&](int i) {
    const u32 slot = smem_u32(ring + (size_t)(i % STAGES) * SLOT_BYTES);
    const u32 bar = smem_u32(&full_bar[warp][i % STAGES]);
    const int tok0 = (first + i * W) * TOK;
    mbar_arrive_expect_tx(bar, SLOT_BYTES);
#pragma unroll
    for (int box = 0; box < NB; ++box) {
#if GQA_L2_EVICT_FIRST
      tma_load_4d(slot + box * TOK * 128, &kv_map, bar, 64 * box, tok0, sc.kvh, plane_k, policy);
      tma_load_4d(slot + SLOT_BYTES / 2 + box * TOK * 128, &kv_map, bar, 64 * box, tok0, sc.kvh,
                  plane_v, policy);
#else
      tma_load_4d(slot + box * TOK * 128, &kv_map, bar, 64 * box, tok0, sc.kvh, plane_k);
      tma_load_4d(slot + SLOT_BYTES / 2 + box * TOK * 128, &kv_map, bar, 64 * box, tok0, sc.kvh, plane_v);
#endif
    }
  };
  if (lane == 0) {
    const int pre = count < STAGES ? count : STAGES;
    for (int i = 0; i < pre; ++i) issue(i);
  }

  WarpDecoder<DT, D, ROWS, TOK> dec;
  dec.init(lane);
  {
    const int g = lane >> 2;
    const u16* qb = args.q + ((long long)sc.b * args.hkv + sc.kvh) * args.group * D;
    dec.load_q(g < args.group ? qb + g * D : nullptr,
               (ROWS == 16 && g + 8 < args.group) ? qb + (g + 8) * D : nullptr);
  }
  pdl_launch_dependents();

  for (int i = 0; i < count; ++i) {
    mbar_wait(smem_u32(&full_bar[warp][i % STAGES]), (u32)((i / STAGES) & 1));
    SwizzledSmemChunks<D, TOK> src{ring + (size_t)(i % STAGES) * SLOT_BYTES};
    dec.step(src, (first + i * W) * TOK, sc.len, args.scale_log2);
    __syncwarp();
    if (lane == 0 && i + STAGES < count) {
      fence_proxy_async_smem();
      issue(i + STAGES);
    }
  }
  dec.finish();
  __syncthreads();  // every warp has drained its ring: the bytes become the merge area
  using MA = MergeArea<D, ROWS, W>;
  dec.store_state(MA::ml(smem, warp), MA::os(smem, warp), args.group);
  __syncthreads();
  cta_epilogue<DT, D, ROWS, W>(args, sc, smem, &s_ticket);
}
