"""What compute-sanitizer's racecheck reports on the shared-memory hand-offs our MLA kernels use,
on a kernel small enough to read in full.

    compute-sanitizer --tool racecheck --racecheck-report hazard python tools/racecheck_handoff.py VARIANT

One CTA of 256 threads (two warpgroups; 384 for sync_sync_384, skew, skew_pad and the alt variants), run once
per VARIANT; warpgroup 1 writes 128 floats of shared memory, warpgroup 0 reads them, over ROUNDS rounds that
reuse the same words (so a read of round r must come after round r's write and before round r+1's):

  arrive_sync  writer: store; bar.arrive B1 / reader: bar.sync B1; load  (the seesaw's publish_max
               hand-off until 2026-12-06; the reader tells the writer the words are free again with bar.arrive B2 /
               bar.sync B2). The PTX memory model orders these (barrier arrive = release, sync = acquire).
  sync_sync    the same with bar.sync on both sides of both barriers.
  syncthreads  __syncthreads() between the write and the read, and between the read and the next write.
  mbarrier     writer: store; mbarrier.arrive (release) / reader: mbarrier.try_wait.parity loop (acquire);
               load; the way back through a second mbarrier (the narrow kernels' q_full / q_empty
               pattern, with generic stores where they have cp.async).
  none         no barrier between the writer and the reader: a real race (the control; racecheck
               must report it).
  sync_sync_384 as sync_sync in a CTA of 384 threads whose third warpgroup returns at once, so the
               256-thread named barriers cover part of the CTA (as the MLA kernels' consumer barriers,
               whose producer warpgroup runs its own loop): narrow2's reports (docs/MLA.md) lie across such
               a barrier, written with an immediate barrier id.
  skew         sync_sync_384 where warpgroup 0 also passes its own 128-thread barrier (id 3) twice before
               the hand-offs and warpgroup 1 does not: the two sides have passed different numbers of
               barriers when they meet (narrow2's one-tile items: one warpgroup runs a tile, with its two
               warpgroup barriers, the other none).
  skew_pad     skew, with warpgroup 1 passing its own barrier (id 4) twice as well: equal counts again.
  alt1 .. alt8
               narrow2's shape of work (384 threads): lane 0 of warp 8 fills a ring of 4 slots (generic
               stores, mbarrier full / empty, one empty arrival per consuming warp after __syncwarp), the two
               warpgroups take tiles 0..T-1 in turn (tile k to warpgroup k % 2; altT, T = 1..8), each tile with two
               128-thread barriers of its own warpgroup around a 4-word exchange, then one more (row sums), then
               the epilogue's hand-offs across the 256-thread barrier 1 as in dense_decode_narrow2.cu: {m, L}
               words, the two rounds through the same words, a staging round and a ticket word. narrow2's
               racecheck reports (docs/MLA.md, 2026-12-07) came with requests of 5 tiles (300 or 320 tokens),
               none with items of 1, 2, 3, 4, 6 or 64+ tiles in single runs; outputs were always correct.

The tool exits 0 when every value warpgroup 0 read equals what warpgroup 1 wrote in that round
(the hand-off worked on this run), 1 otherwise; racecheck's verdict is in its own output.
Run on a GPU with CuPy (NVRTC compiles the kernel). Results (H100, compute-sanitizer 2025.3.1): arrive_sync
7 and 1 hazards in two runs with every value correct, sync_sync / syncthreads / mbarrier / sync_sync_384 0,
none 9 (docs/MLA.md, "racecheck does not model a bar.arrive -> bar.sync hand-off"). The alt variants (2026-12-07)
are compiled by NVRTC in the CPU tests (tests/mla/test_mla_host.py,
test_racecheck_handoff_tool_compiles_with_the_narrow2_shaped_variants); on an H100 (2026-12-07, the image's
compute-sanitizer) every value was right, alt1 .. alt4 drew 0 hazards and alt5 .. alt8 496 per tile past the fourth,
all of them WARs between the consumers' reads of a ring slot and the producer's stores of the tile that reuses it
after the slot's empty mbarrier (none in the epilogue hand-offs; docs/MLA.md).
"""

from __future__ import annotations

import sys

ROUNDS = 8

SOURCE = r"""
#define BAR_SYNC(id) asm volatile("bar.sync %0, 256;" ::"n"(id) : "memory")
#define BAR_ARRIVE(id) asm volatile("bar.arrive %0, 256;" ::"n"(id) : "memory")
#define WG_SYNC(id) asm volatile("bar.sync %0, 128;" ::"n"(id) : "memory")
#define WG_SYNC_ID(id) asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory")
__device__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ void mbar_wait(unsigned long long* b, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W%=:\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra W%=;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}
// narrow2's shape of work in one CTA of 384 threads; out[0 .. 512) receives the hand-off results and
// out[512 .. 768) each consumer thread's sum over its tiles (checked by the host: alt_expect).
__device__ void alternate(float* out, int T) {
  __shared__ float ring[4][128];
  __shared__ float red[2][4];
  __shared__ float xml[2][2];
  __shared__ float box[128];
  __shared__ float stage[128];
  __shared__ unsigned ticket;
  __shared__ unsigned long long full[4], empty[4];
  const int tid = threadIdx.x, wg = tid >> 7, i = tid & 127, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < 4; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" ::"r"(smem_addr(&empty[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 2) {  // producer: lane 0 of warp 8 fills tile k into slot k % 4, the other threads leave
    if (warp == 8 && lane == 0) {
      for (int k = 0; k < T; ++k) {
        const int s = k & 3;
        if (k >= 4) mbar_wait(&empty[s], ((k >> 2) - 1) & 1);
        for (int j = 0; j < 128; ++j) ring[s][j] = (float)(k * 128 + j);
        mbar_arrive(&full[s]);
      }
    }
    return;
  }
  float acc = 0.f;
  for (int k = wg; k < T; k += 2) {  // tile k to warpgroup k % 2
    const int s = k & 3;
    mbar_wait(&full[s], (k >> 2) & 1);
    const float v = ring[s][i];
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);  // one arrival per warp, after the warp's reads
    if (i < 4) red[wg][i] = v;
    WG_SYNC_ID(2 + wg);  // the column max's exchange (softmax_tile)
    acc += v + red[wg][i & 3];
    WG_SYNC_ID(2 + wg);  // "P complete": red[] read before the next tile's writes
  }
  WG_SYNC_ID(2 + wg);  // row sums
  // the epilogue's hand-offs (dense_decode_narrow2.cu): {m, L}, two rounds through the same words, staging, ticket
  BAR_SYNC(1);
  if (i == 0) { xml[wg][0] = (float)(wg + 1); xml[wg][1] = (float)(10 * (wg + 1)); }
  if (wg == 1) box[i] = (float)(1000 + i);
  BAR_SYNC(1);
  const float mo = xml[wg ^ 1][0] + xml[wg ^ 1][1];
  if (wg == 0) { out[i] = box[i]; box[i] = (float)(2000 + i); }
  BAR_SYNC(1);
  if (wg == 1) out[128 + i] = box[i];
  BAR_SYNC(1);
  if (i < 64) stage[64 * wg + i] = (float)(3000 + 64 * wg + i);  // each warpgroup stages half the row
  BAR_SYNC(1);
  if (wg == 0) out[256 + i] = stage[i];
  BAR_SYNC(1);
  if (tid == 0) ticket = 7u;
  BAR_SYNC(1);
  if (wg == 1) out[384 + i] = (float)ticket + mo;
  out[512 + tid] = acc;
}
extern "C" __global__ void handoff(float* out, int variant) {
  __shared__ float box[128];
  __shared__ unsigned long long full, empty;
  const int wg = threadIdx.x >> 7, i = threadIdx.x & 127;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" ::"r"(smem_addr(&full)) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" ::"r"(smem_addr(&empty)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 2 && variant < 8) return;  // sync_sync_384: the third warpgroup takes no further part
  if (variant == 6 || variant == 7) {  // skew / skew_pad: barriers of one warpgroup before the hand-offs
    if (wg == 0) { WG_SYNC(3); WG_SYNC(3); }
    else if (variant == 7) { WG_SYNC(4); WG_SYNC(4); }
  }
  if (variant >= 8) {  // alt1 .. alt8: narrow2's ring, alternate tiles and epilogue hand-offs over variant - 8 tiles
    alternate(out, variant - 8);
    return;
  }
  for (int r = 0; r < ROUNDS; ++r) {
    const bool first = r == 0, last = r + 1 == ROUNDS;
    if (variant == 0) {         // arrive_sync
      if (wg == 1) { if (!first) BAR_SYNC(2); box[i] = (float)(r * 1000 + i); BAR_ARRIVE(1); }
      else { BAR_SYNC(1); out[r * 128 + i] = box[i]; if (!last) BAR_ARRIVE(2); }
    } else if (variant == 1 || variant >= 5) {  // sync_sync (5..7: in a CTA of 384 threads)
      if (wg == 1) { if (!first) BAR_SYNC(2); box[i] = (float)(r * 1000 + i); BAR_SYNC(1); }
      else { BAR_SYNC(1); out[r * 128 + i] = box[i]; if (!last) BAR_SYNC(2); }
    } else if (variant == 2) {  // syncthreads
      if (wg == 1) box[i] = (float)(r * 1000 + i);
      __syncthreads();
      if (wg == 0) out[r * 128 + i] = box[i];
      __syncthreads();
    } else if (variant == 3) {  // mbarrier: full (writer -> reader), empty (reader -> writer)
      if (wg == 1) { if (!first) mbar_wait(&empty, (r - 1) & 1); box[i] = (float)(r * 1000 + i); mbar_arrive(&full); }
      else { mbar_wait(&full, r & 1); out[r * 128 + i] = box[i]; if (!last) mbar_arrive(&empty); }
    } else {                    // none: a real race
      if (wg == 1) box[i] = (float)(r * 1000 + i);
      else out[r * 128 + i] = box[i];
    }
  }
}
"""

VARIANTS = {"arrive_sync": 0, "sync_sync": 1, "syncthreads": 2, "mbarrier": 3, "none": 4, "sync_sync_384": 5, "skew": 6,
            "skew_pad": 7, **{f"alt{t}": 8 + t for t in range(1, 9)}}


def alt_expect(tiles: int):
    """What variant ``alt<tiles>`` writes to out[0 .. 768): warpgroup 1's first-round words, warpgroup 0's
    second-round words, the staging round, the ticket word plus warpgroup 0's {m, L} (1 + 10), then each consumer
    thread's sum over its tiles k (k % 2 = its warpgroup) of its ring word k * 128 + i and the exchanged word
    k * 128 + i % 4."""
    import numpy as np

    i = np.arange(128, dtype=np.float64)
    sums = [np.zeros(128), np.zeros(128)]
    for k in range(tiles):
        sums[k % 2] += 2 * k * 128 + i + i % 4
    return np.concatenate([1000 + i, 2000 + i, 3000 + i, np.full(128, 7.0 + 11.0), *sums])


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in VARIANTS:
        print(f"usage: racecheck_handoff.py {{{','.join(VARIANTS)}}}", file=sys.stderr)
        return 2
    import cupy as cp
    import numpy as np

    kernel = cp.RawKernel(SOURCE.replace("ROUNDS", str(ROUNDS)), "handoff")
    out = cp.full(ROUNDS * 128, -1.0, dtype=cp.float32)
    kernel((1,), (384 if VARIANTS[argv[0]] >= 5 else 256,), (out, np.int32(VARIANTS[argv[0]])))
    if VARIANTS[argv[0]] >= 8:
        ok = bool((cp.asnumpy(out)[:768] == alt_expect(VARIANTS[argv[0]] - 8)).all())
    else:
        got = cp.asnumpy(out).reshape(ROUNDS, 128)
        want = np.arange(ROUNDS)[:, None] * 1000.0 + np.arange(128)[None, :]
        ok = bool((got == want).all())
    print(f"{argv[0]}: values read {'==' if ok else '!='} values written in every round")
    return 0 if ok or argv[0] == "none" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
