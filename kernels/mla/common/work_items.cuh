// gqadrv — MLA dense decode: the work items of one CTA of the seesaw kernel.
//
// A work item is one request's key range for the CTA's 64-row block: tiles [t_beg, t_beg + 2 npairs)
// (pairs of 64-token tiles), token end tok_end. Two schedules produce them:
//
// Split grid (MLA_BALANCED=0): grid (nmb * S, h_kv, b); the CTA's one item is split blockIdx.x / nmb of
//   request blockIdx.z, S = num_splits whole-pair splits of the request (split_point). Its partial slot
//   is unit * S + split, unit = (b * h_kv + kvh) * nmb + mb (the workspace layout of kernel_spec).
//
// Balanced persistent grid (MLA_BALANCED=1): grid (P, h_kv, nmb), P = num_splits = CTAs per (KV head,
//   row block) group (the host picks about one CTA per SM in total). Request i costs
//   w_i = REQ_COST + npairs_i units (REQ_COST for its Q load and epilogue, then one unit per pair); the
//   requests' units are laid end to end (request i from C_i = sum_{j<i} w_j, its pairs from
//   f_i = C_i + REQ_COST), W = sum w_i, even = ceil(W / P), k = ceil(b / P). Two modes, chosen on the
//   device at every launch:
//   * whole requests, when every w_i <= (even + even / 4 + MERGE_COST) / k (uniform batches of 0.8 P
//     to P requests or of about k P, and near-uniform ones such as lengths L + 2i): CTA p takes
//     requests [k p, k (p + 1)), i.e. the units [C_{kp}, C_{k(p+1)}); no request is cut. A cut adds
//     a partial, a ticket and a merge, which measured more than the model's fixed cost (docs/MLA.md):
//     cuts lost to whole requests at 1.18 even shares (b = 110 uniform on 132 CTAs, 4-10 %, also with
//     chunk / 32 snapping) and won on the ramps of lengths (11-19 %), hence the wide slack. The
//     walker sees chunk = 0 and yields every item with nsplit 1.
//   * cut: chunk = even, CTA p takes the units [B_p, B_{p+1}), B_q = snap(q chunk) (B_0 = 0, B_q = W
//     for q chunk >= W): a boundary moves to the nearer end of its request only within chunk / 32
//     units of it (MLA_SNAP_SHIFT; no slivers), so every CTA gets about one chunk (at most 1 + 1/16 with
//     the fixed costs) and one long request in a batch no longer runs on a single CTA (chunk / 32
//     since 2026-12-05: 1-6 % faster than chunk / 8 on the ramps, docs/MLA.md). snap is monotone (it moves a
//     boundary only within its request, to the nearer end), so the ranges partition [0, W). The CTA
//     holding unit x, cta(x), is floor(x / chunk) corrected for the two boundaries of x's request that
//     may have moved (its first interior boundary to the start, its last to the end; a boundary
//     further inside is more than the tolerance from both ends).
//   * no cut (MLA_FLAG_NO_CUT, set by the host for the sparse paths, whose "requests" are short lists):
//     the cut mode's boundaries, each snapped to the nearer end of its request whatever the distance,
//     so every request lies in one CTA's range (the one holding its midpoint): no partials, no merges,
//     and the workspace holds no partial slots; a CTA's share is off the even one by at most one
//     request. The walker sees chunk 0 as in the whole mode.
//   A request with pairs is shared by nsplit = cta(last pair) - cta(f_i) + 1 CTAs; only a CTA's
//   first and last item can be shared. A request without pairs (length 0) is answered by the CTA
//   whose range holds C_i (out 0, lse +inf). Partial slots: CTA p's share of request i uses slot p + i of the group's (P + b)
//   slots (unique: along the staircase of (CTA, request) pairs p + i increases by at least one per
//   step), so a request's nsplit partials are the consecutive slots from cta(f_i) + i. Every CTA
//   derives W and its range from cache_seqlens at each launch (a block-wide scan, `balanced_start`):
//   nothing depends on host-side lengths, CUDA-graph replays with new lengths stay valid.
#pragma once
#include "../../common/ptx.cuh"
#include "args.cuh"
#include "decode_util.cuh"

#ifndef MLA_BALANCED
#define MLA_BALANCED 0
#endif
// Schedule constants of the balanced grid (the defaults are the measured rule; other values only in
// the experiment variants of kernel_spec, GQADRV_MLA_EXPERIMENTS=1): a cut-mode boundary snaps to a
// request end within chunk >> MLA_SNAP_SHIFT units; the whole mode allows even >> MLA_WHOLE_SLACK_SHIFT
// units above the even share (plus MERGE_COST); MLA_WHOLE_MODE 0 never takes it (cuts always).
#ifndef MLA_SNAP_SHIFT
#define MLA_SNAP_SHIFT 5
#endif
#ifndef MLA_WHOLE_SLACK_SHIFT
#define MLA_WHOLE_SLACK_SHIFT 2
#endif
#ifndef MLA_WHOLE_MODE
#define MLA_WHOLE_MODE 1
#endif


namespace mla {

constexpr int REQ_COST = 1;    // fixed cost of one request, in pairs (balanced schedule)
constexpr int MERGE_COST = 4;  // what a cut adds to the merging CTA's tail, in pairs (whole-request test)

struct WorkItem {
  int req;      // request index
  int len;      // its clamped cache length
  int t_beg;    // first 64-token tile of the item
  int npairs;   // pairs of tiles (0: an empty request this CTA answers, or an empty split)
  int tok_end;  // tokens >= tok_end are masked (min(key_len, end of the item's last pair))
  int nsplit;   // CTAs sharing the request (1: this CTA writes out / lse)
  int slot;     // this item's partial slot (nsplit > 1)
  int slot0;    // the request's first partial slot (the merge reads nsplit consecutive slots)
};

// Pairs of 64-token tiles request `req` needs for the row block whose last valid row is last_row.
GQADRV_DEVICE int request_pairs(const MlaDecodeArgs& a, int req, int last_row, int& len) {
  len = clamped_len(a, req);
  const int key_len = row_key_limit(a, len, last_row);
  return (((key_len + 63) >> 6) + 1) >> 1;
}

// Boundary x (C <= x < C + w, inside the request [C, C + w)) moved to the nearer end of the request
// when it lies within chunk >> MLA_SNAP_SHIFT units of it (chunk / 32; the start on a tie), else x (see
// the header comment).
GQADRV_DEVICE int snap_boundary(int x, int c, int w, int chunk) {
  const int tol = chunk >> MLA_SNAP_SHIFT;
  const int d0 = x - c, d1 = c + w - x;
  if (d0 <= d1 && d0 <= tol) return c;
  if (d1 <= tol && d1 < d0) return c + w;
  return x;
}
// cta(x) for a unit x of the request [C, C + w) (see the header comment).
GQADRV_DEVICE int cta_of_unit(int x, int c, int w, int chunk) {
  int p = x / chunk;
  const int qa = (c + chunk - 1) / chunk, qb = (c + w - 1) / chunk;  // boundaries q chunk inside [C, C + w)
  if (qa <= qb) {
    if (snap_boundary(qa * chunk, c, w, chunk) == c) p = max(p, qa);
    if (snap_boundary(qb * chunk, c, w, chunk) == c + w) p = min(p, qb - 1);
  }
  return p;
}

// The split grid's single item (see above).
GQADRV_DEVICE WorkItem split_item(const MlaDecodeArgs& a, int req, int split, int S, int last_row, long long unit) {
  WorkItem w;
  w.req = req;
  const int npairs_all = request_pairs(a, req, last_row, w.len);
  const int key_len = row_key_limit(a, w.len, last_row);
  const int p_beg = split_point(npairs_all, split, S), p_end = split_point(npairs_all, split + 1, S);
  w.npairs = p_end - p_beg;
  w.t_beg = 2 * p_beg;
  w.tok_end = min(key_len, 2 * p_end * 64);
  w.nsplit = S;
  w.slot0 = (int)(unit * S);
  w.slot = w.slot0 + split;
  return w;
}

// Iterator over a CTA's items of the balanced schedule. Every thread of the CTA runs its own copy
// from the same start and sees the same items.
// The fixed values (r0, r1, chunk) are read from shared memory at each call (`start`, written by
// balanced_start): registers are scarce in the consumers.
struct BalancedWalker {
  int req, cost0;     // next request to look at and its first cost unit C_req
  const int* start;   // sched + NW: {first request, its cost start, r0, r1, chunk}
  int p, slot_base;   // the CTA index; first partial slot of its (KV head, row block) group: (kvh nmb + mb)(P + b)

  // Whether a later call of next() may still return an item.
  GQADRV_DEVICE bool more(const MlaDecodeArgs& a) const { return req < a.b && cost0 < start[3]; }

  GQADRV_DEVICE bool next(const MlaDecodeArgs& a, int last_row, WorkItem& w) {
    const int r0 = start[2], r1 = start[3], chunk = start[4];
#pragma unroll 1
    while (req < a.b && cost0 < r1) {
      int len;
      const int i = req, c = cost0;
      const int np = request_pairs(a, i, last_row, len);
      const int f = c + REQ_COST, end = f + np;
      ++req;
      cost0 = end;
      if (np == 0) {
        if (c < r0) continue;  // answered by the CTA holding C_i
        w = WorkItem{i, len, 0, 0, 0, 1, 0, 0};
        return true;
      }
      const int j0 = max(r0 - f, 0), j1 = min(r1 - f, np);
      if (j1 <= j0) continue;
      const int key_len = row_key_limit(a, len, last_row);
      const int pf = chunk > 0 ? cta_of_unit(f, c, end - c, chunk) : p;  // chunk 0: whole requests
      w.req = i;
      w.len = len;
      w.t_beg = 2 * j0;
      w.npairs = j1 - j0;
      w.tok_end = min(key_len, 2 * j1 * 64);
      w.nsplit = chunk > 0 ? cta_of_unit(end - 1, c, end - c, chunk) - pf + 1 : 1;
      w.slot0 = slot_base + pf + i;
      w.slot = slot_base + p + i;
      return true;
    }
    return false;
  }
};

// Merges a CTA won (it drew the last ticket of a shared request), kept in shared memory as
// {req, slot0, nsplit} triples by thread 0 and run after the CTA's last item, when no load is in
// flight and the tile buffers can hold the merge weights. Only a CTA's first and last item can be
// shared, so there are at most two.
GQADRV_DEVICE void note_merge_won(int* s_merge, int& n_merge, const WorkItem& w, int tid) {
  if (tid == 0) {
    s_merge[3 * n_merge] = w.req;
    s_merge[3 * n_merge + 1] = w.slot0;
    s_merge[3 * n_merge + 2] = w.nsplit;
  }
  ++n_merge;
}
// Runs them over NT threads (`sync`: their barrier), BM-row blocks starting at packed row row0 of
// (request, KV head kvh), row block mb of nmb; `wts`: [BM][nsplit] fp32 scratch.
template <int BM, int NT, int DT, int IPT_MAX = 8, class Sync>
GQADRV_DEVICE void run_merges_won(const MlaDecodeArgs& a, const int* s_merge, int n_merge, float* wts, int kvh, int nmb,
                                  int mb, int row0, int rows, int tid, Sync sync) {
  sync();  // thread 0's s_merge entries are visible
#pragma unroll 1
  for (int k = 0; k < n_merge; ++k) {
    const int req = s_merge[3 * k], slot0 = s_merge[3 * k + 1], nsplit = s_merge[3 * k + 2];
    merge_partials_from<BM, NT, DT, IPT_MAX>(
        a, wts, (long long)slot0 * BM, ((long long)req * a.h_kv + kvh) * nmb + mb, nsplit, rows, tid,
        [&](int r) { return out_row_ptr(a, req, kvh, row0 + r); }, [&](int r) { return lse_ptr(a, req, kvh, row0 + r); },
        sync, M_INIT);
    sync();  // the weights of this merge are read before the next one writes them
  }
}

// The balanced schedule's start, by a block-wide scan of the request costs: all NT threads call it
// (it holds three CTA-wide barriers: the scan, the whole-request test, the result). `sched`: NT / 32
// + 5 ints of shared memory that keep the result (sched[NW .. NW + 4] = first request, its cost
// start, r0, r1, chunk; chunk 0 = whole requests) for balanced_walker(), which each role calls after
// its setmaxnreg (values live across setmaxnreg would be spilled).
template <int NT>
GQADRV_DEVICE void balanced_start(const MlaDecodeArgs& a, int last_row, int p, int parts, int* sched, int tid) {
  constexpr int NW = NT / 32;
  const int lane = tid & 31, warp = tid >> 5;
  const int per = (a.b + NT - 1) / NT, i0 = min(tid * per, a.b), i1 = min(i0 + per, a.b);
  int local = 0;
#pragma unroll 1
  for (int i = i0; i < i1; ++i) {
    int len;
    local += REQ_COST + request_pairs(a, i, last_row, len);
  }
  int incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) sched[warp] = incl;
  __syncthreads();
  int before = 0, total = 0;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const int v = sched[w];
    before += w < warp ? v : 0;
    total += v;
  }
  const int excl = before + incl - local;
  const int even = max((total + parts - 1) / parts, 1);
  // Whole requests, k = ceil(b / P) per CTA, when every request is at most (even + even / 4 +
  // MERGE_COST) / k units (the second barrier ANDs the test over the threads' requests).
  const int k_req = (a.b + parts - 1) / parts;
  const long long cap = (long long)even + (even >> MLA_WHOLE_SLACK_SHIFT) + MERGE_COST;
  const bool no_cut = (a.flags & MLA_FLAG_NO_CUT) != 0;
  int fits = no_cut ? 0 : MLA_WHOLE_MODE;
#pragma unroll 1
  for (int i = i0; fits && i < i1; ++i) {
    int len;
    fits &= (long long)k_req * (REQ_COST + request_pairs(a, i, last_row, len)) <= cap;
  }
  if (__syncthreads_and(fits)) {
    // CTA p takes requests [k p, k (p + 1)): its units start at C_{k p}; the walker sees chunk 0
    const int q0 = p * k_req, q1 = q0 + k_req;
    if (tid == 0) {
      sched[NW + 4] = 0;
      if (q0 >= a.b) {
        sched[NW] = a.b;
        sched[NW + 1] = total;
        sched[NW + 2] = total;
      }
      if (q1 >= a.b) sched[NW + 3] = total;
    }
    if ((i0 <= q0 && q0 < i1) || (i0 <= q1 && q1 < i1)) {
      int c = excl;
#pragma unroll 1
      for (int i = i0; i < i1; ++i) {
        if (i == q0) {
          sched[NW] = i;
          sched[NW + 1] = c;
          sched[NW + 2] = c;
        }
        if (i == q1) sched[NW + 3] = c;
        int len;
        c += REQ_COST + request_pairs(a, i, last_row, len);
      }
    }
    __syncthreads();
    return;
  }
  const int chunk = even;
  // MLA_FLAG_NO_CUT: every boundary snaps to the nearer end of its request (a tolerance no request
  // reaches), so no request is shared; the walker then sees chunk 0 (nsplit 1, no partials).
  const int snap_chunk = no_cut ? (1 << 30) : chunk;
  const int x0 = p * chunk, x1 = (p + 1) * chunk;  // the CTA's boundaries before snapping
  if (tid == 0) {  // boundaries at or past the end
    sched[NW + 4] = no_cut ? 0 : chunk;
    if (x0 >= total) {
      sched[NW] = a.b;
      sched[NW + 1] = total;
      sched[NW + 2] = total;
    }
    if (x1 >= total) sched[NW + 3] = total;
  }
  const bool has0 = x0 < total && excl <= x0 && x0 < excl + local;  // one thread each: the one whose
  const bool has1 = x1 < total && excl <= x1 && x1 < excl + local;  // requests hold the boundary
  if (has0 || has1) {
    int c = excl;
#pragma unroll 1
    for (int i = i0; i < i1; ++i) {
      int len;
      const int w = REQ_COST + request_pairs(a, i, last_row, len);
      if (has0 && c <= x0 && x0 < c + w) {
        const int s0 = snap_boundary(x0, c, w, snap_chunk);
        sched[NW + 2] = s0;
        sched[NW] = s0 == c + w ? i + 1 : i;  // first request of the CTA and its cost start
        sched[NW + 1] = s0 == c + w ? c + w : c;
      }
      if (has1 && c <= x1 && x1 < c + w) sched[NW + 3] = snap_boundary(x1, c, w, snap_chunk);
      c += w;
    }
  }
  __syncthreads();
}

template <int NT>
GQADRV_DEVICE BalancedWalker balanced_walker(const int* sched, int p, int slot_base) {
  constexpr int NW = NT / 32;
  BalancedWalker wk;
  wk.req = sched[NW];
  wk.cost0 = sched[NW + 1];
  wk.start = sched + NW;
  wk.p = p;
  wk.slot_base = slot_base;
  return wk;
}

}  // namespace mla
