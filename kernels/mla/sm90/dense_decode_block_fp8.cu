// gqadrv — MLA dense decode on FlashMLA's 656-byte FP8 cache, "block" schedule (sm_90a, wgmma): one
// 64-token tile at a time, a register-fed dequantizing producer and two consumer warpgroups, and with
// MLA_XOVER=2 FlashMLA's "crossover" (shared/reference/flashmla.md §4.2): the two CTAs of a cluster
// hold the two 64-row blocks of the same (request, split, KV head), and each producer dequantizes
// half of every tile's token rows into both CTAs' shared memory, so each tile is converted once.
// Same semantics, arguments, grid, split-KV and last-CTA merge as dense_decode_seesaw.cu (MLA_FP8=1);
// bf16 q only.
//
// CTA work  grid (nmb * S, h_kv, b), blockIdx.x = mb + nmb * split: 64 packed rows (zero-filled past M)
//           against the 64-token tiles [t_beg, t_beg + ntiles) of the split (ntiles = ceil(key_len / 64)
//           split in whole tiles). MLA_XOVER=2: __cluster_dims__(2, 1, 1) (nmb even, so the cluster is
//           row blocks 2k, 2k + 1 of one split); key_len is the largest key limit of the cluster's valid
//           rows, so both CTAs walk the same tiles (each masks its own rows' limits).
// Warps     384 threads, setmaxnreg WG0 208 (.inc), WG1 160 and WG2 136 (.dec; .inc below the current
//           count is an illegal instruction): 128 x (208 + 160 + 136) = 384 x 168 (no spills in either build).
//           WG0 (warps 0..3): S = Q K^T (m64n64k16 SS x 36), masking, the online softmax (running max
//                 and row sums in registers), P -> sP (bf16, swizzled K-major) and the per-row rescale
//                 factor -> sScale, O_L = O_L a + sP V[:, 0:256] (SS); it issues the next tile's Q K^T
//                 right behind its P V.
//           WG1 (warps 4..7): O_R = O_R a + sP V[:, 256:512] (SS) per tile, a from sScale.
//           WG2 (warps 8..11): producer. Q by cp.async once. Thread x owns quarter q = x & 3 of token
//                 rows: row 32 rank + (x >> 2) of every tile (XOVER 2, rank = the CTA's cluster rank),
//                 or rows x >> 2 and 32 + (x >> 2) (XOVER 1). A quarter row = code bytes [128q, 128q +
//                 128) (channel blocks 2q, 2q + 1) and scale q: 33 registers, double-buffered, so the
//                 next row part's loads (ld.global.nc) are in flight while this one is converted; rows
//                 are also prefetched into L2 (cp.async.bulk.prefetch, 656 B) two tiles ahead. XOVER 2:
//                 every 16-byte result is stored into this CTA and into the peer CTA at the same offset
//                 (st.shared::cluster). The RoPE block (cb 8, bf16 as stored) every CTA copies for
//                 itself by cp.async (row x >> 1, units 4 (x & 1) ..), right after the slot's empty
//                 wait. Rows >= tok_end are not read (neither the cache nor the block table): zeros.
// Smem map  (dynamic, base rounded up to 1024 B; all blocks 1024-aligned)
//           [0, 72K)      Q   64 rows x 576: 9 channel blocks (cb) of 64 rows x 128 B, 128B swizzle
//           [72K, 144K)   K[0] tile slot (bf16, same layout), [144K, 216K) K[1]
//           [216K, 224K)  sP  64 x 64 bf16 (K-major, swizzled; A operand of both warpgroups' SS P V)
//           + sScale[64], sM[64] (fp32, unused), lsum[2][64] (fp32), 7 mbarriers, ticket
//           merge: the K slots hold the [64][S] merge weights after the main loop.
// Barriers  (mbarriers; parities from the tile index i, slot i & 1, fill n = i >> 1)
//           full[slot]: the whole tile written; one arrival per producer warp of every CTA of the
//                 cluster after __syncwarp (4 XOVER; remote ones release.cluster, waits acquire.cluster)
//                 + 128 cp.async.mbarrier.arrive.noinc of this CTA's RoPE copies
//           empty[slot]: WG0 (Q K^T and P V_L retired) and WG1 (P V_R retired) of every CTA of the
//                 cluster, one arrival per warp (8 XOVER); tiles i >= ntiles - 2 are not released (no
//                 fill waits for them), so no peer arrival reaches a CTA after its last wait
//           p_full: sP and sScale of tile i written + proxy-fenced by WG0 (128: every writer arrives)
//           p_empty: WG1's P V_R of tile i retired (4 warp arrivals); WG0 writes sP again after it
//           q: Q landed (cp.async.mbarrier.arrive.noinc, 128)
//           named barrier 5 (EPI, 256 consumer threads) in the epilogue, 6 (WG0's own 128 threads).
//           XOVER 2 starts with a cluster barrier (every barrier initialised before any remote access).
//           Tiles are written with generic stores: the readers execute fence.proxy.async after their
//           waits (WG1 after p_full, which orders it after WG0's full waits), as for cp.async data.
// Masking   as the seesaw: logits of keys >= the row's limit are set to -1e33 after scaling (log2
//           domain); the running max starts at -1e30; rows >= tok_end of the last tile are zeros.
// Split     as the seesaw: S == 1 writes out / lse; S > 1 writes the fp32 partial and {m, l}, takes an
//           acq_rel ticket, and the last CTA merges (then resets the counter to 0).
#include "../../common/cluster.cuh"
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/fp8_rows.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "tile64_ops.cuh"

namespace mla {
namespace blockfp8 {
using seesaw::CB;
using seesaw::DT;
static_assert(MLA_DT == 1, "the FP8 cache is read with bf16 q only");
constexpr u32 TILE = NCB * CB;  // 73728
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_K0 = TILE;
constexpr u32 OFF_P = 3 * TILE;
constexpr u32 OFF_SC = OFF_P + CB;
constexpr u32 OFF_SM = OFF_SC + 256;
constexpr u32 OFF_LSUM = OFF_SM + 256;
constexpr u32 OFF_BAR = OFF_LSUM + 512;  // full[2], empty[2], p_full, p_empty, q
constexpr u32 OFF_TICKET = OFF_BAR + 64;
constexpr u32 SMEM_USED = OFF_TICKET + 16;
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the block_fp8 smem map");
static_assert(64u * MLA_MAX_SPLITS * 4u <= 2u * TILE, "merge weights must fit in the K slots");
static_assert(MLA_BLOCK_M == 64 && MLA_BLOCK_N == 64, "tiling is fixed");
constexpr int THREADS = 384;
#ifndef MLA_XOVER
#define MLA_XOVER 1  // 2: crossover in clusters of two CTAs (see the header comment)
#endif
constexpr int XOVER = MLA_XOVER;
static_assert(XOVER == 1 || XOVER == 2, "MLA_XOVER is 1 or 2");
constexpr int NR = 2 / XOVER;  // token rows per producer thread and tile
#ifndef MLA_REGS0
#define MLA_REGS0 208
#endif
#ifndef MLA_REGS1
#define MLA_REGS1 160
#endif
#ifndef MLA_REGS2
#define MLA_REGS2 136
#endif
static_assert(MLA_REGS0 % 8 == 0 && MLA_REGS1 % 8 == 0 && MLA_REGS2 % 8 == 0 &&
                  128 * (MLA_REGS0 + MLA_REGS1 + MLA_REGS2) <= 384 * 168,
              "setmaxnreg budgets exceed the CTA's launch allocation (384 threads x 168 registers)");
enum : int { BAR_EPI = 5, BAR_WG0 = 6 };

GQADRV_DEVICE u32 full_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)slot; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)(2 + slot); }
GQADRV_DEVICE u32 p_full_bar(u32 sb) { return sb + OFF_BAR + 8u * 4u; }
GQADRV_DEVICE u32 p_empty_bar(u32 sb) { return sb + OFF_BAR + 8u * 5u; }
GQADRV_DEVICE u32 q_bar(u32 sb) { return sb + OFF_BAR + 8u * 6u; }

// This CTA and (XOVER 2) its peer: `peer_delta` is the peer's shared::cluster address of this CTA's
// shared-memory address 0 minus 0, i.e. peer address = local address + peer_delta (mapa keeps offsets).
struct Peer {
  u32 delta;
  GQADRV_DEVICE void store(u32 addr, u32 a0, u32 a1, u32 a2, u32 a3) const {
    fp8::sts_u32x4(addr, a0, a1, a2, a3);
#if MLA_XOVER == 2
    st_cluster_u32x4(addr + delta, a0, a1, a2, a3);
#endif
  }
  // One arrival per warp (after __syncwarp) on the local barrier and, XOVER 2, on the peer's.
  GQADRV_DEVICE void release(u32 bar, int lane) const {
    __syncwarp();
    if (lane == 0) {
#if MLA_XOVER == 2
      mbar_arrive_cluster(bar + delta);
#endif
      mbar_arrive(bar);
    }
  }
};
GQADRV_DEVICE u32 peer_delta_of(u32 sb) {
#if MLA_XOVER == 2
  return cluster_map(sb, cluster_ctarank() ^ 1u) - sb;
#else
  return 0u;
#endif
}
// Wait on a local barrier whose arrivals may come from the peer CTA (acquire at cluster scope).
GQADRV_DEVICE void wait_tile(u32 bar, u32 parity) {
#if MLA_XOVER == 2
  mbar_wait_cluster(bar, parity);
#else
  mbar_wait_wd(bar, parity);
#endif
}
GQADRV_DEVICE u32 slot_at(u32 sb, int slot) { return sb + OFF_K0 + (u32)slot * TILE; }

// The producer thread's quarter of one token row, in registers: code bytes [128q, 128q + 128) (channel
// blocks 2q, 2q + 1) and scale q (33 registers). All zero for a row not read.
struct QuarterRow {
  U32x4 c[8];
  float sc;

  GQADRV_DEVICE void load(const u8* row, int q) {
    if (row != nullptr) {
#pragma unroll
      for (int k = 0; k < 8; ++k) c[k] = ld_global_nc_v4(row + 128 * q + 16 * k);
      sc = __ldg(reinterpret_cast<const float*>(row + fp8::SCALES_AT) + q);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) c[k] = U32x4{0u, 0u, 0u, 0u};
      sc = 0.f;
    }
  }
  // Dequantize into row r of the tile at `k` (and the peer's copy): blocks 2q, 2q + 1.
  GQADRV_DEVICE void store(u32 k, int r, int q, const Peer& peer) const {
    const U32x4 lo[4] = {c[0], c[1], c[2], c[3]};
    const U32x4 hi[4] = {c[4], c[5], c[6], c[7]};
    const u32 b0 = k + (u32)(2 * q) * CB, b1 = b0 + CB;
    fp8::dequant_block_row_with(lo, sc, [&](int u, u32 o0, u32 o1, u32 o2, u32 o3) { peer.store(b0 + swz(r, u), o0, o1, o2, o3); });
    fp8::dequant_block_row_with(hi, sc, [&](int u, u32 o0, u32 o1, u32 o2, u32 o3) { peer.store(b1 + swz(r, u), o0, o1, o2, o3); });
  }
};

GQADRV_DEVICE void prefetch_row_l2(const u8* row) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], 656;" ::"l"(row) : "memory");
}

// P = S (fp32, wgmma C layout of m64n64) to the swizzled 64 x 64 K-major bf16 block at p_base: the
// values and places of seesaw::pack_pa (factors 1) + store_pa, packed and stored pair by pair.
GQADRV_DEVICE void store_p(u32 p_base, const float (&s)[32], int r_lo, int r_hi, int t) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    sts_u32(p_base + swz(r_lo, 2 * kk) + 4u * t, pack2<DT>(s[8 * kk + 0], s[8 * kk + 1]));
    sts_u32(p_base + swz(r_hi, 2 * kk) + 4u * t, pack2<DT>(s[8 * kk + 2], s[8 * kk + 3]));
    sts_u32(p_base + swz(r_lo, 2 * kk + 1) + 4u * t, pack2<DT>(s[8 * kk + 4], s[8 * kk + 5]));
    sts_u32(p_base + swz(r_hi, 2 * kk + 1) + 4u * t, pack2<DT>(s[8 * kk + 6], s[8 * kk + 7]));
  }
}

// Issue S = Q K^T of the tile in `slot` once it is full (parity ph): 36 k-steps, one commit group.
GQADRV_DEVICE void issue_qk(float (&s)[32], u32 sb, int slot, u32 ph) {
  const u32 k = slot_at(sb, slot);
  u32 q = sb + OFF_Q;
  asm volatile("" : "+r"(q));  // descriptors derived per call, not hoisted out of the tile loop (registers)
  wait_tile(full_bar(sb, slot), ph);
  cpasync_to_wgmma_fence();
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < NCB; ++c) seesaw::qk_block(s, q, k, c, c == 0);
  wgmma_commit();
}

struct Cta {
  u32 sb;
  u8* smem;
  int tid, lane, wi, g, t, nmb, mb, split, S, kvh, b, M, row0;
  u32 peer_delta;  // XOVER 2: peer shared::cluster address - local address
};
struct Range {
  int len, ntiles, t_beg, tok_end;
};
// Key range of the CTA: the largest key limit of its valid rows, its split's whole tiles.
GQADRV_DEVICE Range cta_range(const MlaDecodeArgs& a, const Cta& c) {  // c.mb: this CTA's row block
  Range r;
  r.len = clamped_len(a, c.b);
  // the last valid row of the CTA's block (XOVER 2: of the cluster's two blocks, so both walk the same tiles)
  const int end = c.row0 - (XOVER == 2 ? (c.mb & 1) * MLA_BLOCK_M : 0) + XOVER * MLA_BLOCK_M;
  const int last_row = (c.M < end ? c.M : end) - 1;
  const int key_len = row_key_limit(a, r.len, last_row);
  const int ntiles_all = (key_len + 63) >> 6;
  r.t_beg = split_point(ntiles_all, c.split, c.S);
  r.ntiles = split_point(ntiles_all, c.split + 1, c.S) - r.t_beg;
  r.tok_end = min(key_len, (r.t_beg + r.ntiles) * 64);
  return r;
}

template <int WG>
GQADRV_DEVICE void main_loop(const MlaDecodeArgs& a, const Cta& c, const Range rg_, float (&o)[128], float& l_lo,
                             float& l_hi, float& m_lo, float& m_hi) {
  const u32 sb = c.sb;
  u8* const smem = c.smem;
  const int lane = c.lane, wi = c.wi, g = c.g, t = c.t, row0 = c.row0;
  const int len = rg_.len, ntiles = rg_.ntiles, t_beg = rg_.t_beg, tok_end = rg_.tok_end;
  const int r_lo = 16 * wi + g, r_hi = r_lo + 8;
  float* sSc = reinterpret_cast<float*>(smem + OFF_SC);
  const Peer peer{c.peer_delta};


  if (ntiles > 0) {
    if constexpr (WG == 0) {
      // =============================================================== warpgroup 0
      const int lim_lo = min(row_key_limit(a, len, row0 + r_lo), tok_end);
      const int lim_hi = min(row_key_limit(a, len, row0 + r_hi), tok_end);
      const int lim_min = min(row_key_limit(a, len, row0), tok_end);
      const float scl = a.scale_log2;
      float s[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      mbar_wait_wd(q_bar(sb), 0);
      reg_fence(o);
      reg_fence(s);
      issue_qk(s, sb, 0, 0u);
#pragma unroll 1
      for (int i = 0; i < ntiles; ++i) {
        const int slot = i & 1;
        wgmma_wait<0>();  // S(i) (and P V_L(i - 1), released below at i - 1)
        reg_fence(s);
        reg_fence(o);
        float mx_lo, mx_hi;
        seesaw::scale_mask_max(s, scl, t_beg + i, t, lim_lo, lim_hi, lim_min, mx_lo, mx_hi);
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        const float a_lo = fast_exp2(m_lo - mn_lo), a_hi = fast_exp2(m_hi - mn_hi);
        m_lo = mn_lo;
        m_hi = mn_hi;
        float sum_lo, sum_hi;
        seesaw::exp_rows(s, mn_lo, mn_hi, sum_lo, sum_hi);
        l_lo = l_lo * a_lo + sum_lo;
        l_hi = l_hi * a_hi + sum_hi;
        // P (bf16) and the rescale factors to shared memory for both warpgroups, once WG1's P V_R of
        // tile i - 1 retired
        mbar_wait_wd(p_empty_bar(sb), (u32)(i & 1) ^ 1u);
        store_p(sb + OFF_P, s, r_lo, r_hi, t);
        if (t == 0) {
          sSc[r_lo] = a_lo;
          sSc[r_hi] = a_hi;
        }
        fence_proxy_async_smem();
        mbar_arrive(p_full_bar(sb));  // every writer of sP / sScale arrives itself
        named_bar_sync(BAR_WG0, 128);  // all of sP written (WG0 reads it too)
        // O_L = O_L a + P V_L (SS), then the next tile's S behind it
        seesaw::scale_o(o, a_lo, a_hi);
        reg_fence(o);
        wgmma_fence();
        seesaw::pv_ss(o, sb + OFF_P, slot_at(sb, slot));
        wgmma_commit();
        if (i + 1 < ntiles) {
          issue_qk(s, sb, slot ^ 1, (u32)(((i + 1) >> 1) & 1));
          wgmma_wait<1>();  // P V_L(i) retired (S(i + 1) may still run; sP is rewritten only after the next p_empty wait)
        } else {
          wgmma_wait<0>();
        }
        reg_fence(o);
        if (i + 2 < ntiles) peer.release(empty_bar(sb, slot), lane);  // WG0's reads of K[slot] retired
      }
    } else {
      // =============================================================== warpgroup 1
#pragma unroll 1
      for (int i = 0; i < ntiles; ++i) {
        const int slot = i & 1;
        mbar_wait_wd(p_full_bar(sb), (u32)(i & 1));
        cpasync_to_wgmma_fence();  // sP (WG0's stores) and K[slot] (the producer's) for the async proxy
        const float f_lo = sSc[r_lo], f_hi = sSc[r_hi];
        seesaw::scale_o(o, f_lo, f_hi);
        reg_fence(o);
        wgmma_fence();
        seesaw::pv_ss(o, sb + OFF_P, slot_at(sb, slot) + 4u * CB);
        wgmma_commit();
        wgmma_wait<0>();
        reg_fence(o);
        seesaw::release(p_empty_bar(sb), lane);
        if (i + 2 < ntiles) peer.release(empty_bar(sb, slot), lane);
      }
    }
  }
}

// Epilogue of both consumer warpgroups (one code path, so that both reach its named barriers at the same
// instructions): row sums (WG1 holds none: l = 0), then out / lse, or the split partial and the merge.
GQADRV_DEVICE void epilogue(const MlaDecodeArgs& a, const Cta& c, const float (&o)[128], float l_lo, float l_hi,
                            float m_lo, float m_hi, int wg) {
  u8* const smem = c.smem;
  const int tid = c.tid, wi = c.wi, g = c.g, t = c.t, nmb = c.nmb, mb = c.mb, split = c.split, S = c.S;
  const int kvh = c.kvh, b = c.b, M = c.M, row0 = c.row0;
  const int r_lo = 16 * wi + g, r_hi = r_lo + 8;
  float L_lo, L_hi;
  sum_rows_2wg(reinterpret_cast<float*>(smem + OFF_LSUM), l_lo, l_hi, r_lo, r_hi, wg, t,
               [] { named_bar_sync(BAR_EPI, 256); }, L_lo, L_hi);
  const bool v_lo = row0 + r_lo < M, v_hi = row0 + r_hi < M;
  // m is read only by warpgroup 0's stores (lse, the split partial's {m, L})
  const RowPair rp{r_lo, r_hi, v_lo, v_hi, m_lo, m_hi, L_lo, L_hi};
  if (S == 1) {
    store_out_rows<DT>(a, o, rp, wg, t, [&](int rr) { return out_row_ptr(a, b, kvh, row0 + rr); },
                       [&](int rr) { return lse_ptr(a, b, kvh, row0 + rr); });
    return;
  }

  // ---- split > 1: this split's partial (written even when empty), then the ticket
  const long long unit = ((long long)b * a.h_kv + kvh) * nmb + mb;
  store_partial_rows(a, o, rp, (unit * S + split) * MLA_BLOCK_M, wg, t);
  if (!last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), S, tid,
                      [] { named_bar_sync(BAR_EPI, 256); }))
    return;
  const int rows = M - row0 < MLA_BLOCK_M ? M - row0 : MLA_BLOCK_M;
  merge_partials<MLA_BLOCK_M, 256, DT>(a, reinterpret_cast<float*>(smem + OFF_K0), unit, S, b, kvh, row0, rows, tid,
                                       [] { named_bar_sync(BAR_EPI, 256); });
}


}  // namespace blockfp8
}  // namespace mla

#if MLA_XOVER == 2
#define MLA_BLOCK_FP8_CLUSTER __attribute__((cluster_dims(2, 1, 1)))  // compile-time cluster: no launch attribute
#else
#define MLA_BLOCK_FP8_CLUSTER
#endif
extern "C" __global__ void __launch_bounds__(mla::blockfp8::THREADS, 1) MLA_BLOCK_FP8_CLUSTER
    mla_dense_decode_block_fp8(const __grid_constant__ MlaDecodeArgs a) {
  using namespace mla;
  using namespace mla::blockfp8;
  const int tid = threadIdx.x;
  u8* smem;
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);

  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
  const int nmb = a.num_m_blocks, S = a.num_splits;
  const int mb = (int)blockIdx.x % nmb, split = (int)blockIdx.x / nmb;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int M = a.m_rows, row0 = mb * MLA_BLOCK_M;

  if (tid == 0) {
    mbar_init(full_bar(sb, 0), 4 * XOVER + 128);  // producer warps of the cluster + this CTA's RoPE copies
    mbar_init(full_bar(sb, 1), 4 * XOVER + 128);
    mbar_init(empty_bar(sb, 0), 8 * XOVER);  // consumer warps of the cluster
    mbar_init(empty_bar(sb, 1), 8 * XOVER);
    mbar_init(p_full_bar(sb), 128);
    mbar_init(p_empty_bar(sb), 4);
    mbar_init(q_bar(sb), 128);
    fence_mbarrier_init();
  }
  pdl_wait();  // no-op unless launched with programmatic stream serialization
#if MLA_XOVER == 2
  cluster_sync_all();  // both CTAs' barriers initialised before any remote store or arrival
#else
  __syncthreads();  // barriers initialised (the last CTA-wide barrier: WG2 leaves early)
#endif

  if (wg == 2) {
    // =================================================================== producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MLA_REGS2));
    const int x = tid - 256, pw = wi;
    const Cta c{sb, smem, tid, lane, wi, g, t, nmb, mb, split, S, kvh, b, M, row0, peer_delta_of(sb)};
    const Range rg_ = cta_range(a, c);
    const int ntiles = rg_.ntiles, t_beg = rg_.t_beg, tok_end = rg_.tok_end;
    if (ntiles <= 0) return;
    const i32* bt_row = a.block_table + (long long)b * a.bt_stride;
    {  // Q rows of this block (rows >= M zero-filled): rows 16 pw + 4 q + (lane >> 3), every cb
      const int u = lane & 7;
#pragma unroll 1
      for (int q = 0; q < 4; ++q) {
        const int r = 16 * pw + 4 * q + (lane >> 3), rg = row0 + r;
        const u16* src = rg < M ? q_row_ptr(a, b, kvh, rg) + u * 8 : nullptr;
#pragma unroll
        for (int c = 0; c < NCB; ++c)
          cp_async_16(sb + OFF_Q + (u32)c * CB + swz(r, u), src != nullptr ? (const void*)(src + c * 64) : (const void*)a.q,
                      src != nullptr ? 16u : 0u);
      }
      cp_async_mbar_arrive_noinc(q_bar(sb));
    }
    const int q4 = x & 3, rl = x >> 2;
#if MLA_XOVER == 2
    const int r0 = 32 * (int)cluster_ctarank() + rl;  // the thread's token row of every tile
#else
    const int r0 = rl;  // and r0 + 32
#endif
    const Peer peer{c.peer_delta};
    auto row_in_tile = [&](int unit) { return NR == 2 && (unit & 1) ? r0 + 32 : r0; };  // no indexed array
    auto row_of = [&](int unit) {  // the thread's row of unit = tile * NR + k
      return fp8::row_at(a, bt_row, kvh, (t_beg + unit / NR) * 64 + row_in_tile(unit), tok_end);
    };
    const int nunits = ntiles * NR;
    if (q4 == 0) {  // L2 prefetch of the first two tiles' rows
#pragma unroll 1
      for (int u = 0; u < 2 * NR && u < nunits; ++u) {
        const u8* pf = row_of(u);
        if (pf != nullptr) prefetch_row_l2(pf);
      }
    }
    // unit u: load unit u + 1 into the other buffer, then convert this one into slot (u / NR) & 1
    auto step = [&](int u, QuarterRow& cur, QuarterRow& nxt) {
      if (u + 1 < nunits) nxt.load(row_of(u + 1), q4);
      const int i = u / NR, k = u % NR;
      if (k == 0) {
        if (q4 == 0 && u + 2 * NR < nunits) {
#pragma unroll
          for (int kk = 0; kk < NR; ++kk) {
            const u8* pf = row_of(u + 2 * NR + kk);
            if (pf != nullptr) prefetch_row_l2(pf);
          }
        }
        mbar_wait_wd(empty_bar(sb, i & 1), (u32)((i >> 1) & 1) ^ 1u);  // the first fill of a slot is free
        // this CTA's RoPE block of the tile (all 64 rows, every CTA its own): row x >> 1, units 4 (x & 1) ..
        const int rr = x >> 1, t0 = (t_beg + i) * 64 + rr;
        const u8* rp = fp8::row_at(a, bt_row, kvh, t0, tok_end);
        const u32 dst = slot_at(sb, i & 1) + 8u * CB;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int un = 4 * (x & 1) + v;
          cp_async_16(dst + swz(rr, un), rp != nullptr ? (const void*)(rp + fp8::ROPE_AT + 16 * un) : (const void*)a.k_cache,
                      rp != nullptr ? 16u : 0u);
        }
        cp_async_mbar_arrive_noinc(full_bar(sb, i & 1));
      }
      cur.store(slot_at(sb, i & 1), row_in_tile(u), q4, peer);
      if (k == NR - 1) peer.release(full_bar(sb, i & 1), lane);
    };
    QuarterRow part[2];
    part[0].load(row_of(0), q4);
#pragma unroll 1
    for (int u = 0; u < nunits; u += 2) {  // two units per trip: the buffers' roles stay static
      step(u, part[0], part[1]);
      if (u + 1 < nunits) step(u + 1, part[1], part[0]);
    }
    return;
  }

  // ===================================================================== consumer warpgroups
  // Each warpgroup runs its whole remaining path (loop and epilogue) after its own setmaxnreg, so that
  // ptxas sees one register budget per path.
  const Cta c{sb, smem, tid, lane, wi, g, t, nmb, mb, split, S, kvh, b, M, row0, peer_delta_of(sb)};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float l_lo = 0.f, l_hi = 0.f, m_lo = M_INIT, m_hi = M_INIT;
  if (wg == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MLA_REGS0));
    main_loop<0>(a, c, cta_range(a, c), o, l_lo, l_hi, m_lo, m_hi);
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MLA_REGS1));  // 160 < the launch's 168
    main_loop<1>(a, c, cta_range(a, c), o, l_lo, l_hi, m_lo, m_hi);
  }
  pdl_launch_dependents();
  epilogue(a, c, o, l_lo, l_hi, m_lo, m_hi, wg);
}
