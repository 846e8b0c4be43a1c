// gqadrv — GQA decode, short route (capacity <= W*TOK, 64 by default): latency-first, no ring.
// Built for sm_80 and newer ("smxx": sm_80, sm_90a, sm_100a, sm_110a; it is also the short route of
// the portable and tcgen05-family paths). Entry point gqa_decode_short(GqaArgs).
//
// CTA work   one (batch b, KV head kvh); grid B*Hkv, num_splits is always 1: the normalised output
//            of the group's query heads over the whole request (one softmax state per warp,
//            merged by the CTA). A request of <= TOK keys (the clamped length; CTA-uniform) is all
//            warp 0's: warp 0 normalises and stores the output itself and the CTA merge is skipped
//            (measured 2026-12-07, H100, B1 C64 L 1: 1.87 us hot against 2.13 with the merge).
// Warps      GQA_WARPS warps; warp w owns tokens [w*TOK, (w+1)*TOK) of the request. Right after
//            griddepcontrol.wait every thread loads the length and issues its share of the Q copy; once
//            the length is in, its warp's K and V rows, all cp.async (no register result, so nothing
//            stalls until the single wait) into the warp's slot in the 128B-swizzled layout of the
//            pipelined routes. Rows >= len (the clamped length, <= C) are zero-filled without reading
//            memory, so a request of length 1 moves one row per plane, and padding (NaN included) never
//            reaches shared memory; the step masks them too (scores -inf, V rows zeroed). Then one
//            WarpDecoder step from shared memory, the same code as the pipelined routes. (Loading K, V
//            and Q into registers instead, ptxas issued half of the V loads only after the Q operand
//            moves and the first QK MMAs: two round trips. Copies bounded by C instead of len, issued
//            with the length load in one round trip, were slower on the H200 at every length, 2026-12-07:
//            docs/GQA.md.)
// Tiles      one sub-tile of TOK tokens per warp (GQA_TOK, 16 by default: W*TOK >= C); mma.sync
//            m16n8k16 with ROWS = 8 or 16 query rows (WarpDecoder, gqa/common/warp.cuh).
// Smem map   [0, W*SLOT) the warps' slots (SLOT = K then V, D/64 boxes of TOK rows x 128 B,
//            1024-byte aligned); afterwards the same bytes hold the per-warp states (MergeArea:
//            W x ROWS x {m,l} and W x ROWS x (D+8) fp32, see StateLayout), merged by all threads into
//            the fp16/bf16 output. s_q[ROWS][D] (padding rows zero) is static shared memory.
// Barriers   cp.async.wait_group 0 + __syncthreads before the step (Q is copied by the whole CTA),
//            __syncthreads before store_state (the slots become the merge area) and before the
//            merge (cta_finish_and_epilogue, gqa/common/cta.cuh); no mbarriers. The solo path
//            (len <= TOK) has no barrier after the step: the other warps return.
// Start      before griddepcontrol.wait: the CTA's (batch, KV head) and every source address (arithmetic
//            on blockIdx and the arguments only, held there by L2 prefetches of the length, q and the
//            warp's first K / V rows), then griddepcontrol.launch_dependents, so the next PDL grid
//            launches while this one still waits (it waits in turn for this grid's completion). After
//            the wait only the length load and the copies remain. Measured 2026-12-07 (H100, B1 C64):
//            2.24 us hot against 2.55 with the addresses after the wait and the trigger after the step.
#include "../common/config.cuh"
#include "../common/cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK;
constexpr u32 SLOT_BYTES = 2u * D * TOK * 2u;
}

extern "C" __global__ void __launch_bounds__(W * 32, 1) gqa_decode_short(const GqaArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ u32 s_ticket;
  __shared__ __align__(16) u16 s_q[ROWS * D];  // this CTA's query rows, padding rows zero
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  GQA_MARK(args, 0);
  // The (batch, KV head) and every source address before griddepcontrol.wait (arithmetic on blockIdx and
  // the arguments only): after it, the length load and the copies issue without address arithmetic.
  const int b = (int)blockIdx.x / args.hkv, kvh = (int)blockIdx.x - b * args.hkv;  // num_splits == 1
  const u16* q_rows = args.q + ((long long)b * args.hkv + kvh) * args.group * D;
  const long long plane = (long long)args.capacity * D;
  const u16* k_plane = args.kv + (((long long)b * 2) * args.hkv + kvh) * plane;
  const u16* v_plane = args.kv + (((long long)b * 2 + 1) * args.hkv + kvh) * plane;
  const int tok0 = warp * TOK;
  u8* slot = smem + (size_t)warp * SLOT_BYTES;
  const int* len_ptr = args.lengths + b;
  // L2 prefetches of the length and of the warp's first K / V rows consume the addresses before the wait
  // (an L2 prefetch reads no stale data: L2 is where the previous grid's writes land), so neither NVVM nor
  // ptxas moves their arithmetic below it
  if (lane == 0) {
    prefetch_l2(len_ptr);
    prefetch_l2(q_rows);
    if (tok0 < args.capacity) {  // only rows of the request's planes
      prefetch_l2(k_plane + (long long)tok0 * D);
      prefetch_l2(v_plane + (long long)tok0 * D);
    }
  }
  pdl_launch_dependents();  // the next grid may launch now; it waits for this grid's completion
  pdl_wait();
  GQA_MARK(args, 1);
  const int raw_len = *len_ptr;
  stage_q_cp_async<ROWS, D, W * 32>(s_q, q_rows, args.group);
  // K / V rows >= len are zero-filled without reading memory (copy_tile_cp_async's bound), so a short request
  // moves only its valid rows; the copies wait for the length (the schedule's clamped length is the bound)
  const CtaSchedule sc = make_schedule(args, TOK, raw_len);
  copy_tile_cp_async<TOK, D>(smem_u32(slot), k_plane, v_plane, tok0, sc.len, lane);
  cp_async_commit();
  GQA_MARK(args, 2);
  WarpDecoder<DT, D, ROWS, TOK> dec;
  dec.init(lane);
  cp_async_wait<0>();
  __syncthreads();  // Q and every slot have landed
  {
    const int g = lane >> 2;
    dec.load_q(s_q + g * D, ROWS == 16 ? s_q + (g + 8) * D : nullptr);
  }
  if (sc.len <= TOK) {  // CTA-uniform: every key is warp 0's, so no merge: warp 0 writes the output
    if (warp == 0) {
      dec.step(SwizzledSmemChunks{slot}, 0, sc.len, args.scale_log2);
      dec.finish();
      dec.store_output(args.out + ((long long)b * args.hkv + kvh) * args.group * D, args.group);
      write_request_status(args, sc);  // (thread 0 is warp 0's lane 0)
    }
    return;
  }
  if (tok0 < args.capacity) dec.step(SwizzledSmemChunks{slot}, tok0, sc.len, args.scale_log2);
  cta_finish_and_epilogue<W, false>(dec, args, sc, smem, &s_ticket, warp);  // never split
}
