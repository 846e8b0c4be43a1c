"""Processes that see several GPUs (skipped with a reason on one-GPU hosts): convenience replays
keyed by device with the device's context made current at launch, prepared objects launched from
another current device, and the tensor-parallel example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _need_two():
    from gqadrv.runtime.driver import device_count

    if device_count() < 2:
        pytest.skip("needs two GPUs (one visible)")


def test_convenience_replays_on_every_device():
    _need_two()
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import api

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 16, 128)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 4, 900, 128)).astype(np.float16)
    api._layouts.clear()
    for dev in (1, 0):
        with cp.cuda.Device(dev):
            dq, dkv = cp.asarray(q), cp.asarray(kv)
            dl = cp.asarray(np.array([900, 13], np.int32))
            n0 = len(api._layouts)
            for lens in ([900, 13], [1, 899], [0, 900]):
                dl.set(np.array(lens, np.int32))
                out = gqadrv.gqa_decode(dq, dkv, dl)
                assert out.device.id == dev
                check(cp.asnumpy(out).astype(np.float64), gqa_decode_reference(q, kv, np.array(lens)), "float16",
                      f"multi-GPU replay dev {dev}")
            assert len(api._layouts) == n0 + 1  # the first call built it, the others replayed


def test_layout_plans_follow_the_input_device():
    """Same layout, new tensors at every call, on device 1 while device 0 is current (and the
    reverse): the output lands on the inputs' device and is right; one layout entry per device.
    Inputs on two devices are refused before any launch."""
    _need_two()
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import api
    from gqadrv.runtime.module import LaunchPlan

    rng = np.random.default_rng(5)
    api._layouts.clear()
    for dev, other in ((1, 0), (0, 1)):
        for i in range(4):
            q = rng.standard_normal((2, 16, 128)).astype(np.float16)
            kv = rng.standard_normal((2, 2, 4, 1500, 128)).astype(np.float16)
            lens = np.array([1500 - 100 * i, 7 + i], np.int32)
            with cp.cuda.Device(dev):
                dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
                cp.cuda.Device(dev).synchronize()
            with cp.cuda.Device(other):
                out = gqadrv.gqa_decode(dq, dkv, dl)
            assert out.device.id == dev
            with cp.cuda.Device(dev):
                check(cp.asnumpy(out).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16",
                      f"layout plan dev {dev} from {other}")
    assert len(api._layouts) == 2
    with cp.cuda.Device(0):
        dq = cp.zeros((2, 16, 128), cp.float16)
        dl = cp.full(2, 5, cp.int32)
    with cp.cuda.Device(1):
        dkv = cp.zeros((2, 2, 4, 1500, 128), cp.float16)
    calls = []
    orig = LaunchPlan.launch
    LaunchPlan.launch = lambda self, stream=None: calls.append(1) or orig(self, stream)
    try:
        with pytest.raises(ValueError, match="share one device"):
            gqadrv.gqa_decode(dq, dkv, dl)
    finally:
        LaunchPlan.launch = orig
    assert calls == []


def test_prepared_launch_from_another_current_device():
    _need_two()
    import cupy as cp

    import gqadrv

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((1, 2, 8, 4096, 128)).astype(np.float16)
    lens = np.array([4000], np.int32)
    with cp.cuda.Device(1):
        dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
        o = cp.empty_like(dq)
        p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dl)
    with cp.cuda.Device(0):  # device 0 current: the launch must still go to device 1's context
        gqadrv.launch_prepared(p)
    with cp.cuda.Device(1):
        cp.cuda.Device().synchronize()
        check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, lens), "float16", "prepared dev 1")


def test_tensor_parallel_example_two_gpus(report):
    _need_two()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "tensor_parallel_decode.py"), "--gpus", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report("tensor_parallel_decode.py --gpus 2: " + " | ".join(r.stdout.strip().splitlines()[-3:]))
