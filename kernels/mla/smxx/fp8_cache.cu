// gqadrv — FlashMLA's V3.2 FP8 MLA cache (656 bytes per token): quantize a bf16 cache
// [num_blocks, page, 1, 576] into it, and dequantize it back to bf16. Built for sm_80 and newer
// ("smxx": sm_80, sm_90a, sm_100a, sm_110a). One entry per module, chosen by MLA_FP8_OP:
// 0 = mla_fp8_quantize, 1 = mla_fp8_dequantize; both take MlaFp8CacheArgs. Host side:
// gqadrv/mla/fp8_cache.py (MLA_FP8_ARGS mirrors the struct below; tests/mla/test_fp8_cache_host.py
// parses this file and compares names and offsets). Numpy model: gqadrv/mla/fp8_reference.py.
//
// Format     bytes [0, 512): 512 e4m3 codes of latent channels 0..511; [512, 528): 4 fp32 scales,
//            scale k for channels [128k, 128k + 128); [528, 656): the 64 bf16 RoPE channels 512..575,
//            copied bit for bit.
// Quantize   per token and 128-channel tile: amax = max |x| over the tile's finite values (NaN and
//            +-Inf ignored), s = amax / 448 (fp32, round to nearest), s = max(s, 1e-4f) rounded up
//            to a power of two (2^ceil(log2 s): the mantissa bits cleared and the exponent raised
//            when any was set; smallest 2^-13), stored as fp32; code = e4m3(x * (1 / s)) (exact
//            scaling: 1/s is a power of two) with round to nearest even and saturation at +-448;
//            NaN -> 0x7F, +-Inf -> +-448 (0x7E / 0xFE). Conversion: kernels/common/fp8.cuh.
// Dequantize bf16(float(code) * s): fp32 product (exact for power-of-two scales), rounded to bf16
//            (nearest even); NaN codes (and NaN / Inf products of foreign scales) give NaN, stored
//            as the canonical bf16 0x7FFF. The RoPE bytes are copied back unchanged.
// CTA work   MLA_FP8_WARPS warps, one token each (token t = b * page + p over num_blocks x page);
//            grid = ceil(tokens / MLA_FP8_WARPS).
// Warps      no roles. Quantize: lane l loads latent channels 8l..8l+7 and 256+8l..256+8l+7
//            (two 16-byte loads), so the lanes of one half-warp hold one tile in each pass (tile
//            2j + l/16 in pass j); the tile amax is a 4-step xor shuffle inside the half-warp;
//            each lane stores its 8 codes per pass (8-byte stores), lane 0 stores the 4 scales
//            (one 16-byte store), lanes 0..7 copy 16 RoPE bytes each. Dequantize: lane l loads
//            codes 16l..16l+15 (one 16-byte load) and its tile's scale (tile l/8), stores 16 bf16
//            (two 16-byte stores); lanes 0..7 copy 16 RoPE bytes each.
// Addresses  token (b, p): src + b * src_page_stride + p * src_row_stride, dst likewise (byte
//            strides, any page stride: the pages may be views into a bigger pool).
// Loads      16-byte vector loads (ld.global.nc) and stores when both row sets are 16-byte
//            aligned (MLA_FP8_FLAG_VEC16, decided by the host from the bases and strides); byte
//            loads and stores otherwise (same values).
// Smem map   none.
// Barriers   none (warp shuffles only); griddepcontrol.wait before the first load (programmatic
//            dependent launch on sm_90+).
#include "../../common/fp8.cuh"

#ifndef MLA_FP8_OP
#error "MLA_FP8_OP must be defined by the host compiler (0 quantize, 1 dequantize)"
#endif

#define MLA_FP8_WARPS 4
#define MLA_FP8_THREADS (MLA_FP8_WARPS * 32)
#define MLA_FP8_BYTES_PER_TOKEN 656
#define MLA_FP8_SCALES_OFFSET 512
#define MLA_FP8_ROPE_OFFSET 528
#define MLA_FP8_TILE 128
// Bases and strides of both sides are multiples of 16 bytes: vector loads and stores.
#define MLA_FP8_FLAG_VEC16 1

// Scalar arguments of both entries (strides in bytes).
struct MlaFp8CacheArgs {
  const void* src;            // quantize: bf16 [num_blocks, page, 1, 576]; dequantize: u8 [num_blocks, page, 1, 656]
  void* dst;                  // quantize: u8 [num_blocks, page, 1, 656]; dequantize: bf16 [num_blocks, page, 1, 576]
  long long src_page_stride;  // bytes from page b to b + 1 of src
  long long src_row_stride;   // bytes from token p to p + 1 of src
  long long dst_page_stride;  // bytes from page b to b + 1 of dst
  long long dst_row_stride;   // bytes from token p to p + 1 of dst
  int num_blocks;             // pages
  int page_size;              // tokens per page
  int tokens;                 // num_blocks * page_size
  int flags;                  // MLA_FP8_FLAG_* bits
};

namespace {

template <bool VEC>
GQADRV_DEVICE U32x4 load16(const u8* p) {
  if (VEC) return ld_global_nc_v4(p);
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = (u32)p[4 * i] | ((u32)p[4 * i + 1] << 8) | ((u32)p[4 * i + 2] << 16) | ((u32)p[4 * i + 3] << 24);
  }
  return U32x4{w[0], w[1], w[2], w[3]};
}

GQADRV_DEVICE void store_words(u8* p, const u32* w, int nwords) {
#pragma unroll 4
  for (int i = 0; i < nwords; ++i) {
    p[4 * i] = (u8)w[i], p[4 * i + 1] = (u8)(w[i] >> 8), p[4 * i + 2] = (u8)(w[i] >> 16);
    p[4 * i + 3] = (u8)(w[i] >> 24);
  }
}

template <bool VEC>
GQADRV_DEVICE void store16(u8* p, const U32x4& v) {
  if (VEC) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  } else {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    store_words(p, w, 4);
  }
}

template <bool VEC>
GQADRV_DEVICE void store8(u8* p, u32 lo, u32 hi) {
  if (VEC) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(lo), "r"(hi) : "memory");
  } else {
    const u32 w[2] = {lo, hi};
    store_words(p, w, 2);
  }
}

// max over the 16 lanes of this half-warp (lanes 0..15 or 16..31)
GQADRV_DEVICE float half_warp_max(float m) {
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The tile scale from the tile's finite amax: max(amax / 448, 1e-4) rounded up to a power of two.
GQADRV_DEVICE float tile_scale(float amax) {
  const u32 b = __float_as_uint(fmaxf(__fdiv_rn(amax, GQADRV_E4M3_MAX), 1e-4f));
  return __uint_as_float((b + 0x7fffffu) & 0xff800000u);
}

// 1 / s for a power of two s in [2^-13, 2^120]: exact.
GQADRV_DEVICE float pow2_reciprocal(float s) { return __uint_as_float((254u << 23) - __float_as_uint(s)); }

template <bool VEC>
GQADRV_DEVICE void quantize_token(const MlaFp8CacheArgs& a, int token, int lane) {
  const int b = token / a.page_size, p = token - b * a.page_size;
  const u8* src = reinterpret_cast<const u8*>(a.src) + (long long)b * a.src_page_stride + (long long)p * a.src_row_stride;
  u8* dst = reinterpret_cast<u8*>(a.dst) + (long long)b * a.dst_page_stride + (long long)p * a.dst_row_stride;

  U32x4 raw[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) raw[j] = load16<VEC>(src + (256 * j + 8 * lane) * 2);
  U32x4 rope = U32x4{0u, 0u, 0u, 0u};
  if (lane < 8) rope = load16<VEC>(src + 1024 + 16 * lane);

  float s[2];
  u32 codes[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float x[8];
    unpack2<1>(raw[j].x, x[0], x[1]);
    unpack2<1>(raw[j].y, x[2], x[3]);
    unpack2<1>(raw[j].z, x[4], x[5]);
    unpack2<1>(raw[j].w, x[6], x[7]);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, finite_abs(x[i]));
    s[j] = tile_scale(half_warp_max(m));
    const float inv = pow2_reciprocal(s[j]);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(x[i], inv);
    codes[j][0] = e4m3x4_from_f32(x[0], x[1], x[2], x[3]);
    codes[j][1] = e4m3x4_from_f32(x[4], x[5], x[6], x[7]);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) store8<VEC>(dst + 256 * j + 8 * lane, codes[j][0], codes[j][1]);
  // tiles 1 and 3 live in the upper half-warp
  const float s1 = __shfl_sync(0xffffffffu, s[0], 16);
  const float s3 = __shfl_sync(0xffffffffu, s[1], 16);
  if (lane == 0) {
    store16<VEC>(dst + MLA_FP8_SCALES_OFFSET,
                 U32x4{__float_as_uint(s[0]), __float_as_uint(s1), __float_as_uint(s[1]), __float_as_uint(s3)});
  }
  if (lane < 8) store16<VEC>(dst + MLA_FP8_ROPE_OFFSET + 16 * lane, rope);
}

template <bool VEC>
GQADRV_DEVICE void dequantize_token(const MlaFp8CacheArgs& a, int token, int lane) {
  const int b = token / a.page_size, p = token - b * a.page_size;
  const u8* src = reinterpret_cast<const u8*>(a.src) + (long long)b * a.src_page_stride + (long long)p * a.src_row_stride;
  u8* dst = reinterpret_cast<u8*>(a.dst) + (long long)b * a.dst_page_stride + (long long)p * a.dst_row_stride;

  const U32x4 c = load16<VEC>(src + 16 * lane);
  const u8* sp = src + MLA_FP8_SCALES_OFFSET + 4 * (lane >> 3);
  float s;
  if (VEC) {
    s = __ldg(reinterpret_cast<const float*>(sp));
  } else {
    s = __uint_as_float((u32)sp[0] | ((u32)sp[1] << 8) | ((u32)sp[2] << 16) | ((u32)sp[3] << 24));
  }
  U32x4 rope = U32x4{0u, 0u, 0u, 0u};
  if (lane < 8) rope = load16<VEC>(src + MLA_FP8_ROPE_OFFSET + 16 * lane);

  u32 o[8];
  e4m3x16_dequant_bf16(c, s, o);
  store16<VEC>(dst + 32 * lane, U32x4{o[0], o[1], o[2], o[3]});
  store16<VEC>(dst + 32 * lane + 16, U32x4{o[4], o[5], o[6], o[7]});
  if (lane < 8) store16<VEC>(dst + 1024 + 16 * lane, rope);
}

}  // namespace

#if MLA_FP8_OP == 0
extern "C" __global__ void __launch_bounds__(MLA_FP8_THREADS) mla_fp8_quantize(const MlaFp8CacheArgs args) {
  pdl_wait();
  pdl_launch_dependents();
  const int token = blockIdx.x * MLA_FP8_WARPS + (threadIdx.x >> 5);
  if (token >= args.tokens) return;  // a whole warp leaves together: the shuffles stay full-warp
  if (args.flags & MLA_FP8_FLAG_VEC16) {
    quantize_token<true>(args, token, threadIdx.x & 31);
  } else {
    quantize_token<false>(args, token, threadIdx.x & 31);
  }
}
#else
extern "C" __global__ void __launch_bounds__(MLA_FP8_THREADS) mla_fp8_dequantize(const MlaFp8CacheArgs args) {
  pdl_wait();
  pdl_launch_dependents();
  const int token = blockIdx.x * MLA_FP8_WARPS + (threadIdx.x >> 5);
  if (token >= args.tokens) return;
  if (args.flags & MLA_FP8_FLAG_VEC16) {
    dequantize_token<true>(args, token, threadIdx.x & 31);
  } else {
    dequantize_token<false>(args, token, threadIdx.x & 31);
  }
}
#endif
