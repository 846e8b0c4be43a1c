// gqadrv — LSE state merge (merge_state / merge_states): combine partial attention states computed
// over disjoint key sets into the state of their union. Built for sm_80 and newer ("smxx": sm_80,
// sm_90a, sm_100a, sm_110a). Entry point merge_state(MergeArgs, MergeTable); one launch for any
// number of states K. Host side: gqadrv/gqa/merge.py (MERGE_ARGS / MERGE_TABLE mirror the structs
// below; tests/gqa/test_merge_host.py parses this file and compares names and offsets).
//
// Semantics  a state is (v, s): v the normalised attention output over a subset of keys, s its
//            natural-log LSE. s = +inf or s = -inf means "no keys": weight 0, and its v is never
//            combined into the result (NaN stored there cannot leak). m = max of the finite s_k,
//            w_k = exp(s_k - m), v = sum_k w_k v_k / sum_k w_k, s = m + log(sum_k w_k); every state
//            empty: v = 0, s = +inf. NaN in s or v of a non-empty state propagates. fp32
//            accumulation in the fixed order k = 0, 1, ..., K-1: bitwise reproducible.
// CTA work   MERGE_THREADS threads, one work item each: (output row r, 16-byte chunk c of that row,
//            i.e. 8 fp16/bf16 or 4 fp32 elements). Items are numbered row-major over
//            rows x chunks (R x D*itemsize/16) and the grid is ceil(items / MERGE_THREADS) CTAs, so
//            rows of any D share CTAs without idle lanes (the grid covers (rows, D chunks) as one
//            flat axis).
// Warps      no roles. Each thread loads the LSEs and v chunks of states [0, MERGE_BATCH) of its
//            item at once (one memory round trip when K <= MERGE_BATCH), takes the max m of the
//            finite LSEs (for K > MERGE_BATCH a pass over all K LSEs first; a NaN sticks), then
//            accumulates w_k v_k and w_k in state order, loading each further batch of MERGE_BATCH
//            states together. The thread of chunk 0 writes the row's LSE. MERGE_BATCH is 2 in the
//            modules used for K <= 2 (fewer registers: more resident threads, +10 % bandwidth on
//            the H200) and 4 otherwise (K = 4: 4.0 TB/s, copy speed).
// Addresses  state k of row r = (n = r / H, h = r % H): v at base_k + n * v_outer_stride + h * D
//            (+ c * chunk), s at sbase_k + n * s_outer_stride + h. Table form (MERGE_FLAG_TABLE:
//            a list of up to MERGE_MAX_TABLE arrays): base_k = table.v[k], passed by value in the
//            parameter block (no device-side pointer array, so a launch can be captured into a CUDA
//            graph). Stride form (stacked [N, K, H, D]: any K): base_k = table.v[0] + k *
//            v_state_stride. Output rows are contiguous: out + r * D, out_lse + r.
// Loads      16-byte vector loads (ld.global.nc, no L1 allocation) and stores when every v base and
//            the output are 16-byte aligned (MERGE_FLAG_VEC16, decided by the host; D % 8 == 0 keeps
//            every row and state 16-byte aligned after that), element loads and stores otherwise.
// Smem map   none.
// Barriers   none (threads never communicate); griddepcontrol.wait before the first load
//            (programmatic dependent launch on sm_90+).
#include "../../common/ptx.cuh"

#ifndef MERGE_DT
#error "MERGE_DT must be defined by the host compiler (0 fp16, 1 bf16, 2 fp32)"
#endif

#define MERGE_MAX_TABLE 64
#define MERGE_THREADS 128
#ifndef MERGE_BATCH
#error "MERGE_BATCH must be defined by the host compiler (states per batch of loads: 2 for K <= 2, else 4)"
#endif
// State k's bases come from table.v[k] / table.s[k] (list form) instead of table.v[0] + k * stride.
#define MERGE_FLAG_TABLE 1
// Every v base and the output are 16-byte aligned: vector loads and stores.
#define MERGE_FLAG_VEC16 2

// Scalar arguments (strides in elements of the array they step through).
struct MergeArgs {
  void* out;                 // [R, D] merged v, dtype MERGE_DT
  float* out_lse;            // [R] merged natural-log LSE
  long long v_state_stride;  // v elements from state k to k + 1 (stacked: H*D; table form: 0)
  long long s_state_stride;  // s elements from state k to k + 1 (stacked: H; table form: 0)
  long long v_outer_stride;  // v elements from n to n + 1 (stacked: K*H*D; list: H*D)
  long long s_outer_stride;  // s elements from n to n + 1 (stacked: K*H; list: H)
  int rows;                  // R = N*H output rows
  int heads;                 // H
  int head_dim;              // D, a multiple of 8
  int chunks;                // 16-byte chunks per row: D * itemsize / 16
  int num_states;            // K >= 1
  int flags;                 // MERGE_FLAG_* bits
};

// State base addresses: table form uses entries [0, K); stride form only entry 0.
struct MergeTable {
  const void* v[MERGE_MAX_TABLE];   // [..., H, D] per state
  const float* s[MERGE_MAX_TABLE];  // [..., H] per state
};

namespace {
constexpr int DT = MERGE_DT;
constexpr int ESIZE = DT == 2 ? 4 : 2;  // bytes per element
constexpr int EPC = 16 / ESIZE;         // elements per 16-byte chunk
constexpr int DT16 = DT == 2 ? 0 : DT;  // the pack2 / unpack2 code of a 16-bit DT (unused for fp32)
constexpr int BATCH = MERGE_BATCH;  // states whose loads are issued together

GQADRV_DEVICE bool no_keys(float s) { return (__float_as_uint(s) & 0x7fffffffu) == 0x7f800000u; }  // +-inf
GQADRV_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }

// One chunk of v as raw bits (8 x 16-bit or 4 x fp32).
template <bool VEC>
GQADRV_DEVICE U32x4 load_chunk(const u8* p) {
  if (VEC) return ld_global_nc_v4(p);
  U32x4 r;
  if (DT == 2) {
    const u32* q = reinterpret_cast<const u32*>(p);
    r.x = q[0], r.y = q[1], r.z = q[2], r.w = q[3];
  } else {
    const u16* q = reinterpret_cast<const u16*>(p);
    r.x = (u32)q[0] | ((u32)q[1] << 16), r.y = (u32)q[2] | ((u32)q[3] << 16);
    r.z = (u32)q[4] | ((u32)q[5] << 16), r.w = (u32)q[6] | ((u32)q[7] << 16);
  }
  return r;
}

GQADRV_DEVICE void to_float(const U32x4& r, float (&x)[8]) {
  if (DT == 2) {
    x[0] = __uint_as_float(r.x), x[1] = __uint_as_float(r.y), x[2] = __uint_as_float(r.z);
    x[3] = __uint_as_float(r.w);
  } else {
    unpack2<DT16>(r.x, x[0], x[1]);
    unpack2<DT16>(r.y, x[2], x[3]);
    unpack2<DT16>(r.z, x[4], x[5]);
    unpack2<DT16>(r.w, x[6], x[7]);
  }
}

template <bool VEC>
GQADRV_DEVICE void store_chunk(u8* p, const float (&y)[8]) {
  U32x4 r;
  if (DT == 2) {
    r.x = __float_as_uint(y[0]), r.y = __float_as_uint(y[1]), r.z = __float_as_uint(y[2]);
    r.w = __float_as_uint(y[3]);
  } else {
    r.x = pack2<DT16>(y[0], y[1]), r.y = pack2<DT16>(y[2], y[3]);
    r.z = pack2<DT16>(y[4], y[5]), r.w = pack2<DT16>(y[6], y[7]);
  }
  if (VEC) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.x), "r"(r.y), "r"(r.z), "r"(r.w)
                 : "memory");
  } else if (DT == 2) {
    u32* q = reinterpret_cast<u32*>(p);
    q[0] = r.x, q[1] = r.y, q[2] = r.z, q[3] = r.w;
  } else {
    u16* q = reinterpret_cast<u16*>(p);
    q[0] = (u16)r.x, q[1] = (u16)(r.x >> 16), q[2] = (u16)r.y, q[3] = (u16)(r.y >> 16);
    q[4] = (u16)r.z, q[5] = (u16)(r.z >> 16), q[6] = (u16)r.w, q[7] = (u16)(r.w >> 16);
  }
}

// Where state k of one work item lives (byte offsets of the item inside a state precomputed).
struct StateAddr {
  const MergeTable* table;
  long long v_item, s_item;     // byte offsets of the item inside a state
  long long v_state, s_state;   // bytes from state k to k + 1 (0 in table form)
  bool tab;

  GQADRV_DEVICE const u8* v(int k) const {
    return reinterpret_cast<const u8*>(table->v[tab ? k : 0]) + v_item + (long long)k * v_state;
  }
  GQADRV_DEVICE const float* s(int k) const {
    return reinterpret_cast<const float*>(reinterpret_cast<const u8*>(table->s[tab ? k : 0]) + s_item +
                                          (long long)k * s_state);
  }
};

// max of the finite LSEs so far; a NaN LSE makes m NaN and keeps it so (s > NaN is false).
GQADRV_DEVICE float fold_max(float m, float s) { return (!no_keys(s) && (s != s || s > m)) ? s : m; }

// Combine one state into the running sums (skipped entirely when it has no keys).
GQADRV_DEVICE void accumulate(float s, const U32x4& raw, float m, float (&acc)[8], float& den) {
  if (no_keys(s)) return;
  const float w = expf(s - m);
  float x[8];
  to_float(raw, x);
  den += w;
#pragma unroll
  for (int j = 0; j < EPC; ++j) acc[j] = fmaf(w, x[j], acc[j]);
}

// One batch of states [k0, k0 + BATCH): all loads issued before any is used. States past K read
// nothing and count as empty (s = -inf).
template <bool VEC>
GQADRV_DEVICE void load_batch(const StateAddr& at, int k0, int K, float (&s)[BATCH], U32x4 (&raw)[BATCH]) {
#pragma unroll
  for (int i = 0; i < BATCH; ++i) {
    s[i] = neg_inf();
    raw[i] = U32x4{0u, 0u, 0u, 0u};
    if (k0 + i < K) {
      s[i] = *at.s(k0 + i);
      raw[i] = load_chunk<VEC>(at.v(k0 + i));
    }
  }
}

template <bool VEC>
GQADRV_DEVICE void merge_item(const MergeArgs& a, const MergeTable& table, u32 item) {
  const u32 chunks = (u32)a.chunks;
  const int row = (int)(item / chunks);
  const int c = (int)(item - (u32)row * chunks);
  const int n = row / a.heads, h = row - n * a.heads;
  const int K = a.num_states;
  StateAddr at;
  at.table = &table;
  at.tab = (a.flags & MERGE_FLAG_TABLE) != 0;
  at.v_item = ((long long)n * a.v_outer_stride + (long long)h * a.head_dim + (long long)c * EPC) * ESIZE;
  at.s_item = ((long long)n * a.s_outer_stride + h) * 4;
  at.v_state = at.tab ? 0 : a.v_state_stride * ESIZE;
  at.s_state = at.tab ? 0 : a.s_state_stride * 4;

  // The first batch is loaded before the max is known: K <= BATCH takes one memory round trip.
  float s[BATCH];
  U32x4 raw[BATCH];
  load_batch<VEC>(at, 0, K, s, raw);
  float m = neg_inf();
  if (K <= BATCH) {
#pragma unroll
    for (int i = 0; i < BATCH; ++i) m = fold_max(m, s[i]);
  } else {  // pass 1 over every LSE (they are L1 hits again in pass 2)
#pragma unroll 8
    for (int k = 0; k < K; ++k) m = fold_max(m, *at.s(k));
  }

  // Pass 2: weights and the weighted sum, in state order.
  float acc[8], den = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
  for (int i = 0; i < BATCH; ++i) accumulate(s[i], raw[i], m, acc, den);
  for (int k0 = BATCH; k0 < K; k0 += BATCH) {
    load_batch<VEC>(at, k0, K, s, raw);
#pragma unroll
    for (int i = 0; i < BATCH; ++i) accumulate(s[i], raw[i], m, acc, den);
  }

  u8* out = reinterpret_cast<u8*>(a.out) + ((long long)row * a.head_dim + (long long)c * EPC) * ESIZE;
  const bool none = m == neg_inf();  // every state is empty: v = 0, s = +inf
  float y[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = none ? 0.f : acc[e] / den;
  store_chunk<VEC>(out, y);
  if (c == 0) a.out_lse[row] = none ? pos_inf() : m + logf(den);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) merge_state(const MergeArgs args, const MergeTable table) {
  pdl_wait();               // the producers of the states have finished (PDL launch)
  pdl_launch_dependents();  // a dependent grid still waits for this one's completion in its own pdl_wait
  const u32 item = blockIdx.x * (u32)MERGE_THREADS + threadIdx.x;
  if (item >= (u32)args.rows * (u32)args.chunks) return;
  if (args.flags & MERGE_FLAG_VEC16) {
    merge_item<true>(args, table, item);
  } else {
    merge_item<false>(args, table, item);
  }
}
