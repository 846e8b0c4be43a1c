// gqadrv — GQA decode, tcgen05 short route (sm_100a B200 / sm_110a Thor), latency-first, no ring and
// no tensor map. COMPILE-VERIFIED ONLY: no sm_100/sm_110 GPU was available, this kernel has never
// executed.
//
// CTA work   one (batch b, KV head kvh) (grid B*Hkv, blockIdx.x = bh*S + s with S = 1 in practice;
//            make_schedule and cta_epilogue also handle S > 1). The route uses it for C <= 64, i.e.
//            one sub-tile of TOK = 128 tokens; larger capacities are still computed correctly, one
//            sub-tile after the other. Same math and softmax core as tc_long
//            (gqa/common/tc_core.cuh):
//              S^T[tok, h]  = K[tok, :] . Q[h, :]        M 128, N 16, K D
//              O^T[d, h]   += V[tok, d] . P^T[tok, h]    M 128 (64 if D = 64), N 16, K 16 per valid
//                                                         16-token step only
// Loads      plain 16-byte global loads by all 160 threads, written to shared memory in the same
//            128B-swizzled layout TMA would produce. Why not TMA: the kernel signature carries no
//            tensor map (GqaArgs only), a single tile has nothing to pipeline, and plain loads can be
//            bounded by the device length: rows >= len are never read (never past C either) and the
//            rows [len, round_up(len, 16)) that the P.V MMA reads are written as zeros, so NaN/Inf in
//            the padding cannot reach the output. K rows beyond are left as they are: their scores are
//            replaced by -inf with a select.
// Tiles      one sub-tile of TOK = 128 tokens at a time: K and V as D/64 boxes of 128 rows x 128 B,
//            MMA shapes of TcGeom (gqa/common/tc_core.cuh).
// Warps      160 threads: warps 0-3 softmax / epilogue (thread t owns TMEM lane t), warp 4 TMEM
//            alloc / dealloc (whole warp) and MMA issue (lane 0); all 5 warps load Q/K/V and run
//            cta_epilogue. Prologue (barrier init, TMEM alloc) and tail (TMEM free, epilogue):
//            tc_cta_prologue / tc_cta_epilogue of gqa/common/tc_core.cuh, shared with tc_long.
// Smem map   (dynamic, 1024-byte aligned; SMEM_BYTES below, = tc_dynamic_smem on the host)
//              [0, TILE)            K sub-tile: D/64 boxes of 128 rows x 128 B, SW128 (K-major A)
//              [TILE, 2 TILE)       V sub-tile, the same layout (MN-major A of the P.V MMA)
//              [OFF_Q, +16*D*2)     Q: D/64 boxes of 16 rows x 128 B, SW128, rows >= g zero
//              [OFF_P, +4096)       P^T: 2 boxes of 16 heads x 64 tokens, SW128
//            after the last P.V the K/V bytes hold the MergeArea (1 state) and the split scratch.
//            Static smem: mbarriers, red_max [2][4][16], red_l [4][16], TMEM address, ticket.
// TMEM map   64 columns: S^T buffers at 0 / 16, O^T at 32 (head dims 0-127) and 48 (128-255).
// Barriers   s_full[b] count 1 (commit after QK(i), b = i & 1, parity (i >> 1) & 1);
//            p_full count 128 (P^T written + fence.proxy.async, O^T rescaled + wait::st +
//            fence::before; parity i & 1); pv_done count 1 (commit after P.V(i), parity i & 1:
//            all threads wait it before reloading the tile buffers, softmax before P^T / O^T).
//            One __syncthreads per tile publishes the loaded operands (after fence.proxy.async).
//            len <= 0: no tile, no MMA, no wait; zeros are written; warp 4 still deallocates.
// Macros     GQA_DT, GQA_D, GQA_ROWS, GQA_WARPS (= 5), GQA_TOK (= 128), GQA_STAGES (unused, 1),
//            GQA_TC_SMEM (optional host byte count, checked against SMEM_BYTES at compile time),
//            GQA_TRACE (gqa/common/config.cuh timing marks 0, 1, 2, 4, 5).
#include "../common/config.cuh"
#include "../common/cta.cuh"
#include "../common/tc_core.cuh"

#if GQADRV_ARCH < 100
#error "gqa_decode_tc_short needs tcgen05 (sm_100a / sm_110a)"
#endif

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, TOK = GQA_TOK;
constexpr int NTHREADS = 160;
constexpr int WARP_MMA = 4;
static_assert(GQA_WARPS * 32 == NTHREADS, "tc_short runs 5 warps (4 softmax, 1 MMA)");
static_assert(TOK == tc::TOK, "tc_short sub-tiles are 128 tokens (M of the QK MMA)");
static_assert(ROWS == 8 || ROWS == 16, "rows");
using G = TcGeom<DT, D>;
using MA = MergeArea<D, ROWS, 1>;
constexpr u32 OFF_K = 0;
constexpr u32 OFF_V = G::TILE_BYTES;
constexpr u32 OFF_Q = 2u * G::TILE_BYTES;
constexpr u32 OFF_P = OFF_Q + G::Q_BYTES;
constexpr u32 LAYOUT_END = OFF_P + G::P_BYTES;
constexpr u32 SPLIT_SCRATCH = (3u * GQA_MAX_SPLITS * 16u + 16u) * 4u;
constexpr u32 MERGE_BYTES = (u32)MA::BYTES > SPLIT_SCRATCH ? (u32)MA::BYTES : SPLIT_SCRATCH;
static_assert(MERGE_BYTES <= 2u * G::TILE_BYTES, "the merge area reuses the K/V tile");
static_assert(OFF_Q % 1024 == 0 && OFF_P % 1024 == 0, "SW128 operands need 1024-byte alignment");
constexpr u32 SMEM_BYTES = LAYOUT_END;  // SMEM_BYTES
#ifdef GQA_TC_SMEM
static_assert(SMEM_BYTES == (u32)GQA_TC_SMEM, "host tc_dynamic_smem() disagrees with the kernel smem map");
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS) gqa_decode_tc_short(const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ __align__(8) u64 s_full[2];
  __shared__ __align__(8) u64 p_full, pv_done;
  __shared__ __align__(16) float red_max[2 * 64];
  __shared__ __align__(16) float red_l[64];
  __shared__ u32 s_tmem;
  __shared__ u32 s_ticket;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 sbase = smem_u32(smem);
  auto init_barriers = [&]() {
    mbar_init(smem_u32(&s_full[0]), 1);
    mbar_init(smem_u32(&s_full[1]), 1);
    mbar_init(smem_u32(&p_full), tc::SOFTMAX_THREADS);
    mbar_init(smem_u32(&pv_done), 1);
  };
  const u32 tmem =
      tc_cta_prologue<WARP_MMA, tc::NO_WARP>(sbase, SMEM_BYTES, &s_tmem, warp, lane, init_barriers, []() {});

  GQA_MARK(args, 0);
  pdl_wait();
  GQA_MARK(args, 1);
  const CtaSchedule sc = make_schedule(args, TOK);
  GQA_MARK(args, 2);
  const int count = sc.sub_end - sc.sub_begin;  // 0 (len <= 0) or 1 for C <= 128
  const long long plane = (long long)args.capacity * D;
  const u16* kg = args.kv + (((long long)sc.b * 2) * args.hkv + sc.kvh) * plane;
  const u16* vg = args.kv + (((long long)sc.b * 2 + 1) * args.hkv + sc.kvh) * plane;
  if (count > 0) {
    const u16* qg = args.q + ((long long)sc.b * args.hkv + sc.kvh) * args.group * D;
    tc_stage_q<D>(sbase + OFF_Q, qg, args.group, tid, NTHREADS);  // published by the tile barrier
  }
  pdl_launch_dependents();

  TcSoftmax<DT, D, ROWS> sm;
  sm.init(tid);  // meaningful for warps 0-3 only
  for (int i = 0; i < count; ++i) {
    const int tok0 = (sc.sub_begin + i) * TOK;
    const int rest = sc.len - tok0;
    const int valid = rest < TOK ? rest : TOK;  // >= 1
    const int steps = G::pv_steps(valid);
    if (i > 0) mbar_wait(smem_u32(&pv_done), (u32)((i - 1) & 1));  // operands of tile i-1 released
    {
      constexpr int D8 = D / 8;
      const int rows = 16 * steps;  // rows the P.V MMA reads; rows >= valid are zero
#pragma unroll 4
      for (int it = tid; it < rows * D8; it += NTHREADS) {
        const int r = it / D8, c = it - r * D8;
        U32x4 kx = {0u, 0u, 0u, 0u}, vx = {0u, 0u, 0u, 0u};
        if (r < valid) {
          kx = ld_global_nc_v4(kg + (long long)(tok0 + r) * D + 8 * c);
          vx = ld_global_nc_v4(vg + (long long)(tok0 + r) * D + 8 * c);
        }
        const u32 off = swizzled_chunk_offset(TOK, r, c);
        st_shared_v4(sbase + OFF_K + off, kx);
        st_shared_v4(sbase + OFF_V + off, vx);
      }
    }
    fence_proxy_async_smem();  // generic smem writes -> async proxy (tcgen05.mma operands)
    __syncthreads();
    if (warp == WARP_MMA) {
      if (lane == 0) {
        tc_fence_after_thread_sync();
        G::issue_qk(tmem + tc::COL_S0 + 16u * (u32)(i & 1), sbase + OFF_K, sbase + OFF_Q);
        tc_commit(smem_u32(&s_full[i & 1]));
        mbar_wait(smem_u32(&p_full), (u32)(i & 1));
        tc_fence_after_thread_sync();
        G::issue_pv(tmem + tc::COL_O, sbase + OFF_V, sbase + OFF_P, steps, i > 0);
        tc_commit(smem_u32(&pv_done));
      }
      __syncwarp();
    } else {
      TcTileSync sy;
      sy.s_full = smem_u32(&s_full[i & 1]);
      sy.s_full_parity = (u32)((i >> 1) & 1);
      sy.s_free = 0u;  // S buffer reuse is ordered by p_full -> pv_done -> next tile barrier
      sy.pv_done = smem_u32(&pv_done);
      sy.pv_parity = (u32)((i - 1) & 1);
      sy.has_prev = i > 0;
      sy.v_full = 0u;  // V rows >= len were written as zeros by the loader
      sy.v_parity = 0u;
      sy.p_full = smem_u32(&p_full);
      sm.tile(sy, tmem, i & 1, i & 1, red_max, sbase + OFF_P, sbase + OFF_V, tok0, sc.len, args.scale_log2);
    }
  }
  if (warp < 4)
    sm.finish(tmem, count > 0, smem_u32(&pv_done), (u32)((count - 1) & 1), red_l, MA::ml(smem, 0),
              MA::os(smem, 0), args.group);

  tc_cta_epilogue<DT, D, ROWS, NTHREADS, WARP_MMA, false>(args, sc, smem, &s_ticket, tmem, warp);
}
