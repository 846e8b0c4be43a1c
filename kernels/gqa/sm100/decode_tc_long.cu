// gqadrv — GQA decode, tcgen05 long route (sm_100a B200 / sm_110a Thor): TMA ring + 5th-generation
// tensor cores with tensor memory. COMPILE-VERIFIED ONLY: no sm_100/sm_110 GPU was available, this
// kernel has never executed.
//
// CTA work   one (batch b, KV head kvh, split s) of the grid B*Hkv*S, blockIdx.x = bh*S + s
//            (make_schedule). The split owns sub-tiles [nsub*s/S, nsub*(s+1)/S) of TOK = 128 tokens,
//            nsub = ceil(len/TOK), len read on the device and clamped to [0, C]. All query heads of
//            the group are the N = 16 columns of both MMAs (operands swapped: tokens are M):
//              S^T[tok, h]  = K[tok, :] . Q[h, :]        M 128, N 16, K D   (D/16 MMAs)
//              O^T[d, h]   += V[tok, d] . P^T[tok, h]    M 128 (64 if D = 64), N 16, K 128 (8 MMAs
//                                                         per 128 head dims, fewer on the last tile)
//            Online softmax over tokens in the log2 domain with lazy rescaling of O^T in TMEM.
// Warps      192 threads, warp-specialised:
//              warps 0-3  softmax / correction / epilogue: thread t owns TMEM lane t (token t of
//                         S^T, row t of O^T); stages Q; per tile: S^T -> max (shuffles + smem) ->
//                         P^T to smem, O^T rescale when a head's reference max moves by > 8 (log2)
//              warp 4     TMEM alloc / dealloc (whole warp); lane 0 issues every tcgen05.mma and
//                         tcgen05.commit; barrier initialisation
//              warp 5     lane 0: TMA producer (K(i), V(i) alternately through the ring)
//            then all 192 threads run cta_epilogue (merge, output or split partials + ticket).
//            Prologue (barrier init, TMEM alloc, TMA warp prefetches) and tail (TMEM free,
//            epilogue): tc_cta_prologue / tc_cta_epilogue of gqa/common/tc_core.cuh.
// Tiles      TMA box {64, 128, 1, 1} of the 4-D map [2B, Hkv, C, D] (innermost first {D, C, Hkv, 2B}),
//            128B swizzle, OOB zero fill. A K or V sub-tile = D/64 boxes of 128 rows x 128 B.
// Smem map   (dynamic, 1024-byte aligned; SMEM_BYTES below, = tc_dynamic_smem on the host)
//              [0, STAGES*TILE)        ring: STAGES slots of TILE = 128*D*2 bytes; item 2i = K(i),
//                                      item 2i+1 = V(i) of the split's i-th sub-tile, slot = item % STAGES
//              [OFF_Q, +16*D*2)        Q: D/64 boxes of 16 rows x 128 B, K-major SW128, rows >= g zero
//              [OFF_P, +4096)          P^T: 2 boxes of 16 heads x 64 tokens, K-major SW128 (fp16/bf16)
//            after the last P.V the ring bytes hold the MergeArea (1 state) and then the split-merge
//            scratch of gqa/common/cta.cuh. Static smem: mbarriers, the cross-warp reduction buffers
//            (red_max [2][4][16], red_l [4][16] fp32), the TMEM base address and the split ticket.
// TMEM map   64 columns (power of two >= 32) x 128 lanes, fp32:
//              cols  0-15  S^T buffer 0   cols 16-31  S^T buffer 1      (tile i uses buffer i & 1)
//              cols 32-47  O^T head dims 0-127 (D = 64: M = 64, rows in lanes 0-15 of each quadrant)
//              cols 48-63  O^T head dims 128-255 (D = 256 only)
// Barriers   (all mbarriers; "commit" = tcgen05.commit...mbarrier::arrive::one by the MMA thread)
//              full[s]    count 1: producer arrive.expect_tx(TILE) + D/64 TMA boxes; wait parity
//                         (item / STAGES) & 1 (MMA thread; softmax threads too on the last tile)
//              empty[s]   count 1: commit after the MMA that read the item; the producer waits
//                         parity ((item / STAGES) & 1) ^ 1 before refilling (item >= STAGES), and
//                         at the end (tail) parity (item / STAGES) & 1 for the last item of each
//                         slot, so no commit arrival is in flight when the CTA exits
//              q_ready    count 128: softmax threads staged Q (+ fence.proxy.async)
//              s_full[b]  count 1: commit after QK(i) into S buffer b = i & 1; parity (i >> 1) & 1
//              s_free[b]  count 128: softmax threads read S(i) (wait::ld + fence::before); the MMA
//                         thread waits parity ((i >> 1) & 1) ^ 1 before QK(i), i >= 2
//              p_full     count 128: P^T(i) written (+ fence.proxy.async), O^T rescaled (wait::st
//                         + fence::before); MMA waits parity i & 1 before P.V(i)
//              pv_done    count 1: commit after P.V(i); softmax waits parity i & 1 before writing
//                         P^T(i+1) / touching O^T, and after the last tile before reading O^T
//            MMA issue order: QK(0), QK(1), PV(0), QK(2), PV(1), ..., PV(n-1), so QK(i+1) overlaps
//            softmax(i). Every wait has a matching arrival on every path: with no sub-tile (len <= 0,
//            or an empty split) no role waits on anything and the CTA writes zeros / an empty
//            partial; TMEM is always deallocated by warp 4 after the last __syncthreads-ordered read.
// Safety     K rows >= len: scores replaced by -inf with a select (NaN-proof); V rows >= len of the
//            last sub-tile: zeroed in smem after the TMA landed, before P.V; P.V reads only the
//            16-row k-steps that hold valid tokens; tokens >= C come from TMA zero fill; lengths are
//            clamped to [0, C] (make_schedule). tcgen05.wait::ld follows every tcgen05.ld and
//            tcgen05.wait::st every tcgen05.st; tcgen05.fence::before/after_thread_sync bracket every
//            TMEM hand-off (S, P/O correction, O read, dealloc).
// PDL        barrier init, TMEM alloc, descriptor and L2 prefetches run before griddepcontrol.wait.
// Macros     GQA_DT, GQA_D, GQA_ROWS (merge-area rows), GQA_WARPS (= 6), GQA_TOK (= 128),
//            GQA_STAGES (>= 2 ring slots of one K or V sub-tile), GQA_PREFETCH (default 1: L2
//            prefetch of the first sub-tiles before griddepcontrol.wait), GQA_TC_SMEM (optional:
//            the host's byte count, checked against SMEM_BYTES at compile time), GQA_TRACE
//            (gqa/common/config.cuh timing marks 0, 1, 2, 4, 5).
#include "../common/config.cuh"
#include "../common/cta.cuh"
#include "../common/tc_core.cuh"

#if GQADRV_ARCH < 100
#error "gqa_decode_tc_long needs tcgen05 (sm_100a / sm_110a)"
#endif
#ifndef GQA_PREFETCH
#define GQA_PREFETCH 1
#endif

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, TOK = GQA_TOK, STAGES = GQA_STAGES;
constexpr int NTHREADS = 192;
constexpr int WARP_MMA = 4, WARP_TMA = 5;
static_assert(GQA_WARPS * 32 == NTHREADS, "tc_long runs 6 warps (4 softmax, 1 MMA, 1 TMA)");
static_assert(TOK == tc::TOK, "tc_long sub-tiles are 128 tokens (M of the QK MMA)");
static_assert(STAGES >= 2, "the ring needs at least two slots (K and V of one sub-tile)");
static_assert(ROWS == 8 || ROWS == 16, "rows");
using G = TcGeom<DT, D>;
using MA = MergeArea<D, ROWS, 1>;
constexpr u32 OFF_Q = (u32)STAGES * G::TILE_BYTES;
constexpr u32 OFF_P = OFF_Q + G::Q_BYTES;
constexpr u32 LAYOUT_END = OFF_P + G::P_BYTES;
constexpr u32 SPLIT_SCRATCH = (3u * GQA_MAX_SPLITS * 16u + 16u) * 4u;
constexpr u32 MERGE_BYTES = (u32)MA::BYTES > SPLIT_SCRATCH ? (u32)MA::BYTES : SPLIT_SCRATCH;
static_assert(MERGE_BYTES <= (u32)STAGES * G::TILE_BYTES, "the merge area reuses the ring");
static_assert(OFF_Q % 1024 == 0 && OFF_P % 1024 == 0, "SW128 operands need 1024-byte alignment");
constexpr u32 SMEM_BYTES = LAYOUT_END;  // SMEM_BYTES
#ifdef GQA_TC_SMEM
static_assert(SMEM_BYTES == (u32)GQA_TC_SMEM, "host tc_dynamic_smem() disagrees with the kernel smem map");
#endif
}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    gqa_decode_tc_long(const __grid_constant__ TmaDesc kv_map, const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ __align__(8) u64 full_bar[STAGES];
  __shared__ __align__(8) u64 empty_bar[STAGES];
  __shared__ __align__(8) u64 s_full[2];
  __shared__ __align__(8) u64 s_free[2];
  __shared__ __align__(8) u64 q_ready, p_full, pv_done;
  __shared__ __align__(16) float red_max[2 * 64];
  __shared__ __align__(16) float red_l[64];
  __shared__ u32 s_tmem;
  __shared__ u32 s_ticket;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 sbase = smem_u32(smem);
  auto init_barriers = [&]() {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full_bar[s]), 1);
      mbar_init(smem_u32(&empty_bar[s]), 1);
    }
    mbar_init(smem_u32(&s_full[0]), 1);
    mbar_init(smem_u32(&s_full[1]), 1);
    mbar_init(smem_u32(&s_free[0]), tc::SOFTMAX_THREADS);
    mbar_init(smem_u32(&s_free[1]), tc::SOFTMAX_THREADS);
    mbar_init(smem_u32(&q_ready), tc::SOFTMAX_THREADS);
    mbar_init(smem_u32(&p_full), tc::SOFTMAX_THREADS);
    mbar_init(smem_u32(&pv_done), 1);
  };
  auto tma_prefetch = [&]() {  // lane 0 of the TMA warp
    tma_prefetch_desc(&kv_map);
#if GQA_PREFETCH
    {  // L2 prefetch of the first sub-tiles under the guess len == C (kernel parameters only)
      const int split = blockIdx.x % args.num_splits, bh = blockIdx.x / args.num_splits;
      const int b = bh / args.hkv, kvh = bh - b * args.hkv;
      int beg, end;
      capacity_split(args, TOK, split, beg, end);  // exact whenever len >= 3C/4 (make_schedule)
      const int n = (STAGES + 1) / 2;
      for (int i = 0; i < n && beg + i < end; ++i) {
#pragma unroll
        for (int box = 0; box < G::NB; ++box) {
          tma_prefetch_l2_4d(&kv_map, 64 * box, (beg + i) * TOK, kvh, 2 * b);
          tma_prefetch_l2_4d(&kv_map, 64 * box, (beg + i) * TOK, kvh, 2 * b + 1);
        }
      }
    }
#endif
  };
  const u32 tmem =
      tc_cta_prologue<WARP_MMA, WARP_TMA>(sbase, SMEM_BYTES, &s_tmem, warp, lane, init_barriers, tma_prefetch);

  GQA_MARK(args, 0);
  pdl_wait();
  GQA_MARK(args, 1);
  const CtaSchedule sc = make_schedule(args, TOK);
  GQA_MARK(args, 2);
  const int count = sc.sub_end - sc.sub_begin;  // sub-tiles of this split, >= 0
  pdl_launch_dependents();

  if (warp < 4) {
    // ------------------------------------------------ softmax / correction / epilogue warps
    if (count > 0) {
      const u16* qg = args.q + ((long long)sc.b * args.hkv + sc.kvh) * args.group * D;
      tc_stage_q<D>(sbase + OFF_Q, qg, args.group, tid, tc::SOFTMAX_THREADS);
      fence_proxy_async_smem();
      mbar_arrive(smem_u32(&q_ready));
    }
    TcSoftmax<DT, D, ROWS> sm;
    sm.init(tid);
    for (int i = 0; i < count; ++i) {
      const int item_v = 2 * i + 1;
      TcTileSync sy;
      sy.s_full = smem_u32(&s_full[i & 1]);
      sy.s_full_parity = (u32)((i >> 1) & 1);
      sy.s_free = smem_u32(&s_free[i & 1]);
      sy.pv_done = smem_u32(&pv_done);
      sy.pv_parity = (u32)((i - 1) & 1);
      sy.has_prev = i > 0;
      sy.v_full = smem_u32(&full_bar[item_v % STAGES]);
      sy.v_parity = (u32)((item_v / STAGES) & 1);
      sy.p_full = smem_u32(&p_full);
      sm.tile(sy, tmem, i & 1, i & 1, red_max, sbase + OFF_P, sbase + (u32)(item_v % STAGES) * G::TILE_BYTES,
              (sc.sub_begin + i) * TOK, sc.len, args.scale_log2);
    }
    // The merge area overlays the ring: finish() writes it only after the last P.V completed.
    sm.finish(tmem, count > 0, smem_u32(&pv_done), (u32)((count - 1) & 1), red_l, MA::ml(smem, 0),
              MA::os(smem, 0), args.group);
  } else if (warp == WARP_MMA) {
    // ------------------------------------------------ MMA issuer (one thread)
    if (lane == 0 && count > 0) {
      mbar_wait(smem_u32(&q_ready), 0);
      for (int i = 0; i <= count; ++i) {
        if (i < count) {  // QK(i)
          const int item = 2 * i, slot = item % STAGES;
          if (i >= 2) mbar_wait(smem_u32(&s_free[i & 1]), (u32)(((i >> 1) & 1) ^ 1));
          mbar_wait(smem_u32(&full_bar[slot]), (u32)((item / STAGES) & 1));
          tc_fence_after_thread_sync();
          G::issue_qk(tmem + tc::COL_S0 + 16u * (u32)(i & 1), sbase + (u32)slot * G::TILE_BYTES, sbase + OFF_Q);
          tc_commit(smem_u32(&empty_bar[slot]));
          tc_commit(smem_u32(&s_full[i & 1]));
        }
        if (i >= 1) {  // PV(i-1)
          const int j = i - 1, item = 2 * j + 1, slot = item % STAGES;
          mbar_wait(smem_u32(&full_bar[slot]), (u32)((item / STAGES) & 1));
          mbar_wait(smem_u32(&p_full), (u32)(j & 1));
          tc_fence_after_thread_sync();
          const int rest = sc.len - (sc.sub_begin + j) * TOK;
          G::issue_pv(tmem + tc::COL_O, sbase + (u32)slot * G::TILE_BYTES, sbase + OFF_P,
                      G::pv_steps(rest < TOK ? rest : TOK), j > 0);
          tc_commit(smem_u32(&empty_bar[slot]));
          tc_commit(smem_u32(&pv_done));
        }
      }
    }
    __syncwarp();
  } else {
    // ------------------------------------------------ TMA producer (one thread)
    if (lane == 0 && count > 0) {
      for (int item = 0; item < 2 * count; ++item) {
        const int slot = item % STAGES;
        if (item >= STAGES) mbar_wait(smem_u32(&empty_bar[slot]), (u32)(((item / STAGES) & 1) ^ 1));
        const u32 bar = smem_u32(&full_bar[slot]);
        const u32 dst = sbase + (u32)slot * G::TILE_BYTES;
        const int tok0 = (sc.sub_begin + (item >> 1)) * TOK;
        const int plane = 2 * sc.b + (item & 1);  // K plane 2b, V plane 2b+1
        mbar_arrive_expect_tx(bar, G::TILE_BYTES);
#pragma unroll
        for (int box = 0; box < G::NB; ++box)
          tma_load_4d(dst + (u32)box * G::BOX_BYTES, &kv_map, bar, 64 * box, tok0, sc.kvh, plane);
      }
      // Tail: wait until the MMA released the last item of every slot, so that no tcgen05.commit
      // arrival on an empty barrier is still in flight when the CTA leaves.
      const int first_tail = 2 * count > STAGES ? 2 * count - STAGES : 0;
      for (int item = first_tail; item < 2 * count; ++item)
        mbar_wait(smem_u32(&empty_bar[item % STAGES]), (u32)((item / STAGES) & 1));
    }
    __syncwarp();
  }

  tc_cta_epilogue<DT, D, ROWS, NTHREADS, WARP_MMA>(args, sc, smem, &s_ticket, tmem, warp);
}
