// gqadrv — compile-time configuration of one GQA decode module. The host (gqadrv/gqa/routes.py)
// defines these macros; each combination is compiled into its own cubin.
//   GQA_DT      0 = fp16, 1 = bf16
//   GQA_D       head dim: 64, 128, 256
//   GQA_ROWS    8 (group <= 8) or 16 (group <= 16): MMA rows holding the query heads of a group
//   GQA_WARPS   warps per CTA (each warp streams its own sub-tiles)
//   GQA_TOK     tokens per warp sub-tile: 16, 32 or 64
//   GQA_STAGES  ring depth per warp (pipelined kernels)
#pragma once
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
