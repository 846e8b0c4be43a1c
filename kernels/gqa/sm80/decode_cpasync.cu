// gqadrv — GQA decode, portable pipelined route for sm_80 and newer (A100, L40, RTX; a forced
// fallback on any newer GPU). No TMA, no mbarrier transactions, no wgmma/tcgen05. Entry point
// gqa_decode_cpasync(GqaArgs).
//
// CTA work   one (batch b, KV head kvh, split s), exactly as the TMA route (make_schedule,
//            gqa/common/args.cuh): the output (one split) or the split's fp32 partial state.
// Warps      GQA_WARPS identical warps; warp w takes sub-tiles begin+w, begin+w+W, ... Each warp
//            fills its own private ring with cp.async (16 B per lane per copy, rows >= len are
//            zero-filled without reading global memory) into the same 128B-swizzled layout the TMA
//            route uses, so the math (WarpDecoder) is byte-for-byte the same code.
// Tiles      sub-tiles of GQA_TOK tokens (16 or 32) x D, GQA_STAGES ring slots per warp (rings
//            stay <= 96 KB for the 99 KB opt-in limit of sm_86 / sm_89); mma.sync m16n8k16 with
//            ROWS = 8 or 16 query rows.
// Smem map   [0, W*STAGES*SLOT)  ring (slot = K then V of one sub-tile, D/64 boxes of TOK x 128 B);
//            reused afterwards as MergeArea and split-merge scratch.
// Barriers   cp.async groups: one commit per ring step (empty groups keep the count uniform),
//            wait_group<STAGES-1> + __syncwarp before reading a slot, __syncwarp before refilling
//            it; __syncthreads before the warp-state merge (cta_finish_and_epilogue); split
//            ticket: see cta_epilogue in gqa/common/cta.cuh.
#include "../common/config.cuh"
#include "../common/cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK,
              STAGES = GQA_STAGES;
constexpr u32 SLOT_BYTES = 2u * D * TOK * 2u;
}  // namespace

// Register budget: min-blocks 1 lets ptxas use up to 255 registers; for D = 256 ptxas (NVRTC 13.0)
// allocates better without that hint (checked by `python -m gqadrv compile` / the CI static checks).
#if GQA_D == 256
#define GQA_PORTABLE_BOUNDS __launch_bounds__(W * 32)
#else
#define GQA_PORTABLE_BOUNDS __launch_bounds__(W * 32, 1)
#endif

extern "C" __global__ void GQA_PORTABLE_BOUNDS
    gqa_decode_cpasync(const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ u32 s_ticket;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  GQA_MARK(args, 0);
  pdl_wait();
  GQA_MARK(args, 1);
  const CtaSchedule sc = make_schedule(args, TOK);
  GQA_MARK(args, 2);
  const int first = sc.sub_begin + warp;
  const int count = first < sc.sub_end ? (sc.sub_end - first + W - 1) / W : 0;
  u8* ring = smem + (size_t)warp * STAGES * SLOT_BYTES;
  const long long plane = (long long)args.capacity * D;
  const u16* kbase = args.kv + (((long long)sc.b * 2) * args.hkv + sc.kvh) * plane;
  const u16* vbase = args.kv + (((long long)sc.b * 2 + 1) * args.hkv + sc.kvh) * plane;

  auto issue = [&](int i) {
    copy_tile_cp_async<TOK, D>(smem_u32(ring + (size_t)(i % STAGES) * SLOT_BYTES), kbase, vbase,
                               (first + i * W) * TOK, sc.len, lane);
  };
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    if (s < count) issue(s);
    cp_async_commit();
  }

  WarpDecoder<DT, D, ROWS, TOK> dec;
  dec.init(lane);
  {
    const int g = lane >> 2;
    const u16* qb = args.q + ((long long)((int)(blockIdx.x / args.num_splits) / args.hkv) * args.hkv + ((int)(blockIdx.x / args.num_splits) % args.hkv)) * args.group * D;
    dec.load_q(g < args.group ? qb + g * D : nullptr,
               (ROWS == 16 && g + 8 < args.group) ? qb + (g + 8) * D : nullptr);
  }
  pdl_launch_dependents();

  for (int i = 0; i < count; ++i) {
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    SwizzledSmemChunks src{ring + (size_t)(i % STAGES) * SLOT_BYTES};
    dec.step(src, (first + i * W) * TOK, sc.len, args.scale_log2);
    __syncwarp();
    if (i + STAGES < count) issue(i + STAGES);
    cp_async_commit();
  }
  cp_async_wait<0>();  // no copy in flight when the rings become the merge area
  cta_finish_and_epilogue<W>(dec, args, sc, smem, &s_ticket, warp);
}
