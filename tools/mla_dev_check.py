"""MLA dense decode: development check on a GPU (H200), plus CPU layout and protocol models.

    python tools/mla_dev_check.py                   # CPU models, compile, correctness grid, timing
    python tools/mla_dev_check.py --layout-only     # CPU only: layout + protocol models
    python tools/mla_dev_check.py --variants seesaw narrow16 --dtypes bf16 --no-timing --quick
    python tools/mla_dev_check.py --timing-only --timing-shapes 128,8192 16,32768 64,8192,2

Variants (gqadrv/mla/kernel_spec.py KERNELS): seesaw, narrow16, narrow32 (new), wgmma, mma (original).

What it does
  1. CPU models (no GPU): the original kernel's cp.async / ldmatrix / descriptor model; for the seesaw
     and narrow kernels the copy placement, every wgmma descriptor (K-major and MN-major 128B swizzle,
     the transposed-A V^T read), the C -> RS-A fragment reuse of P, the P / P^T stores read back
     through their descriptors, the output staging and the shared-memory maps against kernel_spec;
     and tools/mla_protocol_model.py: the mbarrier / named-barrier / cp.async protocol of both new
     kernels under random interleavings (deadlock, stale or overwritten blocks, parity errors).
  2. Compiles every variant x dtype through gqadrv.runtime (NVRTC, sm_90a) and prints the ptxas report
     (registers, spills, stack, any "Performance Loss" note). The correctness grid uses builds with
     MLA_WATCHDOG=1 (an mbarrier wait longer than 4 s traps: a protocol bug becomes a launch error,
     not a hang); timing uses the production builds.
  3. Correctness grid against gqadrv/mla/reference.py (float64), every variant on every case:
     NaN-poisoned unused pages and padding, poisoned block-table entries past each request's pages
     (2147480000), shuffled page order, non-contiguous q / k_cache / block_table, lengths 0 /
     over-capacity / negative, causal, splits 1 / auto (per variant) / fixed (split cases are
     launched twice without resetting the counters, which checks the in-kernel ticket reset), odd
     tile counts (seesaw pairs), long rings (narrow), M = 16 / 24 / 32 / 64 / 128 / 256 rows.
     One line per case and variant, then one summary line per variant.
  4. Timing: b 128, h_kv 1, page 64, not causal: h_q 128 and 16 at L 4K / 8K / 16K / 32K (s_q 1),
     h_q 64 and 128 at L 8K with s_q 2 (CUDA events around 50 back-to-back launches), every eligible
     variant (narrow kernels up to two row blocks), '*' marks kernel_spec.choose_variant's pick; then
     a summary with FlashMLA / FlashInfer numbers from shared/ANCHORS.md.

Exit status: 0 all passed, 1 some case (or a CPU model) failed, 2 launch/driver error (printed; a
watchdog trap shows up here), 3 hang (a launch did not finish within --hang-seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
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
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
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


# ----------------------------------------------------------------------- seesaw / narrow layouts
def _sw(a):
    """128B swizzle on byte addresses (Swizzle<3,4,3>: bits 4..6 ^= bits 7..9)."""
    return a ^ (((a >> 7) & 7) << 4)


def _kmaj(start, sbo, r, k):
    """Element (row r, k) of a K-major 128B-swizzled wgmma operand whose descriptor starts at `start`."""
    return _sw(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k)


def _mnmaj(start, lbo, sbo, n, k):
    """Element (mn n, k) of an MN-major 128B-swizzled operand (64-element MN atoms at LBO, 8-row K
    groups at SBO)."""
    return _sw(start + (n // 64) * lbo + (n % 64) * 2 + (k // 8) * sbo + (k % 8) * 128)


def _swz(row, unit):
    return row * 128 + ((unit ^ (row & 7)) << 4)


def _c_elem(w, lane, i):
    """wgmma fp32 accumulator register i of lane `lane` in warp w of the warpgroup -> (row, col)."""
    g, t = lane >> 2, lane & 3
    j, h, e = i >> 2, (i >> 1) & 1, i & 1
    return 16 * w + g + 8 * h, 8 * j + 2 * t + e


def _a_frag_elem(w, lane, kk, i, half):
    """RS A fragment register i (0..3), 16-bit half `half`, k-step kk -> (row, k) (the m16n8k16 A layout)."""
    g, t = lane >> 2, lane & 3
    return 16 * w + g + 8 * (i & 1), 16 * kk + 2 * t + 8 * (i >> 1) + half


class _Mem:
    def __init__(self, errs):
        self.mem, self.errs = {}, errs

    def put(self, addr, tag, what):
        if addr in self.mem and len(self.errs) < 40:
            self.errs.append(f"{what}: byte {addr} written twice ({self.mem[addr]} and {tag})")
        self.mem[addr] = tag

    def at(self, addr):
        return self.mem.get(addr, ("?", addr))

    def expect(self, addr, want, what):
        got = self.at(addr)
        if got != want and len(self.errs) < 40:
            self.errs.append(f"{what}: got {got}, want {want}")


def layout_model_seesaw() -> list[str]:
    """dense_decode_seesaw.cu: smem map, Q / K placement, QK and P V descriptors, C -> RS A fragment,
    the P stores read back through the SS descriptor."""
    errs: list[str] = []
    CB, TILE = 8192, 9 * 8192
    OFF_Q, OFF_K0, OFF_K1 = 0, TILE, 2 * TILE
    OFF_P0, OFF_P1 = OFF_K0 + 8 * CB, 3 * TILE
    OFF_SM = OFF_P1 + CB
    OFF_SC0, OFF_SC1 = OFF_SM + 256, OFF_SM + 512
    OFF_LSUM = OFF_SC1 + 256
    OFF_BAR = OFF_LSUM + 512
    OFF_TICKET = OFF_BAR + 192
    OFF_SCHED = OFF_TICKET + 16   # balanced schedule: 12 warp sums + the CTA's start (5 ints)
    OFF_MERGE = OFF_SCHED + 80    # won merges: 2 x {request, first slot, splits}
    OFF_XM = OFF_MERGE + 48       # WG1's exact row maxima (max_logits)
    used = OFF_XM + 256
    regions = [("Q", OFF_Q, TILE), ("K0", OFF_K0, TILE), ("K1", OFF_K1, TILE), ("P1", OFF_P1, CB),
               ("sM", OFF_SM, 256), ("sSc0", OFF_SC0, 256), ("sSc1", OFF_SC1, 256), ("lsum", OFF_LSUM, 512),
               ("bars", OFF_BAR, 24 * 8), ("ticket", OFF_TICKET, 16), ("sched", OFF_SCHED, 17 * 4),
               ("merge", OFF_MERGE, 6 * 4), ("xm", OFF_XM, 64 * 4)]
    regions.sort(key=lambda r: r[1])
    for (n0, a0, s0), (n1, a1, _) in zip(regions, regions[1:]):
        if a0 + s0 > a1:
            errs.append(f"seesaw smem: {n0} overlaps {n1}")
    for n, a, _ in regions[:4]:
        if a % 1024:
            errs.append(f"seesaw smem: {n} not 1 KB aligned")
    if used + 1024 != ks.KERNELS["seesaw"].smem_bytes:
        errs.append(f"seesaw smem: map uses {used} + 1024, kernel_spec says {ks.KERNELS['seesaw'].smem_bytes}")
    if not (OFF_K0 + 8 * CB <= OFF_P0 < OFF_P0 + CB <= OFF_K0 + TILE):
        errs.append("seesaw smem: sP0 must be K0's channel block 8")
    if 64 * ks.MAX_SPLITS * 4 > 2 * TILE:
        errs.append("seesaw smem: merge weights do not fit in the K slots")

    M = _Mem(errs)
    # producer warpgroup (warps pw = 0..3): rows 16 pw + 4 q + (lane >> 3), q < 4, unit lane & 7; Q once,
    # then every channel block of both K slots
    for base, tag in ((OFF_Q, "Q"), (OFF_K0, "K0"), (OFF_K1, "K1")):
        for pw in range(4):
            for lane in range(32):
                u = lane & 7
                for q in range(4):
                    r = 16 * pw + 4 * q + (lane >> 3)
                    for c in range(9):
                        for e in range(8):
                            M.put(base + c * CB + _swz(r, u) + 2 * e, (tag, r, 64 * c + 8 * u + e), f"seesaw {tag} copy")
    n_el = len(M.mem)
    if n_el != 3 * 64 * 576:
        errs.append(f"seesaw: copies cover {n_el} elements, expected {3 * 64 * 576}")
    # QK: m64n64k16, A = Q cb c (+32 B per k-step), B = K slot cb c, both K-major, SBO 1 KB
    for slot, base in ((0, OFF_K0), (1, OFF_K1)):
        for c in range(9):
            for k in range(4):
                for r in range(64):
                    for kk in range(16):
                        ch = 64 * c + 16 * k + kk
                        if slot == 0:
                            M.expect(_kmaj(OFF_Q + c * CB + 32 * k, 1024, r, kk), ("Q", r, ch), f"seesaw QK A cb{c}")
                        M.expect(_kmaj(base + c * CB + 32 * k, 1024, r, kk), (f"K{slot}", r, ch), f"seesaw QK B K{slot} cb{c}")
    # P V: B = V read MN-major from the K slot at cb0 = 0 (WG0) / 4 (WG1): LBO 8 KB, SBO 1 KB, +2 KB per k-step
    for slot, base in ((0, OFF_K0), (1, OFF_K1)):
        for cb0 in (0, 4):
            for kk in range(4):
                for n in range(0, 256, 3):
                    for k in range(16):
                        M.expect(_mnmaj(base + cb0 * CB + kk * 2048, CB, 1024, n, k), (f"K{slot}", 16 * kk + k, 64 * cb0 + n),
                                 f"seesaw PV B K{slot} cb0 {cb0}")
    # C layout of S (m64n64) -> pack_pa -> RS A fragment (rows / k of P), and store_pa -> SS descriptor
    P = _Mem(errs)
    for wi in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            r_lo, r_hi = 16 * wi + g, 16 * wi + g + 8
            d = {i: _c_elem(wi, lane, i) for i in range(32)}
            for kk in range(4):
                for i in range(4):
                    regs = (d[8 * kk + 2 * i], d[8 * kk + 2 * i + 1])  # pa[4 kk + i] = pack(d[8kk+2i], d[8kk+2i+1])
                    for half in range(2):
                        want = _a_frag_elem(wi, lane, kk, i, half)
                        if regs[half] != want and len(errs) < 40:
                            errs.append(f"seesaw pack_pa: pa[{4 * kk + i}].{half} holds P{regs[half]}, RS A wants P{want}")
                # store_pa: unit 2kk (+1) of rows r_lo / r_hi, bytes 4t
                for i, (row, unit) in enumerate(((r_lo, 2 * kk), (r_hi, 2 * kk), (r_lo, 2 * kk + 1), (r_hi, 2 * kk + 1))):
                    for half in range(2):
                        P.put(OFF_P1 + _swz(row, unit) + 4 * t + 2 * half, ("P",) + d[8 * kk + 2 * i + half], "seesaw store_pa")
    for kk in range(4):
        for r in range(64):
            for k in range(16):
                P.expect(_kmaj(OFF_P1 + 32 * kk, 1024, r, k), ("P", r, 16 * kk + k), "seesaw PV A (sP)")
    return errs


def layout_model_narrow(nq: int) -> list[str]:
    """dense_decode_narrow.cu (MLA_NQ = nq): smem map, Q / piece placement, S^T and O^T descriptors,
    S^T accumulator -> P^T stores, O^T accumulator -> output staging."""
    errs: list[str] = []
    kv = ks.KERNELS[f"narrow{nq}"]
    nslot = dict(kv.fixed_defines)["MLA_NSLOT"]
    PIECE, QCB = 8192, nq * 128
    OFF_Q, OFF_P = 0, 9 * QCB
    OFF_RING = OFF_P + QCB
    OFF_RED = OFF_RING + nslot * PIECE
    OFF_LRED = OFF_RED + 16 * nq
    OFF_BAR = OFF_LRED + 16 * nq
    OFF_TICKET = OFF_BAR + 8 * (2 * nslot + 2)
    used = OFF_TICKET + 16
    if used + 1024 != kv.smem_bytes:
        errs.append(f"narrow{nq} smem: map uses {used} + 1024, kernel_spec says {kv.smem_bytes}")
    if any(x % 1024 for x in (OFF_P, OFF_RING, QCB)):
        errs.append(f"narrow{nq} smem: swizzled blocks not 1 KB aligned")
    if nslot < 18:
        errs.append(f"narrow{nq}: ring of {nslot} pieces cannot hold two tiles")
    stg_f32 = 2048 + 16
    if nq * stg_f32 > nslot * PIECE or nq * ks.MAX_SPLITS * 4 > nslot * PIECE:
        errs.append(f"narrow{nq}: staging / merge weights do not fit in the ring")

    M = _Mem(errs)
    for w in range(4):  # Q by the consumer warpgroup: rows 16 h + 4 w + (lane >> 3)
        for lane in range(32):
            u = lane & 7
            for h in range(nq // 16):
                r = 16 * h + 4 * w + (lane >> 3)
                for c in range(9):
                    for e in range(8):
                        M.put(OFF_Q + c * QCB + _swz(r, u) + 2 * e, ("Q", r, 64 * c + 8 * u + e), f"narrow{nq} Q copy")
    piece = OFF_RING + 3 * PIECE  # any slot: the layout inside a piece does not depend on it
    for pw in range(4):  # producer warps 4 + pw: rows 16 pw + 4 q + (lane >> 3), unit lane & 7 (one piece = cb c)
        for lane in range(32):
            u = lane & 7
            for q in range(4):
                r = 16 * pw + 4 * q + (lane >> 3)
                for e in range(8):
                    M.put(piece + _swz(r, u) + 2 * e, ("K", r, 8 * u + e), f"narrow{nq} piece copy")
    if len(M.mem) != nq * 576 + 64 * 64:
        errs.append(f"narrow{nq}: copies cover {len(M.mem)} elements, expected {nq * 576 + 64 * 64}")
    for k in range(4):  # S^T: A = piece (K-major), B = Q cb (K-major); channel c * 64 + 16 k + kk (c = 0 here)
        for m_ in range(64):
            for kk in range(16):
                M.expect(_kmaj(piece + 32 * k, 1024, m_, kk), ("K", m_, 16 * k + kk), f"narrow{nq} QK A")
        for n in range(nq):
            for kk in range(16):
                for c in (0, 5, 8):
                    M.expect(_kmaj(OFF_Q + c * QCB + 32 * k, 1024, n, kk), ("Q", n, 64 * c + 16 * k + kk), f"narrow{nq} QK B cb{c}")
    for kk in range(4):  # O^T: A = V^T read MN-major from the piece (+2 KB per 16 tokens)
        for mm in range(64):
            for k in range(16):
                M.expect(_mnmaj(piece + 2048 * kk, PIECE, 1024, mm, k), ("K", 16 * kk + k, mm), f"narrow{nq} PV A")
    # S^T accumulators -> P^T stores (element (row n, token 16 w + g + 8 h)), read back as B
    P = _Mem(errs)
    for w in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for j in range(nq // 8):
                for e in range(2):
                    for h in range(2):
                        tok, n = _c_elem(w, lane, 4 * j + 2 * h + e)  # st[4j + 2h + e]
                        if (tok, n) != (16 * w + g + 8 * h, 8 * j + 2 * t + e):
                            errs.append(f"narrow{nq}: st[{4 * j + 2 * h + e}] is S^T{(tok, n)}")
                        tl = 16 * w + g
                        addr = OFF_P + _swz(n, (tl >> 3) + h) + 2 * (tl & 7)
                        for byte in range(2):
                            P.put(addr + byte, ("P", n, tok, byte), f"narrow{nq} P store")
    for kk in range(4):
        for n in range(nq):
            for k in range(16):
                P.expect(_kmaj(OFF_P + 32 * kk, 1024, n, k), ("P", n, 16 * kk + k, 0), f"narrow{nq} PV B (P)")
    # O^T accumulators -> staging [row][channel] (16-bit, row stride 1040 B)
    S = _Mem(errs)
    for w in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for mblk in range(8):
                for j in range(nq // 8):
                    for e in range(2):
                        for h in range(2):
                            chl, n = _c_elem(w, lane, 4 * j + 2 * h + e)
                            ch = 64 * mblk + chl
                            if ch != 64 * mblk + 16 * w + g + 8 * h:
                                errs.append(f"narrow{nq}: ot[{mblk}][{4 * j + 2 * h + e}] channel {ch}")
                            S.put(n * 1040 + 2 * ch, ("O", n, ch), f"narrow{nq} staging")
    if len(S.mem) != nq * 512:
        errs.append(f"narrow{nq}: staging covers {len(S.mem)} elements, expected {nq * 512}")
    return errs


# =============================================================================== CPU protocol model
# The seesaw and narrow kernels' synchronisation, transcribed: each warpgroup / producer is a Python
# generator that yields the kernel's synchronisation actions in program order; a scheduler runs them
# under random interleavings, with cp.async copies landing in random order, and checks: no deadlock;
# mbarrier parity semantics as in PTX (a wait for parity x succeeds iff the current phase bit differs
# from x); noinc arrivals that fire only once all earlier copies of the issuing agent have landed;
# named barriers with arrive / sync halves; every block a wgmma group reads holds the expected data
# when issued and is neither refilled nor overwritten until the issuing warpgroup's wait_group
# retires the group; every scalar exchange (sM, sScale0, sScale1) read with the intended step's value.
# Keep the transcriptions in step with kernels/mla/sm90/dense_decode_{seesaw,narrow}.cu.

class ModelError(Exception):
    pass


# ----------------------------------------------------------------------------- machine
class Machine:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.mbar = {}          # name -> [count, pending, phase]
        self.nbar = {}          # id -> [arrived, waiting agents list, generation]
        self.mem = {}           # block -> tag
        self.pending_loads = []  # [agent, block, tag, seq]
        self.load_seq = 0
        self.arrive_after = []  # [agent, bar, seq]: fires when agent's loads with seq' < seq done
        self.inflight = {}      # agent -> list of groups; group = list of (block, tag)
        self.readers = {}       # block -> count of in-flight groups reading it
        self.loading = {}       # block -> count of loads in flight to it
        self.log = []

    # mbarriers
    def init_mbar(self, name, count):
        self.mbar[name] = [count, count, 0]

    def arrive(self, name, n=1):
        b = self.mbar[name]
        b[1] -= n
        if b[1] < 0:
            raise ModelError(f"mbarrier {name}: more arrivals than its count in one phase")
        if b[1] == 0:
            b[1] = b[0]
            b[2] += 1

    def can_wait(self, name, parity):
        return (self.mbar[name][2] & 1) != parity

    # memory
    def check_not_busy(self, block, what):
        if self.readers.get(block, 0):
            raise ModelError(f"{what}: block {block} is read by an in-flight wgmma group")
        if self.loading.get(block, 0):
            raise ModelError(f"{what}: block {block} has a cp.async in flight")

    def write(self, block, tag, what):
        self.check_not_busy(block, what)
        self.mem[block] = tag

    def read(self, block, tag, what):
        if self.loading.get(block, 0):
            raise ModelError(f"{what}: block {block} read while a cp.async to it is in flight")
        got = self.mem.get(block)
        if got != tag:
            raise ModelError(f"{what}: block {block} holds {got}, expected {tag}")

    def issue_load(self, agent, block, tag):
        self.check_not_busy(block, f"{agent} load {tag}")
        self.load_seq += 1
        self.loading[block] = self.loading.get(block, 0) + 1
        self.pending_loads.append([agent, block, tag, self.load_seq])
        self.mem[block] = ("partial", tag)

    def noinc_arrive(self, agent, bar):
        self.arrive_after.append([agent, bar, self.load_seq + 1])
        self.fire_arrivals()

    def fire_arrivals(self):
        changed = True
        while changed:
            changed = False
            for rec in list(self.arrive_after):
                agent, bar, seq = rec
                if not any(pl[0] == agent and pl[3] < seq for pl in self.pending_loads):
                    self.arrive_after.remove(rec)
                    self.arrive(bar)
                    changed = True

    def complete_random_load(self):
        pl = self.rng.choice(self.pending_loads)
        self.pending_loads.remove(pl)
        _, block, tag, _ = pl
        self.loading[block] -= 1
        self.mem[block] = tag
        self.fire_arrivals()

    # wgmma groups
    def gemm(self, agent, reads, what):
        for block, tag in reads:
            self.read(block, tag, what)
        grp = self.inflight.setdefault(agent, [])
        grp.append(list(reads))
        for block, _ in reads:
            self.readers[block] = self.readers.get(block, 0) + 1

    def wait_group(self, agent, n):
        grp = self.inflight.setdefault(agent, [])
        while len(grp) > n:
            done = grp.pop(0)
            for block, _ in done:
                self.readers[block] -= 1


def run(agents: dict, machine: Machine, named_counts: dict, max_steps=2_000_000):
    """agents: name -> generator. Actions yielded:
    ('wait', bar, parity) | ('arrive', bar) | ('load', block, tag) | ('noinc', bar)
    ('gemm', reads, what) | ('wait_group', n) | ('write', block, tag, what) | ('read', block, tag, what)
    ('nb_arrive', id) | ('nb_sync', id)"""
    m = machine
    state = {name: {"gen": gen, "blocked": None, "done": False} for name, gen in agents.items()}
    nb = {i: {"arrived": 0, "sync_waiters": [], "gen": 0} for i in named_counts}

    def step(name):
        st = state[name]
        while True:
            if st["blocked"] is not None:
                kind, *args = st["blocked"]
                if kind == "wait":
                    if not m.can_wait(*args):
                        return False
                elif kind == "nb":
                    bid, gen = args
                    if nb[bid]["gen"] == gen:
                        return False
                st["blocked"] = None
            try:
                act = next(st["gen"])
            except StopIteration:
                st["done"] = True
                return True
            kind = act[0]
            if kind == "wait":
                if not m.can_wait(act[1], act[2]):
                    st["blocked"] = ("wait", act[1], act[2])
                    return True
            elif kind == "arrive":
                m.arrive(act[1])
            elif kind == "load":
                m.issue_load(name, act[1], act[2])
            elif kind == "noinc":
                m.noinc_arrive(name, act[1])
            elif kind == "gemm":
                m.gemm(name, act[1], act[2])
            elif kind == "wait_group":
                m.wait_group(name, act[1])
            elif kind == "write":
                m.write(act[1], act[2], act[3])
            elif kind == "read":
                m.read(act[1], act[2], act[3])
            elif kind in ("nb_arrive", "nb_sync"):
                b = nb[act[1]]
                b["arrived"] += 1
                gen = b["gen"]
                if b["arrived"] == named_counts[act[1]]:
                    b["arrived"] = 0
                    b["gen"] += 1
                elif kind == "nb_sync":
                    st["blocked"] = ("nb", act[1], gen)
                    return True
            else:
                raise ModelError(f"unknown action {act}")
            # yield the processor now and then to vary interleavings
            if m.rng.random() < 0.5:
                return True

    steps = 0
    while True:
        steps += 1
        if steps > max_steps:
            raise ModelError("step limit")
        live = [n for n, s in state.items() if not s["done"]]
        if not live and not m.pending_loads:
            return
        choices = []
        for n in live:
            st = state[n]
            b = st["blocked"]
            if b is None or (b[0] == "wait" and m.can_wait(b[1], b[2])) or (b[0] == "nb" and nb[b[1]]["gen"] != b[2]):
                choices.append(n)
        if m.pending_loads:
            choices.append(None)
        if not choices:
            raise ModelError("deadlock: " + ", ".join(f"{n} blocked on {state[n]['blocked']}" for n in live))
        c = m.rng.choice(choices)
        if c is None:
            m.complete_random_load()
        else:
            step(c)


# ----------------------------------------------------------------------------- seesaw
def seesaw_model(npairs: int, seed: int, tma: bool = False, tail: tuple = (False, False)) -> None:
    """The split grid's single work item of npairs >= 1 pairs (seesaw / seesaw_tma): see seesaw_items_model."""
    seesaw_items_model([npairs], seed, tma=tma, tails=[tail], balanced=False)


def balanced_model(items: list, seed: int, tails: list | None = None, tma: bool = True) -> None:
    """seesaw_bal (TMA, MLA_BALANCED=1) or seesaw_bal_cp (``tma`` False: the cp.async producer walking the
    items) over one CTA's work items. See seesaw_items_model."""
    seesaw_items_model(list(items), seed, tma=tma, tails=tails, balanced=True)


def seesaw_items_model(items: list, seed: int, tma: bool, tails: list | None, balanced: bool) -> None:
    """Transcription of dense_decode_seesaw.cu for one CTA: ``items`` = pairs per work item (0: an
    empty request the CTA answers; the split grid has one item with >= 1 pair). Agents: the consumer
    warpgroups WG0 / WG1 and the producer: with ``tma`` (MLA_TMA_K=1) the TMA thread (one full barrier
    per half tile, completed when the half's loads landed) and the Q loaders (producer warps 1..3,
    q / q_empty hand-off per item); else one cp.async producer warpgroup loading Q, then K (one full
    barrier per channel block). Blocks: ('K', slot, cb) for the two slots' 9 channel blocks
    (('K', 0, 8) doubles as sP0), ('P1',), ('Q',), scalars ('sM',), ('sSc0',), ('sSc1',).
    ``tails[k]``: (even, odd) tile of item k's last pair partly valid, so the TMA build's consumers
    zero its rows past the end in the V blocks they read (no wgmma group or load may be in flight on
    them). ``balanced`` (MLA_BALANCED=1): K barrier phases run on over the CTA's pairs, every pair's
    halves are released (also an item's last), sM is reset behind the epilogue barrier; the split
    grid releases only halves that a later pair refills. Both end with the merge weights written into
    the K slots, which must find no load or wgmma in flight. The balanced cp.async producer loads each
    item's Q (after q_empty of the previous one) before the item's pairs."""
    assert balanced or len(items) == 1, "the split grid has one work item"
    halves = tma  # one full barrier per half tile
    tails = tails or [(False, False)] * len(items)
    m = Machine(random.Random(seed))
    for s_ in range(2):
        for c in range(9):
            m.init_mbar(("full", s_, c), 1)   # 128 producer threads (or the TMA thread) as one arrival
        for h in range(2):
            m.init_mbar(("empty", s_, h), 1)  # 4 consumer warps modelled as one
    m.init_mbar("q", 1)
    m.init_mbar("qe", 2)  # q_empty: one arrival per warpgroup here (8 warps in the kernel)
    FULL = (lambda s_, c: ("full", s_, 0 if c < 4 else 4)) if halves else (lambda s_, c: ("full", s_, c))  # noqa: E731
    EMPTY = lambda s_, h: ("empty", s_, h)  # noqa: E731
    KB = lambda s_, c: ("K", s_, c)  # noqa: E731
    m.mem[("sM",)] = ("init", 0)
    with_pairs = [k for k, n in enumerate(items) if n > 0]
    base = [sum(items[:k]) for k in range(len(items))]  # the CTA's pair index of each item's first pair

    def q_loader():
        for nq, k in enumerate(with_pairs):
            if nq > 0:
                yield ("wait", "qe", (nq - 1) & 1)
            yield ("load", ("Q",), ("q", k))
            yield ("noinc", "q")

    def k_producer():
        def fill(slot, c0, c1, tile):
            for c in range(c0, c1):
                yield ("load", KB(slot, c), ("tile", tile, c))
                if not halves:
                    yield ("noinc", FULL(slot, c))
            if halves:  # one TMA per half: the barrier completes when the half landed
                yield ("noinc", FULL(slot, c0))

        if not tma and not balanced:  # the split grid's cp.async producer warpgroup loads Q itself first
            yield from q_loader()
        for nq, k in enumerate(with_pairs):
            if not tma and balanced:  # the balanced cp.async producer: each item's Q before its pairs
                if nq > 0:
                    yield ("wait", "qe", (nq - 1) & 1)
                yield ("load", ("Q",), ("q", k))
                yield ("noinc", "q")
            for it in range(items[k]):
                g = base[k] + it
                T0, pe = 2 * g, (g & 1) ^ 1
                yield ("wait", EMPTY(0, 0), pe)
                yield from fill(0, 0, 4, T0)
                yield ("wait", EMPTY(1, 1), pe)
                yield from fill(1, 4, 9, T0 + 1)
                yield ("wait", EMPTY(0, 1), pe)
                yield from fill(0, 4, 9, T0)
                yield ("wait", EMPTY(1, 0), pe)
                yield from fill(1, 0, 4, T0 + 1)

    order1 = [4, 5, 6, 7, 8, 0, 1, 2, 3]

    def first_qk(wg, k, what):
        """Item k's first Q K^T on slot wg (no wait for it)."""
        q, b0 = [(("Q",), ("q", k))], base[k]
        for c in (range(9) if wg == 0 else order1):
            yield ("wait", FULL(wg, c), b0 & 1)
            yield ("gemm", q + [(KB(wg, c), ("tile", 2 * b0 + wg, c))], f"wg{wg} item{k} {what} QK cb{c}")

    def epilogue(wg, k, last_tag):
        yield ("nb_sync", 5)  # sum_rows_2wg
        yield ("read", ("sM",), last_tag, f"wg{wg} item{k} epilogue sM")
        if balanced:
            yield ("nb_sync", 5)  # every thread has read sM: reset
            if wg == 0:
                yield ("write", ("sM",), ("init", k + 1), f"wg0 item{k} sM reset")

    def merge_weights(wg):
        yield ("nb_sync", 5)
        for c in range(9):
            yield ("write", KB(wg, c), ("merge",), f"wg{wg} merge weights K{wg} cb{c}")

    def wg0():
        nq = 0
        for k, n in enumerate(items):
            tail = tails[k]
            if n == 0:
                yield from epilogue(0, k, ("init", k))
                continue
            q = [(("Q",), ("q", k))]
            b0 = base[k]
            yield ("wait", "q", nq & 1)
            yield from first_qk(0, k, "prologue")
            yield ("wait_group", 0)
            if n == 1:
                yield ("arrive", "qe")
            for it in range(n):
                g = b0 + it
                T0, ph, nxt = 2 * g, g & 1, it + 1 < n
                yield ("read", ("sM",), ("init", k) if it == 0 else ("m1", g - 1), f"wg0 {g} sM")
                yield ("write", ("sM",), ("m0", g), "wg0 sM")
                yield ("write", ("sSc0",), ("a0", g), "wg0 sSc0")
                yield ("nb_arrive", 1)
                if tma and not nxt and tail[0]:
                    for c in range(4):
                        yield ("write", KB(0, c), ("tile", T0, c), f"wg0 {g} zero tail K0 cb{c}")
                yield ("gemm", [(KB(0, c), ("tile", T0, c)) for c in range(4)], f"wg0 {g} RS P0 V0L")
                yield ("nb_sync", 2)
                yield ("read", ("sSc1",), ("a1", g), f"wg0 {g} sSc1")
                if g % 3 == 0:  # a rescale by a1: P0 V0L retires before P0 is repacked (else stored as is)
                    yield ("wait_group", 0)
                yield ("write", KB(0, 8), ("P0", g), f"wg0 {g} sP0 store")
                yield ("nb_arrive", 3)
                yield ("wait_group", 0)
                if balanced or nxt:
                    yield ("arrive", EMPTY(0, 0))
                yield ("nb_sync", 4)
                for c in range(4):
                    yield ("wait", FULL(1, c), ph)
                if tma and not nxt and tail[1]:
                    for c in range(4):
                        yield ("write", KB(1, c), ("tile", T0 + 1, c), f"wg0 {g} zero tail K1 cb{c}")
                yield ("gemm", [(("P1",), ("P1", g))] + [(KB(1, c), ("tile", T0 + 1, c)) for c in range(4)],
                       f"wg0 {g} SS sP1 V1L")
                if nxt:
                    for c in range(4):
                        yield ("wait", FULL(0, c), ph ^ 1)
                        yield ("gemm", q + [(KB(0, c), ("tile", T0 + 2, c))], f"wg0 {g} next QK cb{c}")
                    yield ("wait_group", 4)
                    yield ("arrive", EMPTY(1, 0))
                    for c in range(4, 9):
                        yield ("wait", FULL(0, c), ph ^ 1)
                        yield ("gemm", q + [(KB(0, c), ("tile", T0 + 2, c))], f"wg0 {g} next QK cb{c}")
                yield ("wait_group", 0)
                if balanced and not nxt:
                    yield ("arrive", EMPTY(1, 0))
                if it + 2 == n:
                    yield ("arrive", "qe")
            nq += 1
            yield from epilogue(0, k, ("m1", b0 + n - 1))
        yield from merge_weights(0)

    def wg1():
        nq = 0
        order = order1
        for k, n in enumerate(items):
            tail = tails[k]
            if n == 0:
                yield from epilogue(1, k, ("init", k))
                continue
            q = [(("Q",), ("q", k))]
            b0 = base[k]
            yield ("wait", "q", nq & 1)
            yield from first_qk(1, k, "prologue")
            yield ("wait_group", 0)
            if n == 1:
                yield ("arrive", "qe")
            for it in range(n):
                g = b0 + it
                T1, ph, nxt = 2 * g + 1, g & 1, it + 1 < n
                yield ("nb_sync", 1)
                yield ("read", ("sM",), ("m0", g), f"wg1 {g} sM")
                yield ("read", ("sSc0",), ("a0", g), f"wg1 {g} sSc0")
                yield ("write", ("sM",), ("m1", g), "wg1 sM")
                yield ("write", ("sSc1",), ("a1", g), "wg1 sSc1")
                yield ("nb_arrive", 2)
                yield ("write", ("P1",), ("P1", g), f"wg1 {g} sP1 store")
                if tma and not nxt and tail[1]:
                    for c in range(4, 8):
                        yield ("write", KB(1, c), ("tile", T1, c), f"wg1 {g} zero tail K1 cb{c}")
                yield ("gemm", [(KB(1, c), ("tile", T1, c)) for c in range(4, 8)], f"wg1 {g} RS P1 V1R")
                yield ("nb_sync", 3)
                for c in range(4, 8):
                    yield ("wait", FULL(0, c), ph)
                if tma and not nxt and tail[0]:
                    for c in range(4, 8):
                        yield ("write", KB(0, c), ("tile", T1 - 1, c), f"wg1 {g} zero tail K0 cb{c}")
                yield ("gemm", [(KB(0, 8), ("P0", g))] + [(KB(0, c), ("tile", T1 - 1, c)) for c in range(4, 8)],
                       f"wg1 {g} SS sP0 V0R")
                yield ("nb_arrive", 4)
                if nxt:
                    yield ("wait_group", 1)
                    yield ("arrive", EMPTY(1, 1))
                    yield ("wait_group", 0)
                    yield ("arrive", EMPTY(0, 1))
                    for c in order:
                        yield ("wait", FULL(1, c), ph ^ 1)
                        yield ("gemm", q + [(KB(1, c), ("tile", T1 + 2, c))], f"wg1 {g} next QK cb{c}")
                yield ("wait_group", 0)
                if balanced and not nxt:
                    yield ("arrive", EMPTY(1, 1))
                    yield ("arrive", EMPTY(0, 1))
                if it + 2 == n:
                    yield ("arrive", "qe")
            nq += 1
            yield from epilogue(1, k, ("m1", b0 + n - 1))
        yield from merge_weights(1)

    agents = {"producer": k_producer(), "wg0": wg0(), "wg1": wg1()}
    if tma:
        agents["q"] = q_loader()
    run(agents, m, {1: 2, 2: 2, 3: 2, 4: 2, 5: 2})
    for bkey in m.readers:
        if m.readers[bkey]:
            raise ModelError(f"block {bkey} still has in-flight readers at exit")


# ----------------------------------------------------------------------------- narrow
def narrow_model(ntiles: int, nslot: int, seed: int) -> None:
    """Transcription of dense_decode_narrow.cu's ring (producer warpgroup + consumer warpgroup; the 4
    producer warps run the same slot / parity sequence, so they are modelled as one agent)."""
    m = Machine(random.Random(seed))
    for s in range(nslot):
        m.init_mbar(("full", s), 1)   # 128 producer threads modelled as one arrival
        m.init_mbar(("empty", s), 1)  # 4 consumer warps modelled as one
    m.init_mbar("q", 1)

    def producer():
        slot, ph = 0, 0
        for tile in range(ntiles):
            for c in range(9):
                yield ("wait", ("empty", slot), ph ^ 1)
                yield ("load", ("ring", slot), ("piece", tile, c))
                yield ("noinc", ("full", slot))
                slot += 1
                if slot == nslot:
                    slot, ph = 0, ph ^ 1

    def consumer():
        yield ("load", ("Q",), ("q",))
        yield ("noinc", "q")
        yield ("wait", "q", 0)
        qs = {"slot": 0, "ph": 0}

        def issue_qk(tile):
            for c in range(9):
                yield ("wait", ("full", qs["slot"]), qs["ph"])
                yield ("gemm", [(("Q",), ("q",)), (("ring", qs["slot"]), ("piece", tile, c))], f"QK t{tile} c{c}")
                qs["slot"] += 1
                if qs["slot"] == nslot:
                    qs["slot"], qs["ph"] = 0, qs["ph"] ^ 1

        def wrap(x):
            return x if x < nslot else x - nslot

        yield from issue_qk(0)
        base = prev_base = 0
        for tile in range(ntiles):
            yield ("wait_group", 0)
            if tile > 0:
                for c in range(8):
                    yield ("arrive", ("empty", wrap(prev_base + c)))
            yield ("arrive", ("empty", wrap(base + 8)))
            yield ("write", ("P",), ("P", tile), f"P store t{tile}")
            yield ("gemm", [(("P",), ("P", tile))] + [(("ring", wrap(base + c)), ("piece", tile, c)) for c in range(8)],
                   f"PV t{tile}")
            prev_base, base = base, wrap(base + 9)
            if tile + 1 < ntiles:
                yield from issue_qk(tile + 1)
        yield ("wait_group", 0)

    run({"producer": producer(), "consumer": consumer()}, m, {})


def narrow2_model(items: list, nslot: int, seed: int, bug: str | None = None) -> None:
    """Transcription of dense_decode_narrow2.cu (narrow16x2_tma / narrow16_bal) over one CTA's work
    items: ``items`` = [(tiles, shared), ...] (tiles 0: an empty request or split; shared: the item's
    request is split, so it ends with the partial and the ticket instead of the staged output). One
    TMA producer (one arrival + bytes per piece), one Q copier (warps 9..11 as one agent: q_full after
    its cp.async, q_empty wait before refilling), two consumer warpgroups (an agent each; their
    per-warp empty arrivals as one, their 128 q_empty arrivals as one) on alternate tiles of the CTA
    (tile gtile of all items to warpgroup gtile % 2), the shared named barrier 1 (count 2 here).
    The Q region is two blocks (Q, 0) / (Q, 1): Q lands in both, the O^T hand-off uses (Q, 0), the
    output staging both. ``bug`` injects an error the model must catch: 'no_first_barrier' (the
    hand-off without the barrier that waits for both warpgroups' last wgmma, the first build's race),
    'parity' (a consumer waits on the wrong full parity), 'early_q_empty' (warpgroup 0 releases Q
    before its staging reads). (Tiles alternating per item instead of per CTA would also be safe:
    a warpgroup reaches the next item's tiles only after q_full, i.e. after both warpgroups released
    the previous item's Q, so its previous tile has landed.)"""
    m = Machine(random.Random(seed))
    for sl in range(nslot):
        m.init_mbar(("full", sl), 1)
        m.init_mbar(("empty", sl), 1)
    m.init_mbar("q_full", 1)
    m.init_mbar("q_empty", 2)
    Q = [("Q", 0), ("Q", 1)]

    def producer():
        slot, ph, gtile = 0, 0, 0
        for it, (nt, _) in enumerate(items):
            for k in range(nt):
                for c in range(9):
                    yield ("wait", ("empty", slot), ph ^ 1)
                    yield ("load", ("ring", slot), ("piece", gtile + k, c))
                    yield ("noinc", ("full", slot))
                    slot += 1
                    if slot == nslot:
                        slot, ph = 0, ph ^ 1
            gtile += nt

    def q_copier():
        nq = 0
        for it, (nt, _) in enumerate(items):
            if nt == 0:
                continue
            if nq > 0:
                yield ("wait", "q_empty", (nq - 1) & 1)
            for blk in Q:
                yield ("load", blk, ("q", it))
            yield ("noinc", "q_full")
            nq += 1

    def consumer(u):
        nq, gtile = 0, 0
        for it, (nt, shared) in enumerate(items):
            if nt > 0:
                yield ("wait", "q_full", nq & 1)
                for k in range((gtile ^ u) & 1, nt, 2):
                    gt = gtile + k
                    p0 = 9 * gt
                    for c in range(9):
                        sl, par = (p0 + c) % nslot, ((p0 + c) // nslot) & 1
                        yield ("wait", ("full", sl), par ^ 1 if bug == "parity" else par)
                        yield ("gemm", [(blk, ("q", it)) for blk in Q] + [(("ring", sl), ("piece", gt, c))],
                               f"S^T t{gt} wg{u}")
                    yield ("wait_group", 0)
                    yield ("arrive", ("empty", (p0 + 8) % nslot))
                    yield ("write", ("P", u), ("P", gt), f"P t{gt}")
                    if k == nt - 1:  # the item's last tile: rows >= tok_end zeroed in pieces 0..7
                        for c in range(8):
                            yield ("write", ("ring", (p0 + c) % nslot), ("piece", gt, c), f"tail zero t{gt}")
                    yield ("gemm", [(("P", u), ("P", gt))] + [(("ring", (p0 + c) % nslot), ("piece", gt, c))
                                                              for c in range(8)], f"O^T t{gt} wg{u}")
                    yield ("wait_group", 0)
                    for c in range(8):
                        yield ("arrive", ("empty", (p0 + c) % nslot))
                gtile += nt
                # the hand-off: warpgroup 1 -> 0 (channel blocks 0..3), then 0 -> 1 (4..7), same words
                if bug != "no_first_barrier":
                    yield ("nb_sync", 1)
                if u == 1:
                    yield ("write", Q[0], ("x0", it), f"hand-off 1->0 item {it}")
                yield ("nb_sync", 1)
                if u == 0:
                    yield ("read", Q[0], ("x0", it), f"hand-off read item {it}")
                    yield ("write", Q[0], ("x1", it), f"hand-off 0->1 item {it}")
                yield ("nb_sync", 1)
                if u == 1:
                    yield ("read", Q[0], ("x1", it), f"hand-off read item {it}")
            if not shared:
                if nt > 0:
                    yield ("nb_sync", 1)  # every hand-off read is done
                    if bug == "early_q_empty" and u == 0:
                        yield ("arrive", "q_empty")
                    for blk in Q:
                        yield ("write", blk, ("stg", it), f"staging item {it}")
                    yield ("nb_sync", 1)
                    for blk in Q:
                        yield ("read", blk, ("stg", it), f"staging read item {it}")
            else:
                yield ("nb_sync", 1)  # last_to_arrive: the partial stores, then the ticket
                yield ("nb_sync", 1)
            if nt > 0:
                if not (bug == "early_q_empty" and u == 0 and not shared):
                    yield ("arrive", "q_empty")
                nq += 1
        yield ("nb_sync", 1)  # the merges won, after the last item (the ring is idle)

    run({"producer": producer(), "q_copier": q_copier(), "wg0": consumer(0), "wg1": consumer(1)}, m, {1: 2})


def narrow_fp8_model(ntiles: int, nstage: int, seed: int, tail: bool = False, bug: str | None = None) -> None:
    """Transcription of dense_decode_narrow_fp8.cu's ring: 4 producer warps (warp pw bulk-copies rows
    16 pw .. 16 pw + 15 of every tile into stage k % nstage, one arrival with its bytes on full[s],
    count 4) and two consumer warpgroups of 4 warps (warpgroup u takes tiles u, u + 2, ...; every warp
    reads all four row blocks of the stage for S^T and again for O^T, arrives on empty[s] after its
    O^T reads; warpgroup-wide named barriers between the phases). The kernel arrives per thread
    (count 128: each thread after its own last read); an agent here is a warp whose one arrival
    (count 4) stands for its 32 threads' arrivals, each after that thread's reads. ``tail``: the last tile
    is partial, so between the two barriers the warpgroup zeroes its stale rows (generic writes).
    ``bug`` injects a protocol error the model must catch: 'early_release' (empty arrival before the
    O^T reads), 'no_release' (no empty arrival), 'parity' (consumer waits on the wrong full parity)."""
    m = Machine(random.Random(seed))
    for s in range(nstage):
        m.init_mbar(("full", s), 4)
        m.init_mbar(("empty", s), 4)

    def producer(pw):
        for k in range(ntiles):
            s = k % nstage
            yield ("wait", ("empty", s), ((k // nstage) & 1) ^ 1)
            yield ("load", ("stage", s, pw), ("rows", k, pw))
            yield ("noinc", ("full", s))

    def consumer(u, w):
        bar = 2 + u
        for k in range(u, ntiles, 2):
            s = k % nstage
            par = (k // nstage) & 1
            yield ("wait", ("full", s), par ^ 1 if bug == "parity" else par)
            for pw in range(4):  # S^T: the warp's token rows lie in every row block
                yield ("read", ("stage", s, pw), ("rows", k, pw), f"S^T t{k} wg{u} w{w}")
            yield ("nb_sync", bar)  # maxima written
            if tail and k == ntiles - 1:
                yield ("write", ("stage", s, w), ("zero", k), f"tail zero t{k} wg{u} w{w}")
            yield ("write", ("P", u, w), ("P", k), f"P t{k}")
            yield ("nb_sync", bar)  # P written
            if bug == "early_release":
                yield ("arrive", ("empty", s))
            for pw in range(4):  # O^T: the warp's 16 tokens of every k16 step
                want = ("zero", k) if tail and k == ntiles - 1 else ("rows", k, pw)
                yield ("read", ("stage", s, pw), want, f"O^T t{k} wg{u} w{w}")
            if bug not in ("early_release", "no_release"):
                yield ("arrive", ("empty", s))

    agents = {f"producer{pw}": producer(pw) for pw in range(4)}
    agents.update({f"wg{u}w{w}": consumer(u, w) for u in range(2) for w in range(4)})
    run(agents, m, {2: 4, 3: 4})


def wide_fp8_model(ntiles: int, nstage: int, seed: int, tail: bool = False, bug: str | None = None) -> None:
    """Transcription of dense_decode_wide_fp8.cu's protocol: 4 producer warps (warp pw bulk-copies rows
    16 pw .. 16 pw + 15 of every tile into half stage i = 2k + pw // 2, slot i % nstage: one arrival
    with its bytes on full[slot], count 2) and two consumer warpgroups of 4 warps, both on every tile.
    Warp w of warpgroup u reads row block w % 2 of half stage 2k + w // 2 (its own 16-byte units:
    block (slot, w % 2, u)), converts the codes and stores them into its rows of the warpgroup's V
    tile (block ("V", u, w)), then arrives on empty (count 4 here: the 2 warps of each warpgroup that
    read the half; 128 threads in the kernel). Exchange and P' / alpha through named barrier 1 (8
    warps), the softmax vote through the warpgroup's barrier 2 + u, then P' V (a wgmma group reading
    all four V blocks of the warpgroup and all eight P' blocks), wait_group 0 and the warpgroup
    barrier that ends the tile. ``tail``: in the last tile each warp zeroes its own units before
    reading them. ``bug``: 'early_release' (empty arrival before the code reads), 'parity' (wrong full
    parity), 'no_end_barrier' (the tile's closing warpgroup barrier left out: a warp may store the next
    tile's V while another warp's P' V group still reads it), 'own_wait_only' (a producer warp waits only
    on its own half's empty barriers: with nstage 3 it can load into a slot two phases early)."""
    m = Machine(random.Random(seed))
    for s in range(nstage):
        m.init_mbar(("full", s), 2)
        m.init_mbar(("empty", s), 4)

    def producer(pw):
        h = pw // 2
        for k in range(ntiles):
            i = 2 * k + h
            s = i % nstage
            # every stage of the tile in order (both halves): with an odd nstage a slot serves both
            # halves in turn, and a parity wait cannot tell phase n from n + 2 ('own_wait_only' skips it)
            for j in ((2 * k, 2 * k + 1) if bug != "own_wait_only" else (i,)):
                yield ("wait", ("empty", j % nstage), ((j // nstage) & 1) ^ 1)
            for u in range(2):
                yield ("load", ("stage", s, pw % 2, u), ("rows", k, pw))
            yield ("noinc", ("full", s))

    def consumer(u, w):
        bar = 2 + u
        h = w // 2
        for k in range(ntiles):
            i = 2 * k + h
            s = i % nstage
            par = (i // nstage) & 1
            yield ("wait", ("full", s), par ^ 1 if bug == "parity" else par)
            own = ("stage", s, w % 2, u)
            want = ("rows", k, 2 * h + w % 2)
            if tail and k == ntiles - 1:
                yield ("write", own, ("zero", k), f"tail zero t{k} wg{u} w{w}")
                want = ("zero", k)
            if bug == "early_release":
                yield ("arrive", ("empty", s))
            yield ("read", own, want, f"S^T t{k} wg{u} w{w}")
            yield ("write", ("V", u, w), ("V", k), f"V t{k} wg{u} w{w}")
            if bug != "early_release":
                yield ("arrive", ("empty", s))
            yield ("write", ("X", u, w), ("X", k), f"X t{k}")
            yield ("nb_sync", 1)  # partials exchanged
            yield ("read", ("X", 1 - u, w), ("X", k), f"X read t{k} wg{u} w{w}")
            yield ("nb_sync", bar)  # the vote (and the slow path's maxima)
            yield ("write", ("P", u, w), ("P", k), f"P t{k} wg{u} w{w}")
            yield ("nb_sync", 1)  # P' and alpha written
            reads = [(("V", u, w2), ("V", k)) for w2 in range(4)]
            reads += [(("P", u2, w2), ("P", k)) for u2 in range(2) for w2 in range(4)]
            yield ("gemm", reads, f"P'V t{k} wg{u} w{w}")
            yield ("wait_group", 0)
            if bug != "no_end_barrier":
                yield ("nb_sync", bar)  # the tile's V reads retired before the next tile's stores

    agents = {f"producer{pw}": producer(pw) for pw in range(4)}
    agents.update({f"wg{u}w{w}": consumer(u, w) for u in range(2) for w in range(4)})
    run(agents, m, {1: 8, 2: 4, 3: 4})


def protocol_model(seeds: int = 40) -> list[str]:
    problems = []
    for npairs in (1, 2, 3, 5):
        for seed in range(seeds):
            try:
                seesaw_model(npairs, seed)
            except ModelError as exc:
                problems.append(f"seesaw npairs {npairs} seed {seed}: {exc}")
                break
        for tail in ((False, False), (True, False), (False, True)):  # seesaw_tma, with / without tail zeroing
            for seed in range(seeds):
                try:
                    seesaw_model(npairs, seed, tma=True, tail=tail)
                except ModelError as exc:
                    problems.append(f"seesaw_tma npairs {npairs} tail {tail} seed {seed}: {exc}")
                    break
    for items in ((1,), (3,), (1, 1), (2, 0, 1), (0, 3, 2), (1, 2, 1, 0), (5, 1)):
        for tails in ((False, False), (True, False), (False, True)):
            for seed in range(seeds // 2):
                try:
                    balanced_model(list(items), seed, [tails] * len(items))
                except ModelError as exc:
                    problems.append(f"seesaw_bal items {items} tail {tails} seed {seed}: {exc}")
                    break
        # the cp.async producer walking the items (seesaw_bal_cp)
        for seed in range(seeds // 2):
            try:
                balanced_model(list(items), seed, tma=False)
            except ModelError as exc:
                problems.append(f"seesaw_bal_cp items {items} seed {seed}: {exc}")
                break
    for nslot in (25, 23, 18):
        for ntiles in (1, 2, 3, 7):
            for seed in range(seeds // 2):
                try:
                    narrow_model(ntiles, nslot, seed)
                except ModelError as exc:
                    problems.append(f"narrow nslot {nslot} ntiles {ntiles} seed {seed}: {exc}")
                    break
    for nslot in (25, 18):
        for items in (((1, False),), ((2, True),), ((5, False),), ((3, True), (0, True), (4, False)),
                      ((1, False), (1, True), (3, False), (0, False), (2, True)), ((7, True), (7, False), (1, False)),
                      ((3, False), (3, False), (3, False), (3, True))):
            for seed in range(seeds // 2):
                try:
                    narrow2_model(list(items), nslot, seed)
                except ModelError as exc:
                    problems.append(f"narrow2 nslot {nslot} items {items} seed {seed}: {exc}")
                    break
    for name, model, nstages, tile_counts in (("narrow_fp8", narrow_fp8_model, (4, 2), (1, 2, 3, 5, 9)),
                                              ("wide_fp8", wide_fp8_model, (3, 2, 4), (1, 2, 3, 5, 8))):
        for nstage in nstages:
            for ntiles in tile_counts:
                for tail in (False, True):
                    for seed in range(seeds // 2):
                        try:
                            model(ntiles, nstage, seed, tail)
                        except ModelError as exc:
                            problems.append(f"{name} nstage {nstage} ntiles {ntiles} tail {tail} seed {seed}: {exc}")
                            break
    return problems


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
        self.compile_module, self.load_library = compile_module, load_library
        print(f"device: {self.info.name} cc {self.info.cc} SMs {self.info.sm_count} smem opt-in {self.info.smem_optin} B")
        for variant in args.variants:
            for dt in args.dtypes:
                self.kernel(variant, dt, args.watchdog and not args.timing_only)

    def kernel(self, variant, dt, watchdog):
        """The loaded kernel of (variant, dtype, watchdog build), compiled on first use. The correctness
        grid uses the watchdog build (an mbarrier wait > 4 s traps); timing always the production build
        (the watchdog's trap path makes ptxas serialise the narrow kernel's wgmma chain)."""
        key = (variant, dt, bool(watchdog))
        if key in self.kernels:
            return self.kernels[key]
        base, _, extra = variant.partition(":")
        kv = ks.kernel(base)
        t0 = time.perf_counter()
        defs = kv.defines(dt, watchdog=watchdog)
        for kvp in filter(None, extra.split(",")):
            name, _, val = kvp.partition("=")
            defs[name] = int(val or 1)
        mod = self.compile_module(kv.source, "sm_90a", defs)
        res = mod.resources.get(kv.entry)
        k = self.load_library(mod.cubin, f"mla-{variant}-{dt}-{int(watchdog)}").kernel(kv.entry, 0)
        k.ensure_dynamic_smem(kv.smem_bytes)
        self.kernels[key] = k
        notes = [ln.strip() for ln in mod.log.splitlines() if "Performance Loss" in ln or "warning" in ln.lower()]
        print(f"compiled {variant:8s} {dt:8s}{' watchdog' if watchdog else ''}: {res.registers if res else '?'} regs, "
              f"spills {res.spill_stores if res else '?'}/{res.spill_loads if res else '?'}, "
              f"stack {res.stack_bytes if res else '?'} B, {kv.threads} threads, dyn smem {kv.smem_bytes} B, "
              f"{'cached' if mod.from_cache else f'{time.perf_counter() - t0:.1f} s'}"
              + "".join(f"\n    ptxas: {n}" for n in notes), flush=True)
        return k

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

    def launch(self, variant, dt, grid, block, smem, packed, watchdog=None):
        wd = self.args.watchdog if watchdog is None else watchdog
        # inputs, fills and memsets were queued by CuPy on the legacy default stream, which does not
        # order the non-blocking launch stream: finish them first
        self.cp.cuda.Device().synchronize()
        pack = self.ArgPack(self.sig).pack(packed)
        plan = self.LaunchPlan(self.kernel(variant, dt, wd), grid, block, smem, pack, stream=int(self.stream.ptr))
        try:
            plan.launch()
            self.sync()
        except Exception as exc:  # noqa: BLE001
            raise LaunchError(f"{variant} {dt} grid {grid}: {type(exc).__name__}: {exc}") from exc
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
        # seesaw: odd tile counts (a pair's odd tile past the split end), splits of pairs, 2 row blocks
        Case("odd-tiles", 3, 2, 64, 1, [64 * 5 + 3, 64 * 7, 129], 64, True, 2),
        # narrow: many ring wraps, M = 16 and 32 exactly, splits
        Case("ring16", 2, 1, 16, 1, [2900, 1777], 32, False, 3),
        Case("ring32", 2, 2, 16, 1, [2500, 640], 64, True, "auto"),
        Case("rows24", 2, 3, 8, 1, [1200, 70], 256, True, 1),
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


def run_case(R, c: Case, dtype: str, variants, rng, tally) -> tuple[int, int]:
    cp = R.cp
    q_host, k_host, bt_host, raw, d, meta = build_inputs(cp, c, dtype, rng)
    t0 = time.perf_counter()
    out_ref, lse_ref = ref.mla_decode_reference(q_host, k_host, bt_host, raw, 512, None, c.causal)
    t_ref = time.perf_counter() - t0
    b, s_q, h_q, h_kv, page = c.b, c.s_q, c.h_q, c.h_kv, c.page
    group = h_q // h_kv
    cap = meta["max_blocks"] * page
    out = cp.empty((b, s_q, h_q, 512), cp.uint16)
    lse = cp.empty((b, h_q, s_q), cp.float32)
    E = 2  # element bytes
    qb = d["q_big"]
    q_ptr = qb.data.ptr + qb.strides[1] + qb.strides[2]  # q = q_big[:, 1:, 1:h_q + 1, :576]
    pool = d["pool"]
    passed = fails = 0
    for variant in variants:
        S = c.splits
        if S == "auto":
            S = ks.choose_num_splits(b, s_q, h_q, h_kv, cap, R.info.sm_count, variant=variant)
        grid, block, smem = ks.launch_geometry(b, s_q, h_q, h_kv, S, variant)
        ws = ks.workspace_sizes(b, s_q, h_q, h_kv, S, variant)
        ws_o = cp.empty(max(ws["ws_o"] // 4, 1), cp.float32)
        ws_ml = cp.empty(max(ws["ws_ml"] // 4, 1), cp.float32)
        counters = cp.zeros(max(ws["counters"] // 4, 1), cp.uint32)  # zeroed once, reused by every launch
        values = dict(
            q=q_ptr, k_cache=pool.data.ptr, block_table=d["bt_big"].data.ptr, cache_seqlens=d["lens"].data.ptr,
            out=out.data.ptr, lse=lse.data.ptr, ws_o=ws_o.data.ptr if S > 1 else 0, ws_ml=ws_ml.data.ptr if S > 1 else 0,
            counters=counters.data.ptr,
            q_stride_b=qb.strides[0] // E, q_stride_s=qb.strides[1] // E, q_stride_h=qb.strides[2] // E,
            k_stride_block=pool.strides[0] // E, k_stride_tok=pool.strides[1] // E, k_stride_head=pool.strides[2] // E,
            o_stride_b=out.strides[0] // E, o_stride_s=out.strides[1] // E, o_stride_h=out.strides[2] // E,
            bt_stride=d["bt_big"].strides[0] // 4,
            b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, group=group, m_rows=s_q * group,
            num_m_blocks=ks.num_m_blocks(s_q, h_q, h_kv, variant), page_size=page, page_shift=ks.page_shift(page),
            max_blocks=meta["max_blocks"], num_splits=S, flags=ks.FLAG_CAUSAL if c.causal else 0,
            scale_log2=ks.scale_log2(None),
        )
        packed = ks.pack_args(**values)
        label = (f"{c.name:10s} b{b:<3d} sq{s_q:<2d} hq{h_q:<3d} hkv{h_kv} page{page:<3d} "
                 f"{'causal' if c.causal else 'full  '} S{S:<3d} {dtype[:4]}")
        reps = 2 if S > 1 else 1  # second launch checks that the last CTA reset the counters
        errs = []
        max_o = max_l = 0.0
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
            max_o = max(max_o, float(np.nanmax(np.where(np.isnan(e_out), np.inf, e_out))) if e_out.size else 0.0)
            max_l = max(max_l, float(e_lse.max()) if e_lse.size else 0.0)
            if problems:
                errs.append(f"launch {rep + 1}: " + "; ".join(problems))
        status = "PASS" if not errs else "FAIL"
        fails += bool(errs)
        passed += not errs
        t = tally.setdefault(variant, [0, 0, 0.0, 0.0])
        t[0 if not errs else 1] += 1
        t[2], t[3] = max(t[2], max_o), max(t[3], max_l)
        print(f"{status} {variant:8s} {label} max|dout| {max_o:.2e} max|dlse| {max_l:.2e} (ref {t_ref:.2f}s)"
              + ("" if not errs else "  <- " + " | ".join(errs)), flush=True)
        del ws_o, ws_ml, counters
    return passed, fails


# =============================================================================== timing
TIMING_SHAPES = ((128, 4096, 1), (128, 8192, 1), (128, 16384, 1), (128, 32768, 1),
                 (16, 4096, 1), (16, 8192, 1), (16, 16384, 1), (16, 32768, 1),
                 (64, 8192, 2), (128, 8192, 2))
# (h_q, L, s_q) -> (FlashMLA, FlashInfer) on the same H200 (shared/ANCHORS.md): TFLOPS when M >= 64, else TB/s
PEERS = {(128, 4096, 1): (658, 567), (128, 8192, 1): (652, 566), (128, 16384, 1): (672, 513),
         (128, 32768, 1): (627, 518), (16, 4096, 1): (4.06, 4.17), (16, 8192, 1): (4.23, 4.32),
         (16, 16384, 1): (4.47, 4.00), (16, 32768, 1): (4.50, 3.86), (64, 8192, 2): (629, None),
         (128, 8192, 2): (640, None)}


def _fill_random_bits(cp, flat, dtype, seed):
    """Standard-normal values as 16-bit float bits, generated in chunks (no multi-GB temporaries)."""
    rs = cp.random.RandomState(seed)
    n, chunk = flat.size, 1 << 27
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        x = rs.standard_normal(m, dtype=cp.float32)
        if dtype == "bfloat16":
            u = x.view(cp.uint32)
            flat[i:i + m] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
        else:
            flat[i:i + m] = x.astype(cp.float16).view(cp.uint16)


def _timing_eligible(variant, m_rows):
    """Variants worth timing at M packed rows: narrow kernels only up to two row blocks."""
    bm = ks.kernel(variant.split(":")[0]).block_m
    return not variant.startswith("narrow") or m_rows <= 2 * bm


def timing(R, variants, dtype="bfloat16", shapes=None, all_variants=False):
    cp = R.cp
    print("\ntiming: b 128, h_kv 1, page 64, uniform lengths, not causal; 50 back-to-back launches between CUDA "
          "events, no L2 flush. TFLOPS = 2 h_q s_q sum(len) (576 + 512) / t; TB/s = (q + 576-channel KV + out) "
          "bytes / t. Peers: FlashMLA / FlashInfer on the same H200 (ANCHORS.md)")
    if shapes:
        parsed = []
        for sh in shapes:
            v = [int(x) for x in sh.split(",")]
            parsed.append((v[0], v[1], v[2] if len(v) > 2 else 1))
    else:
        parsed = list(TIMING_SHAPES)
    b, h_kv, page = 128, 1, 64
    best = {}
    pool_L, pool = None, None
    for h_q, L, s_q in sorted(parsed, key=lambda x: (x[1], x[0], x[2])):
        npg = L // page
        nb = b * npg
        if pool_L != L:
            pool = None
            cp.get_default_memory_pool().free_all_blocks()
            pool = cp.empty((nb, page, h_kv, 576), cp.uint16)
            _fill_random_bits(cp, pool.reshape(-1), dtype, 1234 + L)
            pool_L = L
        bt = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32).reshape(b, npg))
        q = cp.asarray(to_bits(np.random.default_rng(1).standard_normal((b, s_q, h_q, 576)), dtype))
        lens = cp.full(b, L, cp.int32)
        out = cp.empty((b, s_q, h_q, 512), cp.uint16)
        lse = cp.empty((b, h_q, s_q), cp.float32)
        group = h_q // h_kv
        m_rows = s_q * group
        flops = 2.0 * h_q * s_q * b * L * (576 + 512)
        nbytes = b * (s_q * h_q * 576 * 2 + L * h_kv * 576 * 2 + s_q * h_q * 512 * 2)
        routed = ks.choose_variant(s_q, h_q, h_kv)
        for variant in variants:
            if not all_variants and not _timing_eligible(variant, m_rows):
                continue
            kvar = variant.split(":")[0]
            if ks.kernel(kvar).tma:
                print(f"  {variant}: TMA variant (two tensor-map parameters) is timed by `python -m gqadrv bench --op mla`, "
                      "not here", flush=True)
                continue
            S = ks.choose_num_splits(b, s_q, h_q, h_kv, L, R.info.sm_count, variant=kvar)
            grid, block, smem = ks.launch_geometry(b, s_q, h_q, h_kv, S, kvar)
            ws = ks.workspace_sizes(b, s_q, h_q, h_kv, S, kvar)
            ws_o = cp.empty(max(ws["ws_o"] // 4, 1), cp.float32)
            ws_ml = cp.empty(max(ws["ws_ml"] // 4, 1), cp.float32)
            counters = cp.zeros(max(ws["counters"] // 4, 1), cp.uint32)
            packed = ks.pack_args(
                q=q.data.ptr, k_cache=pool.data.ptr, block_table=bt.data.ptr, cache_seqlens=lens.data.ptr,
                out=out.data.ptr, lse=lse.data.ptr, ws_o=ws_o.data.ptr, ws_ml=ws_ml.data.ptr, counters=counters.data.ptr,
                q_stride_b=s_q * h_q * 576, q_stride_s=h_q * 576, q_stride_h=576,
                k_stride_block=page * h_kv * 576, k_stride_tok=h_kv * 576, k_stride_head=576,
                o_stride_b=s_q * h_q * 512, o_stride_s=h_q * 512, o_stride_h=512, bt_stride=npg,
                b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, group=group, m_rows=m_rows,
                num_m_blocks=ks.num_m_blocks(s_q, h_q, h_kv, kvar), page_size=page, page_shift=ks.page_shift(page),
                max_blocks=npg, num_splits=S, flags=0, scale_log2=ks.scale_log2(None))
            plan = R.launch(variant, dtype, grid, block, smem, packed, watchdog=False)  # warm-up + error check
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(R.stream)
            for _ in range(50):
                plan.launch()
            e1.record(R.stream)
            R.sync()
            ms = cp.cuda.get_elapsed_time(e0, e1) / 50
            t = ms * 1e-3
            tf, tb = flops / t / 1e12, nbytes / t / 1e12
            key = (h_q, L, s_q)
            if key not in best or t < best[key][1]:
                best[key] = (variant, t, tf, tb)
            print(f"  {variant:8s}{'*' if variant == routed else ' '} {dtype[:4]} b{b} sq{s_q} hq{h_q:<3d} len{L:<5d} "
                  f"S{S:<2d} grid{grid}: {ms * 1e3:8.1f} us  {tf:6.1f} TFLOPS  {tb:5.2f} TB/s", flush=True)
            del ws_o, ws_ml, counters
    print("\ntiming summary (best variant per row; * above = choose_variant's pick):")
    for key in sorted(best, key=lambda k: (-(k[0] * k[2]), k[1])):
        h_q, L, s_q = key
        variant, t, tf, tb = best[key]
        fm, fi = PEERS.get(key, (None, None))
        if s_q * h_q >= 64:
            peer = f"FlashMLA {fm} / FlashInfer {fi} TFLOPS" if fm else ""
            mine = f"{tf:6.1f} TFLOPS"
        else:
            peer = f"FlashMLA {fm} / FlashInfer {fi} TB/s" if fm else ""
            mine = f"{tb:5.2f} TB/s"
        print(f"  hq{h_q:<3d} sq{s_q} len{L:<5d}: {mine}  ({variant}, {t * 1e6:8.1f} us)  {peer}", flush=True)
    del pool
    cp.get_default_memory_pool().free_all_blocks()


# =============================================================================== main
def cpu_models() -> bool:
    ok = True
    checks = [("layout model (original kernel)", layout_model), ("layout model (seesaw)", layout_model_seesaw),
              ("layout model (narrow16)", lambda: layout_model_narrow(16)),
              ("layout model (narrow32)", lambda: layout_model_narrow(32)),
              ("protocol model (seesaw + narrow)", protocol_model)]
    for name, fn in checks:
        t0 = time.perf_counter()
        errs = fn()
        ok &= not errs
        print(f"{name}: {'OK' if not errs else 'FAILED'} ({time.perf_counter() - t0:.1f} s)"
              + ("" if not errs else "\n  " + "\n  ".join(errs[:20])), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["seesaw", "narrow16", "narrow32", "wgmma", "mma"],
                    help="variants (seesaw, narrow16, narrow32, wgmma, mma); 'name:DEF=1,DEF2' adds compile-time defines "
                         "(timing experiments)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument("--layout-only", action="store_true", help="run the CPU layout / protocol models only")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--quick", action="store_true", help="every third correctness case")
    ap.add_argument("--hang-seconds", type=float, default=30.0)
    ap.add_argument("--no-watchdog", action="store_true",
                    help="build without MLA_WATCHDOG (by default an mbarrier wait > 4 s traps instead of hanging)")
    ap.add_argument("--timing-only", action="store_true", help="skip the correctness grid")
    ap.add_argument("--timing-shapes", nargs="*", default=None,
                    help="'h_q,L' or 'h_q,L,s_q' triples (default: h_q 128 and 16 x L 4K..32K, s_q 1; "
                         "h_q 64 and 128 at L 8K, s_q 2)")
    ap.add_argument("--timing-all-variants", action="store_true",
                    help="time every variant on every row (default: narrow kernels only up to 2 row blocks)")
    args = ap.parse_args()
    args.dtypes = [{"bf16": "bfloat16", "fp16": "float16"}[d] for d in args.dtypes]
    args.watchdog = not args.no_watchdog
    t_start = time.perf_counter()

    models_ok = cpu_models()
    if args.layout_only:
        return 0 if models_ok else 1

    try:
        R = Runner(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 2
    passed = failed = 0
    tally: dict = {}
    rng = np.random.default_rng(7)
    try:
        for dt in ([] if args.timing_only else args.dtypes):
            for c in case_grid(args.quick):
                try:
                    p, f = run_case(R, c, dt, args.variants, rng, tally)
                except LaunchError as exc:
                    print(f"LAUNCH ERROR in case {c.name} b{c.b} sq{c.s_q} hq{c.h_q} hkv{c.h_kv} page{c.page} "
                          f"S{c.splits} {dt}: {exc}", flush=True)
                    return 2
                except Exception:  # noqa: BLE001 - a host-side problem in one case: report, continue
                    traceback.print_exc()
                    p, f = 0, len(args.variants)
                passed += p
                failed += f
        if not args.timing_only:
            print()
            for v in args.variants:
                t = tally.get(v, [0, 0, 0.0, 0.0])
                print(f"summary {v:8s}: {t[0]} passed, {t[1]} failed; max|dout| {t[2]:.2e}, max|dlse| {t[3]:.2e}")
            print(f"{passed} passed, {failed} failed ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if not args.no_timing:
            timing(R, args.variants, args.dtypes[0], args.timing_shapes, args.timing_all_variants)
    except LaunchError as exc:
        print(f"LAUNCH ERROR: {exc}", flush=True)
        return 2
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if failed == 0 and models_ok else 1


if __name__ == "__main__":
    sys.exit(main())
