// gqadrv — MLA dense decode: pieces shared by the seesaw and narrow kernels (the original
// dense_decode.cu keeps its own copies so that its SASS stays as measured).
//
// Row geometry: packed row rg of (request b, KV head kvh) is query token s = rg / group, head
// kvh * group + rg % group; rows rg >= M = s_q * group are padding (zero Q, never stored).
// Key limits: row rg may see keys [0, len) (or [0, len - (s_q - 1 - s)) with the bottom-right causal
// mask); a CTA additionally stops at its split's token end, so every limit is min(row limit, tok_end).
#pragma once
#include "../../common/ptx.cuh"
#include "args.cuh"
#include "sync.cuh"

#ifndef MLA_CPASYNC_FENCE
#define MLA_CPASYNC_FENCE 1
#endif

namespace mla {

// After an mbarrier wait that observed cp.async data (generic-proxy writes by other threads), before
// wgmma reads it (async proxy): fence.proxy.async.shared::cta (MEMBAR.CTA + FENCE.VIEW.ASYNC in SASS;
// cheap here because the waiting consumer threads have no copies of their own in flight).
// MLA_CPASYNC_FENCE=0 drops it (FlashMLA's cp.async kernels do without); kept on by default.
GQADRV_DEVICE void cpasync_to_wgmma_fence() {
#if MLA_CPASYNC_FENCE
  fence_proxy_async_smem();
#endif
}

constexpr float MASKED = -1e33f;  // masked logit (log2 domain, already scaled)
constexpr float M_INIT = -1e30f;  // running max before any key; exp2(MASKED - M_INIT) == 0
constexpr float LN2 = 0.69314718055994530942f;
constexpr int D_QK = MLA_D_QK;
constexpr int D_V = MLA_D_V;
constexpr int NCB = D_QK / 64;              // 9 channel blocks of 64 channels (128 bytes)

// Byte offset of 16-byte unit `unit` (0..7) of row `row` in a 128B-swizzled block of 128-byte rows.
GQADRV_DEVICE u32 swz(int row, int unit) { return (u32)(row * 128 + ((unit ^ (row & 7)) << 4)); }

// floor(n * s / S) without 64-bit division (r * s < S * S <= MLA_MAX_SPLITS^2 fits 32 bits).
GQADRV_DEVICE int split_point(int n, int s, int S) {
  const int q = n / S, r = n - q * S;
  return q * s + (r * s) / S;
}
GQADRV_DEVICE float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
GQADRV_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }
GQADRV_DEVICE u32 dynamic_smem_size() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// Cache length of request b, clamped to [0, max_blocks * page_size]; read on the device only.
GQADRV_DEVICE int clamped_len(const MlaDecodeArgs& a, int b) {
  int len = a.cache_seqlens[b];
  const long long cap = (long long)a.max_blocks * a.page_size;
  return len < 0 ? 0 : ((long long)len > cap ? (int)cap : len);
}
// Keys visible to packed row rg (padding rows: len).
GQADRV_DEVICE int row_key_limit(const MlaDecodeArgs& a, int len, int rg) {
  if (rg >= a.m_rows || (a.flags & MLA_FLAG_CAUSAL) == 0) return len;
  const int lim = len - (a.s_q - 1 - rg / a.group);
  return lim < 0 ? 0 : lim;
}
// Pointer to row rg of q (valid rows only).
GQADRV_DEVICE const u16* q_row_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.q + (long long)b * a.q_stride_b + (long long)s * a.q_stride_s + (long long)(kvh * a.group + h) * a.q_stride_h;
}
GQADRV_DEVICE u16* out_row_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.out + (long long)b * a.o_stride_b + (long long)s * a.o_stride_s + (long long)(kvh * a.group + h) * a.o_stride_h;
}
GQADRV_DEVICE float* lse_ptr(const MlaDecodeArgs& a, int b, int kvh, int rg) {
  const int s = rg / a.group, h = rg - s * a.group;
  return a.lse + ((long long)b * a.h_q + kvh * a.group + h) * a.s_q + s;
}
// First element of token `tok` (< len, so its block-table entry is in range) of KV head kvh,
// channel 0; bt_row = block_table row of the request.
GQADRV_DEVICE const u16* k_row_ptr(const MlaDecodeArgs& a, const i32* bt_row, int kvh, int tok) {
  const long long blk = bt_row[tok >> a.page_shift];
  return a.k_cache + blk * a.k_stride_block + (long long)(tok & (a.page_size - 1)) * a.k_stride_tok +
         (long long)kvh * a.k_stride_head;
}

// ------------------------------------------------------------------------- split-KV merge
// The last of the S CTAs of one (request, KV head, row block) merges the S partials of its `rows`
// valid rows: ws_o / ws_ml row index (unit * S + split) * BM + r (unit = (b * h_kv + kvh) * nmb + mb).
// Partial maxima are finite (>= M_INIT) and empty partials carry l = 0, O = 0. `wts` is a
// [BM][S] fp32 scratch in shared memory (generic pointer), `sync()` a barrier over the NT threads.
template <int BM, int NT, int DT, class Sync>
GQADRV_DEVICE void merge_partials(const MlaDecodeArgs& a, float* wts, long long unit, int S, int b, int kvh,
                                  int row0, int rows, int tid, Sync sync) {
  const long long part0 = unit * S * BM;  // partial row index of (split 0, row 0)
  if (tid < rows) {
    const float* ml = a.ws_ml + 2 * (part0 + tid);
    float mmax = M_INIT;
    for (int sp = 0; sp < S; ++sp) {
      float m, l;
      ld_cg_f32x2(ml + 2LL * BM * sp, m, l);
      mmax = fmaxf(mmax, m);
    }
    float L = 0.f;
    for (int sp = 0; sp < S; ++sp) {
      float m, l;
      ld_cg_f32x2(ml + 2LL * BM * sp, m, l);
      const float w = fast_exp2(m - mmax);
      L += w * l;
      wts[tid * S + sp] = w;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int sp = 0; sp < S; ++sp) wts[tid * S + sp] *= inv;
    *lse_ptr(a, b, kvh, row0 + tid) = L > 0.f ? (fast_log2(L) + mmax) * LN2 : pos_inf();
  }
  sync();
  for (int item = tid; item < rows * (D_V / 8); item += NT) {
    const int r = item >> 6, c = (item & 63) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float* src = a.ws_o + (part0 + r) * D_V + c;
    const float* wr = wts + r * S;
#pragma unroll 4
    for (int sp = 0; sp < S; ++sp) {
      const float w = wr[sp];
      float v[8];
      const float* p = src + (long long)sp * BM * D_V;
      ld_cg_f32x4(p, v[0], v[1], v[2], v[3]);
      ld_cg_f32x4(p + 4, v[4], v[5], v[6], v[7]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += w * v[i];
    }
    U32x4 pk;
    pk.x = pack2<DT>(acc[0], acc[1]);
    pk.y = pack2<DT>(acc[2], acc[3]);
    pk.z = pack2<DT>(acc[4], acc[5]);
    pk.w = pack2<DT>(acc[6], acc[7]);
    *reinterpret_cast<U32x4*>(out_row_ptr(a, b, kvh, row0 + r) + c) = pk;
  }
}

}  // namespace mla
