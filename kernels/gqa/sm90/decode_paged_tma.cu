// gqadrv — GQA decode from paged KV caches, TMA route (sm_90a; the same source builds for sm_100a
// and sm_110a). Multi-token queries, LSE and the batch-invariant split mode as the cp.async paged
// kernel (sm80/decode_paged.cu), whose schedule, row blocks and tail it shares
// (gqa/common/paged_cta.cuh). Entry point gqa_decode_paged_tma(TmaDesc k_map, TmaDesc v_map,
// GqaPagedArgs). Host: gqadrv/gqa/paged.py (used for page sizes >= 16).
//
// CTA work   one (batch b, KV head kvh, row block rb, split s) of the grid B*Hkv*RB*S, as in the
//            cp.async kernel: ROWS query rows against the split's sub-tiles of TOK tokens.
//            GQA_PAGED_MULTI builds (development): one-split launches on a smaller grid walk units
//            blockIdx.x, + gridDim.x, ... (see MULTI_BUILD below).
// Warps      GQA_WARPS identical consumer warps, no producer warp: warp w takes sub-tiles
//            begin+w, begin+w+W, ... of its split, or with GQA_PAGED_FLAG_SPEC and balanced splits
//            s*W+w, s*W+w+S*W, ... (interleaved: independent of the length); its lanes
//            0..NBOX-1 load the page ids of the sub-tile's boxes one ring step ahead (block table),
//            lane 0 issues the TMA loads of its private ring. A sub-tile is NBOX = TOK / min(TOK,
//            page) boxes of min(TOK, page) tokens per 64-channel block, each inside one page.
// Start      after griddepcontrol.wait the length load is issued first (D = 256 builds: with the
//            schedule, as before; they never speculate); with GQA_PAGED_FLAG_SPEC
//            (one-wave grids) the first STAGES sub-tiles' page ids are read beside it and their TMA
//            loads issued before the length arrives (entries up to the capacity: past the request's
//            pages they only reach TMA, which zero-fills out-of-pool ids, and loads past the length
//            are waited out unused); without it the page ids of tokens >= len are never read.
//            GQA_PAGED_NEXT builds (development): launches of several waves prefetch the successor
//            CTA's first sub-tiles into L2 while this CTA's rings drain (see NEXT_BUILD below).
// Tiles      4-D tensor maps over the K and V pools: NHD (D, Hkv, page, pages), box
//            {64, 1, BT, 1}; HND (D, page, Hkv, pages), box {64, BT, 1, 1} (GQA_PAGED_FLAG_HND);
//            128B swizzle, so a slot holds D/64 blocks of TOK rows x 128 B exactly as the other
//            routes (WarpDecoder<..., CAUSAL = true>, mma.sync m16n8k16). GQA_KV8 = 1 (e4m3, D >= 128):
//            uint8 maps with boxes of 128 codes per row, D/128 blocks (WarpDecoder<..., KV8 = true>). Boxes of tokens >= len
//            (outside the speculative fill) use page coordinate -1 and page ids outside [0, num_pages) are out of the map: TMA
//            fills both with zeros without reading memory (still counted by complete_tx).
// Smem map   [0, W*STAGES*SLOT) rings (slot = K then V, D/64 blocks of TOK x 128 B, 1024-byte
//            aligned), reused after the loop as the MergeArea and the split-merge scratch (cluster
//            launches: every CTA's receive area past both, RecvArea of cluster_merge.cuh);
//            mbarriers full[W][STAGES] in static shared memory. GQA_PAGED_MULTI: each warp's state
//            goes into the ring slot it read last (s_free), the next unit's q rows are staged in
//            s_qs[2][ROWS*D] (static, cp.async), s_slot_bad[W][STAGES] marks slots with a bad page id.
// Barriers   full[w][slot]: count 1, lane 0 arrive.expect_tx(SLOT) + 2*NB*NBOX boxes complete it;
//            parity (i / STAGES) & 1 for the warp's i-th sub-tile, plus one on the slots whose
//            speculative fill was waited out and dropped (`shifted`). A slot is refilled by lane 0
//            after __syncwarp + fence.proxy.async (its readers are its own warp). __syncthreads
//            before the warp states become the merge area and before the merge; split ticket:
//            cta_epilogue_rows (gqa/common/cta.cuh).
// Splits     a plain launch merges S > 1 splits through the split workspace and the ticket; a
//            launch with clusters of S = num_splits CTAs (2..16, D <= 128, balanced splits; the host
//            decides, gqa/paged.launch_shape) merges them in the CTAs' shared memory instead: each
//            CTA receives the others' states of its chunk of the output items past the ring
//            (RecvArea), recv_bar and one cluster barrier, see gqa/common/cluster_merge.cuh.
#include "../common/config.cuh"
#include "../common/paged_cta.cuh"

namespace {
constexpr int DT = GQA_DT, D = GQA_D, ROWS = GQA_ROWS, W = GQA_WARPS, TOK = GQA_TOK,
              STAGES = GQA_STAGES;
constexpr bool KV8 = GQA_KV8 != 0;
using Decoder = PagedDecoder<DT, D, ROWS, TOK, KV8>;
constexpr int EPB = KV8 ? 128 : 64;  // elements per 128-byte box row (one e4m3 code = one byte)
constexpr int NB = D / EPB;
constexpr u32 SLOT_BYTES = 2u * Decoder::KV_BYTES;
static_assert(!KV8 || D >= 128, "e4m3 rows of 64 bytes take the cp.async route");
constexpr int LOG2_TOK = TOK == 16 ? 4 : (TOK == 32 ? 5 : 6);
static_assert(TOK == 16 || TOK == 32 || TOK == 64, "tokens per sub-tile");
constexpr u32 RING_BYTES = (u32)W * STAGES * SLOT_BYTES;
using RA = RecvArea<D, ROWS, W, RING_BYTES>;
// The cluster merge is built for D <= 128 (routes.cluster_merge_applies), as in decode_tma.cu; so is
// the speculative start (GQA_PAGED_FLAG_SPEC, paged.speculates): the D = 256 e4m3 16-row build has
// no register left for it (a 4-byte spill on sm_90a).
constexpr bool CLUSTER_MERGE = D <= 128;
constexpr bool SPEC_BUILD = D <= 128;
// GQA_PAGED_NEXT = n > 0 (development switch, GQADRV_PAGED_NEXT=n): in launches of more than one wave
// (the host puts the successor stride G in the flags' high bits, GQA_PAGED_NEXT_SHIFT) each warp,
// once its own ring stops refilling, prefetches into L2 the first n sub-tiles that warp w of CTA
// x + G (the CTA that takes a freed SM next) will load first: its length is read beside this
// CTA's, its block-table entries one step before the prefetches (only entries below its length,
// only page ids inside the pool). Nothing is written; the successor's own loads then find L2.
#ifndef GQA_PAGED_NEXT
#define GQA_PAGED_NEXT 0
#endif
constexpr int NEXT_SUBS = GQA_PAGED_NEXT > STAGES ? STAGES : (GQA_PAGED_NEXT < 0 ? 0 : GQA_PAGED_NEXT);
constexpr bool NEXT_BUILD = NEXT_SUBS > 0 && D <= 128;
// GQA_PAGED_MULTI = K (development switch, GQADRV_PAGED_MULTI=K): launches of one split without
// speculation or clusters may use a grid smaller than the units (the host sizes it, paged.launch_shape:
// ceil(units / K) CTAs, or the resident CTAs for K = 1); each CTA then walks units blockIdx.x,
// + gridDim.x, ... and every warp's ring runs on across them: the loads of the next unit's first
// sub-tiles are issued as the slots of this unit free up, so a unit's start no longer waits for its
// first boxes. The resident form (K = 1) was 1.4-4.8 % slower on an H100 (2026-12-08: the static
// order loses the hardware's placement of CTAs on the SMs that free first); K >= 2 keeps that
// placement at K units per CTA. At a unit's end each warp
// stores its state into the slot it read last (refilled only after the unit's output is written),
// and the CTA merges the W states from there: ROWS x (D + 8) floats plus the {m, l} pairs must fit a
// slot (STATE_BYTES). Other launches (splits, the batch-invariant mode, one-wave speculation) take the
// one-unit path below unchanged.
#ifndef GQA_PAGED_MULTI
#define GQA_PAGED_MULTI 0
#endif
constexpr u32 STATE_BYTES = (u32)ROWS * 2 * 4 + (u32)ROWS * StateLayout<D>::STRIDE * 4;
constexpr bool MULTI_BUILD = GQA_PAGED_MULTI != 0 && D <= 128 && STATE_BYTES <= SLOT_BYTES;
}  // namespace

extern "C" __global__ void __launch_bounds__(W * 32, 1)
    gqa_decode_paged_tma(const __grid_constant__ TmaDesc k_map, const __grid_constant__ TmaDesc v_map,
                         const GqaPagedArgs args) {
  extern __shared__ __align__(1024) u8 smem[];
  __shared__ __align__(8) u64 full_bar[W][STAGES];
  __shared__ u32 s_ticket;
  __shared__ u32 s_bad[W];
  __shared__ __align__(8) u64 recv_bar;  // cluster launches: the split merge's receive barrier
  __shared__ int s_free[MULTI_BUILD ? W : 1];               // GQA_PAGED_MULTI: the slot holding warp w's state
  __shared__ u32 s_slot_bad[MULTI_BUILD ? W : 1][STAGES];  // GQA_PAGED_MULTI: a box of the slot's load was bad
  __shared__ __align__(16) u16 s_qs[MULTI_BUILD ? 2 : 1][MULTI_BUILD ? ROWS * D : 8];  // GQA_PAGED_MULTI: next unit's q
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0 && (smem_u32(smem) & 1023u)) __trap();  // the 128B swizzle needs 1 KB alignment
  // Cluster launches (S = num_splits CTAs of one unit (batch, KV head, row block), rank = split)
  // merge the splits in the CTAs' shared memory (cluster_merge.cuh); only the balanced split mode
  // (split_subs == 0) may run so, and a launch whose cluster or shared memory does not match traps.
  const u32 ncl_launch = cluster_nctarank();
  if (ncl_launch > 1 && threadIdx.x == 0 &&
      (!CLUSTER_MERGE || ncl_launch != (u32)args.num_splits || ncl_launch > (u32)CLUSTER_MERGE_MAX ||
       args.split_subs > 0 || dynamic_smem_bytes() < RA::OFFSET + RA::BYTES))
    __trap();
  const u32 ncl = CLUSTER_MERGE ? ncl_launch : 1u, crank = ncl > 1 ? cluster_ctarank() : 0u;
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&full_bar[warp][s]), 1);
    if (warp == 0 && ncl > 1) {  // the unit's state rows, from the grid position alone (no memory read)
      const int rb = ((int)blockIdx.x / args.num_splits) % args.row_blocks;
      const int rows = args.rows - rb * ROWS < ROWS ? args.rows - rb * ROWS : ROWS;
      cluster_recv_init(smem_u32(&recv_bar), crank, ncl, rows, D);
    }
    fence_mbarrier_init();
    if (warp == 0) {
      tma_prefetch_desc(&k_map);
      tma_prefetch_desc(&v_map);
    }
  }
  __syncwarp();
  if (ncl > 1) cluster_arrive_relaxed();  // after the inits: see cluster_merge.cuh
  // Everything up to griddepcontrol.wait reads no memory (grid position, kernel parameters).
  const PagedSchedule unit = paged_unit(args);
  const u64 policy = (args.flags & GQA_FLAG_L2_EVICT_FIRST) ? l2_policy_evict_first() : l2_policy_evict_normal();
  const bool hnd = (args.flags & GQA_PAGED_FLAG_HND) != 0;
  const bool spec_on = SPEC_BUILD && (args.flags & GQA_PAGED_FLAG_SPEC) != 0;
  const int bshift = args.page_shift < LOG2_TOK ? args.page_shift : LOG2_TOK;  // log2 of box rows
  const int nbox = TOK >> bshift;                                                // 1 .. TOK / 16 (page >= 16)
  const int in_page = (1 << args.page_shift) - 1;
  const int* trow = args.table + (long long)unit.b * args.table_stride;
  u8* ring = smem + (size_t)warp * STAGES * SLOT_BYTES;
  bool bad = false;

  // Page id of box `lane` of sub-tile `sub` (lanes < nbox): -1 at or past `limit` (no table read).
  auto fetch_at = [&](int sub, int limit) -> int {
    const int t = sub * TOK + (lane << bshift);
    if (lane >= nbox || t >= limit) return -1;
    return __ldg(trow + (t >> args.page_shift));
  };
  // Lanes < nbox: whether this lane's box of sub-tile `sub` starts below `len` on a page id outside the pool.
  auto bad_box = [&](int sub, int my_pg, int len) -> bool {
    return lane < nbox && sub * TOK + (lane << bshift) < len && (unsigned)my_pg >= (unsigned)args.num_pages;
  };
  // Sub-tile `sub` of KV head `kvh` into ring slot `slot_idx`: all lanes (shuffles); lane 0 issues.
  auto issue_kvh = [&](int slot_idx, int sub, int my_pg, int kvh) {
    const int tok0 = sub * TOK;
    const u32 slot = smem_u32(ring + (size_t)slot_idx * SLOT_BYTES);
    const u32 bar = smem_u32(&full_bar[warp][slot_idx]);
    if (lane == 0) mbar_arrive_expect_tx(bar, SLOT_BYTES);
    for (int k = 0; k < nbox; ++k) {
      const int pg = __shfl_sync(0xffffffffu, my_pg, k);
      if (lane == 0) {
        const int tin = (tok0 + (k << bshift)) & in_page;
        const int c1 = hnd ? tin : kvh, c2 = hnd ? kvh : tin;
#pragma unroll
        for (int cb = 0; cb < NB; ++cb) {
          const u32 dst = slot + cb * TOK * 128 + (k << bshift) * 128;
          tma_load_4d(dst, &k_map, bar, EPB * cb, c1, c2, pg, policy);
          tma_load_4d(dst + SLOT_BYTES / 2, &v_map, bar, EPB * cb, c1, c2, pg, policy);
        }
      }
    }
  };
  auto issue = [&](int slot_idx, int sub, int my_pg) { issue_kvh(slot_idx, sub, my_pg, unit.kvh); };

  // ---- speculative ring fill (GQA_PAGED_FLAG_SPEC): the first sub-tiles of this warp, from table
  // entries read beside the length (not after it). Balanced splits then take the sub-tiles in
  // interleaved order (warp w of split s: s * W + w, then every S * W-th), so a warp's sub-tiles do
  // not depend on the length and the fill is exact up to the request's last sub-tile; the
  // batch-invariant mode's fixed splits guess len = capacity (exact for every split holding tokens).
  // Entries past the request's pages only reach TMA (out-of-pool ids are zero-filled); loads past
  // the length are waited out, never used.
  const bool inter = spec_on && args.split_subs == 0;
  const int step = inter ? args.num_splits * W : W;  // between this warp's sub-tiles
  auto warp_range = [&](const PagedSchedule& s, int& first, int& count) {
    if (inter) {
      first = s.split * W + warp;
      const int nsub = (s.len + TOK - 1) / TOK;
      count = first < nsub ? (nsub - first + step - 1) / step : 0;
    } else {
      first = s.sub_begin + warp;
      count = first < s.sub_end ? (s.sub_end - first + W - 1) / W : 0;
    }
  };
  int first_c, count_c;
  warp_range(paged_schedule(args, unit, TOK, args.capacity), first_c, count_c);  // no memory read
  const int spec = spec_on ? (count_c < STAGES ? count_c : STAGES) : 0;
  GQA_MARK(args, 0);
  GQA_MARK_SM(args);
  pdl_wait();
  GQA_MARK(args, 1);
  // The length first (the one load the schedule depends on; D = 256 builds read it in paged_schedule,
  // as before the speculative start: their registers are all taken), then the guessed sub-tiles'
  // table entries beside it, then the prefetches of the q rows and the table row.
  const int raw_len = SPEC_BUILD ? args.lengths[unit.b] : 0;
  // GQA_PAGED_NEXT: the successor CTA (x + G) and its length, loaded beside this CTA's
  PagedSchedule succ{};
  int succ_raw = 0;
  bool has_succ = false;
  if constexpr (NEXT_BUILD) {
    const int G = (int)((u32)args.flags >> GQA_PAGED_NEXT_SHIFT);
    has_succ = G > 0 && (int)blockIdx.x + G < (int)gridDim.x;
    if (has_succ) {
      succ = paged_unit_at(args, (int)blockIdx.x + G);
      succ_raw = __ldg(args.lengths + succ.b);
    }
  }
  if constexpr (MULTI_BUILD) {
    if (!spec_on && args.num_splits == 1 && args.split_subs == 0 && ncl == 1 && args.units > 0) {
      // ---- GQA_PAGED_MULTI: units blockIdx.x, + G, ... with one ring sequence per warp
      const int G = (int)gridDim.x, n_units = args.units;
      auto len_of = [&](int u) -> int { return u < n_units ? __ldg(args.lengths + paged_unit_at(args, u).b) : 0; };
      // issue cursor: unit iu, its k-th sub-tile of this warp (ic of them from ifirst, step W)
      int iu = (int)blockIdx.x, ik = -1, ic = 0, ifirst = 0, ilen = 0, ikvh = 0;
      const int* irow = trow;
      int i_pre = len_of(iu + G);  // the next unit's length, in flight
      auto i_setup = [&](int u, int raw) {
        const PagedSchedule q = paged_schedule(args, paged_unit_at(args, u), TOK, raw);
        ilen = q.len;
        ifirst = q.sub_begin + warp;
        ic = ifirst < q.sub_end ? (q.sub_end - ifirst + W - 1) / W : 0;
        irow = args.table + (long long)q.b * args.table_stride;
        ikvh = q.kvh;
        ik = -1;
      };
      i_setup(iu, raw_len);
      auto i_advance = [&]() -> bool {  // to the next (unit, sub-tile) of this warp; false past the last unit
        ++ik;
        while (ik >= ic) {
          iu += G;
          if (iu >= n_units) return false;
          i_setup(iu, i_pre);
          i_pre = len_of(iu + G);
          ik = 0;
        }
        return true;
      };
      auto i_fetch = [&]() -> int {  // page id of box `lane` of the cursor's sub-tile (-1 past its length)
        const int t = (ifirst + ik * W) * TOK + (lane << bshift);
        return (lane < nbox && t < ilen) ? __ldg(irow + (t >> args.page_shift)) : -1;
      };
      auto i_issue = [&](int slot_idx, int my_pg) {  // all lanes; lane 0 issues the cursor's sub-tile
        const int sub = ifirst + ik * W;
        const bool b = __any_sync(0xffffffffu, bad_box(sub, my_pg, ilen));
        if (lane == 0) s_slot_bad[warp][slot_idx] = b ? 1u : 0u;
        issue_kvh(slot_idx, sub, my_pg, ikvh);
      };
      // the first STAGES positions of the warp's sequence
#pragma unroll 1
      for (int s = 0; s < STAGES; ++s) {
        if (!i_advance()) break;
        i_issue(s, i_fetch());
      }
      __syncwarp();  // lane 0's s_slot_bad words before any lane reads them
      int c_raw = raw_len, c_pre = len_of((int)blockIdx.x + G);
      long long pos = 0;  // consumer position in the warp's sequence
      int it = 0;         // units done by this CTA (the q staging buffer of unit it is s_qs[it & 1])
#pragma unroll 1
      for (int u = (int)blockIdx.x; u < n_units; u += G, ++it) {
        const PagedSchedule sc = paged_schedule(args, paged_unit_at(args, u), TOK, c_raw);
        c_raw = c_pre;
        c_pre = len_of(u + 2 * G);
        const int first = sc.sub_begin + warp;
        const int count = first < sc.sub_end ? (sc.sub_end - first + W - 1) / W : 0;
        Decoder dec;
        dec.init(lane);
        // q of the first unit from global memory, of later ones from the copy staged during the unit before
        if (it == 0)
          paged_load_q(dec, args, sc, lane);
        else
          paged_load_q_staged(dec, args, sc, lane, s_qs[it & 1]);
        if (it == 0) pdl_launch_dependents();
        if (u + G < n_units) {  // stage the next unit's q (read after this unit's barriers)
          paged_stage_q<D, ROWS>(args, paged_unit_at(args, u + G), s_qs[(it + 1) & 1], threadIdx.x, W * 32);
          cp_async_commit();
        }
        bool ubad = false;
        int free_slot = -1;
        for (int k = 0; k < count; ++k) {
          const int slot = (int)(pos % STAGES);
          const bool last = k == count - 1;
          bool more = false;
          int nxt = -1;
          if (!last) {
            more = i_advance();
            if (more) nxt = i_fetch();  // in flight during this step
          }
          mbar_wait(smem_u32(&full_bar[warp][slot]), (u32)((pos / STAGES) & 1));
          if (s_slot_bad[warp][slot]) ubad = true;
          SwizzledSmemChunks src{ring + (size_t)slot * SLOT_BYTES};
          dec.step(src, (first + k * W) * TOK, sc.len, args.scale_log2);
          __syncwarp();
          if (more) {
            if (lane == 0) fence_proxy_async_smem();
            i_issue(slot, nxt);
          }
          if (last) free_slot = slot;  // refilled after the unit's output is written
          ++pos;
        }
        // ---- unit end: states into the free slots, merge, output rows, status words
        dec.finish();
        const int row0 = sc.rb * ROWS;
        const int rows_here = args.rows - row0 < ROWS ? args.rows - row0 : ROWS;
        if (free_slot >= 0) {
          float* base = reinterpret_cast<float*>(ring + (size_t)free_slot * SLOT_BYTES);
          dec.store_state(base, base + ROWS * 2, rows_here);
        }
        {
          const bool any_bad = __any_sync(0xffffffffu, ubad);
          if (lane == 0) {
            s_free[warp] = free_slot;
            s_bad[warp] = any_bad ? 1u : 0u;
          }
        }
        cp_async_wait<0>();  // this thread's part of the next unit's q
        __syncthreads();
        if (!GQA_TRACE && args.status != nullptr && sc.kvh == 0 && sc.rb == 0 && threadIdx.x == 0) {
          u32* st = args.status + (long long)sc.b * 2;
          st[0] = sc.raw_len <= 0 ? 1u : (sc.raw_len > args.capacity ? 2u : 0u);
          u32 b = 0u;
#pragma unroll
          for (int w = 0; w < W; ++w) b |= s_bad[w];
          st[1] = b;
        }
        paged_multi_store_unit<DT, D, ROWS, W, STAGES, SLOT_BYTES>(args, sc, smem, s_free, rows_here);
        __syncthreads();  // every state read: the free slots may be refilled
        if (free_slot >= 0 && i_advance()) {
          const int my_pg = i_fetch();
          if (lane == 0) fence_proxy_async_smem();
          i_issue(free_slot, my_pg);
          __syncwarp();
        }
      }
      return;
    }
  }
  int pg[STAGES];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) pg[s] = s < spec ? fetch_at(first_c + s * step, args.capacity) : -1;
  if (warp == 0) paged_prefetch<ROWS, D>(args, lane);
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < spec) issue(s, first_c + s * step, pg[s]);
  GQA_MARK(args, 10);  // the speculative boxes issued (their page ids arrived)

  const PagedSchedule sc = SPEC_BUILD ? paged_schedule(args, unit, TOK, raw_len) : paged_schedule(args, TOK);
  GQA_MARK(args, 2);
#if GQA_PAGED_DET_EXIT
  if (paged_idle_split(args, sc)) {  // a batch-invariant split past the request's tokens
    for (int s = 0; s < spec; ++s) mbar_wait(smem_u32(&full_bar[warp][s]), 0u);  // no copy outlives the CTA
    return;
  }
#endif
  int first, count;
  warp_range(sc, first, count);
  // Keep the speculative loads when this warp's first sub-tile matches (then every kept load is the
  // right one: same first, same step; always so in the interleaved order); otherwise wait them out
  // and refill: those slots are one phase ahead.
  const bool keep = spec > 0 && first == first_c;
  int shifted = 0;  // slots [0, shifted) carry one extra completed phase
  if (keep) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (s < spec && s < count && bad_box(first + s * step, pg[s], sc.len)) bad = true;
  } else {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) pg[s] = s < count ? fetch_at(first + s * step, sc.len) : -1;
    if (spec > 0) {
      for (int s = 0; s < spec; ++s) mbar_wait(smem_u32(&full_bar[warp][s]), 0u);
      shifted = spec;
      __syncwarp();
      if (lane == 0) fence_proxy_async_smem();
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (s < count) {
        if (bad_box(first + s * step, pg[s], sc.len)) bad = true;
        issue(s, first + s * step, pg[s]);
      }
  }

  Decoder dec;
  dec.init(lane);
  paged_load_q(dec, args, sc, lane);
  pdl_launch_dependents();

  // GQA_PAGED_NEXT: the successor warp's first sub-tiles (page id of box `lane`), read at step
  // pf_step - 1 (or at pf_step when the warp has no earlier step) and prefetched from pf_step on, one
  // per step: the steps after this warp's last refill, when its ring drains.
  int spg[NEXT_BUILD ? NEXT_SUBS : 1];
  int s_first = 0, s_count = 0, s_len = 0;
  const int pf_step = count > STAGES ? count - STAGES : 0;
  for (int i = 0; i < count; ++i) {
    const int nxt = i + STAGES < count ? fetch_at(first + (i + STAGES) * step, sc.len) : -1;  // in flight during this step
    if constexpr (NEXT_BUILD) {
      if (has_succ && i == (pf_step > 0 ? pf_step - 1 : 0)) {
        const PagedSchedule ss = paged_schedule(args, succ, TOK, succ_raw);
        warp_range(ss, s_first, s_count);
        s_len = ss.len;
        const int* srow = args.table + (long long)succ.b * args.table_stride;
#pragma unroll
        for (int k = 0; k < NEXT_SUBS; ++k) {
          const int t = (s_first + k * step) * TOK + (lane << bshift);
          spg[k] = (k < s_count && lane < nbox && t < s_len) ? __ldg(srow + (t >> args.page_shift)) : -1;
        }
      }
    }
    const int slot = i % STAGES;
    mbar_wait(smem_u32(&full_bar[warp][slot]), (u32)(((i / STAGES) + (slot < shifted ? 1 : 0)) & 1));
    if (i == 0) GQA_MARK(args, 3);
    SwizzledSmemChunks src{ring + (size_t)slot * SLOT_BYTES};
    dec.step(src, (first + i * step) * TOK, sc.len, args.scale_log2);
    __syncwarp();
    if (i + STAGES < count) {
      if (lane == 0) fence_proxy_async_smem();
      if (bad_box(first + (i + STAGES) * step, nxt, sc.len)) bad = true;
      issue(slot, first + (i + STAGES) * step, nxt);
    }
    if constexpr (NEXT_BUILD) {
      if (has_succ) {
#pragma unroll
        for (int k = 0; k < NEXT_SUBS; ++k) {
          if (k < s_count && i == pf_step + k) {  // warp-uniform
            const int tok0 = (s_first + k * step) * TOK;
            for (int kb = 0; kb < nbox; ++kb) {
              const int pg = __shfl_sync(0xffffffffu, spg[k], kb);
              if (lane == 0 && (unsigned)pg < (unsigned)args.num_pages) {  // -1: past the length
                const int tin = (tok0 + (kb << bshift)) & in_page;
                const int c1 = hnd ? tin : succ.kvh, c2 = hnd ? succ.kvh : tin;
#pragma unroll
                for (int cb = 0; cb < NB; ++cb) {
                  tma_prefetch_l2_4d(&k_map, EPB * cb, c1, c2, pg);
                  tma_prefetch_l2_4d(&v_map, EPB * cb, c1, c2, pg);
                }
              }
            }
          }
        }
      }
    }
  }
  // Kept speculative loads past the real sub-tile count: let them land before smem is reused.
  if (keep)
    for (int s = count; s < spec; ++s) mbar_wait(smem_u32(&full_bar[warp][s]), 0u);
  GQA_MARK(args, 4);
  paged_cta_tail<W, RING_BYTES>(dec, args, sc, smem, &s_ticket, s_bad, bad, warp, lane,
                                ClusterMergeCtx{ncl, crank, smem_u32(&recv_bar)});
}
