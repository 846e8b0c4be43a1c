"""The MLA trace builds (GQADRV_MLA_TRACE=1, tools/mla_trace.py) on the CPU: the switch reaches the
defines, trace builds of the kernels that carry stamps compile without spills and read %globaltimer,
and default builds carry no stamp at all."""

from __future__ import annotations

import pytest

from gqadrv.mla import kernel_spec, routes

TRACED = ("narrow16_bal", "seesaw_bal")


def _variant(name):
    return next(v for v in routes.variants_for_arch("sm_90a") if v.name == f"mla_decode_{name}_bfloat16")


def test_switch_reaches_the_defines(monkeypatch):
    monkeypatch.delenv("GQADRV_MLA_TRACE", raising=False)
    assert "MLA_TRACE" not in kernel_spec.defines("bfloat16", "narrow16_bal")
    monkeypatch.setenv("GQADRV_MLA_TRACE", "1")
    assert kernel_spec.defines("bfloat16", "narrow16_bal")["MLA_TRACE"] == 1


@pytest.mark.parametrize("name", TRACED)
def test_trace_builds_stamp_and_default_builds_do_not(name, monkeypatch, isolated_cache):
    from gqadrv.runtime.compiler import compile_module

    v = _variant(name)
    monkeypatch.delenv("GQADRV_MLA_TRACE", raising=False)
    plain = compile_module(v.family.source, "sm_90a", v.defines, cache=isolated_cache)
    assert "globaltimer" not in plain.ptx.decode()
    traced_defines = dict(v.defines, MLA_TRACE=1)
    traced = compile_module(v.family.source, "sm_90a", traced_defines, cache=isolated_cache)
    r = traced.resources[v.family.entry]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    assert traced.ptx.decode().count("%globaltimer") >= 8  # entry, scan, items, merges, producer stamps
    assert "%smid" in traced.ptx.decode() and "%smid" not in plain.ptx.decode()


def _trace_tool():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mla_trace_tool", Path(__file__).resolve().parents[2] / "tools" / "mla_trace.py")
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    return mt


def test_sm_report_tells_sm_bound_speed_from_launch_noise():
    """tools/mla_trace.py's per-SM correlation: near 1 when each SM keeps its speed across launches
    (CTAs placed on other SMs each time), near 0 when speeds are drawn anew per launch."""
    import numpy as np

    mt = _trace_tool()
    rng = np.random.default_rng(0)
    sm_speed = rng.uniform(150.0, 200.0, 132)

    def runs(bound):
        out = []
        for _ in range(3):
            st = np.zeros((132, 16), np.int64)
            st[:, 0] = 1_000_000 + rng.integers(0, 100, 132)
            st[:, 2] = st[:, 0] + 10_000
            sm = rng.permutation(132)
            t = sm_speed[sm] if bound else rng.uniform(150.0, 200.0, 132)
            st[:, 3] = st[:, 2] + (t * 1000).astype(np.int64)
            st[:, mt.SM_SLOT] = sm
            out.append((200.0, st))
        return out

    corr = lambda lines: [float(x.split("correlation ")[1].split()[0]) for x in lines if "correlation" in x]
    assert all(c > 0.99 for c in corr(mt._sm_report(runs(True))))
    assert all(abs(c) < 0.3 for c in corr(mt._sm_report(runs(False))))


def test_end_report_and_from_json(tmp_path, capsys):
    """The uneven-ends lines: 4 CTAs ending at 100, 110, 120, 130 us after the first entry (mean idle
    15 us); at a ceiling whose byte time plus the first K load is 120 us the recoverable time is
    min(15, 130 - 120) = 10 us. `--from-json` prints the same report from the saved stamps."""
    import json

    import numpy as np

    mt = _trace_tool()
    st = np.zeros((5, 16), np.int64)
    t0 = 1_000_000_000
    st[:, 0] = t0
    st[:4, 2] = t0 + 5_000
    st[:4, 13] = t0 + 2_000
    for i, e in enumerate((100, 110, 120, 130)):
        st[i, 3] = t0 + (e - 1) * 1000
        st[i, 4] = t0 + e * 1000
    st[4, [1, 11, 12]] = t0 + 1_000  # the fifth CTA got no work: entry, scan, items / merges done at once
    row = "1,1,16,1000"  # 1000 tokens x 1152 B = 1.152 MB
    ceiling = 1.152 / 118.0  # TB/s: 118 us for the bytes, + 2 us first K load = 120 us
    lines = mt._end_report([(140.0, st)], row, ceiling)
    assert "last CTA end 130.0 us, mean CTA idle before it 15.0 us" in lines[0]
    assert "= 120.0 us" in lines[1] and "recovers at most 10.0 us" in lines[1], lines
    text = mt.report(row, "narrow16_bal", "mla_decode_narrow16_bal_bfloat16", [5, 1, 1], [(140.0, st)], ceiling)
    assert lines[1] in text
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"row": row, "backend": "narrow16_bal", "route": "mla_decode_narrow16_bal_bfloat16",
                                 "grid": [5, 1, 1], "launches": [{"event_us": 140.0, "stamps": st.tolist()}]}]))
    assert mt.main(["--from-json", str(path), "--ceiling-tbps", str(ceiling)]) == 0
    assert capsys.readouterr().out.strip() == text
