"""Deterministic oracle grid of paged GQA decode (``gqa_decode_paged`` / ``prepare_gqa_decode_paged``).

Axes (each value appears many times; tests/gqa/test_paged_reference_host.py checks the counts):
kv_layout NHD / HND x separate / combined K-V, page size 1..256, s_q {1, 2, 4, 7, 16} (s_q = 1 also
as 3-D q), group {1, 4, 8, 16} with 1..4 KV heads, head dim {64, 128, 256}, fp16 / bf16, ragged
lengths (every case has one of 0, negative, > capacity or = capacity; plus page edges, lengths
shorter than s_q that leave causal rows empty, int32 extremes), num_splits {None, 1, 2, 3, 5, 8},
convenience or prepared call, deterministic, scale spelling (default, q_scale, sm_scale), LSE
(not asked / return_lse / given buffer), out given or not, NaN or Inf poison.

Every axis is a balanced sequence shuffled by its own seeded generator (a value count differs by at
most one from another's), so the combinations vary and the grid never changes between runs.
Every case's cache: request pages at shuffled physical indices, some shared between requests
(prefix sharing), a few pages nobody references, unused pages and tail slots poisoned (NaN or
+-Inf), table entries past each request's pages 2147480000; on the device some tables are a column
slice of a wider int32 array and some caches a page slice of a bigger pool (offset, dim-0 stride
of 2-3 pages, or K and V as the two halves of one [num_pages, 2, ...] array).
Capacity <= 2048 tokens, B <= 6, and B * Hq * s_q * capacity * D <= WORK_MAX keep the float64
oracle and the device time of the whole grid small.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gqadrv.gqa.reference import (
    TABLE_POISON,
    gqa_decode_paged_reference,
    paged_kv_from_contiguous,
)

LAYOUTS = ("NHD", "HND")
PAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
S_QS = (1, 2, 4, 7, 16)
GROUPS = (1, 4, 8, 16)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
SPLITS = (None, 1, 2, 3, 5, 8)
CALLS = ("convenience", "prepared")
SCALES = ("default", "q_scale", "sm_scale")
LSE_MODES = ("none", "return", "given")   # prepared: "return" = "given" (launch_prepared returns lse when given)
POOLS = ("dense", "offset", "strided", "kvpair")  # kvpair: separate K / V as [:, 0] / [:, 1] of one array
TABLES = ("dense", "wide", "wide_offset")
SPECIAL_LENGTHS = ("zero", "negative", "over", "full")  # one request of every case gets one of these
N_CASES = 450
MAX_CAPACITY = 2048
WORK_MAX = 1 << 25   # B * Hq * s_q * capacity * D (float64 oracle ~4x that in flops)
Q_SCALE = 1.5
SM_SCALE = 0.07

# |out - oracle| <= TOL + TOL * |oracle| (the contiguous GQA grid's tolerances: fp16 inputs are exact in
# the oracle, the kernels accumulate in fp32 but round P to the input type for the P.V MMA: 2^-11
# relative for fp16, 2^-8 for bf16, plus the rounding of the output itself).
TOL = {"float16": 1e-2, "bfloat16": 2e-2}
# |lse - oracle| <= LSE_ATOL + LSE_RTOL * |oracle|. lse = m + ln(sum exp(s - m)) in fp32: the scores
# are fp32 dot products of exact inputs (relative error ~1e-6 of |s| <= ~10) and exp2 / log2 approximations
# (~2^-22 relative); the row sum may be accumulated from the P rounded for the MMA (unbiased rounding,
# at worst 2^-11 (fp16) / 2^-8 (bf16) relative, i.e. that much absolute on lse). Hence the absolute part
# ~4x the fp16 P rounding and ~2.5x the bf16 one, and a small relative part for the fp32 scores.
LSE_ATOL = {"float16": 2e-3, "bfloat16": 1e-2}
LSE_RTOL = 1e-3


@dataclasses.dataclass(frozen=True)
class PagedCase:
    idx: int
    layout: str        # "NHD" or "HND"
    combined: bool     # v_cache None, k_cache [num_pages, 2, ...]
    page: int
    s_q: int
    q3d: bool          # s_q == 1 given as [B, Hq, D]
    group: int
    hkv: int
    d: int
    dtype: str
    max_pages: int
    lengths: tuple
    share: tuple       # (dst, src, n) triples for paged_kv_from_contiguous
    extra_pages: int
    splits: int | None
    call: str
    deterministic: bool
    scale: str
    lse_mode: str
    out_given: bool    # convenience call with out=
    poison: str        # "nan" or "inf"
    pool: str
    table: str

    @property
    def hq(self) -> int:
        return self.group * self.hkv

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page

    @property
    def wants_lse(self) -> bool:
        return self.lse_mode != "none"

    @property
    def id(self) -> str:
        L = ",".join(map(str, self.lengths))
        q = "q3" if self.q3d else f"s{self.s_q}"
        return (f"{self.idx:03d}-{self.layout}{'c' if self.combined else 's'}-p{self.page}x{self.max_pages}-{q}"
                f"-h{self.hq}/{self.hkv}-d{self.d}{self.dtype[0]}-L[{L}]-{self.call[:4]}-S{self.splits}"
                f"{'-det' if self.deterministic else ''}-{self.scale}-lse{self.lse_mode}-{self.pool}-{self.table}"
                f"{'-share' if self.share else ''}{'-out' if self.out_given else ''}-{self.poison}")

    def scale_kwargs(self) -> dict:
        return scale_kwargs(self.scale)


def scale_kwargs(scale: str) -> dict:
    """The call keywords of a softmax-scale spelling (SCALES)."""
    if scale == "q_scale":
        return {"q_scale": Q_SCALE}
    if scale == "sm_scale":
        return {"sm_scale": SM_SCALE}
    return {}


def _balanced(values, n: int, seed: int) -> list:
    """``values`` repeated to length n, shuffled by a generator seeded with ``seed``."""
    seq = [values[i % len(values)] for i in range(n)]
    order = np.random.default_rng(seed).permutation(n)
    return [seq[i] for i in order]


def _length(kind: str, cap: int, page: int, s_q: int, rng) -> int:
    if kind == "zero":
        return 0
    if kind == "negative":
        return int(rng.choice([-1, -7, -(2**31)]))
    if kind == "over":
        return int(rng.choice([cap + 1, cap + page, cap + 1000, 2**31 - 1]))
    if kind == "full":
        return cap
    if kind == "one":
        return 1
    if kind == "short":  # fewer keys than query tokens: the first rows see no key
        return int(rng.integers(1, max(2, s_q)))
    if kind == "edge":   # around a page boundary
        k = int(rng.integers(1, cap // page + 1))
        return int(min(cap, max(1, k * page + int(rng.integers(-1, 2)))))
    return int(rng.integers(1, cap + 1))  # "random"


ORDINARY_LENGTHS = ("random", "random", "random", "edge", "edge", "short", "one", "full", "zero", "over")


@functools.cache
def grid() -> tuple[PagedCase, ...]:
    n = N_CASES
    ax = {name: _balanced(vals, n, 1000 + i) for i, (name, vals) in enumerate([
        ("layout", LAYOUTS), ("combined", (False, True)), ("page", PAGES), ("s_q", S_QS), ("group", GROUPS),
        ("d", HEAD_DIMS), ("dtype", DTYPES), ("splits", SPLITS), ("call", CALLS), ("scale", SCALES),
        ("lse", LSE_MODES), ("special", SPECIAL_LENGTHS), ("table", TABLES), ("pool", POOLS),
        ("batch", (1, 2, 3, 4, 5, 6, 3, 4, 5)), ("hkv", (1, 2, 3, 4)), ("q3d", (False, True)),
        ("det", (False, False, False, True)), ("share", (False, True, True)), ("poison", ("nan", "nan", "inf")),
        ("out", (False, True))])}
    rng = np.random.default_rng(20261201)
    cases = []
    for i in range(n):
        page, s_q, d, hkv = ax["page"][i], ax["s_q"][i], ax["d"][i], ax["hkv"][i]
        group = ax["group"][i]
        B = ax["batch"][i]
        hq = group * hkv
        # capacity: log-uniform number of pages up to MAX_CAPACITY tokens, then within the work budget
        top = MAX_CAPACITY // page
        max_pages = max(1, round(2 ** rng.uniform(0, math.log2(top)))) if top > 1 else 1
        per_token = hq * s_q * page * d  # work = B * max_pages * per_token
        while B > 2 and B * max_pages * per_token > WORK_MAX:  # fewer requests first: keep long capacities
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
                full_src = clamped[dst - 1] // page
                n_dst = -(-clamped[dst] // page)
                m = min(full_src, n_dst)
                if m >= 1:
                    share.append((dst, dst - 1, int(rng.integers(1, m + 1))))
        splits, det = ax["splits"][i], ax["det"][i]
        if det:
            splits = None  # deterministic chooses its own split (no explicit count with it)
        combined = ax["combined"][i]
        pool = ax["pool"][i]
        if combined and pool == "kvpair":
            pool = "strided"
        call = ax["call"][i]
        cases.append(PagedCase(
            idx=i, layout=ax["layout"][i], combined=combined, page=page, s_q=s_q, q3d=s_q == 1 and ax["q3d"][i],
            group=group, hkv=hkv, d=d, dtype=ax["dtype"][i], max_pages=max_pages, lengths=lengths,
            share=tuple(share), extra_pages=int(rng.integers(1, 4)), splits=splits, call=call,
            deterministic=det, scale=ax["scale"][i], lse_mode=ax["lse"][i],
            out_given=call == "convenience" and ax["out"][i], poison=ax["poison"][i], pool=pool,
            table=ax["table"][i]))
    return tuple(cases)


@dataclasses.dataclass
class HostCase:
    case: PagedCase
    q: np.ndarray          # [B, s_q, Hq, D] or [B, Hq, D], case dtype
    k_cache: np.ndarray    # dense host cache (the values the device views hold)
    v_cache: np.ndarray | None
    block_table: np.ndarray  # int32 [B, max_pages]
    seq_lens: np.ndarray   # int32 [B]
    ref_out: np.ndarray    # float64, q's shape
    ref_lse: np.ndarray    # float64, [B, s_q, Hq] or [B, Hq]


def np_dtype(dtype: str):
    import ml_dtypes

    return np.float16 if dtype == "float16" else ml_dtypes.bfloat16


def host_case(case: PagedCase) -> HostCase:
    """Host inputs of a case (rounded to its dtype, poisoned) and the float64 oracle of them."""
    rng = np.random.default_rng(7919 + case.idx)
    dt = np_dtype(case.dtype)
    B, cap = case.batch, case.capacity
    q = rng.standard_normal((B, case.s_q, case.hq, case.d), dtype=np.float32).astype(dt)
    if case.q3d:
        q = q[:, 0].copy()
    k = rng.standard_normal((B, cap, case.hkv, case.d), dtype=np.float32).astype(dt)
    v = rng.standard_normal((B, cap, case.hkv, case.d), dtype=np.float32).astype(dt)
    kc, vc, bt = paged_kv_from_contiguous(k, v, case.lengths, case.page, kv_layout=case.layout,
                                          combined=case.combined, max_pages=case.max_pages,
                                          extra_pages=case.extra_pages, share=case.share, rng=rng, fill=np.nan)
    if case.poison == "inf":  # +Inf everywhere unused, -Inf in every other channel
        for c in (kc, vc):
            if c is not None:
                c[np.isnan(c)] = np.inf
                view = c[..., 1::2]
                view[np.isposinf(view)] = -np.inf
    lens = np.array(case.lengths, np.int32)
    ref_out, ref_lse = gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout=case.layout, **case.scale_kwargs())
    return HostCase(case, q, kc, vc, bt, lens, ref_out, ref_lse)


@dataclasses.dataclass
class DeviceCase:
    q: object
    k_cache: object
    v_cache: object
    block_table: object
    seq_lens: object
    keep: tuple            # the pool / wide table the views come from


def _pool_views(case: PagedCase, kc: np.ndarray, vc: np.ndarray | None, upload):
    """Device views holding kc (and vc) per the case's pool mode; the rest of each pool is NaN."""
    P = kc.shape[0]
    if case.pool == "kvpair" and vc is not None:
        pair = np.full((P, 2) + kc.shape[1:], np.nan, kc.dtype)
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
        big = np.full((off + P * step + 1,) + c.shape[1:], np.nan, c.dtype)
        big[off: off + P * step: step] = c
        d = upload(big)
        out.append(d[off: off + P * step: step])
        keep.append(d)
    return out[0], out[1], tuple(keep)


def _table_view(case: PagedCase, bt: np.ndarray, upload):
    if case.table == "dense":
        d = upload(bt)
        return d, d
    B, mp = bt.shape
    off = 2 if case.table == "wide_offset" else 0
    wide = np.full((B, mp + off + 3), TABLE_POISON, np.int32)
    wide[:, off: off + mp] = bt
    d = upload(wide)
    return d[:, off: off + mp], d


def device_case(h: HostCase, upload=None) -> DeviceCase:
    """Device arrays of a host case (CuPy by default; ``upload`` = np.array gives host views for CPU tests)."""
    if upload is None:
        from tests.helpers import to_device as upload
    k, v, keep = _pool_views(h.case, h.k_cache, h.v_cache, upload)
    bt, wide = _table_view(h.case, h.block_table, upload)
    return DeviceCase(upload(h.q), k, v, bt, upload(h.seq_lens), keep + (wide,))


def dense_case(B, C, hq, hkv, D, dtype, page, layout, s_q, lens, seed, table_fill=TABLE_POISON):
    """One request set of a hand-written GPU case (the cluster and speculation files): random q / K / V of
    ``C`` tokens per request scattered into shuffled pages (two unused, NaN in every unused page and tail
    slot, table entries past the pages ``table_fill``), lengths as given (clipped to int32), and the
    float64 oracle. Returns (q, k_cache, v_cache, block_table, lengths, ref_out, ref_lse)."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(dtype)
    q = rng.standard_normal((B, s_q, hq, D), dtype=np.float32).astype(dt)
    k = rng.standard_normal((B, C, hkv, D), dtype=np.float32).astype(dt)
    v = rng.standard_normal((B, C, hkv, D), dtype=np.float32).astype(dt)
    lens = np.array(lens, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32)
    kc, vc, bt = paged_kv_from_contiguous(k, v, np.minimum(lens, C).clip(0), page, kv_layout=layout,
                                          max_pages=-(-C // page), extra_pages=2, rng=rng, fill=np.nan,
                                          table_fill=table_fill)
    ref_out, ref_lse = gqa_decode_paged_reference(q, kc, vc, bt, lens, kv_layout=layout)
    return q, kc, vc, bt, lens, ref_out, ref_lse


def prepare_poisoned(d, layout, splits, *, lse=True, deterministic=False):
    """``prepare_gqa_decode_paged`` of device arrays (q, k_cache, v_cache, block_table, lengths) into an
    output of all-ones bits (NaN) and an LSE buffer of NaN (or none); returns (prepared, out, lse)."""
    import cupy as cp

    import gqadrv

    q, kc, vc, bt, sl = d
    o = cp.empty_like(q)
    o.view(cp.uint16).fill(0xFFFF)
    lb = cp.full(q.shape[:3], np.nan, cp.float32) if lse else None
    p = gqadrv.prepare_gqa_decode_paged(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=sl, out=o, lse=lb,
                                        kv_layout=layout, num_splits=splits, deterministic=deterministic)
    return p, o, lb


def check_paged(got_out, got_lse, h_out: np.ndarray, h_lse: np.ndarray | None, dtype: str, label: str,
                record: bool = True) -> None:
    """out: finite everywhere, exactly 0 on rows without a key, within TOL of the oracle; lse (when
    given): +inf exactly on rows without a key, finite elsewhere and within LSE_ATOL / LSE_RTOL.
    The largest errors go to the end-of-run report (tests/helpers.record_error) when ``record``."""
    from tests.helpers import record_error as _record

    def record_error(key: str, value: float) -> None:
        if record:
            _record(key, value)

    g = np.asarray(got_out).astype(np.float64)
    assert g.shape == h_out.shape, f"{label}: out shape {g.shape} != {h_out.shape}"
    assert np.all(np.isfinite(g)), f"{label}: {int((~np.isfinite(g)).sum())} non-finite out elements"
    tol = TOL[dtype]
    err = np.abs(g - h_out)
    bad = err > tol + tol * np.abs(h_out)
    assert not bad.any(), (f"{label}: {int(bad.sum())} out elements off, max err {err.max():.3e} at "
                           f"{np.unravel_index(err.argmax(), err.shape)}")
    record_error(f"paged {label} out {dtype}", float(err.max()) if err.size else 0.0)
    if h_lse is None:
        return
    empty = np.isposinf(h_lse)
    assert np.all(g[empty] == 0.0), f"{label}: rows without a key are not exactly 0"
    if got_lse is None:
        return
    gl = np.asarray(got_lse).astype(np.float64)
    assert gl.shape == h_lse.shape, f"{label}: lse shape {gl.shape} != {h_lse.shape}"
    assert np.array_equal(np.isposinf(gl), empty), f"{label}: lse +inf on rows {np.argwhere(np.isposinf(gl) != empty)[:8].tolist()} differs"
    assert np.all(np.isfinite(gl[~empty])), f"{label}: non-finite lse on rows with keys"
    lerr = np.abs(gl[~empty] - h_lse[~empty])
    lbad = lerr > LSE_ATOL[dtype] + LSE_RTOL * np.abs(h_lse[~empty])
    assert not lbad.any(), f"{label}: {int(lbad.sum())} lse values off, max err {lerr.max():.3e}"
    record_error(f"paged {label} lse {dtype}", float(lerr.max()) if lerr.size else 0.0)


def graph_states(B, mp, page, finite_pages, s_q, rng):
    """(lengths, block table) states: initial, shrink, grow to and past the capacity, remap and share
    pages, empty / negative / int32-max lengths, fewer keys than query tokens, back to the start."""
    cap = mp * page

    def table(lens, share=False):
        bt = np.full((B, mp), TABLE_POISON, np.int32)
        for b in range(B):
            n = -(-min(max(int(lens[b]), 0), cap) // page)
            bt[b, :n] = rng.choice(finite_pages, size=n, replace=False)
        if share and B > 1:  # request 1 starts with request 0's first full pages
            n = min(min(max(int(lens[0]), 0), cap) // page, -(-min(max(int(lens[1]), 0), cap) // page))
            bt[1, :n] = bt[0, :n]
        return bt

    first = np.array([cap // 2, 100, 1, cap], np.int32)[:B]
    grown = np.array([cap, cap - 1, cap // 2 + 3, cap + 40], np.int32)[:B]
    states = [(first, table(first))]
    states.append((np.array([7, 50, 0, cap // 3], np.int32)[:B], states[0][1]))          # shrink, same table
    states.append((grown, table(grown)))                                                   # grow
    states.append((grown, table(grown, share=True)))                                       # remap + share
    # the tables of `grown` give every request at least as many pages as the lengths below use
    states.append((np.array([-5, 1, max(0, s_q - 2), 2**31 - 1], np.int32)[:B], table(grown)))
    states.append((np.array([page + 1, 2 * page, 3, cap], np.int32)[:B], table(grown, share=True)))
    states.append(states[0])
    return states


# ----------------------------------------------------------------------------- batch invariance
# (test_deterministic_*_is_batch_invariant of tests/gqa/test_paged_gpu.py and test_paged_fp8_gpu.py)
TARGET_LEN = 3000
INV_HQ, INV_HKV, INV_D, INV_PAGE, INV_MAX_PAGES = 32, 8, 128, 16, 256   # group 4, capacity 4096; B 64 x 8 KV heads
# = 512 CTAs is past the large-batch rule of the default route (cp.async from 2 waves on), which the
# batch-invariant mode must not follow
BATCH_PLACES = [(1, 0), (7, 0), (7, 3), (7, 6), (64, 0), (64, 31), (64, 63)]


def invariance_batch(rng, B: int, pos: int, others: np.ndarray, t_row: np.ndarray, t_q: np.ndarray, npdt):
    """(q [B, s_q, INV_HQ, INV_D], block table [B, INV_MAX_PAGES], lengths [B]) of a batch of B
    requests with the target (row t_row, query t_q, TARGET_LEN keys) at position ``pos``; the others
    have random lengths (one of them 0, some past the capacity) on pages drawn from ``others`` (with
    repeats: shared pages), table entries past their pages TABLE_POISON."""
    cap = INV_MAX_PAGES * INV_PAGE
    s_q = t_q.shape[0]
    lens = rng.integers(0, cap + 200, size=B).astype(np.int32)
    lens[rng.integers(0, B)] = 0
    bt = np.full((B, INV_MAX_PAGES), TABLE_POISON, np.int32)
    for b in range(B):
        n = -(-min(int(lens[b]), cap) // INV_PAGE)
        bt[b, :n] = rng.choice(others, size=n)
    q = rng.standard_normal((B, s_q, INV_HQ, INV_D), dtype=np.float32).astype(npdt)
    lens[pos], bt[pos], q[pos] = TARGET_LEN, t_row, t_q
    return q, bt, lens
