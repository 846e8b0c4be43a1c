// gqadrv — thread-block-cluster primitives (sm_90+): CTA rank, shared::cluster addresses of a peer
// CTA's shared memory, remote stores and mbarrier arrivals, the cluster-wide barrier, and an mbarrier
// wait with cluster-scope acquire (for data a peer CTA wrote before a release.cluster arrival).
#pragma once
#include "ptx.cuh"

#if GQADRV_ARCH >= 90
GQADRV_DEVICE u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The shared::cluster address of `addr` (a shared::cta address of this CTA) in CTA `rank` of the cluster.
GQADRV_DEVICE u32 cluster_map(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
GQADRV_DEVICE void st_cluster_u32x4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
// Arrive on an mbarrier of any CTA of the cluster (shared::cluster address), releasing this thread's
// prior writes (its shared::cluster stores included) at cluster scope.
GQADRV_DEVICE void mbar_arrive_cluster(u32 cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}
// Wait for the phase of parity `parity` of a local mbarrier, acquiring at cluster scope.
GQADRV_DEVICE void mbar_wait_cluster(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      " .reg .pred P1;\n"
      "LAB_WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
      " @!P1 bra LAB_WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// All threads of every CTA of the cluster (aligned: every thread executes both).
GQADRV_DEVICE void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif
