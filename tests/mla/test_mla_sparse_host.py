"""The sparse MLA decode case grid (tests/mla/sparse_decode_cases.py) on the CPU: its size, that every
axis value and every invalid-index kind appears, that each case fits the host oracle's budget and
routes only to backends that accept it, that the generated data keep their promises (indices name
only the request's own tokens or invalid values, unreferenced rows and spare pages are NaN bytes,
referenced rows are finite), and the float64 oracle against a direct per-row loop on three small
cases drawn by the same generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gqadrv.mla.fp8_reference import BYTES_PER_TOKEN
from tests.mla.sparse_decode_cases import (
    BATCHES,
    BF_BACKENDS,
    FP8_BACKENDS,
    HEADS,
    INVALID_KINDS,
    KVS,
    MAX_SLOTS,
    MAX_WORK,
    Q_VIEWS,
    S_QS,
    SPLITS,
    TRIPLES,
    build,
    data_oracle,
    grid,
    invalid_value,
    make_layout,
    ordered_indices,
)

GRID = grid()


def test_grid_size_and_unique_labels():
    assert len(GRID) >= 120
    labels = [c.label for c in GRID]
    assert len(set(labels)) == len(labels)
    assert [c.idx for c in GRID] == list(range(len(GRID)))


@pytest.mark.parametrize("axis,values", [
    ("kv", KVS), ("h_q", HEADS), ("b", BATCHES), ("s_q", S_QS), ("main", TRIPLES), ("splits", SPLITS),
    ("q_view", Q_VIEWS), ("varlen", (False, True)), ("topk_len", (False, True)), ("extra_topk_len", (False, True)),
    ("sink", (False, True)), ("dead_rows", (False, True)), ("tables", (False, True)), ("wide_rows", (False, True)),
    ("idx_pad", (0, 5)), ("page_pad", (1, 3)),
])
def test_every_axis_value_appears(axis, values):
    seen = {getattr(c, axis) for c in GRID}
    assert set(values) <= seen, (axis, set(values) - seen)


def test_extra_pools_and_backends_appear():
    extras = {c.extra for c in GRID}
    assert None in extras and len(extras - {None}) >= 8
    fp8 = {c.backend for c in GRID if c.fp8}
    assert set(FP8_BACKENDS) <= fp8
    bf = {c.backend for c in GRID if not c.fp8}
    assert (set(BF_BACKENDS) - {"narrow"}) | {"narrow16", "narrow32"} <= bf
    for kv in KVS:  # every cache kind with the default route and a forced one, with and without an extra pool
        cs = [c for c in GRID if c.kv == kv]
        assert {c.backend is None for c in cs} == {True, False}
        assert {c.extra is None for c in cs} == {True, False}
    assert {c.scale is None for c in GRID} == {True, False}


def test_cases_fit_the_budget_and_their_backends():
    for c in GRID:
        assert c.work <= MAX_WORK and c.slots <= MAX_SLOTS, c.label
        assert c.b * c.s_q * c.h_q * c.keys <= 2_000_000
        if c.backend in ("narrow16", "narrow32"):
            assert c.h_q <= int(c.backend[-2:]), c.label
            assert not c.fp8
        if c.backend:
            assert (c.backend.endswith("_fp8")) == c.fp8, c.label
            assert "tma" not in c.backend
        assert c.extra_topk_len <= (c.extra is not None)
        assert c.dtype == ("float16" if c.kv == "fp16" else "bfloat16")
    # FlashMLA's large topk with more than one request, and the largest batch, are kept by the shrinking
    assert any(c.main[1] == 2048 and c.b >= 4 for c in GRID)
    assert any(c.b == 74 and c.s_q > 1 for c in GRID)
    assert any(c.h_q == 128 and c.main[1] >= 576 for c in GRID)


def _cheap(n):
    return sorted(GRID, key=lambda c: (c.work + c.slots // 8, c.idx))[:n]


def _check_pool(p, b, s_q, kv):
    """Indices name only tokens < len of the request's own pages, or invalid values; every row not
    named by a counted valid index is NaN bytes, the named rows finite; spare pages unreferenced."""
    lay = p.layout
    slots = lay.slots
    bad_values = {invalid_value(k, slots) for k in INVALID_KINDS}
    idx = p.indices.astype(np.int64)
    assert idx.shape[:2] == (b, s_q) and p.indices.dtype == np.int32
    counted = np.zeros(slots, bool)
    n = np.full(b, idx.shape[-1]) if p.topk_length is None else np.clip(p.topk_length, 0, idx.shape[-1])
    for i in range(b):
        own = set(lay.slot(i, np.arange(int(lay.lengths[i]))).tolist())
        for t in range(s_q):
            for pos, j in enumerate(idx[i, t]):
                if 0 <= j < slots:
                    assert j in own, (i, t, j)
                    if pos < n[i]:
                        counted[j] = True
                else:
                    assert j in bad_values, j
            valid = idx[i, t][(idx[i, t] >= 0) & (idx[i, t] < slots)]
            assert np.unique(valid).size == valid.size  # a permutation: no duplicates
    spare_rows = (lay.spare[:, None] * lay.page + np.arange(lay.page)).reshape(-1)
    assert not counted[spare_rows].any()
    assert np.array_equal(np.sort(np.concatenate([lay.table.reshape(-1), lay.spare])), np.arange(lay.num_blocks))
    flat = p.cache.reshape(slots, -1)
    if kv.startswith("fp8"):
        assert flat.shape[1] == BYTES_PER_TOKEN and flat.dtype == np.uint8
        assert (flat[~counted] == 0xFF).all()
        assert not (flat[counted, 512:528] == 0xFF).all(axis=-1).any()
    else:
        assert (flat.view(np.uint16)[~counted] == 0xFFFF).all()
    num = np.asarray(p.numbers, np.float64).reshape(slots, 576)
    assert np.isfinite(num[counted]).all() and np.isnan(num[~counted]).all()
    return {int(v) for v in idx[(idx < 0) | (idx >= slots)].ravel()}


def test_generated_data_keep_their_promises():
    kinds = set()
    for c in _cheap(30):
        d = build(c)
        assert d.q.shape == (c.b, c.s_q, c.h_q, 576)
        for p, t in ((d.main, c.main), (d.extra, c.extra)):
            if p is None:
                assert t is None
                continue
            s_k, topk, page = t
            assert p.indices.shape[-1] == topk and p.layout.page == page
            assert (p.layout.lengths >= 0).all() and (p.layout.lengths <= s_k).all()
            found = _check_pool(p, c.b, c.s_q, c.kv)
            kinds |= {k for k in INVALID_KINDS if invalid_value(k, p.layout.slots) in found}
        if c.sink:
            assert d.sink.shape == (c.h_q,) and d.sink.dtype == np.float32
        else:
            assert d.sink is None
    assert kinds == set(INVALID_KINDS)


def test_layout_shuffles_pages_and_varlen_has_empty_requests():
    rng = np.random.default_rng(0)
    lay = make_layout(rng, 37, 1024, 61, True)
    assert (lay.lengths == 0).any() and (lay.lengths == 1024).any()
    assert not np.array_equal(lay.table.reshape(-1), np.sort(lay.table.reshape(-1)))
    assert lay.spare.size >= 1
    idx = ordered_indices(lay, 2, 1024)
    for i in range(3):
        n = int(lay.lengths[i])
        assert np.array_equal(idx[i, 1, :n], lay.slot(i, np.arange(n))) and (idx[i, :, n:] == -1).all()


def direct(d):
    """Per (request, token, head): the keys listed in order (duplicates counted), softmax in float64,
    the sink factor; (out [b, s_q, h_q, 512], lse [b, h_q, s_q])."""
    q = np.asarray(d.q, np.float64)
    b, s_q, h_q, dim = q.shape
    scale = dim ** -0.5 if d.scale is None else d.scale
    out = np.zeros((b, s_q, h_q, 512))
    lse = np.full((b, h_q, s_q), np.inf)
    for i in range(b):
        for t in range(s_q):
            keys = []
            for p in (d.main, d.extra):
                if p is None:
                    continue
                rows = np.asarray(p.numbers, np.float64).reshape(-1, 576)
                n = len(p.indices[i, t]) if p.topk_length is None else min(max(int(p.topk_length[i]), 0),
                                                                           len(p.indices[i, t]))
                keys += [rows[j] for j in p.indices[i, t][:n] if 0 <= j < rows.shape[0]]
            if not keys:
                continue
            k = np.array(keys)
            for h in range(h_q):
                logits = k @ q[i, t, h] * scale
                m = logits.max()
                w = np.exp(logits - m)
                lse[i, h, t] = m + np.log(w.sum())
                o = (w @ k[:, :512]) / w.sum()
                if d.sink is not None:
                    s = float(d.sink[h])
                    o = o * (0.0 if s == np.inf else 1.0 if s == -np.inf else 1.0 / (1.0 + np.exp(s - lse[i, h, t])))
                out[i, t, h] = o
    return out, lse


def _small(pred):
    """The first grid case matching ``pred``, cut down to b <= 4, h_q <= 3 (the direct loop is slow)."""
    c = next(c for c in GRID if pred(c))
    return dataclasses.replace(c, b=min(c.b, 4), h_q=min(c.h_q, 3), s_q=min(c.s_q, 2))


@pytest.mark.parametrize("pick", [
    lambda c: c.fp8 and c.extra is not None and c.sink and c.topk_len and c.main[1] <= 576,
    lambda c: c.kv == "bf16" and c.dead_rows and c.sink and c.varlen and c.extra is None,
    lambda c: c.kv == "fp16" and c.extra is not None and c.extra_topk_len and c.scale is not None,
], ids=["fp8-extra-sink-topk_length", "bf16-dead-rows-sink-varlen", "fp16-extra-lengths-scale"])
def test_oracle_matches_direct_loop(pick):
    c = _small(pick)
    d = build(c)
    ro, rl = data_oracle(d)
    do, dl = direct(d)
    assert ro.shape == do.shape and rl.shape == dl.shape
    assert np.isfinite(ro).all()
    np.testing.assert_allclose(ro, do, rtol=1e-9, atol=1e-12)
    assert np.array_equal(np.isposinf(rl), np.isposinf(dl))
    fin = np.isfinite(dl)
    np.testing.assert_allclose(rl[fin], dl[fin], rtol=1e-12, atol=1e-12)
    if c.sink:
        assert np.isposinf(d.sink).any() or np.isneginf(d.sink).any() or c.h_q < 3
