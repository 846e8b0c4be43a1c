// gqadrv — MLA-private wgmma wrappers (sm_90a only: wgmma does not exist on sm_100), used by all
// three wgmma kernels (dense_decode.cu with MLA_MMA=1, dense_decode_seesaw.cu, dense_decode_narrow.cu).
//
//   wgmma_desc_sw128(addr, lbo, sbo)                               shared-memory matrix descriptor
//   wgmma_fence / wgmma_commit / wgmma_wait<N> / reg_fence(r)      ordering around the async region
//   wgmma_m64nNk16_ss<DT, TA, TB>(d, desc_a, desc_b, scale_d)      N = 16, 32, 64, 256; A, B from smem
//   wgmma_m64n256k16_rs<DT, TB>(d, a0..a3, desc_b, scale_d)        A from registers (4 x b32 per thread)
//
// DT: 0 = fp16, 1 = bf16 inputs, fp32 accumulators. TA / TB: 0 = K-major, 1 = MN-major (transposed;
// 16-bit types only). scale_d = 0 overwrites D, 1 accumulates. Issued by a whole warpgroup.
//
// Accumulator layout of wgmma .m64nNk16 with fp32 D (per warpgroup): warp w (0..3 of the
// warpgroup) owns rows 16w .. 16w+15; lane l = 4g + t holds, for every 8-column chunk j,
//   d[4j + 0] = D[16w + g    ][8j + 2t    ]   d[4j + 1] = D[16w + g    ][8j + 2t + 1]
//   d[4j + 2] = D[16w + g + 8][8j + 2t    ]   d[4j + 3] = D[16w + g + 8][8j + 2t + 1]
// i.e. per warp exactly the mma.sync m16n8 C layout repeated over N/8 chunks (N / 2 registers).
//
// RS A fragment (per warp w of the warpgroup, rows 16w .. 16w+15; lane l = 4g + t), two 16-bit
// values per register, low half = lower column:
//   a0 = A[16w+g][2t, 2t+1]   a1 = A[16w+g+8][2t, 2t+1]   a2 = A[16w+g][2t+8, 2t+9]   a3 = A[16w+g+8][2t+8, 2t+9]
// which is accumulator registers d[8k .. 8k+7] of an m64nN fp32 result, columns 16k .. 16k+15,
// packed pairwise: the C -> A reuse of P in the P V product.
//
// Shared-memory matrix descriptor (64 bits): start address >> 4 in bits 0..13, leading byte
// offset >> 4 in 16..29, stride byte offset >> 4 in 32..45, base offset 49..51 (0: every swizzle
// atom used here starts on a 1024-byte boundary), layout in 62..63 (1 = 128-byte swizzle).
// 128B-swizzled canonical layouts (16-bit elements, T = 8 elements = 16 bytes):
//   K-major : 8-row groups of 128-byte rows; SBO = byte distance between 8-row groups (1024 for
//             dense 128-byte rows); LBO unused (set to 16 bytes); a k16 step inside the 128-byte
//             row advances the start address by 32 bytes.
//   MN-major: atoms of 8 K-rows x 64 contiguous MN elements (128 B); LBO = byte distance between
//             64-element MN atoms, SBO = byte distance between 8-row K groups.
#pragma once

#if GQADRV_ARCH != 90
#error "wgmma is sm_90a-only: build the MLA_MMA=0 (mma.sync) variant for other targets"
#endif

GQADRV_DEVICE u64 wgmma_desc_sw128(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
  u64 d = (u64)((smem_addr & 0x3FFFFu) >> 4);
  d |= (u64)((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= (u64)((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= (u64)1 << 62;  // 128-byte swizzle
  return d;
}

GQADRV_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
GQADRV_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
GQADRV_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pin accumulator registers in place around the asynchronous region: after wgmma_wait, reads of
// `r` cannot be hoisted above it (the empty asm "redefines" r after the wait in program order).
GQADRV_DEVICE void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <int N>
GQADRV_DEVICE void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}

// ------------------------------------------------------------------ generated MMA wrappers
// The accumulators are always operands %0 .. %(N/2 - 1) ("+f" outputs come first); the inputs
// follow, so their operand numbers (passed as literal tokens below) depend on N.
// MLA_WG_R<n>: the PTX names of the first n accumulator operands; MLA_WG_D<n>(i): the "+f"
// constraints of d[i] .. d[i + n - 1].
#define MLA_WG_R8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define MLA_WG_R16 MLA_WG_R8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define MLA_WG_R32 MLA_WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MLA_WG_R128 MLA_WG_R32                                                                  \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"             \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"             \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"             \
  ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"             \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"  \
  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MLA_WG_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MLA_WG_D16(i) MLA_WG_D8(i), MLA_WG_D8(i + 8)
#define MLA_WG_D32(i) MLA_WG_D16(i), MLA_WG_D16(i + 16)
#define MLA_WG_D128(i) MLA_WG_D32(i), MLA_WG_D32(i + 32), MLA_WG_D32(i + 64), MLA_WG_D32(i + 96)

// D (+)= A B with A and B from shared memory; operands %DA, %DB (descriptors), %SD (scale_d),
// %ITA, %ITB (transpose immediates). The accumulator constraints come last (they contain commas).
#define MLA_WGMMA_SS_ASM(N, TY, REGS, DA, DB, SD, ITA, ITB, ...)                                    \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #SD ", 0;\n"                                  \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, %" #DA  \
               ", %" #DB ", p, 1, 1, %" #ITA ", %" #ITB ";\n}\n"                                     \
               : __VA_ARGS__                                                                        \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
#define MLA_WGMMA_SS_FN(N, NACC, REGS, DA, DB, SD, ITA, ITB, ...)                                   \
  template <int DT, int TA, int TB>                                                                 \
  GQADRV_DEVICE void wgmma_m64n##N##k16_ss(float (&d)[NACC], u64 desc_a, u64 desc_b, int scale_d) { \
    if constexpr (DT == 1) {                                                                        \
      MLA_WGMMA_SS_ASM(N, "bf16", REGS, DA, DB, SD, ITA, ITB, __VA_ARGS__);                          \
    } else {                                                                                        \
      MLA_WGMMA_SS_ASM(N, "f16", REGS, DA, DB, SD, ITA, ITB, __VA_ARGS__);                           \
    }                                                                                               \
  }
MLA_WGMMA_SS_FN(16, 8, MLA_WG_R8, 8, 9, 10, 11, 12, MLA_WG_D8(0))
MLA_WGMMA_SS_FN(32, 16, MLA_WG_R16, 16, 17, 18, 19, 20, MLA_WG_D16(0))
MLA_WGMMA_SS_FN(64, 32, MLA_WG_R32, 32, 33, 34, 35, 36, MLA_WG_D32(0))
MLA_WGMMA_SS_FN(256, 128, MLA_WG_R128, 128, 129, 130, 131, 132, MLA_WG_D128(0))

// D (+)= A B with A from registers (a0..a3: %128..%131), B from shared memory (%132), scale_d %133,
// transpose-B immediate %134.
#define MLA_WGMMA_M64N256K16_RS_ASM(TY)                                                            \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %133, 0;\n"                                       \
               " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" MLA_WG_R128            \
               "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"                              \
               : MLA_WG_D128(0)                                                                     \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d), "n"(TB))
template <int DT, int TB>
GQADRV_DEVICE void wgmma_m64n256k16_rs(float (&d)[128], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N256K16_RS_ASM("bf16");
  } else {
    MLA_WGMMA_M64N256K16_RS_ASM("f16");
  }
}

#undef MLA_WGMMA_M64N256K16_RS_ASM
#undef MLA_WGMMA_SS_FN
#undef MLA_WGMMA_SS_ASM
#undef MLA_WG_D128
#undef MLA_WG_D32
#undef MLA_WG_D16
#undef MLA_WG_D8
#undef MLA_WG_R128
#undef MLA_WG_R32
#undef MLA_WG_R16
#undef MLA_WG_R8
