"""The MLA route registry: kernel families (from ``kernel_spec``), variants, routing by compute
capability, split counts. ``python -m gqadrv compile`` and the static tests read it.

* ``seesaw_tma`` (sm_90a): two consumer warpgroups on FlashMLA's seesaw schedule, K tiles by TMA
  from one producer thread, one CTA per (request, row block, split); the default on the H200 for
  every head count when k_cache is TMA-describable (pages of 64..256 tokens, 16-byte aligned
  strides) and the batch is small (the split count comes from the shapes).
* ``seesaw_bal`` (sm_90a): the same kernel on the balanced persistent grid (about one CTA per SM;
  whole requests per CTA when the lengths are near uniform, else an equal share of all requests'
  tiles with long requests shared between CTAs, chosen on the device at each launch:
  kernels/mla/common/work_items.cuh); the default for TMA-describable caches when the requests' row
  blocks fill 3/4 of the SMs (the split grid would then run every request on one CTA, so a single
  long request would set the time of the whole batch).
* ``seesaw`` (sm_90a): the same schedule with a cp.async producer warpgroup; the default for pages
  of 1..32 tokens or k_cache layouts a tensor map cannot describe, at small batch.
* ``seesaw_bal_cp`` / ``seesaw_nope_bal`` (sm_90a): the cp.async seesaw (576 / 512-channel rows) on
  the balanced persistent grid; the default where ``seesaw`` / ``seesaw_nope`` would run and the
  batch fills the SMs as for seesaw_bal: dense caches a tensor map cannot describe, and the sparse
  decode / prefill on their gathered lists (with ``FLAG_NO_CUT``: every list on one CTA, no partials),
  where the persistent CTAs load the next list's Q and first tiles while they finish the previous one.
* ``narrow16x2_tma`` / ``narrow16_bal`` (sm_90a): tokens as the wgmma M dimension for M <= 16 packed
  rows (e.g. h_q 16, s_q 1), two consumer warpgroups on alternate 64-token tiles, pieces by TMA; on
  the split grid / the balanced persistent grid. The default for M <= 16 when k_cache is
  TMA-describable (narrow16_bal when the batch fills the SMs as for seesaw_bal) on GPUs with at least
  ``NARROW_MIN_DRAM_PER_SM`` of DRAM bandwidth per SM (the H200); below that (the H100) the seesaw
  routes serve M <= 16 too (``narrow_preferred``), docs/MLA.md.
* ``narrow16`` / ``narrow32`` (sm_90a): tokens as the wgmma M dimension for M <= 16 / 32 rows with one
  consumer warpgroup (cp.async or, as ``narrow16_tma`` / ``narrow32_tma``, TMA pieces); only when
  forced (slower than the seesaw / narrow16x2 on the H200, docs/MLA.md).
* ``wgmma`` (sm_90a): the first kernel (no overlap between phases); only when forced.
* ``mma`` (mma.sync + ldmatrix, the first kernel's layout): chosen on sm_100 / sm_110 (B200, Thor),
  where wgmma does not exist; compile-verified only there (no such GPU here). It also runs on sm_90
  when forced (``backend="mma"``), which is how the H200 tests cover its code.
* ``seesaw_fp8`` / ``mma_fp8``: the same two kernels on FlashMLA's 656-byte FP8 cache
  (``is_fp8_kvcache=True``, bf16 q): seesaw_fp8 on sm_90 only when forced, mma_fp8 on sm_100 / sm_110
  (compile-verified only) and, when forced, on sm_90.
* ``narrow16_fp8`` (sm_90a): the FP8 cache with tokens as the wgmma M dimension, the e4m3 codes
  dequantized into wgmma register fragments by the consumers; the default on sm_90 for M <= 16 packed
  rows (e.g. h_q 16 s_q 1, and the sparse decode at those head counts).
* ``wide64_fp8`` (sm_90a): the same design for 64-row blocks, the two consumer warpgroups splitting
  the channels of every tile; the default on sm_90 for M > 16 (h_q 64 / 128, dense and sparse decode).
"""

from __future__ import annotations

import dataclasses

from ..ops.contract import check_choice
from ..ops.registry import KernelFamily
from . import kernel_spec as _ks
from .args import SIG, SIG_TMA, SIG_TMA1

__all__ = ["BACKENDS", "FAMILIES", "MlaFamily", "MlaVariant", "backend_for_cc", "default_splits", "select_variant",
           "variants_for_arch"]

FEATURES = frozenset({"dense_kv", "paged_kv", "fp16", "bf16", "causal", "lse", "split_kv", "multi_token"})
FP8_FEATURES = frozenset({"dense_kv", "paged_kv", "bf16", "fp8_kv", "causal", "lse", "split_kv", "multi_token"})


@dataclasses.dataclass(frozen=True)
class MlaFamily(KernelFamily):
    block_m: int = 64             # packed query rows per CTA
    max_rows: int | None = None   # largest M = s_q * h_q / h_kv the kernel serves (None: any)
    tma_boxes: tuple = ()         # TMA families: channel blocks per box of each CUtensorMap parameter
    fp8: bool = False             # reads the 656-byte FP8 cache (bf16 q only)
    nope: bool = False            # d_qk 512: q / K rows of 512 channels (sparse prefill's MODEL1 layout)

    @property
    def sink_epilogue(self) -> bool:
        """Its epilogue (decode_util.cuh store_out_rows) folds an attention sink into out's normaliser
        (FLAG_SINK) on items without splits: the seesaw builds and the first kernel (wgmma / mma)."""
        return self.source in ("mla/sm90/dense_decode_seesaw.cu", "mla/sm90/dense_decode.cu")

    @property
    def tma(self) -> bool:
        """The first parameters are CUtensorMaps of k_cache (kernel_spec.tma_eligible caches only)."""
        return bool(self.tma_boxes)


FAMILIES = {
    name: MlaFamily(name, k.source, k.entry, k.arches, {0: SIG, 1: SIG_TMA1, 2: SIG_TMA}[len(k.tma_boxes)],
                    FP8_FEATURES if k.fp8 else FEATURES, block_m=k.block_m, max_rows=k.max_rows,
                    tma_boxes=k.tma_boxes, fp8=k.fp8, nope=k.nope)
    for name, k in _ks.KERNELS.items()
}
BACKENDS = ("auto", *FAMILIES)
# d_qk 512 (nope) problems: the build a backend name stands for (the nope builds stand for themselves).
NOPE_BUILDS = {"seesaw": "seesaw_nope", "mma": "mma_nope", "seesaw_bal_cp": "seesaw_nope_bal",
               **{n: n for n, f in FAMILIES.items() if f.nope},
               # experiment builds of seesaw_bal_cp (GQADRV_MLA_EXPERIMENTS=1): their seesaw_nope_bal twins
               **{n: twin for n in FAMILIES if n.startswith("seesaw_bal_cp_")
                  for twin in ["seesaw_nope_bal" + n.removeprefix("seesaw_bal_cp")] if twin in FAMILIES}}
# The cp.async seesaw builds and their balanced-grid forms (routed when the batch fills the SMs and no
# tensor map can describe k_cache: pages of 1..32 tokens, other strides, the sparse paths' lists).
BALANCED_CP = {"seesaw": "seesaw_bal_cp", "seesaw_nope": "seesaw_nope_bal"}


@dataclasses.dataclass(frozen=True)
class MlaVariant:
    family: MlaFamily
    dtype: str

    @property
    def name(self) -> str:
        return f"mla_decode_{self.family.name}_{self.dtype}"

    @property
    def defines(self) -> dict:
        return _ks.defines(self.dtype, self.family.name)

    @property
    def block(self) -> tuple[int, int, int]:
        return (_ks.kernel(self.family.name).threads, 1, 1)

    @property
    def dynamic_smem(self) -> int:
        return _ks.dynamic_smem_bytes(variant=self.family.name)


_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a", (11, 0): "sm_110a"}


def backend_for_cc(cc: tuple[int, int]) -> str:
    """'seesaw' on sm_90 (measured fastest on the H200 for every h_q, docs/MLA.md); 'mma' on sm_100 /
    sm_110, where wgmma does not exist (compile-verified only). The kernels need ~226 KB of shared
    memory per CTA, which rules out sm_8x and sm_12x."""
    if cc == (9, 0):
        return "seesaw"
    if cc in ((10, 0), (11, 0)):
        return "mma"
    raise RuntimeError(f"MLA decode needs compute capability 9.0, 10.0 or 11.0 (about 226 KB of shared memory "
                       f"per block); this GPU has {cc[0]}.{cc[1]}")


# Datasheet DRAM bytes per second per SM from which the narrow kernels serve M <= 16 packed rows. Measured
# (docs/RESULTS.md): on the H200 (4.9e12 B/s, 132 SMs: 37 GB/s per SM) narrow16_bal / narrow16x2_tma
# are 1.6-8.5 % faster than the seesaw routes at h_q 16; on the H100 SXM (3.35e12 B/s: 25 GB/s per SM)
# the seesaw routes are 1.7-3.3 % faster. The threshold lies between the two; other GPUs are untested.
NARROW_MIN_DRAM_PER_SM = 30e9


def narrow_preferred(peak_dram_bytes_per_s: float | None, sm_count: int) -> bool:
    """Whether M <= 16 takes the narrow kernels on this GPU (True when the bandwidth is unknown: the
    H200's routes)."""
    if not peak_dram_bytes_per_s or sm_count <= 0:
        return True
    return peak_dram_bytes_per_s / sm_count >= NARROW_MIN_DRAM_PER_SM


def select_variant(cc: tuple[int, int], dtype: str, m_rows: int, backend: str | None = None,
                   tma_ok: bool = False, fp8: bool = False, nope: bool = False, large_batch: bool = False,
                   narrow_ok: bool = True) -> MlaVariant:
    """The variant for a device and problem (``m_rows`` = s_q * h_q / h_kv); ``backend`` forces one.
    ``tma_ok``: k_cache is TMA-describable (kernel_spec.tma_eligible), so the seesaw runs as
    ``seesaw_tma`` unless the cp.async ``seesaw`` is forced, and as ``seesaw_bal`` (the balanced
    persistent grid) when ``large_batch`` (row blocks of all requests fill 3/4 of the SMs: the split
    grid would give every request one CTA however long it is). ``fp8``: k_cache is the 656-byte FP8
    format, read on sm_90 by ``narrow16_fp8`` (m_rows <= 16) or ``wide64_fp8`` (``seesaw_fp8`` when forced), on
    sm_100 / sm_110 by ``mma_fp8`` (also forced on sm_90). ``narrow_ok=False`` (``narrow_preferred`` of the
    GPU) routes m_rows <= 16 on TMA-describable bf16 / fp16 caches to the seesaw routes as well."""
    native = backend_for_cc(cc)
    forced = check_choice("backend", backend, BACKENDS)
    name = native if forced in (None, "auto") else forced
    if fp8:
        if forced in (None, "auto"):
            name = native + "_fp8"
            if name == "seesaw_fp8":  # tokens-as-M kernels that dequantize into register fragments (MLA.md)
                name = "narrow16_fp8" if m_rows <= FAMILIES["narrow16_fp8"].max_rows else "wide64_fp8"
        elif not FAMILIES[name].fp8:
            fp8_names = sorted(n for n, f in FAMILIES.items() if f.fp8)
            raise ValueError(f"MLA backend {name!r} reads bf16 / fp16 caches; with is_fp8_kvcache=True use 'auto' or "
                             f"one of {fp8_names}")
    elif FAMILIES[name].fp8:
        raise ValueError(f"MLA backend {name!r} reads the 656-byte FP8 cache: pass is_fp8_kvcache=True with it")
    elif nope:
        if name not in NOPE_BUILDS:
            raise ValueError(f"MLA backend {name!r} reads 576-channel rows; d_qk 512 is served by "
                             f"{sorted(NOPE_BUILDS)} (or 'auto')")
        name = NOPE_BUILDS[name]
    elif FAMILIES[name].nope:
        raise ValueError(f"MLA backend {name!r} is the d_qk 512 build; it is chosen by d_qk, not by name")
    if name == "seesaw" and forced in (None, "auto") and tma_ok and not nope:
        if narrow_ok and m_rows <= FAMILIES["narrow16_bal"].max_rows:  # tokens as wgmma M, two consumer warpgroups
            name = "narrow16_bal" if large_batch else "narrow16x2_tma"
        else:
            name = "seesaw_bal" if large_batch else "seesaw_tma"
    elif name in BALANCED_CP and forced in (None, "auto") and large_batch:
        name = BALANCED_CP[name]  # the cp.async seesaw on the balanced grid
    fam = FAMILIES[name]
    if fam.tma and not tma_ok:
        raise ValueError(f"MLA backend {name!r} needs a TMA-describable k_cache: pages of {_ks.TMA_MIN_PAGE}..256 "
                         "tokens, a 16-byte aligned base and strides that are multiples of 16 bytes")
    arch = _ARCH[cc]
    if arch not in fam.arches:
        raise RuntimeError(f"MLA backend {name!r} is not built for {arch} (built for {', '.join(fam.arches)})")
    if fam.max_rows is not None and m_rows > fam.max_rows:
        raise ValueError(f"MLA backend {name!r} serves at most {fam.max_rows} query rows per KV head "
                         f"(s_q * h_q / h_kv), this problem has {m_rows}")
    return MlaVariant(fam, dtype)


def variants_for_arch(arch: str) -> list[MlaVariant]:
    return [MlaVariant(f, dt) for f in FAMILIES.values() if arch in f.arches
            for dt in (("bfloat16",) if f.fp8 or f.nope else ("float16", "bfloat16"))]


def default_splits(variant: MlaVariant, b: int, s_q: int, h_q: int, h_kv: int, capacity: int, sm_count: int) -> int:
    """Splits per (request, KV head, row block) from host-known sizes only, never the lengths, so
    a prepared launch stays valid for any lengths (see kernel_spec.choose_num_splits)."""
    return _ks.choose_num_splits(b, s_q, h_q, h_kv, capacity, sm_count, variant=variant.family.name)
