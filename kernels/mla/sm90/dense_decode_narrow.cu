// gqadrv — MLA dense decode for few packed rows per KV head (M = s_q * h_q / h_kv <= MLA_NQ, NQ = 16
// or 32), sm_90a, wgmma with tokens as the M dimension: the memory-bound regime (e.g. h_q 16, s_q 1),
// where padding the rows to 64 would quadruple the tensor work. Same semantics, arguments, split-KV
// and last-CTA merge as dense_decode.cu; the row block is NQ rows (nmb = ceil(M / NQ)).
//
// Math      per 64-token tile, transposed so that the 64 tokens fill wgmma's M = 64:
//             S^T[64 tok x NQ]  = K[64 x 576] Q^T          wgmma m64nNQk16 x 36, A = K (K-major), B = Q
//             O^T[512 x NQ]    += V^T[512 x 64] P^T         wgmma m64nNQk16 x 32, A = V^T (MN-major,
//                                                          transposed read of the K tile), B = P (K-major)
//           O^T lives in 8 accumulator sets (one per 64-channel block), NQ / 2 fp32 each per thread.
// CTA work  grid (nmb * S, h_kv, b), blockIdx.x = mb + nmb * split: NQ packed rows (zero-filled past M)
//           against the tiles [ntiles * split / S, ntiles * (split + 1) / S), ntiles = ceil(key_len / 64).
// Warps     256 threads: warpgroup 0 (warps 0..3) computes; warpgroup 1 (warps 4..7) produces, warp
//           4 + p copying rows 16p .. 16p+15 of every piece. In the consumer
//           warp w holds S^T / O^T rows (tokens or channels) 16w .. 16w+15; lane 4g + t holds columns
//           (query rows) 8j + 2t + e, j < NQ / 8, e < 2.
// Smem map  (base rounded up to 1024 B)
//           [0, 9 NQ 128)        Q: 9 channel blocks of NQ rows x 128 B, 128B swizzle (B of S^T)
//           + NQ x 128 B          P: NQ rows x 64 tokens, swizzled K-major (B of O^T)
//           + MLA_NSLOT x 8 KB    piece ring: one piece = one channel block (64 tokens x 128 B,
//                                 swizzled) of one tile; tile i uses pieces 9 i .. 9 i + 8 in ring order,
//                                 so a wgmma operand never spans two pieces (every wgmma above reads
//                                 exactly one channel block of A)
//           + red[4][NQ], lred[4][NQ] fp32, 2 MLA_NSLOT + 1 mbarriers, ticket
//           epilogue: the ring holds the output staging rows, then the [NQ][S] merge weights.
// Pipeline  producer (each of the 4 warps): per piece wait empty[slot] (parity starts at 1), 4 cp.async
//           of 16 B per lane (4 rows x 128 B per instruction; zero-fill for tokens >= tok_end, whose
//           block-table entries are never read), cp.async.mbarrier.arrive.noinc on full[slot] (count
//           128: every producer thread). Block-table entries of the next tile are loaded one tile
//           ahead (1 per lane, shuffled to the rows).
//           consumer, tile i: wait S^T(i) (and O^T += ...(i-1)); release the pieces of tile i-1
//           (channel blocks 0..7) and piece 8 of tile i (empty[slot], one arrival per warp);
//           softmax (column max over the 64 tokens: shuffles over g, then red[] + named barrier 1);
//           P^T -> smem; barrier; issue O^T += V^T P^T (i), then S^T(i+1) piece by piece (each piece:
//           wait full[slot], fence.proxy.async, wgmma.fence, 4 k-steps). The ring keeps up to
//           MLA_NSLOT - 9 pieces (>= 14, 112 KB) in flight while a tile is computed.
// Masking   as dense_decode.cu (scaled logits of keys >= the row's limit -> -1e33, running max from
//           -1e30); K/V rows >= tok_end are zero-filled, so NaN in unused cache pages never reaches O.
// TMA mode  (MLA_TMA_K=1, entry mla_dense_decode_narrow_tma(k_cb, args); pages of 64..256 tokens):
//           k_cb is the 5-D CUtensorMap of k_cache (64 channels, page tokens, 9 channel blocks, h_kv,
//           num_blocks) with box (64, 64, 1, 1, 1), 128B swizzle: one TMA writes one piece. One
//           producer thread (warp 4, lane 0; the other producer threads exit) waits empty[slot] and
//           issues arrive.expect_tx(8 KB) on full[slot] (count 1) + the TMA, piece by piece in ring
//           order, reading each tile's block-table entry one tile ahead. The consumer needs no proxy
//           fence after a full wait (one after the Q wait: Q is still copied with cp.async). Rows >=
//           tok_end of the split's last tile come from a real page and may hold anything, so the
//           consumer zeroes them in pieces 0..7 of that tile (after its S^T, before its O^T update;
//           the fence and barrier after the P stores cover those writes).
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "narrow_ops.cuh"

#ifndef MLA_NSLOT
#error "MLA_NSLOT not defined (pieces of 8 KB in the ring)"
#endif

namespace mla {
namespace narrow {
constexpr int NSLOT = MLA_NSLOT;
constexpr u32 OFF_Q = 0;
constexpr u32 OFF_P = NCB * QCB;
constexpr u32 OFF_RING = OFF_P + QCB;
constexpr u32 OFF_RED = OFF_RING + NSLOT * PIECE;
constexpr u32 OFF_LRED = OFF_RED + 4 * NQ * 4;
constexpr u32 OFF_BAR = OFF_LRED + 4 * NQ * 4;  // full[NSLOT], empty[NSLOT], q
constexpr u32 OFF_TICKET = OFF_BAR + 8u * (2 * NSLOT + 2);
constexpr u32 SMEM_USED = OFF_TICKET + 16;
constexpr int THREADS = 256;
constexpr u32 STG_BF16 = 1024u + 16u;          // output staging row strides (bank spread)
constexpr u32 STG_F32 = 2048u + 16u;
static_assert(NSLOT >= 18, "the ring must hold two tiles (9 pieces each)");
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the narrow smem map (+1 KB alignment slack)");
static_assert(NQ * STG_F32 <= NSLOT * PIECE, "output staging must fit in the ring");
static_assert((u32)NQ * MLA_MAX_SPLITS * 4u <= NSLOT * PIECE, "merge weights must fit in the ring");
static_assert(OFF_P % 1024 == 0 && OFF_RING % 1024 == 0 && QCB % 1024 == 0, "swizzle atoms are 1 KB aligned");

constexpr int BAR_C = 1;  // named barrier of the consumer warpgroup (128 threads)
#ifndef MLA_TMA_K
#define MLA_TMA_K 0  // 1: pieces by TMA from one producer thread (header comment)
#endif

GQADRV_DEVICE u32 full_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)slot; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int slot) { return sb + OFF_BAR + 8u * (u32)(NSLOT + slot); }
GQADRV_DEVICE u32 q_bar(u32 sb) { return sb + OFF_BAR + 8u * (u32)(2 * NSLOT); }
GQADRV_DEVICE u32 slot_addr(u32 sb, int slot) { return sb + OFF_RING + (u32)slot * PIECE; }

}  // namespace narrow
}  // namespace mla

#if MLA_TMA_K
extern "C" __global__ void __launch_bounds__(mla::narrow::THREADS, 1)
    mla_dense_decode_narrow_tma(const __grid_constant__ TmaDesc k_cb, const __grid_constant__ MlaDecodeArgs a) {
#else
extern "C" __global__ void __launch_bounds__(mla::narrow::THREADS, 1)
    mla_dense_decode_narrow(const __grid_constant__ MlaDecodeArgs a) {
#endif
  using namespace mla;
  using namespace mla::narrow;
  const int tid = threadIdx.x;
  u8* smem;
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);  // base rounded up to 1 KB

  const int lane = tid & 31, warp = tid >> 5;
  const int nmb = a.num_m_blocks, S = a.num_splits;
  const int mb = (int)blockIdx.x % nmb, split = (int)blockIdx.x / nmb;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int M = a.m_rows, row0 = mb * NQ;

  if (tid == 0) {
#if MLA_TMA_K
    tma_prefetch_desc(&k_cb);
    constexpr u32 FULL_COUNT = 1;  // one arrive.expect_tx per piece
#else
    constexpr u32 FULL_COUNT = 128;  // every producer thread
#endif
#pragma unroll 1
    for (int i = 0; i < NSLOT; ++i) {
      mbar_init(full_bar(sb, i), FULL_COUNT);
      mbar_init(empty_bar(sb, i), 4);
    }
    mbar_init(q_bar(sb), 128);
    fence_mbarrier_init();
  }

  pdl_wait();  // no-op unless launched with programmatic stream serialization
  const int len = clamped_len(a, b);
  const int last_row = (M - row0 < NQ ? M - row0 : NQ) - 1 + row0;
  const int key_len = row_key_limit(a, len, last_row);
  const int ntiles = (key_len + 63) >> 6;
  const int t_beg = split_point(ntiles, split, S), t_end = split_point(ntiles, split + 1, S);
  const int tok_end = min(key_len, t_end * 64);
  const i32* bt_row = a.block_table + (long long)b * a.bt_stride;
  __syncthreads();  // barriers initialised

  if (warp >= 4) {
    // =================================================================== producer warpgroup
    // Warp pw = warp - 4 copies rows 16 pw .. 16 pw + 15 of every piece (4 cp.async of 16 B per lane
    // per piece: row 16 pw + 4 q + (lane >> 3), unit lane & 7). One producer warp alone (the first
    // version) could not keep enough copies in flight: 2.1 TB/s against 4 TB/s for the seesaw's
    // producer warpgroup; four warps issue a quarter each.
#if MLA_TMA_K
    if (t_beg < t_end && warp == 4 && lane == 0) {
      auto page_of = [&](int tile) { return __ldg(bt_row + ((tile * 64) >> a.page_shift)); };
      int cur = page_of(t_beg);
      int slot = 0;
      u32 ph = 0;
#pragma unroll 1
      for (int tile = t_beg; tile < t_end; ++tile) {
        const int nxt = tile + 1 < t_end ? page_of(tile + 1) : 0;  // one tile ahead
        const int off = (tile * 64) & (a.page_size - 1);
        tma_tile_pieces<NSLOT>(slot_addr(sb, 0), full_bar(sb, 0), empty_bar(sb, 0), &k_cb, off, kvh, cur, slot, ph);
        cur = nxt;
      }
    }
    return;
#endif
    if (t_beg < t_end) {
      const int pw = warp - 4;
      const int u = lane & 7, rsub = lane >> 3;
      const u16* kbase = a.k_cache + (long long)kvh * a.k_stride_head + u * 8;
      const int pmask = a.page_size - 1, pshift = a.page_shift;
      // block-table entry of token tile * 64 + 16 pw + (lane & 15) (lanes 16..31 repeat 0..15)
      auto fetch = [&](int tile) {
        const int tok = tile * 64 + 16 * pw + (lane & 15);
        return tok < tok_end ? bt_row[tok >> pshift] : 0;
      };
      int cur = fetch(t_beg);
      int slot = 0;
      u32 ph = 0;
#pragma unroll 1
      for (int tile = t_beg; tile < t_end; ++tile) {
        const int nxt = tile + 1 < t_end ? fetch(tile + 1) : 0;
        const u16* src[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int rl = 4 * q + rsub, tok = tile * 64 + 16 * pw + rl;
          const int blk = __shfl_sync(0xffffffffu, cur, rl);
          src[q] = tok < tok_end
                       ? kbase + (long long)blk * a.k_stride_block + (long long)(tok & pmask) * a.k_stride_tok
                       : nullptr;
        }
#pragma unroll 1
        for (int c = 0; c < NCB; ++c) {
          mbar_wait_wd(empty_bar(sb, slot), ph ^ 1u);
          const u32 dst = slot_addr(sb, slot);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int r = 16 * pw + 4 * q + rsub;
            const bool ok = src[q] != nullptr;
            cp_async_16(dst + swz(r, u), ok ? (const void*)(src[q] + c * 64) : (const void*)a.k_cache, ok ? 16u : 0u);
          }
          cp_async_mbar_arrive_noinc(full_bar(sb, slot));
          if (++slot == NSLOT) {
            slot = 0;
            ph ^= 1u;
          }
        }
        cur = nxt;
      }
      cp_async_wait_all();
    }
    return;
  }

  // ===================================================================== consumer warpgroup
  const int w = warp, g = lane >> 2, t = lane & 3;
  float ot[8][NACC], m_run[NJ][2], l_run[NJ][2];
  int lim[NJ][2];
  const int lim_min = init_row_state(a, len, tok_end, row0, t, ot, m_run, l_run, lim);
  const float sc = a.scale_log2;
  float* red = reinterpret_cast<float*>(smem + OFF_RED);

  if (t_beg < t_end) {
    {  // Q rows of this block (rows >= M zero-filled): warp w copies rows 4 w + (lane >> 3) (+16 h)
      const int u = lane & 7;
#pragma unroll
      for (int h = 0; h < NQ / 16; ++h) {
        const int r = 16 * h + 4 * w + (lane >> 3), rg = row0 + r;
        const u16* src = rg < M ? q_row_ptr(a, b, kvh, rg) + u * 8 : nullptr;
#pragma unroll
        for (int c = 0; c < NCB; ++c)
          cp_async_16(sb + OFF_Q + (u32)c * QCB + swz(r, u), src ? (const void*)(src + c * 64) : (const void*)a.q,
                      src ? 16u : 0u);
      }
      cp_async_mbar_arrive_noinc(q_bar(sb));
    }
    mbar_wait_wd(q_bar(sb), 0);
#if MLA_TMA_K
    fence_proxy_async_smem();  // Q (cp.async, generic proxy) before the first wgmma reads it
#endif

    float st[NACC], st1[NACC];
    int qslot = 0;  // ring position of the next piece to compute S^T with
    u32 qph = 0;
    auto issue_qk = [&]() {
#pragma unroll 1
      for (int c = 0; c < NCB; ++c) {
        mbar_wait_wd(full_bar(sb, qslot), qph);
#if !MLA_TMA_K
        cpasync_to_wgmma_fence();
#endif
        wgmma_fence();
        qk_piece(st, st1, slot_addr(sb, qslot), sb + OFF_Q + (u32)c * QCB, c == 0);
        if (++qslot == NSLOT) {
          qslot = 0;
          qph ^= 1u;
        }
      }
      wgmma_commit();
    };
    auto release = [&](int slot) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar(sb, slot));
    };

#pragma unroll
    for (int i = 0; i < NACC; ++i) st[i] = st1[i] = 0.f;
    // pin the initial values before the first wgmma is issued (no register moves may land inside
    // a wgmma pipeline stage, or ptxas serialises every wgmma)
    reg_fence(st);
    reg_fence(st1);
#pragma unroll
    for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
    issue_qk();
    int base = 0;       // ring slot of piece 0 of the current tile
    int prev_base = 0;  // ... of the previous tile
#pragma unroll 1
    for (int tile = t_beg; tile < t_end; ++tile) {
      wgmma_wait<0>();
      reg_fence(st);
      reg_fence(st1);
#pragma unroll
      for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
      float sv[NACC];  // S^T of this tile
#pragma unroll
      for (int i = 0; i < NACC; ++i) sv[i] = st[i] + st1[i];
      if (tile > t_beg) {
#pragma unroll 1
        for (int c = 0; c < 8; ++c) release(prev_base + c < NSLOT ? prev_base + c : prev_base + c - NSLOT);
      }
      release(base + 8 < NSLOT ? base + 8 : base + 8 - NSLOT);

      softmax_tile(sv, tile, w, g, t, lim, lim_min, sc, red, BAR_C, m_run, l_run, sb + OFF_P, ot);
#if MLA_TMA_K
      if ((tile + 1) * 64 > tok_end) {  // rows >= tok_end of pieces 0..7 (their S^T is complete)
        const int first = tok_end - tile * 64;
#pragma unroll 1
        for (int i = tid; i < 8 * 64 * 8; i += 128) {
          const int m = i >> 9, r = (i >> 3) & 63, u = i & 7;
          if (r >= first) sts_zero16(slot_addr(sb, base + m < NSLOT ? base + m : base + m - NSLOT) + swz(r, u));
        }
      }
#endif
      fence_proxy_async_smem();
      named_bar_sync(BAR_C, 128);  // P complete; every red[] read done before the next tile's writes

      // ---- O^T += V^T P^T (pieces 0..7 of this tile), then S^T of the next tile
      wgmma_fence();
      // k16 step outer, channel block inner: consecutive wgmmas update different accumulators
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int m = 0; m < 8; ++m)
          pv_step(ot[m], slot_addr(sb, base + m < NSLOT ? base + m : base + m - NSLOT), sb + OFF_P, kk);
      wgmma_commit();
      prev_base = base;
      base = base + 9 < NSLOT ? base + 9 : base + 9 - NSLOT;
      if (tile + 1 < t_end) issue_qk();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
  }
  pdl_launch_dependents();

  // ---- row sums: over the 8 lanes g of a row, then over the 4 warps
  float Lr[NJ][2];
  row_sums(l_run, w, g, t, reinterpret_cast<float*>(smem + OFF_LRED), BAR_C, Lr);
  const int rows = M - row0 < NQ ? M - row0 : NQ;
  const u32 stg = sb + OFF_RING;  // the ring is idle: every piece was consumed

  if (S == 1) {
    // normalised output staged as [row][512] 16-bit (row stride STG_BF16), then 16-byte stores
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * j + 2 * t + e;
        const float inv = Lr[j][e] > 0.f ? 1.f / Lr[j][e] : 0.f;
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int ch = 64 * m + 16 * w + g + 8 * h;
            sts_u16(stg + (u32)n * STG_BF16 + 2u * ch, half_bits<DT>(ot[m][4 * j + 2 * h + e] * inv));
          }
        if (w == 0 && g == 0 && n < rows)
          store_row_stats(a, lse_ptr(a, b, kvh, row0 + n), Lr[j][e], m_run[j][e]);
      }
    named_bar_sync(BAR_C, 128);
    for (int item = tid; item < rows * 64; item += 128) {
      const int r = item >> 6, c = (item & 63) * 8;
      *reinterpret_cast<U32x4*>(out_row_ptr(a, b, kvh, row0 + r) + c) = lds_u32x4(stg + (u32)r * STG_BF16 + 2u * c);
    }
    return;
  }

  // ---- split > 1: fp32 partial (written even when empty) and {m, l}, then the ticket
  const long long unit = ((long long)b * a.h_kv + kvh) * nmb + mb;
  const long long slot0 = (unit * S + split) * NQ;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
#pragma unroll
      for (int m = 0; m < 8; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ch = 64 * m + 16 * w + g + 8 * h;
          sts_f32(stg + (u32)n * STG_F32 + 4u * ch, ot[m][4 * j + 2 * h + e]);
        }
      if (w == 0 && g == 0 && n < rows)
        *reinterpret_cast<F32x2*>(a.ws_ml + 2 * (slot0 + n)) = F32x2{m_run[j][e], Lr[j][e]};
    }
  named_bar_sync(BAR_C, 128);
  for (int item = tid; item < rows * 128; item += 128) {
    const int r = item >> 7, c = (item & 127) * 4;
    float v0, v1, v2, v3;
    lds_f32x4(stg + (u32)r * STG_F32 + 4u * c, v0, v1, v2, v3);
    float* dst = a.ws_o + (slot0 + r) * MLA_D_V + c;
    *reinterpret_cast<F32x2*>(dst) = F32x2{v0, v1};
    *reinterpret_cast<F32x2*>(dst + 2) = F32x2{v2, v3};
  }
  if (!last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), S, tid,
                      [] { named_bar_sync(BAR_C, 128); }))
    return;
  merge_partials<NQ, 128, DT>(a, reinterpret_cast<float*>(smem + OFF_RING), unit, S, b, kvh, row0, rows, tid,
                              [] { named_bar_sync(BAR_C, 128); });
}
