// gqadrv — compile-time configuration of one GQA decode module. The host (gqadrv/gqa/routes.py)
// defines these macros; each combination is compiled into its own cubin.
//   GQA_DT      0 = fp16, 1 = bf16
//   GQA_D       head dim: 64, 128, 256
//   GQA_ROWS    8 (group <= 8) or 16 (group <= 16): MMA rows holding the query heads of a group
//   GQA_WARPS   warps per CTA (each warp streams its own sub-tiles)
//   GQA_TOK     tokens per warp sub-tile: 16, 32 or 64
//   GQA_STAGES  ring depth per warp (pipelined kernels)
#pragma once
#include "../../common/trace.cuh"

#ifndef GQA_DT
#error "GQA_DT not defined"
#endif
#ifndef GQA_D
#error "GQA_D not defined"
#endif
#ifndef GQA_ROWS
#error "GQA_ROWS not defined"
#endif
#ifndef GQA_WARPS
#error "GQA_WARPS not defined"
#endif
#ifndef GQA_TOK
#error "GQA_TOK not defined"
#endif
#ifndef GQA_STAGES
#define GQA_STAGES 1
#endif
#ifndef GQA_MAX_SPLITS
#define GQA_MAX_SPLITS 64
#endif

// GQA_TRACE=1 (development only): thread 0 of every CTA writes %globaltimer stamps into
// ((u64*)args.status)[blockIdx.x * 16 + i] at the marks GQA_MARK(args, i) (kernels/common/trace.cuh);
// the host passes a trace buffer of grid * 16 u64 in place of the status pointer
// (tools/trace_decode.py); GQA_MARK_SM(args) puts the CTA's %smid in slot 15 (the paged TMA kernel).
#ifndef GQA_TRACE
#define GQA_TRACE 0
#endif
#if GQA_TRACE
#define GQA_MARK(args, i) GQADRV_TRACE_STAMP((args).status, i)
#define GQA_MARK_SM(args) GQADRV_TRACE_SMID((args).status, 15)
#else
#define GQA_MARK(args, i) GQADRV_TRACE_NOP()
#define GQA_MARK_SM(args) GQADRV_TRACE_NOP()
#endif
