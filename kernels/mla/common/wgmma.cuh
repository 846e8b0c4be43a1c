// gqadrv — MLA-private wgmma wrappers (sm_90a only: wgmma does not exist on sm_100).
//
// Accumulator layout of wgmma .m64nNk16 with fp32 D (per warpgroup): warp w (0..3 of the
// warpgroup) owns rows 16w .. 16w+15; lane l = 4g + t holds, for every 8-column chunk j,
//   d[4j + 0] = D[16w + g    ][8j + 2t    ]   d[4j + 1] = D[16w + g    ][8j + 2t + 1]
//   d[4j + 2] = D[16w + g + 8][8j + 2t    ]   d[4j + 3] = D[16w + g + 8][8j + 2t + 1]
// i.e. per warp exactly the mma.sync m16n8 C layout repeated over N/8 chunks.
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
// The long operand lists of the two MMA wrappers below were written out mechanically (one
// "+f" per accumulator register); everything else is hand-written.
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

// D[64 x 32] (+)= A[64 x 16] * B[16 x 32], fp32 accumulators (d: 16 registers per thread, the layout
// above), A and B from shared memory through descriptors. TB = 0: B is K-major; TB = 1: B is
// MN-major (transposed). scale_d = 0 overwrites D, 1 accumulates. Issued by a whole warpgroup.
#define MLA_WGMMA_M64N32K16_SS(TY)                                                   \
  asm volatile(                                                                        \
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                  \
      " wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {"                  \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"  \
      "}, %16, %17, p, 1, 1, 0, %19;\n}\n"  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])  \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TB))
template <int DT, int TB>
GQADRV_DEVICE void wgmma_m64n32k16_ss(float (&d)[16], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N32K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N32K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N32K16_SS

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], fp32 accumulators (d: 128 registers per thread, the layout
// above), A and B from shared memory through descriptors. TB = 0: B is K-major; TB = 1: B is
// MN-major (transposed). scale_d = 0 overwrites D, 1 accumulates. Issued by a whole warpgroup.
#define MLA_WGMMA_M64N256K16_SS(TY)                                                   \
  asm volatile(                                                                        \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                  \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"                  \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "  \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "  \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "  \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "  \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "  \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"  \
      "}, %128, %129, p, 1, 1, 0, %131;\n}\n"  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TB))
template <int DT, int TB>
GQADRV_DEVICE void wgmma_m64n256k16_ss(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
  if constexpr (DT == 1) {
    MLA_WGMMA_M64N256K16_SS("bf16");
  } else {
    MLA_WGMMA_M64N256K16_SS("f16");
  }
}
#undef MLA_WGMMA_M64N256K16_SS
