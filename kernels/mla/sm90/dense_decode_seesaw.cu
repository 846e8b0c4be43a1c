// gqadrv — MLA dense decode, "seesaw" schedule (sm_90a, wgmma). Same semantics and arguments as
// dense_decode.cu (which stays as the simple fallback), its split grid and last-CTA merge, or the
// balanced persistent grid (MLA_BALANCED); this kernel
// is built for the compute-bound regime (M = s_q * h_q / h_kv >= 32 packed rows per KV head).
//
// CTA work  64 packed rows (zero-filled past M) against the 64-token tiles of its work items
//           (kernels/mla/common/work_items.cuh): split grid (nmb * S, h_kv, b), blockIdx.x = mb + nmb *
//           split, one item = one whole-pair split of ceil(key_len / 64) tiles, key_len = the largest
//           key limit of the block's valid rows (len, or len - (s_q - 1 - s_last) when causal); or, with
//           MLA_BALANCED=1 (TMA entry mla_dense_decode_seesaw_tma: route seesaw_bal; cp.async entry
//           mla_dense_decode_seesaw: routes seesaw_bal_cp / seesaw_nope_bal), the balanced
//           persistent grid (P, h_kv, nmb): the CTA walks its share of all requests' pairs, item by
//           item (whole requests, or the end / start of a request shared with the neighbouring CTA;
//           with MLA_FLAG_NO_CUT, the sparse paths' lists, whole requests only).
//           Tiles go in pairs (T0 = even, T1 = odd tile of a pair). A pair's odd tile may lie past the
//           item's token end tok_end: its rows are zero-filled and masked. Per item: Q load, pairs,
//           epilogue (out / lse, or the fp32 partial and a ticket when the request is shared); the
//           K barriers' phases run on over the CTA's pairs (parity of the CTA's pair count), Q's over
//           its items, so the producer fills the next item's first pair while the consumers finish
//           the previous one.
// Warps     384 threads: warpgroups WG0 (warps 0..3) and WG1 (4..7) compute, WG2 (warps 8..11) is the
//           producer (all cp.async copies: Q once, then the K blocks of every pair in the order they
//           die, so the consumer warps never have copies in flight when they execute a proxy fence).
//           setmaxnreg: producer down to 56 registers, consumers up to 224 (launch bound 384 -> 168).
//           WG0 owns output columns [0, 256) (O_L, 128 fp32 per thread) and computes S0 = Q K0^T;
//           WG1 owns [256, 512) (O_R) and computes S1 = Q K1^T (m64n64k16 x 36 each, SS).
//           The running row max m lives in shared memory (sM) and is updated twice per pair:
//             WG0: m0 = max(m, rowmax S0), a0 = 2^(m - m0)   O_L *= a0, P0 = 2^(S0 - m0)
//                  O_L += P0 V0[:, 0:256]          (RS: P0 from registers)
//             WG1: m1 = max(m0, rowmax S1), a1 = 2^(m0 - m1) O_R *= a0 a1, P1 = 2^(S1 - m1)
//                  O_R += P1 V1[:, 256:512]        (RS)
//                  O_R += (P0 a1) V0[:, 256:512]   (SS: WG0 writes P0 a1 to sP0)
//             WG0: O_L *= a1; O_L += P1 V1[:, 0:256]     (SS: WG1 writes P1 to sP1)
//           so both halves end every pair relative to m1, and the row sums l (per warpgroup, over its
//           own S tiles) are merged at the end: L = l_WG0 + l_WG1.
//           Lazy running max (MLA_LAZY_LOG2 = 8): m0 / m1 move only when a tile's row max exceeds the
//           running max by more than 8 (log2 units; P <= 2^8), so most pairs have a0 = a1 = 1; a warp
//           whose factors are all 1 skips its O rescale and the wgmma wait in front of it, and WG0 then
//           stores P0 to sP0 from the registers P0 V0L is still reading (reads only) instead of
//           repacking P0 a1 after that product retired. Launches with MLA_FLAG_MAX_LOGITS (the sparse
//           prefill's max_logits) keep the lazy max too and fold every tile's row max into an exact one
//           beside it (x_lo / x_hi per warpgroup; WG1's to WG0 through sXM in the epilogue), which
//           they report; only their split items (the merge reads {m, l}) run the exact running max.
//           Within a warpgroup warp wi owns rows 16wi .. 16wi+15; lane 4g + t holds rows 16wi + g and
//           16wi + g + 8 (wgmma C layout), the same rows in both warpgroups.
// Smem map  (dynamic, base rounded up to 1024 B; all blocks 1024-aligned)
//           [0, 72K)      Q   64 rows x 576: 9 channel blocks (cb) of 64 rows x 128 B, 128B swizzle
//           [72K, 144K)   K0  slot of the even tile, same layout; its cb 8 (RoPE, read only by
//                             Q K0^T) doubles as sP0 once S0 is computed
//           [144K, 216K)  K1  slot of the odd tile
//           [216K, 224K)  sP1 64 x 64 (K-major, swizzled; A of WG0's SS P V)
//           + sM[64], sScale0[64], sScale1[64], lsum[2][64] (fp32), 24 mbarriers (full[2][9],
//           empty[2][2], q, q_empty), ticket, the balanced schedule's scan / start (20 ints) and
//           won merges (2 x 3 ints), sXM[64] (fp32: WG1's exact row maxima of an item, read by WG0)
//           merge: the K slots hold the [64][S] merge weights after the main loop.
// Loads     producer warpgroup, cp.async 16 B with zero-fill (src-size 0) for token rows >= tok_end (no
//           global read, no block-table read); each warp instruction copies 4 rows x 128 B of one cb.
//           MLA_BT_AHEAD=1 (balanced builds): each thread reads the block-table entries of its 8 rows of a pair
//           one pair ahead (those of an item's first pair before its q_empty wait and Q copies), so the
//           copies never wait for the entries (the sparse paths' gathered lists: one entry per token).
//           Per pair it fills, each after the matching `empty` barrier (one arrival per consumer warp):
//             K0 cb 0..3  freed by WG0 after O_L += P0 V0L       (empty[0][0])
//             K1 cb 4..8  freed by WG1 after O_R += P1 V1R       (empty[1][1])
//             K0 cb 4..8  freed by WG1 after O_R += sP0 V0R      (empty[0][1])
//             K1 cb 0..3  freed by WG0 after O_L += sP1 V1L      (empty[1][0])
//           and completes each block on full[slot][cb] with cp.async.mbarrier.arrive.noinc (count 128);
//           Readers wait on the full barrier of every block they read (parity = pair index & 1), then
//           fence.proxy.async (cp.async writes are generic-proxy; wgmma reads are async-proxy).
// d_qk 512 (MLA_NOPE=1, sparse prefill without RoPE channels; cp.async path only): q and K rows hold
//           512 channels; channel block 8 is neither loaded nor multiplied (NCB_QK = 8: Q K^T over
//           blocks 0..7; its full barriers are never armed or waited on; sP0 still aliases K0's block 8).
//           MLA_NOPE_SKIP=0 (experiment seesaw_nope_bal_nb9) zero-fills block 8 and multiplies it.
// L2 hints  (cp.async producers, MLA_KV_HINT=1) every K and Q copy carries an L2 cache policy and the
//           256-byte L2 prefetch (cp_async_16_l2): with MLA_FLAG_KV_REUSE (the sparse prefill, whose
//           query tokens read the same kv rows) K evict_last and Q evict_first, else evict_normal.
// Sink      with MLA_FLAG_SINK (the sparse paths, items without splits only; the host decides) out =
//           O / (L + 2^(sink[head] log2 e - m)) in store_out_rows (decode_util.cuh sink_term), i.e.
//           FlashMLA's attention-sink factor 1 / (1 + exp(sink - lse)) without a pass over out.
// Q / items q (count: the Q loaders) completes once per item with pairs; q_empty (count 8, one
//           arrival per consumer warp once the item's last Q K^T retired) lets the Q loaders write the
//           next item's Q (cp.async balanced builds: the whole producer warpgroup, before the item's
//           first K copies, which wait for the previous item's releases anyway). With MLA_BALANCED the
//           consumers release every K half after its last reader, also after an item's last pair (the
//           next item refills it); the split grid keeps
//           releases to pairs with a successor. Merges won on shared requests run after the CTA's
//           last item (no load in flight then; the merge weights use the K slots).
// TMA mode (MLA_TMA_K=1, entry mla_dense_decode_seesaw_tma, parameters (k_lo, k_hi, args): two
//           CUtensorMaps of k_cache as 5-D (64 channels, page tokens, 9 channel blocks, h_kv,
//           num_blocks) with strides (token, 128 B, head, page) and boxes (64, 64, 4 | 5, 1, 1), 128B
//           swizzle, so that one TMA writes channel blocks 0..3 (k_lo) or 4..8 (k_hi, block
//           coordinate 4) of a 64-token tile in exactly the smem layout above; pages of 64..256
//           tokens): producer warps 1..3 load Q with cp.async (then cp.async.wait_all +
//           fence.proxy.async before arriving on bar_q, so the consumers need no proxy fence; q_bar
//           count 96), warp 0's lanes 1..31 exit, and its lane 0 issues the four K loads of a pair
//           from the start (not after Q), in
//           the same order and after the same `empty` waits as above, each completing on the
//           barrier of its half (full[slot][0] for cb 0..3, full[slot][4] for cb 4..8: count 1,
//           expect_tx 32 / 40 KB; readers of any cb wait on its half's barrier). It reads the
//           block-table entries of the next pair one pair ahead. A tile that starts at or after
//           tok_end uses page coordinate -1 (out of bounds: zero-filled, no global read, no
//           block-table read); bad block-table entries (negative, >= num_blocks) are out of bounds
//           too. Rows >= tok_end of a partially valid tile come from a real page and may hold
//           anything (NaN), so before their P V products the consumers zero those rows of the V
//           blocks they read (WG0: cb 0..3 of both slots, WG1: cb 4..7), fence.proxy.async, and sync
//           their warpgroup (named barriers 6 / 7, 128 threads); this happens only in a split's last
//           pair. No fence.proxy.async after the full waits (TMA writes are async-proxy).
// FP8 mode (MLA_FP8=1, entry mla_dense_decode_seesaw_fp8, bf16 q; k_cache = FlashMLA's 656-byte rows:
//           512 e4m3 codes, 4 fp32 scales, 64 bf16 RoPE; kernels/mla/common/fp8_rows.cuh): the consumers
//           are unchanged and read the same bf16 tiles. The producer warpgroup (setmaxnreg 72, consumers
//           216) fills a half tile in two steps: after its `empty` wait, cp.async of the raw codes into
//           the half's own blocks 2-3 (cb 0..3) or 6-7 (cb 4..8), 16-byte units swizzled, and of the
//           RoPE straight into cb 8 (one commit group per half; rows >= tok_end zero-filled, their
//           scales read as 0); then, once the group landed (cp.async.wait_group + __syncwarp: a row's
//           two halves come from two lanes), it dequantizes in place: cb C0, C0 + 1 from raw bytes
//           0..127, a producer-warpgroup named barrier (id 8, 128 threads: all raw units read), then
//           cb C0 + 2, C0 + 3 from bytes 128..255; one plain arrival per thread and block on the full
//           barriers (128), the RoPE block's after the group's wait. The consumers' fence.proxy.async
//           after their full waits covers these generic writes, as for cp.async data. Order per pair:
//           issue K0 lo, issue K1 hi, convert K0 lo, issue K0 hi, convert K1 hi, issue K1 lo (after
//           WG0 read K0 lo), convert K0 hi, convert K1 lo: no wait depends on a later conversion.
// Barriers  named (256 consumer threads; P0 / P1: one side arrives, the other syncs), per pair:
//           1 SCALE0  WG0 -> WG1: sM = m0 and sScale0 = a0 written
//           2 SCALE1  WG1 -> WG0: sM = m1 and sScale1 = a1 written
//           3 P0      WG0 -> WG1: sP0 written (+ proxy fence)
//           4 P1      WG1 -> WG0: sP1 written (+ proxy fence) and WG1's SS P V issued
//           5 EPI     epilogue (all 256 consumer threads; the producer warpgroup has exited)
//           SCALE0 and SCALE1 are full syncs on both sides (MLA_SYNC_HANDOFF=2, the default): the
//           writer's bar.arrive (release) before the reader's bar.sync (acquire) is ordered by the PTX
//           memory model, but compute-sanitizer racecheck reports it as a race (tools/racecheck_handoff.py
//           shows it on a 20-line kernel); with both sides syncing it reports none, at no measured cost
//           (docs/MLA.md). MLA_SYNC_HANDOFF=0 (experiment seesaw_bal_arrive) keeps both writers arriving.
//           A release (empty barrier) is issued only when the next pair exists, so the k-th fill of a
//           block waits for exactly k completions (parity (k & 1) ^ 1).
// Masking   logits of keys >= the row's limit are set to -inf (unscaled; tile64_ops.cuh mask_row_max);
//           the running max starts at M_INIT = -1e30 and only ever grows, so it stays finite and
//           2^(-inf sc - m) = 0 (no NaN); only tiles that reach past the CTA's smallest limit are masked.
// Split     as dense_decode.cu: S == 1 writes out / lse; S > 1 writes the fp32 partial and {m, l},
//           takes an acq_rel ticket, and the last CTA merges (then resets the counter to 0). Balanced
//           builds (MLA_PARTIAL_L2=1): partial stores with an L2 evict_last policy, the merged partials'
//           lines discarded from L2 (decode_util.cuh store_partial*, merge_partials_from).
// Trace     MLA_TRACE=1 builds only (development, tools/mla_trace.py): MLA_MARK %globaltimer stamps by
//           consumer thread 0 and the TMA thread (slots 13 / 14; in the cp.async builds item 0's epilogue
//           after the row sums / before the out stores), and the CTA's SM (%smid, MLA_MARK_SM) in slot 15
//           (decode_util.cuh); compiled out otherwise.
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "../common/work_items.cuh"
#include "tile64_ops.cuh"
#if MLA_FP8
#include "../common/fp8_rows.cuh"
#endif

namespace mla {
namespace seesaw {
constexpr u32 TILE = NCB * CB;            // 73728
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_K0 = TILE;
constexpr u32 OFF_K1 = 2 * TILE;
constexpr u32 OFF_P0 = OFF_K0 + 8 * CB;   // aliases K0's cb 8
constexpr u32 OFF_P1 = 3 * TILE;
constexpr u32 OFF_SM = OFF_P1 + CB;
constexpr u32 OFF_SC0 = OFF_SM + 256;
constexpr u32 OFF_SC1 = OFF_SC0 + 256;
constexpr u32 OFF_LSUM = OFF_SC1 + 256;
constexpr u32 OFF_BAR = OFF_LSUM + 512;   // full[2][9], empty[2][2], bar_q
constexpr u32 OFF_TICKET = OFF_BAR + 192;
constexpr u32 OFF_SCHED = OFF_TICKET + 16;  // balanced schedule: 12 warp sums, the CTA's start (5 ints)
constexpr u32 OFF_MERGE = OFF_SCHED + 80;   // merges won: {request, first slot, splits} x 2 (request -1: none)
constexpr u32 OFF_XM = OFF_MERGE + 48;      // WG1's exact row maxima of an item (max_logits), read by WG0
constexpr u32 SMEM_USED = OFF_XM + 256;
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the seesaw smem map (+1 KB alignment slack)");
static_assert(64u * MLA_MAX_SPLITS * 4u <= 2u * TILE, "merge weights must fit in the K slots");
static_assert(MLA_BLOCK_M == 64 && MLA_BLOCK_N == 64, "tiling is fixed");
constexpr int THREADS = 384;  // 2 consumer warpgroups + 1 producer warpgroup
// setmaxnreg budgets (multiples of 8): 2 x 128 x 224 + 128 x 56 = 64512 = 384 x 168 registers
// FP8 build: 216 / 72 (2 x 128 x 216 + 128 x 72 = 64512; its producer dequantizes, and spills at 56).
// The budgets must fit the CTA's launch allocation, 384 x 168 registers: setmaxnreg.inc waits until the
// registers it asks for are free, so a larger sum deadlocks the consumers.
#ifndef MLA_FP8
#define MLA_FP8 0  // 1: k_cache in FlashMLA's 656-byte FP8 format (see the header comment)
#endif
#ifndef MLA_CONSUMER_REGS
#define MLA_CONSUMER_REGS (MLA_FP8 ? 216 : 224)
#endif
#ifndef MLA_PRODUCER_REGS
#define MLA_PRODUCER_REGS (MLA_FP8 ? 72 : 56)
#endif
constexpr int CONSUMER_REGS = MLA_CONSUMER_REGS;
constexpr int PRODUCER_REGS = MLA_PRODUCER_REGS;
static_assert(CONSUMER_REGS % 8 == 0 && PRODUCER_REGS % 8 == 0 && 256 * CONSUMER_REGS + 128 * PRODUCER_REGS <= 384 * 168,
              "setmaxnreg budgets exceed the CTA's launch allocation (384 threads x 168 registers)");

enum : int { BAR_SCALE0 = 1, BAR_SCALE1 = 2, BAR_P0 = 3, BAR_P1 = 4, BAR_EPI = 5, BAR_WG0 = 6, BAR_WG1 = 7 };

#ifndef MLA_TMA_K
#define MLA_TMA_K 0  // 1: K tiles by TMA (one producer thread), see the header comment
#endif
static_assert(!(MLA_TMA_K && MLA_FP8), "the FP8 build loads K through registers, not by TMA");
static_assert(!(MLA_NOPE && (MLA_TMA_K || MLA_FP8)), "MLA_NOPE (d_qk 512) is built on the cp.async bf16 / fp16 path");
#ifndef MLA_NOPE_SKIP
#define MLA_NOPE_SKIP 1  // MLA_NOPE: channel block 8 neither loaded nor multiplied (0: zero-filled and multiplied)
#endif
// Channel blocks of Q K^T: 9, or 8 for 512-channel rows (block 8 would be zeros on both sides).
constexpr int NCB_QK = (MLA_NOPE && MLA_NOPE_SKIP) ? 8 : NCB;
#ifndef MLA_KV_HINT
#define MLA_KV_HINT 1  // cp.async producers: L2 policies (MLA_FLAG_KV_REUSE) and the 256-byte L2 prefetch
#endif
// The bf16 / fp16 cp.async producer's 16-byte copies: with an L2 policy and the 256-byte prefetch
// (MLA_KV_HINT), else plain (the FP8 producer copies raw codes with cp_async_16 and passes no policy).
GQADRV_DEVICE void copy16(u32 dst, const void* src, u32 bytes, u64 pol) {
#if MLA_KV_HINT && !MLA_FP8
  cp_async_16_l2(dst, src, bytes, pol);
#else
  (void)pol;
  cp_async_16(dst, src, bytes);
#endif
}
#ifndef MLA_BT_AHEAD
// cp.async bf16 / fp16 producer of the balanced builds: block-table entries read one pair ahead (0: experiment
// _bt0); the split-grid builds read them beside their copies (one pair ahead, their producer spilled 20 bytes)
#define MLA_BT_AHEAD MLA_BALANCED
#endif
static_assert(!(MLA_BT_AHEAD && !MLA_BALANCED), "MLA_BT_AHEAD is built on the balanced grid's item walk");
#ifndef MLA_MAXLOG_LAZY
#define MLA_MAXLOG_LAZY 1  // MLA_FLAG_MAX_LOGITS items without splits: lazy running max, exact max tracked beside
#endif


// After a consumer's wait on a full barrier: cp.async data (generic proxy) needs a proxy fence
// before wgmma reads it; TMA data does not.
GQADRV_DEVICE void k_fence() {
#if !MLA_TMA_K
  cpasync_to_wgmma_fence();
#endif
}

#if MLA_TMA_K
// TMA mode: one barrier per half tile (cb 0..3 -> full[slot][0], cb 4..8 -> full[slot][4])
GQADRV_DEVICE u32 full_bar(u32 sb, int slot, int cb) { return sb + OFF_BAR + 8u * (u32)(9 * slot + (cb < 4 ? 0 : 4)); }
#else
GQADRV_DEVICE u32 full_bar(u32 sb, int slot, int cb) { return sb + OFF_BAR + 8u * (u32)(9 * slot + cb); }
#endif
// empty[slot][half]: half 0 = cb 0..3 (last reader WG0), half 1 = cb 4..8 (last reader WG1)
GQADRV_DEVICE u32 empty_bar(u32 sb, int slot, int half) { return sb + OFF_BAR + 8u * (u32)(18 + 2 * slot + half); }
GQADRV_DEVICE u32 q_bar(u32 sb) { return sb + OFF_BAR + 8u * 22u; }
// q_empty: the consumers' 8 warps arrive once the item's last Q K^T has retired (the next item's Q may land)
GQADRV_DEVICE u32 q_empty_bar(u32 sb) { return sb + OFF_BAR + 8u * 23u; }
// Threads arriving on q_bar: TMA mode, producer warps 1..3 (warp 0's lane 0 issues the K loads meanwhile);
// otherwise the whole producer warpgroup.
constexpr u32 Q_LOADERS = MLA_TMA_K ? 96u : 128u;
// Release the K halves after an item's last pair too (the balanced schedule's next item refills them);
// the split grid's single item keeps the releases to pairs that have a successor.
constexpr bool RELEASE_LAST = MLA_BALANCED != 0;
static_assert(!(MLA_BALANCED && MLA_FP8), "the balanced schedule is built on the TMA and cp.async bf16 / fp16 producers");
#ifndef MLA_SYNC_HANDOFF
#define MLA_SYNC_HANDOFF 2
#endif
// The writer's side of a scale hand-off (SCALE1: level 1, SCALE0: level 2): sync when MLA_SYNC_HANDOFF >= level,
// else arrive.
template <int LEVEL>
GQADRV_DEVICE void handoff_publish(u32 bar) {
  if (MLA_SYNC_HANDOFF >= LEVEL) named_bar_sync(bar, 256);
  else named_bar_arrive(bar, 256);
}
#ifndef MLA_LAZY_LOG2
#define MLA_LAZY_LOG2 8  // the running max moves only when a tile's max exceeds it by more than this (log2 units)
#endif
// Running max after a tile whose row max is m_tile: unchanged unless m_tile exceeds it by more than
// MLA_LAZY_LOG2 (log2 units), so P = 2^(S - m) stays below 2^MLA_LAZY_LOG2 (exact in bf16 / fp16 range,
// and the row sums in fp32) and most pairs need no rescale of O at all. 0: the exact running max.
// `exact`: the exact running max (items whose max_logits come from the split merge's {m, l}, or every
// MLA_FLAG_MAX_LOGITS item with MLA_MAXLOG_LAZY=0); other items with MLA_FLAG_MAX_LOGITS (the sparse
// prefill) report the exact maximum the consumers track beside the lazy one (x_lo / x_hi, sXM).
GQADRV_DEVICE float lazy_max(bool exact, float m_old, float m_tile) {
  const float slack = exact ? 0.f : (float)MLA_LAZY_LOG2;
  return m_tile > m_old + slack ? m_tile : m_old;
}
GQADRV_DEVICE bool exact_max_item(const MlaDecodeArgs& a, int nsplit) {
  return (a.flags & MLA_FLAG_MAX_LOGITS) && (nsplit > 1 || !MLA_MAXLOG_LAZY);
}
// Whether any row of this warp has a rescale factor other than 1 (warp-uniform: a skipped rescale
// also skips the wgmma wait before it).
GQADRV_DEVICE bool warp_rescales(float f_lo, float f_hi) {
  return __any_sync(0xffffffffu, f_lo != 1.f || f_hi != 1.f);
}

// Source rows of tile `tile` a producer thread copies: tokens tile * 64 + 16 pw + 4 q + (lane >> 3),
// q < 4 (pw = producer warp 0..3), already advanced to the lane's 16-byte unit (lane & 7);
// nullptr = zero-fill (token >= tok_end: neither the cache nor the block table is read).
GQADRV_DEVICE void tile_rows(const MlaDecodeArgs& a, const i32* bt_row, int kvh, int tile, int tok_end, int pw,
                             int lane, const u16* (&p)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int tok = tile * 64 + 16 * pw + 4 * q + (lane >> 3);
    p[q] = tok < tok_end ? k_row_ptr(a, bt_row, kvh, tok) + (lane & 7) * 8 : nullptr;
  }
}

// MLA_BT_AHEAD=1: the same rows in two steps, so that the block-table reads of a pair can be issued one
// pair ahead of its copies: tile_entries() loads the entries of the thread's 4 rows of `tile` (0 for tokens
// >= tok_end: never read), entry_rows() turns them into the row pointers of tile_rows().
GQADRV_DEVICE void tile_entries(const MlaDecodeArgs& a, const i32* bt_row, int tile, int tok_end, int pw, int lane,
                                int (&e)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int tok = tile * 64 + 16 * pw + 4 * q + (lane >> 3);
    e[q] = tok < tok_end ? bt_row[tok >> a.page_shift] : 0;
  }
}
GQADRV_DEVICE void entry_rows(const MlaDecodeArgs& a, const int (&e)[4], int kvh, int tile, int tok_end, int pw,
                              int lane, const u16* (&p)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int tok = tile * 64 + 16 * pw + 4 * q + (lane >> 3);
    p[q] = tok < tok_end ? k_row_at(a, e[q], kvh, tok) + (lane & 7) * 8 : nullptr;
  }
}

// cp.async of channel blocks [C0, C1) of one tile into `slot` by the producer warpgroup (4 copies
// of 16 B per thread and block: 4 rows x 128 B per warp instruction), one noinc arrival per thread
// and block on full[slot][cb].
// With MLA_KV_HINT the copies carry L2 policy `pol` and the 256-byte prefetch (copy16).
template <int C0, int C1>
GQADRV_DEVICE void load_blocks(u32 slot, u32 bar_slot0, const u16* const (&p)[4], const u16* any, int pw, int lane,
                               u64 pol) {
  const int u = lane & 7;
#pragma unroll
  for (int c = C0; c < C1; ++c) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = 16 * pw + 4 * q + (lane >> 3);
      const bool ok = p[q] != nullptr && !(MLA_NOPE && c == 8);  // MLA_NOPE (MLA_NOPE_SKIP=0): block 8 zeros
      copy16(slot + (u32)c * CB + swz(r, u), ok ? (const void*)(p[q] + c * 64) : (const void*)any, ok ? 16u : 0u, pol);
    }
    cp_async_mbar_arrive_noinc(bar_slot0 + 8u * (u32)c);
  }
}

GQADRV_DEVICE void setmaxnreg_dec_producer() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS)); }
GQADRV_DEVICE void setmaxnreg_inc_consumer() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS)); }


// Wait for cb c of `slot` (parity ph), make it visible to the async proxy, issue its 4 QK steps and
// commit them as one wgmma group.
GQADRV_DEVICE void qk_block_waited(float (&s)[32], u32 sb, int slot, int c, u32 ph, bool first) {
  mbar_wait_wd(full_bar(sb, slot, c), ph);
  k_fence();
  wgmma_fence();  // after the (divergent) wait loop: keeps ptxas from serialising the wgmma chain
  qk_block(s, sb + OFF_Q, sb + (slot ? OFF_K1 : OFF_K0), c, first);
  wgmma_commit();
}


// An item's first Q K^T (pair phase ph0), issued without waiting: S0 = Q K0^T (WG0, blocks in order) /
// S1 = Q K1^T (WG1, blocks 4..8 then 0..3: the fill order).
GQADRV_DEVICE void first_qk(float (&s)[32], u32 sb, int wg, u32 ph0) {
  wgmma_fence();
  if (wg == 0) {
#pragma unroll
    for (int c = 0; c < NCB_QK; ++c) qk_block_waited(s, sb, 0, c, ph0, c == 0);
  } else {
#pragma unroll
    for (int i = 0; i < NCB_QK; ++i) {
      const int c = i < NCB_QK - 4 ? 4 + i : i - (NCB_QK - 4);  // 4..8 (4..7), 0..3 (fill order)
      qk_block_waited(s, sb, 1, c, ph0, i == 0);
    }
  }
}

// Publish the new running maxima of rows r_lo / r_hi (sM) and their rescale factors (sSc) from lane
// t == 0 of each quad, once every lane of the warp has read the old sM values.
GQADRV_DEVICE void publish_max(float* sM, float* sSc, int r_lo, int r_hi, int t, float m_lo, float m_hi, float a_lo,
                               float a_hi) {
  __syncwarp();
  if (t == 0) {
    sM[r_lo] = m_lo;
    sM[r_hi] = m_hi;
    sSc[r_lo] = a_lo;
    sSc[r_hi] = a_hi;
  }
}
// %ctaid.y (I = 1), %ctaid.z (I = 2) or %tid.x (I = 3) read again (volatile: never merged with an
// earlier read, so the value is not kept live across setmaxnreg).
template <int I>
GQADRV_DEVICE int ctaid_or_tid() {
  int v;
  if (I == 1) asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
  if (I == 2) asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v));
  if (I == 3) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
  return v;
}
#if MLA_TMA_K

// TMA mode: Q rows [row0, row0 + 64) of request `req` (rows >= M zero-filled) by producer warps 1..3
// (x = 0..95): thread x copies 16-byte unit x & 7 of rows x / 8 + 12 k, every channel block.
GQADRV_DEVICE void load_q_rows(const MlaDecodeArgs& a, u32 q_smem, int req, int kvh, int row0, int M, int x) {
  const int u = x & 7;
#pragma unroll 1
  for (int r = x >> 3; r < MLA_BLOCK_M; r += 12) {
    const int rg = row0 + r;
    const u16* src = rg < M ? q_row_ptr(a, req, kvh, rg) + u * 8 : nullptr;
#pragma unroll
    for (int c = 0; c < NCB; ++c)
      cp_async_16(q_smem + (u32)c * CB + swz(r, u), src ? (const void*)(src + c * 64) : (const void*)a.q,
                  src ? 16u : 0u);
  }
}

// Zero rows [first_row, 64) of channel blocks c0 .. c0 + 3 of a K slot (TMA mode, a split's partially
// valid last tile: those rows come from a real page and may hold anything). One warpgroup (128
// threads, x = thread index in it), then the proxy fence and the warpgroup's named barrier.
GQADRV_DEVICE void zero_tail_rows(u32 slot, int c0, int first_row, int x, int bar_id) {
#pragma unroll 1
  for (int k = 0; k < 16; ++k) {
    const int i = x + 128 * k, cb = c0 + (i >> 9), r = (i >> 3) & 63, u = i & 7;
    if (r >= first_row) sts_zero16(slot + (u32)cb * CB + swz(r, u));
  }
  fence_proxy_async_smem();
  named_bar_sync(bar_id, 128);
}

// Page of a 64-token tile for the TMA producer (-1: the tile starts at or after tok_end; its block-table
// entry is never read and the out-of-bounds box is zero-filled), and the tile's first token in it.
struct TileSrc {
  int blk, off;
};
GQADRV_DEVICE TileSrc tile_src(const MlaDecodeArgs& a, const i32* bt_row, int tile, int tok_end) {
  const int tok = tile * 64;
  return TileSrc{tok < tok_end ? __ldg(bt_row + (tok >> a.page_shift)) : -1, tok & (a.page_size - 1)};
}
// One TMA for channel blocks [C0, C1) of a tile (C0 = 0: k_lo, 4 blocks; C0 = 4: k_hi, 5 blocks).
template <int C0, int C1>
GQADRV_DEVICE void tma_half(u32 slot, u32 bar, const TmaDesc* km, const TileSrc& src, int kvh) {
  mbar_arrive_expect_tx(bar, (u32)(C1 - C0) * CB);
  mla_tma_k_5d(slot + (u32)C0 * CB, km, bar, 0, src.off, C0, kvh, src.blk);
}
#endif

#if MLA_FP8
// FP8 mode (see the header comment): a half tile = code blocks C0 .. C0 + 3 of a slot (C0 = 0 or 4; for
// C0 = 4 also the RoPE block 8). Its raw codes (64 rows x 256 bytes) land by cp.async in the slot's own
// blocks C0 + 2 (bytes 0..127 of each row) and C0 + 3 (bytes 128..255), 16-byte units swizzled like the
// bf16 blocks; producer thread x copies row x >> 1, bytes 128 (x & 1) .. + 127 (8 copies), and the RoPE
// units 4 (x & 1) .. + 3 straight into block 8. One cp.async group per half.
constexpr u32 BAR_FP8 = 8;  // named barrier of the producer warpgroup (128 threads)

GQADRV_DEVICE void fp8_issue(const MlaDecodeArgs& a, u32 slot, const i32* bt_row, int kvh, int tile, int tok_end,
                             int x, int c0, bool rope, float& s_a, float& s_b) {
  const int r = x >> 1, sub = x & 1;
  const u8* row = fp8::row_at(a, bt_row, kvh, tile * 64 + r, tok_end);
  const bool ok = row != nullptr;
  const u32 dst = slot + (u32)(c0 + 2 + sub) * CB;
#pragma unroll
  for (int u = 0; u < 8; ++u)
    cp_async_16(dst + swz(r, u), ok ? (const void*)(row + 64 * c0 + 128 * sub + 16 * u) : (const void*)a.k_cache,
                ok ? 16u : 0u);
  if (rope) {
#pragma unroll
    for (int u = 4 * sub; u < 4 * sub + 4; ++u)
      cp_async_16(slot + 8u * CB + swz(r, u), ok ? (const void*)(row + fp8::ROPE_AT + 16 * u) : (const void*)a.k_cache,
                  ok ? 16u : 0u);
  }
  cp_async_commit();
  s_a = s_b = 0.f;
  if (ok) fp8::ld_f32x2_nc(row + fp8::SCALES_AT + 4 * (c0 / 2), s_a, s_b);
}

// Dequantize one landed half in place. Phase 1: raw bytes 0..127 (block C0 + 2) -> blocks C0, C0 + 1;
// phase 2: raw bytes 128..255 (block C0 + 3) -> blocks C0 + 2, C0 + 3, written only after the producer
// warpgroup's barrier (every thread has read its raw units of both phases by then). Thread x: row x >> 1,
// raw units 4 (x & 1) .. + 3 of each phase = the 64 channels of output block C0 + (x & 1) (+ 2). Each
// block completes on its full barrier with one arrival per thread. No fence.proxy.async here: it would
// wait for this thread's copies of the other halves still in flight (measured: FP8 decode at half the
// bf16 speed with it); the consumers fence after their full waits, as for the bf16 cp.async data.
GQADRV_DEVICE void fp8_convert(u32 slot, u32 bar_slot0, int x, int c0, float s_a, float s_b) {
  const int r = x >> 1, sub = x & 1;
  __syncwarp();  // the partner lane's copies of this row (waited for by it) are visible after this
  U32x4 c[4];
  const u32 raw1 = slot + (u32)(c0 + 2) * CB, raw2 = raw1 + CB;
#pragma unroll
  for (int j = 0; j < 4; ++j) c[j] = lds_u32x4(raw1 + swz(r, 4 * sub + j));
  fp8::dequant_block_row(c, s_a, slot + (u32)(c0 + sub) * CB, r);
#pragma unroll
  for (int j = 0; j < 4; ++j) c[j] = lds_u32x4(raw2 + swz(r, 4 * sub + j));
  mbar_arrive(bar_slot0 + 8u * (u32)c0);
  mbar_arrive(bar_slot0 + 8u * (u32)(c0 + 1));
  named_bar_sync(BAR_FP8, 128);  // all raw reads of this half done: blocks C0 + 2, C0 + 3 may be overwritten
  fp8::dequant_block_row(c, s_b, slot + (u32)(c0 + 2 + sub) * CB, r);
  mbar_arrive(bar_slot0 + 8u * (u32)(c0 + 2));
  mbar_arrive(bar_slot0 + 8u * (u32)(c0 + 3));
}
#endif

}  // namespace seesaw
}  // namespace mla

#if MLA_TMA_K
extern "C" __global__ void __launch_bounds__(mla::seesaw::THREADS, 1)
    mla_dense_decode_seesaw_tma(const __grid_constant__ TmaDesc k_lo, const __grid_constant__ TmaDesc k_hi,
                                const __grid_constant__ MlaDecodeArgs a) {
#elif MLA_FP8
extern "C" __global__ void __launch_bounds__(mla::seesaw::THREADS, 1)
    mla_dense_decode_seesaw_fp8(const __grid_constant__ MlaDecodeArgs a) {
#else
extern "C" __global__ void __launch_bounds__(mla::seesaw::THREADS, 1)
    mla_dense_decode_seesaw(const __grid_constant__ MlaDecodeArgs a) {
#endif
  using namespace mla;
  using namespace mla::seesaw;
  const int tid = threadIdx.x;
  u8* smem;
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);  // base rounded up to 1 KB

  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
  const int nmb = a.num_m_blocks;
#if MLA_BALANCED
  const int mb = (int)blockIdx.z;  // the KV head (blockIdx.y) is read again by each role after its setmaxnreg
#else
  const int S = a.num_splits;
  const int mb = (int)blockIdx.x % nmb, split = (int)blockIdx.x / nmb;
  const int kvh = blockIdx.y, b = blockIdx.z;
#endif
  const int M = a.m_rows, row0 = mb * MLA_BLOCK_M;
  const int last_row = (M - row0 < MLA_BLOCK_M ? M - row0 : MLA_BLOCK_M) - 1 + row0;  // the block's last valid row

  // Balanced grid: the block geometry again in each role after its setmaxnreg (shadowing the values
  // above, which would otherwise stay live across setmaxnreg and be spilled).
#if MLA_BALANCED
#define REDERIVE_BLOCK_GEOMETRY()                                                                       \
  const int mb = ctaid_or_tid<2>(), kvh = ctaid_or_tid<1>(), row0 = mb * MLA_BLOCK_M;                   \
  const int last_row = (M - row0 < MLA_BLOCK_M ? M - row0 : MLA_BLOCK_M) - 1 + row0
#else
#define REDERIVE_BLOCK_GEOMETRY() \
  do {                            \
  } while (0)
#endif

  if (tid == 0) {
#if MLA_TMA_K
    tma_prefetch_desc(&k_lo);
    tma_prefetch_desc(&k_hi);
#pragma unroll 1
    for (int i = 0; i < 18; ++i) mbar_init(sb + OFF_BAR + 8u * i, 1);  // full: one arrive.expect_tx (TMA)
#else
#pragma unroll 1
    for (int i = 0; i < 18; ++i) mbar_init(sb + OFF_BAR + 8u * i, 128);  // full: the producer's 128 threads
#endif
#pragma unroll 1
    for (int i = 18; i < 22; ++i) mbar_init(sb + OFF_BAR + 8u * i, 4);  // empty: one arrival per consumer warp
    mbar_init(q_bar(sb), Q_LOADERS);
    mbar_init(q_empty_bar(sb), 8);  // one arrival per consumer warp once its last Q K^T of an item retired
    fence_mbarrier_init();
  }
  float* sM = reinterpret_cast<float*>(smem + OFF_SM);
  if (tid < 64) sM[tid] = M_INIT;

  MLA_MARK(a, 0, tid == 0);
  MLA_MARK_SM(a, 15, tid == 0);
  pdl_wait();  // no-op unless launched with programmatic stream serialization
  // The CTA's work items (kernels/mla/common/work_items.cuh); every thread walks the same list.
#if MLA_BALANCED
  // The scan's barriers also publish the barrier inits and sM (the last CTA-wide barriers: WG2 leaves early).
  balanced_start<THREADS>(a, last_row, (int)blockIdx.x, a.num_splits, reinterpret_cast<int*>(smem + OFF_SCHED), tid);
  MLA_MARK(a, 1, tid == 0);
  BalancedWalker walker;  // read from shared memory by each role after its setmaxnreg
  auto start_walk = [&](int group) {
    walker = balanced_walker<THREADS>(reinterpret_cast<const int*>(smem + OFF_SCHED), (int)blockIdx.x,
                                      group * (a.num_splits + a.b));
  };
  auto next_item = [&](WorkItem& w, int block_last_row) -> bool { return walker.next(a, block_last_row, w); };
#else
  __syncthreads();  // barriers initialised, sM = M_INIT (the last CTA-wide barrier: WG2 leaves early)
  bool item_left = true;
  auto start_walk = [](int) {};
  auto next_item = [&](WorkItem& w, int) -> bool {
    if (!item_left) return false;
    item_left = false;
    w = split_item(a, b, split, S, last_row, ((long long)b * a.h_kv + kvh) * nmb + mb);
    return true;
  };
#endif
  // Values computed before setmaxnreg stay live across it (and would be spilled): each role walks
  // its items after its setmaxnreg.

  if (wg == 2) {
    // =================================================================== producer warpgroup
    setmaxnreg_dec_producer();
    REDERIVE_BLOCK_GEOMETRY();
    start_walk(kvh * nmb + mb);
    const int pw = wi;
    WorkItem w;
    int nq = 0, gp = 0;  // items with pairs so far (Q phase), pairs so far (K barrier phases)
#if MLA_TMA_K
    // thread 0 (warp 0, lane 0) issues every K load; warps 1..3 load Q; warp 0's other lanes leave
    if (pw == 0 && lane != 0) return;
#pragma unroll 1
    while (next_item(w, last_row)) {
      if (w.npairs == 0) continue;
      const int npairs = w.npairs, t_beg = w.t_beg, tok_end = w.tok_end;
      if (pw != 0) {
        if (nq > 0) mbar_wait_wd(q_empty_bar(sb), (u32)(nq - 1) & 1u);  // the previous item's Q is dead
        load_q_rows(a, sb + OFF_Q, w.req, kvh, row0, M, tid - 288);
        cp_async_wait_all();
        fence_proxy_async_smem();  // Q is read by wgmma only: no consumer-side fence needed
        mbar_arrive(q_bar(sb));
      } else {
        const i32* bt_row = a.block_table + (long long)w.req * a.bt_stride;
        TileSrc s0 = tile_src(a, bt_row, t_beg, tok_end);
        TileSrc s1 = tile_src(a, bt_row, t_beg + 1, tok_end);
#pragma unroll 1
        for (int it = 0; it < npairs; ++it) {
          const int T0 = t_beg + 2 * it;
          const u32 pe = (u32)((gp + it) & 1) ^ 1u;  // empty parity: the first fill of every block is free
          const bool nxt = it + 1 < npairs;
          // next pair's block-table entries, one pair ahead (in flight during the empty waits)
          const TileSrc n0 = nxt ? tile_src(a, bt_row, T0 + 2, tok_end) : s0;
          const TileSrc n1 = nxt ? tile_src(a, bt_row, T0 + 3, tok_end) : s1;
          mbar_wait_wd(empty_bar(sb, 0, 0), pe);
          tma_half<0, 4>(sb + OFF_K0, full_bar(sb, 0, 0), &k_lo, s0, kvh);
          mbar_wait_wd(empty_bar(sb, 1, 1), pe);
          tma_half<4, 9>(sb + OFF_K1, full_bar(sb, 1, 4), &k_hi, s1, kvh);
          mbar_wait_wd(empty_bar(sb, 0, 1), pe);
          tma_half<4, 9>(sb + OFF_K0, full_bar(sb, 0, 4), &k_hi, s0, kvh);
          mbar_wait_wd(empty_bar(sb, 1, 0), pe);
          tma_half<0, 4>(sb + OFF_K1, full_bar(sb, 1, 0), &k_lo, s1, kvh);
          s0 = n0;
          s1 = n1;
          MLA_MARK(a, 13, nq == 0 && it == 0);
        }
        MLA_MARK(a, 14, true);
      }
      gp += npairs;
      ++nq;
    }
#else
    // cp.async and FP8 producers: every thread copies. Split grid: its single item; balanced grid
    // (bf16 / fp16 only): the CTA's items in turn, each item's Q once the previous item's last Q K^T
    // retired (q_empty), its pairs after the previous item's (the K phases run on over the CTA's pairs).
#if MLA_KV_HINT && !MLA_FP8
    // L2 policies: with MLA_FLAG_KV_REUSE (sparse prefill) K rows stay (evict_last) and Q, read once, goes first
    const bool reuse = (a.flags & MLA_FLAG_KV_REUSE) != 0;
    const u64 k_pol = reuse ? l2_policy_evict_last() : l2_policy_evict_normal();
    const u64 q_pol = reuse ? l2_policy_evict_first() : l2_policy_evict_normal();
#else
    const u64 k_pol = 0, q_pol = 0;
#endif
#if MLA_BALANCED
#pragma unroll 1
    while (next_item(w, last_row)) {
      if (w.npairs == 0) continue;
#if MLA_BT_AHEAD && !MLA_FP8
      // the first pair's block-table entries, in flight during the q_empty wait and the Q copies
      int e0[4], e1[4];
      tile_entries(a, a.block_table + (long long)w.req * a.bt_stride, w.t_beg, w.tok_end, pw, lane, e0);
      tile_entries(a, a.block_table + (long long)w.req * a.bt_stride, w.t_beg + 1, w.tok_end, pw, lane, e1);
#endif
      if (nq > 0) mbar_wait_wd(q_empty_bar(sb), (u32)(nq - 1) & 1u);  // the previous item's Q is dead
#else
    if (next_item(w, last_row) && w.npairs > 0) {
#endif
      const int npairs = w.npairs, t_beg = w.t_beg, tok_end = w.tok_end;
      const i32* bt_row = a.block_table + (long long)w.req * a.bt_stride;
      {  // Q rows of this block (rows >= M zero-filled): rows 16 pw + 4 q + (lane >> 3), every cb
        const int u = lane & 7;
#pragma unroll 1
        for (int q = 0; q < 4; ++q) {
          const int r = 16 * pw + 4 * q + (lane >> 3), rg = row0 + r;
          const u16* src = rg < M ? q_row_ptr(a, w.req, kvh, rg) + u * 8 : nullptr;
#pragma unroll
          for (int c = 0; c < NCB_QK; ++c) {
            const bool ok = src != nullptr && !(MLA_NOPE && c == 8);  // MLA_NOPE: q rows of 512, block 8 zeros
            copy16(sb + OFF_Q + (u32)c * CB + swz(r, u), ok ? (const void*)(src + c * 64) : (const void*)a.q,
                   ok ? 16u : 0u, q_pol);
          }
        }
        cp_async_mbar_arrive_noinc(q_bar(sb));
      }
#if MLA_FP8
      const int x = tid - 256;
#pragma unroll 1
      for (int it = 0; it < npairs; ++it) {
        const int T0 = t_beg + 2 * it;
        const u32 pe = (u32)((gp + it) & 1) ^ 1u;  // empty parity: the first fill of every block is free
        // Each half is converted once the next one's copies are issued: waits and conversions alternate,
        // so no conversion waits for a later release. Every wait here is for a release that depends only
        // on halves already converted: empty(1,1) / empty(0,1) on WG1's previous pair, empty(1,0) on WG0
        // having read this pair's K0 cb 0..3 (converted before that wait).
        float s0a, s0b, s1a, s1b, s2a, s2b, s3a, s3b;
        mbar_wait_wd(empty_bar(sb, 0, 0), pe);
        fp8_issue(a, sb + OFF_K0, bt_row, kvh, T0, tok_end, x, 0, false, s0a, s0b);
        mbar_wait_wd(empty_bar(sb, 1, 1), pe);
        fp8_issue(a, sb + OFF_K1, bt_row, kvh, T0 + 1, tok_end, x, 4, true, s1a, s1b);
        cp_async_wait<1>();  // K0 cb 0..3 landed
        fp8_convert(sb + OFF_K0, full_bar(sb, 0, 0), x, 0, s0a, s0b);
        mbar_wait_wd(empty_bar(sb, 0, 1), pe);
        fp8_issue(a, sb + OFF_K0, bt_row, kvh, T0, tok_end, x, 4, true, s2a, s2b);
        cp_async_wait<1>();  // K1 cb 4..8 landed
        mbar_arrive(full_bar(sb, 1, 8));  // RoPE of K1: in the group just completed
        fp8_convert(sb + OFF_K1, full_bar(sb, 1, 0), x, 4, s1a, s1b);
        mbar_wait_wd(empty_bar(sb, 1, 0), pe);
        fp8_issue(a, sb + OFF_K1, bt_row, kvh, T0 + 1, tok_end, x, 0, false, s3a, s3b);
        cp_async_wait<1>();  // K0 cb 4..8 landed
        mbar_arrive(full_bar(sb, 0, 8));  // RoPE of K0
        fp8_convert(sb + OFF_K0, full_bar(sb, 0, 0), x, 4, s2a, s2b);
        cp_async_wait<0>();  // K1 cb 0..3 landed
        fp8_convert(sb + OFF_K1, full_bar(sb, 1, 0), x, 0, s3a, s3b);
      }
#else
#pragma unroll 1
      for (int it = 0; it < npairs; ++it) {
        const int T0 = t_beg + 2 * it;
        const u32 pe = (u32)((gp + it) & 1) ^ 1u;  // empty parity: the first fill of every block is free
        const u16* p0[4];
        const u16* p1[4];
#if MLA_BT_AHEAD
        entry_rows(a, e0, kvh, T0, tok_end, pw, lane, p0);
        entry_rows(a, e1, kvh, T0 + 1, tok_end, pw, lane, p1);
        if (it + 1 < npairs) {  // the next pair's entries, in flight during this pair's waits and copies
          tile_entries(a, bt_row, T0 + 2, tok_end, pw, lane, e0);
          tile_entries(a, bt_row, T0 + 3, tok_end, pw, lane, e1);
        }
#else
        tile_rows(a, bt_row, kvh, T0, tok_end, pw, lane, p0);
        tile_rows(a, bt_row, kvh, T0 + 1, tok_end, pw, lane, p1);
#endif
        mbar_wait_wd(empty_bar(sb, 0, 0), pe);
        load_blocks<0, 4>(sb + OFF_K0, full_bar(sb, 0, 0), p0, a.k_cache, pw, lane, k_pol);
        mbar_wait_wd(empty_bar(sb, 1, 1), pe);
        load_blocks<4, NCB_QK>(sb + OFF_K1, full_bar(sb, 1, 0), p1, a.k_cache, pw, lane, k_pol);
        mbar_wait_wd(empty_bar(sb, 0, 1), pe);
        load_blocks<4, NCB_QK>(sb + OFF_K0, full_bar(sb, 0, 0), p0, a.k_cache, pw, lane, k_pol);
        mbar_wait_wd(empty_bar(sb, 1, 0), pe);
        load_blocks<0, 4>(sb + OFF_K1, full_bar(sb, 1, 0), p1, a.k_cache, pw, lane, k_pol);
      }
#if !MLA_BALANCED
      cp_async_wait_all();
#endif
#endif
#if MLA_BALANCED
      gp += npairs;
      ++nq;
#endif
    }
#if MLA_BALANCED
    cp_async_wait_all();
#endif
#endif
  } else {
  // ===================================================================== consumer warpgroups
  setmaxnreg_inc_consumer();
  REDERIVE_BLOCK_GEOMETRY();
#if MLA_BALANCED
  const int wg = ctaid_or_tid<3>() >> 7;
#endif
  start_walk(kvh * nmb + mb);
  float* sSc0 = reinterpret_cast<float*>(smem + OFF_SC0);
  float* sSc1 = reinterpret_cast<float*>(smem + OFF_SC1);
  const int r_lo = 16 * wi + g, r_hi = r_lo + 8;
  const float sc = a.scale_log2;
  const int rows = M - row0 < MLA_BLOCK_M ? M - row0 : MLA_BLOCK_M;
  // the attention sink of the thread's two rows in log2 units (MLA_FLAG_SINK), read once: the CTA's KV head
  // and row block are fixed, so the epilogue does not wait for these loads item after item
  const float sk_lo = sink_log2(a, kvh, row0 + r_lo), sk_hi = sink_log2(a, kvh, row0 + r_hi);
  int nq = 0, gp = 0;  // as in the producer
  // Merges this CTA won (last ticket of a shared request), run after its last item, when no load is in
  // flight into the K slots that hold the merge weights. Only a CTA's first and last item can be shared.
  int* s_merge = reinterpret_cast<int*>(smem + OFF_MERGE);  // written by thread 0, read after BAR_EPI
  if (tid == 0) s_merge[0] = s_merge[3] = -1;
  int n_merge = 0;  // uniform over the consumer threads
  WorkItem w;
  int ni = 0;  // items so far (trace stamps only)
#pragma unroll 1
  while (next_item(w, last_row)) {
  const int ti = ni++;
  (void)ti;
  const int len = w.len, npairs = w.npairs, t_beg = w.t_beg, tok_end = w.tok_end;
  const int lim_lo = min(row_key_limit(a, len, row0 + r_lo), tok_end);
  const int lim_hi = min(row_key_limit(a, len, row0 + r_hi), tok_end);
  const int lim_min = min(row_key_limit(a, len, row0), tok_end);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float l_lo = 0.f, l_hi = 0.f;
  const bool exact = exact_max_item(a, w.nsplit);
  float x_lo = neg_inf(), x_hi = neg_inf();  // exact row maxima of this warpgroup's tiles (max_logits)
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;

  if (npairs > 0) {
    // ---- prologue: S0 = Q K0^T (WG0) / S1 = Q K1^T (WG1) of the first pair
    mbar_wait_wd(q_bar(sb), (u32)nq & 1u);
    MLA_MARK(a, 2 + 3 * ti, ti < 3 && tid == 0);
    reg_fence(o);
    reg_fence(s);
    first_qk(s, sb, wg, (u32)gp & 1u);
    wgmma_wait<0>();
    reg_fence(s);
    if (npairs == 1) release(q_empty_bar(sb), lane);  // the item's last Q K^T has retired

    if (wg == 0) {
      // =============================================================== warpgroup 0
#pragma unroll 1
      for (int it = 0; it < npairs; ++it) {
        const int T0 = t_beg + 2 * it;
        const bool nxt = it + 1 < npairs;
        const u32 ph = (u32)((gp + it) & 1);
        // softmax of S0 against the shared running max
        float mx_lo, mx_hi;
        mask_row_max(s, sc, T0, t, lim_lo, lim_hi, lim_min, mx_lo, mx_hi);
        x_lo = fmaxf(x_lo, mx_lo);
        x_hi = fmaxf(x_hi, mx_hi);
        const float mo_lo = sM[r_lo], mo_hi = sM[r_hi];
        const float mn_lo = lazy_max(exact, mo_lo, mx_lo), mn_hi = lazy_max(exact, mo_hi, mx_hi);
        const float a0_lo = fast_exp2(mo_lo - mn_lo), a0_hi = fast_exp2(mo_hi - mn_hi);
        publish_max(sM, sSc0, r_lo, r_hi, t, mn_lo, mn_hi, a0_lo, a0_hi);
        float sum_lo, sum_hi;
        exp_rows(s, sc, mn_lo, mn_hi, sum_lo, sum_hi);
        l_lo = l_lo * a0_lo + sum_lo;
        l_hi = l_hi * a0_hi + sum_hi;
        u32 pa[16];
        pack_pa(pa, s, 1.f, 1.f);
        handoff_publish<2>(BAR_SCALE0);
        if (warp_rescales(a0_lo, a0_hi)) scale_o(o, a0_lo, a0_hi);
#if MLA_TMA_K
        if (tok_end - T0 * 64 < 64) zero_tail_rows(sb + OFF_K0, 0, tok_end - T0 * 64, tid, BAR_WG0);
#endif
        // O_L += P0 V0L (RS)
        wgmma_fence();
        pv_rs(o, pa, sb + OFF_K0);
        wgmma_commit();
        // P0 a1 -> sP0 for WG1: when every a1 of the warp is 1 the registers P0 V0L reads are stored
        // as they are (reads only) while the product runs; otherwise repacked once it retired
        named_bar_sync(BAR_SCALE1, 256);
        const float a1_lo = sSc1[r_lo], a1_hi = sSc1[r_hi];
        const bool rescale1 = warp_rescales(a1_lo, a1_hi);
        if (rescale1) {
          wgmma_wait<0>();
          reg_fence(o);
          reg_fence_u(pa);
          pack_pa(pa, s, a1_lo, a1_hi);
        }
        store_pa(sb + OFF_P0, pa, r_lo);
        fence_proxy_async_smem();
        named_bar_arrive(BAR_P0, 256);
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence_u(pa);
        if (RELEASE_LAST || nxt) release(empty_bar(sb, 0, 0), lane);  // K0 cb 0..3 dead
        // O_L = O_L a1 + P1 V1L (SS, sP1 from WG1)
        named_bar_sync(BAR_P1, 256);
        if (rescale1) scale_o(o, a1_lo, a1_hi);
        l_lo *= a1_lo;
        l_hi *= a1_hi;
#pragma unroll
        for (int c = 0; c < 4; ++c) mbar_wait_wd(full_bar(sb, 1, c), ph);
#if MLA_TMA_K
        {  // after BAR_SCALE1: WG1's Q K1^T (the other reader of K1 cb 0..3) is complete
          const int v1 = tok_end - (T0 + 1) * 64;
          if (v1 > 0 && v1 < 64) zero_tail_rows(sb + OFF_K1, 0, v1, tid, BAR_WG0);
        }
#endif
        k_fence();
        wgmma_fence();
        pv_ss(o, sb + OFF_P1, sb + OFF_K1);
        wgmma_commit();
        if (nxt) {
          // next S0: cb 0..3 (refilled after P0 V0L), then cb 4..8 (after WG1's sP0 V0R); K1 cb 0..3
          // are released once P1 V1L is done
#pragma unroll
          for (int c = 0; c < 4; ++c) qk_block_waited(s, sb, 0, c, ph ^ 1u, c == 0);
          wgmma_wait<4>();
          release(empty_bar(sb, 1, 0), lane);
#pragma unroll
          for (int c = 4; c < NCB_QK; ++c) qk_block_waited(s, sb, 0, c, ph ^ 1u, false);
        }
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence(s);
        if (RELEASE_LAST && !nxt) release(empty_bar(sb, 1, 0), lane);  // P1 V1L done: K1 cb 0..3 dead
        if (it + 2 == npairs) release(q_empty_bar(sb), lane);  // the item's last Q K^T has retired
      }
    } else {
      // =============================================================== warpgroup 1
#pragma unroll 1
      for (int it = 0; it < npairs; ++it) {
        const int T1 = t_beg + 2 * it + 1;
        const bool nxt = it + 1 < npairs;
        const u32 ph = (u32)((gp + it) & 1);
        float mx_lo, mx_hi;
        mask_row_max(s, sc, T1, t, lim_lo, lim_hi, lim_min, mx_lo, mx_hi);
        x_lo = fmaxf(x_lo, mx_lo);
        x_hi = fmaxf(x_hi, mx_hi);
        named_bar_sync(BAR_SCALE0, 256);
        const float mo_lo = sM[r_lo], mo_hi = sM[r_hi];
        const float mn_lo = lazy_max(exact, mo_lo, mx_lo), mn_hi = lazy_max(exact, mo_hi, mx_hi);
        const float a1_lo = fast_exp2(mo_lo - mn_lo), a1_hi = fast_exp2(mo_hi - mn_hi);
        const float f_lo = a1_lo * sSc0[r_lo], f_hi = a1_hi * sSc0[r_hi];
        publish_max(sM, sSc1, r_lo, r_hi, t, mn_lo, mn_hi, a1_lo, a1_hi);
        handoff_publish<1>(BAR_SCALE1);
        float sum_lo, sum_hi;
        exp_rows(s, sc, mn_lo, mn_hi, sum_lo, sum_hi);
        l_lo = l_lo * f_lo + sum_lo;
        l_hi = l_hi * f_hi + sum_hi;
        u32 pa[16];
        pack_pa(pa, s, 1.f, 1.f);
        store_pa(sb + OFF_P1, pa, r_lo);
        fence_proxy_async_smem();
        if (warp_rescales(f_lo, f_hi)) scale_o(o, f_lo, f_hi);
#if MLA_TMA_K
        {
          const int v1 = tok_end - T1 * 64;
          if (v1 > 0 && v1 < 64) zero_tail_rows(sb + OFF_K1, 4, v1, tid - 128, BAR_WG1);
        }
#endif
        // O_R += P1 V1R (RS)
        wgmma_fence();
        pv_rs(o, pa, sb + OFF_K1 + 4 * CB);
        wgmma_commit();
        // O_R += (P0 a1) V0R (SS, sP0 from WG0)
        named_bar_sync(BAR_P0, 256);
#pragma unroll
        for (int c = 4; c < 8; ++c) mbar_wait_wd(full_bar(sb, 0, c), ph);
#if MLA_TMA_K
        {  // after BAR_SCALE0: WG0's Q K0^T (the other reader of K0 cb 4..7) is complete
          const int v0 = tok_end - (T1 - 1) * 64;
          if (v0 < 64) zero_tail_rows(sb + OFF_K0, 4, v0, tid - 128, BAR_WG1);
        }
#endif
        k_fence();
        wgmma_fence();
        pv_ss(o, sb + OFF_P0, sb + OFF_K0 + 4 * CB);
        wgmma_commit();
        named_bar_arrive(BAR_P1, 256);
        if (nxt) {
          wgmma_wait<1>();  // P1 V1R done: K1 cb 4..8 are dead
          reg_fence_u(pa);
          release(empty_bar(sb, 1, 1), lane);
          wgmma_wait<0>();  // sP0 V0R done: K0 cb 4..8 (and sP0) are dead
          reg_fence(o);
          release(empty_bar(sb, 0, 1), lane);
          // next S1: cb 4..8, then cb 0..3 (refilled after WG0's sP1 V1L)
          wgmma_fence();
#pragma unroll
          for (int i = 0; i < NCB_QK; ++i) {
            const int c = i < NCB_QK - 4 ? 4 + i : i - (NCB_QK - 4);
            qk_block_waited(s, sb, 1, c, ph ^ 1u, i == 0);
          }
        }
        wgmma_wait<0>();
        reg_fence(o);
        reg_fence(s);
        reg_fence_u(pa);
        if (RELEASE_LAST && !nxt) {  // the item's last pair: its K1 cb 4..8, K0 cb 4..8 and sP0 are dead
          release(empty_bar(sb, 1, 1), lane);
          release(empty_bar(sb, 0, 1), lane);
        }
        if (it + 2 == npairs) release(q_empty_bar(sb), lane);  // the item's last Q K^T has retired
      }
    }
    gp += npairs;
    ++nq;
  }
#if MLA_BALANCED
  if (!walker.more(a)) pdl_launch_dependents();
#else
  pdl_launch_dependents();
#endif
  MLA_MARK(a, 3 + 3 * ti, ti < 3 && tid == 0);

  // ---- row sums over the quad, then over the two warpgroups (both relative to the final sM); WG1's
  // exact row maxima to WG0 (published before the same barrier, read after it)
  float* sXM = reinterpret_cast<float*>(smem + OFF_XM);
  if (wg == 1 && t == 0) {
    sXM[r_lo] = x_lo;
    sXM[r_hi] = x_hi;
  }
  float L_lo, L_hi;
  sum_rows_2wg(reinterpret_cast<float*>(smem + OFF_LSUM), l_lo, l_hi, r_lo, r_hi, wg, t,
               [] { named_bar_sync(BAR_EPI, 256); }, L_lo, L_hi);
#if !MLA_TMA_K
  MLA_MARK(a, 13, ti == 0 && tid == 0);  // (cp.async builds: slots 13 / 14 split item 0's epilogue)
#endif
  if (wg == 0) {  // before the balanced builds' second BAR_EPI, after which WG1 may write the next item's
    x_lo = fmaxf(x_lo, sXM[r_lo]);
    x_hi = fmaxf(x_hi, sXM[r_hi]);
  }
  const float m_lo = sM[r_lo], m_hi = sM[r_hi];
  const bool v_lo = row0 + r_lo < M, v_hi = row0 + r_hi < M;
#if MLA_BALANCED
  // every consumer thread has read sM and lsum: reset the running max for the next item (each quad's
  // lane 0 its two rows; WG1 reads sM only after WG0's BAR_SCALE0 arrival, WG0's lanes after the
  // __syncwarp)
  named_bar_sync(BAR_EPI, 256);
  if (wg == 0 && t == 0) {
    sM[r_lo] = M_INIT;
    sM[r_hi] = M_INIT;
  }
  __syncwarp();
#endif

  const RowPair rp{r_lo,  r_hi,  v_lo, v_hi, m_lo, m_hi, L_lo, L_hi, x_lo, x_hi,
                   sink_term_log2(a, sk_lo, m_lo), sink_term_log2(a, sk_hi, m_hi)};
#if !MLA_TMA_K
  MLA_MARK(a, 14, ti == 0 && tid == 0);
#endif
  if (w.nsplit == 1) {
    store_out_rows<DT>(a, o, rp, wg, t, [&](int r) { return out_row_ptr(a, w.req, kvh, row0 + r); },
                       [&](int r) { return lse_ptr(a, w.req, kvh, row0 + r); });
    MLA_MARK(a, 4 + 3 * ti, ti < 3 && tid == 0);
    continue;
  }
  // ---- a shared request: this item's partial (written even when empty), then the ticket
  store_partial_rows(a, o, rp, (long long)w.slot * MLA_BLOCK_M, wg, t);
  const long long unit = ((long long)w.req * a.h_kv + kvh) * nmb + mb;
  if (last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), w.nsplit, tid,
                     [] { named_bar_sync(BAR_EPI, 256); }))
    note_merge_won(s_merge, n_merge, w, tid);
  MLA_MARK(a, 4 + 3 * ti, ti < 3 && tid == 0);
  }  // items
  MLA_MARK(a, 11, tid == 0);

  // ---- merges won: no load is in flight (every issued load was consumed), the K slots are free
  run_merges_won<MLA_BLOCK_M, 256, DT, MLA_FP8 ? 4 : 8>(a, s_merge, n_merge, reinterpret_cast<float*>(smem + OFF_K0), kvh, nmb, mb,
                                       row0, rows, tid, [] { named_bar_sync(BAR_EPI, 256); });
  MLA_MARK(a, 12, tid == 0);
  }  // consumer warpgroups
}
