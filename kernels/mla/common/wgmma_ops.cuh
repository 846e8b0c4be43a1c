// gqadrv — MLA-private wgmma wrappers with both transpose immediates (sm_90a only), used by the
// seesaw (dense_decode_seesaw.cu) and narrow (dense_decode_narrow.cu) kernels. Included after
// wgmma.cuh (descriptor helper, fence / commit / wait, accumulator layout comment).
//
//   wgmma_m64nNk16_ss_t<DT, TA, TB>(d, desc_a, desc_b, scale_d)   A and B from shared memory
//   wgmma_m64nNk16_rs<DT, TB>(d, a0..a3, desc_b, scale_d)         A from registers (4 x b32 per thread)
//
// TA / TB: 0 = K-major, 1 = MN-major (transposed; 16-bit types only). scale_d = 0 overwrites D.
// RS A fragment (per warp w of the warpgroup, rows 16w .. 16w+15; lane l = 4g + t), two 16-bit
// values per register, low half = lower column:
//   a0 = A[16w+g][2t, 2t+1]   a1 = A[16w+g+8][2t, 2t+1]   a2 = A[16w+g][2t+8, 2t+9]   a3 = A[16w+g+8][2t+8, 2t+9]
// which is accumulator registers d[8k .. 8k+7] of an m64nN fp32 result, columns 16k .. 16k+15,
// packed pairwise: the C -> A reuse of P in the P V product.
// The long operand lists below were generated mechanically (one "+f" per accumulator register).
#pragma once
#include "wgmma.cuh"

#define MLA_WGMMA_M64N16K16_SS(TY)                                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"                                \
               " wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])                                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
template <int DT, int TA, int TB>
GQADRV_DEVICE void wgmma_m64n16k16_ss_t(float (&d)[8], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N16K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N16K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N16K16_SS

#define MLA_WGMMA_M64N32K16_SS(TY)                                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                \
               " wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
template <int DT, int TA, int TB>
GQADRV_DEVICE void wgmma_m64n32k16_ss_t(float (&d)[16], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N32K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N32K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N32K16_SS

#define MLA_WGMMA_M64N64K16_SS(TY)                                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                                \
               " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
template <int DT, int TA, int TB>
GQADRV_DEVICE void wgmma_m64n64k16_ss_t(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N64K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N64K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N64K16_SS

#define MLA_WGMMA_M64N256K16_SS(TY)                                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                \
               " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
               "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
               "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
               "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
               "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
                 "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
                 "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
                 "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
                 "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
                 "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
                 "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
                 "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
                 "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                 \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
template <int DT, int TA, int TB>
GQADRV_DEVICE void wgmma_m64n256k16_ss_t(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N256K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N256K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N256K16_SS

#define MLA_WGMMA_M64N256K16_RS(TY)                                                        \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %133, 0;\n"                                \
               " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
               "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
               "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
               "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
               "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
                 "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
                 "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
                 "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
                 "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
                 "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
                 "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
                 "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
                 "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                 \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d), "n"(TB))
template <int DT, int TB>
GQADRV_DEVICE void wgmma_m64n256k16_rs(float (&d)[128], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N256K16_RS("bf16");
  } else {
    MLA_WGMMA_M64N256K16_RS("f16");
  }
}
#undef MLA_WGMMA_M64N256K16_RS
