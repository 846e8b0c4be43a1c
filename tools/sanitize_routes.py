"""Run every GQA route once on small shapes (plus the runtime proof kernel) and check the results;
meant to be run under compute-sanitizer (``--mla-only``: the MLA routes alone; ``--paged-only``: the paged GQA routes and
merge_state alone; ``--gqa-only``: the contiguous GQA routes and the proof kernel alone):

    for t in memcheck racecheck synccheck initcheck; do
        compute-sanitizer --tool $t --report-api-errors no --error-exitcode 9 python tools/sanitize_routes.py
    done
(--report-api-errors no: cuda.bindings probes driver entry points with cuGetProcAddress, and the
 ones an older driver lacks would otherwise be listed as API errors; device errors are unaffected.)

Routes: short, TMA (1 split; 3, 8 and 16 splits, merged in clusters), portable (1 and 3 splits), with lengths that include
0, negative, > capacity and poisoned (NaN) padding; MLA decode (seesaw_tma, seesaw, narrow16, wgmma and mma.sync, 1 to 3 splits,
and, on the 656-byte FP8 cache, seesaw_fp8, narrow16_fp8, wide64_fp8 and mma_fp8,
causal, NaN-poisoned pages and block-table entries; ``--sparse-only``: the sparse MLA decode alone, also part of the MLA
routes; seesaw_bal: the balanced persistent grid; ``--backend NAME`` with ``--mla-only`` or ``--sparse-only``: only the
MLA cases forced onto that backend, e.g. ``--mla-only --backend narrow16_fp8``). Exit code 0 when every result matches
the oracle.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _only_backend() -> str | None:
    """--backend NAME: run only the MLA cases of that backend."""
    args = sys.argv[1:]
    return args[args.index("--backend") + 1] if "--backend" in args and args.index("--backend") + 1 < len(args) else None


def _run_as(backend: str) -> str | None:
    """The backend a case written for ``backend`` runs on, or None (skipped): every case without
    --backend; with --backend NAME the cases of NAME, or of its base when NAME is an experiment build
    of a default variant (GQADRV_MLA_EXPERIMENTS=1: ``<base>_<suffix>``, e.g. seesaw_bal_nopl2 runs the
    seesaw_bal cases; the longest default name that NAME extends is its base)."""
    only = _only_backend()
    if only is None or only == backend:
        return backend
    from gqadrv.mla import kernel_spec

    names = {k.name for k in kernel_spec.DEFAULT_VARIANTS}
    bases = [n for n in names if only.startswith(n + "_")]
    return only if only not in names and bases and max(bases, key=len) == backend else None


def main() -> int:
    import cupy as cp

    import gqadrv
    from gqadrv.gqa.reference import gqa_decode_reference
    from gqadrv.runtime.proof import tma_ring_reduce

    rng = np.random.default_rng(0)
    bad = 0
    runs = [("short", None, 48, 1), ("tma", None, 300, 1), ("tma-split", None, 300, 3), ("tma-split8", None, 1100, 8),
            ("tma-split16", None, 2100, 16),
            ("portable", "portable", 300, 1), ("portable-split", "portable", 300, 3)]
    if "--mla-only" in sys.argv[1:]:
        return 1 if _mla_routes(cp, gqadrv, rng) else 0
    if "--paged-only" in sys.argv[1:]:
        return 1 if _paged_routes(cp, gqadrv, rng) else 0
    if "--sparse-only" in sys.argv[1:]:
        return 1 if _sparse_routes(cp, gqadrv, rng) else 0
    for name, backend, C, splits in runs:
        B, Hq, Hkv, D = 4, 8, 1 if splits > 8 else 2, 128  # 4 clusters of 16 are resident on any sm_90
        q = rng.standard_normal((B, Hq, D)).astype(np.float16)
        kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float16)
        lens = np.array([C, 0, C + 9, C // 3], np.int32)
        for b, n in enumerate(lens):
            kv[b, :, :, max(0, min(int(n), C)):] = np.nan
        ref = gqa_decode_reference(q, kv, lens)
        dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
        o = cp.empty_like(dq)
        p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dl, num_splits=splits, backend=backend)
        for _ in range(2):
            gqadrv.launch_prepared(p)
        out = gqadrv.gqa_decode(dq, dkv, dl, backend=backend)
        cp.cuda.Device().synchronize()
        for label, got in (("prepared", o), ("convenience", out)):
            err = float(np.max(np.abs(cp.asnumpy(got).astype(np.float64) - ref)))
            ok = err < 2e-2
            bad += not ok
            print(f"{name:15s} {label:12s} route={p.route} splits={p.num_splits} cluster={p._plans[0].cluster} "
                  f"max err {err:.2e} {'OK' if ok else 'FAIL'}")
    if "--gqa-only" not in sys.argv[1:]:
        bad += _mla_routes(cp, gqadrv, rng)
        bad += _paged_routes(cp, gqadrv, rng)
    x = cp.asarray(rng.standard_normal((2, 2, 300, 200)).astype(np.float32))
    s = cp.asnumpy(tma_ring_reduce(x))
    h = cp.asnumpy(x).astype(np.float64)
    pad = np.zeros((2, 2, 384, 256))
    pad[:, :, :300, :200] = h
    ref = pad.reshape(2, 2, 3, 128, 4, 64).sum(axis=(3, 5))
    ok = np.allclose(s, ref, rtol=1e-4, atol=1e-2)
    bad += not ok
    print(f"proof tma_ring_reduce {'OK' if ok else 'FAIL'}")
    return 1 if bad else 0


def _paged_routes(cp, gqadrv, rng) -> int:
    """Paged GQA decode: TMA and cp.async kernels, page 16 / 1, s_q 1 and 4 (two row blocks at group
    8), 1, 3 and 9 splits (the TMA kernel's in clusters) and the batch-invariant mode, LSE, poisoned table entries and NaN in unused
    pages, a length past the capacity, an empty request and a page id out of range; then merge_state."""
    from gqadrv.gqa.reference import gqa_decode_paged_reference, paged_kv_from_contiguous

    from gqadrv.ops.fp8 import e4m3_from_f32, e4m3_to_f32

    bad = 0
    B, Hq, Hkv, D, T = 4, 16, 2, 128, 320  # T: whole pages of every tested size
    for backend, page, s_q, splits, det, fp8 in (
            ("hopper", 16, 1, 1, False, False), ("hopper", 16, 4, 3, False, False), ("hopper", 32, 4, None, True, False),
            ("hopper", 16, 1, 9, False, False),  # clusters of 9 (3 and 9: the balanced splits merge in clusters)
            ("portable", 16, 4, 3, False, False), ("portable", 1, 1, None, True, False),
            ("portable", 4, 2, 1, False, False),
            # e4m3 caches (uint8 codes, per-head device scales): TMA and cp.async kernels
            ("hopper", 16, 1, 1, False, True), ("hopper", 32, 4, 3, False, True), ("portable", 16, 2, 3, False, True),
            ("portable", 1, 1, None, True, True)):
        lens = np.array([T, 0, T + 40, T // 3], np.int32)
        k = rng.standard_normal((B, T, Hkv, D)).astype(np.float16)
        v = rng.standard_normal((B, T, Hkv, D)).astype(np.float16)
        kc, vc, bt = paged_kv_from_contiguous(k, v, np.minimum(lens, T), page, rng=rng, extra_pages=2,
                                              max_pages=-(-T // page))
        bad_row = 3  # request 3: one page id past the pool, reported as bad_page
        bt[bad_row, 0] = kc.shape[0] + 5
        q = rng.standard_normal((B, s_q, Hq, D)).astype(np.float16)
        kw = {}
        if fp8:  # codes of the fp16 pages (NaN poison stays NaN: code 0x7F), dequantized for the oracle
            ks, vs = np.array([0.5, 1.5], np.float32), np.array([2.0, 0.25], np.float32)
            kc8, vc8 = e4m3_from_f32(kc.astype(np.float32) / ks[:, None]), e4m3_from_f32(vc.astype(np.float32) / vs[:, None])
            kc, vc = e4m3_to_f32(kc8) * ks[:, None], e4m3_to_f32(vc8) * vs[:, None]
            kw = dict(kv_dtype="e4m3", k_scale=cp.asarray(ks), v_scale=cp.asarray(vs))
        ref, ref_lse = gqa_decode_paged_reference(q, kc, vc, bt, lens)
        dq, dt, dl = (cp.asarray(x) for x in (q, bt, lens))
        dk, dv = (cp.asarray(kc8), cp.asarray(vc8)) if fp8 else (cp.asarray(kc), cp.asarray(vc))
        o, lse = cp.empty_like(dq), cp.empty((B, s_q, Hq), cp.float32)
        p = gqadrv.prepare_gqa_decode_paged(q=dq, k_cache=dk, v_cache=dv, block_table=dt, seq_lens=dl, out=o,
                                            lse=lse, num_splits=None if det else splits, deterministic=det,
                                            backend=backend, **kw)
        for _ in range(2):
            gqadrv.launch_prepared(p)
        st = gqadrv.check_status(p)
        good = [0, 1, 2]  # request 3 reads zeros for its bad page: not compared
        err = float(np.max(np.abs(cp.asnumpy(o)[good].astype(np.float64) - ref[good])))
        fin = np.isfinite(ref_lse[good])
        lerr = float(np.max(np.abs(cp.asnumpy(lse)[good][fin] - ref_lse[good][fin])))
        ok = err < 2e-2 and lerr < 1e-2 and st["bad_page"] == [bad_row] and st["empty"] == [1] and st["clamped"] == [2]
        bad += not ok
        print(f"paged {'e4m3 ' if fp8 else ''}{backend:8s} page {page:2d} s_q {s_q} splits {p.num_splits} det {det} "
              f"route={p.route} cluster={p._plans[0].cluster} "
              f"max err {err:.2e} lse {lerr:.2e} status {st} {'OK' if ok else 'FAIL'}")
    va = cp.asarray(rng.standard_normal((6, 4, 128)).astype(np.float16))
    vb = cp.asarray(rng.standard_normal((6, 4, 128)).astype(np.float16))
    sa = cp.asarray(rng.standard_normal((6, 4)).astype(np.float32))
    sb = cp.asarray(rng.standard_normal((6, 4)).astype(np.float32))
    vm, sm = gqadrv.merge_state(va, sa, vb, sb)
    w = np.exp(np.stack([cp.asnumpy(sa), cp.asnumpy(sb)]) - np.logaddexp(cp.asnumpy(sa), cp.asnumpy(sb)))
    want = w[0][..., None] * cp.asnumpy(va).astype(np.float64) + w[1][..., None] * cp.asnumpy(vb).astype(np.float64)
    err = float(np.max(np.abs(cp.asnumpy(vm).astype(np.float64) - want)))
    ok = err < 2e-3
    bad += not ok
    print(f"merge_state max err {err:.2e} {'OK' if ok else 'FAIL'}")
    return bad


def _mla_routes(cp, gqadrv, rng) -> int:
    """MLA decode: wgmma and mma.sync routes, 1 and 3 splits, causal s_q 2, lengths 0 / > capacity,
    NaN-poisoned unused pages and block-table entries."""
    from gqadrv.mla.reference import mla_decode_reference
    from gqadrv.mla.selftest import make_case

    bad = 0
    for backend, splits, s_q, page in (("seesaw_tma", 1, 1, 64), ("seesaw_tma", 3, 2, 128), ("seesaw_tma", 2, 1, 256),
                                       ("seesaw", 1, 1, 64), ("seesaw", 3, 2, 16), ("narrow16", 3, 1, 1),
                                       ("narrow16_tma", 3, 1, 64), ("narrow32_tma", 1, 2, 128),
                                       ("narrow16x2_tma", 3, 1, 64), ("narrow16x2_tma", 1, 1, 256),
                                       ("narrow16_bal", None, 1, 64), ("narrow16_bal", 2, 1, 128),
                                       ("seesaw_bal", None, 1, 64), ("seesaw_bal", 2, 2, 128),
                                       ("seesaw_bal_cp", None, 1, 16), ("seesaw_bal_cp", 2, 2, 1),
                                       ("wgmma", 1, 1, 64), ("wgmma", 3, 2, 16), ("mma", 3, 1, 1), ("mma", 1, 2, 32)):
        run_as = _run_as(backend)
        if run_as is None:
            continue
        q, k, bt, ln = make_case(rng, 3, s_q, 16, 1, page, [300, 0, 10**6], max_blocks=-(-300 // page))
        o, lse = gqadrv.flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512,
                                               num_splits=splits, causal=s_q > 1, backend=run_as)
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, s_q > 1)
        err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ro)))
        ok = err < 3e-2 and bool(np.array_equal(np.isinf(cp.asnumpy(lse)), np.isinf(rl)))
        bad += not ok
        print(f"mla {run_as:10s} splits={splits} s_q={s_q} page={page} max err {err:.2e} {'OK' if ok else 'FAIL'}")
    # balanced grid on a uniform batch of k = 2 requests per CTA (the whole-request chunk, no cuts)
    for backend, h_q in (("seesaw_bal", 64), ("narrow16_bal", 16), ("seesaw_bal_cp", 64)):
        run_as = _run_as(backend)
        if run_as is None:
            continue
        q, k, bt, ln = make_case(rng, 4, 1, h_q, 1, 64, [300] * 4, max_blocks=5)
        o, lse = gqadrv.flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k), cp.asarray(bt), cp.asarray(ln), 512,
                                               num_splits=2, backend=run_as)
        ro, rl = mla_decode_reference(q, k, bt, ln, 512, None, False)
        err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ro)))
        ok = err < 3e-2 and bool(np.allclose(cp.asnumpy(lse), rl, atol=1e-3))
        bad += not ok
        print(f"mla {run_as:10s} uniform b=4 on 2 CTAs max err {err:.2e} {'OK' if ok else 'FAIL'}")
    # the 656-byte FP8 cache (is_fp8_kvcache=True): unused rows all 0xFF (NaN codes, scales and RoPE)
    from gqadrv.mla.fp8_reference import dequantize_k_cache_reference, quantize_k_cache_reference

    for backend, splits, s_q, page, h_q in (("seesaw_fp8", 1, 1, 64, 64), ("seesaw_fp8", 3, 2, 16, 64),
                                            ("seesaw_fp8", 2, 1, 1, 64), ("mma_fp8", 1, 1, 64, 64),
                                            ("mma_fp8", 3, 2, 32, 64), ("narrow16_fp8", 1, 1, 64, 16),
                                            ("narrow16_fp8", 3, 1, 16, 16), ("narrow16_fp8", 2, 2, 1, 8),
                                            ("wide64_fp8", 1, 1, 64, 64), ("wide64_fp8", 3, 2, 16, 128),
                                            ("wide64_fp8", 2, 1, 1, 32)):
        run_as = _run_as(backend)
        if run_as is None:
            continue
        q, k, bt, ln = make_case(rng, 3, s_q, h_q, 1, page, [300, 0, 10**6], max_blocks=-(-300 // page))
        k8 = quantize_k_cache_reference(k)
        k8[np.isnan(np.asarray(k, np.float32)).all(axis=-1)] = 0xFF
        o, lse = gqadrv.flash_mla_with_kvcache(cp.asarray(q), cp.asarray(k8), cp.asarray(bt), cp.asarray(ln), 512,
                                               num_splits=splits, causal=s_q > 1, backend=run_as, is_fp8_kvcache=True)
        ro, rl = mla_decode_reference(q, dequantize_k_cache_reference(k8), bt, ln, 512, None, s_q > 1)
        err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ro)))
        ok = err < 3e-2 and bool(np.array_equal(np.isinf(cp.asnumpy(lse)), np.isinf(rl)))
        bad += not ok
        print(f"mla {run_as:10s} splits={splits} s_q={s_q} page={page} fp8 max err {err:.2e} {'OK' if ok else 'FAIL'}")
    return bad + _sparse_routes(cp, gqadrv, rng)


def _sparse_routes(cp, gqadrv, rng) -> int:
    """Sparse MLA decode (indices): FP8 and bf16 pools of odd page sizes whose unreferenced rows are
    NaN, every kind of invalid index, topk_length, an extra pool, attention sinks with +-inf, s_q 2
    (the LSE transpose), an unmergeable q (packed), 1 and 3 splits, seesaw(_fp8) and mma(_fp8)."""
    import ml_dtypes

    from gqadrv.mla.fp8_reference import dequantize_k_cache_reference, quantize_k_cache_reference
    from gqadrv.mla.sparse_reference import sparse_decode_reference

    bad = 0
    b, h_q, nb, page, topk, enb, epage, etopk = 3, 16, 9, 13, 70, 4, 5, 11
    bad_idx = np.array([-1, -(2**31), 2**31 - 1, nb * page, 2147480000, -123456], np.int32)
    for fp8, backend, splits, s_q in ((True, "seesaw_fp8", 1, 2), (True, "seesaw_fp8", 3, 1), (True, "mma_fp8", 3, 2),
                                      (True, "narrow16_fp8", 3, 1), (True, "wide64_fp8", 3, 2), (False, "seesaw", 3, 2),
                                      (False, "seesaw_bal_cp", None, 2), (False, "mma", 1, 1)):
        run_as = _run_as(backend)
        if run_as is None:
            continue
        k = (rng.standard_normal((nb, page, 1, 576)) / 4).astype(ml_dtypes.bfloat16)
        ek = (rng.standard_normal((enb, epage, 1, 576)) / 4).astype(ml_dtypes.bfloat16)
        idx = rng.integers(0, nb * page, size=(b, s_q, topk)).astype(np.int32)
        idx[:, :, ::5] = bad_idx[rng.integers(0, 6, size=idx[:, :, ::5].shape)]
        idx[2] = -1                                                   # request 2: no valid main key
        eidx = rng.integers(-2, enb * epage + 2, size=(b, s_q, etopk)).astype(np.int32)
        eidx[2, 0] = -1                                               # request 2, token 0: no key at all
        used = np.zeros(nb * page, bool)
        used[idx[(idx >= 0) & (idx < nb * page)]] = True
        kf = k.reshape(-1, 576).copy()
        kf[~used] = np.nan                                            # unreferenced rows: NaN
        k = kf.reshape(k.shape)
        tl = np.array([topk, 33, topk], np.int32)
        etl = np.array([etopk, 0, 7], np.int32)
        sink = rng.standard_normal(h_q).astype(np.float32)
        sink[[1, 2]] = [np.inf, -np.inf]
        qw = (rng.standard_normal((b, s_q + 1, h_q, 576)) / 4).astype(ml_dtypes.bfloat16)
        q = qw[:, :s_q]                                               # s_q > 1: request stride != s_q x token stride
        if fp8:
            k8, ek8 = quantize_k_cache_reference(k), quantize_k_cache_reference(ek)
            k8[~used.reshape(nb, page)] = 0xFF
            dk, dek, kn, ekn = cp.asarray(k8), cp.asarray(ek8), dequantize_k_cache_reference(k8), dequantize_k_cache_reference(ek8)
        else:
            dk, dek, kn, ekn = cp.asarray(k), cp.asarray(ek), k, ek
        dq = cp.asarray(qw)[:, :s_q]
        o, lse = gqadrv.flash_mla_with_kvcache(dq, dk, None, None, 512, None, num_splits=splits, is_fp8_kvcache=fp8,
                                               backend=run_as, indices=cp.asarray(idx), attn_sink=cp.asarray(sink),
                                               topk_length=cp.asarray(tl), extra_k_cache=dek,
                                               extra_indices_in_kvcache=cp.asarray(eidx),
                                               extra_topk_length=cp.asarray(etl))
        ro, rl = sparse_decode_reference(q, kn, idx, None, 512, sink, tl, ekn, eidx, etl)
        err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ro)))
        with np.errstate(invalid="ignore"):
            lerr = float(np.max(np.abs(np.where(np.isinf(rl), 0, cp.asnumpy(lse) - rl))))
        ok = (err < 3e-2 and lerr < 1e-3 and bool(np.array_equal(np.isinf(cp.asnumpy(lse)), np.isinf(rl)))
              and not np.isnan(cp.asnumpy(o).astype(np.float32)).any())
        bad += not ok
        print(f"mla sparse {'fp8 ' if fp8 else 'bf16'} {run_as:10s} splits={splits} s_q={s_q} max err {err:.2e} "
              f"lse {lerr:.2e} {'OK' if ok else 'FAIL'}")
    return bad + _sparse_prefill_routes(cp, gqadrv, rng)


def _sparse_prefill_routes(cp, gqadrv, rng) -> int:
    """Sparse prefill on the balanced grid without cuts (seesaw_bal_cp, seesaw_nope_bal for d_qk 512):
    every kind of invalid index, NaN in unreferenced kv rows, a row without any valid index; d_qk 512 with an
    attention sink (applied in the dense kernel's epilogue, FLAG_SINK; +inf / -inf entries)."""
    import ml_dtypes

    from gqadrv.mla.sparse_reference import sparse_prefill_reference

    bad = 0
    s_q, h_q, s_kv, topk = 9, 16, 150, 70
    for d_qk in (576, 512):
        run_as = _run_as("seesaw_bal_cp")
        if run_as is None:
            continue
        kv = (rng.standard_normal((s_kv, 1, d_qk)) / 4).astype(ml_dtypes.bfloat16)
        q = (rng.standard_normal((s_q, h_q, d_qk)) / 4).astype(ml_dtypes.bfloat16)
        idx = rng.integers(0, s_kv, size=(s_q, 1, topk)).astype(np.int32)
        idx[:, :, ::4] = np.array([-1, -(2**31), 2**31 - 1, s_kv, 2147480000], np.int32)[rng.integers(0, 5, size=idx[:, :, ::4].shape)]
        idx[3] = -1
        used = np.zeros(s_kv, bool)
        used[idx[(idx >= 0) & (idx < s_kv)]] = True
        kv[~used] = np.nan
        sink = None
        if d_qk == 512:
            sink = rng.standard_normal(h_q).astype(np.float32)
            sink[:2] = (np.inf, -np.inf)
        o, mx, lse = gqadrv.flash_mla_sparse_fwd(cp.asarray(q), cp.asarray(kv), cp.asarray(idx), 0.1, backend=run_as,
                                                 attn_sink=None if sink is None else cp.asarray(sink))
        ro, rm, rl = sparse_prefill_reference(q, kv, idx, 0.1, 512, sink)
        err = float(np.max(np.abs(cp.asnumpy(o).astype(np.float64) - ro)))
        ok = (err < 3e-2 and bool(np.array_equal(np.isinf(cp.asnumpy(lse)), np.isinf(rl)))
              and not np.isnan(cp.asnumpy(o).astype(np.float32)).any())
        bad += not ok
        print(f"mla sparse prefill d_qk {d_qk} {run_as:10s} max err {err:.2e} {'OK' if ok else 'FAIL'}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
