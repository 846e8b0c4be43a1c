// gqadrv — GQA decode from paged (or contiguous) KV caches with multi-token queries, LSE output and
// a batch-invariant split mode. cp.async route for sm_80 and newer (built for sm_80, sm_90a,
// sm_100a, sm_110a). Entry point gqa_decode_paged(GqaPagedArgs) (kernels/gqa/common/paged_args.cuh:
// cache addressing, row order, schedule).
//
// CTA work   one (batch b, KV head kvh, row block rb, split s) of the grid B*Hkv*RB*S
//            (blockIdx.x = ((b*Hkv + kvh)*RB + rb)*S + s): ROWS query rows (query token j, head h
//            of the group: row j*group + h) against the split's sub-tiles of TOK tokens, read once
//            for all of them. Output rows (+ LSE) for one split, else fp32 partials and the ticket.
//            Lengths are read on the device only and clamped to [0, capacity].
// Warps      GQA_WARPS identical warps; warp w takes sub-tiles begin+w, begin+w+W, ... and fills
//            its own ring with cp.async (16 B per lane per copy). Before a copy, lane L holds the
//            element offset of row L % TOK of the sub-tile (page id from the block table, loaded
//            one ring step ahead so its latency hides behind the math): when the sub-tile lies in
//            one page (page >= TOK, or a contiguous cache) every row is row 0 + r * tok_stride,
//            otherwise each copy takes its row's offset from lane r by shuffle. Rows >= len and
//            rows on a page id outside [0, num_pages) are zero-filled without reading memory
//            (the latter is reported in the status words).
// Tiles      sub-tiles of TOK (16 or 32) tokens x D in the 128B-swizzled slot layout of the other
//            routes, GQA_STAGES slots per warp; WarpDecoder<..., CAUSAL = true> (gqa/common/warp.cuh)
//            with mma.sync m16n8k16; each lane's two rows carry their causal shift s_q - 1 - j.
//            GQA_KV8 = 1: e4m3 caches, one byte per element, the FP8 slot layout (kv8_chunk_offset)
//            and WarpDecoder<..., KV8 = true> (dequantization in registers, scales folded).
// Smem map   [0, W*STAGES*SLOT) rings (slot = K then V, D/64 boxes of TOK x 128 B; e4m3: max(1, D/128)), reused after
//            the loop as the MergeArea of the W warp states and then the split-merge scratch.
// Barriers   cp.async groups: one commit per ring step (empty groups keep the count uniform),
//            wait_group<STAGES-1> + __syncwarp before reading a slot, __syncwarp before refilling
//            it; __syncthreads before the warp states are stored (the rings become the merge area)
//            and before the merge; split ticket: cta_epilogue_rows in gqa/common/cta.cuh.
#include "../common/config.cuh"
#include "../common/paged_cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK,
              STAGES = GQA_STAGES;
constexpr bool KV8 = GQA_KV8 != 0;
using Decoder = PagedDecoder<DT, D, ROWS, TOK, KV8>;
template <bool B> struct KvElem { using T = u16; };
template <> struct KvElem<true> { using T = u8; };
using KvT = KvElem<KV8>::T;          // one cache element: fp16 / bf16 bits or an e4m3 code
constexpr int EPC = 16 / sizeof(KvT);  // elements per 16-byte chunk
constexpr u32 SLOT_BYTES = 2u * Decoder::KV_BYTES;
constexpr int LOG2_TOK = TOK == 16 ? 4 : 5;
static_assert(TOK == 16 || TOK == 32, "one row per lane of the offset shuffle");

// Slot byte offset of 16-byte chunk c of K row r (V: + Decoder::KV_BYTES)
GQADRV_DEVICE u32 slot_chunk(int r, int c) {
  if constexpr (KV8)
    return kv8_chunk_offset<D>(TOK, r, c);
  else
    return swizzled_chunk_offset(TOK, r, c);
}
}  // namespace

// Fill a ring slot with rows [tok0, tok0 + TOK) of one KV head. `my_off` is this lane's offset of
// row lane % TOK (-1: zero-fill); `one_page`: every row is on the page of row 0.
//
// GQA_PAGED_HOISTED_COPY = 1 (the default since 2026-12-06; GQADRV_PAGED_COPY=plain builds the per-chunk
// form for A/B): the one-page test is taken once per sub-tile instead of once per chunk, and a lane's
// chunk column c = lane % CPR is the same for every copy, so the one-page path walks one pointer per lane
// by a constant row step (about half the integer instructions per chunk of the per-chunk form, whose
// per-chunk branch ptxas does not hoist out of the unrolled loop). H100: 0.6-0.9 % faster at B 64 / 128
// (docs/RESULTS.md, 2026-12-06), outputs bit-identical.
// D = 256 keeps the per-chunk form (the hoisted one spills on sm_100a there).
#ifndef GQA_PAGED_HOISTED_COPY
#define GQA_PAGED_HOISTED_COPY 1
#endif
#if GQA_D == 256
#undef GQA_PAGED_HOISTED_COPY
#define GQA_PAGED_HOISTED_COPY 0
#endif
GQADRV_DEVICE void copy_tile_paged(u32 slot, const KvT* kbase, const KvT* vbase, long long my_off, bool one_page,
                                   int tok0, int len, long long tok_stride, int lane) {
  constexpr int CPR = D / EPC, CHUNKS = TOK * CPR;  // 16-byte chunks per row / per K tile
  constexpr u32 VOFF = Decoder::KV_BYTES;
#if GQA_PAGED_HOISTED_COPY
  static_assert(CPR <= 32 && 32 % CPR == 0, "a lane keeps one chunk column");
  constexpr int RPK = 32 / CPR;  // rows per copy instruction of the warp
  const int c = lane % CPR, r0 = lane / CPR;
  if (one_page) {
    const long long off0 = __shfl_sync(0xffffffffu, my_off, 0);
    const bool page_ok = off0 >= 0;
    const long long first = page_ok ? off0 + r0 * tok_stride + EPC * c : 0;
    const long long step = RPK * tok_stride;
#pragma unroll
    for (int k = 0; k < CHUNKS / 32; ++k) {
      const int r = r0 + RPK * k;
      const bool ok = page_ok && tok0 + r < len;
      const long long off = ok ? first + k * step : 0;
      const u32 dst = slot + slot_chunk(r, c);
      cp_async_16(dst, kbase + off, ok ? 16u : 0u);
      cp_async_16(dst + VOFF, vbase + off, ok ? 16u : 0u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < CHUNKS / 32; ++k) {
      const int r = r0 + RPK * k;
      const long long row = __shfl_sync(0xffffffffu, my_off, r);
      const bool ok = row >= 0;
      const long long off = ok ? row + EPC * c : 0;
      const u32 dst = slot + slot_chunk(r, c);
      cp_async_16(dst, kbase + off, ok ? 16u : 0u);
      cp_async_16(dst + VOFF, vbase + off, ok ? 16u : 0u);
    }
  }
#else
  const long long off0 = __shfl_sync(0xffffffffu, my_off, 0);
#pragma unroll
  for (int k = 0; k < CHUNKS / 32; ++k) {
    const int idx = lane + 32 * k;
    const int r = idx / CPR, c = idx - r * CPR;
    long long off;
    bool ok;
    if (one_page) {
      off = off0 + r * tok_stride;
      ok = off0 >= 0 && tok0 + r < len;
    } else {
      off = __shfl_sync(0xffffffffu, my_off, r);
      ok = off >= 0;
    }
    off = ok ? off + EPC * c : 0;
    const u32 dst = slot + slot_chunk(r, c);
    cp_async_16(dst, kbase + off, ok ? 16u : 0u);
    cp_async_16(dst + VOFF, vbase + off, ok ? 16u : 0u);
  }
#endif
}

#if GQA_D == 256
#define GQA_PAGED_BOUNDS __launch_bounds__(W * 32)
#else
#define GQA_PAGED_BOUNDS __launch_bounds__(W * 32, 1)
#endif

extern "C" __global__ void GQA_PAGED_BOUNDS gqa_decode_paged(const GqaPagedArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ u32 s_ticket;
  __shared__ u32 s_bad[W];  // per warp: a page id outside [0, num_pages) was met
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  pdl_wait();
  if (warp == 0) paged_prefetch<ROWS, D>(args, lane);  // q rows and the table row: overlap the length's load
  const PagedSchedule sc = paged_schedule(args, TOK);
#if GQA_PAGED_DET_EXIT
  if (paged_idle_split(args, sc)) return;  // a batch-invariant split past the request's tokens
#endif
  const int first = sc.sub_begin + warp;
  const int count = first < sc.sub_end ? (sc.sub_end - first + W - 1) / W : 0;
  u8* ring = smem + (size_t)warp * STAGES * SLOT_BYTES;
  const KvT* kbase = reinterpret_cast<const KvT*>(args.k) + (long long)sc.kvh * args.head_stride;
  const KvT* vbase = reinterpret_cast<const KvT*>(args.v) + (long long)sc.kvh * args.head_stride;
  const bool paged = args.table != nullptr;
  const bool one_page = !paged || args.page_shift >= LOG2_TOK;  // warp-uniform
  const int* trow = paged ? args.table + (long long)sc.b * args.table_stride : nullptr;
  const int in_page = paged ? (1 << args.page_shift) - 1 : 0x7fffffff;
  bool bad = false;

  // Page id of this lane's row (lane % TOK) of sub-tile `sub`: -1 past len (no table read); the
  // load's result is consumed one ring step later.
  auto fetch = [&](int i) -> int {
    const int t = (first + i * W) * TOK + (lane & (TOK - 1));
    if (i >= count || t >= sc.len) return -1;
    return paged ? __ldg(trow + (t >> args.page_shift)) : sc.b;
  };
  auto issue = [&](int i, int pg) {
    const int tok0 = (first + i * W) * TOK;
    const int t = tok0 + (lane & (TOK - 1));
    long long off = -1;
    if (t < sc.len) {
      if ((unsigned)pg < (unsigned)args.num_pages)
        off = (long long)pg * args.page_stride + (long long)(t & in_page) * args.tok_stride;
      else
        bad = true;
    }
    copy_tile_paged(smem_u32(ring + (size_t)(i % STAGES) * SLOT_BYTES), kbase, vbase, off, one_page, tok0, sc.len,
                    args.tok_stride, lane);
  };

  int pg[STAGES];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) pg[s] = fetch(s);
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    if (s < count) issue(s, pg[s]);
    cp_async_commit();
  }

  Decoder dec;
  dec.init(lane);
  paged_load_q(dec, args, sc, lane);
  pdl_launch_dependents();

  for (int i = 0; i < count; ++i) {
    const int nxt = fetch(i + STAGES);  // in flight during this step
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    SwizzledSmemChunks src{ring + (size_t)(i % STAGES) * SLOT_BYTES};
    dec.step(src, (first + i * W) * TOK, sc.len, args.scale_log2);
    __syncwarp();
    if (i + STAGES < count) issue(i + STAGES, nxt);
    cp_async_commit();
  }
  cp_async_wait<0>();  // no copy in flight when the rings become the merge area
  paged_cta_tail<W>(dec, args, sc, smem, &s_ticket, s_bad, bad, warp, lane);
}
