"""GQA decode on the GPU against the float64 oracle: the grid (>= 200 cases) through the convenience
call, the forced-portable route, and the prepared path for every num_splits; NaN/Inf padding,
out-of-range device lengths, interop (CuPy, torch, JAX), non-default streams, seed aliases."""

import functools
import os

import numpy as np
import pytest

from tests.gqa.cases import check, grid, host_inputs, to_device, to_host

pytestmark = pytest.mark.gpu

SPLITS = [None, 1, 2, 3, 8, 10, 16, 64]


def _items():
    items = []
    for c in grid():
        items.append((c.idx, "auto"))
        items.append((c.idx, "portable"))
        for ns in SPLITS:  # the whole grid through the prepared path, for every num_splits
            if c.capacity <= 64 and ns not in (None, 1):
                continue  # the short route cannot split (test_short_route_cannot_split)
            items.append((c.idx, f"prepared-{ns}"))
        items.append((c.idx, "prepared-portable-None"))
        if c.capacity > 64:
            items.append((c.idx, "prepared-portable-3"))
    return items


ITEMS = _items()


@functools.lru_cache(maxsize=1)
def device_case(idx):
    case = grid()[idx]
    q, kv, lens, ref = host_inputs(case)
    return case, to_device(q), to_device(kv), to_device(lens), ref


def nan_filled_like(x):
    import cupy as cp

    o = cp.empty_like(x)
    o.view(cp.uint16).fill(0xFFFF)  # NaN in fp16 and bf16: every element must be written
    return o


def test_grid_is_large_enough():
    assert len(grid()) >= 200
    assert {c.capacity for c in grid()} >= {1, 2, 63, 64, 65, 127, 128, 1000, 4096, 8192}
    assert any(c.poison == "nan" for c in grid()) and any(c.poison == "inf" for c in grid())
    assert any(min(c.lengths) <= 0 for c in grid()) and any(max(c.lengths) > c.capacity for c in grid())


@pytest.mark.parametrize("idx,mode", ITEMS, ids=[f"{grid()[i].id}-{m}" for i, m in ITEMS])
def test_oracle(idx, mode):
    import cupy as cp

    import gqadrv

    case, q, kv, lens, ref = device_case(idx)
    if mode in ("auto", "portable"):
        out = gqadrv.gqa_decode(q, kv, lens, q_scale=case.q_scale, backend=None if mode == "auto" else "portable")
        assert isinstance(out, cp.ndarray) and out.shape == q.shape and out.dtype == q.dtype
        check(to_host(out).astype(np.float64), ref, case.dtype, f"gqa_decode {mode}")
        return
    parts = mode.split("-")
    backend = "portable" if parts[1] == "portable" else None
    ns = None if parts[-1] == "None" else int(parts[-1])
    o = nan_filled_like(q)
    p = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens, "q_scale": case.q_scale},
                                  num_splits=ns, backend=backend)
    if ns is not None:
        assert p.num_splits == ns
    for rep in range(2):  # the second launch proves the split counters were reset by the first
        assert gqadrv.launch_prepared(p) is o
        check(to_host(o).astype(np.float64), ref, case.dtype, f"prepared {'portable' if backend else 'auto'}")


def test_out_argument_is_the_returned_object_and_fully_written():
    import gqadrv

    case, q, kv, lens, ref = device_case(next(c.idx for c in grid() if c.capacity == 1000))
    o = nan_filled_like(q)
    assert gqadrv.gqa_decode(q, kv, lens, out=o, q_scale=case.q_scale) is o
    check(to_host(o).astype(np.float64), ref, case.dtype, "gqa_decode out=")


@pytest.mark.parametrize("C", [64, 300, 5000])
def test_empty_and_out_of_range_lengths_with_poisoned_cache(C):
    """len <= 0 gives zeros, len > C is clamped, NaN/Inf anywhere outside [0, len) never leaks."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa.reference import gqa_decode_reference

    rng = np.random.default_rng(C)
    B = 6
    q = rng.standard_normal((B, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((B, 2, 8, C, 128)).astype(np.float16)
    lens = np.array([0, -7, C + 1, 2**31 - 1, 5, C], np.int32)
    for b, n in enumerate(lens):
        kv[b, :, :, max(0, min(int(n), C)):] = np.nan
    ref = gqa_decode_reference(q, kv, lens)
    for backend in (None, "portable"):
        out = gqadrv.gqa_decode(cp.asarray(q), cp.asarray(kv), cp.asarray(lens), backend=backend)
        got = cp.asnumpy(out).astype(np.float64)
        assert np.all(got[:2] == 0)
        check(got, ref, "float16", "out-of-range lengths")
        if C > 64:
            o = nan_filled_like(cp.asarray(q))
            p = gqadrv.prepare_gqa_decode(Q=cp.asarray(q), KV=cp.asarray(kv), O=o, sequence_lengths=cp.asarray(lens),
                                          num_splits=7, backend=backend)
            gqadrv.launch_prepared(p)
            check(cp.asnumpy(o).astype(np.float64), ref, "float16", "out-of-range lengths prepared")
            st = gqadrv.check_status(p)
            assert st == {"empty": [0, 1], "clamped": [2, 3]}


def test_convenience_replays_follow_device_data_and_every_key_part(monkeypatch):
    """Repeated CuPy calls reuse their validated launch (gqa/api.py: replays); lengths and values
    are device data read at every launch, and any change of q_scale, out, stream or tuning
    environment is a different key."""
    import cupy as cp

    import gqadrv
    from gqadrv.gqa import api
    from gqadrv.gqa.reference import gqa_decode_reference

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 16, 128)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 4, 2000, 128)).astype(np.float16)
    dq, dkv = cp.asarray(q), cp.asarray(kv)
    dlen = cp.asarray(np.array([2000, 700], np.int32))
    api._layouts.clear()  # entries are per layout: an earlier test may have left this one
    n0 = len(api._layouts)
    first = gqadrv.gqa_decode(dq, dkv, dlen)
    assert len(api._layouts) == n0 + 1
    for lens in ([2000, 700], [5, 1999], [0, 2000], [2001, 1]):
        dlen.set(np.array(lens, np.int32))
        got = gqadrv.gqa_decode(dq, dkv, dlen)
        assert got is not first and got.data.ptr != dq.data.ptr
        check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q, kv, np.array(lens)), "float16", f"replay {lens}")
    assert len(api._layouts) == n0 + 1  # all of them replays
    dq[0, 0, :] = 0  # values are device data too
    q2 = q.copy()
    q2[0, 0, :] = 0
    lens = np.array([2001, 1], np.int32)
    check(cp.asnumpy(gqadrv.gqa_decode(dq, dkv, dlen)).astype(np.float64), gqa_decode_reference(q2, kv, lens),
          "float16", "replay after a value change")
    o = cp.full(dq.shape, np.nan, dq.dtype)
    assert gqadrv.gqa_decode(dq, dkv, dlen, out=o) is o
    assert gqadrv.gqa_decode(dq, dkv, dlen, out=o) is o
    check(cp.asnumpy(o).astype(np.float64), gqa_decode_reference(q2, kv, lens), "float16", "replay out=")
    check(cp.asnumpy(gqadrv.gqa_decode(dq, dkv, dlen, q_scale=0.5)).astype(np.float64),
          gqa_decode_reference(q2, kv, lens, 0.5), "float16", "replay q_scale")
    s = cp.cuda.Stream(non_blocking=True)
    for _ in range(2):
        got = gqadrv.gqa_decode(dq, dkv, dlen, stream=s)
    s.synchronize()
    check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q2, kv, lens), "float16", "replay stream=")
    monkeypatch.setenv("GQADRV_BACKEND", "portable")
    n1 = len(api._layouts)
    for _ in range(2):
        got = gqadrv.gqa_decode(dq, dkv, dlen)
    assert len(api._layouts) == n1 + 1
    check(cp.asnumpy(got).astype(np.float64), gqa_decode_reference(q2, kv, lens), "float16", "replay portable")
    with pytest.raises(ValueError, match="q_scale"):  # an invalid call never becomes a replay
        gqadrv.gqa_decode(dq, dkv, dlen, q_scale=-1.0)
    with pytest.raises(ValueError, match="q_scale"):
        gqadrv.gqa_decode(dq, dkv, dlen, q_scale=-1.0)


def test_short_route_cannot_split():
    import cupy as cp

    import gqadrv

    q = cp.zeros((1, 32, 128), cp.float16)
    kv = cp.zeros((1, 2, 8, 64, 128), cp.float16)
    lens = cp.ones(1, cp.int32)
    with pytest.raises(ValueError, match="cannot split"):
        gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=cp.empty_like(q), sequence_lengths=lens, num_splits=2)
    assert gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=cp.empty_like(q), sequence_lengths=lens, num_splits=1).num_splits == 1


def _seed_case():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 32, 128)).astype(np.float16)
    kv = rng.standard_normal((2, 2, 8, 700, 128)).astype(np.float16)
    lens = np.array([700, 333], np.int32)
    from gqadrv.gqa.reference import gqa_decode_reference

    return q, kv, lens, gqa_decode_reference(q, kv, lens, 1.25)


def test_non_default_streams():
    import cupy as cp

    import gqadrv

    q, kv, lens, ref = _seed_case()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        dq, dkv, dl = cp.asarray(q), cp.asarray(kv), cp.asarray(lens)
    out = gqadrv.gqa_decode(dq, dkv, dl, q_scale=1.25, stream=s)
    s.synchronize()
    check(cp.asnumpy(out).astype(np.float64), ref, "float16", "stream object")
    out2 = gqadrv.gqa_decode(dq, dkv, dl, q_scale=1.25, stream=s.ptr)
    s.synchronize()
    check(cp.asnumpy(out2).astype(np.float64), ref, "float16", "stream int")
    with s:  # CuPy's current stream is the default
        out3 = gqadrv.gqa_decode(dq, dkv, dl, q_scale=1.25)
        s.synchronize()
    check(cp.asnumpy(out3).astype(np.float64), ref, "float16", "current CuPy stream")


def test_torch_interop():
    torch = pytest.importorskip("torch")
    import gqadrv

    q, kv, lens, ref = _seed_case()
    tq, tkv, tl = (torch.from_numpy(x).cuda() for x in (q, kv, lens))
    out = gqadrv.gqa_decode(tq, tkv, tl, q_scale=1.25)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float16 and out.shape == tq.shape
    check(out.cpu().numpy().astype(np.float64), ref, "float16", "torch in/out")
    o = torch.full_like(tq, float("nan"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        r = gqadrv.gqa_decode(tq, tkv, tl, out=o, q_scale=1.25)  # default: torch's current stream
    assert r is o
    torch.cuda.synchronize()
    check(o.cpu().numpy().astype(np.float64), ref, "float16", "torch out=")
    bq, bkv = tq.to(torch.bfloat16), tkv.to(torch.bfloat16)
    from gqadrv.gqa.reference import gqa_decode_reference

    bref = gqa_decode_reference(bq.float().cpu().numpy(), bkv.float().cpu().numpy(), lens, 1.25)
    bout = gqadrv.gqa_decode(bq, bkv, tl, q_scale=1.25, stream=torch.cuda.current_stream())
    assert bout.dtype == torch.bfloat16
    check(bout.float().cpu().numpy().astype(np.float64), bref, "bfloat16", "torch bf16")


def test_jax_interop():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gqadrv

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    q, kv, lens, ref = _seed_case()
    jq, jkv, jl = jnp.asarray(q), jnp.asarray(kv), jnp.asarray(lens)
    out = gqadrv.gqa_decode(jq, jkv, jl, q_scale=1.25)
    assert isinstance(out, jax.Array)
    check(np.asarray(out).astype(np.float64), ref, "float16", "jax in/out")
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        gqadrv.gqa_decode(jq, jkv, jl, out=jnp.zeros_like(jq))


def test_seed_aliases_keep_the_sm110_rule():
    import cupy as cp

    import gqadrv
    from gqadrv.runtime.driver import device_info

    if device_info(0).cc == (11, 0):
        pytest.skip("this is an SM110 device")
    q = cp.zeros((1, 32, 128), cp.float16)
    kv = cp.zeros((1, 2, 8, 128, 128), cp.float16)
    lens = cp.ones(1, cp.int32)
    with pytest.raises(RuntimeError, match="requires compute capability 11.0"):
        gqadrv.sm110_gqa_decode(q, kv, lens)
    with pytest.raises(RuntimeError, match="requires compute capability 11.0"):
        gqadrv.prepare_sm110_gqa_decode({"Q": q, "KV": kv, "O": cp.empty_like(q), "sequence_lengths": lens})


def test_cli_demo_and_selftest(report):
    import subprocess
    import sys

    for cmd in (["demo"], ["selftest"], ["info"]):
        r = subprocess.run([sys.executable, "-m", "gqadrv", *cmd], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        report(f"$ python -m gqadrv {' '.join(cmd)}")
        for ln in r.stdout.strip().splitlines():
            report("  " + ln)
