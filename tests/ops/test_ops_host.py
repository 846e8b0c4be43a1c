"""CPU tests of the op layer (gqadrv/ops) and of the floors between packages."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from gqadrv.ops import contract as oc
from gqadrv.ops import oracle
from gqadrv.ops.bounded import BoundedMap
from gqadrv.runtime.module import TMAP, ArgPack, NamedStruct, Signature

PKG = pathlib.Path(__file__).resolve().parents[2] / "gqadrv"


# ----------------------------------------------------------------------------- floors
def _imports(path: pathlib.Path) -> set[str]:
    """gqadrv-internal modules a file imports (relative imports resolved)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    pkg = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("gqadrv"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gqadrv"))
    return out


# torch / jax: the framework integrations (gqadrv.torch, gqadrv.jax) sit beside the cli, above the families.
FLOOR = {"runtime": 0, "_version": 0, "types": 0, "ops": 1, "gqa": 2, "mla": 2, "merge": 2, "cli": 3, "torch": 3,
         "jax": 3, "__main__": 4}


def _floor(mod: str) -> int | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None  # the package itself (re-exports)
    return FLOOR.get(parts[1])


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_each_module_imports_only_lower_floors(path):
    rel = path.relative_to(PKG)
    if rel.name == "__init__.py" and len(rel.parts) == 1:
        return  # gqadrv/__init__.py re-exports the families
    own = FLOOR[rel.parts[0].removesuffix(".py")]
    for mod in _imports(path):
        f = _floor(mod)
        if f is None:
            continue
        assert f <= own, f"{rel} (floor {own}) imports {mod} (floor {f})"
        if own == 2 and f == 2:  # op families never import each other's internals
            assert mod.split(".")[1] == rel.parts[0], f"{rel} imports another family: {mod}"


def test_nobody_imports_the_cli():
    for path in PKG.rglob("*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        assert not any(m.startswith("gqadrv.cli") for m in _imports(path)), path


# ----------------------------------------------------------------------------- bounded map
def test_bounded_map_evicts_oldest_and_builds_once():
    m = BoundedMap(3)
    for i in range(5):
        m.put(i, i * 10)
    assert len(m) == 3 and 0 not in m and 1 not in m and m.get(4) == 40
    calls = []
    assert m.get_or_create("k", lambda: calls.append(1) or "v") == "v"
    assert m.get_or_create("k", lambda: calls.append(1) or "w") == "v" and calls == [1]


# ----------------------------------------------------------------------------- named structs
def test_named_struct_layout_follows_c_rules():
    s = NamedStruct("S", ("a", "i"), ("p", "Q"), ("f", "f"))
    assert [(n, o) for n, o, _ in s.fields] == [("a", 0), ("p", 8), ("f", 16)]
    assert s.size == 24 and s.align == 8


def test_arg_pack_by_name_and_field_patch():
    s = NamedStruct("S", ("q", "Q"), ("out", "Q"), ("scale", "f"), ("n", "i"))
    sig = Signature(("map", TMAP), ("args", s))
    pack = ArgPack(sig).pack(bytes(range(128)), {"q": 1, "out": 2, "scale": 0.5, "n": 7})
    assert pack.get_field("args.out") == 2 and pack.get_field("args.n") == 7
    pack.set_field("args.out", 0xDEAD0000)
    assert pack.get_field("args.out") == 0xDEAD0000 and pack.get_field("args.q") == 1
    assert pack.bytes()[:128] == bytes(range(128))  # the tensor map is untouched
    with pytest.raises(KeyError, match="no struct field 'args.missing'"):
        pack.set_field("args.missing", 1)
    with pytest.raises(ValueError, match="missing fields"):
        ArgPack(sig).pack(bytes(128), {"q": 1})


# ----------------------------------------------------------------------------- contract helpers
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", None, True, 1e300, 1j])
def test_positive_scale_rejects_with_value_error(bad):
    with pytest.raises(ValueError, match="q_scale"):
        oc.check_positive_scale("q_scale", bad)


def test_choice_names_the_argument():
    assert oc.check_choice("backend", " Hopper ", ("auto", "hopper")) == "hopper"
    with pytest.raises(TypeError, match="backend must be None or one of"):
        oc.check_choice("backend", 123, ("auto", "hopper"))
    with pytest.raises(ValueError, match="backend must be one of"):
        oc.check_choice("backend", "cuda", ("auto", "hopper"))


# ----------------------------------------------------------------------------- prepared objects
def test_launch_prepared_rejects_other_objects():
    import gqadrv

    for bad in (None, object(), {"Q": 1}):
        with pytest.raises(TypeError, match="launch_prepared expects an object returned by a prepare_"):
            gqadrv.launch_prepared(bad)
    with pytest.raises(TypeError, match="check_status expects a prepared object"):
        gqadrv.check_status(None)


def test_launch_prepared_switches_context_only_in_multi_gpu_processes(monkeypatch):
    """Several GPUs: the prepared device's context is made current around the launches (enter_device /
    leave_device through runtime.module.launch_plans, the per-launch form the layout plans share) and
    restored even when a launch raises; one GPU: no context call at all. The stream reaches every plan."""
    from gqadrv.ops import prepared as P
    from gqadrv.runtime import driver as D

    calls = []

    class Plan:
        def __init__(self, fail=False):
            self.fail = fail

        def launch(self, h=None):
            calls.append(("launch", h))
            if self.fail:
                raise RuntimeError("launch failed")

    def make(*plans):
        return P.Prepared(device=1, _plans=plans, _out="out", _keep=(), _status=None, _status_names=())

    monkeypatch.setattr(D, "enter_device", lambda dev: calls.append(("enter", dev)) or "prev-ctx")
    monkeypatch.setattr(D, "leave_device", lambda prev: calls.append(("leave", prev)))
    monkeypatch.setattr(D, "device_scope", lambda dev: pytest.fail("device_scope on the per-launch path"))
    monkeypatch.setattr(D, "multi_device", lambda: True)
    assert P.launch_prepared(make(Plan(), Plan()), 1234) == "out"
    assert calls == [("enter", 1), ("launch", 1234), ("launch", 1234), ("leave", "prev-ctx")]
    calls.clear()
    with pytest.raises(RuntimeError, match="launch failed"):
        P.launch_prepared(make(Plan(fail=True), Plan()))
    assert calls == [("enter", 1), ("launch", None), ("leave", "prev-ctx")]
    calls.clear()
    monkeypatch.setattr(D, "multi_device", lambda: False)
    assert P.launch_prepared(make(Plan()), None) == "out"
    assert calls == [("launch", None)]


# ----------------------------------------------------------------------------- oracle helpers
def test_masked_softmax_lse_and_empty_rows():
    s = np.array([[1.0, 2.0, 3.0], [5.0, np.nan, 1.0]])
    valid = np.array([[True, True, False], [False, False, False]])
    p, lse = oracle.masked_softmax_lse(s, valid)
    np.testing.assert_allclose(p[0], [np.exp(1) / (np.exp(1) + np.exp(2)), np.exp(2) / (np.exp(1) + np.exp(2)), 0])
    np.testing.assert_allclose(lse[0], np.log(np.exp(1) + np.exp(2)))
    assert np.all(p[1] == 0) and lse[1] == np.inf


def test_merge_states_equals_attention_over_the_union():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((4, 10))
    v = rng.standard_normal((4, 10, 8))
    full, lse = oracle.attend(s, np.ones_like(s, bool), v)
    parts = [oracle.attend(s[:, a:b], np.ones((4, b - a), bool), v[:, a:b]) for a, b in ((0, 3), (3, 3), (3, 10))]
    m, ml = oracle.merge_states([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(m, full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ml, lse, rtol=1e-12)
    e, el = oracle.merge_states([parts[1][0]], [parts[1][1]])  # all empty
    assert np.all(e == 0) and np.all(el == np.inf)


# ----------------------------------------------------------------------------- declared features
def test_dispatcher_names_missing_features():
    from gqadrv.ops.registry import FeatureError, KernelFamily, require_features
    from gqadrv.runtime.module import Signature

    fam = KernelFamily("toy", "toy.cu", "toy", ("sm_90a",), Signature(), frozenset({"dense_kv", "bf16"}))
    require_features(fam, {"bf16"})
    with pytest.raises(FeatureError, match=r"toy.*does not support causal, paged_kv .*supports: bf16, dense_kv"):
        require_features(fam, {"bf16", "paged_kv", "causal"})


def test_mla_problems_need_only_declared_features():
    import dataclasses

    from gqadrv.mla import plan, routes

    @dataclasses.dataclass
    class P:
        dtype: str
        causal: bool
        s_q: int
        kv_fp8: bool = False

    for fam in routes.FAMILIES.values():
        probs = (P("bfloat16", False, 1, True), P("bfloat16", True, 4, True)) if fam.fp8 else (
            P("float16", False, 1), P("bfloat16", True, 4))
        for p in probs:
            assert plan.features_of(p) <= fam.features, (fam.name, plan.features_of(p))
        if not fam.fp8:
            assert "fp8_kv" not in fam.features
    assert "multi_token" in plan.features_of(P("bfloat16", True, 2))
    assert "fp8_kv" in plan.features_of(P("bfloat16", False, 1, True))
