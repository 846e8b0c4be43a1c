"""The absolute softmax scale ``sm_scale`` (issue #22 item 3) without a GPU: argument rules, the
effective scale the problem carries, the float32 the kernels receive, the oracle."""

import math
import struct

import numpy as np
import pytest

import gqadrv
from gqadrv.gqa import contract, plan
from gqadrv.gqa.args import SIG_PLAIN
from gqadrv.gqa.reference import gqa_decode_reference
from gqadrv.runtime.module import ArgPack
from tests.fakes import fake

B, HQ, HKV, C = 2, 16, 4, 100


def _problem(D=128, q_scale=1.0, sm_scale=None):
    return contract.validate(fake((B, HQ, D)), fake((B, 2, HKV, C, D)), fake((B,), np.int32), None, q_scale,
                             stream=None, sm_scale=sm_scale)


@pytest.mark.parametrize("q_scale", [None, 1.0, 1, np.float64(1.0), np.float32(1.0)])
def test_sm_scale_with_the_default_q_scale_is_accepted(q_scale):
    contract.check_scale_pair(q_scale, 0.1)


@pytest.mark.parametrize("q_scale", [2.0, 0.5, 3, np.float32(0.7), "1.0", True])
def test_both_scales_are_a_value_error(q_scale):
    with pytest.raises(ValueError, match="either q_scale .* or sm_scale .* not both"):
        contract.check_scale_pair(q_scale, 0.1)
    with pytest.raises(ValueError, match="not both"):
        _problem(q_scale=q_scale, sm_scale=0.1)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.1", True, 1e40, complex(1, 0)])
def test_invalid_sm_scale(bad):
    with pytest.raises(ValueError, match="sm_scale"):
        _problem(sm_scale=bad)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_effective_scales(D):
    p = _problem(D, sm_scale=0.03)
    assert p.sm_scale == 0.03 and p.q_scale == pytest.approx(0.03 * math.sqrt(D), rel=1e-15)
    p = _problem(D, q_scale=2.0)
    assert p.q_scale == 2.0 and p.sm_scale == 2.0 / math.sqrt(D)
    p = _problem(D)  # defaults: 1/sqrt(D)
    assert p.sm_scale == 1.0 / math.sqrt(D)
    assert plan.scale_log2(p) == 1.0 / math.sqrt(D) / math.log(2.0)


# Scales of the GPU bitwise test (tests/gqa/test_scale_gpu.py): sm_scale=s and q_scale=s*sqrt(D)
# must pack the same float32 into GqaArgs.scale_log2.
BITWISE_SCALES = [0.01, 0.0625, 0.08838834764831845, 0.1, 0.3, 1.0, 2.5]


def _packed_scale(problem, monkeypatch) -> bytes:
    monkeypatch.setattr(plan, "flags_for", lambda *a: 0)
    args = plan.args_fields(problem, 0, None, 0, 1, None, None)
    pack = ArgPack(SIG_PLAIN).pack(args)
    off, fmt = SIG_PLAIN.field_offsets["args.scale_log2"]
    return pack.bytes()[off:off + struct.calcsize(fmt)]


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("s", BITWISE_SCALES)
def test_both_spellings_pack_the_same_float32(D, s, monkeypatch):
    a = _packed_scale(_problem(D, sm_scale=s), monkeypatch)
    b = _packed_scale(_problem(D, q_scale=s * math.sqrt(D)), monkeypatch)
    assert a == b
    assert a == struct.pack("<f", s / math.log(2.0))  # the absolute scale, in the log2 domain
    other = _packed_scale(_problem(D, sm_scale=s * 1.5), monkeypatch)
    assert other != a  # the packed field really carries the scale


def test_packed_scale_differs_from_the_default(monkeypatch):
    assert _packed_scale(_problem(128, sm_scale=0.2), monkeypatch) != _packed_scale(_problem(128), monkeypatch)


def test_public_calls_refuse_both_scales_before_anything_else():
    """No GPU here: the scale conflict must be raised before the GPU is even looked for."""
    q, kv, lens = fake((B, HQ, 128)), fake((B, 2, HKV, C, 128)), fake((B,), np.int32)
    with pytest.raises(ValueError, match="not both"):
        gqadrv.gqa_decode(q, kv, lens, q_scale=2.0, sm_scale=0.1)
    with pytest.raises(ValueError, match="not both"):
        gqadrv.sm110_gqa_decode(q, kv, lens, q_scale=2.0, sm_scale=0.1)
    with pytest.raises(ValueError, match="not both"):
        gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=fake((B, HQ, 128)), sequence_lengths=lens, q_scale=2.0, sm_scale=0.1)
    with pytest.raises(ValueError, match="not both"):
        gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": fake((B, HQ, 128)), "sequence_lengths": lens,
                                   "q_scale": 2.0, "sm_scale": 0.1})
    with pytest.raises(ValueError, match="not both"):
        gqadrv.prepare_sm110_gqa_decode({"Q": q, "KV": kv, "O": fake((B, HQ, 128)), "sequence_lengths": lens,
                                         "q_scale": 2.0, "sm_scale": 0.1})
    # one scale only: past the scale rules (the machine has no GPU: NoGpuError, not a ValueError)
    for kw in ({"sm_scale": 0.1}, {"q_scale": 2.0}, {"q_scale": 1.0, "sm_scale": 0.1}):
        with pytest.raises(gqadrv.NoGpuError):
            gqadrv.gqa_decode(q, kv, lens, **kw)


def test_prepare_dict_accepts_sm_scale_and_rejects_unknown_keys():
    q, kv, lens = fake((B, HQ, 128)), fake((B, 2, HKV, C, 128)), fake((B,), np.int32)
    with pytest.raises(ValueError, match="unknown inputs keys"):
        gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": fake((B, HQ, 128)), "sequence_lengths": lens,
                                   "softmax_scale": 0.1})
    with pytest.raises(gqadrv.NoGpuError):
        gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": fake((B, HQ, 128)), "sequence_lengths": lens,
                                   "sm_scale": 0.1})


def test_reference_accepts_sm_scale():
    rng = np.random.default_rng(0)
    D = 128
    q = rng.standard_normal((2, 8, D)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 2, 50, D)).astype(np.float16)
    lens = np.array([50, 17])
    s = 0.07
    a = gqa_decode_reference(q, kv, lens, sm_scale=s)
    b = gqa_decode_reference(q, kv, lens, q_scale=s * math.sqrt(D))
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert not np.allclose(a, gqa_decode_reference(q, kv, lens))  # the scale matters
    np.testing.assert_allclose(gqa_decode_reference(q, kv, lens, sm_scale=1 / math.sqrt(D)),
                               gqa_decode_reference(q, kv, lens), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="not both"):
        gqa_decode_reference(q, kv, lens, q_scale=2.0, sm_scale=s)
