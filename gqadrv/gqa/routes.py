"""The GQA route registry: the single source of truth for kernels, builds, launch geometry and splits.

A *family* is one kernel source and entry symbol with the architectures it is built for. A
*variant* is one compiled module of a family (dtype, head dim, MMA rows, tiling). ``select_variant``
maps (device compute capability, problem geometry, backend) to a variant; ``launch_geometry``
gives grid, block and dynamic shared memory; ``default_splits`` the split count. Validation, the
API, the CLI (``compile``), tests and docs all read these tables.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from ..ops.contract import check_choice
from ..ops.registry import KernelFamily
from ..runtime.compiler import cc_for_arch
from ..runtime.module import PORTABLE_CLUSTER_MAX
from . import tcgen05 as _tc
from .args import SIG_PLAIN, SIG_TMA
from .paged_args import SIG_PAGED, SIG_PAGED_TMA
from .contract import MAX_GROUP, MAX_SPLITS, STATE_ROW_PAD, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

__all__ = [
    "ARCH_SMEM_OPTIN",
    "FAMILIES",
    "PORTABLE_SMEM_LIMIT",
    "SHORT_CAPACITY_MAX",
    "Family",
    "Tiling",
    "Variant",
    "backend_for_cc",
    "cluster_merge_applies",
    "cluster_recv_bytes",
    "cluster_splits",
    "default_splits",
    "launch_geometry",
    "l2_prefetch_pays",
    "prefers_portable",
    "PORTABLE_MIN_WAVES",
    "select_paged_variant",
    "select_variant",
    "tuning_env",
    "variants_for_arch",
]

# L2 prefetch before griddepcontrol.wait pays when every CTA runs in the first wave and streams at
# least this many rounds of sub-tiles (see l2_prefetch_pays).
PREFETCH_MIN_ROUNDS = 8
SHORT_CAPACITY_MAX = 64
SPLIT_MIN_ROUNDS = 4  # see default_splits
# Per-block shared-memory opt-in limits of the targets (bytes); the portable family must also fit
# sm_86 / sm_89 (101376 B).
ARCH_SMEM_OPTIN = {"sm_80": 166912, "sm_90a": 232448, "sm_100a": 232448, "sm_110a": 232448}
PORTABLE_SMEM_LIMIT = 101376
_DT_CODE = {"float16": 0, "bfloat16": 1}


@dataclasses.dataclass(frozen=True)
class Family(KernelFamily):
    """A GQA kernel family (see ops.registry.KernelFamily) and the facts routing needs."""

    uses_tma: bool = False
    splittable: bool = False
    ring: bool = False        # K/V slots in dynamic smem (a pipelined ring, or one slot per warp)
    tcgen05: bool = False     # geometry from gqa/tcgen05.py (B200 / Thor kernels)


_ALL = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
_DENSE = frozenset({"dense_kv", "fp16", "bf16"})
_SPLIT = _DENSE | {"split_kv"}
FAMILIES: dict[str, Family] = {
    "short": Family("short", "gqa/smxx/decode_short.cu", "gqa_decode_short", _ALL, SIG_PLAIN, _DENSE,
                    uses_tma=False, splittable=False, ring=True),
    "tma": Family("tma", "gqa/sm90/decode_tma.cu", "gqa_decode_tma", ("sm_90a", "sm_100a", "sm_110a"), SIG_TMA,
                  _SPLIT, uses_tma=True, splittable=True, ring=True),
    "portable": Family("portable", "gqa/sm80/decode_cpasync.cu", "gqa_decode_cpasync", _ALL, SIG_PLAIN, _SPLIT,
                       uses_tma=False, splittable=True, ring=True),
    # paged / contiguous caches with multi-token queries, LSE and the batch-invariant split mode
    # (gqa/paged.py); cp.async, so one source serves every architecture
    "paged": Family("paged", "gqa/sm80/decode_paged.cu", "gqa_decode_paged", _ALL, SIG_PAGED,
                    _SPLIT | {"paged_kv", "multi_token", "lse", "batch_invariant", "fp8_e4m3_kv"}, uses_tma=False, splittable=True,
                    ring=True),
    # the same with TMA boxes of whole pages (page size >= 16) on Hopper
    "paged_tma": Family("paged_tma", "gqa/sm90/decode_paged_tma.cu", "gqa_decode_paged_tma",
                        ("sm_90a", "sm_100a", "sm_110a"), SIG_PAGED_TMA,
                        _SPLIT | {"paged_kv", "multi_token", "lse", "batch_invariant", "fp8_e4m3_kv"}, uses_tma=True,
                        splittable=True, ring=True),
    # tcgen05 + TMEM kernels for B200 / Thor: compile-verified only (no such GPU here)
    "tc_short": Family("tc_short", _tc.TC_SOURCE["tc_short"], _tc.TC_ENTRY["tc_short"], ("sm_100a", "sm_110a"),
                       SIG_PLAIN, _DENSE, uses_tma=False, splittable=False, ring=False, tcgen05=True),
    "tc_long": Family("tc_long", _tc.TC_SOURCE["tc_long"], _tc.TC_ENTRY["tc_long"], ("sm_100a", "sm_110a"),
                      SIG_TMA, _SPLIT, uses_tma=True, splittable=True, ring=True, tcgen05=True),
}

# Kernel families each backend routes to (``info`` and the docs read this, not a copy).
BACKEND_FAMILIES = {
    "hopper": ("short", "tma", "portable", "paged", "paged_tma"),
    "tcgen05": ("tc_short", "tc_long", "short", "portable", "paged"),
    "portable": ("short", "portable", "paged"),
}

# Environment variables that change routing, compiled switches or launch flags (tuning and
# development only). Every one of them is part of the route and layout keys (tuning_env()).
TUNING_ENV = ("GQADRV_BACKEND", "GQADRV_TILING", "GQADRV_SHORT_TILING", "GQADRV_PREFETCH", "GQADRV_L2_EVICT_FIRST",
              "GQADRV_TRACE", "GQADRV_PAGED_COPY", "GQADRV_PAGED_DET_EXIT", "GQADRV_KV8_CVT",
              "GQADRV_KV8_T", "GQADRV_CLUSTER_MERGE", "GQADRV_PAGED_SPEC", "GQADRV_PAGED_NEXT",
              "GQADRV_PAGED_MULTI")
# os.environ.get encodes the key and decodes the value (~0.3 us each); on POSIX os.environ keeps
# its bytes mapping in ``_data`` (kept in step by os.environ[...] = / del / putenv through it), read
# here directly on the per-call path. The values are only compared with each other.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_TUNING_ENV_B = tuple(k.encode() for k in TUNING_ENV)


def tuning_env() -> tuple:
    d = _ENV_BYTES
    if type(d) is dict:
        return tuple([d.get(k) for k in _TUNING_ENV_B])
    env = os.environ
    return tuple(env.get(k) for k in TUNING_ENV)


@dataclasses.dataclass(frozen=True)
class Tiling:
    warps: int
    tok: int      # tokens per warp sub-tile
    stages: int   # ring slots per warp (1 for the short kernel)

    @property
    def tokens_per_round(self) -> int:
        return self.warps * self.tok


# Default tilings per (family, head_dim); GQADRV_TILING="warps,tok,stages" overrides (tuning only).
_TILINGS = {
    ("short", 64): Tiling(4, 16, 1),
    ("short", 128): Tiling(4, 16, 1),
    ("short", 256): Tiling(4, 16, 1),
    ("tma", 64): Tiling(4, 32, 4),
    ("tma", 128): Tiling(4, 32, 2),
    ("tma", 256): Tiling(4, 16, 2),
    # portable rings stay <= 96 KB so they fit the 99 KB opt-in limit of sm_86 / sm_89 GPUs
    ("portable", 64): Tiling(4, 32, 3),
    ("portable", 128): Tiling(4, 16, 3),
    ("portable", 256): Tiling(4, 16, 1),
    # the paged kernel has the portable ring (same sm_86 / sm_89 shared-memory budget)
    ("paged", 64): Tiling(4, 32, 3),
    ("paged", 128): Tiling(4, 16, 3),
    ("paged", 256): Tiling(4, 16, 1),
    ("paged_tma", 64): Tiling(4, 32, 4),
    # 8 warps x 1 stage: B16 L4K page 16 64.9 us hot / 76.5 cold vs 66.7 / 78.4 with (4, 32, 2);
    # B1 L32K 37.5 / 45.6 vs 37.2 / 46.5 (docs/RESULTS.md, paged decode tilings)
    ("paged_tma", 128): Tiling(8, 32, 1),
    ("paged_tma", 256): Tiling(4, 16, 2),
}
# e4m3 caches (one byte per element): the rings keep about the fp16 bytes in flight with twice the
# tokens per slot or twice the slots (the cp.async kernel takes 16 or 32 tokens per sub-tile)
# H200, Hq 32 / Hkv 8 / D 128, page 16 (hot TB/s of e4m3 bytes, 2026-12-01 tuning sweep): TMA 8x32x3
# B64 L4K 4.12, B128 L8K 4.35, B256 L2K 4.18 vs 8x32x2 4.05 / 4.33 / 4.02 and cp.async 4x32x3 4.08 /
# 4.31 / 3.37; 8x16x4 and 8x64x1 slower
_TILINGS_E4M3 = {
    ("paged", 64): Tiling(4, 32, 3),
    ("paged", 128): Tiling(4, 32, 3),
    ("paged", 256): Tiling(4, 16, 1),   # two stages spill the 16-row sm_100a / sm_110a build
    ("paged_tma", 128): Tiling(8, 32, 3),
    ("paged_tma", 256): Tiling(4, 16, 4),
}
E4M3_FAMILIES = ("paged", "paged_tma")  # the kernels built with GQA_KV8 (kernels/gqa/common/warp.cuh)
E4M3_TMA_MIN_HEAD_DIM = 128             # 64-byte e4m3 rows take the cp.async route


def tiling_for(family: str, head_dim: int, kv8: bool = False) -> Tiling:
    if FAMILIES[family].tcgen05:
        threads, tok, stages = _tc.TC_TILINGS[(family, head_dim)]
        return Tiling(threads // 32, tok, stages)
    if family == "short":
        env = os.environ.get("GQADRV_SHORT_TILING")  # "warps,tok" (tuning only); warps*tok >= 64
        if env:
            w, t = (int(x) for x in env.split(","))
            return Tiling(w, t, 1)
        return _TILINGS[(family, head_dim)]
    env = os.environ.get("GQADRV_TILING")
    if env:
        w, t, s = (int(x) for x in env.split(","))
        return Tiling(w, t, s)
    if kv8 and (family, head_dim) in _TILINGS_E4M3:
        return _TILINGS_E4M3[(family, head_dim)]
    return _TILINGS[(family, head_dim)]


# Compile-time switches of the TMA family (kernels/gqa/sm90/decode_tma.cu); the environment
# variables exist for tuning runs only.
_TMA_SWITCHES = {"GQA_PREFETCH": ("GQADRV_PREFETCH", 1)}
# Each switch's value in the kernel sources when not defined (0 for every switch not listed): a variant's
# name carries the switches that differ from it, so a development build never shares a default's name.
_SWITCH_DEFAULTS = {**{m: d for m, (_, d) in _TMA_SWITCHES.items()},
                    "GQA_PAGED_HOISTED_COPY": 1, "GQA_PAGED_DET_EXIT": 1, "GQA_KV8_T": 1, "GQA_KV8_CVT": 1}


def switches_for(family: str) -> tuple[tuple[str, int], ...]:
    sw = []
    if family == "tma":
        sw = [(macro, int(os.environ.get(env, default))) for macro, (env, default) in _TMA_SWITCHES.items()]
    if family == "paged" and os.environ.get("GQADRV_PAGED_COPY", "") == "plain":
        # development only (A/B): the cp.async paged kernel's per-chunk copy instead of the hoisted one,
        # the default since 2026-12-06 (kernels/gqa/sm80/decode_paged.cu)
        sw.append(("GQA_PAGED_HOISTED_COPY", 0))
    if family in ("paged", "paged_tma") and os.environ.get("GQADRV_PAGED_DET_EXIT", "") == "0":
        # development only (A/B): every batch-invariant split takes part in the ticket, as before
        # 2026-12-06 (paged_args.cuh; the default lets the idle ones leave)
        sw.append(("GQA_PAGED_DET_EXIT", 0))
    if family in E4M3_FAMILIES and os.environ.get("GQADRV_KV8_CVT", ""):
        # development only: the e4m3 -> fp16 conversion of the KV8 decoders (warp.cuh, GQA_KV8_CVT)
        sw.append(("GQA_KV8_CVT", int(os.environ["GQADRV_KV8_CVT"])))
    if family in E4M3_FAMILIES and os.environ.get("GQADRV_KV8_T", ""):
        # development only: GQADRV_KV8_T=0 turns the transposed 8-row e4m3 decoder off (warp_t8.cuh)
        sw.append(("GQA_KV8_T", int(os.environ["GQADRV_KV8_T"])))
    if family == "paged_tma" and os.environ.get("GQADRV_PAGED_NEXT", ""):
        # development only (A/B): the TMA paged kernel prefetches its successor CTA's first n sub-tiles
        # into L2 in launches of several waves (decode_paged_tma.cu, GQA_PAGED_NEXT; paged.successor_stride)
        sw.append(("GQA_PAGED_NEXT", int(os.environ["GQADRV_PAGED_NEXT"])))
    if family == "paged_tma" and os.environ.get("GQADRV_PAGED_MULTI", ""):
        # development only (A/B): one-split launches of several waves run CTAs that each walk several units
        # with their warps' rings running on across them (decode_paged_tma.cu, GQA_PAGED_MULTI); the value K
        # sizes the grid (paged.launch_shape): K >= 2 units per CTA, 1 = the resident CTAs
        sw.append(("GQA_PAGED_MULTI", max(1, int(os.environ["GQADRV_PAGED_MULTI"]))))
    if os.environ.get("GQADRV_TRACE", "0") == "1":  # development only: see tools/trace_decode.py
        sw.append(("GQA_TRACE", 1))
    return tuple(sw)


@dataclasses.dataclass(frozen=True)
class Variant:
    family: Family
    dtype: str
    head_dim: int
    rows: int
    tiling: Tiling
    switches: tuple[tuple[str, int], ...] = ()
    kv8: bool = False   # e4m3 caches (GQA_KV8; E4M3_FAMILIES only)

    def __hash__(self) -> int:
        # the fields' hash, computed once: variants key the route, kernel, split and geometry caches
        # of every call path, and hashing the nested frozen dataclasses costs ~1 us each time
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.family, self.dtype, self.head_dim, self.rows, self.tiling, self.switches, self.kv8))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def name(self) -> str:
        t = self.tiling
        extra = "".join(f"_{m.lower().replace('gqa_', '')}{v}" for m, v in self.switches
                        if v != _SWITCH_DEFAULTS.get(m, 0))
        kv = "_kve4m3" if self.kv8 else ""
        return (f"{self.family.name}_{self.dtype}{kv}_d{self.head_dim}_r{self.rows}_w{t.warps}t{t.tok}s{t.stages}"
                f"{extra}")

    @property
    def defines(self) -> dict:
        t = self.tiling
        if self.family.tcgen05:
            d = _tc.tc_defines(self.family.name, _DT_CODE[self.dtype], self.head_dim, self.rows, t.tok, t.stages)
            d.update(self.switches)
            return d
        d = {"GQA_DT": _DT_CODE[self.dtype], "GQA_D": self.head_dim, "GQA_ROWS": self.rows,
             "GQA_WARPS": t.warps, "GQA_TOK": t.tok, "GQA_STAGES": t.stages}
        if self.kv8:
            d["GQA_KV8"] = 1
        d.update(self.switches)
        return d

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.tiling.warps * 32, 1, 1)

    @property
    def dynamic_smem(self) -> int:
        t, D = self.tiling, self.head_dim
        if self.family.tcgen05:
            return _tc.tc_dynamic_smem(self.family.name, D, self.rows, t.tok, t.stages)
        merge = (t.warps * self.rows * 2 + t.warps * self.rows * (D + STATE_ROW_PAD)) * 4
        need = merge
        if self.family.ring:
            # K + V per slot: D * 2 bytes per row, e4m3: max(128, D) bytes (warp.cuh, KV_BYTES)
            row = max(128, D) if self.kv8 else 2 * D
            need = max(need, t.warps * t.stages * 2 * row * t.tok)
        return (need + 1023) // 1024 * 1024


def rows_for_group(group: int) -> int:
    return 8 if group <= 8 else 16


def backend_for_cc(cc: tuple[int, int]) -> str:
    """'hopper' for sm_90, 'tcgen05' for sm_100 (B200) and sm_110 (Thor), 'portable' for sm_8x,
    sm_12x and other GPUs of compute capability 8.0 or newer."""
    if cc[0] < 8:
        raise RuntimeError(
            f"gqadrv needs compute capability 8.0 or newer (Ampere, Ada, Hopper, Blackwell); "
            f"this GPU has {cc[0]}.{cc[1]}"
        )
    if cc == (9, 0):
        return "hopper"
    if cc in ((10, 0), (11, 0)):
        return "tcgen05"
    return "portable"


BACKENDS = ("auto", "hopper", "tcgen05", "portable")


def check_backend(backend) -> str | None:
    """None/'auto' or a backend name (TypeError for a non-string, ValueError for an unknown name)."""
    b = check_choice("backend", backend, BACKENDS)
    return None if b == "auto" else b


def _backend_override(backend: str | None) -> str | None:
    if backend is not None:
        return check_backend(backend)
    env = os.environ.get("GQADRV_BACKEND") or None
    b = check_choice("GQADRV_BACKEND", env, BACKENDS)
    return None if b == "auto" else b


# On sm_90, grids of at least this many waves of unsplit TMA-route CTAs (one per SM), head dim 128,
# take the cp.async route unless a backend is forced. Measured on two kinds of H200 machine
# (docs/RESULTS.md, table 3), it streams 0.5-2.5 % slower than the TMA route inside CUDA graphs that
# re-read the same KV, but 2-6 % faster from a cold L2 (B64 C4096: 236.7 vs 235.0 us hot, 249.6 vs
# 266.1 us cold on one machine; 246.4 vs 245.2 and 256.4 vs 271.1 on the other), and a decode step
# of a real model meets its KV cold: every layer reads a different cache, with other kernels'
# writes in between.
# (The other head dims keep the TMA route: the portable D = 256 ring has a single stage.)
PORTABLE_MIN_WAVES = 2


def prefers_portable(cc: tuple[int, int], head_dim: int, ctas: int, sm_count: int) -> bool:
    """The large-batch rule above: `ctas` = batch x KV heads (the unsplit grid)."""
    return cc == (9, 0) and head_dim == 128 and sm_count > 0 and ctas >= PORTABLE_MIN_WAVES * sm_count


def _check_dtype_head_dim(dtype: str, head_dim: int) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")


def _native_and_forced(cc: tuple[int, int], backend: str | None) -> tuple[str, str | None]:
    """(the GPU's own backend, the backend forced by ``backend`` / GQADRV_BACKEND or None); a forced
    backend the GPU lacks is a RuntimeError."""
    native = backend_for_cc(cc)
    forced = _backend_override(backend)
    if forced in ("hopper", "tcgen05") and native != forced:
        need = "9.0" if forced == "hopper" else "10.0 or 11.0"
        raise RuntimeError(f"backend {forced!r} needs compute capability {need}, this GPU has {cc[0]}.{cc[1]}")
    return native, forced


def select_variant(cc: tuple[int, int], capacity: int, head_dim: int, dtype: str, group: int,
                   backend: str | None = None, ctas: int = 0, sm_count: int = 0) -> Variant:
    """The route for a device and problem. ``backend`` (or GQADRV_BACKEND) may force a backend;
    ``ctas`` (batch x KV heads) and ``sm_count`` enable the large-batch rule (prefers_portable)."""
    _check_dtype_head_dim(dtype, head_dim)
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group size {group} is not supported; supported: 1..{MAX_GROUP}")
    native, forced = _native_and_forced(cc, backend)
    chosen = forced or native
    rows = rows_for_group(group)
    short = capacity <= SHORT_CAPACITY_MAX
    if chosen == "tcgen05":
        fam = FAMILIES["tc_short" if short else "tc_long"]
    elif short:
        fam = FAMILIES["short"]
    else:
        fam = FAMILIES["tma"] if chosen == "hopper" else FAMILIES["portable"]
        if forced is None and fam.name == "tma" and prefers_portable(cc, head_dim, ctas, sm_count):
            fam = FAMILIES["portable"]
    return Variant(fam, dtype, head_dim, rows, tiling_for(fam.name, head_dim), switches_for(fam.name))


def paged_rows(cc_major: int, family: str, head_dim: int, rows: int, kv8: bool) -> int:
    """MMA rows of the paged build for ``rows`` query rows of one KV head (``rows_for_group``), except on
    sm_100 / sm_110 (compute capability 10.x / 11.x), where D 256 fp16 / bf16 caches take the 16-row build for
    any row count: the 8-row D 256 builds of both paged kernels spill registers there under NVRTC 13.0
    (4-12 bytes), the 16-row ones do not. Those arches are compile-verified only (docs/TESTING.md)."""
    if cc_major in (10, 11) and family in ("paged", "paged_tma") and head_dim == 256 and not kv8:
        return 16
    return rows_for_group(rows)


def select_paged_variant(cc: tuple[int, int], head_dim: int, dtype: str, rows: int,
                         backend: str | None = None, tma_ok: bool = False, kv8: bool = False) -> Variant:
    """The paged / multi-token / LSE route: ``rows`` = s_q x group query rows of one KV head,
    packed into MMA row blocks of 8 (rows <= 8) or 16. Family "paged_tma" on sm_90 when the pools
    are TMA-describable with page size >= 16 (``tma_ok``, decided by gqa/paged.py), "paged"
    (cp.async, every architecture) otherwise or with backend 'portable'. ``backend`` is checked as
    in select_variant (a forced backend the GPU lacks is an error)."""
    _check_dtype_head_dim(dtype, head_dim)
    native, forced = _native_and_forced(cc, backend)
    fam = "paged_tma" if tma_ok and (forced or native) == "hopper" else "paged"
    if kv8 and fam == "paged_tma" and head_dim < E4M3_TMA_MIN_HEAD_DIM:
        fam = "paged"
    return Variant(FAMILIES[fam], dtype, head_dim, paged_rows(cc[0], fam, head_dim, rows, kv8),
                   tiling_for(fam, head_dim, kv8), switches_for(fam), kv8)


def variants_for_arch(arch: str) -> list[Variant]:
    """Every module `python -m gqadrv compile --arch ARCH` builds."""
    out = []
    for fam in FAMILIES.values():
        if arch not in fam.arches:
            continue
        for dtype in SUPPORTED_DTYPES:
            for d in SUPPORTED_HEAD_DIMS:
                for rows in (8, 16):
                    if paged_rows(cc_for_arch(arch)[0], fam.name, d, rows, False) == rows:
                        out.append(Variant(fam, dtype, d, rows, tiling_for(fam.name, d), switches_for(fam.name)))
                    if fam.name in E4M3_FAMILIES and (fam.name == "paged" or d >= E4M3_TMA_MIN_HEAD_DIM):
                        out.append(Variant(fam, dtype, d, rows, tiling_for(fam.name, d, True), switches_for(fam.name),
                                           True))
    return out


def launch_geometry(variant: Variant, batch: int, num_kv_heads: int, num_splits: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, dynamic smem bytes): one CTA per (batch, KV head, split)."""
    return (batch * num_kv_heads * num_splits, 1, 1), variant.block, variant.dynamic_smem


# The split merge through distributed shared memory (kernels/gqa/common/cluster_merge.cuh): a TMA
# launch of S = 2..CLUSTER_MERGE_MAX splits runs as clusters of S CTAs; each CTA owns a chunk of the
# output's items and receives the others' states of them in an area past the ring (cluster_recv_bytes).
CLUSTER_MERGE_MAX = 16         # CLUSTER_MERGE_MAX of cluster_merge.cuh
CLUSTER_PORTABLE_MAX = PORTABLE_CLUSTER_MAX  # runtime.module: larger ones need the non-portable attribute
CLUSTER_MERGE_MAX_HEAD_DIM = 128  # CLUSTER_MERGE of decode_tma.cu (the D 256 builds leave it out)


@functools.lru_cache(maxsize=1024)
def cluster_recv_bytes(variant: Variant) -> int:
    """Bytes of the cluster merge's receive area (RecvArea::BYTES): rows x D / 8 + CLUSTER_MERGE_MAX
    entries (at least the S x ceil(items / S) a CTA receives) of 8 fp32 numerators and {max,
    denominator}, 40 bytes each."""
    return (variant.rows * variant.head_dim // 8 + CLUSTER_MERGE_MAX) * 40


@functools.lru_cache(maxsize=1024)
def _cluster_capable(variant: Variant) -> bool:
    """The TMA families (contiguous and paged, sm_90 build), head dim <= 128, ring plus receive area
    within the opt-in."""
    return (variant.family.name in ("tma", "paged_tma") and variant.head_dim <= CLUSTER_MERGE_MAX_HEAD_DIM
            and variant.dynamic_smem + cluster_recv_bytes(variant) <= ARCH_SMEM_OPTIN["sm_90a"])


def cluster_merge_applies(variant: Variant, splits: int) -> bool:
    """Whether a launch of ``variant`` with ``splits`` splits may merge them in a cluster: the TMA
    families (sm_90 build), head dim <= 128, 2..cluster_cap() splits, and ring plus receive area
    within the shared-memory opt-in. GQADRV_CLUSTER_MERGE=0 turns it off (tuning only). Whether
    the clusters run in one wave is the caller's second condition (plan.launch_shape)."""
    return 2 <= splits <= cluster_cap() and _cluster_capable(variant)


def cluster_cap() -> int:
    """The largest cluster the split merge may use: CLUSTER_MERGE_MAX unless GQADRV_CLUSTER_MERGE
    (tuning only) says 0 (never: the ticket) or a size 2..CLUSTER_MERGE_MAX (8 = portable clusters
    only); 1 or any other value keeps the default."""
    v = cluster_merge_switch()
    if v is None or not v.isdigit() or v == "1":
        return CLUSTER_MERGE_MAX
    return min(int(v), CLUSTER_MERGE_MAX)


def cluster_merge_switch() -> str | None:
    """GQADRV_CLUSTER_MERGE as set (None when unset), read without the per-call encode / decode of
    os.environ where its bytes mapping is at hand (see tuning_env)."""
    d = _ENV_BYTES
    if type(d) is dict:
        v = d.get(b"GQADRV_CLUSTER_MERGE")
        return None if v is None else v.decode()
    return os.environ.get("GQADRV_CLUSTER_MERGE")


def cluster_splits(variant: Variant, batch: int, num_kv_heads: int, capacity: int, splits: int, fits,
                   extra_rounds: int = 1) -> int:
    """The split count when the splits may merge in a cluster: ``splits`` is the ticket-merge count
    of ``default_splits``; ``fits(S)`` says how many clusters of S CTAs run at once (fewer or as
    many as of a smaller S). Portable sizes first: among S <= min(splits, 8, cluster_cap()) whose
    (batch, KV head) clusters are all resident, the one with the fewest sub-tile rounds per CTA
    (ties: the smaller S), if it streams at most ``extra_rounds`` rounds more per CTA than the
    ticket count; failing that the same rule over S <= min(splits, cluster_cap()) (non-portable
    clusters of 9..16); failing both, ``splits`` with the ticket.

    Measured on an H100 (hot µs, docs/RESULTS.md 2026-12-07 "cluster split merge" and
    "all-to-all"): B1 C1024 8 splits 4.3-4.5 in clusters vs 4.8-4.9 with the ticket; B1 C2048 8 in
    clusters 5.3 vs 16 with the ticket 5.7-5.8; B2 C1024 4 in clusters 4.9 vs 8 with the ticket 5.4;
    B1 C4096 keeps 16 with the ticket (8 in clusters, 4 rounds: 7.0-7.1 vs 6.8-6.9; 16-CTA clusters
    fit 7 at a time, not 8). Hkv 4: B1 C2048 8 in clusters 4.79 vs 16 in clusters 5.19 vs 16 with
    the ticket 5.94 (hence portable first); B1 C4096 16 in clusters 5.98 vs 32 with the ticket 8.66.
    The paged TMA kernel passes ``extra_rounds`` 0 (its rounds are 256 tokens: p16 B1 L4K in
    clusters of 8, 2 rounds, 10.0 µs vs 16 with the ticket 8.8)."""
    if splits < 2 or not cluster_merge_applies(variant, 2):
        return splits
    bh = batch * num_kv_heads
    rounds = sub_tile_rounds(variant, capacity)
    ticket_per = -(-rounds // splits)

    def pick(limit: int) -> int:
        big = next((S for S in range(min(splits, limit), 1, -1) if bh <= fits(S)), 0)
        if not big:
            return 0
        per = -(-rounds // big)
        if per > ticket_per + extra_rounds:
            return 0
        return max(2, -(-rounds // per))  # the smallest S with `per` rounds per CTA (it fits: S <= big)

    cap = cluster_cap()
    return pick(min(cap, CLUSTER_PORTABLE_MAX)) or (pick(cap) if cap > CLUSTER_PORTABLE_MAX else 0) or splits


def sub_tile_rounds(variant: Variant, capacity: int) -> int:
    """Rounds of sub-tiles (one per warp, `warps * tok` tokens) that cover the capacity."""
    return -(-capacity // variant.tiling.tokens_per_round)


@functools.lru_cache(maxsize=4096)
def default_splits(variant: Variant, batch: int, num_kv_heads: int, capacity: int, sm_count: int,
                   ctas_per_sm: int) -> int:
    """Split count from (B*Hkv, KV sub-tiles, SM count): enough CTAs to fill the GPU at batch 1,
    each split still owning at least one sub-tile per warp."""
    if not variant.family.splittable:
        return 1
    bh = batch * num_kv_heads
    slots = sm_count * max(1, ctas_per_sm)
    if bh >= slots:
        return 1
    rounds = sub_tile_rounds(variant, capacity)
    # Below SPLIT_MIN_ROUNDS rounds of sub-tiles the ticket + merge of a split (about 2 us of latency
    # on the H200) costs more than the rounds it takes off each CTA (B4 C256: 4.6 us unsplit, 5.1-5.3
    # with 2 or 4 splits). Above it: one wave of CTAs, each warp owning at least one sub-tile
    # (B1 C1024: 5.1 us with 8 splits of one round, 6.0 with 4 splits of two).
    if rounds < SPLIT_MIN_ROUNDS:
        return 1
    return max(1, min(slots // bh, rounds, MAX_SPLITS))


def l2_prefetch_pays(variant: Variant, batch: int, num_kv_heads: int, capacity: int, splits: int, sm_count: int,
                     ctas_per_sm: int) -> bool:
    """Whether the TMA route should prefetch its first sub-tiles into L2 before griddepcontrol.wait.

    Only the first wave overlaps the previous kernel's tail, and the extra L2 requests cost more
    than they save on short streams. Measured on the H200 (hot, prefetch on / off): B16 C4096
    62.1 / 63.2 us and B1 C32768 33.8 / 35.1 us (one wave, 32 and 16 rounds per CTA: on);
    B1 C4096 7.8 / 7.6 us and B4 C256 4.1 / 4.0 us (2 rounds: off); B256 C2048 482 / 472 us
    (16 waves: off). Only the sm_90 "tma" family reads the flag; the tcgen05 "tc_long" kernel (never
    run here) keeps its compile-time prefetch of the first sub-tiles.
    """
    if variant.family.name != "tma":
        return False
    if batch * num_kv_heads * splits > sm_count * max(1, ctas_per_sm):
        return False
    return sub_tile_rounds(variant, capacity) // max(1, splits) >= PREFETCH_MIN_ROUNDS

