"""The balanced schedule of the seesaw MLA kernel (kernels/mla/common/work_items.cuh), modelled in
Python step for step: for random lengths and CTA counts, every pair of every request is taken by
exactly one CTA, a request's shares are its consecutive partial slots (unique in the group), only a
CTA's first and last items are shared, and every request is answered (empty ones by one CTA)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).resolve().parents[2] / "kernels" / "mla" / "common" / "work_items.cuh"


def req_cost() -> int:
    m = re.search(r"constexpr int REQ_COST = (\d+);", HEADER.read_text())
    assert m, "REQ_COST not found in work_items.cuh"
    return int(m.group(1))


def npairs(length: int) -> int:
    return (((max(length, 0) + 63) >> 6) + 1) >> 1


def snap_boundary(x, c, w, chunk):
    tol = w if (w >= chunk and 4 * w <= 5 * chunk) else chunk >> 3
    d0, d1 = x - c, c + w - x
    if d0 <= d1 and d0 <= tol:
        return c
    if d1 <= tol and d1 < d0:
        return c + w
    return x


def cta_of_unit(x, c, w, chunk):
    p = x // chunk
    qa, qb = (c + chunk - 1) // chunk, (c + w - 1) // chunk
    if qa <= qb:
        if snap_boundary(qa * chunk, c, w, chunk) == c:
            p = max(p, qa)
        if snap_boundary(qb * chunk, c, w, chunk) == c + w:
            p = min(p, qb - 1)
    return p


def boundaries(ws, parts):
    """B_0 .. B_P of the snapped schedule (balanced_start), and the chunk."""
    total = sum(ws)
    chunk = max((total + parts - 1) // parts, 1)
    k = (len(ws) + parts - 1) // parts
    if len(set(ws)) == 1 and 16 * k * parts <= 17 * len(ws):  # uniform: k whole requests per CTA
        chunk = k * ws[0]
    starts = np.concatenate([[0], np.cumsum(ws)])
    out = []
    for q in range(parts + 1):
        x = q * chunk
        if x >= total:
            out.append(total)
            continue
        i = int(np.searchsorted(starts, x, side="right") - 1)
        out.append(snap_boundary(x, int(starts[i]), ws[i], chunk))
    return out, chunk


def items_of(lens, parts: int, p: int, cost: int):
    """The items CTA p yields (BalancedWalker.next after balanced_start), as dicts."""
    ws = [cost + npairs(x) for x in lens]
    bnd, chunk = boundaries(ws, parts)
    r0, r1 = bnd[p], bnd[p + 1]
    total = sum(ws)
    if r0 >= total:
        return []
    c, req = 0, 0
    while not r0 < c + ws[req]:  # the first request with a unit at or after r0
        c += ws[req]
        req += 1
    out = []
    while req < len(lens) and c < r1:
        i, np_ = req, npairs(lens[req])
        f, end = c + cost, c + cost + np_
        req, c0, c = req + 1, c, end
        if np_ == 0:
            if c0 >= r0:
                out.append({"req": i, "npairs": 0, "t_beg": 0, "nsplit": 1, "slot": None, "slot0": None})
            continue
        j0, j1 = max(r0 - f, 0), min(r1 - f, np_)
        if j1 <= j0:
            continue
        pf = cta_of_unit(f, c0, end - c0, chunk)
        out.append({"req": i, "t_beg": 2 * j0, "npairs": j1 - j0,
                    "nsplit": cta_of_unit(end - 1, c0, end - c0, chunk) - pf + 1,
                    "slot0": pf + i, "slot": p + i, "cta": p})
    return out


@pytest.mark.parametrize("seed", range(40))
def test_balanced_items_cover_every_pair_once(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 300))
    kind = seed % 4
    if kind == 0:
        lens = rng.integers(-5, 40000, b)
    elif kind == 1:
        lens = np.full(b, int(rng.integers(0, 9000)))
    elif kind == 2:
        lens = np.where(rng.random(b) < 0.7, 0, rng.integers(1, 200000, b))
    else:
        lens = rng.integers(0, 130, b)
    parts = int(rng.choice([1, 2, 7, 66, 132, 300, 512]))
    cost = req_cost()
    covered = [np.zeros(npairs(x), np.int32) for x in lens]
    answered = np.zeros(b, np.int32)
    shares: dict = {}
    slots = set()
    for p in range(parts):
        its = items_of(list(lens), parts, p, cost)
        for k, it in enumerate(its):
            i = it["req"]
            if it["npairs"] == 0:
                answered[i] += 1
                continue
            covered[i][it["t_beg"] // 2: it["t_beg"] // 2 + it["npairs"]] += 1
            if it["nsplit"] == 1:
                answered[i] += 1
            else:
                assert k in (0, len(its) - 1), "a shared request that is neither the CTA's first nor last item"
                shares.setdefault(i, []).append(it)
                assert it["slot"] not in slots
                slots.add(it["slot"])
                assert it["slot"] < parts + b
    for i, x in enumerate(lens):
        assert np.all(covered[i] == 1), f"request {i}: pairs taken {covered[i].tolist()}"
        if i in shares:
            sh = shares[i]
            n = sh[0]["nsplit"]
            assert len(sh) == n and all(s["nsplit"] == n and s["slot0"] == sh[0]["slot0"] for s in sh)
            assert sorted(s["slot"] for s in sh) == list(range(sh[0]["slot0"], sh[0]["slot0"] + n))
            assert answered[i] == 0
        else:
            assert answered[i] == 1, f"request {i} (len {x}) answered {answered[i]} times"


def test_uniform_lengths_are_never_cut():
    """Uniform lengths with 0.8 P <= b <= P (the bench rows at h_q <= 64): no request is shared, one
    request per CTA at most."""
    for b, parts, L in ((128, 132, 4096), (128, 132, 32768), (110, 132, 8192), (128, 132, 100), (53, 66, 4096)):
        lens = [L] * b
        per = []
        for p in range(parts):
            its = items_of(lens, parts, p, req_cost())
            assert all(it["nsplit"] == 1 for it in its), (b, parts, L, p, its)
            per.append(len(its))
        assert sum(per) == b and max(per) == 1, (b, parts, L, per)


def test_uniform_batches_larger_than_the_grid_are_never_cut():
    """Uniform lengths with b a little under a multiple k of P (h_q 128 and s_q 2 rows: b = 128 on 66
    or 33 CTAs): chunk = k whole requests, no request is shared, no CTA holds more than k requests;
    just past the 17/16 margin (b = 100 on 66 CTAs) the cut schedule is kept."""
    for b, parts, L in ((128, 66, 4096), (128, 66, 8192), (128, 33, 8192), (130, 66, 1000), (256, 132, 4096),
                        (63, 16, 64)):
        lens = [L] * b
        k = -(-b // parts)
        per = [items_of(lens, parts, p, req_cost()) for p in range(parts)]
        assert all(it["nsplit"] == 1 for its in per for it in its), (b, parts, L)
        assert sum(len(its) for its in per) == b and max(len(its) for its in per) == k, (b, parts, L)
    lens = [8192] * 100
    shared = [it for p in range(66) for it in items_of(lens, 66, p, req_cost()) if it["nsplit"] > 1]
    assert shared, "b = 100 on 66 CTAs is outside the 17/16 margin: some requests are cut"


def test_shares_stay_near_one_chunk():
    """Uniform batches of short requests (b > P) and ramps of lengths: no CTA gets more than
    1.25 chunks plus one request's fixed cost."""
    cost = req_cost()
    for lens, parts in (([4096] * 128, 66), ([4096] * 256, 132), ([1000 + 97 * i for i in range(128)], 132),
                        ([64 * (1 + i % 200) for i in range(300)], 132)):
        ws = [cost + npairs(x) for x in lens]
        _, chunk = boundaries(ws, parts)
        for p in range(parts):
            load = sum(it["npairs"] + cost for it in items_of(lens, parts, p, cost))
            assert load <= chunk + chunk // 4 + 2 * cost, (parts, p, load, chunk)


def test_one_long_request_is_spread():
    """One request 16 times longer than the others: it is shared by about 16 CTAs, and no CTA gets
    more than two chunks of work."""
    lens = [16 * 4096] + [4096] * 127
    parts = 132
    ws = [req_cost() + npairs(x) for x in lens]
    _, chunk = boundaries(ws, parts)
    loads = [sum(it["npairs"] for it in items_of(lens, parts, p, req_cost())) for p in range(parts)]
    assert max(loads) <= 2 * chunk
    its0 = [it for p in range(parts) for it in items_of(lens, parts, p, req_cost()) if it["req"] == 0]
    assert 14 <= len(its0) <= 17 and all(it["nsplit"] == len(its0) for it in its0)
