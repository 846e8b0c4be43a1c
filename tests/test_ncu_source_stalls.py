"""tools/ncu_source_stalls.py on a synthetic Nsight Compute source-page CSV (CPU only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_source_stalls", ROOT / "tools" / "ncu_source_stalls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
       "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x10", "LDC R1, c[0x0][0x28]", "2", "10", "0", "2", "0"],
    ["0x20", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8", "0", "8", "0", "0", "0"],
    ["0x30", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R5+URZ+0x38568], R18", "1", "100", "0", "1", "0"],
    ["0x40", "@!P0  BRA 0x1000", "60", "100", "55", "5", "50"],
    ["0x50", "USETMAXREG.DEALLOC.CTAPOOL 0x48", "0", "4", "0", "0", "0"],
    ["0x60", "LDS.128 R24, [R15+0x1e000]", "37", "1,000", "30", "7", "20"],
]


def test_regions_reasons_and_hot_instructions(tmp_path):
    tool = _tool()
    f = tmp_path / "src.csv"
    lines = ["==PROF== Connected to process 1", '"Kernel Name","k",']
    lines += [",".join(f'"{c}"' for c in r) for r in [HDR, *ROWS]]
    f.write_text("\n".join(lines) + "\n")
    hdr, data = tool.load(str(f))
    assert hdr == HDR and len(data) == len(ROWS)
    text = tool.report(hdr, data, 2)
    assert text.splitlines()[0] == "6 instructions, 100 stall samples"
    # three regions: before the first USETMAXREG, the consumer role, the producer role
    assert "region [0, 1) from 'LDC R1, c[0x0][0x28]': 2.0 % of samples, 10 warp instructions" in text
    assert "region [1, 4) from 'USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd8': 61.0 % of samples, 208 warp" in text
    assert "region [4, 6) from 'USETMAXREG.DEALLOC.CTAPOOL 0x48': 37.0 % of samples, 1004 warp" in text
    assert "long_sb 90 %, wait 10 %" in text  # the consumer region: 55 of 61 samples
    hot = text.split("top 2 instructions by samples:")[1].splitlines()
    assert "60.0 %" in hot[1] and "TRYWAIT P0, [R5+URZ+0x38568]" in hot[1] and "[long_sb 55]" in hot[1]
    assert "37.0 %" in hot[2] and "LDS.128" in hot[2]


def test_rejects_a_file_without_the_source_table(tmp_path):
    f = tmp_path / "x.csv"
    f.write_text('"Metric","Value"\n"a","1"\n')
    with pytest.raises(ValueError, match="no 'Address' header"):
        _tool().load(str(f))
