"""GPU regression tests for defects found on the H200 when gqadrv was tried as a new user would
(issue: one op layer). Each failed before the fix:

* a per-launch stream override of ``launch_prepared`` stuck to the prepared object;
* a torch ``sequence_lengths`` (written on a torch stream) passed with CuPy q/kv was read before its
  producer finished: only q's framework was ordered;
* the convenience replay cache depended on call order (the first call's key differed) and was off
  in processes that see several GPUs.

Ordering is made deterministic with a spin kernel that holds a stream for tens of milliseconds:
a launch that is not ordered behind it runs at once on stale device data.
"""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_reference
from tests.gqa.cases import check

pytestmark = pytest.mark.gpu

_SPIN = r"""
extern "C" __global__ void spin(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def _spin(stream, ms: float = 50.0) -> None:
    """Hold ``stream`` busy for ``ms`` milliseconds (one thread, globaltimer loop)."""
    import cupy as cp

    k = cp.RawKernel(_SPIN, "spin")
    with stream:
        k((1,), (1,), (np.int64(ms * 1e6),))


def _inputs(seed=0, B=2, C=1500):
    import cupy as cp

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((B, 2, 8, C, 128)).astype(np.float16)
    return q, kv, cp.asarray(q), cp.asarray(kv)


def test_stream_override_does_not_stick():
    """After launch_prepared(p, stream=s1), launch_prepared(p) goes to the prepare-time stream s0
    again: it must wait for s0's producer (lengths written behind a spin kernel)."""
    import cupy as cp

    import gqadrv

    q, kv, dq, dkv = _inputs(1)
    s0, s1 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    old, new = np.array([1500, 1500], np.int32), np.array([3, 700], np.int32)
    with s0:
        dl = cp.asarray(old)
        o = cp.full(dq.shape, np.nan, dq.dtype)
    p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=dl, stream=s0)
    assert p.stream == s0.ptr
    gqadrv.launch_prepared(p, stream=s1)
    s1.synchronize()
    check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, old), "float16", "override launch")
    assert p.stream == s0.ptr and p.plans[0].stream == s0.ptr
    with s0:
        d_new = cp.asarray(new)
    s0.synchronize()
    _spin(s0)                      # s0 busy ...
    with s0:
        dl[...] = d_new            # ... then a device-side producer writes the new lengths on s0
    # (a host -> device copy from pageable memory would block the host until s0 is idle, which
    # orders everything and hides the defect)
    gqadrv.launch_prepared(p)      # must be ordered on s0, behind the producer
    s0.synchronize()
    check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, new), "float16", "prepare-time stream")


@pytest.mark.parametrize("path", ["convenience", "prepared"])
def test_mixed_framework_inputs_are_each_ordered(path):
    """CuPy q/kv with torch lengths written on a torch stream (behind ~50 ms of work): the torch
    producer is ordered before the launch too, not only q's framework."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    import gqadrv

    q, kv, dq, dkv = _inputs(2)
    new = np.array([9, 1100], np.int32)
    ts = torch.cuda.Stream()
    tl = torch.full((2,), 1500, dtype=torch.int32, device="cuda")
    o = cp.empty_like(dq)
    t_new = torch.from_numpy(new).to("cuda")   # device data before the producer runs (a pageable host
    torch.cuda.synchronize()                   # copy inside the producer would block the host instead)
    with torch.cuda.stream(ts):
        torch.cuda._sleep(int(100e6))
        tl.copy_(t_new)
        if path == "convenience":
            gqadrv.gqa_decode(dq, dkv, tl, out=o)           # launch stream: CuPy's current one
        else:
            p = gqadrv.prepare_gqa_decode(Q=dq, KV=dkv, O=o, sequence_lengths=tl)
    if path == "prepared":
        gqadrv.launch_prepared(p)
    cp.cuda.get_current_stream().synchronize()
    check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q, kv, new), "float16", f"torch lengths {path}")
    torch.cuda.synchronize()


def test_first_convenience_call_is_replayed(tmp_path):
    """In a fresh process (no call before it), the second identical call is a replay: one entry."""
    import subprocess
    import sys

    code = (
        "import cupy as cp, numpy as np, gqadrv\n"
        "from gqadrv.gqa import api\n"
        "q = cp.zeros((1, 32, 128), cp.float16); kv = cp.zeros((1, 2, 8, 300, 128), cp.float16)\n"
        "l = cp.full(1, 300, cp.int32)\n"
        "for _ in range(3): gqadrv.gqa_decode(q, kv, l)\n"
        "print('entries', len(api._layouts))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "entries 1" in r.stdout, r.stdout
