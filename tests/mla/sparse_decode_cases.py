"""The oracle grid of DeepSeek sparse MLA decode (``flash_mla_with_kvcache`` with ``indices``), and the
host-side builders the sparse GPU tests share.

Data (FlashMLA's tests/test_flash_mla_sparse_decoding.py, made stricter): each request owns
ceil(s_k / page) pages of its pool, assigned in shuffled order, plus a few spare pages no request
owns. The indices of a (request, query token) row are a random permutation of max(len, topk)
positions truncated to topk, the positions >= the request's length made invalid, the rest mapped to
flattened slots ``page_id * page + offset`` through the request's pages. Invalid entries cycle
through every kind (INVALID_KINDS: -1, INT_MIN, -123456, num_blocks * page (just past the end), the
end + 63, 2147480000, INT_MAX); some rows are invalid throughout. Only the rows named by a counted
valid index (position < clamp(topk_length, 0, topk)) hold data; every other byte of the pool is NaN
(FP8: 0xFF codes, scales and RoPE; bf16 / fp16: 0xFFFF), and so is the padding of the device copies
(pages padded past page * row, rows optionally padded past 656 bytes / 576 channels). The float64
oracle (gqadrv.mla.sparse_reference.sparse_decode_reference) reads the same numbers (an FP8 pool
dequantized by the numpy model of the format).

Axes, drawn with co-prime strides: cache fp8 (uint8 / int8 bytes), bf16, fp16; h_q {1, 3, 16, 32,
64, 100, 128}; b {1, 4, 37, 74}; s_q {1, 2, 3}; (s_k, topk, page) of FlashMLA's grid plus topk and
page sizes that are not multiples of 64; varlen lengths (some 0); topk_length on / off (values
below 0, 0, above topk); an extra pool with its own (s_k, topk, page) and extra_topk_length;
attention sinks (about 1/3 +inf, 1/3 -inf, the rest normal); rows with no valid index; softmax
scale default / 576 ** -0.55; splits auto / 1 / 5; the backends (auto, seesaw_fp8, mma_fp8 on FP8;
auto, seesaw, mma, wgmma, narrow16 / narrow32 on bf16 / fp16); q as a view (wider last dim, more
heads, or more tokens: the last is not mergeable into one row stride); indices padded past topk
(pad = a slot of a NaN spare page); block_table / cache_seqlens given (ignored) or None. Cases are
shrunk (b, then h_q, ...) until b * s_q * h_q * (topk + extra_topk) <= MAX_WORK and both pools hold
<= MAX_SLOTS rows, so the host oracle stays fast.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from gqadrv.mla.fp8_reference import (
    BYTES_PER_TOKEN,
    dequantize_k_cache_reference,
    quantize_k_cache_reference,
)
from gqadrv.mla.sparse_reference import sparse_decode_reference, valid_index_mask

BF16 = np.dtype(ml_dtypes.bfloat16)
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
D_QK, D_V = 576, 512

KV_CYCLE = ("fp8_u8", "bf16", "fp8_i8", "fp16", "fp8_u8", "bf16", "fp8_i8")
KVS = ("fp8_u8", "fp8_i8", "bf16", "fp16")
HEADS = (1, 3, 16, 32, 64, 100, 128)
BATCHES = (1, 4, 37, 74)
S_QS = (1, 2, 3)
TRIPLES = ((512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61), (2046, 2048, 64),
           (650, 576, 53), (300, 37, 16), (100, 1, 1), (2046, 2048, 576), (512, 130, 256))  # (s_k, topk, page)
SPLITS = (None, 1, 5)
FP8_BACKENDS = (None, "seesaw_fp8", "mma_fp8")
BF_BACKENDS = (None, "seesaw", "mma", "wgmma", "narrow")  # narrow: narrow16 (h_q <= 16) or narrow32 (h_q <= 32)
Q_VIEWS = ("wide", "heads", "tokens")
INVALID_KINDS = ("-1", "INT_MIN", "-123456", "end", "end+63", "2147480000", "INT_MAX")
SCALE_055 = D_QK ** -0.55
N_CASES = 140
MAX_WORK = 2_000_000   # b * s_q * h_q * (topk + extra_topk): logits of the float64 oracle
MAX_SLOTS = 1 << 16    # rows of both pools together
SPARE_PAGES = 3


def is_fp8(kv: str) -> bool:
    return kv.startswith("fp8")


def q_dtype(kv: str) -> str:
    return "float16" if kv == "fp16" else "bfloat16"


def np_dtype(kv: str) -> np.dtype:
    return np.dtype(np.float16) if kv == "fp16" else BF16


def invalid_value(kind: str, slots: int) -> int:
    """The int32 value of an invalid index kind for a pool of ``slots`` rows."""
    return {"-1": -1, "INT_MIN": INT_MIN, "-123456": -123456, "end": slots, "end+63": slots + 63,
            "2147480000": 2147480000, "INT_MAX": INT_MAX}[kind]


# ----------------------------------------------------------------------------- the grid
@dataclasses.dataclass(frozen=True)
class SparseCase:
    idx: int
    kv: str                     # KVS
    b: int
    s_q: int
    h_q: int
    main: tuple                 # (s_k, topk, page) of k_cache
    extra: tuple | None         # (s_k, topk, page) of extra_k_cache, or None
    varlen: bool                # request lengths random in [0, s_k] (some 0), else all s_k
    topk_len: bool              # topk_length given
    extra_topk_len: bool        # extra_topk_length given (only with an extra pool)
    sink: bool                  # attn_sink given
    dead_rows: bool             # every 4th (request, token) row holds only invalid indices
    scale: float | None         # softmax_scale (None: 576 ** -0.5)
    splits: int | None
    backend: str | None
    q_view: str                 # Q_VIEWS
    wide_rows: bool             # cache rows padded (FP8: 672 bytes apart; bf16 / fp16: 640 channels)
    page_pad: int               # padding rows per page (stride(0) = (page + page_pad) * row stride)
    idx_pad: int                # indices handed over as a view of [b, s_q, topk + idx_pad]
    tables: bool                # pass block_table / cache_seqlens (ignored by the sparse path)

    @property
    def fp8(self) -> bool:
        return is_fp8(self.kv)

    @property
    def dtype(self) -> str:
        return q_dtype(self.kv)

    @property
    def keys(self) -> int:
        return self.main[1] + (self.extra[1] if self.extra else 0)

    @property
    def work(self) -> int:
        return self.b * self.s_q * self.h_q * self.keys

    @property
    def slots(self) -> int:
        return sum(self.b * _pool_rows(t) for t in (self.main, self.extra) if t)

    @property
    def label(self) -> str:
        s_k, topk, page = self.main
        x = ""
        if self.extra:
            x = f"+x{self.extra[0]}t{self.extra[1]}p{self.extra[2]}{'T' if self.extra_topk_len else ''}"
        flags = "".join(c for c, on in (("V", self.varlen), ("T", self.topk_len), ("K", self.sink),
                                        ("I", self.dead_rows), ("B", self.tables)) if on)
        return (f"{self.idx}:{self.kv}b{self.b}s{self.s_q}h{self.h_q}k{s_k}t{topk}p{page}{x}{flags}"
                f"S{self.splits}{self.backend or 'auto'}q{self.q_view}")


def _pool_rows(t: tuple) -> int:
    s_k, _, page = t
    return (max(1, -(-s_k // page)) + SPARE_PAGES) * page


def _smaller(values: tuple, v):
    i = values.index(v)
    return values[max(i - 1, 0)]


def _shrink(i: int, b: int, s_q: int, h_q: int, main: tuple, extra: tuple | None):
    """Smaller b, h_q, s_q (b first when the pools are too big and on every third case) until the
    case fits MAX_WORK and MAX_SLOTS; the extra pool goes last."""
    def fits(b, s_q, h_q, extra):
        keys = main[1] + (extra[1] if extra else 0)
        rows = sum(b * _pool_rows(t) for t in (main, extra) if t)
        return b * s_q * h_q * keys <= MAX_WORK and rows <= MAX_SLOTS, rows <= MAX_SLOTS

    while True:
        ok, rows_ok = fits(b, s_q, h_q, extra)
        if ok:
            return b, s_q, h_q, extra
        if b > 1 and (not rows_ok or i % 3 == 0 or h_q == 1):
            b = _smaller(BATCHES, b)
        elif h_q > 1:
            h_q = _smaller(HEADS, h_q)
        elif s_q > 1:
            s_q -= 1
        else:
            extra = None


def grid() -> list[SparseCase]:
    out = []
    for i in range(N_CASES):
        kv = KV_CYCLE[i % 7]
        j = i // 7
        b = BATCHES[i % 4]
        s_q = S_QS[(i // 4) % 3]
        main = TRIPLES[i % 11]
        h_q = HEADS[(j + i // 3) % 7]
        has_extra = (i // 3) % 2 == 1
        extra = TRIPLES[(i * 4 + 5) % 11] if has_extra else None
        if is_fp8(kv):
            backend = FP8_BACKENDS[j % 3]
        else:
            backend = BF_BACKENDS[(j + i // 2) % 5]
            if backend == "narrow":
                if h_q > 32:
                    h_q = (3, 16, 32)[j % 3]
                backend = "narrow32" if h_q > 16 or j % 2 else "narrow16"
        b, s_q, h_q, extra = _shrink(i, b, s_q, h_q, main, extra)
        out.append(SparseCase(
            idx=i, kv=kv, b=b, s_q=s_q, h_q=h_q, main=main, extra=extra,
            varlen=(i // 2) % 2 == 0, topk_len=(i // 5) % 2 == 1,
            extra_topk_len=extra is not None and (i // 6) % 2 == 0,
            sink=(i // 2) % 3 != 0, dead_rows=(i // 5) % 3 == 1,
            scale=SCALE_055 if i % 2 else None, splits=SPLITS[(i // 3) % 3], backend=backend,
            q_view=Q_VIEWS[(i // 11) % 3], wide_rows=(i // 13) % 2 == 1, page_pad=1 + 2 * ((i // 17) % 2),
            idx_pad=5 * ((i // 19) % 2), tables=i % 4 == 3))
    return out


# ----------------------------------------------------------------------------- pools and indices
@dataclasses.dataclass(frozen=True)
class Layout:
    """A paged pool: request i owns the pages ``table[i]`` (shuffled ids) and holds ``lengths[i]``
    tokens; the ``spare`` pages belong to no request."""

    page: int
    num_blocks: int
    lengths: np.ndarray   # int32 [b]
    table: np.ndarray     # int32 [b, pages per request]: the page of positions [p * page, (p + 1) * page)
    spare: np.ndarray     # int page ids

    @property
    def slots(self) -> int:
        return self.num_blocks * self.page

    def slot(self, i: int, pos: np.ndarray) -> np.ndarray:
        """Flattened slots of request i's token positions ``pos``."""
        pos = np.asarray(pos, np.int64)
        return self.table[i][pos // self.page].astype(np.int64) * self.page + pos % self.page

    def all_slots(self) -> np.ndarray:
        """Every slot holding a token (position < length) of some request."""
        parts = [self.slot(i, np.arange(int(n))) for i, n in enumerate(self.lengths)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def make_layout(rng, b: int, s_k: int, page: int, varlen: bool, lengths=None) -> Layout:
    per = max(1, -(-s_k // page))
    nb = b * per + SPARE_PAGES
    perm = rng.permutation(nb)
    if lengths is None:
        if varlen:
            lengths = rng.integers(0, s_k + 1, size=b)
            lengths[rng.random(b) < 0.2] = 0
            if b >= 4:
                lengths[0], lengths[1] = s_k, 0
        else:
            lengths = np.full(b, s_k)
    return Layout(page, nb, np.asarray(lengths, np.int32), perm[: b * per].reshape(b, per).astype(np.int32),
                  perm[b * per:])


def draw_indices(rng, layout: Layout, s_q: int, topk: int, kind_offset: int = 0, dead_rows: bool = False) -> np.ndarray:
    """int32 [b, s_q, topk]: per row a random permutation of max(len, topk) positions cut to topk,
    positions >= len invalid; invalid entries cycle through INVALID_KINDS (from ``kind_offset``);
    with ``dead_rows`` every 4th row is invalid throughout."""
    b = len(layout.lengths)
    idx = np.zeros((b, s_q, topk), np.int64)
    bad = np.zeros((b, s_q, topk), bool)
    for i in range(b):
        n = int(layout.lengths[i])
        for t in range(s_q):
            pos = rng.permutation(max(n, topk))[:topk]
            ok = pos < n
            idx[i, t] = np.where(ok, layout.slot(i, np.where(ok, pos, 0)), 0)
            bad[i, t] = ~ok
            if dead_rows and (i * s_q + t) % 4 == 1:
                bad[i, t] = True
    fill_invalid(idx, bad, layout.slots, kind_offset)
    return idx.astype(np.int32)


def fill_invalid(idx: np.ndarray, bad: np.ndarray, slots: int, kind_offset: int = 0) -> None:
    """Write invalid values of every kind, in turn, where ``bad`` (in place)."""
    vals = np.array([invalid_value(k, slots) for k in INVALID_KINDS], np.int64)
    bad = np.broadcast_to(bad, idx.shape)
    idx[bad] = vals[(np.arange(int(bad.sum())) + kind_offset) % len(vals)]


def ordered_indices(layout: Layout, s_q: int, topk: int) -> np.ndarray:
    """int32 [b, s_q, topk]: every position < len in order, then -1 (what dense decode attends)."""
    b = len(layout.lengths)
    idx = np.full((b, s_q, topk), -1, np.int64)
    for i in range(b):
        n = min(int(layout.lengths[i]), topk)
        idx[i, :, :n] = layout.slot(i, np.arange(n))
    return idx.astype(np.int32)


def draw_topk_length(rng, b: int, topk: int) -> np.ndarray:
    """int32 [b] in [-2, topk + 2], with 0 and values past topk (clamped by the contract)."""
    v = rng.integers(-2, topk + 3, size=b)
    v[rng.random(b) < 0.2] = 0
    if b >= 4:
        v[0], v[1], v[3] = topk + 7, 0, -1
    return v.astype(np.int32)


def counted_slots(indices: np.ndarray, slots: int, topk_length=None) -> np.ndarray:
    """The distinct slots named by a counted valid index."""
    ok = valid_index_mask(indices, slots, topk_length)
    return np.unique(np.asarray(indices, np.int64)[ok])


def fill_pool(rng, layout: Layout, live: np.ndarray, kv: str) -> tuple[np.ndarray, np.ndarray]:
    """(cache as handed to gqadrv, numbers the oracle reads): data ~ N(0, 0.5^2) in the ``live`` slots,
    NaN bits everywhere else. FP8: uint8 [nb, page, 1, 656] (0xFF poison) and its dequantized bf16;
    bf16 / fp16: the same array twice ([nb, page, 1, 576], 0xFFFF poison)."""
    nb, page, n = layout.num_blocks, layout.page, layout.slots
    live = np.asarray(live, np.int64)
    vals = (rng.standard_normal((live.size, D_QK)) * 0.5).astype(np.float32).astype(np_dtype(kv))
    bits = np.full((n, D_QK), 0xFFFF, np.uint16)
    if is_fp8(kv):
        k8 = np.full((n, BYTES_PER_TOKEN), 0xFF, np.uint8)
        k8[live] = quantize_k_cache_reference(vals)
        bits[live] = dequantize_k_cache_reference(k8[live]).view(np.uint16)
        return k8.reshape(nb, page, 1, BYTES_PER_TOKEN), bits.view(BF16).reshape(nb, page, 1, D_QK)
    bits[live] = vals.view(np.uint16)
    k = bits.view(np_dtype(kv)).reshape(nb, page, 1, D_QK)
    return k, k


@dataclasses.dataclass(frozen=True)
class Pool:
    layout: Layout
    cache: np.ndarray               # what gqadrv reads (FP8 bytes as uint8, or bf16 / fp16)
    numbers: np.ndarray             # what the oracle reads, [nb, page, 1, 576]
    indices: np.ndarray             # int32 [b, s_q, topk]
    topk_length: np.ndarray | None  # int32 [b]

    @property
    def pad_slot(self) -> int:
        """A slot of a spare page (NaN, never named by a valid index): the value of index padding."""
        return int(self.layout.spare[0]) * self.layout.page


def make_pool(rng, b: int, s_q: int, triple: tuple, kv: str, *, varlen: bool = False, with_topk_length: bool = False,
              dead_rows: bool = False, kind_offset: int = 0, fill_all: bool = False, lengths=None) -> Pool:
    """A pool and its indices. ``fill_all``: every token < len holds data (indices and topk_length may
    then change freely, e.g. between graph replays); else only the counted slots."""
    s_k, topk, page = triple
    layout = make_layout(rng, b, s_k, page, varlen, lengths)
    idx = draw_indices(rng, layout, s_q, topk, kind_offset, dead_rows)
    tl = draw_topk_length(rng, b, topk) if with_topk_length else None
    live = layout.all_slots() if fill_all else counted_slots(idx, layout.slots, tl)
    cache, numbers = fill_pool(rng, layout, live, kv)
    return Pool(layout, cache, numbers, idx, tl)


def draw_sink(rng, h_q: int) -> np.ndarray:
    """float32 [h_q]: about 1/3 +inf, 1/3 -inf, the rest N(0, 1)."""
    kind = rng.integers(0, 3, size=h_q)
    return np.where(kind == 0, np.inf, np.where(kind == 1, -np.inf, rng.standard_normal(h_q))).astype(np.float32)


def draw_q(rng, b: int, s_q: int, h_q: int, kv: str) -> np.ndarray:
    return (rng.standard_normal((b, s_q, h_q, D_QK)) * 0.5).astype(np.float32).astype(np_dtype(kv))


@dataclasses.dataclass(frozen=True)
class SparseData:
    q: np.ndarray
    main: Pool
    extra: Pool | None
    sink: np.ndarray | None
    scale: float | None


def build(case: SparseCase) -> SparseData:
    rng = np.random.default_rng(2000 + case.idx)
    q = draw_q(rng, case.b, case.s_q, case.h_q, case.kv)
    main = make_pool(rng, case.b, case.s_q, case.main, case.kv, varlen=case.varlen, with_topk_length=case.topk_len,
                     dead_rows=case.dead_rows, kind_offset=case.idx)
    extra = None
    if case.extra:
        extra = make_pool(rng, case.b, case.s_q, case.extra, case.kv, varlen=case.varlen,
                          with_topk_length=case.extra_topk_len, dead_rows=case.dead_rows, kind_offset=case.idx + 3)
    sink = draw_sink(rng, case.h_q) if case.sink else None
    return SparseData(q, main, extra, sink, case.scale)


def oracle(q, main: Pool, extra: Pool | None = None, sink=None, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sparse decode, one request at a time (small gathers): (out [b, s_q, h_q, 512],
    lse [b, h_q, s_q])."""
    def tl(p, sl):
        return None if p is None or p.topk_length is None else p.topk_length[sl]

    outs, lses = [], []
    for i in range(q.shape[0]):
        sl = slice(i, i + 1)
        o, l = sparse_decode_reference(q[sl], main.numbers, main.indices[sl], scale, D_V, sink, tl(main, sl),
                                       extra.numbers if extra else None, extra.indices[sl] if extra else None,
                                       tl(extra, sl))
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


def data_oracle(d: SparseData) -> tuple[np.ndarray, np.ndarray]:
    return oracle(d.q, d.main, d.extra, d.sink, d.scale)


# ----------------------------------------------------------------------------- device copies (CuPy)
def device_q(q: np.ndarray, view: str = "wide"):
    """q as a strided device view: 'wide' (last dim 640), 'heads' (3 more heads), 'tokens' (one
    more query token: stride(0) != s_q * stride(1)); 'dense' a contiguous copy."""
    import cupy as cp

    b, s_q, h_q, d = q.shape
    if view == "dense":
        return cp.asarray(q)
    shape = {"wide": (b, s_q, h_q, 640), "heads": (b, s_q, h_q + 3, d), "tokens": (b, s_q + 1, h_q, d)}[view]
    w = cp.zeros(shape, q.dtype)
    sub = {"wide": (Ellipsis, slice(0, d)), "heads": (slice(None), slice(None), slice(2, 2 + h_q)),
           "tokens": (slice(None), slice(1, 1 + s_q))}[view]
    w[sub] = cp.asarray(q)
    return w[sub]


def device_cache(cache: np.ndarray, kv: str, wide_rows: bool = False, page_pad: int = 1):
    """The pool on the device as a view whose pages are ``page + page_pad`` rows apart and whose rows
    are padded (``wide_rows``: FP8 672 bytes, bf16 / fp16 640 channels); all padding is NaN bits.
    FP8 caches come back as uint8 or int8 (``kv``)."""
    import cupy as cp

    nb, page, _, row = cache.shape
    if is_fp8(kv):
        wrow = row + (16 if wide_rows else 0)
        h = np.full((nb, page + page_pad, 1, wrow), 0xFF, np.uint8)
        h[:, :page, :, :row] = cache
        d = cp.asarray(h)
        if kv == "fp8_i8":
            d = d.view(cp.int8)
        return d[:, :page, :, :row]
    wrow = row + (64 if wide_rows else 0)
    h = np.full((nb, page + page_pad, 1, wrow), 0xFFFF, np.uint16)
    h[:, :page, :, :row] = cache.view(np.uint16)
    return cp.asarray(h).view(np_dtype(kv))[:, :page, :, :row]


def device_indices(idx: np.ndarray, pad: int = 0, pad_value: int = 0):
    """int32 indices on the device, as a view of [b, s_q, topk + pad] (pad entries = ``pad_value``)."""
    import cupy as cp

    if not pad:
        return cp.asarray(np.ascontiguousarray(idx, np.int32))
    b, s_q, topk = idx.shape
    w = np.full((b, s_q, topk + pad), pad_value, np.int32)
    w[..., :topk] = idx
    return cp.asarray(w)[..., :topk]


def device_pool_args(p: Pool, kv: str, wide_rows=False, page_pad=1, idx_pad=0) -> tuple:
    """(cache, indices, topk_length) device arrays of a pool."""
    import cupy as cp

    tl = None if p.topk_length is None else cp.asarray(p.topk_length)
    return (device_cache(p.cache, kv, wide_rows, page_pad), device_indices(p.indices, idx_pad, p.pad_slot), tl)


def device_args(case: SparseCase, d: SparseData) -> dict:
    """The keyword arguments of ``flash_mla_with_kvcache`` / ``prepare_mla_decode`` for a grid case."""
    import cupy as cp

    k, idx, tl = device_pool_args(d.main, case.kv, case.wide_rows, case.page_pad, case.idx_pad)
    args = {"q": device_q(d.q, case.q_view), "k_cache": k, "block_table": None, "cache_seqlens": None,
            "head_dim_v": D_V, "softmax_scale": d.scale, "is_fp8_kvcache": case.fp8, "indices": idx,
            "topk_length": tl, "attn_sink": None if d.sink is None else cp.asarray(d.sink)}
    if d.extra is not None:
        ek, eidx, etl = device_pool_args(d.extra, case.kv, not case.wide_rows, 4 - case.page_pad, case.idx_pad)
        args.update(extra_k_cache=ek, extra_indices_in_kvcache=eidx, extra_topk_length=etl)
    if case.tables:
        args.update(block_table=cp.asarray(d.main.layout.table), cache_seqlens=cp.asarray(d.main.layout.lengths))
    return args
