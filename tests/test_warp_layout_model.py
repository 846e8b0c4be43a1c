"""CPU check of the warp-level fragment layouts in kernels/common/gqa_warp.cuh through the numpy model
in tools/simulate_warp_layout.py: the permuted K chunks, both V paths (16-byte chunks + prmt from
global memory, ldmatrix.x4.trans from the 128B-swizzled ring with the per-lane offsets kofs / vofs),
the masking of NaN padding and the output column order, against the float64 oracle."""

import importlib.util
import math
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "simulate_warp_layout.py"


def _model():
    spec = importlib.util.spec_from_file_location("simulate_warp_layout", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODEL = _model()


@pytest.mark.parametrize("ldsm", [False, True], ids=["chunk-V", "ldmatrix-V"])
@pytest.mark.parametrize("case", range(len(MODEL.CASES)))
def test_layout_model_matches_oracle(case, ldsm):
    err = MODEL.run(**MODEL.CASES[case], ldsm=ldsm)
    assert err < 1e-2


def test_layout_model_detects_a_wrong_ldmatrix_address(monkeypatch):
    good = MODEL.lane_offsets

    def unswizzled(TOK):  # forget the XOR with the row phase: wrong rows of V reach the MMA
        kofs, _ = good(TOK)
        vofs = [[((l & 7) + 8 * ((l >> 3) & 1)) * 128 + ((2 * w + (l >> 4)) << 4) for w in range(4)] for l in range(32)]
        return kofs, vofs

    monkeypatch.setattr(MODEL, "lane_offsets", unswizzled)
    err = MODEL.run(**MODEL.CASES[0], ldsm=True)
    assert math.isnan(err) or err > 1e-1
