"""Deterministic oracle grids of the GQA decode with FP8-e4m3 KV caches (``gqa_decode_paged`` /
``prepare_gqa_decode_paged`` with ``kv_dtype`` / ``k_scale`` / ``v_scale``, and the contiguous
``gqa_decode`` / ``prepare_gqa_decode`` that route FP8 caches to the paged family).

Paged grid (``grid()``, N_CASES cases; the axes of tests/gqa/paged_cases.py plus the FP8 ones):
kv_layout NHD / HND x separate / combined K-V, page size 1..256, s_q {1, 2, 4, 7, 16} (s_q = 1 also
as 3-D q), group {1, 4, 8, 16} with 1..4 KV heads, head dim {64, 128, 256}, fp16 / bf16 q, ragged
lengths (each case has one of 0, negative, > capacity, = capacity), num_splits {None, 1, 2, 3, 5,
8}, deterministic, convenience / prepared call, softmax scale spelling, LSE (none / return_lse /
given buffer), out given, pools (dense, offset, strided, K / V halves of one array), tables (dense,
column slices of wider tables), shared pages, backend (auto / "portable" = cp.async), and
  * k_scale and v_scale forms, drawn independently: none (1.0), a host float, a float32 device array
    of shape () or (1,) (per tensor), or of shape (Hkv,) (per KV head);
  * the cache type: uint8 codes or int8 codes with kv_dtype spelled "e4m3" / "float8_e4m3fn" /
    "E4M3", or (a few cases, skipped where torch or its float8 DLPack export is missing) a torch
    float8_e4m3fn tensor without kv_dtype, every argument of those cases then a torch tensor;
  * codes: e4m3 quantization of random normal data with the case's scales (per-head magnitudes differ;
    the host float and device per-tensor scales are amax / 448, the per-head ones the heads' amax /
    448), and in a third of the cases 5% of the codes replaced by the special sets: saturation +-448
    (0x7E / 0xFE), zeros (0x00 / 0x80), subnormals (0x01..0x07, 0x81..0x87), plus a whole token of
    zeros per request and (scaled K only) a whole saturated K token;
  * poison: unused pages, tail slots of last pages and pool padding hold the NaN codes (all 0x7F, or
    0x7F / 0xFF alternating over the channels); table entries past a request's pages TABLE_POISON.
    The integer conversion reads NaN codes as +-480 (finite), so a leak there shows as a wrong value,
    not as NaN: the poison keys are the largest the format can hold and dominate any row that reads
    them (the cvt conversion makes them NaN, which the finiteness check catches).
Capacity <= MAX_CAPACITY tokens, B <= 6 and B * Hq * s_q * capacity * D <= WORK_MAX keep the host
quantization, the float64 oracle and the device time small.

Contiguous grid (``contiguous_grid()``, N_CONTIG cases): kv [B, 2, Hkv, C, D] codes with C not a
power of two in most cases, 3-D and 4-D q, gqa_decode / prepare_gqa_decode, the same scale forms,
LSE modes and special codes; NaN codes past each length.

Oracle: gqa_decode_paged_reference (float64) on the DEQUANTIZED caches, float64(code value) *
float64(float32 scale) per KV head (NaN in the poisoned slots, which the oracle never reads).

Tolerances (|out - oracle| <= TOL + TOL * |oracle|): the kernels turn codes into fp16 exactly
(integer ops giving value * 2^-8, or cvt.rn.f16x2.e4m3x2 on sm_89+), fold the scales into fp32
score / output factors, multiply in fp16 MMAs with fp32 accumulation and round P to fp16 for the
P.V MMA (2^-11 relative); bf16 q is scaled by a power of
two per row and converted to fp16 exactly (for finite rows whose smallest elements stay above
2^-28 of the largest). So bf16 q is as accurate as fp16 q except for the bf16 rounding of the output
(2^-9 relative, within TOL's relative part), and both get the fp16 grid's fp16 tolerance, 1e-2
(tests/gqa/paged_cases.py gives bf16 2e-2 only because its P is rounded to bf16). LSE: the row sums
are accumulated in fp32 before P is rounded; the fp16 grid's fp16 bounds (2e-3 absolute, 1e-3
relative for the fp32 scores, which can reach ~1e2 here with saturated keys) apply to both dtypes.
V magnitudes stay O(1) (the absolute error of the P rounding scales with |V|).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gqadrv.gqa.fp8_reference import computed_scale, quantize_kv_fp8_reference
from gqadrv.gqa.reference import (
    TABLE_POISON,
    gqa_decode_paged_reference,
    paged_kv_from_contiguous,
)
from gqadrv.ops.fp8 import e4m3_from_f32, e4m3_to_f32
from tests.gqa.paged_cases import (
    CALLS,
    DTYPES,
    GROUPS,
    HEAD_DIMS,
    LAYOUTS,
    LSE_MODES,
    ORDINARY_LENGTHS,
    PAGES,
    POOLS,
    S_QS,
    SCALES,
    SPECIAL_LENGTHS,
    SPLITS,
    TABLES,
    PagedCase,
    _balanced,
    _length,
    _table_view,
    np_dtype,
    scale_kwargs,
)

__all__ = [
    "LSE_ATOL",
    "LSE_RTOL",
    "N_CASES",
    "N_CONTIG",
    "SCALE_FORMS",
    "SPECIAL_CODES",
    "TOL",
    "ContigCase",
    "Fp8Case",
    "check_fp8",
    "contiguous_grid",
    "contiguous_host_case",
    "dequantize",
    "device_case",
    "grid",
    "host_case",
    "quantize",
    "scale_arg",
]

N_CASES = 240
N_CONTIG = 20
MAX_CAPACITY = 2048
WORK_MAX = 1 << 24          # B * Hq * s_q * capacity * D (half the fp16 grid's: the host quantizes too)
TOL = {"float16": 1e-2, "bfloat16": 1e-2}
LSE_ATOL = {"float16": 2e-3, "bfloat16": 2e-3}
LSE_RTOL = 1e-3

SCALE_FORMS = ("none", "float", "dev0", "dev1", "head")   # None, host float, device (), (1,), (Hkv,)
CACHES = ("uint8",) * 5 + ("int8",) * 2 + ("uint8",) * 4 + ("torch",)   # 1 in 12 a torch float8 tensor
KV_DTYPE_NAMES = ("e4m3", "e4m3", "float8_e4m3fn", "E4M3")
CODE_SETS = ("random", "random", "special")
POISONS = ("nan", "alt")                                  # all 0x7F, or 0x7F / 0xFF over the channels
BACKENDS = (None, None, None, "portable")
SATURATION = (0x7E, 0xFE)
SPECIAL_CODES = np.array(SATURATION + (0x00, 0x80) + tuple(range(0x01, 0x08)) + tuple(range(0x81, 0x88)), np.uint8)
SPECIAL_FRACTION = 0.05
NAN_CODE = 0x7F


# ----------------------------------------------------------------------------- codes and scales
def quantize(x: np.ndarray, form: str, head_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes of float32 ``x``, float32 scale per head [H]) for a scale form: scale 1 ("none"),
    amax / 448 of the tensor (the per-tensor forms) or of each head ("head")."""
    H = x.shape[head_axis]
    if form == "none":
        return e4m3_from_f32(x.astype(np.float32)), np.ones(H, np.float32)
    if form == "head":
        s = np.array([computed_scale(np.take(x, h, axis=head_axis)) for h in range(H)], np.float32)
        return quantize_kv_fp8_reference(x, s, head_axis=head_axis)[0], s
    s0 = computed_scale(x)
    return quantize_kv_fp8_reference(x, s0)[0], np.full(H, s0, np.float32)


def dequantize(codes: np.ndarray, scale: np.ndarray, head_axis: int) -> np.ndarray:
    """float64 code value * float32 scale of the code's KV head (NaN codes -> NaN)."""
    shape = [1] * codes.ndim
    shape[head_axis] = -1
    return e4m3_to_f32(codes).astype(np.float64) * np.asarray(scale, np.float64).reshape(shape)


def scale_arg(form: str, scale: np.ndarray, upload):
    """The k_scale / v_scale argument of a form (``upload``: host float32 array -> device array)."""
    if form == "none":
        return None
    if form == "float":
        return float(scale[0])
    if form == "dev0":
        return upload(np.array(scale[0], np.float32))
    if form == "dev1":
        return upload(np.array(scale[:1], np.float32))
    return upload(np.ascontiguousarray(scale, np.float32))


def sprinkle_specials(codes: np.ndarray, rng, token_axis: int, lengths, saturate: bool,
                      saturate_token: bool) -> None:
    """Replace SPECIAL_FRACTION of ``codes`` [B, ...] (in place) by special codes (saturation only
    when ``saturate``), and in every request with keys one whole token below its length by zeros
    (+0 / -0) and, with ``saturate_token``, another by +-448."""
    pool = SPECIAL_CODES if saturate else SPECIAL_CODES[len(SATURATION):]
    mask = rng.random(codes.shape) < SPECIAL_FRACTION
    codes[mask] = rng.choice(pool, size=int(mask.sum()))
    T = codes.shape[token_axis]
    token_shape = tuple(n for a, n in enumerate(codes.shape) if a not in (0, token_axis))
    fills = [np.array([0x00, 0x80], np.uint8)] + ([np.array(SATURATION, np.uint8)] if saturate_token else [])
    for b, n in enumerate(lengths):
        n = min(max(int(n), 0), T)
        for fill in fills if n else ():
            idx = [slice(None)] * codes.ndim
            idx[0], idx[token_axis] = b, int(rng.integers(0, n))
            codes[tuple(idx)] = rng.choice(fill, size=token_shape)


def poison_codes(shape: tuple, kind: str) -> np.ndarray:
    """NaN codes: all 0x7F ("nan"), or 0x7F on even and 0xFF on odd channels ("alt")."""
    p = np.full(shape, NAN_CODE, np.uint8)
    if kind == "alt":
        p[..., 1::2] = 0xFF
    return p


# ----------------------------------------------------------------------------- the paged grid
@dataclasses.dataclass(frozen=True)
class Fp8Case(PagedCase):
    """A case of the fp16 paged grid's axes (PagedCase; ``dtype`` is q's and the output's) plus the
    e4m3 ones."""
    k_form: str
    v_form: str
    cache: str          # "uint8", "int8" (codes + kv_dtype) or "torch" (float8_e4m3fn, every input torch)
    kv_dtype: str | None
    codes: str          # "random" or "special"
    backend: str | None

    @property
    def id(self) -> str:
        return (f"{super().id}-k{self.k_form}-v{self.v_form}-{self.cache}"
                f"{'' if self.kv_dtype is None else ':' + self.kv_dtype}-{self.codes}{'-portable' if self.backend else ''}")


@functools.cache
def grid() -> tuple[Fp8Case, ...]:
    n = N_CASES
    ax = {name: _balanced(vals, n, 5000 + i) for i, (name, vals) in enumerate([
        ("layout", LAYOUTS), ("combined", (False, True)), ("page", PAGES), ("s_q", S_QS), ("group", GROUPS),
        ("d", HEAD_DIMS), ("dtype", DTYPES), ("splits", SPLITS), ("call", CALLS), ("scale", SCALES),
        ("lse", LSE_MODES), ("special", SPECIAL_LENGTHS), ("table", TABLES), ("pool", POOLS),
        ("batch", (1, 2, 3, 4, 5, 6, 3, 4, 5)), ("hkv", (1, 2, 3, 4)), ("q3d", (False, True)),
        ("det", (False, False, False, True)), ("share", (False, True, True)), ("poison", POISONS),
        ("out", (False, True)), ("k_form", SCALE_FORMS), ("v_form", SCALE_FORMS), ("cache", CACHES),
        ("kv_dtype", KV_DTYPE_NAMES), ("codes", CODE_SETS), ("backend", BACKENDS)])}
    rng = np.random.default_rng(20261202)
    cases = []
    for i in range(n):
        page, s_q, d, hkv, group, B = ax["page"][i], ax["s_q"][i], ax["d"][i], ax["hkv"][i], ax["group"][i], \
            ax["batch"][i]
        hq = group * hkv
        top = MAX_CAPACITY // page
        max_pages = max(1, round(2 ** rng.uniform(0, math.log2(top)))) if top > 1 else 1
        per_token = hq * s_q * page * d
        while B > 2 and B * max_pages * per_token > WORK_MAX:
            B -= 1
        while max_pages > 1 and B * max_pages * per_token > WORK_MAX:
            max_pages = max(1, max_pages // 2)
        while B > 1 and B * max_pages * per_token > WORK_MAX:
            B -= 1
        cap = max_pages * page
        kinds = [str(rng.choice(ORDINARY_LENGTHS)) for _ in range(B)]
        kinds[int(rng.integers(0, B))] = ax["special"][i]
        lengths = tuple(_length(k, cap, page, s_q, rng) for k in kinds)
        share = []
        if ax["share"][i]:
            clamped = [min(max(x, 0), cap) for x in lengths]
            for dst in range(1, B):
                m = min(clamped[dst - 1] // page, -(-clamped[dst] // page))
                if m >= 1:
                    share.append((dst, dst - 1, int(rng.integers(1, m + 1))))
        splits, det = ax["splits"][i], ax["det"][i]
        if det:
            splits = None
        combined, pool, call = ax["combined"][i], ax["pool"][i], ax["call"][i]
        if combined and pool == "kvpair":
            pool = "strided"
        cache = ax["cache"][i]
        cases.append(Fp8Case(
            idx=i, layout=ax["layout"][i], combined=combined, page=page, s_q=s_q, q3d=s_q == 1 and ax["q3d"][i],
            group=group, hkv=hkv, d=d, dtype=ax["dtype"][i], max_pages=max_pages, lengths=lengths,
            share=tuple(share), extra_pages=int(rng.integers(1, 4)), splits=splits, call=call, deterministic=det,
            scale=ax["scale"][i], lse_mode=ax["lse"][i], out_given=call == "convenience" and ax["out"][i],
            poison=ax["poison"][i], pool=pool, table=ax["table"][i], k_form=ax["k_form"][i],
            v_form=ax["v_form"][i], cache=cache, kv_dtype=None if cache == "torch" else ax["kv_dtype"][i],
            codes=ax["codes"][i], backend=ax["backend"][i]))
    return tuple(cases)


@dataclasses.dataclass
class HostFp8Case:
    case: object
    q: np.ndarray                # q's dtype, q's shape
    k_codes: np.ndarray          # uint8 paged cache (combined: [P, 2, ...] with V inside)
    v_codes: np.ndarray | None
    block_table: np.ndarray | None
    seq_lens: np.ndarray
    k_scale: np.ndarray          # float32 [Hkv] (the per-tensor forms repeat one value)
    v_scale: np.ndarray
    k_deq: np.ndarray            # float64 dequantized K / V pages (separate even for a combined cache)
    v_deq: np.ndarray
    ref_out: np.ndarray
    ref_lse: np.ndarray


def _magnitudes(rng, hkv: int, lo: float, hi: float, head_lo: float, head_hi: float) -> np.ndarray:
    """Per-head standard deviations: a log-uniform tensor magnitude times per-head factors."""
    return (math.exp(rng.uniform(math.log(lo), math.log(hi))) * rng.uniform(head_lo, head_hi, size=hkv)).astype(
        np.float32)


def _kv_data(rng, shape: tuple, head_axis: int, token_axis: int, lengths, k_form: str, v_form: str,
             special: bool):
    """Quantized K and V ([B, ...] contiguous per request) and their per-head scales. K magnitudes
    0.5..3 (softmax from flat to peaked), V 0.5..1.5 (outputs O(1))."""
    hkv = shape[head_axis]
    bshape = [1] * len(shape)
    bshape[head_axis] = hkv
    out = []
    for form, mags in ((k_form, _magnitudes(rng, hkv, 0.5, 3.0, 0.5, 1.5)),
                       (v_form, _magnitudes(rng, hkv, 0.5, 1.5, 0.6, 1.4))):
        x = rng.standard_normal(shape, dtype=np.float32) * mags.reshape(bshape)
        out.append(quantize(x, form, head_axis))
    (kc, ks), (vc, vs) = out
    if special:
        # scale 1 makes +-448 keys / values literal 448s: V keeps them out (outputs stay O(1)), K only
        # gets the sprinkled ones (a saturated token would take every row's whole softmax)
        sprinkle_specials(kc, rng, token_axis, lengths, saturate=True, saturate_token=k_form != "none")
        sprinkle_specials(vc, rng, token_axis, lengths, saturate=v_form != "none", saturate_token=False)
    return kc, ks, vc, vs


def _head_axis(layout: str) -> int:
    """The KV-head axis of K or V pages: [P, page, Hkv, D] (NHD) or [P, Hkv, page, D] (HND)."""
    return 2 if layout == "NHD" else 1


def host_case(case: Fp8Case) -> HostFp8Case:
    """Host inputs of a paged case (codes, scales, poisoned pools, table) and the float64 oracle on the
    dequantized caches."""
    rng = np.random.default_rng(104729 + case.idx)
    dt = np_dtype(case.dtype)
    B, cap = case.batch, case.capacity
    q = rng.standard_normal((B, case.s_q, case.hq, case.d), dtype=np.float32).astype(dt)
    if case.q3d:
        q = q[:, 0].copy()
    kc, ks, vc, vs = _kv_data(rng, (B, cap, case.hkv, case.d), 2, 1, case.lengths, case.k_form, case.v_form,
                              case.codes == "special")
    # scatter the code values as float32 (NaN marks what no request uses), then poison with NaN codes
    kf, vf, bt = paged_kv_from_contiguous(kc.astype(np.float32), vc.astype(np.float32), case.lengths, case.page,
                                          kv_layout=case.layout, combined=case.combined, max_pages=case.max_pages,
                                          extra_pages=case.extra_pages, share=case.share, rng=rng, fill=np.nan)

    def codes_of(f):
        if f is None:
            return None
        c = np.where(np.isnan(f), 0, f).astype(np.uint8)
        return np.where(np.isnan(f), poison_codes(f.shape, case.poison), c)

    k_codes, v_codes = codes_of(kf), codes_of(vf)
    ha = _head_axis(case.layout)
    if case.combined:
        k_deq, v_deq = dequantize(k_codes[:, 0], ks, ha), dequantize(k_codes[:, 1], vs, ha)
    else:
        k_deq, v_deq = dequantize(k_codes, ks, ha), dequantize(v_codes, vs, ha)
    lens = np.array(case.lengths, np.int32)
    ref_out, ref_lse = gqa_decode_paged_reference(q, k_deq, v_deq, bt, lens, kv_layout=case.layout,
                                                  **case.scale_kwargs())
    return HostFp8Case(case, q, k_codes, v_codes, bt, lens, ks, vs, k_deq, v_deq, ref_out, ref_lse)


@dataclasses.dataclass
class DeviceFp8Case:
    q: object
    k_cache: object
    v_cache: object
    block_table: object
    seq_lens: object
    k_scale: object
    v_scale: object
    kv_dtype: str | None
    keep: tuple


def _pool_views(case, kc: np.ndarray, vc: np.ndarray | None, upload):
    """Device views of the code caches per the case's pool mode; the rest of each pool is poison."""
    P = kc.shape[0]
    if case.pool == "kvpair" and vc is not None:
        pair = poison_codes((P, 2) + kc.shape[1:], case.poison)
        pair[:, 0], pair[:, 1] = kc, vc
        d = upload(pair)
        return d[:, 0], d[:, 1], (d,)
    out, keep = [], []
    for c in (kc, vc):
        if c is None:
            out.append(None)
            continue
        if case.pool == "dense":
            d = upload(c)
            out.append(d)
            keep.append(d)
            continue
        off = 1 + case.idx % 3
        step = 1 if case.pool == "offset" else 2 + case.idx % 2
        big = poison_codes((off + P * step + 1,) + c.shape[1:], case.poison)
        big[off: off + P * step: step] = c
        d = upload(big)
        out.append(d[off: off + P * step: step])
        keep.append(d)
    return out[0], out[1], tuple(keep)


def uploaders(framework: str, cache: str):
    """(upload of any host array, upload of a uint8 code array as the case's cache type). CuPy
    uploads by default; "torch" wraps CuPy uploads with torch.from_dlpack (float8 caches as a view);
    "numpy" keeps host arrays (CPU checks of the views)."""
    if framework == "numpy":
        return np.array, (lambda a: a.view(np.int8)) if cache == "int8" else np.array
    from tests.helpers import to_device

    if framework == "torch":
        import ml_dtypes
        import torch

        def up(a):
            if a.dtype == np.dtype(ml_dtypes.bfloat16):   # through uint16: no bf16 DLPack needed
                return torch.from_dlpack(to_device(a.view(np.uint16))).view(torch.bfloat16)
            return torch.from_dlpack(to_device(a))

        return up, lambda a: up(a).view(torch.float8_e4m3fn)
    return to_device, (lambda a: to_device(a).view(np.int8)) if cache == "int8" else to_device


def device_case(h: HostFp8Case, framework: str | None = None) -> DeviceFp8Case:
    """Device arrays of a paged host case (CuPy; torch for torch cases; ``framework="numpy"`` gives host
    views for CPU tests)."""
    case = h.case
    fw = framework or ("torch" if case.cache == "torch" else "cupy")
    up, up_cache = uploaders(fw, case.cache)
    k, v, keep = _pool_views(case, h.k_codes, h.v_codes, up_cache)
    bt, wide = _table_view(case, h.block_table, up)
    return DeviceFp8Case(up(h.q), k, v, bt, up(h.seq_lens), scale_arg(case.k_form, h.k_scale, up),
                         scale_arg(case.v_form, h.v_scale, up), case.kv_dtype, keep + (wide,))


# ----------------------------------------------------------------------------- the contiguous grid
@dataclasses.dataclass(frozen=True)
class ContigCase:
    idx: int
    dtype: str
    d: int
    hkv: int
    group: int
    C: int
    s_q: int
    q3d: bool
    lengths: tuple
    call: str           # "convenience" (gqa_decode) or "prepared" (prepare_gqa_decode + launch_prepared)
    lse_mode: str
    deterministic: bool
    k_form: str
    v_form: str
    cache: str          # "uint8" or "int8"
    kv_dtype: str
    codes: str
    scale: str
    backend: str | None

    @property
    def hq(self) -> int:
        return self.group * self.hkv

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def wants_lse(self) -> bool:
        return self.lse_mode != "none"

    @property
    def id(self) -> str:
        q = "q3" if self.q3d else f"s{self.s_q}"
        return (f"c{self.idx:02d}-C{self.C}-{q}-h{self.hq}/{self.hkv}-d{self.d}{self.dtype[0]}-{self.call[:4]}"
                f"-lse{self.lse_mode}{'-det' if self.deterministic else ''}-k{self.k_form}-v{self.v_form}"
                f"-{self.cache}:{self.kv_dtype}-{self.codes}-{self.scale}{'-portable' if self.backend else ''}")

    def scale_kwargs(self) -> dict:
        return scale_kwargs(self.scale)


CONTIG_CAPACITIES = (64, 77, 300, 1000, 1536)


@functools.cache
def contiguous_grid() -> tuple[ContigCase, ...]:
    n = N_CONTIG
    ax = {name: _balanced(vals, n, 7000 + i) for i, (name, vals) in enumerate([
        ("dtype", DTYPES), ("d", HEAD_DIMS), ("hkv", (1, 2, 4, 8)), ("group", GROUPS), ("C", CONTIG_CAPACITIES),
        ("s_q", S_QS), ("q3d", (False, True)), ("call", CALLS), ("lse", LSE_MODES),
        ("det", (False, False, False, True)), ("k_form", SCALE_FORMS), ("v_form", SCALE_FORMS),
        ("cache", ("uint8", "uint8", "int8")), ("kv_dtype", KV_DTYPE_NAMES), ("codes", CODE_SETS),
        ("scale", SCALES), ("backend", BACKENDS)])}
    rng = np.random.default_rng(20261203)
    cases = []
    for i in range(n):
        C, s_q, B = ax["C"][i], ax["s_q"][i], 4 + i % 3
        hq = ax["group"][i] * ax["hkv"][i]
        while C > CONTIG_CAPACITIES[0] and B * hq * s_q * C * ax["d"][i] > WORK_MAX:   # a smaller capacity
            C = max(c for c in CONTIG_CAPACITIES if c < C)
        kinds = ["full", "zero", "short", "over", "negative", "random"][:B]
        lengths = tuple(_length(k, C, 1, s_q, rng) if k != "over" else C + 5 for k in kinds)
        cases.append(ContigCase(
            idx=i, dtype=ax["dtype"][i], d=ax["d"][i], hkv=ax["hkv"][i], group=ax["group"][i], C=C, s_q=s_q,
            q3d=s_q == 1 and ax["q3d"][i], lengths=lengths, call=ax["call"][i], lse_mode=ax["lse"][i],
            deterministic=ax["det"][i], k_form=ax["k_form"][i], v_form=ax["v_form"][i], cache=ax["cache"][i],
            kv_dtype=ax["kv_dtype"][i], codes=ax["codes"][i], scale=ax["scale"][i], backend=ax["backend"][i]))
    return tuple(cases)


@dataclasses.dataclass
class ContigHost:
    case: ContigCase
    q: np.ndarray
    kv_codes: np.ndarray         # uint8 [B, 2, Hkv, C, D], NaN codes past each length
    seq_lens: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    kv_deq: np.ndarray           # float64 [B, 2, Hkv, C, D]
    ref_out: np.ndarray
    ref_lse: np.ndarray


def contiguous_host_case(case: ContigCase) -> ContigHost:
    rng = np.random.default_rng(3571 + case.idx)
    B, C = case.batch, case.C
    q = rng.standard_normal((B, case.s_q, case.hq, case.d), dtype=np.float32).astype(np_dtype(case.dtype))
    if case.q3d:
        q = q[:, 0].copy()
    kc, ks, vc, vs = _kv_data(rng, (B, case.hkv, C, case.d), 1, 2, case.lengths, case.k_form, case.v_form,
                              case.codes == "special")
    kv = np.stack([kc, vc], axis=1)
    for b, n in enumerate(case.lengths):
        n = min(max(int(n), 0), C)
        kv[b, :, :, n:] = poison_codes(kv[b, :, :, n:].shape, "alt" if b % 2 else "nan")
    deq = np.stack([dequantize(kv[:, 0], ks, 1), dequantize(kv[:, 1], vs, 1)], axis=1)
    lens = np.array(case.lengths, np.int32)
    # the contiguous cache is the combined HND layout with one page of C tokens per request
    ref_out, ref_lse = gqa_decode_paged_reference(q, deq, None, np.arange(B, dtype=np.int32)[:, None], lens,
                                                  kv_layout="HND", **case.scale_kwargs())
    return ContigHost(case, q, kv, lens, ks, vs, deq, ref_out, ref_lse)


# ----------------------------------------------------------------------------- checks
def check_fp8(got_out, got_lse, h_out: np.ndarray, h_lse: np.ndarray | None, dtype: str, label: str,
              record: bool = True) -> float:
    """out: finite everywhere, exactly 0 on rows without a key, within TOL of the oracle; lse (when
    given): +inf exactly on rows without a key, finite elsewhere, within LSE_ATOL / LSE_RTOL. The
    largest errors go to the end-of-run report when ``record``. Returns max |out - oracle|."""
    from tests.helpers import record_error

    g = np.asarray(got_out).astype(np.float64)
    assert g.shape == h_out.shape, f"{label}: out shape {g.shape} != {h_out.shape}"
    assert np.all(np.isfinite(g)), f"{label}: {int((~np.isfinite(g)).sum())} non-finite out elements"
    tol = TOL[dtype]
    err = np.abs(g - h_out)
    bad = err > tol + tol * np.abs(h_out)
    assert not bad.any(), (f"{label}: {int(bad.sum())} out elements off, max err {err.max():.3e} at "
                           f"{np.unravel_index(err.argmax(), err.shape)}")
    emax = float(err.max()) if err.size else 0.0
    if record:
        record_error(f"paged fp8 {label} out {dtype}", emax)
    if h_lse is None:
        return emax
    empty = np.isposinf(h_lse)
    assert np.all(g[empty] == 0.0), f"{label}: rows without a key are not exactly 0"
    if got_lse is None:
        return emax
    gl = np.asarray(got_lse).astype(np.float64)
    assert gl.shape == h_lse.shape, f"{label}: lse shape {gl.shape} != {h_lse.shape}"
    assert np.array_equal(np.isposinf(gl), empty), \
        f"{label}: lse +inf on rows {np.argwhere(np.isposinf(gl) != empty)[:8].tolist()} differs"
    assert np.all(np.isfinite(gl[~empty])), f"{label}: non-finite lse on rows with keys"
    lerr = np.abs(gl[~empty] - h_lse[~empty])
    lbad = lerr > LSE_ATOL[dtype] + LSE_RTOL * np.abs(h_lse[~empty])
    assert not lbad.any(), f"{label}: {int(lbad.sum())} lse values off, max err {lerr.max():.3e}"
    if record:
        record_error(f"paged fp8 {label} lse {dtype}", float(lerr.max()) if lerr.size else 0.0)
    return emax


def unused_table_entries_poisoned(h: HostFp8Case) -> bool:
    """Every table entry past a request's used pages holds TABLE_POISON."""
    c = h.case
    for b, n in enumerate(h.seq_lens):
        used = -(-min(max(int(n), 0), c.capacity) // c.page)
        if not np.all(h.block_table[b, used:] == TABLE_POISON):
            return False
    return True
