// gqadrv — header-only PTX wrappers shared by every kernel family.
//
// No CUDA toolkit header is included anywhere: NVRTC's implicit builtins (threadIdx, __syncthreads,
// __shfl_xor_sync, atomics) plus the inline PTX below are all the kernels use, so a compile needs
// nothing but libnvrtc and takes tens of milliseconds.
//
// Architecture gates: GQADRV_ARCH is set by the host compiler (80, 90, 100, 110). Hopper-and-newer
// instructions (TMA, mbarrier expect_tx, griddepcontrol) compile to nothing below sm_90 so that
// shared code can include this file from the sm_80 portable kernels too.
#pragma once

#ifndef GQADRV_ARCH
#error "GQADRV_ARCH must be defined by the host compiler (80, 90, 100, 110)"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#define GQADRV_DEVICE __device__ __forceinline__

// A CUtensorMap passed by value (128 bytes). The host copies the encoded bytes into the
// parameter buffer; the kernel uses &desc as the generic address of the descriptor.
struct alignas(64) TmaDesc {
  u64 words[16];
};

struct alignas(16) U32x4 {
  u32 x, y, z, w;
};

struct alignas(8) F32x2 {
  float x, y;
};

GQADRV_DEVICE u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

GQADRV_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// ----------------------------------------------------------------------------- math
GQADRV_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Pack two fp32 values into one 32-bit register of two 16-bit floats: `lo` goes to bits 0..15.
template <int DT>
GQADRV_DEVICE u32 pack2(float lo, float hi);
template <>
GQADRV_DEVICE u32 pack2<0>(float lo, float hi) {  // fp16
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <>
GQADRV_DEVICE u32 pack2<1>(float lo, float hi) {  // bf16
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Unpack one 32-bit register of two 16-bit floats.
template <int DT>
GQADRV_DEVICE void unpack2(u32 v, float& lo, float& hi);
template <>
GQADRV_DEVICE void unpack2<0>(u32 v, float& lo, float& hi) {
  u16 a = (u16)(v & 0xffffu), b = (u16)(v >> 16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
}
template <>
GQADRV_DEVICE void unpack2<1>(u32 v, float& lo, float& hi) {
  lo = __int_as_float((int)(v << 16));
  hi = __int_as_float((int)(v & 0xffff0000u));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulate. DT 0 = fp16, 1 = bf16. Not volatile: a pure
// register computation, so the compiler may interleave independent accumulator chains.
template <int DT>
GQADRV_DEVICE void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1);
template <>
GQADRV_DEVICE void mma_16816<0>(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
GQADRV_DEVICE void mma_16816<1>(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------------------- memory
// ldmatrix.x4.trans (sm_75+): four 8x8 b16 matrices; lane l supplies the shared address of row l % 8
// of matrix l / 8 (16 contiguous bytes); register m of lane (g = l / 4, t = l % 4) receives
// {M_m[2t][g], M_m[2t + 1][g]} (low, high half): an mma.sync B fragment of a row-major tile.
// Not a memory clobber: ordering against the mbarrier waits comes from asm volatile.
GQADRV_DEVICE void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// stmatrix.m8n8.x4 (sm_90+): matrix i (register ri of every lane, the mma fragment layout: lane 4g + t
// holds row g, columns 2t, 2t + 1) goes to the 16-byte rows whose shared addresses lanes 8i .. 8i + 7
// give.
GQADRV_DEVICE void stsm_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2),
               "r"(r3)
               : "memory");
}
// The same, transposed: element (g, 2t + e) of matrix i goes to column g of row 2t + e.
GQADRV_DEVICE void stsm_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
GQADRV_DEVICE U32x4 ld_global_nc_v4(const void* p) {
  U32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// L2-only loads (bypass L1): used for data another CTA wrote during this launch.
GQADRV_DEVICE void ld_cg_f32x2(const float* p, float& a, float& b) {
  asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];" : "=f"(a), "=f"(b) : "l"(p));
}
GQADRV_DEVICE void ld_cg_f32x4(const float* p, float& a, float& b, float& c, float& d) {
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "l"(p));
}

// 16-byte asynchronous global->shared copy (sm_80+). src_bytes = 0 zero-fills the destination
// without reading global memory.
GQADRV_DEVICE void cp_async_16(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The same with an L2 cache policy (createpolicy) and a 256-byte L2 prefetch of the source's sector
// group (scattered 1 KB rows: the other units of the row are then in L2 when their copies arrive).
GQADRV_DEVICE void cp_async_16_l2(u32 dst, const void* src, u32 src_bytes, u64 policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
GQADRV_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
GQADRV_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Dynamic shared memory actually provided by the launch (bytes).
GQADRV_DEVICE u32 dynamic_smem_bytes() {
  u32 r;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// ----------------------------------------------------------------------------- named barriers
// bar.sync / bar.arrive on hardware barrier `id` (1..15; 0 is __syncthreads) expecting `count`
// threads (a multiple of 32): barriers for a subset of the warps; in producer/consumer hand-offs one
// side arrives, the other syncs.
GQADRV_DEVICE void named_bar_sync(u32 id, u32 count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
GQADRV_DEVICE void named_bar_arrive(u32 id, u32 count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ----------------------------------------------------------------------------- mbarrier / TMA
// Non-binding prefetches of the line holding `p` (no register result, never faults on a valid
// address; nothing waits for them).
GQADRV_DEVICE void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
GQADRV_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

#if GQADRV_ARCH >= 90
GQADRV_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Make barrier initialisation visible to the async proxy (TMA complete_tx).
GQADRV_DEVICE void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
GQADRV_DEVICE void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
GQADRV_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
GQADRV_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spin until the barrier's phase with the given parity has completed.
GQADRV_DEVICE void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      " WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// ---- thread-block clusters (distributed shared memory)
// Rank of this CTA in its cluster and the cluster's CTA count (1 for a launch without clusters).
GQADRV_DEVICE u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
GQADRV_DEVICE u32 cluster_nctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
// Cluster barrier halves; every thread of every CTA of the cluster arrives once, convergent per warp.
// The relaxed arrive orders nothing by itself: the mbarrier inits it publishes are released by
// fence_mbarrier_init (release.cluster) before it, and the wait acquires.
GQADRV_DEVICE void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
GQADRV_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// The shared::cluster address of shared::cta address `addr` in the CTA of cluster rank `rank`.
GQADRV_DEVICE u32 map_shared_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// One-way stores into another CTA's shared memory (shared::cluster addresses from map_shared_rank),
// each completing its bytes on the mbarrier `bar` of that CTA (also a shared::cluster address).
GQADRV_DEVICE void st_async_v4(u32 addr, U32x4 v, u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar) : "memory");
}
GQADRV_DEVICE void st_async_v2(u32 addr, u32 a, u32 b, u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
               ::"r"(addr), "r"(a), "r"(b), "r"(bar) : "memory");
}
GQADRV_DEVICE void tma_prefetch_desc(const TmaDesc* desc) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(desc) : "memory");
}
// 4-D tiled TMA load into shared memory, completing on an mbarrier, with an L2 cache policy.
GQADRV_DEVICE void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3,
                               u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;" ::"r"(dst),
      "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
      : "memory");
}
// 5-D tiled TMA load into shared memory, completing on an mbarrier.
GQADRV_DEVICE void tma_load_5d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(dst),
      "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// 5-D tiled TMA load into shared memory, completing on an mbarrier, with an L2 cache policy.
GQADRV_DEVICE void tma_load_5d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3, int c4,
                               u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;" ::"r"(dst),
      "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "l"(policy)
      : "memory");
}
// Prefetch a 4-D tile into L2 (no shared memory, no barrier): fire and forget.
GQADRV_DEVICE void tma_prefetch_l2_4d(const TmaDesc* desc, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(desc),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// 4-D tiled TMA load without an L2 cache hint.
GQADRV_DEVICE void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
      "l"(desc), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
GQADRV_DEVICE u64 l2_policy_evict_normal() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}
GQADRV_DEVICE u64 l2_policy_evict_first() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// Not volatile: the policy is a pure value, so that the compiler creates it once for a run of stores
// (the MLA partial stores call this once per store).
GQADRV_DEVICE u64 l2_policy_evict_last() {
  u64 p;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// Stores with an L2 cache policy (e.g. evict_last for data read back later in the same launch).
GQADRV_DEVICE void st_f32_l2hint(float* p, float a, u64 pol) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(p), "f"(a), "l"(pol) : "memory");
}
GQADRV_DEVICE void st_f32x2_l2hint(float* p, float a, float b, u64 pol) {
  asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(p), "f"(a), "f"(b), "l"(pol) : "memory");
}
GQADRV_DEVICE void st_u32x4_l2hint(void* p, U32x4 v, u64 pol) {
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}
// Drop the 128-byte L2 line at p (128-byte aligned) without writing it back: for dead scratch data.
GQADRV_DEVICE void discard_l2_line(const void* p) { asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory"); }
// Programmatic dependent launch: wait for the preceding grid's memory, let the next grid start.
GQADRV_DEVICE void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
GQADRV_DEVICE void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#else
GQADRV_DEVICE void pdl_wait() {}
GQADRV_DEVICE void pdl_launch_dependents() {}
#endif

// ----------------------------------------------------------------------------- atomics
// Ticket for the last-CTA merge: acq_rel at GPU scope so the partials written before the ticket
// are visible to whichever CTA draws the last ticket.
GQADRV_DEVICE u32 atomic_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
GQADRV_DEVICE void store_relaxed_gpu(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
