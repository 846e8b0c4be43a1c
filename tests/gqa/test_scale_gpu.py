"""The absolute softmax scale on the GPU (issue #22 item 3): ``sm_scale=s`` gives bit for bit the
output of ``q_scale=s*sqrt(D)`` (both pack the same float32, tests/gqa/test_scale_host.py) and
matches the float64 oracle, through the convenience call (default and portable routes, TMA with
splits) and the prepared path; both scales at once never launch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check, to_device, to_host
from tests.gqa.test_scale_host import BITWISE_SCALES

pytestmark = pytest.mark.gpu

# (B, Hq, Hkv, C, D): short route, TMA with splits, one of each head dim
SHAPES = [(2, 32, 8, 64, 128), (1, 32, 8, 3000, 128), (2, 16, 4, 700, 64), (1, 16, 2, 1500, 256)]


def _inputs(shape, dtype, seed):
    B, Hq, Hkv, C, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    kv = rng.standard_normal((B, 2, Hkv, C, D)).astype(np.float32)
    lens = np.array([C - 5 * b for b in range(B)], np.int32)
    if dtype == "bfloat16":
        import ml_dtypes

        qh, kvh = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
    else:
        qh, kvh = q.astype(np.float16), kv.astype(np.float16)
    return (qh.astype(np.float64), kvh.astype(np.float64), lens), (to_device(qh), to_device(kvh), to_device(lens))


def _bits(x):
    return to_host(x).view(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Hq{}_Hkv{}_C{}_D{}".format(*s))
@pytest.mark.parametrize("backend", [None, "portable"])
def test_sm_scale_equals_q_scale_bitwise_and_matches_the_oracle(shape, dtype, backend):
    import gqadrv

    D = shape[4]
    (q, kv, lens), (dq, dkv, dl) = _inputs(shape, dtype, seed=sum(shape))
    for s in (BITWISE_SCALES[1], BITWISE_SCALES[3], BITWISE_SCALES[5]):
        a = gqadrv.gqa_decode(dq, dkv, dl, sm_scale=s, backend=backend)
        b = gqadrv.gqa_decode(dq, dkv, dl, q_scale=s * math.sqrt(D), backend=backend)
        c = gqadrv.gqa_decode(dq, dkv, dl, q_scale=1.0, sm_scale=s, backend=backend)
        assert np.array_equal(_bits(a), _bits(b)), f"sm_scale={s} vs q_scale={s * math.sqrt(D)}"
        assert np.array_equal(_bits(a), _bits(c))
        ref = gqa_decode_reference(q, kv, lens, sm_scale=s)
        check(to_host(a).astype(np.float64), ref, dtype, f"sm_scale {backend or 'auto'}")
    # the scale really reaches the kernel: a different sm_scale changes the output
    other = gqadrv.gqa_decode(dq, dkv, dl, sm_scale=0.5, backend=backend)
    assert not np.array_equal(_bits(other), _bits(a))


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_prepared_sm_scale(num_splits):
    import cupy as cp

    import gqadrv

    shape = (1, 32, 8, 3000, 128)
    (q, kv, lens), (dq, dkv, dl) = _inputs(shape, "float16", seed=4)
    s = 0.0625
    o1, o2 = cp.empty_like(dq), cp.empty_like(dq)
    p1 = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o1, sequence_lengths=dl, sm_scale=s, num_splits=num_splits)
    p2 = gqadrv.prepare_gqa_decode({"Q": dq, "KV": dkv, "O": o2, "sequence_lengths": dl, "q_scale": s * math.sqrt(128)},
                                   num_splits=num_splits)
    gqadrv.launch_prepared(p1)
    gqadrv.launch_prepared(p2)
    assert np.array_equal(_bits(o1), _bits(o2))
    check(to_host(o1).astype(np.float64), gqa_decode_reference(q, kv, lens, sm_scale=s), "float16", "prepared sm_scale")
    o3 = cp.empty_like(dq)
    p3 = gqadrv.prepare_gqa_decode({"Q": dq, "KV": dkv, "O": o3, "sequence_lengths": dl, "sm_scale": s},
                                   num_splits=num_splits)
    gqadrv.launch_prepared(p3)
    assert np.array_equal(_bits(o1), _bits(o3))


def test_both_scales_never_launch(monkeypatch):
    import cupy as cp

    import gqadrv
    from gqadrv.runtime.module import LaunchPlan

    _, (dq, dkv, dl) = _inputs((1, 32, 8, 500, 128), "float16", seed=1)
    gqadrv.gqa_decode(dq, dkv, dl, sm_scale=0.1)  # a known layout
    calls = []
    orig = LaunchPlan.launch
    monkeypatch.setattr(LaunchPlan, "launch", lambda self, stream=None: calls.append(1) or orig(self, stream))
    with pytest.raises(ValueError, match="not both"):
        gqadrv.gqa_decode(dq, dkv, dl, q_scale=2.0, sm_scale=0.1)
    with pytest.raises(ValueError, match="not both"):
        gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=cp.empty_like(dq), sequence_lengths=dl, q_scale=2.0, sm_scale=0.1)
    assert calls == []
