"""Host mirror of the GQA kernels' argument block (kernels/gqa/common/args.cuh: struct GqaArgs).

Field names, order and C types match the header; ``tests/gqa/test_gqa_host.py`` parses the header
and compares every name and offset. Every GQA kernel takes ``(GqaArgs)`` or
``(CUtensorMap kv_map, GqaArgs)``. Launches pack it once and patch single fields by name
(``ArgPack.set_field("args.out", ptr)``).
"""

from __future__ import annotations

from ..runtime.module import TMAP, NamedStruct, Signature

__all__ = ["GQA_ARGS", "GQA_FLAG_L2_EVICT_FIRST", "GQA_FLAG_L2_PREFETCH", "SIG_PLAIN", "SIG_TMA"]

GQA_ARGS = NamedStruct(
    "GqaArgs",
    ("q", "Q"),           # const u16* [B, Hq, D]
    ("kv", "Q"),          # const u16* [B, 2, Hkv, C, D]
    ("out", "Q"),         # u16* [B, Hq, D]
    ("lengths", "Q"),     # const i32* [B]
    ("ws_o", "Q"),        # float* [B*Hkv, S, group, D] split partial numerators (splits > 1)
    ("ws_ml", "Q"),       # float* [B*Hkv, S, group, 2] {max (log2 domain), denominator}
    ("counters", "Q"),    # u32* [B*Hkv] arrival tickets, zero between launches
    ("status", "Q"),      # u32* [B] or null: 0 ok, 1 length <= 0, 2 length > capacity
    ("scale_log2", "f"),  # sm_scale / ln 2 (sm_scale = q_scale / sqrt(D) when q_scale is given)
    ("hkv", "i"),
    ("group", "i"),
    ("capacity", "i"),
    ("num_splits", "i"),
    ("flags", "i"),       # GQA_FLAG_* bits
)
GQA_FLAG_L2_EVICT_FIRST = 1
GQA_FLAG_L2_PREFETCH = 2

SIG_TMA = Signature(("kv_map", TMAP), ("args", GQA_ARGS))
SIG_PLAIN = Signature(("args", GQA_ARGS))
