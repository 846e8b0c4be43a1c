"""Property-based fuzzing of the GQA contract (CPU, fake device arrays): for random shapes, dtypes,
devices, strides and scalars, validate() either accepts exactly the calls an independent statement
of the rules accepts, or raises TypeError/ValueError with a message."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gqadrv.gqa import contract
from tests.fakes import FakeCudaArray

DT = {"f16": np.float16, "f32": np.float32, "i32": np.int32, "i64": np.int64, "u8": np.uint8}


@st.composite
def calls(draw):
    B = draw(st.integers(0, 3))
    Hkv = draw(st.sampled_from([1, 2, 3, 4]))
    g = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 17]))
    Hq = Hkv * g + draw(st.sampled_from([0, 0, 0, 1]))
    D = draw(st.sampled_from([64, 128, 256, 32, 96]))
    C = draw(st.sampled_from([0, 1, 5, 64, 65]))
    qdt = draw(st.sampled_from(["f16", "f16", "f32"]))
    kvdt = draw(st.sampled_from([qdt, qdt, "f32", "u8"]))
    ldt = draw(st.sampled_from(["i32", "i32", "i64"]))
    kv_shape = (B + draw(st.sampled_from([0, 0, 1])), draw(st.sampled_from([2, 2, 1])), Hkv, C,
                D + draw(st.sampled_from([0, 0, 64])))
    lshape = draw(st.sampled_from([(B,), (B,), (B, 1), (B + 1,)]))
    out_kind = draw(st.sampled_from(["none", "good", "shape", "dtype"]))
    scale = draw(st.sampled_from([1.0, 0.5, 0.0, -1.0, math.nan, math.inf, "x", None]))
    dev = draw(st.sampled_from([0, 0, 0, 1]))
    return dict(B=B, Hq=Hq, Hkv=Hkv, D=D, C=C, qdt=qdt, kvdt=kvdt, ldt=ldt, kv_shape=kv_shape,
                lshape=lshape, out=out_kind, scale=scale, dev=dev)


def expected_ok(c) -> bool:
    B, Hq, Hkv, D = c["B"], c["Hq"], c["Hkv"], c["D"]
    if B <= 0 or Hq <= 0 or c["qdt"] != "f16":
        return False
    kb, two, kh, C, kd = c["kv_shape"]
    if kb != B or two != 2 or kh <= 0 or C <= 0 or kd != D or c["kvdt"] != "f16" or c["dev"] != 0:
        return False
    if Hq % Hkv or not 1 <= Hq // Hkv <= 16 or D not in (64, 128, 256):
        return False
    if c["ldt"] != "i32" or c["lshape"] != (B,):
        return False
    if c["out"] in ("shape", "dtype"):
        return False
    s = c["scale"]
    return isinstance(s, float) and math.isfinite(s) and s > 0


@settings(max_examples=400, deadline=None)
@given(calls())
def test_contract_matches_the_rules(c):
    q = FakeCudaArray(np.zeros((c["B"], c["Hq"], c["D"]), DT[c["qdt"]]))
    kv = FakeCudaArray(np.zeros(c["kv_shape"], DT[c["kvdt"]]), device=c["dev"])
    lens = FakeCudaArray(np.zeros(c["lshape"], DT[c["ldt"]]))
    out = None
    if c["out"] == "good":
        out = FakeCudaArray(np.zeros((c["B"], c["Hq"], c["D"]), np.float16))
    elif c["out"] == "shape":
        out = FakeCudaArray(np.zeros((c["B"], c["Hq"], c["D"] + 64), np.float16))
    elif c["out"] == "dtype":
        out = FakeCudaArray(np.zeros((c["B"], c["Hq"], c["D"]), np.float32))
    try:
        p = contract.validate(q, kv, lens, out, c["scale"], stream=None)
    except (TypeError, ValueError) as exc:
        assert str(exc), "errors must carry a message"
        assert not expected_ok(c), f"rejected a valid call: {exc}"
        return
    assert expected_ok(c), f"accepted an invalid call {c}"
    assert p.group * p.num_kv_heads == p.num_q_heads and p.capacity == c["C"]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(-5, 80), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)))
def test_num_splits_rule_is_total(v):
    ok = v is None or (type(v) is int and 1 <= v <= 64)
    try:
        r = contract.check_num_splits(v)
    except ValueError:
        assert not ok
        return
    assert ok and r == v
