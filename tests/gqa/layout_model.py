"""Numpy model of kernels/gqa/common/warp.cuh: simulates the 32 lanes' mma.sync m16n8k16 fragments
(PTX ISA layouts) with the permuted chunk mapping, the swizzled smem addressing (including the
per-lane offsets kofs / vofs, checked against the permuted chunk mapping, and ldmatrix.x4.trans
for V) and the online
softmax, and compares one warp's result with the float64 oracle. Run: python -m tests.gqa.layout_model
(tests/test_warp_layout_model.py runs it in CI)."""

import numpy as np

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


def mma(acc, a, b):
    """acc[lane][4] += A(16x16) B(16x8); a[lane][4][2], b[lane][2][2] halves (as float)."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        for e in range(2):
            A[g, 2 * t + e] = a[l][0][e]; A[g + 8, 2 * t + e] = a[l][1][e]
            A[g, 2 * t + 8 + e] = a[l][2][e]; A[g + 8, 2 * t + 8 + e] = a[l][3][e]
            B[2 * t + e, g] = b[l][0][e]; B[2 * t + 8 + e, g] = b[l][1][e]
    C = A @ B
    for l in range(32):
        g, t = l // 4, l % 4
        acc[l][0] += C[g, 2 * t]; acc[l][1] += C[g, 2 * t + 1]
        acc[l][2] += C[g + 8, 2 * t]; acc[l][3] += C[g + 8, 2 * t + 1]


def k_chunk(p, t):
    return 2 * t + (p & 1) + 8 * (p >> 1)


def o_dim(j, n):
    return 8 * j + n


def swz(rows, r, c):
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)


def lane_offsets(TOK):
    """kofs[lane][p & 1], vofs[lane][q & 3] as WarpDecoder derives them from its two per-lane offsets
    (kofs ^ ((p & 1) << 4), vofs ^ ((q & 3) << 5))."""
    k0 = [swz(TOK, l // 4, 2 * (l % 4)) for l in range(32)]
    v0 = [swz(TOK, (l & 7) + 8 * ((l >> 3) & 1), l >> 4) for l in range(32)]
    kofs = [[k0[l] ^ (par << 4) for par in (0, 1)] for l in range(32)]
    vofs = [[v0[l] ^ (w << 5) for w in range(4)] for l in range(32)]
    return kofs, vofs


def ldsm_x4_trans(rows):
    """rows[lane] = 8 elements at lane's address -> regs[lane][m] = (M_m[2t][g], M_m[2t+1][g])."""
    regs = []
    for l in range(32):
        g, t = l // 4, l % 4
        regs.append([(rows[8 * mi + 2 * t][g], rows[8 * mi + 2 * t + 1][g]) for mi in range(4)])
    return regs


def run(D=128, ROWS=16, TOK=32, group=12, length=77, ntok=96, scale=0.7, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((group, D)).astype(np.float16).astype(np.float64)
    K = rng.standard_normal((ntok, D)).astype(np.float16).astype(np.float64)
    V = rng.standard_normal((ntok, D)).astype(np.float16).astype(np.float64)
    K[length:] = np.nan; V[length:] = np.nan
    KP, NJ, NT, KS, NB = D // 32, D // 8, TOK // 8, TOK // 16, D // 64
    # Q fragments
    qlo = np.zeros((32, 2 * KP, 2, 2)); qhi = np.zeros((32, 2 * KP, 2, 2))
    for l in range(32):
        g, t = l // 4, l % 4
        for p in range(KP):
            c = k_chunk(p, t)
            for row, dst in ((g, qlo), (g + 8, qhi)):
                if row < group and (row < 8 or ROWS == 16):
                    v = Q[row, 8 * c: 8 * c + 8]
                    dst[l, 2 * p, 0] = v[0:2]; dst[l, 2 * p, 1] = v[2:4]
                    dst[l, 2 * p + 1, 0] = v[4:6]; dst[l, 2 * p + 1, 1] = v[6:8]
    o = np.zeros((32, NJ, 4)); m = np.full((32, 2), -np.inf); lsum = np.zeros((32, 2))
    sl2 = scale / np.sqrt(D) / np.log(2)
    for tok0 in range(0, ntok, TOK):
        # the slot as TMA would write it (128B swizzle), as bytes of fp16 -> we keep float elements
        slotK = {}; slotV = {}
        for r in range(TOK):
            for c in range(D // 8):
                off = swz(TOK, r, c)
                slotK[off] = K[tok0 + r, 8 * c: 8 * c + 8] if tok0 + r < ntok else np.zeros(8)
                slotV[off] = V[tok0 + r, 8 * c: 8 * c + 8] if tok0 + r < ntok else np.zeros(8)
        ldk = lambda r, c: slotK[swz(TOK, r, c)]
        kofs, vofs = lane_offsets(TOK)
        BOX = TOK * 128
        s = np.zeros((32, NT, 4))
        for p in range(KP):
            for i in range(NT):
                a0 = [[qlo[l, 2 * p, 0], qhi[l, 2 * p, 0], qlo[l, 2 * p, 1], qhi[l, 2 * p, 1]] for l in range(32)]
                a1 = [[qlo[l, 2 * p + 1, 0], qhi[l, 2 * p + 1, 0], qlo[l, 2 * p + 1, 1], qhi[l, 2 * p + 1, 1]] for l in range(32)]
                # the kernel's address kofs[p & 1] + (p >> 1) * BOX + i * 1024 must hold the chunk of
                # the permuted mapping: row 8 i + l / 4, chunk k_chunk(p, l % 4)
                kc = [slotK[kofs[l][p & 1] + (p >> 1) * BOX + i * 1024] for l in range(32)]
                want = [ldk(8 * i + l // 4, k_chunk(p, l % 4)) for l in range(32)]
                if not all(np.array_equal(x, y, equal_nan=True) for x, y in zip(kc, want)):
                    return float("nan")
                acc = s[:, i]
                mma(acc, a0, [[kc[l][0:2], kc[l][2:4]] for l in range(32)])
                mma(acc, a1, [[kc[l][4:6], kc[l][6:8]] for l in range(32)])
        partial = tok0 + TOK > length
        for l in range(32):
            t = l % 4
            for i in range(NT):
                for e in range(2):
                    valid = (not partial) or (tok0 + 8 * i + 2 * t + e < length)
                    s[l, i, e] = s[l, i, e] * sl2 if valid else -np.inf
                    s[l, i, 2 + e] = s[l, i, 2 + e] * sl2 if valid else -np.inf
        mx = np.max(s[:, :, [0, 1]].reshape(32, -1), axis=1), np.max(s[:, :, [2, 3]].reshape(32, -1), axis=1)
        for h in range(2):  # quad allreduce
            v = mx[h].reshape(8, 4).max(axis=1).repeat(4)
            mnew = np.maximum(m[:, h], v)
            base = np.where(mnew == -np.inf, 0, mnew)
            alpha = np.exp2(m[:, h] - base)
            m[:, h] = mnew
            cols = [0, 1] if h == 0 else [2, 3]
            s[:, :, cols] = np.exp2(s[:, :, cols] - base[:, None, None])
            lsum[:, h] = lsum[:, h] * alpha + s[:, :, cols].reshape(32, -1).sum(axis=1)
            o[:, :, cols] *= alpha[:, None, None]
        P = s.astype(np.float16).astype(np.float64)
        for ks in range(KS):
            a = [[P[l, 2 * ks, 0:2], P[l, 2 * ks, 2:4], P[l, 2 * ks + 1, 0:2], P[l, 2 * ks + 1, 2:4]] for l in range(32)]
            for q in range(NJ // 2):
                rows = [slotV[vofs[l][q & 3] + (q >> 2) * BOX + ks * 2048] for l in range(32)]
                regs = ldsm_x4_trans(rows)
                for l in range(32):  # token halves >= len zeroed (16-bit masks)
                    tr = tok0 + 16 * ks + 2 * (l % 4)
                    for mi, dt in ((0, 0), (1, 8), (2, 0), (3, 8)):
                        regs[l][mi] = tuple(x if (not partial or tr + dt + e < length) else 0.0
                                            for e, x in enumerate(regs[l][mi]))
                mma(o[:, 2 * q], a, [[regs[l][0], regs[l][1]] for l in range(32)])
                mma(o[:, 2 * q + 1], a, [[regs[l][2], regs[l][3]] for l in range(32)])
    ltot = lsum.reshape(8, 4, 2).sum(axis=1)  # quad reduce -> per g
    out = np.zeros((group, D))
    for l in range(32):
        g, t = l // 4, l % 4
        for j in range(NJ):
            for h, row in ((0, g), (1, g + 8)):
                if row < group:
                    out[row, o_dim(j, 2 * t)] = o[l, j, 2 * h] / ltot[g, h]
                    out[row, o_dim(j, 2 * t + 1)] = o[l, j, 2 * h + 1] / ltot[g, h]
    sc = Q @ K[:length].T * scale / np.sqrt(D)
    p = np.exp(sc - sc.max(axis=1, keepdims=True))
    ref = (p / p.sum(axis=1, keepdims=True)) @ V[:length]
    return np.max(np.abs(out - ref))


CASES = (dict(D=128, ROWS=16, TOK=32, group=12, length=77), dict(D=64, ROWS=8, TOK=16, group=4, length=40, ntok=48),
         dict(D=256, ROWS=8, TOK=16, group=8, length=33, ntok=48), dict(D=128, ROWS=8, TOK=32, group=1, length=96),
         dict(D=64, ROWS=16, TOK=64, group=16, length=70, ntok=128))

if __name__ == "__main__":
    for kw in CASES:
        err = run(**kw)
        print(kw, "max err", f"{err:.2e}", "OK" if err < 1e-2 else "FAIL")
