// gqadrv — MLA dense decode: the kernel argument block and compile-time configuration.
//
// One by-value struct, passed as `const __grid_constant__ MlaDecodeArgs`. The Python mirror is
// gqadrv/mla/kernel_spec.py (FIELDS / FORMAT): same order, same sizes, explicit padding. Keep the
// two in step; kernel_spec.py's self-check compares the field list with this file.
//
// Shapes use: b = batch, s_q = query tokens per request, h_q = query heads, h_kv = KV heads,
// group = h_q / h_kv, M = s_q * group packed query rows per (request, KV head), nmb = ceil(M / 64)
// row blocks, S = num_splits. All strides are in ELEMENTS (not bytes); every row that is read
// with 16-byte copies (q rows, k_cache rows) must start on a 16-byte boundary.
#pragma once

#ifndef MLA_DT
#error "MLA_DT not defined (0 = fp16, 1 = bf16)"
#endif
#ifndef MLA_MMA
#define MLA_MMA 1  // 1 = wgmma (sm_90a only), 0 = mma.sync m16n8k16 + ldmatrix (sm_80+)
#endif
#ifndef MLA_NOPE
#define MLA_NOPE 0  // 1 = d_qk 512 (no RoPE channels: q and K rows of 512; channel block 8 zero-filled)
#endif
#ifndef MLA_K_EVICT_FIRST
#define MLA_K_EVICT_FIRST 0  // 1 = the TMA K loads carry an L2 evict-first policy (mla_tma_k_5d)
#endif
#ifndef MLA_SMEM_BYTES
#error "MLA_SMEM_BYTES not defined (dynamic shared memory the host launches with)"
#endif

#define MLA_D_QK 576
#define MLA_D_V 512
#define MLA_BLOCK_M 64      // packed query rows per CTA
#define MLA_BLOCK_N 64      // tokens per K tile
#define MLA_THREADS 256     // two consumer warpgroups
#define MLA_MAX_SPLITS 512  // merge weights [64][S] fp32 live in the 144 KB K ring

// args.flags bits
#define MLA_FLAG_CAUSAL 1       // bottom-right causal mask (only meaningful for s_q > 1)
#define MLA_FLAG_MAX_LOGITS 2   // also write each row's max logit (natural units) at lse + max_offset
#define MLA_FLAG_NO_CUT 4       // balanced grid: never share a request between CTAs (work_items.cuh)
#define MLA_FLAG_SINK 16        // out = O / (L + 2^(sink[head] log2 e - m)): the attention sink in the epilogue
                                //   (nsplit 1 items of the store_out_rows kernels only; the host decides)
#define MLA_FLAG_KV_REUSE 8     // cp.async seesaw: K rows with an L2 evict_last policy, Q with evict_first
                                //   (the sparse prefill: every kv row is read by many query tokens)

struct MlaDecodeArgs {
  const u16* q;              // [b, s_q, h_q, 576]   strides q_stride_{b,s,h}, last dim contiguous
  const u16* k_cache;        // [num_blocks, page_size, h_kv, 576]  strides k_stride_{block,tok,head}
  const i32* block_table;    // [b, max_blocks]      row stride bt_stride; entries >= ceil(len/page) never read
  const i32* cache_seqlens;  // [b]                  read on the device only; clamped to [0, max_blocks*page_size]
  u16* out;                  // [b, s_q, h_q, 512]   strides o_stride_{b,s,h}, last dim contiguous
  float* lse;                // [b, h_q, s_q]        contiguous, natural log, +inf for rows without keys;
                             //                      with MLA_FLAG_MAX_LOGITS max(softmax_scale q.k) at
                             //                      lse + max_offset (-inf for rows without keys)
  float* ws_o;               // [b, h_kv, nmb, S, 64, 512] fp32 unnormalised partial O (S > 1, else unused)
  float* ws_ml;              // [b, h_kv, nmb, S, 64, 2]   {running max (log2 domain), row sum} per partial row
  u32* counters;             // [b, h_kv, nmb]       arrival tickets; zero between launches (the last CTA resets)
  long long q_stride_b;      // elements between requests of q
  long long q_stride_s;      // elements between query tokens of q
  long long q_stride_h;      // elements between heads of q
  long long k_stride_block;  // elements between pages of k_cache
  long long k_stride_tok;    // elements between tokens of a page
  long long k_stride_head;   // elements between KV heads of a token
  long long o_stride_b;      // elements between requests of out
  long long o_stride_s;      // elements between query tokens of out
  long long o_stride_h;      // elements between heads of out
  long long bt_stride;       // elements between rows of block_table
  int b;                     // batch
  int s_q;                   // query tokens per request
  int h_q;                   // query heads
  int h_kv;                  // KV heads (h_q % h_kv == 0)
  int group;                 // h_q / h_kv
  int m_rows;                // M = s_q * group (row r: token r / group, head kvh * group + r % group)
  int num_m_blocks;          // nmb = ceil(M / 64)
  int page_size;             // tokens per page, power of two in [1, 256]
  int page_shift;            // log2(page_size)
  int max_blocks;            // block_table columns
  int num_splits;            // S in [1, MLA_MAX_SPLITS]; grid.x = nmb * S
  int flags;                 // MLA_FLAG_* bits
  float scale_log2;          // softmax_scale * log2(e)
  int max_offset;            // MLA_FLAG_MAX_LOGITS: elements from a row's lse to its max_logits (else 0)
  const float* sink;         // [h_q] fp32 attention sink (natural units) with MLA_FLAG_SINK, else null
};
