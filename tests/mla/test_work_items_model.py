"""The balanced schedule of the seesaw MLA kernel (kernels/mla/common/work_items.cuh), modelled in
Python step for step: for random lengths and CTA counts, every pair of every request is taken by
exactly one CTA, a request's shares are its consecutive partial slots (unique in the group), only a
CTA's first and last items are shared, and every request is answered (empty ones by one CTA)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from gqadrv.mla.kernel_spec import SCHEDULE_EXPERIMENTS

HEADER = Path(__file__).resolve().parents[2] / "kernels" / "mla" / "common" / "work_items.cuh"


def req_cost() -> int:
    m = re.search(r"constexpr int REQ_COST = (\d+);", HEADER.read_text())
    assert m, "REQ_COST not found in work_items.cuh"
    return int(m.group(1))


def npairs(length: int) -> int:
    return (((max(length, 0) + 63) >> 6) + 1) >> 1


def merge_cost() -> int:
    m = re.search(r"constexpr int MERGE_COST = (\d+);", HEADER.read_text())
    assert m, "MERGE_COST not found in work_items.cuh"
    return int(m.group(1))


def header_define(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", HEADER.read_text())
    assert m, f"{name} default not found in work_items.cuh"
    return int(m.group(1))


# (snap shift, whole-mode slack shift, whole mode): the header's defaults, and each schedule experiment
# of kernel_spec (built with other values of the same three defines)
DEFAULT_SCHED = (header_define("MLA_SNAP_SHIFT"), header_define("MLA_WHOLE_SLACK_SHIFT"), header_define("MLA_WHOLE_MODE"))
SCHEDS = list(dict.fromkeys([DEFAULT_SCHED, *SCHEDULE_EXPERIMENTS.values()]))  # ("whole" is the header default)


def snap_boundary(x, c, w, chunk, shift=None):
    tol = chunk >> (DEFAULT_SCHED[0] if shift is None else shift)
    d0, d1 = x - c, c + w - x
    if d0 <= d1 and d0 <= tol:
        return c
    if d1 <= tol and d1 < d0:
        return c + w
    return x


def cta_of_unit(x, c, w, chunk, shift=None):
    p = x // chunk
    qa, qb = (c + chunk - 1) // chunk, (c + w - 1) // chunk
    if qa <= qb:
        if snap_boundary(qa * chunk, c, w, chunk, shift) == c:
            p = max(p, qa)
        if snap_boundary(qb * chunk, c, w, chunk, shift) == c + w:
            p = min(p, qb - 1)
    return p


def whole_k(ws, parts, sched=None, no_cut=False):
    """k when the schedule gives every CTA k whole requests (k = ceil(b / P), every request at most
    (even + (even >> slack shift) + MERGE_COST) / k units, even = ceil(W / P); even / 4 by default),
    else 0 (the cut schedule; always with the whole mode off)."""
    _snap, slack, whole = DEFAULT_SCHED if sched is None else sched
    if no_cut:  # MLA_FLAG_NO_CUT: never the whole mode
        return 0
    b, total = len(ws), sum(ws)
    even = max((total + parts - 1) // parts, 1)
    k = (b + parts - 1) // parts
    return k if whole and all(k * w <= even + (even >> slack) + merge_cost() for w in ws) else 0


def boundaries(ws, parts, sched=None, no_cut=False):
    """B_0 .. B_P of the schedule (balanced_start), and the chunk the walker sees (0: whole requests,
    and with ``no_cut``: MLA_FLAG_NO_CUT snaps every boundary, 1 << 30 as its snapping chunk)."""
    shift = (DEFAULT_SCHED if sched is None else sched)[0]
    total = sum(ws)
    starts = np.concatenate([[0], np.cumsum(ws)])
    k = whole_k(ws, parts, sched, no_cut)
    if k:
        return [int(starts[min(q * k, len(ws))]) for q in range(parts + 1)], 0
    chunk = max((total + parts - 1) // parts, 1)
    out = []
    for q in range(parts + 1):
        x = q * chunk
        if x >= total:
            out.append(total)
            continue
        i = int(np.searchsorted(starts, x, side="right") - 1)
        out.append(snap_boundary(x, int(starts[i]), ws[i], (1 << 30) if no_cut else chunk, shift))
    return out, 0 if no_cut else chunk


def items_of(lens, parts: int, p: int, cost: int, sched=None, no_cut=False):
    """The items CTA p yields (BalancedWalker.next after balanced_start), as dicts."""
    shift = (DEFAULT_SCHED if sched is None else sched)[0]
    ws = [cost + npairs(x) for x in lens]
    bnd, chunk = boundaries(ws, parts, sched, no_cut)
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
        pf = cta_of_unit(f, c0, end - c0, chunk, shift) if chunk else p
        out.append({"req": i, "t_beg": 2 * j0, "npairs": j1 - j0,
                    "nsplit": cta_of_unit(end - 1, c0, end - c0, chunk, shift) - pf + 1 if chunk else 1,
                    "slot0": pf + i, "slot": p + i, "cta": p})
    return out


def _sched_id(t) -> str:
    return "snap%d_slack%d_whole%d" % t


# the default constants on 40 seeds, each schedule experiment on every fourth one (CI time)
_COVER_CASES = ([pytest.param(seed, DEFAULT_SCHED, id=f"{seed}-default") for seed in range(40)]
                + [pytest.param(seed, t, id=f"{seed}-{_sched_id(t)}") for t in SCHEDS[1:] for seed in range(0, 40, 4)])


@pytest.mark.parametrize(("seed", "sched"), _COVER_CASES)
def test_balanced_items_cover_every_pair_once(seed, sched):
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
        its = items_of(list(lens), parts, p, cost, sched)
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


def _even(lens, parts):
    ws = [req_cost() + npairs(x) for x in lens]
    return max((sum(ws) + parts - 1) // parts, 1)


def test_near_uniform_batches_take_whole_requests():
    """Batches whose requests all fit k = ceil(b / P) to a CTA within 1/4 of the even share plus one
    merge (uniform rows of the bench at every h_q, the varlen rows L + 2i, b = 128 on 132, 66 or 33
    CTAs, b = 110 on 132): no request is shared and every CTA holds at most k requests."""
    for b, parts, lens in ((128, 132, [4096] * 128), (128, 132, [32768] * 128), (128, 132, [100] * 128),
                           (128, 66, [4096] * 128), (128, 66, [8192] * 128), (128, 33, [8192] * 128),
                           (130, 66, [1000] * 130), (256, 132, [4096] * 256), (63, 16, [64] * 63),
                           (128, 66, [8192 + 2 * i for i in range(128)]), (128, 132, [8192 + 2 * i for i in range(128)]),
                           (110, 132, [4096] * 110), (110, 132, [8192] * 110), (100, 132, [8192] * 100)):
        k = -(-b // parts)
        assert whole_k([req_cost() + npairs(x) for x in lens], parts) == k, (b, parts)
        per = [items_of(lens, parts, p, req_cost()) for p in range(parts)]
        assert all(it["nsplit"] == 1 for its in per for it in its), (b, parts)
        assert sum(len(its) for its in per) == b and max(len(its) for its in per) == k, (b, parts)


def test_uneven_batches_are_cut_near_the_even_share():
    """Where whole requests would leave some CTA more than 1/4 plus one merge above the even share
    (b = 90 on 132 or b = 100 on 66 CTAs, ramps, the bench's spread rows, short requests mixed with
    long ones), requests are cut: no CTA gets more than 1.25 even shares plus two requests' fixed
    cost (the bound of the widest snapping tolerance, chunk / 8; the default's chunk / 32 stays well
    inside it; an older rule kept requests of 1-1.25 chunks whole and left 1.5-1.7 shares on one CTA
    of the spread rows)."""
    cost = req_cost()
    b = 128
    cases = [([8192] * 90, 132), ([32768] * 100, 132), ([8192] * 100, 66), ([1000 + 97 * i for i in range(128)], 132),
             ([64 * (1 + i % 200) for i in range(300)], 132)]
    for L in (4096, 8192):
        ramp = [L // 4 + (3 * L // 2) * i // (b - 1) for i in range(b)]
        cases.append(([ramp[(37 * i) % b] for i in range(b)], 132))
    for lens, parts in cases:
        ws = [cost + npairs(x) for x in lens]
        assert whole_k(ws, parts) == 0, (len(lens), parts)
        even = _even(lens, parts)
        loads = [sum(it["npairs"] + cost for it in items_of(lens, parts, p, cost)) for p in range(parts)]
        assert max(loads) <= even + even // 4 + 2 * cost, (len(lens), parts, max(loads), even)
        assert any(it["nsplit"] > 1 for p in range(parts) for it in items_of(lens, parts, p, cost))


def test_one_long_request_is_spread():
    """One request 16 times longer than the others: it is shared by about 16 CTAs, and no CTA gets
    more than two chunks of work."""
    lens = [16 * 4096] + [4096] * 127
    parts = 132
    ws = [req_cost() + npairs(x) for x in lens]
    _, chunk = boundaries(ws, parts)
    assert chunk > 0
    loads = [sum(it["npairs"] for it in items_of(lens, parts, p, req_cost())) for p in range(parts)]
    assert max(loads) <= 2 * chunk
    its0 = [it for p in range(parts) for it in items_of(lens, parts, p, req_cost()) if it["req"] == 0]
    assert 14 <= len(its0) <= 17 and all(it["nsplit"] == len(its0) for it in its0)


@pytest.mark.parametrize("sched", SCHEDS, ids=_sched_id)
def test_cut_loads_stay_within_the_snapping_tolerance(sched):
    """In the cut mode no CTA gets more than the even share plus two snapped boundaries (chunk >> snap
    shift each) plus two requests' fixed cost, for the default constants and every schedule experiment
    (kernel_spec.SCHEDULE_EXPERIMENTS); with the whole mode off, uniform batches are cut too."""
    snap, slack, whole = sched
    cost = req_cost()
    b = 128
    cases = [([8192] * 90, 132), ([8192] * 110, 132), ([4096] * 128, 132), ([8192] * 128, 66),
             ([1000 + 97 * i for i in range(128)], 132), ([16 * 4096] + [4096] * 127, 132)]
    for L in (4096, 8192):
        ramp = [L // 4 + (3 * L // 2) * i // (b - 1) for i in range(b)]
        cases.append(([ramp[(37 * i) % b] for i in range(b)], 132))
    for lens, parts in cases:
        ws = [cost + npairs(x) for x in lens]
        even = _even(lens, parts)
        loads = [sum(it["npairs"] + cost for it in items_of(lens, parts, p, cost, sched)) for p in range(parts)]
        if whole_k(ws, parts, sched):
            assert max(loads) <= even + (even >> slack) + merge_cost(), (len(lens), parts, max(loads), even)
            continue
        assert max(loads) <= even + 2 * (even >> snap) + 2 * cost, (len(lens), parts, max(loads), even)
        if not whole:
            assert any(it["nsplit"] > 1 for p in range(parts) for it in items_of(lens, parts, p, cost, sched))


@pytest.mark.parametrize("seed", range(24))
def test_no_cut_keeps_every_request_on_one_cta(seed):
    """MLA_FLAG_NO_CUT (the sparse paths' lists): every request lies in one CTA's range (nsplit 1, no
    partial slot), every pair is taken once, every request answered once, and no CTA gets more than
    the even share plus one request (its two boundaries each move by at most half a request)."""
    rng = np.random.default_rng(1000 + seed)
    b = int(rng.integers(1, 5000))
    kind = seed % 3
    if kind == 0:    # top-k lists: up to 2048 keys, some rows without any
        lens = np.where(rng.random(b) < 0.1, 0, rng.integers(1, 2049, b))
    elif kind == 1:  # uniform lists
        lens = np.full(b, int(rng.integers(0, 16385)))
    else:            # a few long requests among short ones
        lens = np.where(rng.random(b) < 0.02, rng.integers(1, 300000, b), rng.integers(0, 600, b))
    parts = int(rng.choice([1, 7, 33, 66, 132, 512]))
    sched = SCHEDS[seed % len(SCHEDS)]
    cost = req_cost()
    ws = [cost + npairs(x) for x in lens]
    even = _even(list(lens), parts)
    covered = [np.zeros(npairs(x), np.int32) for x in lens]
    answered = np.zeros(b, np.int32)
    for p in range(parts):
        its = items_of(list(lens), parts, p, cost, sched, no_cut=True)
        assert sum(it["npairs"] + cost for it in its) <= even + max(ws), (p, even, max(ws))
        for it in its:
            assert it["nsplit"] == 1
            answered[it["req"]] += 1
            covered[it["req"]][it["t_beg"] // 2: it["t_beg"] // 2 + it["npairs"]] += 1
    assert np.all(answered == 1)
    assert all(np.all(c == 1) for c in covered)


def test_schedule_experiments_differ_from_the_default_where_meant():
    """What the default and each experiment do on the bench's rows (CPU model; docs/MLA.md). The
    default snaps within chunk / 32 and keeps the even / 4 whole-mode slack: b = 110 uniform requests on
    132 CTAs stay whole (65 units against an even share of 55: cuts measured slower there), and the
    ramp's busiest CTA is the one of chunk / 32 snapping (snap8, the rule before 2026-12-05, and snap16
    leave more). snap32 (even / 16 slack) sends b = 110 to the cut mode with every CTA at the even share
    plus one boundary's tolerance; cut32 also cuts b = 128 uniform."""
    cost = req_cost()
    assert DEFAULT_SCHED == (5, 2, 1) == SCHEDULE_EXPERIMENTS["whole"]
    # the builds: seesaw_bal takes the header's two-mode rule, narrow16_bal cuts always (cut32's schedule)
    from gqadrv.mla import kernel_spec

    nb, sb = (dict(kernel_spec.kernel(n).fixed_defines) for n in ("narrow16_bal", "seesaw_bal"))
    assert nb["MLA_WHOLE_MODE"] == SCHEDULE_EXPERIMENTS["cut32"][2] == 0 and "MLA_WHOLE_MODE" not in sb
    lens110 = [8192] * 110
    ws = [cost + npairs(x) for x in lens110]
    assert whole_k(ws, 132) == 1 and whole_k(ws, 132, SCHEDULE_EXPERIMENTS["snap8"]) == 1
    assert whole_k(ws, 132, SCHEDULE_EXPERIMENTS["snap32"]) == 0
    even = _even(lens110, 132)
    loads = [sum(it["npairs"] + cost for it in items_of(lens110, 132, p, cost, SCHEDULE_EXPERIMENTS["snap32"]))
             for p in range(132)]
    assert max(loads) <= even + (even >> 5) + cost < 65
    lens128 = [4096] * 128
    assert whole_k([cost + npairs(x) for x in lens128], 132) == 1
    assert whole_k([cost + npairs(x) for x in lens128], 132, SCHEDULE_EXPERIMENTS["cut32"]) == 0
    ramp = [2048 + 12288 * i // 127 for i in range(128)]
    ramp = [ramp[(37 * i) % 128] for i in range(128)]
    worst = {}
    for name, sched in (("default", None), *SCHEDULE_EXPERIMENTS.items()):
        worst[name] = max(sum(it["npairs"] + cost for it in items_of(ramp, 132, p, cost, sched)) for p in range(132))
    assert worst["default"] == worst["snap32"] < worst["snap16"] < worst["snap8"], worst
