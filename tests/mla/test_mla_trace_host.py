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
