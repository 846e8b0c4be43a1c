"""The MLA experiment builds (GQADRV_MLA_EXPERIMENTS=1) on the GPU. The balanced variants keep split
partials in L2 (stored evict_last, discarded from L2 once merged: MLA_PARTIAL_L2=1); the experiment
``<variant>_nopl2`` builds them without those cache policies. Both must give bit-identical outputs
on every launch of a prepared object (a discarded line must never be read again by a later launch).
The scripts run in a subprocess, since the experiment variants are registered when gqadrv.mla.kernel_spec is
imported. ``seesaw_bal_arrive`` / ``_arrive1`` (MLA_SYNC_HANDOFF 0 / 1: the writer of a scale hand-off
arrives on the named barrier instead of the default sync) hand over the same values: they must match the
oracle and give out / lse bit-identical to seesaw_bal. ``<variant>_st4`` (MLA_OUT_V16=0: one 4-byte store per
pair of output channels instead of the default 16-byte chunks) must give outputs bit-identical to the default.
The sparse prefill's builds without one of its 2026-12-06 changes (``_nohint``: no L2 policies, ``_nb9``: the
zero channel block of d_qk 512 multiplied), ``_oef`` (out stores with an L2 evict_first policy) and ``_bt0`` (block-table
entries read just before their copies) must be bit-identical to the default; ``_xmax`` (the exact running max
under max_logits) must give bit-identical max_logits and out / lse within the grid's tolerances."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _run_experiment_script(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Runs a test script in a subprocess with GQADRV_MLA_EXPERIMENTS=1 (the experiment variants are
    registered when gqadrv.mla.kernel_spec is imported) and the repository on PYTHONPATH."""
    env = dict(os.environ, GQADRV_MLA_EXPERIMENTS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)

# Shared by the scripts below: a paged fp16 batch (K pages in random order) and n launches of a prepared
# object as host copies (out as uint16 bits, lse).
PAGED_HELPERS = textwrap.dedent("""
    import cupy as cp, numpy as np, gqadrv

    def paged_batch(rs, b, h_q, lens, page):
        mb = -(-max(lens) // page)
        k = cp.asarray((rs.standard_normal((b * mb, page, 1, 576)) / 10).astype(np.float16))
        q = cp.asarray((rs.standard_normal((b, 1, h_q, 576)) / 10).astype(np.float16))
        bt = cp.asarray(rs.permutation(b * mb).astype(np.int32).reshape(b, mb))
        return q, k, bt, cp.asarray(np.array(lens, np.int32))

    def launches(p, n):
        runs = []
        for _ in range(n):
            o, l = gqadrv.launch_prepared(p)
            runs.append((cp.asnumpy(o).view(np.uint16).copy(), cp.asnumpy(l).copy()))
        return runs
""")

SCRIPT = PAGED_HELPERS + textwrap.dedent("""
    rs = np.random.default_rng(3)
    failures = []
    cases = [  # (b, h_q, lengths, page): uniform (whole mode), spread and skewed batches (cuts)
        (128, 64, [4096] * 128, 64),
        (128, 64, [1024 + (3 * 4096 // 2) * i // 127 for i in range(128)], 64),
        (64, 16, [16 * 2048] + [2048] * 63, 64),
        (37, 16, [int(x) for x in rs.integers(0, 3000, 37)], 128),
        (20, 128, [int(x) for x in rs.integers(1, 5000, 20)], 64),
    ]
    for b, h_q, lens, page in cases:
        q, k, bt, sl = paged_batch(rs, b, h_q, lens, page)
        fam = "narrow16_bal" if h_q <= 16 else "seesaw_bal"
        for base in (fam, fam + "_cut32"):
            res = {v: launches(gqadrv.prepare_mla_decode(q, k, bt, sl, backend=v), 3) for v in (base, base + "_nopl2")}
            ref = res[base][0]
            for v, runs in res.items():
                for i, (o, l) in enumerate(runs):
                    if not (np.array_equal(o, ref[0]) and np.array_equal(l, ref[1], equal_nan=True)):
                        failures.append(f"b{b} h_q{h_q} {v} launch {i}")
    print("FAILURES:", failures)
    raise SystemExit(1 if failures else 0)
""")


def test_partial_l2_cache_policies_leave_outputs_bit_identical_on_every_launch():
    r = _run_experiment_script(SCRIPT, 600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])


# The oracle / A-B script's helpers: a variant's launches (the first against the float64 oracle with the grid's
# bounds, every later one bit-identical to it) and its distance from a base build (out within the dtype's
# tolerance, lse within 1e-4, the same rows without keys).
ORACLE_AB_HELPERS = textwrap.dedent("""
    import cupy as cp, numpy as np, gqadrv
    from gqadrv.mla.reference import mla_decode_reference
    from gqadrv.mla.selftest import make_case
    from tests.helpers import MAX_ERRORS
    from tests.mla.cases import TOL
    from tests.mla.test_mla_gpu import check
    failures = []

    def run_checked(tag, backend, launches, q, k, bt, ln, causal, splits, ro, rl, dtype):
        p = gqadrv.prepare_mla_decode(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512,
                                      causal=causal, num_splits=splits, backend=backend)
        o, l = gqadrv.launch_prepared(p)
        o1, l1 = cp.asnumpy(o).astype(np.float64), cp.asnumpy(l).astype(np.float64)
        for rep in range(launches - 1):
            o, l = gqadrv.launch_prepared(p)
            if not (np.array_equal(cp.asnumpy(o).astype(np.float64), o1, equal_nan=True)
                    and np.array_equal(cp.asnumpy(l).astype(np.float64), l1, equal_nan=True)):
                failures.append(f"{tag} {backend}: launch {rep + 2} differs from the first")
                break
        try:   # the MLA oracle grid's check (tests/mla/test_mla_gpu.py): same bounds
            check(o1, l1, ro, rl, dtype, backend)
        except AssertionError as e:
            failures.append(f"{tag}: {e}")
        return o1, l1

    def against_base(tag, base, base_res, variant, res, dtype):
        (ob, lb), (ov, lv) = base_res, res
        fin = np.isfinite(lb)
        d_out = float(np.abs(ov - ob).max())
        d_lse = float(np.abs(lv[fin] - lb[fin]).max()) if fin.any() else 0.0
        if d_out > TOL[dtype] or d_lse > 1e-4 or not np.array_equal(fin, np.isfinite(lv)):
            failures.append(f"{tag} {variant} against {base}: out {d_out:.3e}, lse {d_lse:.3e}")
        print(f"{tag} {variant} - {base} max |out| {d_out:.3e}, |lse| {d_lse:.3e}")

    def finish():
        for key, e in sorted(MAX_ERRORS.items()):
            print(f"max err against the oracle, {key}: {e:.3e}")
        print("FAILURES:", failures)
        raise SystemExit(1 if failures else 0)
""")

ARRIVE_SCRIPT = ORACLE_AB_HELPERS + textwrap.dedent("""
    # (page, b, s_q, h_q, lengths, splits, causal, dtype): uniform (whole requests), spread and skewed (cut)
    # batches, causal s_q 2 and 4, partial last tiles, one- and two-pair items, empty and over-capacity
    # lengths, a forced split count, h_q 32 / 64 / 128; NaN in unused rows
    cases = [
        (64, 128, 1, 64, [2048 + 17] * 128, None, False, "bfloat16"),
        (64, 64, 1, 128, [4096] * 64, None, False, "float16"),
        (64, 128, 1, 64, [512 + 3 * 1024 * i // 127 + i % 5 for i in range(128)], None, False, "bfloat16"),
        (128, 20, 1, 64, [16 * 1024 + 3] + [700] * 19, None, False, "float16"),
        (256, 9, 2, 64, [127, 4096 + 17, 0, 1, 2000, 64, 65, 129, 3333], None, True, "bfloat16"),
        (64, 7, 4, 32, [1, 63, 64, 65, 128, 129, 5000], 5, True, "float16"),
        (64, 3, 1, 64, [65, 0, 10**6], None, False, "bfloat16"),
    ]
    variants = ("seesaw_bal", "seesaw_bal_arrive", "seesaw_bal_arrive1")
    for i, (page, b, s_q, h_q, lens, splits, causal, dtype) in enumerate(cases):
        rng = np.random.default_rng(400 + i)
        cap = max(min(max(lens), 20000), 1)
        q, k, bt, ln = make_case(rng, b, s_q, h_q, 1, page, lens, dtype, max_blocks=-(-cap // page))
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, causal)
        res = {v: run_checked(f"case {i}", v, 3, q, k, bt, ln, causal, splits, ro, rl, dtype) for v in variants}
        for v in variants[1:]:
            against_base(f"case {i}", "seesaw_bal", res["seesaw_bal"], v, res[v], dtype)
            same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(res[v], res["seesaw_bal"]))
            if not same:
                failures.append(f"case {i} {v}: out / lse not bit-identical to seesaw_bal")
    finish()
""")


def test_arrive_handoff_builds_match_the_oracle_and_the_default_bit_for_bit():
    """``seesaw_bal_arrive`` / ``_arrive1`` (writer-side bar.arrive on the scale hand-offs) against the float64 oracle
    and seesaw_bal on uniform, spread and skewed batches, causal s_q 2 and 4, partial last tiles, one- and
    two-pair items, empty and over-capacity lengths, a forced split count, h_q 32 / 64 / 128: out / lse
    bit-identical to seesaw_bal, three launches of each prepared object bit-identical."""
    r = _run_experiment_script(ARRIVE_SCRIPT, 900)
    print(r.stdout[-4000:])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])


OUT_STORE_SCRIPT = ORACLE_AB_HELPERS + textwrap.dedent("""
    # the out stores' transpose (MLA_OUT_V16, the default) changes how values are stored, never what they are:
    # out / lse of the 4-byte-store builds (_st4) bit-identical to the default builds; h_q 3 / 37 / 64 / 128 (partial row blocks: rows past M not stored),
    # s_q 2 causal, pages 1 / 16 / 64, empty and over-capacity lengths, one CTA (no cut) and cut requests
    cases = [
        ("seesaw_bal", 64, 128, 1, 64, [2048 + 17] * 128, None, False, "bfloat16"),
        ("seesaw_bal", 64, 9, 2, 64, [127, 4096 + 17, 0, 1, 2000, 64, 65, 129, 3333], None, True, "float16"),
        ("seesaw_bal", 128, 20, 1, 37, [16 * 1024 + 3] + [700] * 19, None, False, "bfloat16"),
        ("seesaw_bal_cp", 16, 50, 1, 128, [int(x) for x in np.random.default_rng(5).integers(0, 3000, 50)], None,
         False, "bfloat16"),
        ("seesaw_bal_cp", 1, 6, 2, 3, [65, 0, 10**6, 1, 300, 64], 3, True, "float16"),
    ]
    for i, (base, page, b, s_q, h_q, lens, splits, causal, dtype) in enumerate(cases):
        rng = np.random.default_rng(700 + i)
        cap = max(min(max(lens), 20000), 1)
        q, k, bt, ln = make_case(rng, b, s_q, h_q, 1, page, lens, dtype, max_blocks=-(-cap // page))
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, causal)
        res = {v: run_checked(f"case {i}", v, 2, q, k, bt, ln, causal, splits, ro, rl, dtype) for v in (base, base + "_st4")}
        same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(res[base + "_st4"], res[base]))
        print(f"case {i} {base}_st4 bit-identical to {base}: {same}")
        if not same:
            failures.append(f"case {i} {base}_st4: out / lse not bit-identical to {base}")
    # the d_qk 512 sparse prefill on seesaw_nope_bal and its _st4 build (forced by name)
    from gqadrv.mla.sparse_reference import sparse_prefill_reference
    rng = np.random.default_rng(9)
    q = cp.asarray((rng.standard_normal((300, 64, 512)) / 4).astype(np.float32)).astype("bfloat16")
    kv = cp.asarray((rng.standard_normal((400, 1, 512)) / 4).astype(np.float32)).astype("bfloat16")
    idx = cp.asarray(rng.integers(-3, 403, size=(300, 1, 100)).astype(np.int32))
    outs = {v: gqadrv.flash_mla_sparse_fwd(q, kv, idx, 0.1, backend=v) for v in ("seesaw_nope_bal", "seesaw_nope_bal_st4")}
    same = all(cp.array_equal(x, y, equal_nan=True) for x, y in zip(*outs.values()))
    print(f"sparse prefill seesaw_nope_bal_st4 bit-identical: {same}")
    if not same:
        failures.append("sparse prefill seesaw_nope_bal_st4: not bit-identical")
    finish()
""")


def test_out_store_builds_are_bit_identical():
    """The default 16-byte out stores (a transpose inside each quad, MLA_OUT_V16) and the 4-byte-store
    experiment builds ``<variant>_st4``, against the float64 oracle and bit for bit against each other:
    seesaw_bal / seesaw_bal_cp / seesaw_nope_bal (partial row blocks, causal s_q 2, pages 1 / 16 / 64, cut
    and whole requests, the d_qk 512 sparse prefill)."""
    r = _run_experiment_script(OUT_STORE_SCRIPT, 900)
    print(r.stdout[-4000:])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])


PREFILL_SCRIPT = textwrap.dedent("""
    import cupy as cp, numpy as np, gqadrv
    failures = []
    def finish():
        if failures:
            print("FAILURES:", *failures, sep="\\n")
            raise SystemExit(1)
        print("all builds agree")
    rng = np.random.default_rng(11)
    for d, s_q, h_q in ((576, 701, 64), (512, 701, 128), (576, 3, 64), (512, 40, 64)):
        # rising logits along every list (the lazy running max moves), some invalid indices
        q = cp.asarray((0.5 + rng.standard_normal((s_q, h_q, d)) / 10).astype(np.float32)).astype("bfloat16")
        kv = cp.asarray((np.linspace(0, 0.4, 900)[:, None, None] + rng.standard_normal((900, 1, d)) / 10)
                        .astype(np.float32)).astype("bfloat16")
        idx = np.sort(rng.integers(-5, 905, size=(s_q, 1, 384)).astype(np.int32), axis=2)
        idx = cp.asarray(idx)
        base = "seesaw_bal_cp" if d == 576 else "seesaw_nope_bal"
        ref = gqadrv.flash_mla_sparse_fwd(q, kv, idx, 0.5, backend="seesaw_bal_cp")
        ref = [cp.asnumpy(x.astype(cp.float32)) for x in ref]
        builds = ["seesaw_bal_cp_nohint", "seesaw_bal_cp_oef", "seesaw_bal_cp_bt0", "seesaw_bal_cp_xmax"]
        builds += ["seesaw_nope_bal_nb9"] if d == 512 else []
        for v in builds:
            got = [cp.asnumpy(x.astype(cp.float32)) for x in gqadrv.flash_mla_sparse_fwd(q, kv, idx, 0.5, backend=v)]
            tag = f"d{d} s_q{s_q} h_q{h_q} {v}"
            if v.endswith("_xmax"):
                ok_m = np.array_equal(got[1], ref[1], equal_nan=True)
                eo = float(np.nanmax(np.abs(got[0] - ref[0])))
                fin = np.isfinite(ref[2])
                el = float(np.abs(got[2][fin] - ref[2][fin]).max())
                print(f"{tag}: max_logits bit-identical {ok_m}, out diff {eo:.3e}, lse diff {el:.3e}")
                if not ok_m or eo > 2e-2 or el > 1e-3:
                    failures.append(tag)
            else:
                same = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(got, ref))
                print(f"{tag}: bit-identical {same}")
                if not same:
                    failures.append(tag)
    finish()
""")


def test_prefill_builds_agree():
    """The sparse prefill's default builds against ``_nohint`` / ``_oef`` / ``_bt0`` / ``_nb9`` (bit for bit) and ``_xmax``
    (max_logits bit for bit, out / lse close) on rising logits, balanced and split grids, d_qk 576 / 512."""
    r = _run_experiment_script(PREFILL_SCRIPT, 900)
    print(r.stdout[-4000:])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])

