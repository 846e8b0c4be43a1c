// gqadrv — %globaltimer trace stamps for development timing (tools/trace_decode.py), shared by
// every kernel family.
//
// GQADRV_TRACE_STAMP(buf, i): thread 0 of the CTA writes the %globaltimer value (ns) into
// ((u64*)buf)[blockIdx.x * GQADRV_TRACE_SLOTS + i]; the host passes a buffer of grid * 16 u64 in
// place of a pointer argument the kernel does not need while tracing. A family maps its own
// switch onto these macros in its configuration header, e.g. kernels/gqa/common/config.cuh:
//   #if GQA_TRACE
//   #define GQA_MARK(args, i) GQADRV_TRACE_STAMP((args).status, i)
//   #else
//   #define GQA_MARK(args, i) GQADRV_TRACE_NOP()
//   #endif
// Self-contained (no other header): a configuration header may include it before ptx.cuh.
#pragma once

#define GQADRV_TRACE_SLOTS 16  // stamps per CTA

#define GQADRV_TRACE_STAMP(buf, i)                                                                 \
  do {                                                                                             \
    if (threadIdx.x == 0) {                                                                        \
      unsigned long long t_;                                                                       \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                       \
      reinterpret_cast<unsigned long long*>(buf)[blockIdx.x * GQADRV_TRACE_SLOTS + (i)] = t_;      \
    }                                                                                              \
  } while (0)

// GQADRV_TRACE_SMID(buf, i): thread 0 writes the CTA's %smid into the same slot array (slot i), so the
// host can line up the CTAs that ran one after another on one SM (tools/trace_decode.py --paged).
#define GQADRV_TRACE_SMID(buf, i)                                                                  \
  do {                                                                                             \
    if (threadIdx.x == 0) {                                                                        \
      unsigned int s_;                                                                             \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(s_));                                              \
      reinterpret_cast<unsigned long long*>(buf)[blockIdx.x * GQADRV_TRACE_SLOTS + (i)] = s_;      \
    }                                                                                              \
  } while (0)

#define GQADRV_TRACE_NOP() \
  do {                     \
  } while (0)
