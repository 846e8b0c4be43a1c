"""Host mirror of the paged GQA kernel's argument block (kernels/gqa/common/paged_args.cuh:
struct GqaPagedArgs). Field names, order and C types match the header; a CPU test parses the
header and compares every name and offset (tests/gqa/test_paged_host.py)."""

from __future__ import annotations

from ..runtime.module import TMAP, NamedStruct, Signature

__all__ = ["GQA_PAGED_ARGS", "GQA_PAGED_FLAG_HND", "GQA_PAGED_FLAG_SPEC", "GQA_PAGED_NEXT_SHIFT", "SIG_PAGED",
           "SIG_PAGED_TMA"]

GQA_PAGED_ARGS = NamedStruct(
    "GqaPagedArgs",
    ("q", "Q"),            # const u16* [B, s_q, Hq, D]
    ("k", "Q"),            # const u16* K pool
    ("v", "Q"),            # const u16* V pool (same strides)
    ("out", "Q"),          # u16* [B, s_q, Hq, D]
    ("lse", "Q"),          # float* [B, s_q, Hq] or null
    ("lengths", "Q"),      # const i32* [B]
    ("table", "Q"),        # const i32* [B, table_stride] or null (contiguous cache)
    ("ws_o", "Q"),         # float* [units, S, ROWS, D]
    ("ws_ml", "Q"),        # float* [units, S, ROWS, 2]
    ("counters", "Q"),     # u32* [units]
    ("status", "Q"),       # u32* [B, 1 + S] or null
    ("page_stride", "q"),  # elements
    ("tok_stride", "q"),
    ("head_stride", "q"),
    ("scale_log2", "f"),
    ("hkv", "i"),
    ("group", "i"),
    ("s_q", "i"),
    ("rows", "i"),
    ("row_blocks", "i"),
    ("page_shift", "i"),
    ("num_pages", "i"),
    ("table_stride", "i"),
    ("capacity", "i"),
    ("num_splits", "i"),
    ("split_subs", "i"),
    ("flags", "i"),
    ("k_scale", "Q"),        # const float* or null (e4m3 caches)
    ("v_scale", "Q"),
    ("k_scale_value", "f"),
    ("v_scale_value", "f"),
    ("k_scale_stride", "i"),  # 0: per tensor, 1: per KV head
    ("v_scale_stride", "i"),
    ("units", "i"),           # B * hkv * row_blocks
)

GQA_PAGED_FLAG_HND = 4  # TMA maps in HND order (D, page, Hkv, pages)
GQA_PAGED_FLAG_SPEC = 8  # TMA kernel: ring filled before the length is known (paged.speculates)
GQA_PAGED_NEXT_SHIFT = 16  # flags bits 16..31: successor stride of GQA_PAGED_NEXT builds (paged.successor_stride)

SIG_PAGED = Signature(("args", GQA_PAGED_ARGS))
SIG_PAGED_TMA = Signature(("k_map", TMAP), ("v_map", TMAP), ("args", GQA_PAGED_ARGS))
