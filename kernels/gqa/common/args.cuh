// gqadrv — the argument block of every GQA decode kernel and the work of one CTA it defines:
//   * GqaArgs and its flags (one layout for all GQA kernels, filled by the host: see
//     gqadrv/gqa/routes.py),
//   * CtaSchedule: the (batch, KV head, split) of a CTA and the sub-tiles of the device-side length
//     it owns (make_schedule), plus the capacity-based split a kernel can use before the length is
//     known (capacity_split).
#pragma once
#include "../../common/ptx.cuh"

// Scalar/pointer kernel arguments shared by every GQA kernel (after the optional TMA descriptor).
struct GqaArgs {
  const u16* q;        // [B, Hq, D]
  const u16* kv;       // [B, 2, Hkv, C, D]
  u16* out;            // [B, Hq, D]
  const i32* lengths;  // [B]
  float* ws_o;         // [B*Hkv, S, group, D] fp32 partial numerators (splits > 1)
  float* ws_ml;        // [B*Hkv, S, group, 2]   {max (log2 domain), denominator}
  u32* counters;       // [B*Hkv] arrival tickets, zero between launches
  u32* status;         // [B] or null: 0 ok, 1 length <= 0, 2 length > capacity
  float scale_log2;    // q_scale / sqrt(D) / ln 2
  int hkv;
  int group;
  int capacity;
  int num_splits;
  int flags;           // GQA_FLAG_* bits
};
// Streaming hint: load KV with an L2 evict-first policy (the host sets it when the KV footprint is
// large compared with the L2, so the stream does not evict what other kernels keep there).
#define GQA_FLAG_L2_EVICT_FIRST 1
// Prefetch the first sub-tiles into L2 before griddepcontrol.wait (TMA route; the host sets it when
// the grid is one wave of long streams, see routes.l2_prefetch_pays).
#define GQA_FLAG_L2_PREFETCH 2

// Work of one CTA: which request, KV head and split, and which sub-tiles of TOK tokens it owns.
//
// Split boundaries: with nsub_cap = ceil(C/TOK) and nsub_len = ceil(len/TOK), a request whose
// length is at least 3/4 of the capacity uses the capacity-based boundaries
// [nsub_cap*s/S, nsub_cap*(s+1)/S) clipped to nsub_len, otherwise length-based boundaries
// [nsub_len*s/S, nsub_len*(s+1)/S). The first rule lets a kernel start loading before it has read
// the length (capacity_split below is then exact); the second keeps short requests balanced.
struct CtaSchedule {
  int b, kvh, bh, split;
  int raw_len;        // as stored on the device
  int len;            // clamped to [0, capacity]
  int sub_begin;      // first sub-tile of this split
  int sub_end;        // one past the last
};

// floor(n * s / S) for 0 <= s <= S <= GQA_MAX_SPLITS without a 64-bit division (a subroutine call
// on the critical path of the prologue): n * s / S = q * s + r * s / S with n = q * S + r, and
// r * s < S * S fits 32 bits.
GQADRV_DEVICE int split_point(int n, int s, int S) {
  const int q = n / S, r = n - q * S;
  return q * s + (r * s) / S;
}

GQADRV_DEVICE void capacity_split(const GqaArgs& a, int tok_per_sub, int split, int& beg, int& end) {
  const int nsub = (a.capacity + tok_per_sub - 1) / tok_per_sub;
  beg = split_point(nsub, split, a.num_splits);
  end = split_point(nsub, split + 1, a.num_splits);
}

// `raw` = a.lengths[b] for this CTA's request (b = blockIdx.x / num_splits / hkv), loaded by the
// caller: a kernel that floods the memory system with speculative loads reads it first, so that
// the one load the schedule depends on is not queued behind them.
GQADRV_DEVICE CtaSchedule make_schedule(const GqaArgs& a, int tok_per_sub, int raw) {
  CtaSchedule s;
  s.split = blockIdx.x % a.num_splits;
  s.bh = blockIdx.x / a.num_splits;
  s.b = s.bh / a.hkv;
  s.kvh = s.bh - s.b * a.hkv;
  s.raw_len = raw;
  s.len = raw < 0 ? 0 : (raw > a.capacity ? a.capacity : raw);
  const int nsub = (s.len + tok_per_sub - 1) / tok_per_sub;
  if (4LL * s.len >= 3LL * a.capacity) {
    capacity_split(a, tok_per_sub, s.split, s.sub_begin, s.sub_end);
    if (s.sub_end > nsub) s.sub_end = nsub;
    if (s.sub_begin > s.sub_end) s.sub_begin = s.sub_end;
  } else {
    s.sub_begin = split_point(nsub, s.split, a.num_splits);
    s.sub_end = split_point(nsub, s.split + 1, a.num_splits);
  }
  return s;
}

GQADRV_DEVICE CtaSchedule make_schedule(const GqaArgs& a, int tok_per_sub) {
  return make_schedule(a, tok_per_sub, a.lengths[(int)blockIdx.x / a.num_splits / a.hkv]);
}
