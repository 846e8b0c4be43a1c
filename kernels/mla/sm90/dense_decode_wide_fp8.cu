// gqadrv — MLA dense decode on FlashMLA's 656-byte FP8 cache for 64-row blocks of packed query rows
// (M = s_q * h_q / h_kv > 16, e.g. h_q 64 or 128), sm_90a. Like dense_decode_narrow_fp8.cu, tokens are
// the wgmma M dimension of S^T = K Q^T and the consumer warpgroups dequantize the e4m3 codes straight
// into wgmma register A fragments; the 64 query rows are its N dimension. The two consumer warpgroups
// work on the same tile and split the channels: warpgroup u converts scale blocks 2u, 2u + 1 (latent
// channels 256u .. 256u + 255), once per tile: the fragments feed the S^T wgmmas and, by stmatrix,
// become the f16 V tile in shared memory that the same warpgroup's O += P V wgmmas (m64n256k16, both
// operands in shared memory) read for its 256 output channels.
//
// Math      per 64-token tile (pieces shared with the narrow kernel: fp8_tokm.cuh):
//             S^T[64 tok x 64 q] = sum over k of A[tok, k] Qh[q, k] + R'[tok] Qr^T
//                 A[tok, k] = f16(code) * f16(s_b[tok] * 2^E_tok) (one HMUL2 per code pair), E_tok =
//                 127 - (the largest biased exponent of the token's four scales), clamped to [-60, 60]:
//                 the token's largest scale becomes [1, 2). Qh: q * 2^-e_n in f16 (e_n per query row: the
//                 row's largest |q| in [2^14, 2^15), exact). R' = the bf16 RoPE channels * 2^E_tok (exact
//                 HMUL2.BF16), Qr = RoPE q * 2^-e_n (bf16); f16 and bf16 wgmmas share the accumulator.
//                 Warpgroup u: scale blocks 2u, 2u + 1 (16 k16 steps) + RoPE steps 2u, 2u + 1, a partial
//                 S^T; the logit is (partial_0 + partial_1) * 2^-E_tok * softmax_scale * 2^e_n.
//             O[64 q x 512] += P' A[:, latent], P'[q, tok] = f16(p * 2^(E_run - E_tok)), E_run = the
//                 smallest E_tok of the split so far (the accumulators are in units of 2^-E_run, rescaled
//                 with the running maxima when it falls), so P' <= 1; V is the stored A (the latent
//                 channels of A are V times 2^E_tok). Warpgroup u: 4 k16 steps of m64n256k16 over its
//                 256 channels.
//           With power-of-two scales (FlashMLA's quantizer) and tokens whose four scales lie within
//           2^24 of each other, every product equals the one on the dequantized cache; otherwise the
//           scales are applied in f16 instead of through a bf16 rounding of each element (a block scale
//           more than 2^24 below the token's largest, or a token whose E_tok exceeds E_run by more than
//           14, contributes with f16 subnormal precision).
// Layout    a half stage holds 32 token rows of 656 bytes as stored (codes, 4 fp32 scales at byte 512,
//           64 bf16 RoPE channels at byte 528); warps w = 0, 1 of each consumer warpgroup read the
//           tile's first half, w = 2, 3 the second. S^T: thread (w, g, t) owns tokens 16w + g (+8) and
//           reads the 16-byte units of fp8_tokm.cuh's logical order (conflict-free: 656 = 16 mod 128).
//           The V tile and O use that logical channel order: V block j (= 2b + jj) holds logical
//           channels 64j .. 64j + 63; O column 8i + 2t + e of warpgroup u (i = 8 grp + 2q + h) is
//           physical channel 16 (8 (2u + grp / 2) + 2t + grp % 2) + 4q + 2h + e, so a thread's 16
//           values of one row and group grp are 16 consecutive channels (two 16-byte stores).
// CTA work  grid (nmb * S, h_kv, b), blockIdx.x = mb + nmb * split: rows [64 mb, 64 mb + 64) of (request,
//           KV head) over the tiles [ntiles * split / S, ntiles * (split + 1) / S), ntiles =
//           ceil(key_len / 64), key_len the block's last row's key limit.
// Warps     384 threads. Warpgroups 0 and 1 (warps 0..7, setmaxnreg.inc to 240 registers) compute, both
//           on every tile, with the channel split above; warpgroup u owns the softmax of query columns
//           32u .. 32u + 31 (its running max / sums). Warpgroup 2 (warps 8..11, setmaxnreg.dec to 24)
//           produces (fp8_tokm.cuh: produce_rows with half stages). Nothing computed before setmaxnreg
//           stays live across it.
// Smem map  (base rounded up to 1024 B)
//           [0, 64 KB)        Qh: 8 blocks of 64 logical channels x 64 rows x 128 B, f16, 128B swizzle
//           + 8 KB            Qr: 64 rows x 64 logical RoPE channels, bf16, 128B swizzle
//           + 8 KB            P': 64 query rows x 64 tokens, f16, swizzled K-major (one, read by both)
//           + 2 x 8 KB        S^T exchange: warpgroup u's partial of the other's 32 columns
//           + 8 x 8 KB        V: 8 blocks of 64 tokens x 64 logical channels x 128 B, f16, 128B swizzle
//                             (read MN-major); blocks 4u .. 4u + 3 written and read by warpgroup u only
//           + 3 x 20,992 B    ring of NSTAGE half stages (32 x 656 B)
//           + red[2][32][4] / ered[2][4] / lred[2][4][32], qsc[64], alpha[64], lim[64], {m, L}[64],
//             running max [2][64], mbarriers full / empty [NSTAGE], ticket, wflag[2][4]
//           the merge weights ([64][S] fp32) use the exchange area, V and the ring after the last tile.
// Barriers  full[s] (count 2: one arrive.expect_tx per producer warp of the half, completed by its bulk
//           copies), empty[s] (count 128: every consumer thread of the half's four warps after its own
//           last read of the stage; with 3 slots a slot serves both halves in turn, so every producer
//           warp waits on both halves' empty barriers of a tile, in order). Named: 1 = both consumer warpgroups (256; per tile: partials
//           exchanged; P' and alpha written), 2 / 3 = warpgroup 0 / 1 (128; per tile: the softmax vote
//           (wg_all, flags wflag[u][4]); in the slow path column maxima and E_tok minima written; the
//           previous tile's P V wgmmas retired before V is overwritten).
// Pipeline  consumer thread, tile k, half stage 2k + w / 2: wait full; scales of its two tokens (in the
//           split's last tile, stale rows: its own units zeroed, scales dropped) -> E_tok and the f16
//           block factors; S^T in eight groups of 2 wgmmas (a group's codes converted while the previous one
//           runs, at most two in flight), each group's fragments stored to V (stmatrix), + 2 RoPE
//           wgmmas; release the half stage; write the other warpgroup's columns to the exchange,
//           barrier 1, add the other's partial of its own columns; softmax of its own columns: the
//           warpgroup votes (barrier 2 / 3) whether every logit is <= its column's running max + 8 and
//           every E_tok >= E_run; if so (most tiles) maxima, alpha (= 1) and E_run stay (p <= 2^8 then),
//           else the exact tile maxima and E_tok minimum through red[] / ered[] and barrier 2 / 3; P'
//           (stmatrix.trans of 8 x 8 blocks) and the rescale factors to smem; proxy fence; barrier 1;
//           rescale O (skipped when no max and E_run changed); O += P' V (4 wgmmas); wait; barrier 2 / 3.
// Masking   logits of keys >= the column's limit -> -1e33 (scaled, log2 domain), running max from -1e30;
//           in the split's last tile the rows >= tok_end of a half stage (stale bytes of an earlier tile
//           or never written): every thread zeroes the 16-byte units it reads itself before reading them
//           (no barrier) and takes their scales as 0, so their fragments, V rows and P' are 0 and their
//           E_tok (60) never lowers E_run.
// Split     S == 1 writes out (16-byte stores of 8 consecutive channels) and lse; S > 1 writes the fp32
//           partial and {m, l} of the rows, takes the ticket, and the last CTA merges.
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "fp8_tokm.cuh"

#if MLA_DT != 1
#error "the FP8 wide kernel takes bf16 q (MLA_DT=1)"
#endif

namespace mla {
namespace wfp8 {
using namespace tokm;
constexpr int NQ = 64;    // query rows per CTA (wgmma N of S^T, M of O)
constexpr int NACC = 32;  // fp32 accumulators per thread of one m64n64 result
#ifndef MLA_NSTAGE
#define MLA_NSTAGE 3
#endif
constexpr int NSTAGE = MLA_NSTAGE;   // half stages in the ring
constexpr u32 HSTAGE = 32u * ROW;    // 32 token rows
constexpr u32 QCB = (u32)NQ * 128u;  // one 64-channel block of Q / V (8 KB)
constexpr u32 OFF_QH = 0;
constexpr u32 OFF_QR = 8 * QCB;
constexpr u32 OFF_P = OFF_QR + QCB;
constexpr u32 OFF_X = OFF_P + QCB;  // + u * 8 KB
constexpr u32 OFF_V = OFF_X + 2 * 8192;
constexpr u32 OFF_RING = OFF_V + 8 * QCB;
constexpr u32 OFF_RED = OFF_RING + NSTAGE * HSTAGE;  // red[2][32][4] f32: [u][column][warp]
constexpr u32 OFF_ERED = OFF_RED + 2 * 4 * 32 * 4;   // ered[2][4] i32
constexpr u32 OFF_LRED = OFF_ERED + 2 * 4 * 4;       // lred[2][4][32] f32
constexpr u32 OFF_QSC = OFF_LRED + 2 * 4 * 32 * 4;   // qsc[64] f32: softmax scale (log2) * 2^e_n
constexpr u32 OFF_ALPHA = OFF_QSC + NQ * 4;          // alpha[64] f32
constexpr u32 OFF_LIM = OFF_ALPHA + NQ * 4;          // lim[64] i32: row key limits - 64 t_beg (split-relative)
constexpr u32 OFF_ML = OFF_LIM + NQ * 4;             // {m, L}[64]
constexpr u32 OFF_MRUN = OFF_ML + NQ * 8;            // running max [2][64] f32 (by tile parity)
constexpr u32 OFF_BAR = OFF_MRUN + 2 * NQ * 4;       // full[NSTAGE], empty[NSTAGE]
constexpr u32 OFF_TICKET = OFF_BAR + 8u * (2 * NSTAGE);
constexpr u32 OFF_WFLAG = OFF_TICKET + 16;          // wg_all flags [2][4] u32
constexpr u32 SMEM_USED = OFF_WFLAG + 32;
constexpr int THREADS = 384;
constexpr int BAR_ALL = 1;   // 256 consumer threads
constexpr int BAR_WG0 = 2;   // + u: 128 threads of warpgroup u
constexpr int E_MAX = 60;    // E_tok clamp
static_assert(OFF_WFLAG % 16 == 0, "wg_all flags are read as one 16-byte load");
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the FP8 wide smem map");
static_assert(OFF_QR % 1024 == 0 && OFF_P % 1024 == 0 && OFF_V % 1024 == 0, "swizzle atoms are 1 KB aligned");
static_assert(OFF_RING % 16 == 0 && HSTAGE % 16 == 0, "bulk copies land on 16-byte boundaries");
static_assert((u32)NQ * MLA_MAX_SPLITS * 4u <= OFF_RED - OFF_X, "merge weights must fit");
static_assert(OFF_BAR % 8 == 0, "mbarriers are 8-byte aligned");

GQADRV_DEVICE u32 full_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)s; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)(NSTAGE + s); }
GQADRV_DEVICE u32 stage_addr(u32 sb, int s) { return sb + OFF_RING + (u32)s * HSTAGE; }

GQADRV_DEVICE void sts_f32x4(u32 addr, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(w));
}
GQADRV_DEVICE void lds_f32x2(u32 addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "r"(addr));
}
GQADRV_DEVICE u32 f16x2_splat(float v) { return pack2<0>(v, v); }
GQADRV_DEVICE u32 bf16x2_splat(float v) { return pack2<1>(v, v); }

// S^T, two k16 steps (4 * qq, 4 * qq + 1 within the 16-byte unit of the thread's rows: words cw / dw of
// rows r0 / r1) of logical Q block qb; fa / fb: the f16x2 factors of the rows. The fragments also go to
// the V tile: va = the lane's stmatrix row address of step 4 * qq (step 4 * qq + 1: va ^ 32).
GQADRV_DEVICE void qk_steps(float (&sacc)[NACC], u32 c0, u32 c1, u32 d0, u32 d1, u64 db, u32 fa, u32 fb, bool first,
                            u32 va) {
  u32 fr[2][4];
  const u32 cw[2] = {c0, c1}, dw[2] = {d0, d1};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    u32 lo, hi;
    e4m3x4_to_f16x2(cw[q], lo, hi);
    fr[q][0] = hmul2(lo, fa);
    fr[q][2] = hmul2(hi, fa);
    e4m3x4_to_f16x2(dw[q], lo, hi);
    fr[q][1] = hmul2(lo, fb);
    fr[q][3] = hmul2(hi, fb);
  }
  wgmma_fence();
  wgmma_rs<0, 64>(sacc, fr[0][0], fr[0][1], fr[0][2], fr[0][3], db, first ? 0 : 1);
  wgmma_rs<0, 64>(sacc, fr[1][0], fr[1][1], fr[1][2], fr[1][3], db + 2, 1);
  wgmma_commit();
  stsm_x4(va, fr[0][0], fr[0][1], fr[0][2], fr[0][3]);
  stsm_x4(va ^ 32u, fr[1][0], fr[1][1], fr[1][2], fr[1][3]);
}
// S^T partial of warpgroup u over its scale blocks 2u, 2u + 1: four 16-byte units per row (bi = 2 (b -
// 2u) + jj: unit 8b + jj + 2t), each as two groups of two k16 steps, at most two groups in flight.
// va0: the lane's stmatrix address in V block 0 for k16 step 0 (row 16w + l % 8 + 8 (l / 8 % 2), chunk
// l / 16, swizzled); step q of block j is at (va0 + 8 KB j) ^ 32 q.
GQADRV_DEVICE void qk_blocks(float (&sacc)[NACC], u32 r0, u32 r1, u32 qh, int u, int t, u32 fa0, u32 fb0, u32 fa1,
                             u32 fb1, u32 va0) {
#pragma unroll
  for (int bi = 0; bi < 4; ++bi) {
    const int b = 2 * u + (bi >> 1), jj = bi & 1;
    const int ch = 8 * b + jj + 2 * t;
    const U32x4 c = lds_u32x4(r0 + 16u * (u32)ch);
    const U32x4 d = lds_u32x4(r1 + 16u * (u32)ch);
    const u32 fa = bi < 2 ? fa0 : fa1, fb = bi < 2 ? fb0 : fb1;
    const u64 db = wgmma_desc_sw128(qh + (u32)(2 * b + jj) * QCB, 16, 1024);
    const u32 va = va0 + (u32)(2 * b + jj) * QCB;
    qk_steps(sacc, c.x, c.y, d.x, d.y, db, fa, fb, bi == 0, va);
    qk_steps(sacc, c.z, c.w, d.z, d.w, db + 4, fa, fb, false, va ^ 64u);
    wgmma_wait<2>();
  }
}
// RoPE steps 2u, 2u + 1 (bf16 as stored, times 2^E_tok: ra / rb the rows' bf16x2 factors).
GQADRV_DEVICE void qk_rope(float (&sacc)[NACC], u32 r0, u32 r1, u32 qr, int u, int t, u32 ra, u32 rb) {
  const U32x4 c = lds_u32x4(r0 + ROPE_AT + 32u * (u32)t + 16u * (u32)u);
  const U32x4 d = lds_u32x4(r1 + ROPE_AT + 32u * (u32)t + 16u * (u32)u);
  const u32 c0 = hmul2_bf16(c.x, ra), c1 = hmul2_bf16(c.y, ra), c2 = hmul2_bf16(c.z, ra), c3 = hmul2_bf16(c.w, ra);
  const u32 d0 = hmul2_bf16(d.x, rb), d1 = hmul2_bf16(d.y, rb), d2 = hmul2_bf16(d.z, rb), d3 = hmul2_bf16(d.w, rb);
  wgmma_fence();
  const u64 db = wgmma_desc_sw128(qr, 16, 1024) + (u64)(4 * u);
  wgmma_rs<1, 64>(sacc, c0, d0, c1, d1, db, 1);
  wgmma_rs<1, 64>(sacc, c2, d2, c3, d3, db + 2, 1);
  wgmma_commit();
}
// O[64 x 256] += P' V[:, 256u ..]: P' K-major (k16 step kk = +32 B), V MN-major (atoms of 8 tokens x 64
// channels, LBO = 8 KB between channel blocks, SBO = 1 KB between 8-token groups, step kk = +2 KB).
GQADRV_DEVICE void pv(float (&o)[128], u32 p_base, u32 v_base) {
  const u64 dp = wgmma_desc_sw128(p_base, 16, 1024);
  const u64 dv = wgmma_desc_sw128(v_base, QCB, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss<0, 0, 1>(o, dp + (u64)(kk * 2), dv + (u64)(kk * 128), 1);
  wgmma_commit();
}

}  // namespace wfp8
}  // namespace mla

extern "C" __global__ void __launch_bounds__(mla::wfp8::THREADS, 1)
    mla_dense_decode_wide_fp8(const __grid_constant__ MlaDecodeArgs a) {
  using namespace mla;
  using namespace mla::wfp8;
  {  // barrier initialisation (nothing computed here stays live across setmaxnreg: it would be spilled)
    u8* smem0;
    const int tid0 = sreg<3>();
    const u32 sb0 = aligned_dynamic_smem(smem0, SMEM_USED, tid0);
    if (tid0 == 0) {
#pragma unroll 1
      for (int i = 0; i < NSTAGE; ++i) {
        mbar_init(full_bar(sb0, i), 2);     // one arrival (with its bytes) per producer warp of the half
        mbar_init(empty_bar(sb0, i), 128);  // one per consumer thread reading the half
      }
      fence_mbarrier_init();
    }
  }
  __syncthreads();  // barriers initialised
  // block geometry, derived after setmaxnreg in each role; pdl_wait is a no-op unless launched with
  // programmatic stream serialization
#define WFP8_GEOMETRY()                                                                        \
  const int tid = threadIdx.x;                                                                 \
  u8* smem;                                                                                    \
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid);                                   \
  const int lane = tid & 31, warp = tid >> 5;                                                  \
  const int nmb = a.num_m_blocks;                                                              \
  const int S = a.num_splits, mb = sreg<0>() % nmb, split = sreg<0>() / nmb;                   \
  const int kvh = sreg<1>(), b = sreg<2>();                                                    \
  const int M = a.m_rows, row0 = mb * NQ;                                                      \
  const int rows = M - row0 < NQ ? M - row0 : NQ;                                              \
  pdl_wait();                                                                                  \
  const int len = clamped_len(a, b);                                                           \
  const int key_len = row_key_limit(a, len, row0 + rows - 1);                                  \
  const int ntiles = (key_len + 63) >> 6;                                                      \
  const int t_beg = split_point(ntiles, split, S), t_end = split_point(ntiles, split + 1, S); \
  const int tok_end = min(key_len, t_end * 64);                                                \
  const int nt = t_end - t_beg;                                                                \
  const i32* bt_row = a.block_table + (long long)b * a.bt_stride
  if (sreg<3>() >= 256) {
    setmaxnreg_dec_producer();
    WFP8_GEOMETRY();
    // ===================================================================== producer warpgroup
    produce_rows<NSTAGE, 2>(a, bt_row, kvh, t_beg, nt, tok_end, warp - 8, lane,
                            [&](int st) { return full_bar(sb, st); }, [&](int st) { return empty_bar(sb, st); },
                            [&](int st) { return stage_addr(sb, st); });
    return;
  }
  setmaxnreg_inc_consumer();

  // ========================================================================= consumer warpgroups
  // The block geometry is derived twice, for the tile loop and again for the epilogue, so that none of
  // it stays live through the loop (the registers are needed there).
  float ot[128];      // O rows 16w + g (+8) x this warpgroup's 256 logical channels (wgmma C layout)
  float l_run[4][2];  // own query columns n = 8 (jo + 4u) + 2t + e: sums per thread
  int e_run = E_MAX;  // O is in units of 2^-e_run
  int nt_done = 0;    // tiles walked (the loop's counter at its exit: no register of its own in the loop)
  {
  WFP8_GEOMETRY();
  const int u = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  const int ctid = tid;  // 0..255
  const int hh = w >> 1;  // the half stage this warp reads
#pragma unroll
  for (int i = 0; i < 128; ++i) ot[i] = 0.f;
  // the running maxima live in shared memory (mrun[k & 1] written by tile k, read by tile k + 1),
  // which keeps them out of the registers the S^T phase needs
#pragma unroll
  for (int jo = 0; jo < 4; ++jo)
#pragma unroll
    for (int e = 0; e < 2; ++e) l_run[jo][e] = 0.f;
  float* red = reinterpret_cast<float*>(smem + OFF_RED);  // [u][c32][w]
  int* ered = reinterpret_cast<int*>(smem + OFF_ERED);    // [u][w]
  int* lim_s = reinterpret_cast<int*>(smem + OFF_LIM);
  float* qsc = reinterpret_cast<float*>(smem + OFF_QSC);
  float* mrun = reinterpret_cast<float*>(smem + OFF_MRUN);
  const int bar_wg = BAR_WG0 + u;

  if (nt > 0) {
    {  // Q: row n = tid / 4 (256 threads, 64 rows), latent channels [128 k, 128 k + 128) and RoPE
       // channels [16 k, 16 k + 16) per thread, k = tid % 4; rows >= M are zero
      const int n = ctid >> 2, k = ctid & 3;
      const bool valid = n < rows;
      const u16* src = valid ? q_row_ptr(a, b, kvh, row0 + n) : nullptr;
      float mx = 0.f;
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {
        const U32x4 v = valid ? *reinterpret_cast<const U32x4*>(src + 128 * k + 8 * i) : U32x4{0u, 0u, 0u, 0u};
        const u32 ww[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          float lo, hi;
          unpack2<1>(ww[z], lo, hi);
          mx = fmaxf(mx, fmaxf(fabsf(lo), fabsf(hi)));
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // 2^-e with the largest |q| of the row in [2^14, 2^15) after scaling (1 for a zero / NaN row)
      const int E = (int)((__float_as_uint(mx) >> 23) & 0xffu);
      const int sh = (mx > 0.f && E < 255) ? max(E - 141, -126) : 0;  // e_n
      const float down = exp2i(-sh);
      if (k == 0) {
        qsc[n] = a.scale_log2 * exp2i(sh);
        mrun[n] = M_INIT;
        mrun[NQ + n] = M_INIT;
        lim_s[n] = min(row_key_limit(a, len, row0 + n), tok_end) - 64 * t_beg;  // split-relative
      }
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {  // (read again: L1 / L2 hits, fewer live registers)
        const U32x4 v = valid ? *reinterpret_cast<const U32x4*>(src + 128 * k + 8 * i) : U32x4{0u, 0u, 0u, 0u};
        const u32 ww[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          const int L = q_logical_latent(128 * k + 8 * i + 2 * z);
          float lo, hi;
          unpack2<1>(ww[z], lo, hi);
          sts_u32(sb + OFF_QH + (u32)(L >> 6) * QCB + swz(n, (L & 63) >> 3) + 2u * (u32)(L & 7),
                  pack2<0>(lo * down, hi * down));
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const U32x4 v = valid ? *reinterpret_cast<const U32x4*>(src + 512 + 16 * k + 8 * i) : U32x4{0u, 0u, 0u, 0u};
        const u32 ww[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          const int L = q_logical_rope(16 * k + 8 * i + 2 * z);
          float lo, hi;
          unpack2<1>(ww[z], lo, hi);
          sts_u32(sb + OFF_QR + swz(n, L >> 3) + 2u * (u32)(L & 7), pack2<1>(lo * down, hi * down));
        }
      }
      fence_proxy_async_smem();  // generic writes of Q before the wgmmas read them
      named_bar_sync(BAR_ALL, 256);
    }
    const u32 p_base = sb + OFF_P;
    const int i0 = 16 * w + g;              // tokens i0, i0 + 8 of S^T
    const int ir = i0 - 32 * hh;            // their rows in the half stage
    // stmatrix address of this lane in V block 0, k16 step 0: row 16w + l % 8 + 8 (l / 8 % 2), chunk l / 16
    const u32 va0 = sb + OFF_V + (u32)(16 * w + (lane & 7) + 8 * ((lane >> 3) & 1)) * 128u +
                    ((u32)((lane >> 4) ^ (lane & 7)) << 4);
    const u32 xw = sb + OFF_X + (u32)u * 8192u + (u32)(w * 4 * 32 + lane) * 16u;        // my exchange slots
    const u32 xr = sb + OFF_X + (u32)(1 - u) * 8192u + (u32)(w * 4 * 32 + lane) * 16u;  // the other's
    float sacc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) sacc[i] = 0.f;
    reg_fence(sacc);
    reg_fence(ot);

    // positions in the loop are relative to the split's first key (t_beg * 64), as are the limits in
    // lim_s: t_beg, tok_end and nt then need no register through the loop, only rel_end, which lies in
    // (64 (nt - 1), 64 nt] (tok_end < 64 t_end only in the sequence's last tile), so it bounds the loop
    const int rel_end = tok_end - 64 * t_beg;
    int k = 0;
#pragma unroll 1
    for (; 64 * k < rel_end; ++k) {
      const int hi = 2 * k + hh, s = hi % NSTAGE;
      mbar_wait_wd(full_bar(sb, s), (u32)((hi / NSTAGE) & 1));
      const u32 st = stage_addr(sb, s);
      const u32 r0 = st + (u32)ir * ROW, r1 = r0 + 8u * ROW;
      const int nvalid = rel_end - k * 64;  // rows >= nvalid hold stale bytes (last tile only)
      // ---- the tokens' scales: E_tok and the f16 factors of this warpgroup's blocks. In the split's
      // last tile the rows >= tok_end hold stale bytes (an earlier tile's, or never written): the thread
      // zeroes the units it reads itself (its four code units and its RoPE unit) and drops their scales.
      float s0[4], s1[4];
      lds_f32x4(r0 + SCALES_AT, s0[0], s0[1], s0[2], s0[3]);
      lds_f32x4(r1 + SCALES_AT, s1[0], s1[1], s1[2], s1[3]);
      if (nvalid < 64) {
        auto zero_own = [&](u32 r) {
#pragma unroll
          for (int bi = 0; bi < 4; ++bi) sts_zero16(r + 16u * (u32)(8 * (2 * u + (bi >> 1)) + (bi & 1) + 2 * t));
          sts_zero16(r + ROPE_AT + 32u * (u32)t + 16u * (u32)u);
        };
        if (i0 >= nvalid) {
          zero_own(r0);
          s0[0] = s0[1] = s0[2] = s0[3] = 0.f;
        }
        if (i0 + 8 >= nvalid) {
          zero_own(r1);
          s1[0] = s1[1] = s1[2] = s1[3] = 0.f;
        }
      }
      u32 e40 = 0u, e41 = 0u;
#pragma unroll
      for (int bb = 0; bb < 4; ++bb) {
        e40 |= ((__float_as_uint(s0[bb]) >> 23) & 0xffu) << (8 * bb);
        e41 |= ((__float_as_uint(s1[bb]) >> 23) & 0xffu) << (8 * bb);
      }
      const u32 m0 = vmax4(e40, e40 >> 16), m1 = vmax4(e41, e41 >> 16);
      const int E0 = min(max(127 - (int)max(m0 & 0xffu, (m0 >> 8) & 0xffu), -E_MAX), E_MAX);
      const int E1 = min(max(127 - (int)max(m1 & 0xffu, (m1 >> 8) & 0xffu), -E_MAX), E_MAX);
      const float p0s = exp2i(E0), p1s = exp2i(E1);
      const float sA0 = u ? s0[2] : s0[0], sB0 = u ? s0[3] : s0[1];  // blocks 2u / 2u + 1 of row r0
      const float sA1 = u ? s1[2] : s1[0], sB1 = u ? s1[3] : s1[1];  // ... of row r1

      // ---- S^T partial: two scale blocks (four batches, at most two in flight; their fragments to V)
      // and two RoPE steps
      {
        const u32 fa0 = f16x2_splat(sA0 * p0s), fb0 = f16x2_splat(sA1 * p1s);  // block 2u
        const u32 fa1 = f16x2_splat(sB0 * p0s), fb1 = f16x2_splat(sB1 * p1s);  // block 2u + 1
        qk_blocks(sacc, r0, r1, sb + OFF_QH, u, t, fa0, fb0, fa1, fb1, va0);
        qk_rope(sacc, r0, r1, sb + OFF_QR, u, t, bf16x2_splat(p0s), bf16x2_splat(p1s));
        mbar_arrive(empty_bar(sb, s));  // the thread's last read of the half stage
        wgmma_wait<0>();
      }
      reg_fence(sacc);
      reg_fence(ot);

      // ---- exchange: the other warpgroup's columns out, my columns' other half in (two code paths,
      // so that every accumulator index is a constant)
      float x[4][2][2];  // own columns: [jo][e][h]
      if (u == 0) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4)
          sts_f32x4(xw + (u32)q4 * 512u, sacc[16 + 4 * q4], sacc[17 + 4 * q4], sacc[18 + 4 * q4], sacc[19 + 4 * q4]);
        named_bar_sync(BAR_ALL, 256);  // partials exchanged
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          float o0, o1, o2, o3;
          lds_f32x4(xr + (u32)q4 * 512u, o0, o1, o2, o3);
          x[q4][0][0] = sacc[4 * q4] + o0;
          x[q4][1][0] = sacc[4 * q4 + 1] + o1;
          x[q4][0][1] = sacc[4 * q4 + 2] + o2;
          x[q4][1][1] = sacc[4 * q4 + 3] + o3;
        }
      } else {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4)
          sts_f32x4(xw + (u32)q4 * 512u, sacc[4 * q4], sacc[4 * q4 + 1], sacc[4 * q4 + 2], sacc[4 * q4 + 3]);
        named_bar_sync(BAR_ALL, 256);
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          float o0, o1, o2, o3;
          lds_f32x4(xr + (u32)q4 * 512u, o0, o1, o2, o3);
          x[q4][0][0] = sacc[16 + 4 * q4] + o0;
          x[q4][1][0] = sacc[17 + 4 * q4] + o1;
          x[q4][0][1] = sacc[18 + 4 * q4] + o2;
          x[q4][1][1] = sacc[19 + 4 * q4] + o3;
        }
      }

      // ---- softmax of the own columns (n = 32u + c32, c32 = 8 jo + 2t + e): logits, then the key
      // limits only in tiles that reach one
      const bool need_mask = (k + 1) * 64 > lim_s[0];  // lim_s[0]: the smallest limit (row 0's), read
                                                       // from smem rather than kept in a register
      const float inv0 = exp2i(-E0), inv1 = exp2i(-E1);
#pragma unroll
      for (int jo = 0; jo < 4; ++jo) {
        float sc0, sc1;
        lds_f32x2(sb + OFF_QSC + 4u * (u32)(32 * u + 8 * jo + 2 * t), sc0, sc1);
        x[jo][0][0] *= inv0 * sc0;
        x[jo][0][1] *= inv1 * sc0;
        x[jo][1][0] *= inv0 * sc1;
        x[jo][1][1] *= inv1 * sc1;
      }
      if (need_mask) {
        const int pos0 = k * 64 + i0, pos1 = pos0 + 8;  // split-relative, like lim_s
#pragma unroll
        for (int jo = 0; jo < 4; ++jo) {
          int l2[2];
          asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(l2[0]), "=r"(l2[1]) : "r"(sb + OFF_LIM + 4u * (u32)(32 * u + 8 * jo + 2 * t)));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (pos0 >= l2[e]) x[jo][e][0] = MASKED;
            if (pos1 >= l2[e]) x[jo][e][1] = MASKED;
          }
        }
      }
      // running maxima: a column keeps its running max m while no logit of the tile exceeds m + 8 (so
      // p <= 2^8) and E_run stays while no token's E_tok is below it: then the warpgroup takes the fast
      // path (one warpgroup vote, wg_all; alpha = 1); otherwise the exact tile maxima and E_tok minimum (slow path)
      float mo[4][2], al[4][2];
#pragma unroll
      for (int jo = 0; jo < 4; ++jo)
        lds_f32x2(sb + OFF_MRUN + 4u * (u32)(((k + 1) & 1) * NQ + 32 * u + 8 * jo + 2 * t), mo[jo][0], mo[jo][1]);
      bool fits = E0 >= e_run && E1 >= e_run;
#pragma unroll
      for (int jo = 0; jo < 4; ++jo)
#pragma unroll
        for (int e = 0; e < 2; ++e) fits = fits && x[jo][e][0] <= mo[jo][e] + 8.f && x[jo][e][1] <= mo[jo][e] + 8.f;
      int e_new = e_run;
      if (wg_all(sb + OFF_WFLAG + 16u * (u32)u, w, lane, bar_wg, fits)) {  // fast path (uniform in the warpgroup)
#pragma unroll
        for (int jo = 0; jo < 4; ++jo) al[jo][0] = al[jo][1] = 1.f;
      } else {
        const int em = over_g(min(E0, E1), [](int p, int q) { return min(p, q); });
#pragma unroll
        for (int jo = 0; jo < 4; ++jo)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float mm = over_g(fmaxf(x[jo][e][0], x[jo][e][1]), [](float p, float q) { return fmaxf(p, q); });
            if (g == 0) red[((u * 32) + 8 * jo + 2 * t + e) * 4 + w] = mm;  // red[u][c32][w]
          }
        if (lane == 0) ered[u * 4 + w] = em;
        named_bar_sync(bar_wg, 128);  // maxima and E_tok minima of the warpgroup written
        // E_run: the tile's smallest E_tok (the same in both warpgroups: they read the same tokens)
        e_new = min(e_run, min(min(ered[u * 4], ered[u * 4 + 1]), min(ered[u * 4 + 2], ered[u * 4 + 3])));
#pragma unroll
        for (int jo = 0; jo < 4; ++jo)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float r4[4];
            lds_f32x4(sb + OFF_RED + 16u * (u32)(u * 32 + 8 * jo + 2 * t + e), r4[0], r4[1], r4[2], r4[3]);
            const float mn = fmaxf(mo[jo][e], fmaxf(fmaxf(r4[0], r4[1]), fmaxf(r4[2], r4[3])));
            al[jo][e] = fast_exp2(mo[jo][e] - mn);
            mo[jo][e] = mn;
          }
      }
      const float gam = exp2i(e_new - e_run);
      e_run = e_new;
      const float f0 = exp2i(e_new - E0), f1 = exp2i(e_new - E1);  // P' factors of the thread's tokens
      u32 pk[4][2];  // [jo][h]: f16x2 P' of columns 32u + 8 jo + 2t, + 1 at token i0 + 8 h
#pragma unroll
      for (int jo = 0; jo < 4; ++jo) {
        float pp[2][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pp[e][0] = fast_exp2(x[jo][e][0] - mo[jo][e]);
          pp[e][1] = fast_exp2(x[jo][e][1] - mo[jo][e]);
          l_run[jo][e] = l_run[jo][e] * al[jo][e] + (pp[e][0] + pp[e][1]);
        }
        pk[jo][0] = pack2<0>(pp[0][0] * f0, pp[1][0] * f0);
        pk[jo][1] = pack2<0>(pp[0][1] * f1, pp[1][1] * f1);
      }
      // P' rows n = 32u + 8 jo + r (r = lane % 8), 16-byte chunk 2w + h: stmatrix.trans of the 8 x 8
      // blocks (jo, h), block 2 jo' + h of an x4 from lanes 8 (2 jo' + h) ..
      {
        const int mi = lane >> 3, n = 32 * u + 8 * (mi >> 1) + (lane & 7);
        const u32 pa = p_base + swz(n, 2 * w + (mi & 1));
        stsm_x4_trans(pa, pk[0][0], pk[0][1], pk[1][0], pk[1][1]);
        stsm_x4_trans(pa + 16u * 128u, pk[2][0], pk[2][1], pk[3][0], pk[3][1]);
      }
      if (w == 0 && g == 0) {
#pragma unroll
        for (int jo = 0; jo < 4; ++jo) {
          const int n = 32 * u + 8 * jo + 2 * t;
          sts_f32x2(sb + OFF_ALPHA + 4u * (u32)n, al[jo][0], al[jo][1]);
          sts_f32x2(sb + OFF_MRUN + 4u * (u32)((k & 1) * NQ + n), mo[jo][0], mo[jo][1]);
        }
      }
      fence_proxy_async_smem();      // P' and this thread's V fragments before the wgmmas read them
      named_bar_sync(BAR_ALL, 256);  // P' and alpha complete

      // ---- rescale O (rows i0 / i0 + 8: alpha times the E_run change), then O += P' V
      {
        const float fl = lds_f32(sb + OFF_ALPHA + 4u * (u32)i0) * gam;
        const float fh = lds_f32(sb + OFF_ALPHA + 4u * (u32)(i0 + 8)) * gam;
        if (__any_sync(0xffffffffu, fl != 1.f || fh != 1.f)) {  // most tiles change no maximum
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            ot[4 * j] *= fl;
            ot[4 * j + 1] *= fl;
            ot[4 * j + 2] *= fh;
            ot[4 * j + 3] *= fh;
          }
        }
      }
      pv(ot, p_base, sb + OFF_V + (u32)(4 * u) * QCB);
      wgmma_wait<0>();  // with the P V wgmmas in flight across the loop's back edge, ptxas serialises
                        // every wgmma of the kernel (C7514)
      reg_fence(ot);
      named_bar_sync(bar_wg, 128);  // the warpgroup's V reads retired before the next tile's stmatrix
    }
    nt_done = k;
  }
  }  // the tile loop's geometry ends here
  pdl_launch_dependents();
  WFP8_GEOMETRY();
  const int u = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  const int ctid = tid;  // 0..255
  float* mrun = reinterpret_cast<float*>(smem + OFF_MRUN);
  const int bar_wg = BAR_WG0 + u;
  (void)nt;

  // ---- row sums of the own columns over the 8 lanes g and the 4 warps; O to true units
  float* lred = reinterpret_cast<float*>(smem + OFF_LRED);  // [u][w][32]
#pragma unroll
  for (int jo = 0; jo < 4; ++jo)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[jo][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) lred[(u * 4 + w) * 32 + 8 * jo + 2 * t + e] = l;
    }
  {
    const float unit_scale = exp2i(-e_run);
#pragma unroll
    for (int i = 0; i < 128; ++i) ot[i] *= unit_scale;
  }
  named_bar_sync(bar_wg, 128);  // lred of the warpgroup
  const long long unit = ((long long)b * a.h_kv + kvh) * nmb + mb;
  const long long slot0 = (unit * S + split) * NQ;
  if (w == 0 && g == 0) {
#pragma unroll
    for (int jo = 0; jo < 4; ++jo)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c32 = 8 * jo + 2 * t + e, n = 32 * u + c32;
        const float L = lred[(u * 4) * 32 + c32] + lred[(u * 4 + 1) * 32 + c32] + lred[(u * 4 + 2) * 32 + c32] +
                        lred[(u * 4 + 3) * 32 + c32];
        const float m = nt_done > 0 ? mrun[((nt_done - 1) & 1) * NQ + n] : M_INIT;
        sts_f32x2(sb + OFF_ML + 8u * (u32)n, m, L);
        if (n < rows) {
          if (S == 1)
            store_row_stats(a, lse_ptr(a, b, kvh, row0 + n), L, m);
          else
            *reinterpret_cast<F32x2*>(a.ws_ml + 2 * (slot0 + n)) = F32x2{m, L};
        }
      }
  }
  named_bar_sync(BAR_ALL, 256);  // {m, L} of every column
  // the thread's rows 16w + g + 8 rh; group grp of its columns is the 16 physical channels from
  // 16 (8 (2u + grp / 2) + 2t + grp % 2), value 2i + e of the group in ot[4 (8 grp + i) + 2 rh + e]
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int n = 16 * w + g + 8 * rh;
    if (n >= rows) continue;
    float m_, L;
    lds_f32x2(sb + OFF_ML + 8u * (u32)n, m_, L);
    (void)m_;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      const int c0 = 16 * (8 * (2 * u + (grp >> 1)) + 2 * t + (grp & 1));
      if (S == 1) {
        const float inv = L > 0.f ? 1.f / L : 0.f;
        u32 pk[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) pk[i] = pack2<1>(ot[4 * (8 * grp + i) + 2 * rh] * inv, ot[4 * (8 * grp + i) + 2 * rh + 1] * inv);
        u16* dst = out_row_ptr(a, b, kvh, row0 + n) + c0;
        *reinterpret_cast<U32x4*>(dst) = U32x4{pk[0], pk[1], pk[2], pk[3]};
        *reinterpret_cast<U32x4*>(dst + 8) = U32x4{pk[4], pk[5], pk[6], pk[7]};
      } else {
        float* dst = a.ws_o + (slot0 + n) * MLA_D_V + c0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          *reinterpret_cast<float4*>(dst + 4 * i) =
              make_float4(ot[4 * (8 * grp + 2 * i) + 2 * rh], ot[4 * (8 * grp + 2 * i) + 2 * rh + 1],
                          ot[4 * (8 * grp + 2 * i + 1) + 2 * rh], ot[4 * (8 * grp + 2 * i + 1) + 2 * rh + 1]);
      }
    }
  }
  if (S == 1) return;
  if (!last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), S, ctid,
                      [] { named_bar_sync(BAR_ALL, 256); }))
    return;
  merge_partials<NQ, 256, 1>(a, reinterpret_cast<float*>(smem + OFF_X), unit, S, b, kvh, row0, rows, ctid,
                             [] { named_bar_sync(BAR_ALL, 256); });
}
