"""Host-side description of the tcgen05 GQA decode kernels (sm_100a B200, sm_110a Thor).

The kernels live in ``kernels/gqa/sm100/decode_tc_{long,short}.cu`` and share their decode core with
``kernels/gqa/common/tc_core.cuh`` (on the op-neutral wrappers of ``kernels/common/tcgen05.cuh``). They are compile-verified only (NVRTC + ptxas resource checks in
``tests/test_tcgen05_static.py``): no sm_100/sm_110 GPU was available, they have never executed.

This module has no dependency on ``gqadrv.gqa.routes`` (the route registry imports it, not the other
way round); the split and group limits come from ``gqadrv.gqa.contract``. Everything here mirrors a compile-time constant of the kernels; the kernels check the
shared-memory size against ``GQA_TC_SMEM`` (passed by :func:`tc_defines`) with a ``static_assert``.

* One CTA = one (batch, KV head, split); grid ``B*Hkv*S``, ``blockIdx.x = bh*S + split``.
* Sub-tiles of ``TC_TOK`` = 128 tokens (M of the QK MMA); the KV tensor map box is
  ``{64, 128, 1, 1}`` over ``[2B, Hkv, C, D]`` (innermost first ``{D, C, Hkv, 2B}``), 128B swizzle.
* tc_long: 192 threads (4 softmax warps, 1 MMA warp, 1 TMA warp), a ring of ``stages`` slots of one
  K or V sub-tile each. tc_short: 160 threads (4 softmax warps, 1 MMA warp), plain loads, no ring.
"""

from __future__ import annotations

from .contract import MAX_GROUP as _MAX_GROUP
from .contract import MAX_SPLITS as _MAX_SPLITS
from .contract import STATE_ROW_PAD

__all__ = [
    "TC_ENTRY",
    "TC_FAMILIES",
    "TC_NUM_QK_HEADS",
    "TC_SOURCE",
    "TC_TILINGS",
    "TC_TMEM_COLUMNS",
    "TC_TOK",
    "tc_defines",
    "tc_dynamic_smem",
    "tc_kv_box",
    "tc_uses_tma",
]

TC_FAMILIES = ("tc_short", "tc_long")
TC_ENTRY = {"tc_short": "gqa_decode_tc_short", "tc_long": "gqa_decode_tc_long"}
TC_SOURCE = {"tc_short": "gqa/sm100/decode_tc_short.cu", "tc_long": "gqa/sm100/decode_tc_long.cu"}

TC_TOK = 128            # tokens per sub-tile (tc::TOK)
TC_NUM_QK_HEADS = 16    # N of both MMAs (tc::NH): query heads of a group, zero-padded
TC_TMEM_COLUMNS = 64    # tc::TMEM_COLS, allocated and freed by every CTA
_THREADS = {"tc_short": 160, "tc_long": 192}

# (family, head_dim) -> (threads, tok, stages). tc_long stages = ring slots of ONE K or V sub-tile
# (128 * D * 2 bytes): D=64 6 x 16 KiB, D=128 3 x 32 KiB (both ~100 KiB: two CTAs per SM),
# D=256 3 x 64 KiB (~205 KiB, one CTA per SM).
TC_TILINGS: dict[tuple[str, int], tuple[int, int, int]] = {
    ("tc_short", 64): (160, TC_TOK, 1),
    ("tc_short", 128): (160, TC_TOK, 1),
    ("tc_short", 256): (160, TC_TOK, 1),
    ("tc_long", 64): (192, TC_TOK, 6),
    ("tc_long", 128): (192, TC_TOK, 3),
    ("tc_long", 256): (192, TC_TOK, 3),
}


def _check(family_name: str, head_dim: int, rows: int, tok: int, stages: int) -> None:
    if family_name not in TC_ENTRY:
        raise ValueError(f"unknown tcgen05 family {family_name!r}; expected one of {TC_FAMILIES}")
    if head_dim not in (64, 128, 256):
        raise ValueError(f"head_dim {head_dim} is not supported by {family_name}; supported: 64, 128, 256")
    if rows not in (8, 16):
        raise ValueError(f"rows must be 8 or 16, got {rows}")
    if tok != TC_TOK:
        raise ValueError(f"{family_name} sub-tiles are {TC_TOK} tokens (M of the QK MMA), got tok={tok}")
    if family_name == "tc_long" and stages < 2:
        raise ValueError(f"tc_long needs at least 2 ring stages, got {stages}")


def tc_dynamic_smem(family_name: str, head_dim: int, rows: int, tok: int, stages: int) -> int:
    """Exact dynamic shared memory (bytes) of a tcgen05 kernel variant (the kernel's SMEM_BYTES).

    Operand buffers (all 1024-byte aligned, 128B-swizzled): K/V sub-tiles of ``tok*D*2`` bytes
    (tc_long: ``stages`` ring slots; tc_short: one K and one V tile), Q (16 rows x D) and P^T
    (16 heads x tok). After the last P.V the operand bytes are reused for the merge area (one softmax
    state: ``rows*2 + rows*(D+8)`` fp32) and the split-merge scratch ``(3*64*16+16)*4`` bytes, which
    always fit inside the K/V region, so they add nothing.
    """
    _check(family_name, head_dim, rows, tok, stages)
    tile = tok * head_dim * 2
    kv = stages * tile if family_name == "tc_long" else 2 * tile
    q = TC_NUM_QK_HEADS * head_dim * 2
    p = TC_NUM_QK_HEADS * tok * 2
    merge = max((rows * 2 + rows * (head_dim + STATE_ROW_PAD)) * 4, (3 * _MAX_SPLITS * _MAX_GROUP + _MAX_GROUP) * 4)
    if merge > kv:  # the kernels static_assert the same
        raise ValueError(f"{family_name}: merge area ({merge} B) does not fit the K/V buffers ({kv} B)")
    return kv + q + p


def tc_defines(family_name: str, dtype_code: int, head_dim: int, rows: int, tok: int, stages: int) -> dict:
    """Macros to compile a tcgen05 variant with (GQADRV_ARCH is added by the compiler)."""
    _check(family_name, head_dim, rows, tok, stages)
    if dtype_code not in (0, 1):
        raise ValueError(f"dtype_code must be 0 (fp16) or 1 (bf16), got {dtype_code}")
    return {
        "GQA_DT": dtype_code,
        "GQA_D": head_dim,
        "GQA_ROWS": rows,
        "GQA_WARPS": _THREADS[family_name] // 32,
        "GQA_TOK": tok,
        "GQA_STAGES": stages,
        "GQA_TC_SMEM": tc_dynamic_smem(family_name, head_dim, rows, tok, stages),
    }


def tc_uses_tma(family_name: str) -> bool:
    """tc_long takes the KV tensor map (signature (TmaDesc, GqaArgs)); tc_short takes GqaArgs only."""
    return family_name == "tc_long"


def tc_kv_box(family_name: str, head_dim: int) -> tuple[int, int, int, int]:
    """TMA box (innermost first) the tc_long kernel expects for the KV tensor map: {64, TOK, 1, 1}."""
    if not tc_uses_tma(family_name):
        raise ValueError(f"{family_name} does not use a tensor map")
    return (64, TC_TILINGS[(family_name, head_dim)][1], 1, 1)
