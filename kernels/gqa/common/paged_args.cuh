// gqadrv — the argument block of the paged / multi-token GQA decode kernel
// (kernels/gqa/sm80/decode_paged.cu) and the work of one of its CTAs:
//   * GqaPagedArgs (filled by the host: gqadrv/gqa/paged_plan.py; mirrored in gqadrv/gqa/paged_args.py),
//   * PagedSchedule: the (batch, KV head, row block, split) of a CTA and the sub-tiles of the
//     device-side length it owns (paged_schedule).
//
// GQA_KV8 = 1: the pools hold float8_e4m3fn codes (one byte per element; k / v are then byte
// pointers and the strides count bytes), dequantized in registers with the scales at the end of the
// block (kernels/gqa/common/warp.cuh, KV8).
#ifndef GQA_KV8
#define GQA_KV8 0
#endif
//
// Cache addressing: element (page, token in page, KV head, d) of the K (or V) pool is at
//   k + page * page_stride + token * tok_stride + head * head_stride + d          (elements)
// which covers NHD [pages, page, Hkv, D], HND [pages, Hkv, page, D], the combined [pages, 2, ...]
// forms (v = k + one K plane) and the contiguous [B, 2, Hkv, C, D] cache (table == null: request b
// is page b of C tokens). Token t of request b lives on page table[b * table_stride + (t >> page_shift)]
// at t & (2^page_shift - 1); table entries of tokens >= len are never used: the TMA kernel's
// speculative ring fill (GQA_PAGED_FLAG_SPEC) may load entries up to the capacity before the length
// is known, but it hands them only to TMA (which zero-fills a page id outside the pool without
// reading memory) and discards every load the length does not confirm.
//
// Rows: the CTA's query rows are s_q * group (query token j, head h of the group) in the order
// r = j * group + h, cut into row blocks of ROWS (the MMA rows); row r of token j sees keys
// [0, len - (s_q - 1 - j)) (bottom-right causal; all keys when s_q == 1).
#pragma once
#include "args.cuh"

struct GqaPagedArgs {
  const u16* q;          // [B, s_q, Hq, D]
  const u16* k;          // K pool (see above)
  const u16* v;          // V pool, same strides
  u16* out;              // [B, s_q, Hq, D]
  float* lse;            // [B, s_q, Hq] natural log (+inf: no key), or null
  const i32* lengths;    // [B]
  const i32* table;      // [B, table_stride] page ids, or null (contiguous cache: page = request)
  float* ws_o;           // [units, S, ROWS, D] fp32 partial numerators (splits > 1), units = B*Hkv*row_blocks
  float* ws_ml;          // [units, S, ROWS, 2] {max (log2 domain), denominator}
  u32* counters;         // [units] arrival tickets, zero between launches
  u32* status;           // [B, 1 + S] or null: word 0 length code (0 ok, 1 len <= 0, 2 len > capacity),
                         // word 1 + s: 1 if split s met a page id outside [0, num_pages)
  long long page_stride; // elements
  long long tok_stride;  // elements
  long long head_stride; // elements
  float scale_log2;      // sm_scale / ln 2
  int hkv;
  int group;
  int s_q;
  int rows;              // s_q * group
  int row_blocks;        // ceil(rows / ROWS)
  int page_shift;        // log2(page size) (table != null)
  int num_pages;         // valid page ids: [0, num_pages)
  int table_stride;      // elements between table rows
  int capacity;          // max_pages * page size (contiguous: C); lengths clamp to [0, capacity]
  int num_splits;
  int split_subs;        // > 0: split s owns sub-tiles [s * split_subs, (s + 1) * split_subs) (batch-invariant
                         // mode, merged in split order); 0: sub-tiles of len balanced over the splits
  int flags;             // GQA_FLAG_L2_EVICT_FIRST (args.cuh), GQA_PAGED_FLAG_HND
  // e4m3 caches (GQA_KV8 builds; ignored otherwise): K scale of KV head h = k_scale_value *
  // (k_scale ? k_scale[h * k_scale_stride] : 1), the same for V (stride 0: one scale per tensor)
  const float* k_scale;
  const float* v_scale;
  float k_scale_value;
  float v_scale_value;
  int k_scale_stride;
  int v_scale_stride;
  int units;             // B * hkv * row_blocks (the TMA kernel's GQA_PAGED_MULTI builds walk them, grid-strided)
};
// The TMA kernel's tensor maps are HND-ordered (D, page, Hkv, pages) instead of NHD-ordered
// (D, Hkv, page, pages): the box coordinates swap.
#define GQA_PAGED_FLAG_HND 4
// The TMA kernel fills its ring before the length is known (the host sets it for one-wave grids,
// gqa/paged.speculates): from the block-table entries of the sub-tiles each warp owns whatever the
// length, because the balanced splits then take the sub-tiles in interleaved order (warp w of split
// s: s * W + w, then every S * W-th); the batch-invariant mode keeps its fixed splits (the guess
// len = capacity is exact for every split that holds tokens).
#define GQA_PAGED_FLAG_SPEC 8
// Bits 16..31 of flags: GQA_PAGED_NEXT builds of the TMA kernel (development switch) read the successor
// stride G there, the number of co-resident CTAs of a launch of more than one wave (0: no successor
// prefetch). CTA x + G is the one that takes a freed SM after the wave of x (blocks launch in order):
// near its end each warp of x prefetches into L2 the first sub-tiles warp w of CTA x + G will load.
#define GQA_PAGED_NEXT_SHIFT 16

struct PagedSchedule {
  int b, kvh, rb, split;
  long long unit;        // (b * hkv + kvh) * row_blocks + rb
  int raw_len, len;      // as stored / clamped to [0, capacity]
  int sub_begin, sub_end;
  int splits_used;       // splits of this unit that take part in its ticket (see GQA_PAGED_DET_EXIT)
};

// GQA_PAGED_DET_EXIT = 1 (the default since 2026-12-06; GQADRV_PAGED_DET_EXIT=0 builds the old form for
// A/B): in the batch-invariant mode only the splits that hold tokens of the request (at least split 0)
// take part: the others leave right after the schedule, and the ticket counts
// max(1, ceil(nsub / split_subs)) arrivals. With 0 every split of the launch writes an (empty) partial
// and takes a ticket, so a block table sized for a longer context than served launches mostly idle
// CTAs that still cost their partials (H100, B16 L4096 in a 131072-token table: 224.2 -> 114.3 us hot).
// D = 256 keeps the old form (the switch makes the cp.async kernel spill on sm_100a there).
#ifndef GQA_PAGED_DET_EXIT
#define GQA_PAGED_DET_EXIT 1
#endif
#if defined(GQA_D) && GQA_D == 256
#undef GQA_PAGED_DET_EXIT
#define GQA_PAGED_DET_EXIT 0
#endif

// The (batch, KV head, row block, split) of grid position `cta` (no memory read).
GQADRV_DEVICE PagedSchedule paged_unit_at(const GqaPagedArgs& a, int cta) {
  PagedSchedule s;
  s.split = cta % a.num_splits;
  const int unit = cta / a.num_splits;
  s.unit = unit;
  s.rb = unit % a.row_blocks;
  const int bh = unit / a.row_blocks;
  s.b = bh / a.hkv;
  s.kvh = bh - s.b * a.hkv;
  return s;
}
// The CTA's own (batch, KV head, row block, split).
GQADRV_DEVICE PagedSchedule paged_unit(const GqaPagedArgs& a) { return paged_unit_at(a, (int)blockIdx.x); }

// The sub-tiles of unit `u` (paged_unit) for the stored length `raw` (a.lengths[u.b], or a.capacity
// for the TMA kernel's speculative guess): split_point over the length's sub-tiles (balanced), or the
// fixed splits of the batch-invariant mode. (The TMA kernel's interleaved order, GQA_PAGED_FLAG_SPEC,
// takes only len from here.)
GQADRV_DEVICE PagedSchedule paged_schedule(const GqaPagedArgs& a, PagedSchedule s, int tok_per_sub, int raw) {
  s.raw_len = raw;
  s.len = s.raw_len < 0 ? 0 : (s.raw_len > a.capacity ? a.capacity : s.raw_len);
  const int nsub = (s.len + tok_per_sub - 1) / tok_per_sub;
  s.splits_used = a.num_splits;
  if (a.split_subs > 0) {
    const long long beg = (long long)s.split * a.split_subs;
    s.sub_begin = beg < nsub ? (int)beg : nsub;
    s.sub_end = s.sub_begin + a.split_subs < nsub ? s.sub_begin + a.split_subs : nsub;
#if GQA_PAGED_DET_EXIT
    const int used = (nsub + a.split_subs - 1) / a.split_subs;
    s.splits_used = used < 1 ? 1 : (used < a.num_splits ? used : a.num_splits);
#endif
  } else {
    s.sub_begin = split_point(nsub, s.split, a.num_splits);
    s.sub_end = split_point(nsub, s.split + 1, a.num_splits);
  }
  return s;
}

GQADRV_DEVICE PagedSchedule paged_schedule(const GqaPagedArgs& a, int tok_per_sub) {
  const PagedSchedule u = paged_unit(a);
  return paged_schedule(a, u, tok_per_sub, a.lengths[u.b]);
}
