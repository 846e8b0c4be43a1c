// gqadrv — the TMA 128-byte swizzle of shared-memory tiles, shared by every kernel family.
//
// A tile of `rows` rows is stored as 128-byte-wide boxes (64 16-bit elements per row and box), the
// layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B: box b holds 16-byte chunks 8b..8b+7 of every
// row, and chunk c of row r sits at chunk position (c & 7) ^ (r & 7) of its 128-byte box row. Each
// 8-row group of a box is one 1024-byte swizzle atom, so tiles start on 1024-byte boundaries. The
// same layout is the canonical SWIZZLE_128B K-major / MN-major operand of wgmma and tcgen05.mma
// (common/tcgen05.cuh, shared-memory descriptor), and copies written by hand (cp.async, st.shared)
// use swizzled_chunk_offset to produce it.
#pragma once
#include "ptx.cuh"

// Byte offset of 16-byte chunk `c` of row `r` in a tile of `rows` rows (layout above).
GQADRV_DEVICE u32 swizzled_chunk_offset(int rows, int r, int c) {
  return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A shared-memory tile (or a slot of several tiles, e.g. K then V of one sub-tile) in the layout
// above, as consumers read it; `base` is the generic address of the first box.
struct SwizzledSmemChunks {
  const u8* base;  // 1024-byte aligned
};
