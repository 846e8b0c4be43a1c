// gqadrv — MLA-private warp-level MMA helpers (sm_80+): ldmatrix without transpose and an
// m16n8k16 MMA on four scalar accumulator references (so that slices of a large accumulator
// array can be passed with compile-time indices). ldsm_x4_trans comes from common/ptx.cuh.
#pragma once

// ldmatrix.x4 (no transpose): lane l supplies the shared address of row l % 8 of matrix l / 8
// (16 contiguous bytes); register m of lane (g = l / 4, t = l % 4) receives
// {M_m[g][2t], M_m[g][2t + 1]} (low, high half).
GQADRV_DEVICE void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// {d0..d3} += A(16x16 row-major fragment a0..a3) * B(16x8 col-major fragment b0, b1), fp32.
// DT 0 = fp16, 1 = bf16. C/D layout: d0 = (g, 2t), d1 = (g, 2t+1), d2 = (g+8, 2t), d3 = (g+8, 2t+1).
template <int DT>
GQADRV_DEVICE void mma16816(float& d0, float& d1, float& d2, float& d3, u32 a0, u32 a1, u32 a2, u32 a3,
                            u32 b0, u32 b1) {
  if constexpr (DT == 1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
