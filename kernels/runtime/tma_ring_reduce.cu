// gqadrv — runtime proof kernel (not attention): 4-D TMA tile ring with full/empty mbarriers.
//
// CTA work   tiles t = blockIdx.x, blockIdx.x + gridDim.x, ... of a 4-D tensor X[N3][N2][N1][N0];
//            tile (n3, n2, ty, tx) is the box {B0 x B1} at (tx*B0, ty*B1, n2, n3), out-of-bounds
//            elements read as zero. out[t] = sum of the tile in fp32.
// Warps      4 warps (128 threads) consume every tile; thread 0 is also the producer: it issues
//            the TMA loads and, once all warps released a slot, writes that slot's tile sum.
// Smem map   ring[STAGES=3][B0*B1*elem] dynamic (> 48 KB: opt-in), red[3][4] fp32 warp sums,
//            full[3] / empty[3] mbarriers.
// Barriers   full[s]: count 1, thread 0 arrive.expect_tx(tile bytes) + 1 TMA completes it.
//            empty[s]: count 4, lane 0 of each warp arrives after writing red[s][warp]; thread 0
//            waits on it, reduces red[s][*], writes out[], then refills slot s.
// PDL        barrier init runs before griddepcontrol.wait; dependents launch after the loop.
#include "../common/ptx.cuh"

#ifndef PROOF_DT
#error "PROOF_DT (0 fp16, 1 bf16, 2 fp32) not defined"
#endif
#ifndef PROOF_B0
#define PROOF_B0 64
#endif
#ifndef PROOF_B1
#define PROOF_B1 128
#endif

namespace {
constexpr int STAGES = 3, WARPS = 4, B0 = PROOF_B0, B1 = PROOF_B1;
constexpr int ELEM = PROOF_DT == 2 ? 4 : 2;
constexpr u32 TILE_BYTES = (u32)B0 * B1 * ELEM;

GQADRV_DEVICE float tile_partial(const u8* tile) {
  float acc = 0.f;
  if constexpr (PROOF_DT == 2) {
    const float* p = reinterpret_cast<const float*>(tile);
    for (int i = threadIdx.x * 4; i < B0 * B1; i += WARPS * 32 * 4) {
      const U32x4 v = *reinterpret_cast<const U32x4*>(p + i);
      acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) + __uint_as_float(v.w);
    }
  } else {
    for (int i = threadIdx.x * 8; i < B0 * B1; i += WARPS * 32 * 8) {
      const U32x4 v = *reinterpret_cast<const U32x4*>(tile + 2 * i);
      const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float lo, hi;
        unpack2<PROOF_DT == 1 ? 1 : 0>(w[k], lo, hi);
        acc += lo + hi;
      }
    }
  }
  return acc;
}
}  // namespace

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    tma_ring_reduce(const __grid_constant__ TmaDesc desc, float* __restrict__ out, int n2, int tiles_y,
                    int tiles_x, int num_tiles) {
  extern __shared__ __align__(1024) u8 ring[];
  __shared__ __align__(8) u64 full[STAGES];
  __shared__ __align__(8) u64 empty[STAGES];
  __shared__ float red[STAGES][WARPS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), WARPS);
    }
    fence_mbarrier_init();
    tma_prefetch_desc(&desc);
  }
  __syncthreads();
  pdl_wait();

  const int count = blockIdx.x < num_tiles ? (num_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const u64 policy = l2_policy_evict_first();
  auto issue = [&](int j) {
    const int t = blockIdx.x + j * gridDim.x;
    const int per_plane = tiles_y * tiles_x;
    const int plane = t / per_plane, rem = t - plane * per_plane;
    const int ty = rem / tiles_x, tx = rem - ty * tiles_x;
    const u32 bar = smem_u32(&full[j % STAGES]);
    mbar_arrive_expect_tx(bar, TILE_BYTES);
    tma_load_4d(smem_u32(ring + (size_t)(j % STAGES) * TILE_BYTES), &desc, bar, tx * B0, ty * B1,
                plane % n2, plane / n2, policy);
  };
  auto finish = [&](int j) {  // thread 0: slot of tile j released by all warps
    mbar_wait(smem_u32(&empty[j % STAGES]), (u32)((j / STAGES) & 1));
    out[blockIdx.x + j * gridDim.x] = red[j % STAGES][0] + red[j % STAGES][1] + red[j % STAGES][2] +
                                      red[j % STAGES][3];
  };
  if (threadIdx.x == 0)
    for (int j = 0; j < STAGES && j < count; ++j) issue(j);

  for (int j = 0; j < count; ++j) {
    const int s = j % STAGES;
    mbar_wait(smem_u32(&full[s]), (u32)((j / STAGES) & 1));
    float acc = tile_partial(ring + (size_t)s * TILE_BYTES);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) {
      red[s][warp] = acc;
      mbar_arrive(smem_u32(&empty[s]));
    }
    if (threadIdx.x == 0 && j + STAGES < count) {
      finish(j);
      issue(j + STAGES);
    }
  }
  if (threadIdx.x == 0) {
    const int first = count > STAGES ? count - STAGES : 0;
    for (int j = first; j < count; ++j) finish(j);
  }
  pdl_launch_dependents();
}
