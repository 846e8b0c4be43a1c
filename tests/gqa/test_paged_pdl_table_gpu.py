"""Block tables and lengths written by the kernel right before a paged decode (programmatic
dependent launch, docs/GQA.md): every paged kernel must read them after griddepcontrol.wait.

A writer kernel on the same stream lets its dependents launch at once
(griddepcontrol.launch_dependents), waits ~20 us and then installs another block table and other
lengths. The decode, launched with the PDL attribute as every gqadrv launch is, has its CTAs
resident during that wait, so any table entry or length read before griddepcontrol.wait is the old
one; the output must be the new state's (the two states' oracles differ, so a kernel serving the
old pages or lengths fails). Covered: the TMA kernel with its speculative start (ticket, clusters,
a 4-stage ring, the batch-invariant mode), the TMA kernel without it, the cp.async kernel at page 16
and page 1; stream launches (the state flips every round) and a captured graph that flips it twice
per replay. (The file's first form, its four TMA cases and the graph test, failed all five
against a build that trusted page ids read before the wait: H100, 2026-12-07, docs/RESULTS.md.)"""

from __future__ import annotations

import numpy as np
import pytest

from gqadrv.gqa.reference import gqa_decode_paged_reference
from tests.gqa.paged_cases import check_paged, dense_case

pytestmark = pytest.mark.gpu

SPIN_NS = 20_000

_WRITER_SRC = r"""
extern "C" __global__ void rewrite_state(int* table, const int* table_src, int n_table, int* lens,
                                         const int* lens_src, int n_lens, unsigned long long spin_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < spin_ns);
  for (int i = threadIdx.x; i < n_table; i += blockDim.x) table[i] = table_src[i];
  for (int i = threadIdx.x; i < n_lens; i += blockDim.x) lens[i] = lens_src[i];
}
"""

# batch, capacity, Hq, Hkv, D, dtype, page, layout, splits, deterministic, backend, env (route switches)
CASES = [
    (1, 4096, 32, 8, 128, "float16", 16, "NHD", None, False, None, {}),                          # spec, 16 splits
    (2, 2048, 32, 4, 128, "bfloat16", 16, "HND", 6, False, None, {}),                            # spec, clusters
    (1, 1024, 8, 1, 64, "bfloat16", 32, "NHD", 5, False, None, {}),                              # 4-stage ring
    (1, 4096, 32, 8, 128, "float16", 64, "NHD", None, True, None, {}),                           # fixed splits
    (1, 4096, 32, 8, 128, "float16", 16, "NHD", None, False, None, {"GQADRV_PAGED_SPEC": "0"}),  # no speculation
    (1, 2048, 32, 8, 128, "float16", 16, "NHD", None, False, "portable", {}),                     # cp.async
    (2, 1024, 16, 2, 128, "bfloat16", 1, "NHD", None, False, None, {}),                          # page 1: cp.async
]


def _ids(c):
    env = "".join(f"-{k[7:].lower()}{v}" for k, v in c[11].items())
    return (f"B{c[0]}C{c[1]}h{c[2]}/{c[3]}d{c[4]}{c[5][:2]}p{c[6]}{c[7]}S{c[8]}{'det' if c[9] else ''}"
            f"{c[10] or ''}{env}")


def _other_table(bt: np.ndarray, C: int, page: int) -> np.ndarray:
    """The same pages, each request's first half of them replaced by its second half (another
    multiset of keys, so another output; attention is blind to a mere reordering)."""
    mp = -(-C // page)
    new = bt.copy()
    half = mp // 2
    new[:, :half] = bt[:, mp - half:mp]
    return new


def _setup(case):
    import cupy as cp

    B, C, hq, hkv, D, dtype, page, layout = case[:8]
    q, kc, vc, bt, hl, ref0, lse0 = dense_case(B, C, hq, hkv, D, dtype, page, layout, 1, [C] * B, seed=C + D + B)
    bt = np.ascontiguousarray(bt)
    bt1 = _other_table(bt, C, page)
    hl1 = np.array([C - 3 * page - 5 - 7 * b for b in range(B)], np.int32)  # shorter, not on a page edge
    ref1, lse1 = gqa_decode_paged_reference(q, kc, vc, bt1, hl1, kv_layout=layout)
    assert np.abs(ref1 - ref0).max() > 0.05  # the two states give different outputs
    d = tuple(cp.asarray(x) for x in (q, kc, vc, bt, hl))
    states = ((cp.asarray(bt), cp.asarray(hl)), (cp.asarray(bt1), cp.asarray(hl1)))
    return d, states, ((ref0, lse0), (ref1, lse1))


def _prepare(d, case):
    import cupy as cp

    import gqadrv

    q, kc, vc, bt, hl = d
    layout, splits, det, backend = case[7], case[8], case[9], case[10]
    o = cp.empty_like(q)
    o.view(cp.uint16).fill(0xFFFF)
    lb = cp.full(q.shape[:3], np.nan, cp.float32)
    p = gqadrv.prepare_gqa_decode_paged(q=q, k_cache=kc, v_cache=vc, block_table=bt, seq_lens=hl, out=o, lse=lb,
                                        kv_layout=layout, num_splits=splits, deterministic=det, backend=backend)
    return p, o, lb


def _write(writer, d, state, s):
    bt, hl = d[3], d[4]
    writer((1,), (256,), (bt, state[0], np.int32(bt.size), hl, state[1], np.int32(hl.size), np.uint64(SPIN_NS)),
           stream=s)


def _route_env(monkeypatch, env):
    for k in ("GQADRV_PAGED_SPEC", "GQADRV_BACKEND", "GQADRV_TILING"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_state_rewritten_by_the_previous_kernel(monkeypatch, case):
    import cupy as cp

    import gqadrv

    _route_env(monkeypatch, case[11])
    d, states, refs = _setup(case)
    p, o, lb = _prepare(d, case)
    want_route = "paged_" if case[10] == "portable" or case[6] < 16 else "paged_tma_"
    assert p.route.startswith(want_route) and ("tma" in p.route) == (want_route == "paged_tma_"), p.route
    writer = cp.RawKernel(_WRITER_SRC, "rewrite_state")
    s = cp.cuda.Stream(non_blocking=True)
    for r in range(6):  # the state flips every round: 0 -> 1 -> 0 ...
        want = (r + 1) % 2
        _write(writer, d, states[want], s)
        gqadrv.launch_prepared(p, stream=s)
        s.synchronize()
        check_paged(cp.asnumpy(o), cp.asnumpy(lb), refs[want][0], refs[want][1], case[5],
                    f"paged state written by the previous kernel, round {r}")
        assert gqadrv.check_status(p)["bad_page"] == []


def test_graph_flips_the_state_between_two_decodes(monkeypatch):
    """One graph: writer (state 1), decode A, writer (state 0), decode B; A must see state 1 and
    B state 0 on every replay."""
    import cupy as cp

    import gqadrv

    case = CASES[0]
    _route_env(monkeypatch, case[11])
    d, states, refs = _setup(case)
    pa, oa, la = _prepare(d, case)
    pb, ob, lb = _prepare(d, case)
    writer = cp.RawKernel(_WRITER_SRC, "rewrite_state")
    s = cp.cuda.Stream(non_blocking=True)
    _write(writer, d, states[0], s)  # compiles the writer and loads the decode's module outside the capture
    gqadrv.launch_prepared(pa, stream=s)
    s.synchronize()
    with s:
        s.begin_capture()
        _write(writer, d, states[1], s)
        gqadrv.launch_prepared(pa, stream=s)
        _write(writer, d, states[0], s)
        gqadrv.launch_prepared(pb, stream=s)
        g = s.end_capture()
    for r in range(4):
        for x in (oa, ob):
            x.view(cp.uint16).fill(0xFFFF)
        s.synchronize()
        g.launch(s)
        s.synchronize()
        check_paged(cp.asnumpy(oa), cp.asnumpy(la), refs[1][0], refs[1][1], case[5], f"graph decode A, replay {r}")
        check_paged(cp.asnumpy(ob), cp.asnumpy(lb), refs[0][0], refs[0][1], case[5], f"graph decode B, replay {r}")
