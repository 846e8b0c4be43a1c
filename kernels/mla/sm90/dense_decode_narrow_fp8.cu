// gqadrv — MLA dense decode on FlashMLA's 656-byte FP8 cache for few packed rows per KV head
// (M = s_q * h_q / h_kv <= 16, e.g. h_q 16 s_q 1: the memory-bound regime), sm_90a. Tokens are the
// wgmma M dimension (as dense_decode_narrow.cu) and the e4m3 codes are dequantized into wgmma
// *register* A fragments by the consumer warpgroups themselves: nothing is written back to shared
// memory, so an FP8 tile costs shared-memory reads of its 42 KB once per GEMM and no conversion
// pass of a producer (the seesaw_fp8 design, whose producer warpgroup set its pace).
//
// Math      per 64-token tile, in a permuted but consistent order of tokens and channels:
//             S^T[64 tok x 16] = sum_b s_b[tok] * (C_b[tok x 128] Qh_b^T) + R[tok x 64] Qr^T
//                 C_b: the e4m3 codes of scale block b (channels 128b .. 128b + 127) as exact f16
//                 (cvt.rn.f16x2.e4m3x2), Qh: q * 2^-e_n in f16 (e_n per query row n puts the row's
//                 largest |q| in [2^14, 2^15): the conversion from bf16 is exact), R / Qr: the bf16
//                 RoPE channels (Qr also * 2^-e_n). wgmma m64n16k16 RS, f16 x 4 blocks (8 k16
//                 steps each, one accumulator set per block) + bf16 x 4 k16 steps; the logits are
//                 S * softmax_scale * 2^e_n.
//             O^T[512 x 16] += V'^T[512 x 64] P^T, V' = f16(code * f16(s_b[tok] * 2^(127 - c_b)))
//                 c_b: the largest scale exponent of block b seen so far (per warpgroup; the
//                 accumulators of block b are in units of 2^(c_b - 127) and are rescaled when c_b
//                 grows), P in f16. wgmma m64n16k16 RS, 8 channel blocks x 4 k16 steps.
//           With power-of-two scales (FlashMLA's quantizer) every product equals the one on the
//           dequantized cache (bf16(code * s) is then exact); other scales are applied in fp32 / f16
//           instead of through a bf16 rounding of each element (differences within that rounding).
// Layout    a tile in shared memory: 64 token rows of RS = 656 bytes, exactly as stored in the cache
//           (512 code bytes, 4 fp32 scales at byte 512, 64 bf16 RoPE channels at byte 528), in token
//           order, so a contiguous run of rows arrives with one bulk copy. 656 = 16 mod 128, so the
//           eight rows g = 0..7 of a fragment load start in eight different 16-byte bank groups.
//           S^T: thread (w, g, t) of a warpgroup owns tokens 16w + g (+8); in half jj of scale block b it
//           reads 16-byte unit 8b + jj + 2t of both rows (4 k16 steps of the block): codes (0, 1) of a
//           word are A columns (2t, 2t + 1), codes (2, 3) columns (2t + 8, 2t + 9) (Q is stored in that
//           channel order, so every k16 step is one 16-channel subset of the block).
//           O^T: row r = 16w + g + 8h of channel block m is channel 16 (8w + g) + 2m + h, so a thread's
//           16 channels are one 16-byte unit of each of its 16 tokens (16kk + 2t + {0, 1, 8, 9}) and
//           all lie in scale block w; a byte permute pairs two tokens' codes of one channel.
// CTA work  grid (S, h_kv, b) (16 rows: nmb = 1 for M <= 16): the tiles [ntiles * split / S,
//           ntiles * (split + 1) / S) of (request, KV head), ntiles = ceil(key_len / 64).
// Warps     384 threads. Warpgroups 0 and 1 (warps 0..7, setmaxnreg.inc to 240 registers) compute:
//           warpgroup u takes the CTA's tiles u, u + 2, ... with its own running max / sums / O^T
//           (merged at the end). Warpgroup 2 (warps 8..11, setmaxnreg.dec to 24) produces: warp 8 + pw
//           copies token rows 16 pw .. 16 pw + 15 of every tile. Nothing computed before setmaxnreg stays
//           live across it (the geometry is derived again in each role).
// Smem map  (base rounded up to 1024 B)
//           [0, 16 KB)       Qh: 8 blocks of 64 logical channels x 16 rows x 128 B, f16, 128B swizzle
//           + 2 KB           Qr: 16 rows x 64 logical RoPE channels, bf16, 128B swizzle
//           + 2 x 2 KB       P^T of each warpgroup: 16 rows x 64 logical tokens, f16, swizzled K-major
//           + 4 x 41,984 B   ring of NSTAGE tile stages (64 x 656 B)
//           + red / ered / lred (per warpgroup and warp), qsc[16], mbarriers full / empty [NSTAGE], ticket,
//             wflag[2][4] (the votes)
//           epilogue: the ring holds warpgroup 1's O^T and statistics, then the output staging rows and
//           the [16][S] merge weights.
// Barriers  full[s] (count 4: one arrive.expect_tx per producer warp with its valid rows x 656 bytes,
//           completed by the bulk copies), empty[s] (count 128: every thread of the consuming
//           warpgroup after its own last shared-memory read of the stage: a per-warp arrival after
//           __syncwarp left the other lanes' reads unordered with the next bulk write, which
//           racecheck reported). Named: 1 = both consumer warpgroups (256: Q written; epilogue
//           hand-off), 2 / 3 = warpgroup 0 / 1 (128: per tile, the vote and in the slow path the maxima
//           written; P written; epilogue).
// Pipeline  producer warp pw, tile k of the CTA, stage k % NSTAGE: wait empty (parity starts at 1),
//           lane 0 arrive.expect_tx; then, when the cache rows are 656 bytes apart, the page holds >= 16
//           tokens and all 16 rows are valid, lane 0 copies them with one 10,496-byte cp.async.bulk;
//           otherwise lane l < 16 copies row 16 pw + l (656 B) if it is below the split's token end
//           (rows past it are never read, nor their block-table entries). Block-table entries of the
//           next tile are read one tile ahead.
//           consumer warpgroup u, tile k: wait full; S^T in two halves of 16 wgmmas (4 independent
//           accumulator chains, wait between halves) + 4 RoPE wgmmas; combine with the scales; softmax
//           over the 64 tokens: the warpgroup votes (wg_all, barrier 2 / 3) whether every logit is
//           <= its row's running max + 8 and no valid token's block exponent exceeds the running c_b;
//           if so (most tiles) maxima, alpha (= 1) and c_b stay (p <= 2^8 then), else the column max
//           through red[] + barrier and the exponents through ered[] (the O^T rescale is skipped when
//           no running max and no c_b changed); P^T -> smem by stmatrix.trans (+ proxy fence,
//           barrier); O^T in 4 k16 batches of 8 wgmmas (wait<1> between batches); release the
//           stage after the last fragment loads.
// Masking   logits of keys >= the row's limit -> -1e33 (scaled, log2 domain), running max from -1e30;
//           in the split's last tile the 528 code + scale bytes of rows >= tok_end are zeroed (they
//           hold stale bytes of an earlier tile) between the per-tile vote and the P barrier, so their V'
//           factor is 0 and their scales never enter c_b.
// Split     as dense_decode_narrow.cu: S == 1 writes out / lse; S > 1 writes the fp32 partial and
//           {m, l}, takes the ticket, and the last CTA merges.
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/decode_util.cuh"
#include "../common/sync.cuh"
#include "../common/wgmma_ops.cuh"
#include "fp8_tokm.cuh"

#if MLA_DT != 1
#error "the FP8 narrow kernel takes bf16 q (MLA_DT=1)"
#endif

namespace mla {
namespace nfp8 {
using namespace tokm;
constexpr int NQ = 16;
constexpr int NACC = 8;   // fp32 accumulators per thread of one m64n16 result
constexpr int NJ = 2;     // 8-column chunks of a result
constexpr u32 RS = ROW;   // bytes of one token row in a stage (dense: whole runs of rows copy at once)
#ifndef MLA_NSTAGE
#define MLA_NSTAGE 4
#endif
constexpr int NSTAGE = MLA_NSTAGE;
constexpr u32 QCB = (u32)NQ * 128u;  // one 64-channel block of Q (2 KB)
constexpr u32 OFF_QH = 0;
constexpr u32 OFF_QR = 8 * QCB;
constexpr u32 OFF_P = OFF_QR + QCB;  // + u * QCB
constexpr u32 OFF_RING = OFF_P + 2 * QCB;
constexpr u32 OFF_RED = OFF_RING + NSTAGE * STAGE;  // red[2][4][NQ] f32
constexpr u32 OFF_ERED = OFF_RED + 2 * 4 * NQ * 4;  // ered[2][4] u32
constexpr u32 OFF_LRED = OFF_ERED + 2 * 4 * 4;      // lred[2][4][NQ] f32
constexpr u32 OFF_QSC = OFF_LRED + 2 * 4 * NQ * 4;  // qsc[NQ] f32: 2^e_n
constexpr u32 OFF_BAR = OFF_QSC + NQ * 4;           // full[NSTAGE], empty[NSTAGE]
constexpr u32 OFF_TICKET = OFF_BAR + 8u * (2 * NSTAGE);
constexpr u32 OFF_WFLAG = OFF_TICKET + 16;          // wg_all flags [2][4] u32
constexpr u32 SMEM_USED = OFF_WFLAG + 32;
constexpr int THREADS = 384;
constexpr int BAR_ALL = 1;  // 256 consumer threads
constexpr int BAR_WG0 = 2;  // + u: 128 threads of warpgroup u
constexpr u32 STG_BF16 = 1024u + 16u;  // output staging row strides (bank spread)
constexpr u32 STG_F32 = 2048u + 16u;
constexpr u32 DUMP_O = 0;                      // warpgroup 1's O^T (fp32 [NQ][512]) in the ring
constexpr u32 DUMP_ML = NQ * 512 * 4;          // its {m, L} per row
static_assert(OFF_WFLAG % 16 == 0, "wg_all flags are read as one 16-byte load");
static_assert(SMEM_USED + 1024 <= MLA_SMEM_BYTES, "MLA_SMEM_BYTES too small for the FP8 narrow smem map");
static_assert(OFF_QR % 1024 == 0 && OFF_P % 1024 == 0 && OFF_RING % 1024 == 0, "swizzle atoms are 1 KB aligned");
static_assert(NQ * STG_F32 <= NSTAGE * STAGE && DUMP_ML + NQ * 8 <= NSTAGE * STAGE, "epilogue staging fits the ring");
static_assert((u32)NQ * MLA_MAX_SPLITS * 4u <= NSTAGE * STAGE, "merge weights must fit in the ring");
static_assert(OFF_BAR % 8 == 0, "mbarriers are 8-byte aligned");

GQADRV_DEVICE u32 full_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)s; }
GQADRV_DEVICE u32 empty_bar(u32 sb, int s) { return sb + OFF_BAR + 8u * (u32)(NSTAGE + s); }
GQADRV_DEVICE u32 stage_addr(u32 sb, int s) { return sb + OFF_RING + (u32)s * STAGE; }

// S^T, half jj (0, 1) of every scale block b: 16-byte unit 8b + jj + 2t of the thread's two rows
// (r0, r1: smem row addresses) = 4 k16 steps of block b; 4 independent accumulator chains of 4.
GQADRV_DEVICE void qk_half(float (&sacc)[4][NACC], u32 r0, u32 r1, u32 qh, int jj, int t) {
  u32 fr[4][4][4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int ch = 8 * b + jj + 2 * t;  // 16-byte unit: the four lanes of a row read every other unit
    const U32x4 c = lds_u32x4(r0 + 16u * (u32)ch);
    const U32x4 d = lds_u32x4(r1 + 16u * (u32)ch);
    const u32 cw[4] = {c.x, c.y, c.z, c.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      e4m3x4_to_f16x2(cw[q], fr[b][q][0], fr[b][q][2]);
      e4m3x4_to_f16x2(dw[q], fr[b][q][1], fr[b][q][3]);
    }
  }
  wgmma_fence();
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const u64 db = wgmma_desc_sw128(qh + (u32)(2 * b + jj) * QCB, 16, 1024);
      wgmma_rs<0, 16>(sacc[b], fr[b][q][0], fr[b][q][1], fr[b][q][2], fr[b][q][3], db + (u64)(q * 2),
                      (jj == 0 && q == 0) ? 0 : 1);
    }
}
// S^T of the RoPE channels (4 k16 steps, bf16 as stored).
GQADRV_DEVICE void qk_rope(float (&r_acc)[NACC], u32 r0, u32 r1, u32 qr, int t) {
  const U32x4 c0 = lds_u32x4(r0 + ROPE_AT + 32u * (u32)t), c1 = lds_u32x4(r0 + ROPE_AT + 32u * (u32)t + 16u);
  const U32x4 d0 = lds_u32x4(r1 + ROPE_AT + 32u * (u32)t), d1 = lds_u32x4(r1 + ROPE_AT + 32u * (u32)t + 16u);
  wgmma_fence();
  const u64 db = wgmma_desc_sw128(qr, 16, 1024);
  wgmma_rs<1, 16>(r_acc, c0.x, d0.x, c0.y, d0.y, db, 0);
  wgmma_rs<1, 16>(r_acc, c0.z, d0.z, c0.w, d0.w, db + 2, 1);
  wgmma_rs<1, 16>(r_acc, c1.x, d1.x, c1.y, d1.y, db + 4, 1);
  wgmma_rs<1, 16>(r_acc, c1.z, d1.z, c1.w, d1.w, db + 6, 1);
}
// O^T += V'^T P^T for k16 step kk: the thread's 4 tokens' 16-byte units x (codes), their V' factors
// as f16x2 pairs fa (tokens 0, 1) / fb (tokens 2, 3).
GQADRV_DEVICE void pv_step(float (&ot)[8][NACC], const U32x4 (&x)[4], u32 fa, u32 fb, u64 dp) {
  u32 fr[8][4];
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int wi = m >> 1;
    const u32 sel = (m & 1) ? 0x7362u : 0x5140u;
    const u32 w0 = wi == 0 ? x[0].x : wi == 1 ? x[0].y : wi == 2 ? x[0].z : x[0].w;
    const u32 w1 = wi == 0 ? x[1].x : wi == 1 ? x[1].y : wi == 2 ? x[1].z : x[1].w;
    const u32 w2 = wi == 0 ? x[2].x : wi == 1 ? x[2].y : wi == 2 ? x[2].z : x[2].w;
    const u32 w3 = wi == 0 ? x[3].x : wi == 1 ? x[3].y : wi == 2 ? x[3].z : x[3].w;
    u32 lo, hi;
    e4m3x4_to_f16x2(__byte_perm(w0, w1, sel), lo, hi);
    fr[m][0] = hmul2(lo, fa);
    fr[m][1] = hmul2(hi, fa);
    e4m3x4_to_f16x2(__byte_perm(w2, w3, sel), lo, hi);
    fr[m][2] = hmul2(lo, fb);
    fr[m][3] = hmul2(hi, fb);
  }
  wgmma_fence();
#pragma unroll
  for (int m = 0; m < 8; ++m) wgmma_rs<0, 16>(ot[m], fr[m][0], fr[m][1], fr[m][2], fr[m][3], dp, 1);
  wgmma_commit();
}

}  // namespace nfp8
}  // namespace mla

extern "C" __global__ void __launch_bounds__(mla::nfp8::THREADS, 1)
    mla_dense_decode_narrow_fp8(const __grid_constant__ MlaDecodeArgs a) {
  using namespace mla;
  using namespace mla::nfp8;
  {  // barrier initialisation (nothing computed here stays live across setmaxnreg: it would be spilled)
    u8* smem0;
    const int tid0 = sreg<3>();
    const u32 sb0 = aligned_dynamic_smem(smem0, SMEM_USED, tid0);
    if (tid0 == 0) {
#pragma unroll 1
      for (int i = 0; i < NSTAGE; ++i) {
        mbar_init(full_bar(sb0, i), 4);   // one arrival (with its bytes) per producer warp
        mbar_init(empty_bar(sb0, i), 128);  // one per thread of the consuming warpgroup
      }
      fence_mbarrier_init();
    }
  }
  __syncthreads();  // barriers initialised
  // block geometry, derived after setmaxnreg in each role (the two paths never merge again: ptxas
  // then allocates each role's registers under its own budget); M <= NQ: one row block, row0 = 0;
  // pdl_wait is a no-op unless launched with programmatic stream serialization
#define NFP8_GEOMETRY()  \
  const int tid = threadIdx.x; \
  u8* smem; \
  const u32 sb = aligned_dynamic_smem(smem, SMEM_USED, tid); \
  const int lane = tid & 31, warp = tid >> 5; \
  const int S = a.num_splits, split = sreg<0>(); \
  const int kvh = sreg<1>(), b = sreg<2>(); \
  const int M = a.m_rows; \
  pdl_wait(); \
  const int len = clamped_len(a, b); \
  const int key_len = row_key_limit(a, len, M - 1); \
  const int ntiles = (key_len + 63) >> 6; \
  const int t_beg = split_point(ntiles, split, S), t_end = split_point(ntiles, split + 1, S); \
  const int tok_end = min(key_len, t_end * 64); \
  const int nt = t_end - t_beg; \
  const i32* bt_row = a.block_table + (long long)b * a.bt_stride
  if (sreg<3>() >= 256) {
    setmaxnreg_dec_producer();
    NFP8_GEOMETRY();
    // ===================================================================== producer warpgroup
    // warp pw copies rows 16 pw .. 16 pw + 15 of every tile (lane l < 16: row 16 pw + l, one bulk copy
    // of 656 bytes); its block-table entries are read one tile ahead
    produce_rows<NSTAGE>(a, bt_row, kvh, t_beg, nt, tok_end, warp - 8, lane, [&](int st) { return full_bar(sb, st); },
                         [&](int st) { return empty_bar(sb, st); }, [&](int st) { return stage_addr(sb, st); });
    return;
  }
  setmaxnreg_inc_consumer();
  NFP8_GEOMETRY();

  // ========================================================================= consumer warpgroups
  const int u = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
  const int ctid = tid & 127;  // thread within the warpgroup
  float ot[8][NACC];
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int i = 0; i < NACC; ++i) ot[m][i] = 0.f;
  float m_run[NJ][2], l_run[NJ][2];
  int lim[NJ][2];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_run[j][e] = M_INIT;
      l_run[j][e] = 0.f;
      lim[j][e] = min(row_key_limit(a, len, 8 * j + 2 * t + e), tok_end);
    }
  const int lim_min = min(row_key_limit(a, len, 0), tok_end);
  u32 c_run4 = 0u;  // running scale exponent of each channel block (byte b: block b), biased as in float, <= 253
  float* red = reinterpret_cast<float*>(smem + OFF_RED) + u * 4 * NQ;
  u32* ered = reinterpret_cast<u32*>(smem + OFF_ERED) + u * 4;
  float* qsc = reinterpret_cast<float*>(smem + OFF_QSC);
  const int bar_wg = BAR_WG0 + u;

  if (nt > 0) {
    {  // Q: row n = tid / 16 (256 threads, 16 rows), 32 latent channels [32 k, 32 k + 32) and 4 RoPE
       // channels [4 k, 4 k + 4) per thread, k = tid % 16; rows >= M are zero
      const int n = tid >> 4, k = tid & 15;
      U32x4 v[4] = {};
      u32 rv[2] = {0u, 0u};
      if (n < M) {
        const u16* src = q_row_ptr(a, b, kvh, n);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = *reinterpret_cast<const U32x4*>(src + 32 * k + 8 * i);
        const u32* rp = reinterpret_cast<const u32*>(src + 512 + 4 * k);
        rv[0] = rp[0];
        rv[1] = rp[1];
      }
      float mx = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 ww[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          float lo, hi;
          unpack2<1>(ww[z], lo, hi);
          mx = fmaxf(mx, fmaxf(fabsf(lo), fabsf(hi)));
        }
      }
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      // 2^-e with the largest |q| of the row in [2^14, 2^15) after scaling (1 for a zero / NaN row)
      const int E = (int)((__float_as_uint(mx) >> 23) & 0xffu);
      const int sh = (mx > 0.f && E < 255) ? max(E - 141, -126) : 0;  // e_n
      const float down = exp2i(-sh);
      if (k == 0) qsc[n] = exp2i(sh);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 ww[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          const int p = 32 * k + 8 * i + 2 * z;  // physical channel pair (p, p + 1), p even
          const int L = q_logical_latent(p);
          float lo, hi;
          unpack2<1>(ww[z], lo, hi);
          const u32 h2 = pack2<0>(lo * down, hi * down);
          sts_u32(sb + OFF_QH + (u32)(L >> 6) * QCB + swz(n, (L & 63) >> 3) + 2u * (u32)(L & 7), h2);
        }
      }
#pragma unroll
      for (int z = 0; z < 2; ++z) {
        const int L = q_logical_rope(4 * k + 2 * z);  // physical RoPE channel pair (4 k + 2 z, + 1)
        float lo, hi;
        unpack2<1>(rv[z], lo, hi);
        sts_u32(sb + OFF_QR + swz(n, L >> 3) + 2u * (u32)(L & 7), pack2<1>(lo * down, hi * down));
      }
      fence_proxy_async_smem();  // generic writes of Q before the wgmmas read them
      named_bar_sync(BAR_ALL, 256);
    }
    float sc[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) sc[j][e] = a.scale_log2 * qsc[8 * j + 2 * t + e];

    const u32 p_base = sb + OFF_P + (u32)u * QCB;
    const u64 dp0 = wgmma_desc_sw128(p_base, 16, 1024);
    const int i0 = 16 * w + g;  // logical tokens i0, i0 + 8 of S^T
    const int rho0 = i0, rho1 = i0 + 8;  // their smem rows
    float sacc[4][NACC], racc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      racc[i] = 0.f;
#pragma unroll
      for (int bb = 0; bb < 4; ++bb) sacc[bb][i] = 0.f;
    }
#pragma unroll
    for (int bb = 0; bb < 4; ++bb) reg_fence(sacc[bb]);
    reg_fence(racc);
#pragma unroll
    for (int m = 0; m < 8; ++m) reg_fence(ot[m]);

#pragma unroll 1
    for (int k = u; k < nt; k += 2) {
      const int tile = t_beg + k, s = k % NSTAGE;
      mbar_wait_wd(full_bar(sb, s), (u32)((k / NSTAGE) & 1));
      const u32 st = stage_addr(sb, s);
      const u32 r0 = st + (u32)rho0 * RS, r1 = st + (u32)rho1 * RS;
      const int nvalid = tok_end - tile * 64;  // rows >= nvalid hold stale bytes (last tile only)

      // ---- S^T: four scale blocks (at most two batches of fragments live) and the RoPE channels
      qk_half(sacc, r0, r1, sb + OFF_QH, 0, t);
      wgmma_commit();
      wgmma_wait<0>();
      qk_half(sacc, r0, r1, sb + OFF_QH, 1, t);
      qk_rope(racc, r0, r1, sb + OFF_QR, t);
      wgmma_commit();
      float s0[4], s1[4];
      lds_f32x4(r0 + SCALES_AT, s0[0], s0[1], s0[2], s0[3]);
      lds_f32x4(r1 + SCALES_AT, s1[0], s1[1], s1[2], s1[3]);
      wgmma_wait<0>();
#pragma unroll
      for (int bb = 0; bb < 4; ++bb) reg_fence(sacc[bb]);
      reg_fence(racc);
#pragma unroll
      for (int m = 0; m < 8; ++m) reg_fence(ot[m]);

      // ---- softmax over the 64 tokens, per query row (column of S^T)
      const int pos0 = tile * 64 + rho0, pos1 = tile * 64 + rho1;  // key positions of rows i0, i0 + 8
      const bool need_mask = (tile + 1) * 64 > lim_min;
      float x[NJ][2][2];  // [j][e][h]
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int i = 4 * j + 2 * h + e;
            const float* sv = h ? s1 : s0;
            const float v = (racc[i] + sv[0] * sacc[0][i] + sv[1] * sacc[1][i] + sv[2] * sacc[2][i] +
                             sv[3] * sacc[3][i]) * sc[j][e];
            x[j][e][h] = (need_mask && (h ? pos1 : pos0) >= lim[j][e]) ? MASKED : v;
          }
      // scale exponents of the valid rows, 8 bits per block (clamped to 253)
      u32 ex = 0u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if ((h ? pos1 : pos0) < tok_end) {
          const float* sv = h ? s1 : s0;
          u32 e4 = 0u;
#pragma unroll
          for (int bb = 0; bb < 4; ++bb) e4 |= ((__float_as_uint(sv[bb]) >> 23) & 0xffu) << (8 * bb);
          ex = vmax4(ex, e4);
        }
      }
      ex = __vminu4(ex, 0xfdfdfdfdu);
      // fast path (uniform in the warpgroup, one wg_all vote): every logit within 8 of its row's running
      // max (p <= 2^8) and no block exponent above its running one: maxima, alpha and c stay;
      // otherwise the exact tile maxima and block exponents (slow path)
      bool fits = vmax4(ex, c_run4) == c_run4;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) fits = fits && x[j][e][0] <= m_run[j][e] + 8.f && x[j][e][1] <= m_run[j][e] + 8.f;
      float alpha[NJ][2];
      float beta = 1.f;
      if (wg_all(sb + OFF_WFLAG + 16u * (u32)u, w, lane, bar_wg, fits)) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) alpha[j][0] = alpha[j][1] = 1.f;
      } else {
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float mm = over_g(fmaxf(x[j][e][0], x[j][e][1]), [](float p, float q) { return fmaxf(p, q); });
            if (g == 0) red[w * NQ + 8 * j + 2 * t + e] = mm;
          }
        ex = over_g(ex, vmax4);
        if (lane == 0) ered[w] = ex;
        named_bar_sync(bar_wg, 128);
        const u32 c_new4 = vmax4(c_run4, vmax4(vmax4(ered[0], ered[1]), vmax4(ered[2], ered[3])));
        beta = exp2i((int)((c_run4 >> (8 * w)) & 0xffu) - (int)((c_new4 >> (8 * w)) & 0xffu));
        c_run4 = c_new4;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * j + 2 * t + e;
            const float mt = fmaxf(fmaxf(red[n], red[NQ + n]), fmaxf(red[2 * NQ + n], red[3 * NQ + n]));
            const float mn = fmaxf(m_run[j][e], mt);
            alpha[j][e] = fast_exp2(m_run[j][e] - mn);
            m_run[j][e] = mn;
          }
      }
      // (both paths passed a warpgroup barrier after the last S^T read of the stage)
      if (nvalid < 64) {  // the split's last tile: rows >= nvalid hold stale bytes; zero their codes and
                          // scales so that O^T reads zeros there
#pragma unroll 1
        for (int i = ctid; i < (64 - nvalid) * 33; i += 128)
          sts_zero16(st + (u32)(nvalid + i / 33) * RS + 16u * (u32)(i % 33));
      }
      const float vnorm = exp2i(127 - (int)((c_run4 >> (8 * w)) & 0xffu));  // V' factor: s * 2^(127 - c_w)
      u32 pk[NJ][2];  // [j][h]: f16x2 P of rows 8j + 2t, + 1 at token i0 + 8h
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        float pp[2][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pp[e][0] = fast_exp2(x[j][e][0] - m_run[j][e]);
          pp[e][1] = fast_exp2(x[j][e][1] - m_run[j][e]);
          l_run[j][e] = l_run[j][e] * alpha[j][e] + (pp[e][0] + pp[e][1]);
        }
        pk[j][0] = pack2<0>(pp[0][0], pp[1][0]);
        pk[j][1] = pack2<0>(pp[0][1], pp[1][1]);
      }
      {  // P^T rows n = 8j + lane % 8, 16-byte chunk 2w + h: stmatrix.trans of the 8 x 8 blocks (j, h)
        const int mi = lane >> 3;
        stsm_x4_trans(p_base + swz(8 * (mi >> 1) + (lane & 7), 2 * w + (mi & 1)), pk[0][0], pk[0][1], pk[1][0], pk[1][1]);
      }
      bool rescale = beta != 1.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) rescale |= alpha[j][e] != 1.f;
      if (__any_sync(0xffffffffu, rescale)) {  // most tiles leave every running max and c_w unchanged
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
          for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              ot[m][4 * j + e] *= alpha[j][e] * beta;
              ot[m][4 * j + 2 + e] *= alpha[j][e] * beta;
            }
      }
      fence_proxy_async_smem();
      named_bar_sync(bar_wg, 128);  // P complete; red[] / ered[] read before the next tile's writes

      // ---- O^T += V'^T P^T in 4 k16 steps; the stage is released after its last read
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        U32x4 xv[4];
        float f[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int rv = 16 * kk + 2 * t + (v & 1) + 8 * (v >> 1);  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
          const u32 ra = st + (u32)rv * RS;
          xv[v] = lds_u32x4(ra + 16u * (u32)(8 * w + g));
          f[v] = lds_f32(ra + SCALES_AT + 4u * (u32)w) * vnorm;
        }
        if (kk == 3) mbar_arrive(empty_bar(sb, s));  // the thread's last read of the stage (each thread
                                                       // releases its own reads)
        pv_step(ot, xv, pack2<0>(f[0], f[1]), pack2<0>(f[2], f[3]), dp0 + (u64)(kk * 2));
        if (kk >= 1) wgmma_wait<1>();
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < 8; ++m) reg_fence(ot[m]);
  }
  pdl_launch_dependents();

  // ---- per warpgroup: row sums over the 8 lanes g and the 4 warps; O^T to true units
  float* lred = reinterpret_cast<float*>(smem + OFF_LRED) + u * 4 * NQ;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[j][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) lred[w * NQ + 8 * j + 2 * t + e] = l;
    }
  {
    const float unit = exp2i((int)((c_run4 >> (8 * w)) & 0xffu) - 127);
#pragma unroll
    for (int m = 0; m < 8; ++m)
#pragma unroll
      for (int i = 0; i < NACC; ++i) ot[m][i] *= unit;
  }
  named_bar_sync(BAR_ALL, 256);  // lred of both warpgroups; the ring is idle (every stage consumed)
  float Lr[NJ][2];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
      Lr[j][e] = lred[n] + lred[NQ + n] + lred[2 * NQ + n] + lred[3 * NQ + n];
    }
  const u32 ring = sb + OFF_RING;
  // O^T element (m, i) of thread (w, g, t): channel 16 (8w + g) + 2m + h, row 8j + 2t + e
  if (u == 1) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * j + 2 * t + e;
#pragma unroll
        for (int m = 0; m < 8; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sts_f32(ring + DUMP_O + 4u * (u32)(n * 512 + 16 * (8 * w + g) + 2 * m + h), ot[m][4 * j + 2 * h + e]);
        if (w == 0 && g == 0) sts_f32x2(ring + DUMP_ML + 8u * (u32)n, m_run[j][e], Lr[j][e]);
      }
  }
  named_bar_sync(BAR_ALL, 256);
  if (u == 1) return;

  // ---- warpgroup 0 merges warpgroup 1's state into its own
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * t + e;
      float m1, L1;
      m1 = lds_f32(ring + DUMP_ML + 8u * (u32)n);
      L1 = lds_f32(ring + DUMP_ML + 8u * (u32)n + 4u);
      const float mm = fmaxf(m_run[j][e], m1);
      const float w0 = fast_exp2(m_run[j][e] - mm), w1 = fast_exp2(m1 - mm);
      m_run[j][e] = mm;
      Lr[j][e] = Lr[j][e] * w0 + L1 * w1;
#pragma unroll
      for (int m = 0; m < 8; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float o1 = lds_f32(ring + DUMP_O + 4u * (u32)(n * 512 + 16 * (8 * w + g) + 2 * m + h));
          ot[m][4 * j + 2 * h + e] = ot[m][4 * j + 2 * h + e] * w0 + o1 * w1;
        }
    }
  named_bar_sync(BAR_WG0, 128);  // the dump is read: the ring may be overwritten
  const int rows = M < NQ ? M : NQ;
  const u32 stg = ring;

  if (S == 1) {
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
            const int ch = 16 * (8 * w + g) + 2 * m + h;
            sts_u16(stg + (u32)n * STG_BF16 + 2u * (u32)ch, (u16)(pack2<1>(ot[m][4 * j + 2 * h + e] * inv, 0.f) & 0xffffu));
          }
        if (w == 0 && g == 0 && n < rows) store_row_stats(a, lse_ptr(a, b, kvh, n), Lr[j][e], m_run[j][e]);
      }
    named_bar_sync(BAR_WG0, 128);
    for (int item = ctid; item < rows * 64; item += 128) {
      const int r = item >> 6, c = (item & 63) * 8;
      *reinterpret_cast<U32x4*>(out_row_ptr(a, b, kvh, r) + c) = lds_u32x4(stg + (u32)r * STG_BF16 + 2u * (u32)c);
    }
    return;
  }

  // ---- split > 1: fp32 partial (written even when empty) and {m, l}, then the ticket
  const long long unit = (long long)b * a.h_kv + kvh;  // nmb == 1
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
          const int ch = 16 * (8 * w + g) + 2 * m + h;
          sts_f32(stg + (u32)n * STG_F32 + 4u * (u32)ch, ot[m][4 * j + 2 * h + e]);
        }
      if (w == 0 && g == 0 && n < rows)
        *reinterpret_cast<F32x2*>(a.ws_ml + 2 * (slot0 + n)) = F32x2{m_run[j][e], Lr[j][e]};
    }
  named_bar_sync(BAR_WG0, 128);
  for (int item = ctid; item < rows * 128; item += 128) {
    const int r = item >> 7, c = (item & 127) * 4;
    float v0, v1, v2, v3;
    lds_f32x4(stg + (u32)r * STG_F32 + 4u * (u32)c, v0, v1, v2, v3);
    float* dst = a.ws_o + (slot0 + r) * MLA_D_V + c;
    *reinterpret_cast<F32x2*>(dst) = F32x2{v0, v1};
    *reinterpret_cast<F32x2*>(dst + 2) = F32x2{v2, v3};
  }
  if (!last_to_arrive(a, unit, reinterpret_cast<u32*>(smem + OFF_TICKET), S, ctid,
                      [] { named_bar_sync(BAR_WG0, 128); }))
    return;
  merge_partials<NQ, 128, 1>(a, reinterpret_cast<float*>(smem + OFF_RING), unit, S, b, kvh, 0, rows, ctid,
                             [] { named_bar_sync(BAR_WG0, 128); });
}
