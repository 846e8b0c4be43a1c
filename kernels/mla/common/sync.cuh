// gqadrv — MLA-private synchronisation helpers (sm_90): mbarrier waits with an optional watchdog,
// cp.async completion tracked by an mbarrier, small shared-memory stores. Named barriers
// (named_bar_sync / named_bar_arrive) are op-neutral: kernels/common/ptx.cuh.
//
// Watchdog: with MLA_WATCHDOG=1 every mbarrier wait that has not completed after
// MLA_WATCHDOG_NS nanoseconds (%globaltimer) executes `trap`, so a protocol bug surfaces as a
// launch error within seconds instead of a hung GPU. Only the slow path (a failed try_wait) reads
// the timer, so the cost on a completed barrier is nil. Off by default (kernel_spec.defines).
#pragma once
#include "../../common/ptx.cuh"

#ifndef MLA_WATCHDOG
#define MLA_WATCHDOG 0
#endif
#ifndef MLA_WATCHDOG_NS
#define MLA_WATCHDOG_NS 4000000000ull  // 4 s
#endif

namespace mla {

// ------------------------------------------------------------------------- mbarrier
GQADRV_DEVICE u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
GQADRV_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Wait until the phase of parity `parity` of the barrier at `bar` has completed (acquire, CTA).
// The whole loop (and the watchdog's timer test and trap) is one asm block: with the loop in C++,
// ptxas treats the wgmma issued after it as being on a divergent path and serialises wgmma chains.
GQADRV_DEVICE void mbar_wait_wd(u32 bar, u32 parity) {
#if MLA_WATCHDOG
  asm volatile(
      "{\n"
      " .reg .pred P1;\n"
      " .reg .u64 t0, t1;\n"
      " mov.u64 t0, %%globaltimer;\n"
      "LAB_WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      " @P1 bra DONE_%=;\n"
      " mov.u64 t1, %%globaltimer;\n"
      " sub.u64 t1, t1, t0;\n"
      " setp.gt.u64 P1, t1, %2;\n"
      " @P1 trap;\n"
      " bra LAB_WAIT_%=;\n"
      "DONE_%=:\n"
      "}\n" ::"r"(bar), "r"(parity), "l"((u64)MLA_WATCHDOG_NS)
      : "memory");
#else
  asm volatile(
      "{\n"
      " .reg .pred P1;\n"
      "LAB_WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      " @P1 bra DONE_%=;\n"
      " bra LAB_WAIT_%=;\n"
      "DONE_%=:\n"
      "}\n" ::"r"(bar), "r"(parity)
      : "memory");
#endif
}
// The barrier receives one arrival (counted against its initial count: .noinc) once every
// cp.async this thread issued before this instruction has completed.
GQADRV_DEVICE void cp_async_mbar_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
GQADRV_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ------------------------------------------------------------------------- shared memory
GQADRV_DEVICE void sts_zero16(u32 addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
GQADRV_DEVICE void sts_u32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
GQADRV_DEVICE void sts_u16(u32 addr, u16 v) { asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory"); }
GQADRV_DEVICE void sts_f32(u32 addr, float v) { asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory"); }
GQADRV_DEVICE void sts_f32x2(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
GQADRV_DEVICE float lds_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
GQADRV_DEVICE U32x4 lds_u32x4(u32 addr) {
  U32x4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
GQADRV_DEVICE void lds_f32x4(u32 addr, float& a, float& b, float& c, float& d) {
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "r"(addr) : "memory");
}

}  // namespace mla
