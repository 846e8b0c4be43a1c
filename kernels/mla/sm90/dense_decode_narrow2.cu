// gqadrv — MLA dense decode for at most 16 packed rows per KV head (M = s_q * h_q / h_kv <= 16, e.g.
// h_q 16 s_q 1: the memory-bound regime), sm_90a, tokens as the wgmma M dimension (the math of
// dense_decode_narrow.cu, narrow_ops.cuh) with TWO consumer warpgroups on alternate tiles, so that
// the tensor work and the softmax of one tile overlap the other's and the ring streams at the
// memory's pace; each consumer warpgroup holds at most one tile of the ring (no S^T issued ahead),
// which leaves about two tiles of the ring for loads in flight. Same semantics and arguments as the
// other dense kernels; the CTA's work comes as work items (kernels/mla/common/work_items.cuh):
// MLA_BALANCED=0: the split grid's single item, MLA_BALANCED=1: the balanced persistent grid.
//
// Math      per 64-token tile (one consumer warpgroup):
//             S^T[64 tok x 16]  = K[64 x 576] Q^T     wgmma m64n16k16 SS x 36 (two partial chains)
//             O^T[512 x 16]    += V^T[512 x 64] P^T   wgmma m64n16k16 SS x 32 (A = V^T, MN-major)
//           Each warpgroup keeps its own running max, row sums and O^T (8 sets of 8 fp32); at the
//           end of a work item the two states are merged through shared memory, each warpgroup
//           ending with half of the channels.
// CTA work  grid (nmb * S, h_kv, b) (split) or (P, h_kv, nmb) (balanced, P = num_splits); the items'
//           tiles [t_beg, t_beg + nt), nt = the item's tiles below its tok_end. Tile k of the CTA
//           (counted over all its items, gtile) goes to consumer warpgroup gtile % 2: a warpgroup's
//           previous tile is then exactly two tiles before, which the ring parity argument needs.
// Warps     384 threads. Warpgroups 0 and 1 (warps 0..7) compute; warpgroup 2 produces: warp 8 lane 0
//           issues one TMA per piece, warps 9..11 copy each item's Q rows (cp.async); warp 8's other
//           lanes wait for lane 0 at the end (the warp exits whole).
//           In a consumer warpgroup warp w holds S^T / O^T rows 16w .. 16w+15 (tokens or
//           channels); lane 4g + t holds columns (query rows) 8j + 2t + e, j < 2, e < 2.
// Smem map  (base rounded up to 1024 B)
//           [0, 18 KB)      Q: 9 channel blocks of 16 rows x 128 B, 128B swizzle (B of S^T); in an
//                           item's epilogue: the O^T hand-off (16 KB), then the output staging rows
//           + 2 x 2 KB      P of warpgroup 0 / 1: 16 rows x 64 tokens, swizzled K-major (B of O^T)
//           + NSLOT x 8 KB  piece ring: tile k of the CTA is pieces 9k .. 9k + 8 in ring order
//           + red[2][4][16], lred[2][4][16], xml[2][2][16] fp32 ({m, L} per warpgroup), sched
//             (balanced scan), merges won,
//             mbarriers full[NSLOT], empty[NSLOT], q_full, q_empty, ticket
//           after the last item: the ring holds the merge weights.
// Barriers  full[s] count 1 (arrive.expect_tx 8 KB + the TMA), empty[s] count 4 (one arrival per warp
//           of the consuming warpgroup after its wgmma reads retired), q_full count 96 (the Q copy
//           threads after cp.async.wait_all + fence.proxy.async), q_empty count 256 (every consumer
//           thread once the item's epilogue no longer reads the Q region). Named: 2 / 3 = warpgroup
//           0 / 1 (128: column max, P written, row sums), 1 = both (256: the epilogue hand-off, the
//           staging, the ticket, the merges).
// Pipeline  producer: per item (with tiles) Q after q_empty of the previous one; pieces in ring
//           order, each: wait empty (parity starts at 1), expect_tx, TMA (5-D box of one channel
//           block), the next tile's block-table entry read one tile ahead.
//           consumer, tile k: 9 x (wait full, 4 wgmmas) -> wait -> release piece 8 -> softmax (column
//           max: shuffles over g, red[] + barrier) -> P -> (last tile of the item: zero rows >=
//           tok_end in pieces 0..7) -> fence.proxy.async + barrier -> 32 wgmmas -> wait -> release
//           pieces 0..7. Parity: a wait for piece p (phase p / NSLOT) is correct when piece
//           p - NSLOT has landed; p - NSLOT <= 9 (k - 2) + 8 for NSLOT >= 18, a piece of the
//           warpgroup's own previous tile or earlier, all landed. The slot cannot run a phase ahead:
//           piece p + NSLOT waits for this warpgroup's release of p.
// Masking   scaled logits of keys >= the row's limit -> -1e33, running max from -1e30; rows >= tok_end
//           of an item's last tile come from a real page (any bytes): zeroed in pieces 0..7 before
//           O^T reads them; tiles at or past tok_end are never loaded.
// Epilogue  per item: row sums (over g, then the 4 warps); once both warpgroups are past their last
//           wgmma of the item (a barrier: the other one may still read Q) both publish {m, L};
//           warpgroup 1 hands its channel blocks 0..3 to warpgroup 0 through 16 KB of the Q region,
//           warpgroup 0 merges them and hands its blocks 4..7 back through the same words (each thread
//           reuses only its own words), so each warpgroup ends with half of the merged O^T. Then out /
//           lse (nsplit 1, staged in the Q region, lse by warpgroup 0) or the fp32 partial + {m, l}
//           and the ticket (thread 0); merges won run after the last item on both warpgroups (the
//           ring is idle then). Balanced builds (MLA_PARTIAL_L2=1) store partials with an L2 evict_last
//           policy and discard the merged partials' lines from L2 (decode_util.cuh).
// Trace     MLA_TRACE=1 builds only (development, tools/mla_trace.py): MLA_MARK %globaltimer stamps by
//           consumer thread 0 and the TMA thread, and the CTA's SM (%smid, MLA_MARK_SM) in slot 15
//           (decode_util.cuh); compiled out otherwise.
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "../common/work_items.cuh"
#include "narrow_ops.cuh"

#ifndef MLA_NSLOT
#error "MLA_NSLOT not defined (pieces of 8 KB in the ring)"
#endif

namespace mla {
namespace narrow {
constexpr int NSLOT = MLA_NSLOT;
constexpr int THREADS = 384;
constexpr int NW_ALL = THREADS / 32;
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_P = NCB * QCB;
constexpr u32 OFF_RING = OFF_P + 2 * QCB;
constexpr u32 OFF_RED = OFF_RING + NSLOT * PIECE;       // red[2][4][NQ]
constexpr u32 OFF_LRED = OFF_RED + 2 * 4 * NQ * 4;      // lred[2][4][NQ]
constexpr u32 OFF_XML = OFF_LRED + 2 * 4 * NQ * 4;      // per warpgroup m[NQ], L[NQ]
constexpr u32 OFF_SCHED = OFF_XML + 2 * 2 * NQ * 4;     // balanced_start: NW_ALL + 5 ints
constexpr u32 OFF_MERGE = OFF_SCHED + 80;               // merges won: 2 x {req, slot0, nsplit}
constexpr u32 OFF_BAR = OFF_MERGE + 32;                 // full[NSLOT], empty[NSLOT], q_full, q_empty
constexpr u32 OFF_TICKET = OFF_BAR + 8u * (2 * NSLOT + 2);
constexpr u32 SMEM_USED = OFF_TICKET + 16;
constexpr u32 STG_BF16 = 1024u + 16u;  // output staging row stride (bank spread)
constexpr u32 XHALF = 4u * NACC * 128u * 4u;  // one half (4 channel blocks) of a warpgroup's O^T
static_assert(NQ == 16, "two consumer warpgroups: 16 rows per CTA");
static_assert(NSLOT >= 18, "the parity argument needs two tiles in the ring");
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the narrow2 smem map (+1 KB slack)");
static_assert((NW_ALL + 5) * 4 <= 80, "balanced schedule scratch");
static_assert(NQ * STG_BF16 <= NCB * QCB && XHALF <= NCB * QCB, "epilogue staging must fit in the Q region");
static_assert((u32)NQ * MLA_MAX_SPLITS * 4u <= NSLOT * PIECE, "merge weights must fit in the ring");
static_assert(OFF_P % 1024 == 0 && OFF_RING % 1024 == 0 && QCB % 1024 == 0, "swizzle atoms are 1 KB aligned");

constexpr int BAR_BOTH = 1, BAR_WG0 = 2;  // warpgroup u: BAR_WG0 + u
constexpr int Q_LOADERS = 96;

GQADRV_DEVICE u32 full_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)slot; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)(NSLOT + slot); }
GQADRV_DEVICE u32 q_full_bar(u32 sb) { return sb + OFF_BAR + 8u * (u32)(2 * NSLOT); }
GQADRV_DEVICE u32 q_empty_bar(u32 sb) { return sb + OFF_BAR + 8u * (u32)(2 * NSLOT + 1); }
GQADRV_DEVICE u32 slot_addr(u32 sb, int slot) { return sb + OFF_RING + (u32)slot * PIECE; }
// Ring slot and full-barrier parity of piece p of the CTA.
GQADRV_DEVICE int piece_slot(int p) { return p % NSLOT; }
GQADRV_DEVICE u32 piece_phase(int p) { return (u32)(p / NSLOT) & 1u; }

// Tiles of an item that hold keys below its tok_end (the last pair of an item may have one).
GQADRV_DEVICE int item_tiles(const WorkItem& w) {
  return w.npairs == 0 ? 0 : max(0, min(2 * w.npairs, (w.tok_end - 64 * w.t_beg + 63) >> 6));
}

// Q rows of packed rows row0 .. row0 + 15 of request `req` (rows >= M zero-filled) by the 96 copy
// threads x = 0..95: 16 rows x 9 channel blocks x 8 units of 16 B, 12 per thread.
GQADRV_DEVICE void load_q_item(const MlaDecodeArgs& a, u32 q_base, int req, int kvh, int row0, int M, int x) {
#pragma unroll 1
  for (int i = x; i < NQ * NCB * 8; i += Q_LOADERS) {
    const int r = i / (NCB * 8), rem = i - r * (NCB * 8), c = rem >> 3, u = rem & 7, rg = row0 + r;
    const u16* src = rg < M ? q_row_ptr(a, req, kvh, rg) + c * 64 + u * 8 : nullptr;
    cp_async_16(q_base + (u32)c * QCB + swz(r, u), src ? (const void*)src : (const void*)a.q, src ? 16u : 0u);
  }
}

// The merge hand-off (see the epilogue): channel blocks cb0 .. cb0 + 3 of a warpgroup's O^T as
// [block][accumulator][thread] fp32 words (thread tw of the other warpgroup holds the same elements).
GQADRV_DEVICE void xchg_store(u32 base, const float (&ot)[8][NACC], int cb0, int tw) {
#pragma unroll
  for (int mm = 0; mm < 4; ++mm)
#pragma unroll
    for (int i = 0; i < NACC; ++i) sts_f32(base + 4u * (u32)((mm * NACC + i) * 128 + tw), ot[cb0 + mm][i]);
}
// ot[cb0 + mm] = ot * a_own + (the other warpgroup's words) * a_oth, per query row (j, e).
GQADRV_DEVICE void xchg_merge(u32 base, float (&ot)[8][NACC], int cb0, int tw, const float (&a_own)[NJ][2],
                              const float (&a_oth)[NJ][2]) {
#pragma unroll
  for (int mm = 0; mm < 4; ++mm)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 4 * j + 2 * h + e;
          const float o = lds_f32(base + 4u * (u32)((mm * NACC + i) * 128 + tw));
          ot[cb0 + mm][i] = ot[cb0 + mm][i] * a_own[j][e] + o * a_oth[j][e];
        }
}

}  // namespace narrow
}  // namespace mla

extern "C" __global__ void __launch_bounds__(mla::narrow::THREADS, 1)
    mla_dense_decode_narrow2_tma(const __grid_constant__ TmaDesc k_cb, const __grid_constant__ MlaDecodeArgs a) {
  using namespace mla;
  using namespace mla::narrow;
  const int tid = threadIdx.x;
  u8* smem;
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);  // base rounded up to 1 KB

  const int lane = tid & 31, warp = tid >> 5;
  const int nmb = a.num_m_blocks;
#if MLA_BALANCED
  const int mb = (int)blockIdx.z, kvh = blockIdx.y;
#else
  const int S = a.num_splits;
  const int mb = (int)blockIdx.x % nmb, split = (int)blockIdx.x / nmb;
  const int kvh = blockIdx.y, b = blockIdx.z;
#endif
  const int M = a.m_rows, row0 = mb * NQ;
  const int last_row = (M - row0 < NQ ? M - row0 : NQ) - 1 + row0;

  if (tid == 0) {
    tma_prefetch_desc(&k_cb);
#pragma unroll 1
    for (int i = 0; i < NSLOT; ++i) {
      mbar_init(full_bar(sb, i), 1);
      mbar_init(empty_bar(sb, i), 4);
    }
    mbar_init(q_full_bar(sb), Q_LOADERS);
    mbar_init(q_empty_bar(sb), 256);
    fence_mbarrier_init();
  }

  MLA_MARK(a, 0, tid == 0);
  MLA_MARK_SM(a, 15, tid == 0);
  pdl_wait();  // no-op unless launched with programmatic stream serialization
#if MLA_BALANCED
  // the scan's barriers also publish the barrier inits
  balanced_start<THREADS>(a, last_row, (int)blockIdx.x, a.num_splits, reinterpret_cast<int*>(smem + OFF_SCHED), tid);
  MLA_MARK(a, 1, tid == 0);
  BalancedWalker walker = balanced_walker<THREADS>(reinterpret_cast<const int*>(smem + OFF_SCHED), (int)blockIdx.x,
                                                   (kvh * nmb + mb) * (a.num_splits + a.b));
  auto next_item = [&](WorkItem& w) -> bool { return walker.next(a, last_row, w); };
#else
  __syncthreads();  // barriers initialised
  bool item_left = true;
  auto next_item = [&](WorkItem& w) -> bool {
    if (!item_left) return false;
    item_left = false;
    w = split_item(a, b, split, S, last_row, ((long long)b * a.h_kv + kvh) * nmb + mb);
    return true;
  };
#endif

  if (warp >= 8) {
    // =================================================================== producer warpgroup
    const int pw = warp - 8;
    // warp 8: lane 0 issues the TMAs; its other lanes wait for it at the end (the warp exits whole)
    if (pw != 0 || lane == 0) {
    WorkItem w;
    int nq = 0;              // items with tiles so far (Q phases)
    int slot = 0;            // ring position of the next piece
    u32 ph = 0;
#pragma unroll 1
    while (next_item(w)) {
      const int nt = item_tiles(w);
      if (nt == 0) continue;
      if (pw != 0) {
        if (nq > 0) mbar_wait_wd(q_empty_bar(sb), (u32)(nq - 1) & 1u);  // the previous item's Q is dead
        load_q_item(a, sb + OFF_Q, w.req, kvh, row0, M, tid - 288);
        cp_async_wait_all();
        fence_proxy_async_smem();  // Q is read by wgmma only
        mbar_arrive(q_full_bar(sb));
      } else {
        const i32* bt_row = a.block_table + (long long)w.req * a.bt_stride;
        auto page_of = [&](int tile) { return __ldg(bt_row + ((tile * 64) >> a.page_shift)); };
        int cur = page_of(w.t_beg);
#pragma unroll 1
        for (int k = 0; k < nt; ++k) {
          const int tile = w.t_beg + k;
          const int nxt = k + 1 < nt ? page_of(tile + 1) : 0;  // one tile ahead
          const int off = (tile * 64) & (a.page_size - 1);
          tma_tile_pieces<NSLOT>(slot_addr(sb, 0), full_bar(sb, 0), empty_bar(sb, 0), &k_cb, off, kvh, cur, slot, ph);
          cur = nxt;
          MLA_MARK(a, 13, nq == 0 && k == 0);
        }
        MLA_MARK(a, 14, true);
      }
      ++nq;
    }
    }  // pw != 0 || lane == 0
    __syncwarp();
    return;
  }

  // ===================================================================== consumer warpgroups
  const int cu = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3, tw = tid & 127;
  const int bar_wg = BAR_WG0 + cu;
  float* red = reinterpret_cast<float*>(smem + OFF_RED) + cu * 4 * NQ;
  float* lred = reinterpret_cast<float*>(smem + OFF_LRED) + cu * 4 * NQ;
  float* xml = reinterpret_cast<float*>(smem + OFF_XML);
  int* s_merge = reinterpret_cast<int*>(smem + OFF_MERGE);
  const u32 p_base = sb + OFF_P + (u32)cu * QCB;
  const float sc = a.scale_log2;
  const int rows = M - row0 < NQ ? M - row0 : NQ;
  auto release = [&](int slot) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar(sb, slot));
  };
  int nq = 0, gtile = 0, n_merge = 0;  // items with tiles, tiles so far (ring position 9 gtile), merges won
  WorkItem it;
#pragma unroll 1
  while (next_item(it)) {
    const int nt = item_tiles(it);
    float ot[8][NACC], m_run[NJ][2], l_run[NJ][2];
    int lim[NJ][2];
    const int lim_min = init_row_state(a, it.len, it.tok_end, row0, t, ot, m_run, l_run, lim);

    if (nt > 0) {
      mbar_wait_wd(q_full_bar(sb), (u32)nq & 1u);  // this item's Q (fenced by its copy threads)
      MLA_MARK(a, 2 + 3 * nq, nq < 3 && tid == 0);
#pragma unroll 1
      for (int k = (gtile ^ cu) & 1; k < nt; k += 2) {
        const int tile = it.t_beg + k, p0 = 9 * (gtile + k);
        float st[NACC], st1[NACC];
#pragma unroll
        for (int i = 0; i < NACC; ++i) st[i] = st1[i] = 0.f;
        // pin the values before the first wgmma (no register moves inside a wgmma pipeline stage)
        reg_fence(st);
        reg_fence(st1);
#pragma unroll
        for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
#pragma unroll 1
        for (int c = 0; c < NCB; ++c) {
          const int p = p0 + c;
          mbar_wait_wd(full_bar(sb, piece_slot(p)), piece_phase(p));
          wgmma_fence();
          qk_piece(st, st1, slot_addr(sb, piece_slot(p)), sb + OFF_Q + (u32)c * QCB, c == 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(st);
        reg_fence(st1);
#pragma unroll
        for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
        release(piece_slot(p0 + 8));  // channels 512..575: S^T only
        float sv[NACC];
#pragma unroll
        for (int i = 0; i < NACC; ++i) sv[i] = st[i] + st1[i];

        softmax_tile(sv, tile, w, g, t, lim, lim_min, sc, red, bar_wg, m_run, l_run, p_base, ot);
        if ((tile + 1) * 64 > it.tok_end) {  // rows >= tok_end of pieces 0..7 (their S^T is complete)
          const int first = it.tok_end - tile * 64;
#pragma unroll 1
          for (int i = tw; i < 8 * 64 * 8; i += 128) {
            const int m = i >> 9, r = (i >> 3) & 63, u = i & 7;
            if (r >= first) sts_zero16(slot_addr(sb, piece_slot(p0 + m)) + swz(r, u));
          }
        }
        fence_proxy_async_smem();
        named_bar_sync(bar_wg, 128);  // P complete; every red[] read done before the next tile's writes

        // ---- O^T += V^T P^T (pieces 0..7), k16 step outer so consecutive wgmmas use different sets
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int m = 0; m < 8; ++m) pv_step(ot[m], slot_addr(sb, piece_slot(p0 + m)), p_base, kk);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
#pragma unroll 1
        for (int m = 0; m < 8; ++m) release(piece_slot(p0 + m));
      }
      gtile += nt;
      MLA_MARK(a, 3 + 3 * nq, nq < 3 && tid == 0);
    }

    // ---- row sums: over the 8 lanes g of a row, then over the warpgroup's 4 warps
    float Lr[NJ][2];
    row_sums(l_run, w, g, t, lred, bar_wg, Lr);

    // ---- the merge of the two warpgroups: warpgroup u ends with channel blocks 4u .. 4u + 3 of the
    // merged O^T. Warpgroup 1 hands over its blocks 0..3, warpgroup 0 then its blocks 4..7, through
    // the same 16 KB of the Q region (a thread writes and reads only its own words there: the second
    // round's writes follow the first round's reads in program order). The Q region is free once both
    // warpgroups are past their last wgmma of the item (the first barrier) and until q_empty.
    if (nt > 0) {
      named_bar_sync(BAR_BOTH, 256);
      if (w == 0 && g == 0) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            xml[cu * 2 * NQ + 8 * j + 2 * t + e] = m_run[j][e];
            xml[cu * 2 * NQ + NQ + 8 * j + 2 * t + e] = Lr[j][e];
          }
      }
      if (cu == 1) xchg_store(sb + OFF_Q, ot, 0, tw);
      named_bar_sync(BAR_BOTH, 256);
      float a_own[NJ][2], a_oth[NJ][2];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = 8 * j + 2 * t + e;
          const float mo = xml[(cu ^ 1) * 2 * NQ + n], Lo = xml[(cu ^ 1) * 2 * NQ + NQ + n];
          const float mn = fmaxf(m_run[j][e], mo);
          a_own[j][e] = fast_exp2(m_run[j][e] - mn);
          a_oth[j][e] = fast_exp2(mo - mn);
          m_run[j][e] = mn;
          Lr[j][e] = Lr[j][e] * a_own[j][e] + Lo * a_oth[j][e];
        }
      if (cu == 0) {
        xchg_merge(sb + OFF_Q, ot, 0, tw, a_own, a_oth);
        xchg_store(sb + OFF_Q, ot, 4, tw);
      }
      named_bar_sync(BAR_BOTH, 256);
      if (cu == 1) xchg_merge(sb + OFF_Q, ot, 4, tw, a_own, a_oth);
    }
    const int cb0 = 4 * cu;  // this warpgroup's channel blocks of the merged O^T

    // ---- out / lse (warpgroup 0 writes lse), or the partial and the ticket
    if (it.nsplit == 1) {
      if (nt > 0) {
        // normalised output staged as [row][512] 16-bit (row stride STG_BF16) in the Q region
        const u32 stg = sb + OFF_Q;
        named_bar_sync(BAR_BOTH, 256);  // every exchange read is done
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * j + 2 * t + e;
            const float inv = Lr[j][e] > 0.f ? 1.f / Lr[j][e] : 0.f;
#pragma unroll
            for (int mm = 0; mm < 4; ++mm)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int ch = 64 * (cb0 + mm) + 16 * w + g + 8 * h;
                const float v = cu == 0 ? ot[mm][4 * j + 2 * h + e] : ot[4 + mm][4 * j + 2 * h + e];  // static indices
                sts_u16(stg + (u32)n * STG_BF16 + 2u * ch, half_bits<DT>(v * inv));
              }
          }
        named_bar_sync(BAR_BOTH, 256);
        for (int item = tid; item < rows * 64; item += 256) {
          const int r = item >> 6, c = (item & 63) * 8;
          *reinterpret_cast<U32x4*>(out_row_ptr(a, it.req, kvh, row0 + r) + c) =
              lds_u32x4(stg + (u32)r * STG_BF16 + 2u * c);
        }
      } else {  // no key: out 0
        for (int item = tid; item < rows * 64; item += 256) {
          const int r = item >> 6, c = (item & 63) * 8;
          *reinterpret_cast<U32x4*>(out_row_ptr(a, it.req, kvh, row0 + r) + c) = U32x4{0u, 0u, 0u, 0u};
        }
      }
      if (cu == 0 && w == 0 && g == 0) {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * j + 2 * t + e;
            if (n < rows) store_row_stats(a, lse_ptr(a, it.req, kvh, row0 + n), Lr[j][e], m_run[j][e]);
          }
      }
    } else {
      // ---- a shared request: the fp32 partial (written even when empty) and {m, l}, then the ticket
      const long long prow0 = (long long)it.slot * NQ;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = 8 * j + 2 * t + e;
          if (n < rows) {
            float* dst = a.ws_o + (prow0 + n) * MLA_D_V + 64 * cb0 + 16 * w + g;
#pragma unroll
            for (int mm = 0; mm < 4; ++mm)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                store_partial1(dst + 64 * mm + 8 * h, cu == 0 ? ot[mm][4 * j + 2 * h + e] : ot[4 + mm][4 * j + 2 * h + e]);
            if (cu == 0 && w == 0 && g == 0) store_partial2(a.ws_ml + 2 * (prow0 + n), m_run[j][e], Lr[j][e]);
          }
        }
      const long long unit = ((long long)it.req * a.h_kv + kvh) * nmb + mb;
      if (last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), it.nsplit, tid,
                         [] { named_bar_sync(BAR_BOTH, 256); }))
        note_merge_won(s_merge, n_merge, it, tid);
    }
    if (nt > 0) {
      MLA_MARK(a, 4 + 3 * nq, nq < 3 && tid == 0);
      mbar_arrive(q_empty_bar(sb));  // this item's reads of the Q region are done
      ++nq;
    }
  }  // items
  pdl_launch_dependents();
  MLA_MARK(a, 11, tid == 0);

  // ---- merges won (both warpgroups): every issued load was consumed, the ring is idle
  run_merges_won<NQ, 256, DT>(a, s_merge, n_merge, reinterpret_cast<float*>(smem + OFF_RING), kvh, nmb, mb, row0, rows,
                              tid, [] { named_bar_sync(BAR_BOTH, 256); });
  MLA_MARK(a, 12, tid == 0);
}
