"""Two development switches of the paged TMA kernel on the GPU, each against the default build.

GQA_PAGED_MULTI (GQADRV_PAGED_MULTI=K): one-split launches of several waves on ceil(units / K) CTAs (K = 2) or
the resident CTAs (K = 1), each walking units with its warps' rings running on across them (states in the
freed slots, the next unit's q staged in shared memory); outputs, LSE and status words must equal the default
build's bit for bit (the same sub-tiles per warp, the same merge order). K = 1 ran on an H100 on 2026-12-08
(22 passed); K = 2 changes only the grid the host sizes.

The successor prefetch (GQA_PAGED_NEXT builds, a development switch:
GQADRV_PAGED_NEXT=n, kernels/gqa/sm90/decode_paged_tma.cu). In launches of more than one wave the
host puts the successor stride G (co-resident CTAs) in the flags' high bits and each warp of CTA x,
once its ring stops refilling, prefetches into L2 the first n sub-tiles of warp w of CTA x + G. The
prefetch writes nothing, so every output, LSE and status word must equal the default build's bit for
bit; the cases are multi-wave grids with lengths of every kind (0, negative, past the capacity, 1,
short, full), table entries past the pages poisoned or real (NaN pages), a page id outside the pool in
a successor's first box, fp16 / bf16 / e4m3 caches, NHD / HND, s_q 2, D 64 and 128, and the
batch-invariant mode. One fp16 case is also held against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import TABLE_POISON
from tests.gqa.paged_cases import check_paged, dense_case

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_only():
    import cupy as cp

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the paged TMA kernel runs on sm_90 only")

SHIFT = 16  # GQA_PAGED_NEXT_SHIFT


def _lengths(B: int, C: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    lens = list(rng.integers(C // 2, C + 1, B))
    for i, v in enumerate([0, -3, 10**9, 1, 17, C, C - 1, 33]):
        lens[(5 * i + 1) % B] = v
    return lens


# batch, capacity, Hq, Hkv, D, dtype, page, layout, s_q, kv ("fp" or "e4m3"), splits, table_fill, deterministic
CASES = [
    (48, 1024, 32, 8, 128, "float16", 16, "NHD", 1, "fp", None, TABLE_POISON, False),
    (48, 1024, 32, 8, 128, "float16", 16, "NHD", 1, "e4m3", None, TABLE_POISON, False),
    (40, 2048, 32, 8, 128, "bfloat16", 64, "HND", 2, "e4m3", None, 0, False),
    (40, 1024, 32, 8, 128, "bfloat16", 32, "HND", 2, "fp", None, 0, False),
    (96, 512, 16, 8, 64, "float16", 16, "NHD", 1, "fp", None, 0, False),
    (24, 2048, 32, 8, 128, "float16", 16, "NHD", 1, "e4m3", None, TABLE_POISON, True),
    (64, 1024, 128, 8, 128, "float16", 16, "NHD", 1, "fp", None, TABLE_POISON, False),   # 16 rows
]


def _flags(p) -> int:
    return p._plans[0].args.get_field("args.flags")


def _prepare(d, layout, splits, det, kv):
    import cupy as cp

    import gqadrv

    q, kc, vc, bt, sl = d
    o = cp.empty_like(q)
    o.view(cp.uint16).fill(0xFFFF)
    lb = cp.full(q.shape[:3], np.nan, cp.float32)
    extra = {}
    if kv is not None:
        kc, vc, extra = kv
    # backend "hopper": the TMA kernel also where fp16 D 128 grids of two waves take the cp.async one
    p = gqadrv.prepare_gqa_decode_paged(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=sl, out=o, lse=lb,
                                        kv_layout=layout, num_splits=splits, deterministic=det, backend="hopper",
                                        **extra)
    return p, o, lb


def _run(p, o, lb):
    import cupy as cp

    import gqadrv

    for _ in range(3):  # repeated launches: nothing carries over between them
        gqadrv.launch_prepared(p)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(o), cp.asnumpy(lb), gqadrv.check_status(p)


SWITCHES = [("GQADRV_PAGED_NEXT", "3"), ("GQADRV_PAGED_NEXT", "1"), ("GQADRV_PAGED_MULTI", "1"),
            ("GQADRV_PAGED_MULTI", "2")]


def _clear(monkeypatch):
    for k, _ in SWITCHES:
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: f"{s[0][7:].lower()}{s[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}C{c[1]}h{c[2]}/{c[3]}d{c[4]}{c[5][:2]}p{c[6]}{c[7]}"
                                                     f"s{c[8]}{c[9]}S{c[10]}{'det' if c[12] else ''}")
def test_switch_changes_no_bit(monkeypatch, case, switch):
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, dtype, page, layout, s_q, kvk, splits, table_fill, det = case
    env, val = switch
    lens = _lengths(B, C, seed=B + C)
    q, kc, vc, bt, hl, ref_out, ref_lse = dense_case(B, C, hq, hkv, D, dtype, page, layout, s_q, lens,
                                                     seed=B * 7 + D, table_fill=table_fill)
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    kv = None
    if kvk == "e4m3":
        k8, ks = gqadrv.quantize_kv_fp8(d[1])
        v8, vs = gqadrv.quantize_kv_fp8(d[2])
        kv = (k8, v8, {"kv_dtype": "e4m3", "k_scale": float(ks.get()), "v_scale": float(vs.get())})

    _clear(monkeypatch)
    p0, o0, l0 = _prepare(d, layout, splits, det, kv)
    assert p0.route.startswith("paged_tma_") and _flags(p0) >> SHIFT == 0, (p0.route, _flags(p0))
    base = _run(p0, o0, l0)

    monkeypatch.setenv(env, val)
    p1, o1, l1 = _prepare(d, layout, splits, det, kv)
    tag = f"_paged_{env[13:].lower()}{val}"
    assert p1.route.startswith("paged_tma_") and p1.route.endswith(tag), (p1.route, tag)
    assert p1.num_splits == p0.num_splits
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = s_q * (hq // hkv)
    units = B * hkv * -(-rows // (8 if rows <= 8 else 16))
    grid = p1._plans[0].grid[0]
    if env == "GQADRV_PAGED_NEXT":
        stride = _flags(p1) >> SHIFT
        assert stride > 0 and stride % sm == 0 and units * p1.num_splits > stride, (stride, sm, units)  # several waves
        assert grid == units * p1.num_splits
    elif p1.num_splits == 1 and not det:  # every case's build qualifies (D <= 128, its state fits a slot)
        if val == "2":  # two units per CTA
            assert grid == -(-units // 2), (grid, units)
        else:  # the resident CTAs
            assert grid < units and grid % sm == 0, (grid, units, sm)
    else:  # splits or the batch-invariant mode: one unit per CTA
        assert grid == units * p1.num_splits, (grid, units)
    got = _run(p1, o1, l1)

    assert np.array_equal(got[0].view(np.uint16), base[0].view(np.uint16)), "out differs from the default build"
    assert np.array_equal(got[1].view(np.uint32), base[1].view(np.uint32)), "lse differs from the default build"
    assert got[2] == base[2], (got[2], base[2])
    assert base[2]["bad_page"] == [], base[2]
    if kvk == "fp" and (env, val) != ("GQADRV_PAGED_NEXT", "1"):
        check_paged(got[0], got[1], ref_out, ref_lse, dtype, f"paged {env}={val}")


def test_bad_page_in_a_successor_box(monkeypatch):
    """A page id outside the pool at the first box of requests whose CTAs are successors (and of one in
    the first wave): they are reported (bad_page) for themselves only, as by the default build, and
    every output bit equals the default build's; the same under both GQADRV_PAGED_MULTI forms (units
    after a CTA's first)."""
    import cupy as cp

    import gqadrv

    B, C, hq, hkv, D, page = 48, 1024, 32, 8, 128, 16
    q, kc, vc, bt, hl, _, _ = dense_case(B, C, hq, hkv, D, "float16", page, "NHD", 1, [C] * B, seed=5)
    bt = bt.copy()
    bad = [2, 17, 30, 47]  # CTA b * 8 + h: 17 * 8 = 136 and later are successors on a 132-SM GPU
    for b in bad:
        bt[b, 0] = kc.shape[0] + 9
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    outs = []
    for sw in (None, ("GQADRV_PAGED_NEXT", "3"), ("GQADRV_PAGED_MULTI", "1"), ("GQADRV_PAGED_MULTI", "2")):
        _clear(monkeypatch)
        if sw is not None:
            monkeypatch.setenv(*sw)
        p, o, lb = _prepare(d, "NHD", None, False, None)
        outs.append(_run(p, o, lb))
        assert (_flags(p) >> SHIFT > 0) == (sw is not None and sw[0] == "GQADRV_PAGED_NEXT")
    for got in outs:
        assert got[2] == {"empty": [], "clamped": [], "bad_page": bad}, got[2]
    for got in outs[1:]:
        assert np.array_equal(outs[0][0].view(np.uint16), got[0].view(np.uint16))
        assert np.array_equal(outs[0][1].view(np.uint32), got[1].view(np.uint32))
