// gqadrv — online-softmax state pieces shared by every attention kernel family.
//
// A softmax state of one query row is (m, l, o[0..D)): the running maximum of the scaled scores in
// the log2 domain, the denominator sum_t 2^(s_t - m) and the numerators sum_t 2^(s_t - m) v_t[d].
// An empty state (no token yet) is m = -inf, l = 0, o = 0. Two states of the same row combine as
//   M = max(m_a, m_b), w_x = 2^(m_x - M):  l = w_a l_a + w_b l_b,  o = w_a o_a + w_b o_b
// (softmax_weight gives w_x, and 0 for an empty side). The final output is o / l.
//
//   StateLayout<D>   row stride of the numerators of one state in shared memory,
//   MergeArea        the shared-memory layout of W such states of ROWS rows each (e.g. one per warp
//                    of a CTA), which a CTA epilogue merges,
//   ItemState        the state of one (row, 8 dims) item held in registers by one thread, and
//   combine_states   the rule above for it.
#pragma once
#include "ptx.cuh"

// Weight 2^(m - m_ref) of a state with maximum m under the common maximum m_ref (log2 domain):
// 0 for an empty state (m = -inf) when m_ref is finite.
GQADRV_DEVICE float softmax_weight(float m, float m_ref) { return fast_exp2(m - m_ref); }

// Row stride (floats) of the states' numerators in a merge area (MergeArea below; mirrored on the
// host, e.g. STATE_ROW_PAD in gqadrv/gqa/contract.py): rows stay 32-byte aligned, so the merge reads
// 8 floats with two 128-bit loads, and the 8 extra floats put consecutive rows 8 banks apart, so the
// fragment-order 64-bit writes of an mma.sync accumulator (WarpDecoder::store_state) are
// conflict-free within each half-warp.
template <int D>
struct StateLayout {
  static constexpr int STRIDE = D + 8;
};

// Shared-memory layout of W softmax states: {m, l} per (state, row), then ROWS rows of D numerators
// per state with the row stride of StateLayout (16-byte aligned: `base` must be too).
template <int D, int ROWS, int W>
struct MergeArea {
  static constexpr int STRIDE = StateLayout<D>::STRIDE;
  static constexpr int ML_FLOATS = W * ROWS * 2;
  static constexpr int OS_FLOATS = W * ROWS * STRIDE;
  static constexpr int BYTES = (ML_FLOATS + OS_FLOATS) * 4;
  static_assert(ML_FLOATS % 4 == 0 && STRIDE % 8 == 0, "16-byte aligned state rows");
  static GQADRV_DEVICE float* ml(u8* base, int warp) {
    return reinterpret_cast<float*>(base) + warp * ROWS * 2;
  }
  static GQADRV_DEVICE float* os(u8* base, int warp) {
    return reinterpret_cast<float*>(base) + ML_FLOATS + warp * ROWS * STRIDE;
  }
};

// Softmax state of one (row, 8 dims) item: running max (log2 domain), denominator, 8 numerators.
struct ItemState {
  float m, l, v[8];
};

// Combine two states of the same item (either may be empty: m == -inf, l == 0, v == 0).
GQADRV_DEVICE void combine_states(ItemState& a, const ItemState& b) {
  const float mn = fmaxf(a.m, b.m);
  if (mn == neg_inf()) return;  // both empty
  const float wa = softmax_weight(a.m, mn), wb = softmax_weight(b.m, mn);  // 0 for an empty side
  a.m = mn;
  a.l = wa * a.l + wb * b.l;
#pragma unroll
  for (int i = 0; i < 8; ++i) a.v[i] = wa * a.v[i] + wb * b.v[i];
}
