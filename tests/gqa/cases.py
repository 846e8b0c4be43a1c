"""Deterministic GQA oracle grid for the GPU tests: geometries x capacities x batches/lengths/scales.

Lengths include 1, sub-tile edges, C-1, C and out-of-range device values (0, negative, > C).
Inputs are drawn on the host, rounded to fp16/bf16, uploaded, and the float64 oracle is computed
from the rounded values. Padding (positions >= the clamped length) can be poisoned with NaN/Inf.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from gqadrv.gqa.reference import gqa_decode_reference

GEOMETRIES = [  # dtype, head_dim, Hq, Hkv
    ("float16", 128, 32, 8),   # the seed's geometry (group 4)
    ("bfloat16", 128, 32, 8),
    ("float16", 64, 16, 16),   # group 1
    ("float16", 256, 16, 2),   # group 8
    ("bfloat16", 64, 48, 3),   # group 16
    ("float16", 128, 12, 4),   # group 3
    ("bfloat16", 256, 32, 2),  # group 16, D 256
    ("float16", 64, 40, 4),    # group 10
]
CAPACITIES = [1, 2, 63, 64, 65, 127, 128, 1000, 4096, 8192]
SCALES = [0.5, 1.0, 1.5]
EDGES = [1, 16, 31, 32, 33, 64, 65, 127, 128, 129, 255, 256, 257]
MAX_ELEMS = 12 << 20  # KV elements per case (keeps host oracle time small)
TOL = {"float16": 1e-2, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    idx: int
    dtype: str
    d: int
    hq: int
    hkv: int
    capacity: int
    lengths: tuple
    q_scale: float
    poison: str  # "", "nan" or "inf": fill K/V padding with this

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def id(self) -> str:
        L = ",".join(map(str, self.lengths)) if len(self.lengths) <= 4 else f"{self.lengths[0]},..x{len(self.lengths)}"
        p = f"-{self.poison}" if self.poison else ""
        return f"{self.idx:03d}-{self.dtype[:2]}{self.d}-h{self.hq}/{self.hkv}-C{self.capacity}-L[{L}]-s{self.q_scale}{p}"


def _lengths(C: int, B: int, variant: int, rng) -> tuple:
    special = [1, C, C - 1, 0, -5, C + 7] + [e for e in EDGES if e <= C]
    out = []
    for b in range(B):
        if variant == 0:
            v = special[(b * 3) % len(special)]
        elif variant == 1:
            v = [C, 1, C - 1][b % 3] if b < 3 else int(rng.integers(1, C + 1))
        else:
            v = special[(b * 5 + 2) % len(special)] if b % 2 else int(rng.integers(1, C + 1))
        out.append(int(v))
    return tuple(out)


@functools.cache
def grid() -> tuple[Case, ...]:
    rng = np.random.default_rng(2026)
    cases = []
    batches = [1, 3, 9, 2, 5, 4, 7]
    for gi, (dt, d, hq, hkv) in enumerate(GEOMETRIES):
        for ci, C in enumerate(CAPACITIES):
            for variant in range(3):
                B = batches[(gi + ci + variant) % len(batches)]
                B = max(1, min(B, MAX_ELEMS // (2 * hkv * C * d)))
                poison = ["", "nan", "inf"][(gi + ci + variant) % 3] if C > 1 else ""
                cases.append(Case(len(cases), dt, d, hq, hkv, C, _lengths(C, B, variant, rng),
                                  SCALES[(gi + ci + variant) % 3], poison))
    return tuple(cases)


def host_inputs(case: Case, seed: int | None = None):
    """(q, kv, lengths) host arrays in the case dtype (poisoned padding) and the float64 oracle."""
    import ml_dtypes

    rng = np.random.default_rng(case.idx if seed is None else seed)
    np_dt = np.float16 if case.dtype == "float16" else ml_dtypes.bfloat16
    q = rng.standard_normal((case.batch, case.hq, case.d), dtype=np.float32).astype(np_dt)
    kv = rng.standard_normal((case.batch, 2, case.hkv, case.capacity, case.d), dtype=np.float32).astype(np_dt)
    lens = np.array(case.lengths, dtype=np.int32)
    if case.poison:
        bad = np.nan if case.poison == "nan" else np.inf
        for b, n in enumerate(lens):
            n = min(max(int(n), 0), case.capacity)
            kv[b, :, :, n:, :] = bad
            if case.poison == "inf" and n < case.capacity:
                kv[b, 0, :, n:, 1::2] = -np.inf
    ref = gqa_decode_reference(q.astype(np.float64), kv, lens, case.q_scale)
    return q, kv, lens, ref


from tests.helpers import record_error, to_device, to_host  # noqa: E402,F401 - re-exported for the GQA tests


def check(got, ref: np.ndarray, dtype: str, label: str) -> float:
    """Assert |got - ref| <= tol + tol*|ref| everywhere (finite); record the max error per label."""
    g = np.asarray(got, dtype=np.float64)
    tol = TOL[dtype]
    assert np.all(np.isfinite(g)), f"{label}: non-finite output"
    err = np.abs(g - ref)
    bad = err > tol + tol * np.abs(ref)
    assert not bad.any(), f"{label}: {int(bad.sum())} elements off, max err {err.max():.3e} at {np.unravel_index(err.argmax(), err.shape)}"
    m = float(err.max()) if err.size else 0.0
    record_error(f"{label} {dtype}", m)
    return m
