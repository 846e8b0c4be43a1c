// gqadrv — GQA decode, short route (capacity <= W*TOK, 64 by default): latency-first, no ring.
// Built for sm_80 and newer (it is also the short route of the portable and tcgen05-family paths).
//
// CTA work   one (batch b, KV head kvh); grid B*Hkv, num_splits is always 1.
// Warps      GQA_WARPS warps; warp w owns tokens [w*TOK, (w+1)*TOK) of the request and loads its
//            K and V rows straight from global memory into registers as 16-byte vectors. Rows are
//            bounded by the capacity C (known on the host), not by the device length, so the Q, K,
//            V and length loads are all in flight at once; rows >= len are masked (scores -inf,
//            V rows zeroed in registers), rows >= C read as zero. One WarpDecoder step.
// Smem map   the per-warp states (MergeArea: W x ROWS x {m,l} and W x ROWS x (D+8) fp32, see StateLayout), merged
//            by all threads into the fp16/bf16 output.
// Barriers   one __syncthreads between store_state and the merge; no mbarriers.
#include "../common/gqa_config.cuh"
#include "../common/gqa_cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK;
}

extern "C" __global__ void __launch_bounds__(W * 32, 1) gqa_decode_short(const GqaArgs args) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 s_ticket;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  GQA_MARK(args, 0);
  pdl_wait();
  GQA_MARK(args, 1);
  WarpDecoder<DT, D, ROWS, TOK> dec;  // Q first: its load does not wait for the length
  dec.init(lane);
  {
    const int g = lane >> 2;
    const u16* qb = args.q + ((long long)((int)blockIdx.x / args.hkv) * args.hkv + ((int)blockIdx.x % args.hkv)) * args.group * D;
    dec.load_q(g < args.group ? qb + g * D : nullptr,
               (ROWS == 16 && g + 8 < args.group) ? qb + (g + 8) * D : nullptr);
  }
  const CtaSchedule sc = make_schedule(args, TOK);
  GQA_MARK(args, 2);

  const int tok0 = warp * TOK;
  if (tok0 < args.capacity) {
    const long long plane = (long long)args.capacity * D;
    const long long kbase = (((long long)sc.b * 2) * args.hkv + sc.kvh) * plane;
    const long long vbase = (((long long)sc.b * 2 + 1) * args.hkv + sc.kvh) * plane;
    GlobalChunks src{args.kv + kbase + (long long)tok0 * D, args.kv + vbase + (long long)tok0 * D, D,
                     args.capacity - tok0};
    dec.step(src, tok0, sc.len, args.scale_log2);
  }
  pdl_launch_dependents();
  dec.finish();
  GQA_MARK(args, 4);
  using MA = MergeArea<D, ROWS, W>;
  dec.store_state(MA::ml(smem, warp), MA::os(smem, warp), args.group);
  __syncthreads();
  GQA_MARK(args, 5);
  cta_epilogue<DT, D, ROWS, W, W * 32, false>(args, sc, smem, &s_ticket);
}
