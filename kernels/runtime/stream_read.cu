// gqadrv — streaming-read ceiling kernel for the benchmark (not attention).
//
// CTA work   grid-stride read of n 16-byte vectors with non-caching vector loads; an XOR of all
//            words is kept so the loads cannot be removed, and written only if it hits a magic value.
// Warps      blockDim.x threads, no roles. Smem: none. Barriers: none.
#include "../common/ptx.cuh"

extern "C" __global__ void stream_read(const U32x4* __restrict__ p, unsigned long long n, u32* out) {
  u32 acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const U32x4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const U32x4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
