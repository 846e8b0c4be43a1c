"""The oracle grid of MLA dense decode on FlashMLA's 656-byte FP8 cache (``is_fp8_kvcache=True``).

Each case quantizes a NaN-poisoned bf16 case of ``make_case`` with the numpy model of the format
(``quantize_k_cache_reference``), then poisons every byte of every unused row (codes 0xFF = NaN,
scales 0xFFFFFFFF = NaN, RoPE 0xFFFF = NaN) and pads each row to 672 bytes with 0xFF (so the row
stride is not 656 and the padding is NaN too). The oracle is the float64 dense decode on
``dequantize_k_cache_reference`` of the same bytes. Axes, drawn with co-prime strides: batch
{1, 2, 37, 128}, s_q {1, 2, 4}, (h_q, h_kv) {(1,1), (3,1), (16,1), (63,1), (64,1), (128,1), (16,2),
(128,2)}, lengths {0, 1, 63, 64, 65, 4096, ragged}, pages {1, 16, 32, 64, 128, 256}, causal, splits
auto / 1 / 7, backend auto (seesaw_fp8 on the H200) / mma_fp8, cache bytes as uint8 / int8.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gqadrv.mla.fp8_reference import BYTES_PER_TOKEN, dequantize_k_cache_reference, quantize_k_cache_reference
from tests.mla.cases import MlaCase

BATCHES = (1, 2, 37, 128)
S_QS = (1, 2, 4)
HEADS = ((1, 1), (3, 1), (16, 1), (63, 1), (64, 1), (128, 1), (16, 2), (128, 2))
LENGTHS = ("0", "1", "63", "64", "65", "4096", "ragged")
PAGES = (1, 16, 32, 64, 128, 256)
SPLITS = (None, 1, 7)
N_CASES = 120
ROW_PAD = 672  # bytes per padded row (a multiple of 16 past 656)
TOL = 2e-2     # bf16 outputs, relative + absolute


@dataclasses.dataclass(frozen=True)
class Fp8MlaCase(MlaCase):
    """An MlaCase (bf16 q) whose cache bytes are handed over as ``code_dtype``."""

    code_dtype: str = "uint8"

    @property
    def label(self) -> str:
        return (f"{self.idx}:b{self.b}s{self.s_q}h{self.h_q}/{self.h_kv}L{self.lengths}p{self.page}"
                f"{'c' if self.causal else ''}S{self.splits}{self.backend or ''}{self.code_dtype}")


def grid() -> list[Fp8MlaCase]:
    out = []
    for i in range(N_CASES):
        b = BATCHES[i % 4]
        L = LENGTHS[(i * 3) % 7]
        if L == "4096" and b > 2:
            b = 1 + i % 2
        h_q, h_kv = HEADS[(i * 5) % len(HEADS)]
        if b == 128 and h_q > 16:
            h_q, h_kv = 16, 1
        out.append(Fp8MlaCase(i, b, S_QS[(i // 4) % 3], h_q, h_kv, L, PAGES[(i * 5) % 6], bool((i // 3) % 2),
                              "bfloat16", SPLITS[(i // 2) % 3], (None, "mma_fp8", None)[i % 3],
                              code_dtype=("uint8", "int8")[(i // 6) % 2]))
    return out


def fp8_case(rng, b, s_q, h_q, h_kv, page, lens, max_blocks=None):
    """(q bf16, k8 uint8 [nb, page, h_kv, 656] with poisoned unused rows, bt, lens, k_deq bf16 oracle cache)."""
    from gqadrv.mla.selftest import make_case

    q, k, bt, ln = make_case(rng, b, s_q, h_q, h_kv, page, lens, "bfloat16", max_blocks=max_blocks)
    k8 = quantize_k_cache_reference(k)
    unused = np.isnan(np.asarray(k, np.float32)).all(axis=-1)
    k8[unused] = 0xFF
    return q, k8, bt, ln, dequantize_k_cache_reference(k8)


def padded_cache(k8: np.ndarray, code_dtype: str = "uint8"):
    """A device view [nb, page, h_kv, 656] of rows 672 bytes apart (0xFF padding), as uint8 or int8."""
    import cupy as cp

    w = np.full(k8.shape[:-1] + (ROW_PAD,), 0xFF, np.uint8)
    w[..., :BYTES_PER_TOKEN] = k8
    d = cp.asarray(w)
    if code_dtype == "int8":
        d = d.view(cp.int8)
    return d[..., :BYTES_PER_TOKEN]
