// gqadrv — MLA dense decode on FlashMLA's 656-byte FP8 cache for 64-row blocks of packed query rows
// (M = s_q * h_q / h_kv > 16, e.g. h_q 64 or 128), sm_90a. Like dense_decode_narrow_fp8.cu, tokens are
// the wgmma M dimension and the consumer warpgroups dequantize the e4m3 codes straight into wgmma
// register A fragments (no conversion pass through shared memory, no dequantizing producer); the 64
// query rows are the wgmma N dimension. The two consumer warpgroups work on the same tile and split
// the channels: warpgroup u owns scale blocks 2u, 2u + 1 (latent channels 256u .. 256u + 255) for
// both GEMMs, so each code is converted once per GEMM by one warpgroup.
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
//             O^T[512 x 64] += V'^T P^T, V' = f16(code * f16(s_b[tok] * 2^(127 - c_b))), c_b: the largest
//                 scale exponent of block b seen so far (the accumulators of block b are in units of
//                 2^(c_b - 127), rescaled when c_b grows), P in f16. Warpgroup u: its 256 channels as 4
//                 m64 blocks x 4 k16 steps of m64n64k16.
//           With power-of-two scales (FlashMLA's quantizer) and tokens whose four scales lie within
//           2^24 of each other, every product equals the one on the dequantized cache; otherwise the
//           scales are applied in f16 instead of through a bf16 rounding of each element (and a block
//           scale more than 2^24 below the token's largest one contributes as f16 subnormals / zero).
// Layout    a stage holds 64 token rows of 656 bytes as stored (codes, 4 fp32 scales at byte 512, 64
//           bf16 RoPE channels at byte 528). S^T: thread (w, g, t) of a warpgroup owns tokens 16w + g
//           (+8) and reads the 16-byte units of fp8_tokm.cuh's logical order (conflict-free: 656 = 16
//           mod 128). O^T: row r = 16w + g + 8h of m-block mb of warpgroup u is channel
//           256u + 8 (8w + g) + 2mb + h, so a thread's 8 channels are one 8-byte unit of each of its 16
//           tokens of the tile (16kk + 2t + {0, 1, 8, 9}) and all lie in scale block 2u + w / 2; a byte
//           permute pairs two tokens' codes of one channel.
// CTA work  grid (nmb * S, h_kv, b), blockIdx.x = mb + nmb * split: rows [64 mb, 64 mb + 64) of (request,
//           KV head) over the tiles [ntiles * split / S, ntiles * (split + 1) / S), ntiles =
//           ceil(key_len / 64), key_len the block's last row's key limit.
// Warps     384 threads. Warpgroups 0 and 1 (warps 0..7, setmaxnreg.inc to 240 registers) compute, both
//           on every tile, with the channel split above; warpgroup u owns the softmax of query columns
//           32u .. 32u + 31 (its running max / sums). Warpgroup 2 (warps 8..11, setmaxnreg.dec to 24)
//           produces (fp8_tokm.cuh: produce_rows). Nothing computed before setmaxnreg stays live
//           across it.
// Smem map  (base rounded up to 1024 B)
//           [0, 64 KB)        Qh: 8 blocks of 64 logical channels x 64 rows x 128 B, f16, 128B swizzle
//           + 8 KB            Qr: 64 rows x 64 logical RoPE channels, bf16, 128B swizzle
//           + 8 KB            P^T: 64 rows x 64 tokens, f16, swizzled K-major (one, read by both)
//           + 2 x 8 KB        S^T exchange: warpgroup u's partial of the other's 32 columns
//           + 3 x 41,984 B    ring of NSTAGE tile stages (64 x 656 B)
//           + red[2][32][4] / ered[2][4] / lred[2][4][32], qsc[64], alpha[64], lim[64], {m, L}[64],
//             running max [2][64], mbarriers full / empty [NSTAGE], ticket
//           the merge weights ([64][S] fp32) use the exchange area and the ring after the last tile.
// Barriers  full[s] (count 4: one arrive.expect_tx per producer warp, completed by its bulk copies),
//           empty[s] (count 256: every consumer thread after its own last read of the stage). Named:
//           1 = both consumer warpgroups (256; per tile: partials exchanged; P and alpha written),
//           2 / 3 = warpgroup 0 / 1 (128; per tile: column maxima and scale exponents written).
// Pipeline  consumer thread, tile k, stage k % NSTAGE: wait full; scales of its two tokens -> E_tok and
//           the f16 block factors; S^T in eight groups of 2 wgmmas (a group's codes converted while
//           the previous one runs, at most two in flight) + 2 RoPE wgmmas; write the other warpgroup's
//           columns to the exchange, barrier 1, add the other's partial of its own columns; zero the
//           stale rows of a partial last tile; softmax of its own columns (maxima through red[] and
//           barrier 2 / 3); P^T and the rescale factors to smem; proxy fence; barrier 1; rescale O^T
//           (skipped when no max and no c_b changed); O^T in 4 k16 batches of 4 wgmmas (wait<1>
//           between batches); release the stage after the last fragment loads.
// Masking   logits of keys >= the column's limit -> -1e33 (scaled, log2 domain), running max from -1e30;
//           in the split's last tile the 528 code + scale bytes of rows >= tok_end are zeroed (stale
//           bytes of an earlier tile) after every S^T read and before any O^T read, so their V' factor
//           is 0; their scales never enter c_b.
// Split     S == 1 writes out (16-byte stores of each thread's 8 channels) and lse; S > 1 writes the
//           fp32 partial and {m, l} of the rows, takes the ticket, and the last CTA merges.
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
constexpr int NQ = 64;    // query rows per CTA (wgmma N)
constexpr int NACC = 32;  // fp32 accumulators per thread of one m64n64 result
#ifndef MLA_NSTAGE
#define MLA_NSTAGE 3
#endif
constexpr int NSTAGE = MLA_NSTAGE;
constexpr u32 QCB = (u32)NQ * 128u;  // one 64-channel block of Q (8 KB)
constexpr u32 OFF_QH = 0;
constexpr u32 OFF_QR = 8 * QCB;
constexpr u32 OFF_P = OFF_QR + QCB;
constexpr u32 OFF_X = OFF_P + QCB;  // + u * 8 KB
constexpr u32 OFF_RING = OFF_X + 2 * 8192;
constexpr u32 OFF_RED = OFF_RING + NSTAGE * STAGE;  // red[2][32][4] f32: [u][column][warp]
constexpr u32 OFF_ERED = OFF_RED + 2 * 4 * 32 * 4;  // ered[2][4] u32
constexpr u32 OFF_LRED = OFF_ERED + 2 * 4 * 4;      // lred[2][4][32] f32
constexpr u32 OFF_QSC = OFF_LRED + 2 * 4 * 32 * 4;  // qsc[64] f32: softmax scale (log2) * 2^e_n
constexpr u32 OFF_ALPHA = OFF_QSC + NQ * 4;         // alpha[64] f32
constexpr u32 OFF_LIM = OFF_ALPHA + NQ * 4;         // lim[64] i32: key limit of each row
constexpr u32 OFF_ML = OFF_LIM + NQ * 4;            // {m, L}[64]
constexpr u32 OFF_MRUN = OFF_ML + NQ * 8;          // running max [2][64] f32 (by tile parity)
constexpr u32 OFF_BAR = OFF_MRUN + 2 * NQ * 4;      // full[NSTAGE], empty[NSTAGE]
constexpr u32 OFF_TICKET = OFF_BAR + 8u * (2 * NSTAGE);
constexpr u32 SMEM_USED = OFF_TICKET + 16;
constexpr int THREADS = 384;
constexpr int BAR_ALL = 1;  // 256 consumer threads
constexpr int BAR_WG0 = 2;  // + u: 128 threads of warpgroup u
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the FP8 wide smem map");
static_assert(OFF_QR % 1024 == 0 && OFF_P % 1024 == 0 && OFF_RING % 1024 == 0, "swizzle atoms are 1 KB aligned");
static_assert((u32)NQ * MLA_MAX_SPLITS * 4u <= 2 * 8192 + NSTAGE * STAGE, "merge weights must fit");
static_assert(OFF_BAR % 8 == 0, "mbarriers are 8-byte aligned");

GQADRV_DEVICE u32 full_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)s; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)(NSTAGE + s); }
GQADRV_DEVICE u32 stage_addr(u32 sb, int s) { return sb + OFF_RING + (u32)s * STAGE; }

GQADRV_DEVICE void lds_u32x2(u32 addr, u32& x, u32& y) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "r"(addr));
}
GQADRV_DEVICE void sts_f32x4(u32 addr, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(x), "f"(y), "f"(z), "f"(w));
}
GQADRV_DEVICE void lds_f32x2(u32 addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "r"(addr));
}
GQADRV_DEVICE u32 f16x2_splat(float v) { return pack2<0>(v, v); }
GQADRV_DEVICE u32 bf16x2_splat(float v) { return pack2<1>(v, v); }

// S^T, two k16 steps (4 * qq, 4 * qq + 1 within the 16-byte unit of the thread's rows: words cw / dw of
// rows r0 / r1) of logical Q block qb; fa / fb: the f16x2 factors of the rows.
GQADRV_DEVICE void qk_steps(float (&sacc)[NACC], u32 c0, u32 c1, u32 d0, u32 d1, u64 db, u32 fa, u32 fb, bool first) {
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
}
// S^T partial of warpgroup u over its scale blocks 2u, 2u + 1: four 16-byte units per row (bi = 2 (b -
// 2u) + jj: unit 8b + jj + 2t), each as two groups of two k16 steps, at most two groups in flight.
GQADRV_DEVICE void qk_blocks(float (&sacc)[NACC], u32 r0, u32 r1, u32 qh, int u, int t, u32 fa0, u32 fb0, u32 fa1,
                             u32 fb1) {
#pragma unroll
  for (int bi = 0; bi < 4; ++bi) {
    const int b = 2 * u + (bi >> 1), jj = bi & 1;
    const int ch = 8 * b + jj + 2 * t;
    const U32x4 c = lds_u32x4(r0 + 16u * (u32)ch);
    const U32x4 d = lds_u32x4(r1 + 16u * (u32)ch);
    const u32 fa = bi < 2 ? fa0 : fa1, fb = bi < 2 ? fb0 : fb1;
    const u64 db = wgmma_desc_sw128(qh + (u32)(2 * b + jj) * QCB, 16, 1024);
    qk_steps(sacc, c.x, c.y, d.x, d.y, db, fa, fb, bi == 0);
    qk_steps(sacc, c.z, c.w, d.z, d.w, db + 4, fa, fb, false);
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
// O^T += V'^T P^T for k16 step kk: the thread's 4 tokens' 8-byte units x (codes), their V' factors as
// f16x2 pairs fa (tokens 0, 1) / fb (tokens 2, 3).
GQADRV_DEVICE void pv_step(float (&ot)[4][NACC], const u32 (&x)[4][2], u32 fa, u32 fb, u64 dp) {
  u32 fr[4][4];
#pragma unroll
  for (int mb = 0; mb < 4; ++mb) {
    const int wi = mb >> 1;
    const u32 sel = (mb & 1) ? 0x7362u : 0x5140u;
    u32 lo, hi;
    e4m3x4_to_f16x2(__byte_perm(x[0][wi], x[1][wi], sel), lo, hi);
    fr[mb][0] = hmul2(lo, fa);
    fr[mb][1] = hmul2(hi, fa);
    e4m3x4_to_f16x2(__byte_perm(x[2][wi], x[3][wi], sel), lo, hi);
    fr[mb][2] = hmul2(lo, fb);
    fr[mb][3] = hmul2(hi, fb);
  }
  wgmma_fence();
#pragma unroll
  for (int mb = 0; mb < 4; ++mb) wgmma_rs<0, 64>(ot[mb], fr[mb][0], fr[mb][1], fr[mb][2], fr[mb][3], dp, 1);
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
        mbar_init(full_bar(sb0, i), 4);     // one arrival (with its bytes) per producer warp
        mbar_init(empty_bar(sb0, i), 256);  // one per consumer thread
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
    produce_rows<NSTAGE>(a, bt_row, kvh, t_beg, nt, tok_end, warp - 8, lane, [&](int st) { return full_bar(sb, st); },
                         [&](int st) { return empty_bar(sb, st); }, [&](int st) { return stage_addr(sb, st); });
    return;
  }
  setmaxnreg_inc_consumer();

  // ========================================================================= consumer warpgroups
  // The block geometry is derived twice, for the tile loop and again for the epilogue, so that none of
  // it stays live through the loop (the registers are needed there).
  float ot[4][NACC];
  float l_run[4][2];  // own query columns n = 8 (jo + 4u) + 2t + e: sums per thread
  int c_run = 0;      // scale exponent of this warp's O^T channel block 2u + w / 2, biased as in float
  int nt_done;
  {
  WFP8_GEOMETRY();
  const int u = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  const int ctid = tid;  // 0..255
  nt_done = nt;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int i = 0; i < NACC; ++i) ot[m][i] = 0.f;
  // the running maxima live in shared memory (mrun[k & 1] written by tile k, read by tile k + 1),
  // which keeps them out of the registers the S^T phase needs
#pragma unroll
  for (int jo = 0; jo < 4; ++jo)
#pragma unroll
    for (int e = 0; e < 2; ++e) l_run[jo][e] = 0.f;
  float* mrun = reinterpret_cast<float*>(smem + OFF_MRUN);
  const int bo = 2 * u + (w >> 1);
  float* red = reinterpret_cast<float*>(smem + OFF_RED);  // [u][c32][w]
  u32* ered = reinterpret_cast<u32*>(smem + OFF_ERED);    // [u][w]
  float* qsc = reinterpret_cast<float*>(smem + OFF_QSC);
  int* lim_s = reinterpret_cast<int*>(smem + OFF_LIM);
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
        lim_s[n] = min(row_key_limit(a, len, row0 + n), tok_end);
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
    const int lim_min = min(row_key_limit(a, len, row0), tok_end);

    const u32 p_base = sb + OFF_P;
    const u64 dp0 = wgmma_desc_sw128(p_base, 16, 1024);
    const int i0 = 16 * w + g;  // tokens i0, i0 + 8 of S^T
    const u32 xw = sb + OFF_X + (u32)u * 8192u + (u32)(w * 4 * 32 + lane) * 16u;        // my exchange slots
    const u32 xr = sb + OFF_X + (u32)(1 - u) * 8192u + (u32)(w * 4 * 32 + lane) * 16u;  // the other's
    float sacc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) sacc[i] = 0.f;
    reg_fence(sacc);
#pragma unroll
    for (int m = 0; m < 4; ++m) reg_fence(ot[m]);

#pragma unroll 1
    for (int k = 0; k < nt; ++k) {
      const int tile = t_beg + k, s = k % NSTAGE;
      mbar_wait_wd(full_bar(sb, s), (u32)((k / NSTAGE) & 1));
      const u32 st = stage_addr(sb, s);
      const u32 r0 = st + (u32)i0 * ROW, r1 = r0 + 8u * ROW;
      const int nvalid = tok_end - tile * 64;  // rows >= nvalid hold stale bytes (last tile only)
      const int pos0 = tile * 64 + i0, pos1 = pos0 + 8;

      // ---- the tokens' scales: E_tok, the f16 factors of this warpgroup's blocks, the exponents
      float s0[4], s1[4];
      lds_f32x4(r0 + SCALES_AT, s0[0], s0[1], s0[2], s0[3]);
      lds_f32x4(r1 + SCALES_AT, s1[0], s1[1], s1[2], s1[3]);
      u32 e40 = 0u, e41 = 0u;
#pragma unroll
      for (int bb = 0; bb < 4; ++bb) {
        e40 |= ((__float_as_uint(s0[bb]) >> 23) & 0xffu) << (8 * bb);
        e41 |= ((__float_as_uint(s1[bb]) >> 23) & 0xffu) << (8 * bb);
      }
      const u32 m0 = vmax4(e40, e40 >> 16), m1 = vmax4(e41, e41 >> 16);
      const int E0 = min(max(127 - (int)max(m0 & 0xffu, (m0 >> 8) & 0xffu), -60), 60);
      const int E1 = min(max(127 - (int)max(m1 & 0xffu, (m1 >> 8) & 0xffu), -60), 60);
      const float p0s = exp2i(E0), p1s = exp2i(E1);
      const float inv0 = exp2i(-E0), inv1 = exp2i(-E1);
      const float sA0 = u ? s0[2] : s0[0], sB0 = u ? s0[3] : s0[1];  // blocks 2u / 2u + 1 of row r0
      const float sA1 = u ? s1[2] : s1[0], sB1 = u ? s1[3] : s1[1];  // ... of row r1
      u32 ex = (pos0 < tok_end ? e40 : 0u);
      ex = vmax4(ex, pos1 < tok_end ? e41 : 0u);
      ex = vmax4(ex, __shfl_xor_sync(0xffffffffu, ex, 4));
      ex = vmax4(ex, __shfl_xor_sync(0xffffffffu, ex, 8));
      ex = vmax4(ex, __shfl_xor_sync(0xffffffffu, ex, 16));

      // ---- S^T partial: two scale blocks (four batches, at most two in flight) and two RoPE steps
      {
        const u32 fa0 = f16x2_splat(sA0 * p0s), fb0 = f16x2_splat(sA1 * p1s);  // block 2u
        const u32 fa1 = f16x2_splat(sB0 * p0s), fb1 = f16x2_splat(sB1 * p1s);  // block 2u + 1
        qk_blocks(sacc, r0, r1, sb + OFF_QH, u, t, fa0, fb0, fa1, fb1);
        qk_rope(sacc, r0, r1, sb + OFF_QR, u, t, bf16x2_splat(p0s), bf16x2_splat(p1s));
        wgmma_wait<0>();
      }
      reg_fence(sacc);
#pragma unroll
      for (int m = 0; m < 4; ++m) reg_fence(ot[m]);

      // ---- exchange: the other warpgroup's columns out, my columns' other half in (two code paths,
      // so that every accumulator index is a constant)
      float x[4][2][2];  // own columns: [jo][e][h]
      if (u == 0) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4)
          sts_f32x4(xw + (u32)q4 * 512u, sacc[16 + 4 * q4], sacc[17 + 4 * q4], sacc[18 + 4 * q4], sacc[19 + 4 * q4]);
        named_bar_sync(BAR_ALL, 256);  // partials exchanged; every S^T read of the stage is done
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
      if (nvalid < 64) {  // the split's last tile: zero the codes and scales of the stale rows
#pragma unroll 1
        for (int i = ctid; i < (64 - nvalid) * 33; i += 256) sts_zero16(st + (u32)(nvalid + i / 33) * ROW + 16u * (u32)(i % 33));
      }

      // ---- softmax of the own columns (n = 32u + c32, c32 = 8 jo + 2t + e): logits, then the key
      // limits only in tiles that reach one
      const bool need_mask = (tile + 1) * 64 > lim_min;
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
      float mx[4][2];
#pragma unroll
      for (int jo = 0; jo < 4; ++jo)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float mm = fmaxf(x[jo][e][0], x[jo][e][1]);
          mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 4));
          mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 8));
          mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 16));
          mx[jo][e] = mm;
        }
      if (g == 0) {  // red[u][c32][w]: one 16-byte load gives a column's four warp maxima
#pragma unroll
        for (int jo = 0; jo < 4; ++jo)
#pragma unroll
          for (int e = 0; e < 2; ++e) red[((u * 32) + 8 * jo + 2 * t + e) * 4 + w] = mx[jo][e];
      }
      if (lane == 0) ered[u * 4 + w] = ex;
      named_bar_sync(bar_wg, 128);  // maxima and exponents of the warpgroup written

      const u32 exw = vmax4(vmax4(ered[u * 4], ered[u * 4 + 1]), vmax4(ered[u * 4 + 2], ered[u * 4 + 3]));
      const int c_new = max(c_run, min((int)((exw >> (8 * bo)) & 0xffu), 253));
      const float beta = exp2i(c_run - c_new);
      c_run = c_new;
      const float vnorm = exp2i(127 - c_new);  // V' factor: s * 2^(127 - c)
#pragma unroll
      for (int jo = 0; jo < 4; ++jo) {
        const int c32 = 8 * jo + 2 * t, n = 32 * u + c32;  // columns n, n + 1
        float mo[2], al[2];
        lds_f32x2(sb + OFF_MRUN + 4u * (u32)(((k + 1) & 1) * NQ + n), mo[0], mo[1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float r4[4];
          lds_f32x4(sb + OFF_RED + 16u * (u32)(u * 32 + c32 + e), r4[0], r4[1], r4[2], r4[3]);
          const float mt = fmaxf(fmaxf(r4[0], r4[1]), fmaxf(r4[2], r4[3]));
          const float mn = fmaxf(mo[e], mt);
          al[e] = fast_exp2(mo[e] - mn);
          mo[e] = mn;
          const float p0 = fast_exp2(x[jo][e][0] - mn), p1 = fast_exp2(x[jo][e][1] - mn);
          l_run[jo][e] = l_run[jo][e] * al[e] + (p0 + p1);
          sts_u16(p_base + swz(n + e, i0 >> 3) + 2u * (u32)(i0 & 7), (u16)(pack2<0>(p0, 0.f) & 0xffffu));
          sts_u16(p_base + swz(n + e, (i0 >> 3) + 1) + 2u * (u32)(i0 & 7), (u16)(pack2<0>(p1, 0.f) & 0xffffu));
        }
        if (w == 0 && g == 0) {
          sts_f32x2(sb + OFF_ALPHA + 4u * (u32)n, al[0], al[1]);
          sts_f32x2(sb + OFF_MRUN + 4u * (u32)((k & 1) * NQ + n), mo[0], mo[1]);
        }
      }
      fence_proxy_async_smem();
      named_bar_sync(BAR_ALL, 256);  // P^T and alpha complete

      // ---- rescale O^T (every column's alpha, this warp's beta), then O^T += V'^T P^T
      {
        float al[8][2];
        bool rescale = beta != 1.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          lds_f32x2(sb + OFF_ALPHA + 4u * (u32)(8 * j + 2 * t), al[j][0], al[j][1]);
          rescale |= al[j][0] != 1.f || al[j][1] != 1.f;
        }
        if (__any_sync(0xffffffffu, rescale)) {  // most tiles leave every running max and c unchanged
#pragma unroll
          for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                ot[m][4 * j + e] *= al[j][e] * beta;
                ot[m][4 * j + 2 + e] *= al[j][e] * beta;
              }
        }
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        u32 xv[4][2];
        float f[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int rv = 16 * kk + 2 * t + (v & 1) + 8 * (v >> 1);  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
          const u32 ra = st + (u32)rv * ROW;
          lds_u32x2(ra + 8u * (u32)(32 * u + 8 * w + g), xv[v][0], xv[v][1]);
          f[v] = lds_f32(ra + SCALES_AT + 4u * (u32)bo) * vnorm;
        }
        if (kk == 3) mbar_arrive(empty_bar(sb, s));  // the thread's last read of the stage
        pv_step(ot, xv, pack2<0>(f[0], f[1]), pack2<0>(f[2], f[3]), dp0 + (u64)(kk * 2));
        if (kk >= 1) wgmma_wait<1>();
      }
      wgmma_wait<0>();  // with the last O^T batch still in flight across the loop's back edge, ptxas
                        // serialises every wgmma of the kernel (C7514)
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < 4; ++m) reg_fence(ot[m]);
  }
  }  // the tile loop's geometry ends here
  pdl_launch_dependents();
  WFP8_GEOMETRY();
  const int u = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  const int ctid = tid;  // 0..255
  float* mrun = reinterpret_cast<float*>(smem + OFF_MRUN);
  const int bar_wg = BAR_WG0 + u;
  (void)nt;

  // ---- row sums of the own columns over the 8 lanes g and the 4 warps; O^T to true units
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
    const float unit_scale = exp2i(c_run - 127);
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int i = 0; i < NACC; ++i) ot[m][i] *= unit_scale;
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
  const int c0 = 256 * u + 8 * (8 * w + g);  // the thread's 8 channels
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float ml[4];
    lds_f32x4(sb + OFF_ML + 8u * (u32)(8 * j + 2 * t), ml[0], ml[1], ml[2], ml[3]);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
      if (n >= rows) continue;
      if (S == 1) {
        const float L = ml[2 * e + 1], inv = L > 0.f ? 1.f / L : 0.f;
        U32x4 pk;
        pk.x = pack2<1>(ot[0][4 * j + e] * inv, ot[0][4 * j + 2 + e] * inv);
        pk.y = pack2<1>(ot[1][4 * j + e] * inv, ot[1][4 * j + 2 + e] * inv);
        pk.z = pack2<1>(ot[2][4 * j + e] * inv, ot[2][4 * j + 2 + e] * inv);
        pk.w = pack2<1>(ot[3][4 * j + e] * inv, ot[3][4 * j + 2 + e] * inv);
        *reinterpret_cast<U32x4*>(out_row_ptr(a, b, kvh, row0 + n) + c0) = pk;
      } else {
        float* dst = a.ws_o + (slot0 + n) * MLA_D_V + c0;
        *reinterpret_cast<float4*>(dst) = make_float4(ot[0][4 * j + e], ot[0][4 * j + 2 + e], ot[1][4 * j + e], ot[1][4 * j + 2 + e]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(ot[2][4 * j + e], ot[2][4 * j + 2 + e], ot[3][4 * j + e], ot[3][4 * j + 2 + e]);
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
