// gqadrv — FP8-e4m3 KV quantizer (quantize_kv_fp8): x (fp16 / bf16 / fp32, any shape, contiguous)
// -> e4m3 codes (one byte per element) with a per-tensor or per-KV-head fp32 scale, and the
// per-tensor amax reduction that computes a scale on the GPU. Built for sm_80 and newer ("smxx":
// sm_80, sm_90a, sm_100a, sm_110a). One entry per module, chosen by KVFP8_OP: 0 = kv_fp8_amax,
// 1 = kv_fp8_quantize; both take KvFp8Args. Host side: gqadrv/gqa/kv_fp8.py (KVFP8_ARGS mirrors
// the struct below; tests/gqa/test_kv_fp8_host.py parses this file and compares names and
// offsets). Numpy model: gqadrv/gqa/fp8_reference.py.
//
// Semantics  code = e4m3(x / s): x widened to fp32 (exact), divided by the scale in fp32 (IEEE,
//            round to nearest even), then rounded to e4m3 (nearest even) with saturation: |x/s|
//            beyond 448 (Inf too) gives +-448, NaN gives 0x7F (kernels/common/fp8.cuh).
//            s: args.scale_value (KVFP8_FLAG_SCALE_PTR clear), or read from the device:
//            scale[0] (per tensor) or scale[h] (KVFP8_FLAG_PER_HEAD: h = (e / inner) % heads for
//            element e, i.e. the index along x's head axis). Device scales are never checked: a
//            zero scale makes x/0 = +-Inf (-> +-448) and 0/0 = NaN (-> 0x7F).
// Amax       kv_fp8_amax folds fl(m / 448) of each CTA's finite amax m (NaN, +-Inf ignored) into
//            *scale with atomicMax on the fp32 bits (non-negative floats order like their bits).
//            The host sets *scale to KVFP8_SCALE_FLOOR first (a memset node), so after the launch
//            *scale = max(fl(amax / 448), 2^-126): division by 448 rounds monotonically, hence
//            max_i fl(m_i / 448) = fl(max_i m_i / 448). Max is exact in any order: deterministic.
//            kv_fp8_quantize then runs with KVFP8_FLAG_SCALE_PTR on that scale (two launches plus
//            one memset, no host read: capturable).
// CTA work   KVFP8_THREADS threads; work item g = elements [16g, 16g + 16) (the last one may be
//            short); grid-stride over the items (amax: grid capped at the resident CTAs, one
//            atomic per CTA; quantize: one item per thread up to the grid limit).
// Warps      no roles. A thread loads its item (16-byte loads: 2 for fp16 / bf16, 4 for fp32),
//            converts 16 values and stores 16 codes (one 16-byte store) when the item is full and
//            x and out are 16-byte aligned (KVFP8_FLAG_VEC16, decided by the host); element loads
//            and byte stores otherwise. Per-head scales: one scale per item when inner % 16 == 0,
//            else per element (64-bit index arithmetic).
// Smem map   amax: KVFP8_THREADS / 32 floats (the warps' maxima). quantize: none.
// Barriers   amax: one __syncthreads between the warp maxima and the CTA maximum. quantize: none.
//            griddepcontrol.wait before the first load in both (programmatic dependent launch on
//            sm_90+: the quantize launch reads the amax launch's scale after it).
#include "../../common/fp8.cuh"

#ifndef KVFP8_DT
#error "KVFP8_DT must be defined by the host compiler (0 fp16, 1 bf16, 2 fp32)"
#endif
#ifndef KVFP8_OP
#error "KVFP8_OP must be defined by the host compiler (0 amax, 1 quantize)"
#endif

#define KVFP8_THREADS 256
#define KVFP8_GROUP 16
// The scale is read from the device (scale[0], or scale[head] with KVFP8_FLAG_PER_HEAD).
#define KVFP8_FLAG_SCALE_PTR 1
// One scale per index of x's head axis: scale[(e / inner) % heads].
#define KVFP8_FLAG_PER_HEAD 2
// x and out are 16-byte aligned: vector loads and stores for full items.
#define KVFP8_FLAG_VEC16 4
// The computed scale's floor, 2^-126 (the smallest normal fp32), as bits: the host's memset value.
#define KVFP8_SCALE_FLOOR 0x00800000

// Scalar arguments of both entries.
struct KvFp8Args {
  const void* x;       // [n] fp16 / bf16 / fp32 (KVFP8_DT), contiguous
  u8* out;             // [n] e4m3 codes (quantize)
  float* scale;        // quantize: the device scale(s) ([1] or [heads]); amax: the scale computed (atomicMax)
  long long n;         // elements of x
  long long inner;     // per head: elements from one head index to the next (x's dims after the head axis)
  long long groups;    // work items: ceil(n / 16)
  int heads;           // per head: x.shape[head_axis]; else 1
  int flags;           // KVFP8_FLAG_* bits
  float scale_value;   // the scale when KVFP8_FLAG_SCALE_PTR is clear
};

namespace {
constexpr int DT = KVFP8_DT;
constexpr int ESIZE = DT == 2 ? 4 : 2;
constexpr int DT16 = DT == 2 ? 0 : DT;  // unpack2 code of a 16-bit DT (unused for fp32)

GQADRV_DEVICE float load_elem(const u8* p) {
  if (DT == 2) return *reinterpret_cast<const float*>(p);
  const u32 h = *reinterpret_cast<const u16*>(p);
  float lo, hi;
  unpack2<DT16>(h, lo, hi);
  return lo;
}

// The 16 values of item g (count of them valid; the rest 0).
template <bool VEC>
GQADRV_DEVICE void load_item(const KvFp8Args& a, long long e0, int count, float (&x)[16]) {
  const u8* p = reinterpret_cast<const u8*>(a.x) + e0 * ESIZE;
  if (VEC) {
    constexpr int LOADS = KVFP8_GROUP * ESIZE / 16;
    U32x4 r[LOADS];
#pragma unroll
    for (int i = 0; i < LOADS; ++i) r[i] = ld_global_nc_v4(p + 16 * i);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      if (DT == 2) {
        x[4 * i] = __uint_as_float(r[i].x), x[4 * i + 1] = __uint_as_float(r[i].y);
        x[4 * i + 2] = __uint_as_float(r[i].z), x[4 * i + 3] = __uint_as_float(r[i].w);
      } else {
        unpack2<DT16>(r[i].x, x[8 * i], x[8 * i + 1]);
        unpack2<DT16>(r[i].y, x[8 * i + 2], x[8 * i + 3]);
        unpack2<DT16>(r[i].z, x[8 * i + 4], x[8 * i + 5]);
        unpack2<DT16>(r[i].w, x[8 * i + 6], x[8 * i + 7]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < KVFP8_GROUP; ++i) x[i] = i < count ? load_elem(p + i * ESIZE) : 0.0f;
  }
}
}  // namespace

#if KVFP8_OP == 0
// ----------------------------------------------------------------------------- amax
extern "C" __global__ void __launch_bounds__(KVFP8_THREADS) kv_fp8_amax(const KvFp8Args args) {
  __shared__ float warp_max[KVFP8_THREADS / 32];
  pdl_wait();
  pdl_launch_dependents();
  const bool vec = (args.flags & KVFP8_FLAG_VEC16) != 0;
  float m = 0.0f;
  for (long long g = (long long)blockIdx.x * KVFP8_THREADS + threadIdx.x; g < args.groups;
       g += (long long)gridDim.x * KVFP8_THREADS) {
    const long long e0 = g * KVFP8_GROUP;
    const long long left = args.n - e0;
    const int count = left < KVFP8_GROUP ? (int)left : KVFP8_GROUP;
    float x[16];
    if (vec && count == KVFP8_GROUP) {
      load_item<true>(args, e0, count, x);
    } else {
      load_item<false>(args, e0, count, x);
    }
#pragma unroll
    for (int i = 0; i < KVFP8_GROUP; ++i) m = fmaxf(m, finite_abs(x[i]));
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < KVFP8_THREADS / 32 ? warp_max[lane] : 0.0f;
#pragma unroll
    for (int o = 4; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(args.scale), __float_as_uint(__fdiv_rn(m, GQADRV_E4M3_MAX)));
  }
}
#else
// ----------------------------------------------------------------------------- quantize
namespace {
// Per-element scales of one item: scale[h] with h = (e / inner) % heads, stepped element by element
// from one 64-bit division per item (the head index changes where the offset inside a head wraps).
GQADRV_DEVICE void head_scales(const KvFp8Args& a, long long e0, int count, float (&s)[16]) {
  const unsigned long long inner = (unsigned long long)a.inner;
  const unsigned long long row = (unsigned long long)e0 / inner;
  unsigned long long off = (unsigned long long)e0 - row * inner;
  u32 h = (u32)(row % (unsigned long long)a.heads);
#pragma unroll
  for (int i = 0; i < KVFP8_GROUP; ++i) {
    s[i] = i < count ? __ldg(a.scale + h) : 1.0f;
    if (++off == inner) {
      off = 0;
      if (++h == (u32)a.heads) h = 0;
    }
  }
}

template <bool VEC>
GQADRV_DEVICE void quantize_item(const KvFp8Args& a, long long e0, int count, float s) {
  float x[16];
  load_item<VEC>(a, e0, count, x);
  const bool per_elem = (a.flags & KVFP8_FLAG_PER_HEAD) && (!VEC || (a.inner & (KVFP8_GROUP - 1)) != 0);
  if (per_elem) {
    float sc[16];
    head_scales(a, e0, count, sc);
#pragma unroll
    for (int i = 0; i < KVFP8_GROUP; ++i) x[i] = __fdiv_rn(x[i], sc[i]);
  } else {
    if (a.flags & KVFP8_FLAG_PER_HEAD) s = __ldg(a.scale + ((unsigned long long)e0 / (unsigned long long)a.inner) %
                                                 (unsigned long long)a.heads);  // one head per item
#pragma unroll
    for (int i = 0; i < KVFP8_GROUP; ++i) x[i] = __fdiv_rn(x[i], s);
  }
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = e4m3x4_from_f32(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  u8* o = a.out + e0;
  if (VEC) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(o), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  } else {
#pragma unroll
    for (int i = 0; i < KVFP8_GROUP; ++i) {
      if (i < count) o[i] = (u8)(w[i >> 2] >> (8 * (i & 3)));
    }
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(KVFP8_THREADS) kv_fp8_quantize(const KvFp8Args args) {
  pdl_wait();  // a computed scale is written by the preceding kv_fp8_amax launch
  pdl_launch_dependents();
  const bool vec = (args.flags & KVFP8_FLAG_VEC16) != 0;
  float s = args.scale_value;
  if ((args.flags & (KVFP8_FLAG_SCALE_PTR | KVFP8_FLAG_PER_HEAD)) == KVFP8_FLAG_SCALE_PTR) s = *args.scale;
  for (long long g = (long long)blockIdx.x * KVFP8_THREADS + threadIdx.x; g < args.groups;
       g += (long long)gridDim.x * KVFP8_THREADS) {
    const long long e0 = g * KVFP8_GROUP;
    const long long left = args.n - e0;
    const int count = left < KVFP8_GROUP ? (int)left : KVFP8_GROUP;
    if (vec && count == KVFP8_GROUP) {
      quantize_item<true>(args, e0, count, s);
    } else {
      quantize_item<false>(args, e0, count, s);
    }
  }
}
#endif
