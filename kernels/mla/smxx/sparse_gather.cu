// gqadrv — DeepSeek sparse MLA decode (FlashMLA's flash_mla_with_kvcache with `indices`): the two
// small kernels around the dense decode kernels. Portable code ("smxx"), built where the MLA kernels
// run: sm_90a, sm_100a, sm_110a. One entry per module, chosen by MLA_SPARSE_OP: 0 = mla_sparse_gather,
// 1 = mla_sparse_finish; both take MlaSparseArgs. Host side: gqadrv/mla/sparse.py (SPARSE_ARGS
// mirrors the struct below; tests/mla/test_sparse_plan_host.py compares names and offsets).
//
// The plan of one sparse decode (gqadrv/mla/sparse.py): gather -> dense decode -> finish.
//   Softmax attention does not depend on the order of its keys, so the keys a query token names
//   (its valid indices, then its valid extra-pool indices) are listed in order, and the dense MLA
//   decode kernels (kernels/mla/sm90/*.cu, unchanged) attend over that list as over the pages of a
//   cache with page_size 1: "request" = one (batch, query token) row, block_table row = its list,
//   cache_seqlens = the list's length, k_cache = the main pool's base with a 16-byte page stride.
//   A list entry is therefore the byte offset of the key row from the main pool's base, in 16-byte
//   units (int32: the host checks that every row of both pools lies within +-32 GiB of the base).
//
// mla_sparse_gather
//   CTA work   one row r = (request bi, query token si) = blockIdx.x (r = bi * s_q + si); 128 threads.
//              n = topk, or clamp(topk_length[bi], 0, topk); position j < n is valid when its index
//              x satisfies 0 <= x < slots of the pool (every other value, -1, INT_MIN, INT_MAX, the
//              slot count, is invalid and never used as an address). Valid positions are compacted in
//              order into list[r, 0 .. count) (the main pool's, then the extra pool's), count -> counts[r].
//              Entries at or past count are not written (the dense kernels never read them).
//              With MLA_SPARSE_PACK_Q, q[bi, si] (h_q rows of d_qk) is also copied to q_packed[r]
//              (16-byte copies) for a q whose batch and token strides cannot be merged.
//              Varlen prefill (cu_seqlens_q != null): row r belongs to the request i with
//              cu_q[i] <= r < cu_q[i+1]; its indices are valid in [0, cu_kv[i+1] - cu_kv[i]) and name
//              main-pool slot cu_kv[i] + x (bounds clamped to the pool: bad device data cannot
//              address outside it).
//   Warps      no roles. Per group of 8 chunks of 128 positions: the thread's 8 indices loaded
//              first, a ballot per warp and chunk, a prefix over the chunks' 4 warp totals in shared
//              memory, one store per valid position.
//   Smem map   static: 8 x 4 warp totals (int).
//   Barriers   two __syncthreads per group (totals written / totals read); griddepcontrol.wait
//              before the first load, launch_dependents after it (the dense kernel waits on the
//              whole grid with griddepcontrol.wait before reading the lists).
//   Address    slot x of a pool = page x / page_size, offset x % page_size (any page size):
//              base16 + page * page_stride16 + offset * row_stride16 (16-byte units, 64-bit).
//
// mla_sparse_finish
//   CTA work   without MLA_SPARSE_SINK one (row r, head h) unit per thread: lse_rows[r, h] ->
//              lse[bi, h, si] (FlashMLA's [b, h_q, s_q] layout; MLA_SPARSE_WRITE_LSE). With it, 4 warps,
//              one unit each: the same LSE copy (when MLA_SPARSE_WRITE_LSE) and out[r, h, :512]
//              *= 1 / (1 + exp(sink[h] - lse)): a sink of +inf gives 0, -inf leaves the row unchanged,
//              a row without keys (lse +inf, out 0) stays 0. The factor is applied in fp32 and rounded
//              to the output type (bf16 with MLA_SPARSE_OUT_BF16, else fp16) to nearest even.
//   Warps      lane l scales elements 16 l .. 16 l + 15 of the row (two 16-byte loads and stores).
//   Smem map   none.  Barriers  none; griddepcontrol.wait before the first load.
#include "../../common/ptx.cuh"

#ifndef MLA_SPARSE_OP
#error "MLA_SPARSE_OP must be defined by the host compiler (0 gather, 1 finish)"
#endif

#define MLA_SPARSE_THREADS 128
#define MLA_SPARSE_WARPS 4

// args.flags bits
#define MLA_SPARSE_PACK_Q 1      // gather: copy q rows into q_packed
#define MLA_SPARSE_WRITE_LSE 2   // finish: lse_rows [rows, h_q] -> lse [b, h_q, s_q]
#define MLA_SPARSE_SINK 4        // finish: scale out rows by the attention-sink factor
#define MLA_SPARSE_OUT_BF16 8    // finish: out is bf16 (else fp16)

struct MlaSparseArgs {
  const i32* indices;            // [b, s_q, topk]        strides idx_stride_{b,s}, last dim contiguous
  const i32* topk_length;        // [b] or null
  const i32* extra_indices;      // [b, s_q, extra_topk]  or null (no extra pool)
  const i32* extra_topk_length;  // [b] or null
  const u16* q;                  // [b, s_q, h_q, 576]    strides q_stride_{b,s,h} (PACK_Q only)
  u16* q_packed;                 // [rows, h_q, 576]      contiguous (PACK_Q only)
  i32* lists;                    // [rows, cap]           16-byte offsets of the rows to attend
  i32* counts;                   // [rows]                valid entries of each list
  const float* lse_rows;         // [rows, h_q]           natural-log LSE the dense kernel wrote
  float* lse;                    // [b, h_q, s_q]         FlashMLA's layout (WRITE_LSE)
  u16* out;                      // rows r: out + r * o_stride_r + h * o_stride_h (SINK)
  const float* attn_sink;        // [h_q] (SINK)
  const i32* cu_seqlens_q;       // [n_req + 1] or null: varlen prefill, rows [cu_q[i], cu_q[i+1]) are request i
  const i32* cu_seqlens_kv;      // [n_req + 1]: request i's indices address main-pool slots
                                 //   [cu_kv[i], cu_kv[i+1]) as 0 .. length - 1
  long long idx_stride_b;        // elements between requests of indices
  long long idx_stride_s;        // elements between query tokens of indices
  long long eidx_stride_b;       // elements between requests of extra_indices
  long long eidx_stride_s;       // elements between query tokens of extra_indices
  long long q_stride_b;          // elements between requests of q
  long long q_stride_s;          // elements between query tokens of q
  long long q_stride_h;          // elements between heads of q
  long long o_stride_r;          // elements between rows (request, token) of out
  long long o_stride_h;          // elements between heads of out
  long long slots;               // main pool: num_blocks * page_size
  long long page_stride16;       // main pool: 16-byte units between pages
  long long row_stride16;        // main pool: 16-byte units between tokens of a page
  long long extra_slots;         // extra pool: num_blocks * page_size (0 without)
  long long extra_page_stride16;
  long long extra_row_stride16;
  long long extra_base16;        // extra pool's base - main pool's base, 16-byte units
  int page_size;                 // main pool tokens per page (any positive value)
  int extra_page_size;           // extra pool tokens per page (1 without)
  int topk;                      // indices per query token
  int extra_topk;                // extra indices per query token (0 without)
  int cap;                       // list row length = topk + extra_topk
  int b;                         // requests
  int s_q;                       // query tokens per request
  int h_q;                       // query heads
  int rows;                      // b * s_q
  int flags;                     // MLA_SPARSE_* bits
  int n_req;                     // varlen requests (cu_seqlens_q != null)
  int d_qk;                      // channels of a q row (576, or 512 without RoPE)
};

namespace {

// Append the valid positions [0, n) of one index row to list[len ..); returns the new length. An
// index x is valid when 0 <= x < slots; it names pool slot first + x (first + x < 2^32: first and x
// are int32 values). Every thread of the CTA calls it (the barriers are CTA-wide). Positions go in
// groups of GATHER_GROUP chunks of 128: a thread loads its GATHER_GROUP indices of a group before it
// votes on any, so a row of topk 2048 costs two dependent global loads instead of sixteen; the list
// order is the positions' order (chunk by chunk, warp by warp, lane by lane).
#ifndef MLA_SPARSE_GATHER_GROUP
#define MLA_SPARSE_GATHER_GROUP 8  // 1: one chunk per round (development comparisons, GQADRV_SPARSE_GATHER_GROUP)
#endif
constexpr int GATHER_GROUP = MLA_SPARSE_GATHER_GROUP;
GQADRV_DEVICE int append_valid(const i32* idx, int n, long long first, long long slots, int page, long long page16,
                               long long row16, long long base16, i32* list, int len,
                               int (*warp_totals)[MLA_SPARSE_WARPS]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll 1
  for (int j0 = 0; j0 < n; j0 += GATHER_GROUP * MLA_SPARSE_THREADS) {
    int x[GATHER_GROUP];
#pragma unroll
    for (int u = 0; u < GATHER_GROUP; ++u) {
      const int j = j0 + u * MLA_SPARSE_THREADS + tid;
      x[u] = j < n ? idx[j] : -1;
    }
    unsigned vote[GATHER_GROUP];
#pragma unroll
    for (int u = 0; u < GATHER_GROUP; ++u) {
      vote[u] = __ballot_sync(0xffffffffu, x[u] >= 0 && (long long)x[u] < slots);
      if (lane == 0) warp_totals[u][warp] = __popc(vote[u]);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < GATHER_GROUP; ++u) {
      int before = len;
#pragma unroll
      for (int w = 0; w < MLA_SPARSE_WARPS; ++w) {
        const int c = warp_totals[u][w];
        before += w < warp ? c : 0;
        len += c;
      }
      if ((vote[u] >> lane) & 1u) {
        const u32 slot = (u32)(first + x[u]), pg = slot / (u32)page, off = slot - pg * (u32)page;
        list[before + __popc(vote[u] & below)] = (i32)(base16 + (long long)pg * page16 + (long long)off * row16);
      }
    }
    __syncthreads();  // the totals are read before the next group overwrites them
  }
  return len;
}

// Varlen rows: the request of query row r (binary search over cu_q, which the host does not read;
// any contents terminate and give a request in [0, n_req)), and its KV slot range [first, first +
// count) clamped to [0, slots].
GQADRV_DEVICE void request_range(const MlaSparseArgs& a, int r, long long& first, long long& count) {
  int lo = 0, hi = a.n_req - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.cu_seqlens_q[mid] <= r) lo = mid; else hi = mid - 1;
  }
  long long s0 = a.cu_seqlens_kv[lo], s1 = a.cu_seqlens_kv[lo + 1];
  s0 = s0 < 0 ? 0 : (s0 > a.slots ? a.slots : s0);
  s1 = s1 < s0 ? s0 : (s1 > a.slots ? a.slots : s1);
  first = s0;
  count = s1 - s0;
}

GQADRV_DEVICE int clamp_len(const i32* lengths, int bi, int n) {
  if (lengths == nullptr) return n;
  const int v = lengths[bi];
  return v < 0 ? 0 : (v > n ? n : v);
}

GQADRV_DEVICE void copy16(void* dst, const void* src) {
  *reinterpret_cast<U32x4*>(dst) = *reinterpret_cast<const U32x4*>(src);
}

// 8 packed 16-bit values (4 words) times f, rounded to nearest even, in place.
GQADRV_DEVICE u32 scale_pair(u32 w, float f, bool bf16) {
  float lo, hi;
  if (bf16) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi * f), "f"(lo * f));
    return r;
  }
  unsigned short a = (unsigned short)(w & 0xffffu), c = (unsigned short)(w >> 16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(c));
  unsigned short ra, rc;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(ra) : "f"(lo * f));
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(rc) : "f"(hi * f));
  return (u32)ra | ((u32)rc << 16);
}

}  // namespace

#if MLA_SPARSE_OP == 0
extern "C" __global__ void __launch_bounds__(MLA_SPARSE_THREADS) mla_sparse_gather(const MlaSparseArgs a) {
  __shared__ int warp_totals[GATHER_GROUP][MLA_SPARSE_WARPS];
  pdl_wait();
  pdl_launch_dependents();
  const int r = blockIdx.x;
  const int bi = r / a.s_q, si = r - bi * a.s_q;
  i32* list = a.lists + (long long)r * a.cap;
  const i32* idx = a.indices + (long long)bi * a.idx_stride_b + (long long)si * a.idx_stride_s;
  long long first = 0, count = a.slots;
  if (a.cu_seqlens_q != nullptr) request_range(a, r, first, count);
  int len = append_valid(idx, clamp_len(a.topk_length, bi, a.topk), first, count, a.page_size, a.page_stride16,
                         a.row_stride16, 0, list, 0, warp_totals);
  if (a.extra_indices != nullptr) {
    const i32* eidx = a.extra_indices + (long long)bi * a.eidx_stride_b + (long long)si * a.eidx_stride_s;
    len = append_valid(eidx, clamp_len(a.extra_topk_length, bi, a.extra_topk), 0, a.extra_slots, a.extra_page_size,
                       a.extra_page_stride16, a.extra_row_stride16, a.extra_base16, list, len, warp_totals);
  }
  if (threadIdx.x == 0) a.counts[r] = len;
  if (a.flags & MLA_SPARSE_PACK_Q) {
    const u16* src = a.q + (long long)bi * a.q_stride_b + (long long)si * a.q_stride_s;
    u16* dst = a.q_packed + (long long)r * a.h_q * a.d_qk;
    const int per_row = a.d_qk / 8, chunks = a.h_q * per_row;
#pragma unroll 1
    for (int c = threadIdx.x; c < chunks; c += MLA_SPARSE_THREADS) {
      const int h = c / per_row, j = c - h * per_row;
      copy16(dst + h * a.d_qk + 8 * j, src + (long long)h * a.q_stride_h + 8 * j);
    }
  }
}
#else
extern "C" __global__ void __launch_bounds__(MLA_SPARSE_THREADS) mla_sparse_finish(const MlaSparseArgs a) {
  pdl_wait();
  pdl_launch_dependents();
  if (!(a.flags & MLA_SPARSE_SINK)) {  // the LSE transpose alone: one unit per thread (finish_geometry)
    const long long unit = (long long)blockIdx.x * MLA_SPARSE_THREADS + threadIdx.x;
    if (unit >= (long long)a.rows * a.h_q || !(a.flags & MLA_SPARSE_WRITE_LSE)) return;
    const int r = (int)(unit / a.h_q), h = (int)(unit - (long long)r * a.h_q);
    const int bi = r / a.s_q, si = r - bi * a.s_q;
    a.lse[((long long)bi * a.h_q + h) * a.s_q + si] = a.lse_rows[unit];
    return;
  }
  const long long unit = (long long)blockIdx.x * MLA_SPARSE_WARPS + (threadIdx.x >> 5);
  if (unit >= (long long)a.rows * a.h_q) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const int r = (int)(unit / a.h_q), h = (int)(unit - (long long)r * a.h_q);
  const int bi = r / a.s_q, si = r - bi * a.s_q;
  const float l = a.lse_rows[unit];
  if ((a.flags & MLA_SPARSE_WRITE_LSE) && lane == 0) a.lse[((long long)bi * a.h_q + h) * a.s_q + si] = l;
  if (!(a.flags & MLA_SPARSE_SINK)) return;
  const float sink = a.attn_sink[h];
  if (l == __int_as_float(0x7f800000) || sink == neg_inf()) return;  // no keys (out 0), or no sink
  const float f = sink == __int_as_float(0x7f800000) ? 0.f : 1.f / (1.f + expf(sink - l));
  u16* row = a.out + (long long)r * a.o_stride_r + (long long)h * a.o_stride_h + 16 * lane;
  const bool bf16 = (a.flags & MLA_SPARSE_OUT_BF16) != 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    U32x4 v = *reinterpret_cast<const U32x4*>(row + 8 * k);
    v.x = scale_pair(v.x, f, bf16);
    v.y = scale_pair(v.y, f, bf16);
    v.z = scale_pair(v.z, f, bf16);
    v.w = scale_pair(v.w, f, bf16);
    *reinterpret_cast<U32x4*>(row + 8 * k) = v;
  }
}
#endif
