// gqadrv — 5th-generation tensor core (tcgen05, tensor memory) support for sm_100a / sm_110a,
// shared by every kernel family that uses it:
//   1. inline-PTX wrappers (TMEM allocation, MMA, commit, TMEM loads/stores, waits, fences),
//   2. documented builders of the instruction descriptor and the shared-memory matrix descriptor.
// The GQA decode core built on them (tile geometry, MMA issue sequences, the online softmax that
// owns one TMEM lane) is kernels/gqa/common/tc_core.cuh.
//
// Everything below is compiled only for GQADRV_ARCH >= 100 (tcgen05 does not exist on sm_90a and is
// rejected by NVRTC on sm_120a). The kernels built on it are compile-verified only: they have never
// run.
#pragma once
#include "ptx.cuh"

#if GQADRV_ARCH >= 100

// ============================================================================ 1. PTX wrappers
// All tcgen05 instructions of a kernel must use the same .cta_group; gqadrv uses ::1 throughout.

// TMEM allocation (warp-collective: the whole warp executes it, .sync.aligned). Writes the TMEM base
// address (lane 0, first column) to shared memory at `dst_smem`. ncols: power of two in [32, 512].
GQADRV_DEVICE void tmem_alloc(u32 dst_smem, u32 ncols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(dst_smem),
               "r"(ncols)
               : "memory");
}
// Give up the right to allocate again (lets other CTAs on the SM allocate without waiting on us).
GQADRV_DEVICE void tmem_relinquish_alloc_permit() {
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;" ::: "memory");
}
// Warp-collective; must be executed by the warp that allocated, with the same column count.
GQADRV_DEVICE void tmem_dealloc(u32 taddr, u32 ncols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(taddr), "r"(ncols)
               : "memory");
}

// Ordering of asynchronous tcgen05 operations across a thread synchronisation (mbarrier, bar.sync):
// the producer side issues before_thread_sync before it arrives, the consumer side issues
// after_thread_sync after its wait and before its own tcgen05 operations.
GQADRV_DEVICE void tc_fence_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
GQADRV_DEVICE void tc_fence_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// Arrive (count 1) on the mbarrier once every tcgen05.mma issued so far by this thread completed.
// (Implies the before_thread_sync ordering of those MMAs.) The shared::cta address of our own CTA
// is a valid shared::cluster address.
GQADRV_DEVICE void tc_commit(u32 mbar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::"r"(mbar)
               : "memory");
}

// D[tmem] (=|+=) A[smem] * B[smem]; `accumulate` = 0 overwrites D. Single-thread issue.
GQADRV_DEVICE void tc_mma_ss(u32 d_tmem, u64 a_desc, u64 b_desc, u32 idesc, u32 accumulate) {
  asm volatile(
      "{\n"
      " .reg .pred acc;\n"
      " setp.ne.b32 acc, %4, 0;\n"
      " tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, acc;\n"
      "}\n" ::"r"(d_tmem),
      "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(accumulate)
      : "memory");
}

// Warp-collective TMEM -> registers, shape 32x32b, 16 repetitions: thread l of the warp receives 16
// consecutive 32-bit columns of TMEM lane (lane field of taddr) + l. Asynchronous: the registers
// may only be used after tc_wait_ld().
GQADRV_DEVICE void tmem_ld_32x32b_x16(u32 taddr, u32 (&r)[16]) {
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
      " [%16];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]),
        "=r"(r[15])
      : "r"(taddr)
      : "memory");
}
// Warp-collective registers -> TMEM, the same shape. Complete only after tc_wait_st().
GQADRV_DEVICE void tmem_st_32x32b_x16(u32 taddr, const u32 (&r)[16]) {
  asm volatile(
      "tcgen05.st.sync.aligned.32x32b.x16.b32 [%0],"
      " {%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16};" ::"r"(taddr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]),
      "r"(r[9]), "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15])
      : "memory");
}
GQADRV_DEVICE void tc_wait_ld() { asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory"); }
GQADRV_DEVICE void tc_wait_st() { asm volatile("tcgen05.wait::st.sync.aligned;" ::: "memory"); }

GQADRV_DEVICE void st_shared_v4(u32 addr, U32x4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
GQADRV_DEVICE void st_shared_u16(u32 addr, u16 v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// ============================================================================ 2. descriptors
// ---- Instruction descriptor of tcgen05.mma .kind::f16 (32 bits, PTX ISA "Instruction descriptor"):
//   bits  0-1  sparsity selector            0 (dense)
//   bit   2    sparsity enable              0
//   bit   3    saturate (integer kinds)     0
//   bits  4-5  D type                       1 = F32 (0 = F16)
//   bit   6    reserved                     0
//   bits  7-9  A type                       0 = F16, 1 = BF16
//   bits 10-12 B type                       0 = F16, 1 = BF16
//   bit  13    negate A                     0
//   bit  14    negate B                     0
//   bit  15    transpose A                  0 = K-major A, 1 = MN-major A
//   bit  16    transpose B                  0 = K-major B, 1 = MN-major B
//   bits 17-22 N >> 3
//   bit  23    reserved                     0
//   bits 24-28 M >> 4
//   bit  29    reserved                     0
//   bits 30-31 max shift (.ws only)         0
// dt: 0 = fp16, 1 = bf16 inputs; fp32 accumulation always.
__host__ __device__ constexpr u32 tc_idesc_f16(int dt, int m, int n, bool a_mn_major, bool b_mn_major) {
  return (1u << 4) | ((u32)dt << 7) | ((u32)dt << 10) | ((a_mn_major ? 1u : 0u) << 15) |
         ((b_mn_major ? 1u : 0u) << 16) | ((u32)(n >> 3) << 17) | ((u32)(m >> 4) << 24);
}

// ---- Shared-memory matrix descriptor (64 bits, PTX ISA "Shared memory descriptor"):
//   bits  0-13  start address        (addr & 0x3FFFF) >> 4
//   bits 16-29  leading-dim byte offset (LBO) >> 4
//   bits 32-45  stride-dim byte offset  (SBO) >> 4
//   bits 46-48  fixed constant 0b001
//   bits 49-51  matrix base offset   0: every swizzle pattern starts on a 1024-byte boundary here
//   bit  52     LBO mode             0 = relative byte offset
//   bits 53-60  fixed constant 0
//   bits 61-63  swizzle mode         0 none, 1 128B/32B-atom, 2 128B, 4 64B, 6 32B
// Canonical SWIZZLE_128B layouts for 16-bit elements (T = 8 elements = 16 bytes), each 1024-byte
// atom = 8 rows of 128 bytes, 16-byte chunk index XOR (row & 7), as written by TMA SWIZZLE_128B
// and by swizzled_chunk_offset (kernels/common/swizzle.cuh):
//   K-major  ((8,m),(T,2k)) : ((8T,SBO),(1,T))   rows = M/N index, 64 K elements per 128-byte row;
//            SBO = distance of 8-row groups (1024 here); LBO unused (encoded 1). A K step of 16
//            elements inside the atom advances the start address by 32 bytes.
//   MN-major ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))  rows = K index, 64 MN elements per row;
//            LBO = distance of 64-element MN blocks (the next TMA box), SBO = distance of 8-row
//            K groups (1024 here). A K step of 16 rows advances the start address by 2048 bytes.
constexpr u32 TC_SWIZZLE_128B = 2;
GQADRV_DEVICE u64 tc_smem_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes, u32 swizzle = TC_SWIZZLE_128B) {
  const u64 lo = (u64)((smem_addr & 0x3FFFFu) >> 4) | ((u64)((lbo_bytes & 0x3FFFFu) >> 4) << 16);
  const u64 hi = (u64)((sbo_bytes & 0x3FFFFu) >> 4) | (1ull << 14) /* bit 46 */ | ((u64)swizzle << 29) /* bits 61-63 */;
  return lo | (hi << 32);
}

#endif  // GQADRV_ARCH >= 100
