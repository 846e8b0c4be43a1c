"""MLA dense decode: development check on a GPU (H200), plus a CPU layout model.

    python tools/mla_dev_check.py                   # layout model, compile, correctness grid, timing
    python tools/mla_dev_check.py --layout-only     # CPU only: the shared-memory / fragment model
    python tools/mla_dev_check.py --variants wgmma --dtypes bf16 --no-timing --quick

What it does
  1. CPU layout model (no GPU): replays the kernel's cp.async placement, the P-tile stores, the
     ldmatrix addresses of the mma.sync variant and the wgmma descriptor start/LBO/SBO arithmetic
     against the canonical 128B-swizzle layouts, and checks every fragment element lands where the
     math needs it.
  2. Compiles kernels/mla/sm90/dense_decode.cu through gqadrv.runtime (NVRTC, sm_90a) for each
     variant x dtype and prints the ptxas report.
  3. Correctness grid against gqadrv/mla/reference.py (float64): NaN-poisoned unused pages and
     padding, poisoned block-table entries past each request's pages (2147480000), shuffled page
     order, non-contiguous q / k_cache / block_table, lengths 0 / over-capacity / negative, causal,
     splits 1 / auto / 7 (split cases are launched twice without resetting the counters, which checks
     the in-kernel ticket reset). One line per case; summary "N passed, M failed".
  4. Timing: b 128, s_q 1, h_q 128 and 16, h_kv 1, len 4096 / 8192, page 64 (CUDA events around 50
     back-to-back launches).

Exit status: 0 all passed, 1 some case failed, 2 launch/driver error (printed), 3 hang (a launch did
not finish within --hang-seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ks = _load("mla_kernel_spec", "gqadrv/mla/kernel_spec.py")
ref = _load("mla_reference", "gqadrv/mla/reference.py")

POISON = 2147480000
NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00}


# =============================================================================== CPU layout model
def layout_model() -> list[str]:
    """Replays the kernel's address arithmetic on a model of shared memory; returns problems."""
    errs: list[str] = []
    CB, TILE = 8192, 9 * 8192
    OFF_Q, OFF_K, OFF_P = 0, TILE, 3 * TILE

    def swz(row, unit):
        return row * 128 + ((unit ^ (row & 7)) << 4)

    mem: dict[int, tuple] = {}

    # cp.async placement (load_tile_rows): Q at OFF_Q, K stage 0 at OFF_K
    for region, tag in ((OFF_Q, "Q"), (OFF_K, "K")):
        for tid in range(256):
            row = tid >> 2
            for i in range(18):
                c = (tid & 3) + 4 * i
                base = region + (c >> 3) * CB + swz(row, c & 7)
                for e in range(8):
                    if base + 2 * e in mem:
                        errs.append(f"{tag}: byte {base + 2 * e} written twice")
                    mem[base + 2 * e] = (tag, row, c * 8 + e)
    # P stores (thread rows r_lo / r_hi, columns 32wg + 8j + 2t (+1))
    for wg in range(2):
        for wi in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for r in (16 * wi + g, 16 * wi + g + 8):
                    for j in range(4):
                        a = OFF_P + swz(r, 4 * wg + j) + 4 * t
                        for e in range(2):
                            if a + 2 * e in mem:
                                errs.append(f"P: byte {a + 2 * e} written twice")
                            mem[a + 2 * e] = ("P", r, 32 * wg + 8 * j + 2 * t + e)
    if len(mem) != 2 * 64 * 576 + 64 * 64:
        errs.append(f"smem model holds {len(mem)} elements, expected {2 * 64 * 576 + 64 * 64}")

    def at(addr):
        return mem.get(addr, ("?", addr))

    def ldsm(addrs, trans):
        """regs[lane][m] = (low element tag, high element tag) for ldmatrix .x4 [.trans]."""
        out = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs = []
            for m in range(4):
                if trans:
                    regs.append((at(addrs[8 * m + 2 * t] + 2 * g), at(addrs[8 * m + 2 * t + 1] + 2 * g)))
                else:
                    regs.append((at(addrs[8 * m + g] + 4 * t), at(addrs[8 * m + g] + 4 * t + 2)))
            out.append(regs)
        return out

    def expect(got, want, what):
        if got != want and len(errs) < 20:
            errs.append(f"{what}: got {got}, want {want}")

    # mma.sync gemm_qk (transcribed from the kernel)
    for wg in range(2):
        for wi in range(4):
            for ks_ in range(36):
                cb, u0 = (ks_ >> 2) * CB, (ks_ & 3) * 2
                aa, bb0, bb1 = [], [], []
                for lane in range(32):
                    mi, lr = lane >> 3, lane & 7
                    a_row, a_u, b_u = 16 * wi + lr + 8 * (mi & 1), mi >> 1, mi & 1
                    a_base = OFF_Q + a_row * 128
                    b_base0 = OFF_K + (32 * wg + lr + 8 * (mi >> 1)) * 128
                    aa.append(a_base + cb + (((u0 + a_u) ^ lr) << 4))
                    bb0.append(b_base0 + cb + (((u0 + b_u) ^ lr) << 4))
                    bb1.append(b_base0 + 16 * 128 + cb + (((u0 + b_u) ^ lr) << 4))
                A, B0, B1 = ldsm(aa, False), ldsm(bb0, False), ldsm(bb1, False)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    k0 = 16 * ks_ + 2 * t
                    for m in range(4):
                        row, k = 16 * wi + g + 8 * (m & 1), k0 + 8 * (m >> 1)
                        expect(A[lane][m], (("Q", row, k), ("Q", row, k + 1)), f"qk A wg{wg} wi{wi} ks{ks_} l{lane} a{m}")
                    for half, BB in ((0, B0), (1, B1)):
                        for m in range(4):
                            n = 32 * wg + 16 * half + 8 * (m >> 1) + g
                            k = k0 + 8 * (m & 1)
                            expect(BB[lane][m], (("K", n, k), ("K", n, k + 1)), f"qk B wg{wg} ks{ks_} half{half} l{lane} b{m}")
    # mma.sync gemm_pv
    for wg in range(2):
        for wi in range(4):
            for kk in range(4):
                aa = []
                for lane in range(32):
                    mi, lr = lane >> 3, lane & 7
                    a_row, a_u = 16 * wi + lr + 8 * (mi & 1), mi >> 1
                    aa.append(OFF_P + a_row * 128 + (((2 * kk + a_u) ^ lr) << 4))
                A = ldsm(aa, False)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for m in range(4):
                        row, k = 16 * wi + g + 8 * (m & 1), 16 * kk + 2 * t + 8 * (m >> 1)
                        expect(A[lane][m], (("P", row, k), ("P", row, k + 1)), f"pv A wg{wg} wi{wi} kk{kk} l{lane} a{m}")
                for nn in range(16):
                    bb = []
                    for lane in range(32):
                        mi, lr = lane >> 3, lane & 7
                        v_row = OFF_K + (16 * kk + lr + 8 * (mi & 1)) * 128
                        cblk, unit = 4 * wg + (nn >> 2), 2 * (nn & 3) + (mi >> 1)
                        bb.append(v_row + cblk * CB + ((unit ^ lr) << 4))
                    B = ldsm(bb, True)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for m in range(4):
                            tok = 16 * kk + 2 * t + 8 * (m & 1)
                            ch = 256 * wg + 16 * nn + 8 * (m >> 1) + g
                            expect(B[lane][m], (("K", tok, ch), ("K", tok + 1, ch)), f"pv B wg{wg} kk{kk} nn{nn} l{lane} b{m}")

    # wgmma descriptors: canonical 128B-swizzle layouts (Swizzle<3,4,3> on byte addresses: bits
    # 4..6 ^= bits 7..9), K-major: row-group stride SBO, 128-byte rows, k contiguous;
    # MN-major: 64-element MN atoms at LBO, 8-row K groups at SBO, rows of 128 bytes.
    def sw(a):
        return a ^ (((a >> 7) & 7) << 4)

    def kmaj(start, sbo, r, k):
        return sw(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k)

    def mnmaj(start, lbo, sbo, n, k):
        return sw(start + (n // 64) * lbo + (n % 64) * 2 + (k // 8) * sbo + (k % 8) * 128)

    for ks_ in range(36):
        off = (ks_ >> 2) * CB + (ks_ & 3) * 32
        for r in range(64):
            for k in range(16):
                expect(at(kmaj(OFF_Q + off, 1024, r, k)), ("Q", r, 16 * ks_ + k), f"wgmma qk A ks{ks_}")
        for wg in range(2):
            for n in range(32):
                for k in range(16):
                    expect(at(kmaj(OFF_K + wg * 32 * 128 + off, 1024, n, k)), ("K", 32 * wg + n, 16 * ks_ + k),
                           f"wgmma qk B wg{wg} ks{ks_}")
    for kk in range(4):
        for r in range(64):
            for k in range(16):
                expect(at(kmaj(OFF_P + kk * 32, 1024, r, k)), ("P", r, 16 * kk + k), f"wgmma pv A kk{kk}")
        for wg in range(2):
            for n in range(256):
                for k in range(16):
                    expect(at(mnmaj(OFF_K + wg * 4 * CB + kk * 16 * 128, CB, 1024, n, k)), ("K", 16 * kk + k, 256 * wg + n),
                           f"wgmma pv B wg{wg} kk{kk}")
    return errs


# =============================================================================== GPU helpers
class LaunchError(RuntimeError):
    pass


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    if dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(np.float16).view(np.uint16)


def from_bits(u: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    if dtype == "bfloat16":
        return u.view(ml_dtypes.bfloat16)
    return u.view(np.float16)


class Runner:
    def __init__(self, args):
        import cupy as cp

        from gqadrv.runtime import device_info
        from gqadrv.runtime.compiler import compile_module
        from gqadrv.runtime.module import ArgPack, LaunchPlan, load_library

        self.cp = cp
        self.args = args
        cp.cuda.Device(0).use()
        cp.zeros(1)  # initialise the context first (shared primary context)
        self.info = device_info(0)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.ArgPack, self.LaunchPlan = ArgPack, LaunchPlan
        self.sig = ks.signature()
        self.kernels = {}
        print(f"device: {self.info.name} cc {self.info.cc} SMs {self.info.sm_count} smem opt-in {self.info.smem_optin} B")
        for variant in args.variants:
            for dt in args.dtypes:
                t0 = time.perf_counter()
                mod = compile_module(ks.SOURCE, "sm_90a", ks.defines(dt, variant))
                res = mod.resources.get(ks.ENTRY)
                k = load_library(mod.cubin, f"mla-{variant}-{dt}").kernel(ks.ENTRY, 0)
                k.ensure_dynamic_smem(ks.SMEM_BYTES)
                self.kernels[(variant, dt)] = k
                print(f"compiled {variant:5s} {dt:8s}: {res.registers if res else '?'} regs, "
                      f"spills {res.spill_stores if res else '?'}/{res.spill_loads if res else '?'}, "
                      f"stack {res.stack_bytes if res else '?'} B, dyn smem {ks.SMEM_BYTES} B, "
                      f"{'cached' if mod.from_cache else f'{time.perf_counter() - t0:.1f} s'}", flush=True)

    def sync(self):
        """Synchronise the stream, failing loudly on a hang instead of waiting forever."""
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.stream)
        deadline = time.time() + self.args.hang_seconds
        while not ev.done:
            if time.time() > deadline:
                print(f"HANG: a launch did not finish within {self.args.hang_seconds} s; exiting", flush=True)
                os._exit(3)
            time.sleep(0.0005)
        ev.synchronize()  # raises on a sticky launch error

    def launch(self, variant, dt, grid, block, smem, packed):
        pack = self.ArgPack(self.sig).pack(packed)
        plan = self.LaunchPlan(self.kernels[(variant, dt)], grid, block, smem, pack, stream=int(self.stream.ptr))
        try:
            plan.launch()
            self.sync()
        except Exception as exc:  # noqa: BLE001
            raise LaunchError(f"{type(exc).__name__}: {exc}") from exc
        return plan


# =============================================================================== cases
class Case:
    def __init__(self, name, b, s_q, h_q, h_kv, lens, page, causal, splits):
        self.name, self.b, self.s_q, self.h_q, self.h_kv = name, b, s_q, h_q, h_kv
        self.lens, self.page, self.causal, self.splits = list(lens), page, causal, splits


def case_grid(quick: bool) -> list[Case]:
    rng = np.random.default_rng(1234)
    heads = [(1, 1), (16, 1), (16, 2), (64, 1), (128, 1), (128, 2)]
    modes = ["0", "1", "63", "64", "65", "4096", "ragged"]
    pages = [1, 16, 64, 256]
    cases = []
    idx = 0
    for mode in modes:
        for h_q, h_kv in heads:
            page = pages[idx % 4]
            s_q = [1, 2, 4][idx % 3]
            causal = (idx // 3) % 2 == 1
            splits = [1, "auto", 7][(idx // 2) % 3]
            if mode == "4096":
                b = 1 + idx % 2
                lens = [4096] * b
            elif mode == "ragged":
                b = 37 if h_q <= 64 else 5
                lens = list(rng.integers(0, 1500, size=b))
                lens[0] = 0
                if b > 2:
                    lens[1] = -3          # negative: clamped to 0
                    lens[2] = 1 << 20     # over capacity: clamped to max_blocks * page
            else:
                b = [1, 2, 37][idx % 3]
                lens = [int(mode)] * b
            cases.append(Case(f"{mode}", b, s_q, h_q, h_kv, lens, page, causal, splits))
            idx += 1
    cases += [
        Case("sq16", 2, 16, 16, 1, [1000, 517], 16, True, "auto"),
        Case("sq8-hkv8", 2, 8, 128, 8, [700, 1290], 64, True, 3),
        Case("sq20", 2, 20, 8, 2, [300, 19], 32, True, 2),
        Case("group3", 3, 3, 3, 1, [130, 2, 0], 128, True, 7),
        Case("page2", 4, 2, 32, 4, [77, 300, 1, 64], 2, False, "auto"),
        Case("page8-long", 1, 1, 128, 1, [3000], 8, False, 7),
    ]
    if quick:
        cases = cases[::3]
    return cases


def build_inputs(cp, c: Case, dtype: str, rng):
    """Host float64 views for the reference and device buffers (non-contiguous on purpose)."""
    b, s_q, h_q, h_kv, page = c.b, c.s_q, c.h_q, c.h_kv, c.page
    raw = np.array(c.lens, np.int64)
    # capacity from the regular lengths; an over-capacity length (1 << 20) is clamped by the kernel
    # and by the reference to max_blocks * page
    regular = np.clip(raw[raw < (1 << 20)], 0, None)
    max_blocks = max(1, int(-(-int(regular.max(initial=1)) // page)))
    cap = max_blocks * page
    eff = np.clip(raw, 0, cap)
    npg = -(-eff // page)
    nb = int(npg.sum()) + 3
    # q: [b, s_q, h_q, 576] sliced out of [b, s_q + 1, h_q + 2, 640]
    q_big = np.full((b, s_q + 1, h_q + 2, 640), NAN_BITS[dtype], np.uint16)
    qv = np.clip(rng.standard_normal((b, s_q, h_q, 576)), -4, 4)
    q_big[:, 1:, 1:h_q + 1, :576] = to_bits(qv, dtype)
    # k_cache: [nb, page, h_kv, 576] sliced out of [nb, page + 1, h_kv, 640], NaN everywhere unused
    pool = np.full((nb, page + 1, h_kv, 640), NAN_BITS[dtype], np.uint16)
    perm = rng.permutation(nb)
    bt_big = np.full((b, max_blocks + 3), POISON, np.int32)
    used = 0
    pid_all, off_all = [], []
    for i in range(b):
        n = int(eff[i])
        pids = perm[used:used + int(npg[i])]
        used += int(npg[i])
        bt_big[i, :len(pids)] = pids
        tok = np.arange(n)
        pid_all.append(pids[tok // page])
        off_all.append(tok % page)
    if used:
        pid = np.concatenate(pid_all)
        off = np.concatenate(off_all)
        vals = np.clip(rng.standard_normal((pid.size, h_kv, 576)), -4, 4)
        pool[pid, off, :, :576] = to_bits(vals, dtype)
    q_host = from_bits(q_big, dtype)[:, 1:, 1:h_q + 1, :576]
    k_host = from_bits(pool, dtype)[:, :page, :, :576]
    bt_host = bt_big[:, :max_blocks]
    d = {
        "q_big": cp.asarray(q_big), "pool": cp.asarray(pool), "bt_big": cp.asarray(bt_big),
        "lens": cp.asarray(raw.astype(np.int32)),
    }
    meta = dict(max_blocks=max_blocks, nb=nb, eff=eff)
    return q_host, k_host, bt_host, raw, d, meta


def run_case(R, c: Case, dtype: str, variants, rng) -> tuple[int, int]:
    cp = R.cp
    q_host, k_host, bt_host, raw, d, meta = build_inputs(cp, c, dtype, rng)
    t0 = time.perf_counter()
    out_ref, lse_ref = ref.mla_decode_reference(q_host, k_host, bt_host, raw, 512, None, c.causal)
    t_ref = time.perf_counter() - t0
    b, s_q, h_q, h_kv, page = c.b, c.s_q, c.h_q, c.h_kv, c.page
    group = h_q // h_kv
    cap = meta["max_blocks"] * page
    S = c.splits
    if S == "auto":
        S = ks.choose_num_splits(b, s_q, h_q, h_kv, cap, R.info.sm_count)
    grid, block, smem = ks.launch_geometry(b, s_q, h_q, h_kv, S)
    ws = ks.workspace_sizes(b, s_q, h_q, h_kv, S)
    ws_o = cp.empty(max(ws["ws_o"] // 4, 1), cp.float32)
    ws_ml = cp.empty(max(ws["ws_ml"] // 4, 1), cp.float32)
    counters = cp.zeros(max(ws["counters"] // 4, 1), cp.uint32)  # zeroed once, reused by every launch
    out = cp.empty((b, s_q, h_q, 512), cp.uint16)
    lse = cp.empty((b, h_q, s_q), cp.float32)
    E = 2  # element bytes
    qb = d["q_big"]
    q_ptr = qb.data.ptr + qb.strides[1] + qb.strides[2]  # q = q_big[:, 1:, 1:h_q + 1, :576]
    pool = d["pool"]
    values = dict(
        q=q_ptr, k_cache=pool.data.ptr, block_table=d["bt_big"].data.ptr, cache_seqlens=d["lens"].data.ptr,
        out=out.data.ptr, lse=lse.data.ptr, ws_o=ws_o.data.ptr if S > 1 else 0, ws_ml=ws_ml.data.ptr if S > 1 else 0,
        counters=counters.data.ptr,
        q_stride_b=qb.strides[0] // E, q_stride_s=qb.strides[1] // E, q_stride_h=qb.strides[2] // E,
        k_stride_block=pool.strides[0] // E, k_stride_tok=pool.strides[1] // E, k_stride_head=pool.strides[2] // E,
        o_stride_b=out.strides[0] // E, o_stride_s=out.strides[1] // E, o_stride_h=out.strides[2] // E,
        bt_stride=d["bt_big"].strides[0] // 4,
        b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, group=group, m_rows=s_q * group,
        num_m_blocks=ks.num_m_blocks(s_q, h_q, h_kv), page_size=page, page_shift=ks.page_shift(page),
        max_blocks=meta["max_blocks"], num_splits=S, flags=ks.FLAG_CAUSAL if c.causal else 0,
        scale_log2=ks.scale_log2(None),
    )
    packed = ks.pack_args(**values)
    fails = 0
    label = (f"{c.name:10s} b{b:<3d} sq{s_q:<2d} hq{h_q:<3d} hkv{h_kv} page{page:<3d} "
             f"{'causal' if c.causal else 'full  '} S{S:<3d} {dtype[:4]}")
    for variant in variants:
        reps = 2 if S > 1 else 1  # second launch checks that the last CTA reset the counters
        errs = []
        for rep in range(reps):
            out.fill(0xFFFF)  # NaN pattern: an unwritten element fails
            lse.fill(np.nan)
            R.launch(variant, dtype, grid, block, smem, packed)
            o = from_bits(cp.asnumpy(out), dtype).astype(np.float64)
            l = cp.asnumpy(lse).astype(np.float64)
            cnt = cp.asnumpy(counters)
            e_out = np.abs(o - out_ref)
            bad_out = ~(e_out <= 1e-2 + 1e-2 * np.abs(out_ref))  # NaN counts as bad
            inf_ref = np.isinf(lse_ref)
            bad_inf = (np.isinf(l) != inf_ref) | (inf_ref & (l != lse_ref))
            fin = ~inf_ref
            e_lse = np.where(fin, np.abs(l - np.where(fin, lse_ref, 0)), 0.0)
            bad_lse = fin & ~(e_lse <= 1e-3 * np.maximum(1.0, np.abs(np.where(fin, lse_ref, 0))))
            problems = []
            if bad_out.any():
                idx = np.argwhere(bad_out)[0]
                problems.append(f"out {int(bad_out.sum())} bad (first {tuple(idx)}: got {o[tuple(idx)]:.5g} "
                                f"want {out_ref[tuple(idx)]:.5g})")
            if bad_inf.any():
                problems.append(f"lse inf mismatch x{int(bad_inf.sum())}")
            if bad_lse.any():
                idx = np.argwhere(bad_lse)[0]
                problems.append(f"lse {int(bad_lse.sum())} bad (first {tuple(idx)}: got {l[tuple(idx)]:.6g} "
                                f"want {lse_ref[tuple(idx)]:.6g})")
            if cnt.any():
                problems.append(f"counters not reset ({int((cnt != 0).sum())} nonzero)")
            max_o = float(np.nanmax(np.where(np.isnan(e_out), np.inf, e_out))) if e_out.size else 0.0
            max_l = float(e_lse.max()) if e_lse.size else 0.0
            if problems:
                errs.append(f"launch {rep + 1}: " + "; ".join(problems))
        status = "PASS" if not errs else "FAIL"
        fails += bool(errs)
        print(f"{status} {variant:5s} {label} max|dout| {max_o:.2e} max|dlse| {max_l:.2e} (ref {t_ref:.2f}s)"
              + ("" if not errs else "  <- " + " | ".join(errs)), flush=True)
    return len(variants) - fails, fails


# =============================================================================== timing
def timing(R, variants, dtype="bfloat16", shapes=None):
    cp = R.cp
    print("\ntiming (50 back-to-back launches, CUDA events; no L2 flush) — FlashMLA on H200 for reference: "
          "~660 TFLOPS at h_q 128, ~4.5 TB/s at h_q 16")
    pairs = [tuple(int(x) for x in sh.split(",")) for sh in shapes] if shapes else \
        [(h, n) for h in (128, 16) for n in (4096, 8192)]
    for h_q, L in pairs:
        if True:
            b, s_q, h_kv, page = 128, 1, 1, 64
            npg = L // page
            nb = b * npg
            n = nb * page * h_kv * 576
            x = cp.random.standard_normal(n, dtype=cp.float32)
            u = x.view(cp.uint32)
            if dtype == "bfloat16":
                bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
            else:
                bits = x.astype(cp.float16).view(cp.uint16)
            del x, u
            pool = bits.reshape(nb, page, h_kv, 576)
            bt = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32).reshape(b, npg))
            q = cp.asarray(to_bits(np.random.default_rng(1).standard_normal((b, s_q, h_q, 576)), dtype))
            lens = cp.full(b, L, cp.int32)
            out = cp.empty((b, s_q, h_q, 512), cp.uint16)
            lse = cp.empty((b, h_q, s_q), cp.float32)
            S = ks.choose_num_splits(b, s_q, h_q, h_kv, L, R.info.sm_count)
            grid, block, smem = ks.launch_geometry(b, s_q, h_q, h_kv, S)
            ws = ks.workspace_sizes(b, s_q, h_q, h_kv, S)
            ws_o = cp.empty(max(ws["ws_o"] // 4, 1), cp.float32)
            ws_ml = cp.empty(max(ws["ws_ml"] // 4, 1), cp.float32)
            counters = cp.zeros(max(ws["counters"] // 4, 1), cp.uint32)
            group = h_q // h_kv
            packed = ks.pack_args(
                q=q.data.ptr, k_cache=pool.data.ptr, block_table=bt.data.ptr, cache_seqlens=lens.data.ptr,
                out=out.data.ptr, lse=lse.data.ptr, ws_o=ws_o.data.ptr, ws_ml=ws_ml.data.ptr, counters=counters.data.ptr,
                q_stride_b=s_q * h_q * 576, q_stride_s=h_q * 576, q_stride_h=576,
                k_stride_block=page * h_kv * 576, k_stride_tok=h_kv * 576, k_stride_head=576,
                o_stride_b=s_q * h_q * 512, o_stride_s=h_q * 512, o_stride_h=512, bt_stride=npg,
                b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, group=group, m_rows=s_q * group,
                num_m_blocks=ks.num_m_blocks(s_q, h_q, h_kv), page_size=page, page_shift=ks.page_shift(page),
                max_blocks=npg, num_splits=S, flags=0, scale_log2=ks.scale_log2(None))
            flops = 2.0 * h_q * s_q * b * L * (576 + 512)
            nbytes = b * (s_q * h_q * 576 * 2 + L * h_kv * 576 * 2 + s_q * h_q * 512 * 2)
            for variant in variants:
                plan = R.launch(variant, dtype, grid, block, smem, packed)  # warm-up + error check
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(R.stream)
                for _ in range(50):
                    plan.launch()
                e1.record(R.stream)
                R.sync()
                ms = cp.cuda.get_elapsed_time(e0, e1) / 50
                t = ms * 1e-3
                print(f"  {variant:5s} {dtype[:4]} b{b} sq{s_q} hq{h_q} hkv{h_kv} len{L} page{page} S{S} grid{grid}: "
                      f"{ms * 1e3:8.1f} us  {flops / t / 1e12:6.1f} TFLOPS  {nbytes / t / 1e12:5.2f} TB/s", flush=True)
            del pool, bits
            cp.get_default_memory_pool().free_all_blocks()


# =============================================================================== main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["wgmma", "mma"], choices=sorted(ks.VARIANTS))
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument("--layout-only", action="store_true", help="run the CPU layout model only")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--quick", action="store_true", help="every third correctness case")
    ap.add_argument("--hang-seconds", type=float, default=30.0)
    ap.add_argument("--timing-only", action="store_true", help="skip the correctness grid")
    ap.add_argument("--timing-shapes", nargs="*", default=None, help="'h_q,L' pairs (default 128/16 x 4096/8192)")
    args = ap.parse_args()
    args.dtypes = [{"bf16": "bfloat16", "fp16": "float16"}[d] for d in args.dtypes]
    t_start = time.perf_counter()

    errs = layout_model()
    print(f"layout model: {'OK' if not errs else 'FAILED'}" + ("" if not errs else "\n  " + "\n  ".join(errs[:20])),
          flush=True)
    if args.layout_only:
        return 0 if not errs else 1

    try:
        R = Runner(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 2
    passed = failed = 0
    rng = np.random.default_rng(7)
    try:
        for dt in ([] if args.timing_only else args.dtypes):
            for c in case_grid(args.quick):
                try:
                    p, f = run_case(R, c, dt, args.variants, rng)
                except LaunchError as exc:
                    print(f"LAUNCH ERROR in case {c.name} b{c.b} sq{c.s_q} hq{c.h_q} hkv{c.h_kv} page{c.page} "
                          f"S{c.splits} {dt}: {exc}", flush=True)
                    return 2
                except Exception:  # noqa: BLE001 - a host-side problem in one case: report, continue
                    traceback.print_exc()
                    p, f = 0, len(args.variants)
                passed += p
                failed += f
        print(f"\n{passed} passed, {failed} failed ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if not args.no_timing:
            timing(R, args.variants, args.dtypes[0], args.timing_shapes)
    except LaunchError as exc:
        print(f"LAUNCH ERROR: {exc}", flush=True)
        return 2
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if failed == 0 and not errs else 1


if __name__ == "__main__":
    sys.exit(main())
