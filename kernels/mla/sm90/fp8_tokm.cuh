// gqadrv — pieces shared by the sm_90a MLA decode kernels that read FlashMLA's 656-byte FP8 cache
// with tokens as the wgmma M dimension and dequantize the e4m3 codes into register A fragments
// (dense_decode_narrow_fp8.cu: 16 query rows; dense_decode_wide_fp8.cu: 64 query rows).
//
//   sreg<I>()                      %ctaid.x / y / z (I = 0, 1, 2) or %tid.x (I = 3), re-read (volatile)
//   setmaxnreg_{dec_producer,inc_consumer}()   register budgets 24 / 240 of a 384-thread CTA at 168
//   e4m3x4_to_f16x2 / hmul2 / hmul2_bf16 / vmax4 / exp2i   conversion and scalar helpers
//   wgmma_rs<DT, N>(d, a0..a3, desc_b, scale_d)   wgmma m64nNk16, A from registers, N = 16 or 64
//   bulk_g2s(dst, src, bytes, bar)                  cp.async.bulk global -> shared, complete_tx on bar
//   produce_rows<NSTAGE, HALVES>(...)               the producer warpgroup's loop (below)
//   over_g(v, op)                                   v reduced over the 8 lanes g of a warp (xor 4, 8, 16)
//   wg_all(flags, w, lane, id, v)                   a warpgroup-wide AND of v through 4 smem flags + barrier id
//   q_logical_latent(p) / q_logical_rope(c)         the logical k index of a physical Q channel
//
// Logical channel order of the S^T GEMM (both kernels): in a 656-byte token row, k16 step 4j + q of
// 64-channel block pair (scale block b = j / 2, half jj = j % 2) reads, in lane t (0..3), 32-bit word q
// of the 16-byte unit 8b + jj + 2t: codes (0, 1) of that word are A columns (2t, 2t + 1), codes (2, 3)
// columns (2t + 8, 2t + 9). Q is stored in that order, so every k16 step multiplies one consistent
// 16-channel subset. The RoPE channels (bf16, byte 528 on) are read as 32 bytes per lane t (units 2t,
// 2t + 1); step q takes words 2 (q % 2), 2 (q % 2) + 1 of unit 2t + q / 2.
#pragma once
#include "../../common/ptx.cuh"
#include "../common/args.cuh"
#include "../common/sync.cuh"

namespace mla {
namespace tokm {

constexpr u32 ROW = 656;  // bytes of one token row in the cache and in a stage
constexpr u32 SCALES_AT = 512, ROPE_AT = 528;
constexpr u32 STAGE = 64 * ROW;  // one 64-token tile

template <int I>
GQADRV_DEVICE int sreg() {
  int v;
  if (I == 0) asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v));
  if (I == 1) asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
  if (I == 2) asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v));
  if (I == 3) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
  return v;
}
// setmaxnreg budgets: 2 x 128 x 240 + 128 x 24 = 64512 = 384 x 168 (the launch allocation)
constexpr int CONSUMER_REGS = 240, PRODUCER_REGS = 24;
static_assert(2 * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS <= 384 * 168, "setmaxnreg budgets exceed the launch allocation");
GQADRV_DEVICE void setmaxnreg_dec_producer() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS)); }
GQADRV_DEVICE void setmaxnreg_inc_consumer() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS)); }

// Two e4m3 codes each of the two 16-bit halves of w -> two f16x2 (exact; NaN codes give NaN).
GQADRV_DEVICE void e4m3x4_to_f16x2(u32 w, u32& lo, u32& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}
GQADRV_DEVICE u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
GQADRV_DEVICE u32 hmul2_bf16(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
GQADRV_DEVICE u32 vmax4(u32 a, u32 b) { return __vmaxu4(a, b); }
// 2^k as a float for k <= 127 (subnormal down to 2^-149, 0 below).
GQADRV_DEVICE float exp2i(int k) {
  return k >= -126 ? __uint_as_float((u32)(k + 127) << 23) : (k >= -149 ? __uint_as_float(1u << (k + 149)) : 0.f);
}

// D (+)= A B, m64nNk16, A from registers (a0..a3), B from shared memory (K-major, 128B swizzle).
template <int DT, int N>
GQADRV_DEVICE void wgmma_rs(float (&d)[N / 2], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b, int scale_d) {
  static_assert(N == 16 || N == 64, "wgmma_rs: N = 16 or 64");
#define TOKM_RS16(TY)                                                                                         \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"                                                 \
               " wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY                                       \
               " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"                \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d))
#define TOKM_RS64(TY)                                                                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                                  \
               " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                        \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19,"  \
               " %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"                                 \
               " {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
                 "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
                 "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
                 "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                          \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d))
  if constexpr (N == 16) {
    if constexpr (DT == 1) {
      TOKM_RS16("bf16");
    } else {
      TOKM_RS16("f16");
    }
  } else {
    if constexpr (DT == 1) {
      TOKM_RS64("bf16");
    } else {
      TOKM_RS64("f16");
    }
  }
#undef TOKM_RS16
#undef TOKM_RS64
}

// v reduced with op over the 8 lanes g of a warp that share t (lane = 4g + t: xor 4, 8, 16), i.e. over
// the 16 rows of an mma C fragment column.
template <class T, class Op>
GQADRV_DEVICE T over_g(T v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

// A vote of the 128 threads (4 warps) of a warpgroup: true when v holds in every one of them. flags:
// the warpgroup's 4 u32 in shared memory (16-byte aligned), written before and read after named barrier
// `id`; the caller orders the next vote's writes after this vote's reads (a later barrier).
GQADRV_DEVICE bool wg_all(u32 flags, int w, int lane, u32 id, bool v) {
  const bool wv = __all_sync(0xffffffffu, v);
  if (lane == 0) sts_u32(flags + 4u * (u32)w, wv ? 1u : 0u);
  named_bar_sync(id, 128);
  const U32x4 f = lds_u32x4(flags);
  return (f.x & f.y & f.z & f.w) != 0u;
}

GQADRV_DEVICE void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// The producer warpgroup (warps 8..11 of the CTA, warp pw = warp - 8): for every tile k of the CTA's
// split (tiles t_beg .. t_beg + nt - 1 of request row bt_row, KV head kvh) and its HALVES stages of
// 64 / HALVES rows (stage index i = HALVES k + pw / (4 / HALVES), slot i % NSTAGE): wait empty
// (parity starts at 1), lane 0 arrive.expect_tx(valid rows x 656 bytes) on full (one arrival per
// producer warp: count 4 / HALVES), then copy token rows 16 pw .. 16 pw + 15 of the tile that are below
// tok_end: one 10,496-byte bulk copy when the cache rows are 656 bytes apart, the page holds >= 16
// tokens and all 16 rows are valid, else one 656-byte copy per valid row. Rows at or past tok_end are
// never read, nor their block-table entries; the entries of the next tile are read one tile ahead.
// With half stages and an odd NSTAGE a slot serves both halves in turn, so a warp must wait on every
// stage's empty barrier in order (both halves of each tile), not only on its own: a parity wait cannot
// tell phase n from phase n + 2, and a warp that skipped the other half's use of a slot could pass its
// next wait on that slot while the slot is still being read (tools/mla_dev_check.py wide_fp8_model).
template <int NSTAGE, int HALVES = 1, class FullBar, class EmptyBar, class StageAt>
GQADRV_DEVICE void produce_rows(const MlaDecodeArgs& a, const i32* bt_row, int kvh, int t_beg, int nt, int tok_end,
                                int pw, int lane, FullBar full_bar, EmptyBar empty_bar, StageAt stage_at) {
  static_assert(HALVES == 1 || HALVES == 2, "produce_rows: stages of 64 or 32 rows");
  const int r = 16 * pw + (lane & 15);
  const int h = pw / (4 / HALVES);             // the warp's stage of the tile
  const int rs = r - h * (64 / HALVES);        // its rows' place in that stage
  auto blk_at = [&](int tile) { return tile * 64 + r < tok_end ? bt_row[(tile * 64 + r) >> a.page_shift] : 0; };
  int blk = nt > 0 ? blk_at(t_beg) : 0;
  const bool contiguous = a.k_stride_tok == (long long)(ROW / 2) && a.page_size >= 16;
#pragma unroll 1
  for (int k = 0; k < nt; ++k) {
    const int tile = t_beg + k, i = HALVES * k + h, s = i % NSTAGE;
    const int nxt = k + 1 < nt ? blk_at(tile + 1) : 0;
    const int nvw = min(max(tok_end - tile * 64 - 16 * pw, 0), 16);  // valid rows of this warp
    if (HALVES == 2 && h == 1) {  // first the other half's stage of this tile: see below
      const int j = i - 1;
      mbar_wait_wd(empty_bar(j % NSTAGE), (u32)((j / NSTAGE) & 1) ^ 1u);
    }
    mbar_wait_wd(empty_bar(s), (u32)((i / NSTAGE) & 1) ^ 1u);
    if (HALVES == 2 && h == 0) {
      const int j = i + 1;
      mbar_wait_wd(empty_bar(j % NSTAGE), (u32)((j / NSTAGE) & 1) ^ 1u);
    }
    if (lane == 0) mbar_arrive_expect_tx(full_bar(s), (u32)nvw * ROW);
    __syncwarp();
    const int tok = tile * 64 + r;
    const u8* src = reinterpret_cast<const u8*>(a.k_cache + (long long)blk * a.k_stride_block +
                                                (long long)(tok & (a.page_size - 1)) * a.k_stride_tok +
                                                (long long)kvh * a.k_stride_head);
    if (contiguous && nvw == 16) {  // the warp's 16 rows are one run of the page: one copy
      if (lane == 0) bulk_g2s(stage_at(s) + (u32)rs * ROW, src, 16 * ROW, full_bar(s));
    } else if (lane < nvw) {
      bulk_g2s(stage_at(s) + (u32)rs * ROW, src, ROW, full_bar(s));
    }
    blk = nxt;
  }
}

// Logical k index (0..511) of physical latent channel p (the S^T order above).
GQADRV_DEVICE int q_logical_latent(int p) {
  const int c = p >> 4, r = p & 15, bq = c >> 3, jj = c & 1, tt = (c >> 1) & 3, q = r >> 2, rr = r & 3;
  return 16 * (8 * bq + 4 * jj + q) + (rr < 2 ? 2 * tt + rr : 2 * tt + 8 + rr - 2);
}
// Logical k index (0..63) of physical RoPE channel c (c = 16 tt + 4 q + rr).
GQADRV_DEVICE int q_logical_rope(int c) {
  const int tt = c >> 4, q = (c >> 2) & 3, rr = c & 3;
  return 16 * q + (rr < 2 ? 2 * tt + rr : 2 * tt + 8 + rr - 2);
}

}  // namespace tokm
}  // namespace mla
