"""CPU check of the warp-level fragment layouts in kernels/gqa/common/warp.cuh through the numpy model
in tests/gqa/layout_model.py: the permuted K chunks read through the per-lane offset kofs, V by
ldmatrix.x4.trans from the 128B-swizzled slot through vofs, the masking of NaN padding and the
output column order, against the float64 oracle."""

import math

import pytest

from tests.gqa import layout_model as MODEL


@pytest.mark.parametrize("case", range(len(MODEL.CASES)))
def test_layout_model_matches_oracle(case):
    err = MODEL.run(**MODEL.CASES[case])
    assert err < 1e-2


def test_layout_model_detects_a_wrong_ldmatrix_address(monkeypatch):
    good = MODEL.lane_offsets

    def unswizzled(TOK):  # forget the XOR with the row phase: wrong rows of V reach the MMA
        kofs, _ = good(TOK)
        vofs = [[((l & 7) + 8 * ((l >> 3) & 1)) * 128 + ((2 * w + (l >> 4)) << 4) for w in range(4)] for l in range(32)]
        return kofs, vofs

    monkeypatch.setattr(MODEL, "lane_offsets", unswizzled)
    err = MODEL.run(**MODEL.CASES[0])
    assert math.isnan(err) or err > 1e-1


def test_layout_model_detects_a_wrong_k_address(monkeypatch):
    good = MODEL.lane_offsets

    def no_swizzle_for_k(TOK):  # K chunk 2t read without the row-phase XOR
        _, vofs = good(TOK)
        kofs = [[(l >> 2) * 128 + ((2 * (l & 3) + s) << 4) for s in range(2)] for l in range(32)]
        return kofs, vofs

    monkeypatch.setattr(MODEL, "lane_offsets", no_swizzle_for_k)
    assert math.isnan(MODEL.run(**MODEL.CASES[0]))
