"""Host-side mirror of the MLA dense decode kernels (kernels/mla/sm90/dense_decode*.cu).

Everything the host needs to build, size and launch each kernel variant, with no GPU access and no
imports outside the standard library (``gqadrv.runtime`` is imported lazily, only by ``signature()``):

* ``FIELDS`` / ``FORMAT``: the by-value ``MlaDecodeArgs`` struct (kernels/mla/common/args.cuh), in
  order, with explicit padding; ``pack_args(**values)`` gives the tuple for ``ArgPack.pack``. Every
  variant takes the same struct as its only parameter.
* ``KERNELS``: one ``KernelVariant`` per variant (source, entry, threads, rows per CTA, dynamic shared
  memory, fixed defines, arches, the M range it is meant for); ``kernel(name)`` looks one up.
* Per-variant helpers (``variant`` keyword, default the original "wgmma" kernel so that callers
  written for the single-kernel API keep working): ``defines(dtype, variant)``,
  ``dynamic_smem_bytes(variant=...)``, ``num_m_blocks(...)``, ``launch_geometry(...)``,
  ``workspace_sizes(...)``, ``choose_num_splits(...)``.
* ``choose_variant(s_q, h_q, h_kv, arch)``: the suggested variant for a shape.

Variants (all read the same arguments, write the same outputs and merge splits in-kernel):
  "seesaw"    sm_90a, wgmma; 64 packed rows per CTA, 384 threads: two consumer warpgroups splitting
              the 512 output columns (FlashMLA-style seesaw schedule) and a producer warpgroup issuing
              cp.async into two 72 KB K slots (mbarriers, setmaxnreg 224 / 56). For M > 32 packed rows
              per KV head (compute-bound at h_q 64 / 128).
  "seesaw_tma" the seesaw schedule with every K half tile loaded by one TMA from one producer thread
              (no proxy fences; rows past the split's end zeroed by the consumers); pages of 64..256 tokens
              whose k_cache a CUtensorMap can describe (``tma_eligible``). The H200 default for those.
  "narrow16_tma" / "narrow32_tma" the narrow kernels with every piece loaded by TMA from one producer
              thread (same page / layout conditions).
  "narrow16"  sm_90a, wgmma with the 64 tokens of a tile as M (S^T = K Q^T, O^T += V^T P^T); 16 rows
              per CTA, one consumer warpgroup + one producer warpgroup, a 25-piece (200 KB) cp.async ring.
              For M <= 16 (memory-bound, e.g. h_q 16 s_q 1).
  "narrow32"  the same with 32 rows per CTA (23-piece ring): 16 < M <= 32.
  "wgmma"     the original simple kernel (wgmma, MLA_MMA=1), any M; correct fallback.
  "mma"       the original kernel on mma.sync + ldmatrix (MLA_MMA=0); the only one for sm_100a.
  "narrow16_fp8" sm_90a, tokens as wgmma M on the 656-byte FP8 cache for M <= 16: the two consumer
              warpgroups convert the e4m3 codes straight into wgmma register fragments (f16, scales applied
              after Q K^T per 128-channel block and folded into V), a bulk-copy producer warpgroup.
  "wide64_fp8" sm_90a, the same tokens-as-M design for 64-row blocks (M > 16, e.g. h_q 64 / 128): both
              consumer warpgroups work on every tile and split the 512 latent channels (each converts its
              two scale blocks for both GEMMs; the S^T partials are summed through shared memory), a
              3-stage ring of 656-byte rows filled by the same bulk-copy producer warpgroup.
  "seesaw_fp8" / "mma_fp8"  the seesaw / the mma.sync kernel on FlashMLA's 656-byte FP8 cache (MLA_FP8=1,
              bf16 q): K tiles dequantized to bf16 into the same shared-memory tiles (fp8_rows.cuh); the
              seesaw_fp8 default on sm_90a, mma_fp8 on sm_100a / sm_110a (compile-verified only there).

``VARIANTS`` / ``VARIANT_ARCHES`` / ``SOURCE`` / ``ENTRY`` / ``BLOCK_THREADS`` / ``SMEM_BYTES`` keep
describing the original two-variant kernel (dense_decode.cu) for existing callers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from pathlib import Path

SOURCE = "mla/sm90/dense_decode.cu"  # relative to the kernels root (compile_module's `source`)
ARGS_HEADER = "mla/common/args.cuh"
ENTRY = "mla_dense_decode"
BLOCK_THREADS = 256
BLOCK_M = 64        # packed query rows (s_q x heads of one KV head) per CTA (original kernel)
BLOCK_N = 64        # tokens per K tile
D_QK = 576
D_V = 512
MAX_SPLITS = 512
PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256
FLAG_CAUSAL = 1
FLAG_MAX_LOGITS = 2  # the kernels also write max(softmax_scale q.k) per row at lse + max_offset
FLAG_NO_CUT = 4  # balanced grids: every request on one CTA (no partials; the sparse paths' short lists)
FLAG_SINK = 16  # the attention sink in the epilogue: out = O / (L + exp(sink) in the row's units) (sink_epilogue)
FLAG_KV_REUSE = 8  # cp.async seesaw: K rows kept in L2 (evict_last), Q first out (the sparse prefill's shared kv)
VARIANTS = {"wgmma": 1, "mma": 0}  # the original kernel's two builds (MLA_MMA value)
VARIANT_ARCHES = {"wgmma": ("sm_90a",), "mma": ("sm_90a", "sm_100a", "sm_110a")}  # 226 KB of smem: no sm_80/sm_120
DTYPES = {"float16": 0, "bfloat16": 1}
SMEM_LIMIT = 232448  # H100 / H200 / B200 opt-in dynamic shared memory per block (227 KB)

# (field, struct format char) in MlaDecodeArgs order. Q: pointer, q: int64, i: int32, f: float.
FIELDS = (
    ("q", "Q"),
    ("k_cache", "Q"),
    ("block_table", "Q"),
    ("cache_seqlens", "Q"),
    ("out", "Q"),
    ("lse", "Q"),
    ("ws_o", "Q"),
    ("ws_ml", "Q"),
    ("counters", "Q"),
    ("q_stride_b", "q"),
    ("q_stride_s", "q"),
    ("q_stride_h", "q"),
    ("k_stride_block", "q"),
    ("k_stride_tok", "q"),
    ("k_stride_head", "q"),
    ("o_stride_b", "q"),
    ("o_stride_s", "q"),
    ("o_stride_h", "q"),
    ("bt_stride", "q"),
    ("b", "i"),
    ("s_q", "i"),
    ("h_q", "i"),
    ("h_kv", "i"),
    ("group", "i"),
    ("m_rows", "i"),
    ("num_m_blocks", "i"),
    ("page_size", "i"),
    ("page_shift", "i"),
    ("max_blocks", "i"),
    ("num_splits", "i"),
    ("flags", "i"),
    ("scale_log2", "f"),
    ("max_offset", "i"),  # FLAG_MAX_LOGITS: elements from a row's lse to its max_logits
    ("sink", "Q"),        # FLAG_SINK: fp32 [h_q] attention sink folded into out's normaliser (else 0)
)
FORMAT = "<" + "".join(c for _, c in FIELDS)
ARGS_BYTES = struct.calcsize(FORMAT)
assert ARGS_BYTES % 8 == 0, ARGS_BYTES

# Shared-memory map of the original kernel (mirrors the constants in dense_decode.cu, which
# static_asserts against MLA_SMEM_BYTES): Q + 2 K stages (64 x 576 x 2 B each), P (64 x 64 x 2 B),
# 2 x 512 B exchanges, 16 B ticket, plus 1 KB so the kernel can round its base up to 1024 bytes.
_TILE_BYTES = BLOCK_N * D_QK * 2
_SMEM_USED = 3 * _TILE_BYTES + BLOCK_M * BLOCK_N * 2 + 512 + 512 + 16
SMEM_BYTES = _SMEM_USED + 1024  # 231440 (the H100/H200 opt-in limit is 232448)

# Seesaw map (dense_decode_seesaw.cu): Q + K0 + K1 (72 KB each; sP0 aliases K0's RoPE block), sP1
# 8 KB, sM / sScale0 / sScale1 (256 B each), lsum 512 B, 24 mbarriers (192 B), ticket 16 B, the
# balanced schedule's scan / start (80 B), won merges (48 B) and WG1's exact row maxima (256 B).
_SEESAW_USED = 3 * _TILE_BYTES + 8192 + 3 * 256 + 512 + 192 + 16 + 80 + 48 + 256
SEESAW_SMEM_BYTES = _SEESAW_USED + 1024  # 232272


def _narrow_used(nq: int, nslot: int) -> int:
    # Q (9 x nq x 128 B) + P (nq x 128 B) + ring (nslot x 8 KB) + red/lred (2 x 4 x nq x 4 B)
    # + (2 nslot + 2) mbarriers + ticket
    return 9 * nq * 128 + nq * 128 + nslot * 8192 + 2 * 4 * nq * 4 + 8 * (2 * nslot + 2) + 16


def _narrow2_used(nslot: int) -> int:
    # dense_decode_narrow2.cu: Q (9 x 16 x 128 B) + 2 P (16 x 128 B) + ring (nslot x 8 KB) + red / lred
    # (2 x 2 x 4 x 16 x 4 B) + xml (2 x 2 x 16 x 4 B) + sched 80 B + merges 32 B + (2 nslot + 2) mbarriers + ticket
    return 9 * 16 * 128 + 2 * 16 * 128 + nslot * 8192 + 2 * 2 * 4 * 16 * 4 + 2 * 2 * 16 * 4 + 80 + 32 + 8 * (2 * nslot + 2) + 16


def _ring_slots(used) -> int:
    """The most 8 KB ring slots n with used(n) + 1 KB alignment slack within the opt-in limit."""
    n = 0
    while used(n + 1) + 1024 <= SMEM_LIMIT:
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel family member (per dtype a separate module)."""

    name: str
    source: str             # path under the kernels root
    entry: str              # extern "C" kernel name
    threads: int            # block size (x)
    block_m: int            # packed query rows per CTA (workspace row block)
    smem_bytes: int         # dynamic shared memory per CTA (includes 1 KB alignment slack)
    fixed_defines: tuple    # ((name, value), ...) besides MLA_DT / MLA_SMEM_BYTES
    arches: tuple           # targets it compiles for
    max_rows: int | None    # largest M = s_q * h_q / h_kv it is meant for (None: any)
    doc: str = ""
    tma_boxes: tuple = ()   # TMA variants: channel blocks per box of each CUtensorMap parameter (k_tensor_maps)
    fp8: bool = False       # reads FlashMLA's 656-byte FP8 cache (MLA_FP8=1; bf16 q only)
    nope: bool = False      # d_qk 512 (MLA_NOPE=1: q / K rows of 512, no RoPE channels; sparse prefill)
    balanced: bool = False  # persistent balanced grid (MLA_BALANCED=1): num_splits = CTAs per (KV head, row block)

    @property
    def tma(self) -> bool:
        """Takes (CUtensorMap..., MlaDecodeArgs) and loads K by TMA (tma_eligible caches only)."""
        return bool(self.tma_boxes)

    def defines(self, dtype: str, watchdog: bool = False) -> dict:
        if self.fp8 and _dtype_name(dtype) != "bfloat16":
            raise ValueError(f"MLA variant {self.name!r} (FP8 cache) is built for bfloat16 q only, got {dtype!r}")
        d = {"MLA_DT": DTYPES[_dtype_name(dtype)], "MLA_SMEM_BYTES": self.smem_bytes, **dict(self.fixed_defines)}
        if watchdog:
            d["MLA_WATCHDOG"] = 1
        if os.environ.get("GQADRV_MLA_TRACE", "0") == "1":  # development only: tools/mla_trace.py
            d["MLA_TRACE"] = 1
        return d


# FP8 narrow map (dense_decode_narrow_fp8.cu): Q f16 16 KB + Q RoPE 2 KB + P^T 2 x 2 KB + the stages
# (64 token rows x 656 B) + red / ered / lred / qsc + 2 NARROW_FP8_STAGES mbarriers + ticket + wg_all flags.
NARROW_FP8_STAGES = 4
_NARROW_FP8_USED = 16384 + 2048 + 4096 + NARROW_FP8_STAGES * 64 * 656 + 512 + 32 + 512 + 64 + 16 * NARROW_FP8_STAGES + 16 + 32
NARROW_FP8_SMEM_BYTES = _NARROW_FP8_USED + 1024
# FP8 wide map (dense_decode_wide_fp8.cu): Q f16 64 KB + Q RoPE 8 KB + P' 8 KB + S^T exchange 16 KB +
# V f16 64 KB + the half stages (32 x 656 B) + red / ered / lred / qsc / alpha / lim / {m, L} / running
# max + 2 WIDE_FP8_STAGES mbarriers + ticket + wg_all flags.
WIDE_FP8_STAGES = 3
_WIDE_FP8_USED = (65536 + 8192 + 8192 + 16384 + 65536 + WIDE_FP8_STAGES * 32 * 656 + 1024 + 32 + 1024 + 3 * 256 + 512
                  + 512 + 16 * WIDE_FP8_STAGES + 16 + 32)
WIDE_FP8_SMEM_BYTES = _WIDE_FP8_USED + 1024
_N16, _N32, _N2 = (_ring_slots(lambda n: _narrow_used(16, n)), _ring_slots(lambda n: _narrow_used(32, n)),
                   _ring_slots(_narrow2_used))
KERNELS = {
    "seesaw": KernelVariant(
        "seesaw", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw", 384, 64, SEESAW_SMEM_BYTES,
        (), ("sm_90a",), None, "two consumer warpgroups + a cp.async producer warpgroup, seesaw schedule; M > 32"),
    "seesaw_tma": KernelVariant(
        "seesaw_tma", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw_tma", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_TMA_K", 1),), ("sm_90a",), None,
        "the seesaw schedule with K half tiles by TMA from one producer thread; pages of 64..256 tokens",
        tma_boxes=(4, 5)),
    "seesaw_bal": KernelVariant(
        "seesaw_bal", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw_tma", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_TMA_K", 1), ("MLA_BALANCED", 1), ("MLA_PARTIAL_L2", 1)), ("sm_90a",), None,
        "seesaw_tma on a persistent grid of about one CTA per SM: whole requests per CTA when the lengths are "
        "near uniform, else an equal share of all requests' pairs of tiles (work_items.cuh); split partials "
        "kept in L2 until merged (MLA_PARTIAL_L2)",
        tma_boxes=(4, 5), balanced=True),
    "seesaw_bal_cp": KernelVariant(
        "seesaw_bal_cp", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_BALANCED", 1), ("MLA_PARTIAL_L2", 1)), ("sm_90a",), None,
        "the cp.async seesaw on the balanced persistent grid (work_items.cuh): pages of 1..32 tokens or layouts a "
        "tensor map cannot describe at large batch, and the sparse paths' gathered lists (MLA_FLAG_NO_CUT: whole "
        "requests only, no partials)", balanced=True),
    "seesaw_nope_bal": KernelVariant(
        "seesaw_nope_bal", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_NOPE", 1), ("MLA_BALANCED", 1), ("MLA_PARTIAL_L2", 1)), ("sm_90a",), None,
        "seesaw_nope on the balanced persistent grid (the d_qk 512 sparse prefill's many short requests)",
        nope=True, balanced=True),
    "narrow16": KernelVariant(
        "narrow16", "mla/sm90/dense_decode_narrow.cu", "mla_dense_decode_narrow", 256, 16,
        _narrow_used(16, _N16) + 1024, (("MLA_NQ", 16), ("MLA_NSLOT", _N16)), ("sm_90a",), 16,
        "tokens as wgmma M, producer warpgroup + piece ring; memory-bound M <= 16"),
    "narrow32": KernelVariant(
        "narrow32", "mla/sm90/dense_decode_narrow.cu", "mla_dense_decode_narrow", 256, 32,
        _narrow_used(32, _N32) + 1024, (("MLA_NQ", 32), ("MLA_NSLOT", _N32)), ("sm_90a",), 32,
        "as narrow16 with 32 rows per CTA; 16 < M <= 32"),
    "narrow16_tma": KernelVariant(
        "narrow16_tma", "mla/sm90/dense_decode_narrow.cu", "mla_dense_decode_narrow_tma", 256, 16,
        _narrow_used(16, _N16) + 1024, (("MLA_NQ", 16), ("MLA_NSLOT", _N16), ("MLA_TMA_K", 1)), ("sm_90a",), 16,
        "narrow16 with every piece loaded by TMA from one producer thread; pages of 64..256 tokens",
        tma_boxes=(1,)),
    "narrow32_tma": KernelVariant(
        "narrow32_tma", "mla/sm90/dense_decode_narrow.cu", "mla_dense_decode_narrow_tma", 256, 32,
        _narrow_used(32, _N32) + 1024, (("MLA_NQ", 32), ("MLA_NSLOT", _N32), ("MLA_TMA_K", 1)), ("sm_90a",), 32,
        "narrow32 with every piece loaded by TMA from one producer thread; pages of 64..256 tokens",
        tma_boxes=(1,)),
    "narrow16x2_tma": KernelVariant(
        "narrow16x2_tma", "mla/sm90/dense_decode_narrow2.cu", "mla_dense_decode_narrow2_tma", 384, 16,
        _narrow2_used(_N2) + 1024, (("MLA_NQ", 16), ("MLA_NSLOT", _N2)), ("sm_90a",), 16,
        "tokens as wgmma M with two consumer warpgroups on alternate tiles and a TMA piece ring; M <= 16, "
        "pages of 64..256 tokens", tma_boxes=(1,)),
    "narrow16_bal": KernelVariant(
        "narrow16_bal", "mla/sm90/dense_decode_narrow2.cu", "mla_dense_decode_narrow2_tma", 384, 16,
        _narrow2_used(_N2) + 1024, (("MLA_NQ", 16), ("MLA_NSLOT", _N2), ("MLA_BALANCED", 1), ("MLA_PARTIAL_L2", 1),
                                    ("MLA_WHOLE_MODE", 0)),
        ("sm_90a",), 16, "narrow16x2_tma on the balanced persistent grid (work_items.cuh), every request's share cut "
        "evenly over the CTAs (MLA_WHOLE_MODE 0), split partials kept in L2 until merged (MLA_PARTIAL_L2); M <= 16",
        tma_boxes=(1,), balanced=True),
    "narrow16_fp8": KernelVariant(
        "narrow16_fp8", "mla/sm90/dense_decode_narrow_fp8.cu", "mla_dense_decode_narrow_fp8", 384, 16,
        NARROW_FP8_SMEM_BYTES, (("MLA_NSTAGE", NARROW_FP8_STAGES),), ("sm_90a",), 16,
        "tokens as wgmma M on the 656-byte FP8 cache: two consumer warpgroups dequantize the codes into wgmma "
        "register fragments (no shared-memory tile of bf16), a bulk-copy producer warp; M <= 16", fp8=True),
    "wide64_fp8": KernelVariant(
        "wide64_fp8", "mla/sm90/dense_decode_wide_fp8.cu", "mla_dense_decode_wide_fp8", 384, 64,
        WIDE_FP8_SMEM_BYTES, (("MLA_NSTAGE", WIDE_FP8_STAGES),), ("sm_90a",), None,
        "tokens as wgmma M on the 656-byte FP8 cache for 64-row blocks: both consumer warpgroups dequantize "
        "their half of the channels into wgmma register fragments, a bulk-copy producer warpgroup; M > 16",
        fp8=True),
    "seesaw_fp8": KernelVariant(
        "seesaw_fp8", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw_fp8", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_FP8", 1),), ("sm_90a",), None,
        "the seesaw on the 656-byte FP8 cache: the producer warpgroup dequantizes half tiles through registers",
        fp8=True),
    "seesaw_nope": KernelVariant(
        "seesaw_nope", "mla/sm90/dense_decode_seesaw.cu", "mla_dense_decode_seesaw", 384, 64, SEESAW_SMEM_BYTES,
        (("MLA_NOPE", 1),), ("sm_90a",), None,
        "the cp.async seesaw on 512-channel q / K rows (d_qk 512: block 8 zero-filled)", nope=True),
    "wgmma": KernelVariant(
        "wgmma", SOURCE, ENTRY, BLOCK_THREADS, BLOCK_M, SMEM_BYTES, (("MLA_MMA", 1),), ("sm_90a",), None,
        "original kernel, wgmma, no overlap between phases"),
    "mma": KernelVariant(
        "mma", SOURCE, ENTRY, BLOCK_THREADS, BLOCK_M, SMEM_BYTES, (("MLA_MMA", 0),), ("sm_90a", "sm_100a", "sm_110a"), None,
        "original kernel on mma.sync + ldmatrix (sm_100a fallback)"),
    "mma_fp8": KernelVariant(
        "mma_fp8", SOURCE, ENTRY, BLOCK_THREADS, BLOCK_M, SMEM_BYTES, (("MLA_MMA", 0), ("MLA_FP8", 1)),
        ("sm_90a", "sm_100a", "sm_110a"), None,
        "the mma.sync kernel on the 656-byte FP8 cache (every thread dequantizes its share of the next tile)",
        fp8=True),
    "mma_nope": KernelVariant(
        "mma_nope", SOURCE, ENTRY, BLOCK_THREADS, BLOCK_M, SMEM_BYTES, (("MLA_MMA", 0), ("MLA_NOPE", 1)),
        ("sm_90a", "sm_100a", "sm_110a"), None,
        "the mma.sync kernel on 512-channel q / K rows (d_qk 512: block 8 zero-filled)", nope=True),
}
assert all(v.smem_bytes <= SMEM_LIMIT for v in KERNELS.values()), {k: v.smem_bytes for k, v in KERNELS.items()}


# Schedule experiments (kernels/mla/common/work_items.cuh's MLA_SNAP_SHIFT / MLA_WHOLE_SLACK_SHIFT /
# MLA_WHOLE_MODE): the balanced variants built with other schedule constants, registered only when the
# process starts with GQADRV_MLA_EXPERIMENTS=1, so that the bench can time them beside the default in the
# same run (``bench --op mla --mla-also seesaw_bal_snap32 ...``). Never routed; forced by name only.
# suffix -> (snap shift, whole-mode slack shift, whole mode): chunk / 8 snapping (the default before
# 2026-12-05), chunk / 16 with the whole mode at even / 8, chunk / 32 with even / 16, chunk / 32 cuts
# always; "whole": the two-mode rule with chunk / 32 and even / 4 (seesaw_bal's default, and narrow16_bal's until
# 2026-12-05 evening, when narrow16_bal switched to cuts always: 1-4 % faster on the H200's uniform h_q 16 rows
# with the partials kept in L2, docs/MLA.md).
SCHEDULE_EXPERIMENTS = {"snap8": (3, 2, 1), "snap16": (4, 3, 1), "snap32": (5, 4, 1), "cut32": (5, 4, 0),
                        "whole": (5, 2, 1)}
EXPERIMENTS_ENV = "GQADRV_MLA_EXPERIMENTS"
DEFAULT_VARIANTS = tuple(KERNELS.values())  # the variants experiments are derived from (never experiments)


def _derived(base: KernelVariant, suffix: str, what: str, extra: tuple) -> tuple[str, KernelVariant]:
    """(name, variant): ``base`` built with the ``extra`` defines (replacing base defines of the same
    names), named ``<base>_<suffix>`` (an experiment, registered only under GQADRV_MLA_EXPERIMENTS=1)."""
    name = f"{base.name}_{suffix}"
    names = {n for n, _ in extra}
    return name, dataclasses.replace(base, name=name, doc=f"{base.name} with {what} (experiment, {EXPERIMENTS_ENV}=1)",
                                     fixed_defines=tuple(d for d in base.fixed_defines if d[0] not in names) + extra)


def schedule_experiments() -> dict:
    """The experiment variants (name -> KernelVariant) derived from every balanced TMA variant."""
    return dict(_derived(base, suffix, f"snap shift {snap}, whole slack shift {slack}, whole mode {whole} (schedule)",
                         (("MLA_SNAP_SHIFT", snap), ("MLA_WHOLE_SLACK_SHIFT", slack), ("MLA_WHOLE_MODE", whole)))
                for base in DEFAULT_VARIANTS if base.balanced and base.tma_boxes
                for suffix, (snap, slack, whole) in SCHEDULE_EXPERIMENTS.items())


def l2_experiments() -> dict:
    """``<variant>_ef`` for every variant whose K tiles arrive by TMA (the TMA seesaw and narrow kernels,
    split and balanced grids): the same build with MLA_K_EVICT_FIRST=1 (an L2 evict-first policy on
    the K loads, as FlashMLA's; experiment, {EXPERIMENTS_ENV}=1)."""
    return dict(_derived(base, "ef", "an L2 evict-first policy on the K loads", (("MLA_K_EVICT_FIRST", 1),))
                for base in DEFAULT_VARIANTS if base.tma_boxes)


def partial_l2_experiments(schedule: dict) -> dict:
    """``<variant>_nopl2`` for every balanced TMA variant and for its ``_cut32`` schedule experiment: the same
    build with MLA_PARTIAL_L2=0, i.e. split partials stored and read without cache hints and left to be
    written back (the default until 2026-12-05; the balanced variants keep partials in L2 until merged
    since then, 1.5-4.5 % faster on rows with cut requests, docs/RESULTS.md; experiment,
    GQADRV_MLA_EXPERIMENTS=1)."""
    bases = [k for k in DEFAULT_VARIANTS if k.balanced and k.tma_boxes] + [v for n, v in schedule.items() if n.endswith("_cut32")]
    return dict(_derived(base, "nopl2", "MLA_PARTIAL_L2=0 (partials through DRAM)", (("MLA_PARTIAL_L2", 0),))
                for base in bases)


def arrive_handoff_experiments() -> dict:
    """``seesaw_bal_arrive`` / ``seesaw_bal_arrive1``: seesaw_bal whose scale hand-offs between the consumer
    warpgroups keep the writer's ``bar.arrive`` (MLA_SYNC_HANDOFF=0: SCALE0 and SCALE1; 1: SCALE0 only) instead
    of the default full syncs; same values, bit-identical outputs; for compute-sanitizer racecheck and timing
    comparisons (the default until 2026-12-06; experiment, GQADRV_MLA_EXPERIMENTS=1)."""
    return dict(_derived(KERNELS["seesaw_bal"], suffix, f"writer-side bar.arrive on {what}",
                         (("MLA_SYNC_HANDOFF", level),))
                for level, suffix, what in ((0, "arrive", "SCALE0 and SCALE1"), (1, "arrive1", "SCALE0")))


def out_st4_experiments() -> dict:
    """``<variant>_st4`` for the seesaw's TMA and cp.async balanced builds: the out rows stored as before
    2026-12-06, one 4-byte store per pair of channels (MLA_OUT_V16=0), instead of the default 16-byte chunks
    after a transpose inside each quad (decode_util.cuh store_row_v16); bit-identical outputs, for timing
    comparisons (experiment, GQADRV_MLA_EXPERIMENTS=1)."""
    return dict(_derived(KERNELS[name], "st4", "4-byte out stores (MLA_OUT_V16=0)", (("MLA_OUT_V16", 0),))
                for name in ("seesaw_bal", "seesaw_bal_cp", "seesaw_nope_bal"))


def prefill_experiments() -> dict:
    """The cp.async balanced seesaw builds without one of the sparse prefill's 2026-12-06 changes, for timing
    comparisons (experiment, GQADRV_MLA_EXPERIMENTS=1): ``<variant>_xmax`` keeps the exact running max on
    MLA_FLAG_MAX_LOGITS launches (MLA_MAXLOG_LAZY=0: every pair whose max moves rescales O, as before),
    ``<variant>_nohint`` issues the K / Q copies without L2 policies or the 256-byte prefetch
    (MLA_KV_HINT=0), ``<variant>_oef`` stores the out rows with an L2 evict_first policy (MLA_OUT_EVICT_FIRST=1:
    the 268-537 MB of out leave the kv rows in L2), ``<variant>_bt0`` reads the producer's block-table entries
    (the gathered indices) just before their copies (MLA_BT_AHEAD=0; the default until 2026-12-06, 3.5-4 %
    slower on the stable prefill rows, docs/RESULTS.md), and ``seesaw_nope_bal_nb9`` loads zeros into channel
    block 8 and multiplies it (MLA_NOPE_SKIP=0)."""
    table = [(name, "xmax", "the exact running max with max_logits (MLA_MAXLOG_LAZY=0)", (("MLA_MAXLOG_LAZY", 0),))
             for name in ("seesaw_bal_cp", "seesaw_nope_bal")]
    table += [(name, "nohint", "K / Q copies without L2 hints (MLA_KV_HINT=0)", (("MLA_KV_HINT", 0),))
              for name in ("seesaw_bal_cp", "seesaw_nope_bal")]
    table += [(name, "oef", "out stores with an L2 evict_first policy (MLA_OUT_EVICT_FIRST=1)",
               (("MLA_OUT_EVICT_FIRST", 1),)) for name in ("seesaw_bal_cp", "seesaw_nope_bal")]
    table += [(name, "bt0", "block-table entries read just before their copies (MLA_BT_AHEAD=0)",
               (("MLA_BT_AHEAD", 0),)) for name in ("seesaw_bal_cp", "seesaw_nope_bal")]
    table.append(("seesaw_nope_bal", "nb9", "channel block 8 zero-filled and multiplied (MLA_NOPE_SKIP=0)",
                  (("MLA_NOPE_SKIP", 0),)))
    return dict(_derived(KERNELS[name], suffix, what, extra) for name, suffix, what, extra in table)


if os.environ.get(EXPERIMENTS_ENV) == "1":
    KERNELS.update(out_st4_experiments())
    KERNELS.update(prefill_experiments())
    KERNELS.update(arrive_handoff_experiments())
    _schedule = schedule_experiments()
    KERNELS.update(_schedule)
    KERNELS.update(l2_experiments())
    KERNELS.update(partial_l2_experiments(_schedule))


def kernel(variant: str) -> KernelVariant:
    try:
        return KERNELS[variant]
    except KeyError:
        raise ValueError(f"unknown MLA variant {variant!r}; use one of {sorted(KERNELS)}") from None


def _dtype_name(dtype: str) -> str:
    dt = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if dt not in DTYPES:
        raise ValueError(f"MLA decode supports float16 and bfloat16, got {dtype!r}")
    return dt


def dynamic_smem_bytes(defines: dict | None = None, variant: str | None = None) -> int:
    """Dynamic shared memory per CTA: of ``variant``, or read from a defines dict (MLA_SMEM_BYTES)."""
    if variant is not None:
        return kernel(variant).smem_bytes
    if defines and "MLA_SMEM_BYTES" in defines:
        return int(defines["MLA_SMEM_BYTES"])
    return SMEM_BYTES


def defines(dtype: str, variant: str = "wgmma", watchdog: bool = False) -> dict:
    """Compile-time defines for one module: dtype 'bfloat16'/'bf16' or 'float16'/'fp16'.

    ``watchdog=True`` adds MLA_WATCHDOG=1 (seesaw / narrow: an mbarrier wait that lasts > 4 s traps
    instead of hanging; development only, the wait loops are otherwise unchanged)."""
    return kernel(variant).defines(dtype, watchdog)


def num_m_blocks(s_q: int, h_q: int, h_kv: int, variant: str = "wgmma") -> int:
    return -(-(s_q * (h_q // h_kv)) // kernel(variant).block_m)


def launch_geometry(b: int, s_q: int, h_q: int, h_kv: int, num_splits: int, variant: str = "wgmma"):
    """((grid_x, grid_y, grid_z), (threads, 1, 1), dynamic smem bytes). grid = (nmb * S, h_kv, b)."""
    _check_heads(h_q, h_kv)
    kv = kernel(variant)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if not 1 <= b <= 65535:
        raise ValueError(f"batch {b} out of range for grid.z (1..65535)")
    if not 1 <= h_kv <= 65535:
        raise ValueError(f"h_kv {h_kv} out of range for grid.y (1..65535)")
    nmb = num_m_blocks(s_q, h_q, h_kv, variant)
    if kv.balanced:  # num_splits = CTAs per (KV head, row block) group
        return (num_splits, h_kv, nmb), (kv.threads, 1, 1), kv.smem_bytes
    return (nmb * num_splits, h_kv, b), (kv.threads, 1, 1), kv.smem_bytes


def workspace_sizes(b: int, s_q: int, h_q: int, h_kv: int, num_splits: int, variant: str = "wgmma",
                    no_cut: bool = False) -> dict:
    """Bytes of each workspace buffer. ws_o / ws_ml are 0 when num_splits == 1 or, on a balanced grid,
    with ``no_cut`` (FLAG_NO_CUT: no request is shared, so no partial is written; pass 0).

    Layout: ws_o [b, h_kv, nmb, S, block_m, 512] fp32, ws_ml [b, h_kv, nmb, S, block_m, 2] fp32,
    counters [b, h_kv, nmb] u32 (block_m and nmb of the variant). counters must be zeroed once at
    allocation; every variant leaves them at zero after each launch.
    """
    kv = kernel(variant)
    bm = kv.block_m
    nmb = num_m_blocks(s_q, h_q, h_kv, variant)
    units = b * h_kv * nmb
    if num_splits == 1 or (no_cut and kv.balanced):
        return {"ws_o": 0, "ws_ml": 0, "counters": 4 * units}
    # balanced grid: num_splits + b partial slots per (KV head, row block) group (work_items.cuh)
    rows = (h_kv * nmb * (num_splits + b) if kv.balanced else units * num_splits) * bm
    return {"ws_o": 4 * rows * D_V, "ws_ml": 8 * rows, "counters": 4 * units}


NCB = D_QK // 64  # 64-channel blocks per 576-channel row
TMA_MIN_PAGE = 64  # a 64-token tile must lie in one page (one box per half tile); smaller pages: cp.async


def tma_eligible(page_size: int, k_ptr: int, k_strides: tuple, num_blocks: int) -> bool:
    """Whether the TMA seesaw can describe k_cache [num_blocks, page, h_kv, 576] (strides in
    elements, last dim contiguous): pages of 64..256 tokens, a 16-byte aligned base, every stride a
    multiple of 16 bytes below 2^40, and page coordinates that fit TMA's signed 32-bit coordinates."""
    return (page_size >= TMA_MIN_PAGE and k_ptr % 16 == 0
            and all(0 < st and (st * 2) % 16 == 0 and st * 2 < 2**40 for st in k_strides)
            and 1 <= num_blocks < 2**31)


def k_tensor_maps(page_size: int, h_kv: int, num_blocks: int, k_strides: tuple, boxes: tuple = (4, 5)) -> list[dict]:
    """The tensor maps of k_cache a TMA variant reads, one per entry of ``boxes`` (its KernelVariant's
    ``tma_boxes``): 5-D (64 channels, page tokens, 9 channel blocks, h_kv, num_blocks) innermost
    first, byte strides (token, 128 B, head, page), box (64, 64, n, 1, 1), 128-byte swizzle. One box
    is n channel blocks of a 64-token tile laid out as the kernels' 64-row x 128 B swizzled blocks:
    the seesaw's k_lo / k_hi (n = 4, 5: channel blocks 0..3 / 4..8), the narrow kernels' k_cb (n = 1)."""
    dims = (64, page_size, NCB, h_kv, num_blocks)
    strides = (k_strides[1] * 2, 128, k_strides[2] * 2, k_strides[0] * 2)
    return [{"dims": dims, "strides": strides, "box": (64, 64, n, 1, 1)} for n in boxes]


def choose_variant(s_q: int, h_q: int, h_kv: int, arch: str = "sm_90a") -> str:
    """Suggested variant: on sm_90a by packed rows per KV head M = s_q * h_q / h_kv (narrow16 for
    M <= 16, narrow32 for M <= 32, seesaw above); elsewhere the mma.sync build of the original."""
    _check_heads(h_q, h_kv)
    if arch not in ("sm_90a", "sm_90"):
        return "mma"
    m = s_q * (h_q // h_kv)
    if m <= 16:
        return "narrow16"
    if m <= 32:
        return "narrow32"
    return "seesaw"


def choose_num_splits(b: int, s_q: int, h_q: int, h_kv: int, capacity_tokens: int, sm_count: int,
                      min_tiles_per_split: int = 4, variant: str = "wgmma") -> int:
    """Splits per (request, KV head, row block) from host-known sizes only (never the lengths).

    Every variant runs one CTA per SM. Minimises a simple cost in units of one 64-token tile of one
    CTA: waves(S) * (tiles / S + 2) + (S > 1) * (1 + merge(S)), waves = ceil(units * S / SMs), where
    the last CTA's merge reads S partials of block_m rows x 2 KB (one tile is 72 KB), under the
    constraints tiles / S >= min_tiles_per_split (the seesaw splits in pairs of tiles) and
    S <= MAX_SPLITS. A grid that already fills the SMs once (units >= SMs * 3 / 4) is not split.
    """
    kv = kernel(variant)
    groups = h_kv * num_m_blocks(s_q, h_q, h_kv, variant)
    if kv.balanced:  # about one CTA per SM in total
        return max(1, min(MAX_SPLITS, sm_count // groups))
    units = b * groups
    if units * 4 >= sm_count * 3:
        return 1
    tiles = max(1, -(-capacity_tokens // BLOCK_N))
    s_max = max(1, min(MAX_SPLITS, tiles // max(1, min_tiles_per_split)))
    merge_per_split = kv.block_m * D_V * 4 / (BLOCK_N * D_QK * 2)

    def cost(s: int) -> float:
        waves = -(-(units * s) // sm_count)
        return waves * (tiles / s + 2.0) + (0.0 if s == 1 else 1.0 + merge_per_split * s)

    return min(range(1, s_max + 1), key=lambda s: (cost(s), s))


def pack_args(**values) -> tuple:
    """Values in FIELDS order (missing 'max_offset' / 'sink' -> 0; unknown or missing fields raise)."""
    values.setdefault("max_offset", 0)
    values.setdefault("sink", 0)
    names = [n for n, _ in FIELDS]
    extra = set(values) - set(names)
    if extra:
        raise TypeError(f"unknown MlaDecodeArgs fields: {sorted(extra)}")
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"missing MlaDecodeArgs fields: {missing}")
    out = []
    for n, c in FIELDS:
        v = values[n]
        out.append(float(v) if c == "f" else int(v))
    return tuple(out)


def scale_log2(softmax_scale: float | None) -> float:
    s = D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    return s * math.log2(math.e)


def page_shift(page_size: int) -> int:
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size must be a power of two in [1, 256], got {page_size}")
    return page_size.bit_length() - 1


def signature():
    """gqadrv.runtime Signature of the kernel: one by-value struct parameter ``args``.

    Uses ``NamedStruct`` where the runtime has it (ArgPack.set_field("args.out", ptr) then works),
    else a plain ``Struct(FORMAT)``; both give the same 208-byte layout (FIELDS has no implicit
    padding), and ``ArgPack.pack(pack_args(...))`` works with either.
    """
    from gqadrv.runtime import module as _m

    named = getattr(_m, "NamedStruct", None)
    kind = named("MlaDecodeArgs", *FIELDS) if named is not None else _m.Struct(FORMAT)
    assert kind.size == ARGS_BYTES and kind.fmt == FORMAT, (kind.size, kind.fmt)
    return _m.Signature(("args", kind))


def _check_heads(h_q: int, h_kv: int) -> None:
    if h_kv < 1 or h_q < 1 or h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a positive multiple of h_kv ({h_kv})")


# ----------------------------------------------------------------------------- self-check
_C_TYPES = {"Q": ("const u16*", "const i32*", "u16*", "float*", "u32*"), "q": ("long long",), "i": ("int",),
            "f": ("float",)}


def check_against_header(kernels_root: str | Path | None = None) -> None:
    """Compare FIELDS with the struct in args.cuh (names, order, C types). Raises AssertionError."""
    root = Path(kernels_root) if kernels_root else Path(__file__).resolve().parents[2] / "kernels"
    text = (root / ARGS_HEADER).read_text()
    body = re.search(r"struct MlaDecodeArgs \{(.*?)\n\};", text, re.S)
    assert body, "struct MlaDecodeArgs not found in args.cuh"
    decl = re.compile(r"^\s*((?:const\s+)?[A-Za-z_][\w ]*?\*?)\s*([A-Za-z_]\w*);", re.M)
    fields = [(m.group(2), " ".join(m.group(1).split())) for m in decl.finditer(body.group(1))]
    assert [f for f, _ in fields] == [n for n, _ in FIELDS], (fields, FIELDS)
    for (name, ctype), (_, c) in zip(fields, FIELDS):
        assert ctype in _C_TYPES[c], f"{name}: C type {ctype!r} does not match format {c!r}"


if __name__ == "__main__":
    check_against_header()
    print(f"MlaDecodeArgs: {len(FIELDS)} fields, {ARGS_BYTES} bytes, FORMAT {FORMAT}; smem {SMEM_BYTES} B")
