"""Host side of the sparse MLA decode (gqadrv/mla/sparse.py), no GPU: the argument struct mirrors
kernels/mla/smxx/sparse_gather.cu, the 16-byte offset range check, the dense-decode problem the
gathered lists feed (its MlaDecodeArgs fields), the flags and the workspace of each case."""

from __future__ import annotations

import re

import pytest

from gqadrv.mla import kernel_spec as ks
from gqadrv.mla import plan as mla_plan
from gqadrv.mla import sparse
from gqadrv.mla.routes import FAMILIES, MlaVariant
from gqadrv.runtime.compiler import kernels_root
from gqadrv.runtime.tensors import TensorView


def _source() -> str:
    return (kernels_root() / "mla" / "smxx" / "sparse_gather.cu").read_text()


def test_argument_struct_matches_the_kernel():
    from tests.helpers import c_struct_fields, python_struct_fields

    text = _source()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "MlaSparseArgs")]
    assert c == python_struct_fields(sparse.SPARSE_ARGS)
    assert sparse.SPARSE_ARGS.size % 8 == 0
    defs = {k: int(v) for k, v in re.findall(r"#define (MLA_SPARSE_\w+) (\d+)", text)}
    assert defs["MLA_SPARSE_THREADS"] == sparse.THREADS
    assert defs["MLA_SPARSE_WARPS"] == sparse.FINISH_WARPS
    assert (defs["MLA_SPARSE_PACK_Q"], defs["MLA_SPARSE_WRITE_LSE"], defs["MLA_SPARSE_SINK"],
            defs["MLA_SPARSE_OUT_BF16"]) == (sparse.FLAG_PACK_Q, sparse.FLAG_WRITE_LSE, sparse.FLAG_SINK,
                                             sparse.FLAG_OUT_BF16)
    entries = [ln for ln in text.splitlines() if ln.startswith('extern "C" __global__')]
    assert len(entries) == 2
    assert "mla_sparse_gather(const MlaSparseArgs a)" in entries[0]
    assert "mla_sparse_finish(const MlaSparseArgs a)" in entries[1]


def test_offsets_fit_the_int32_lists():
    base, page, row = sparse._offsets16(0x7000_0000_0000 + 4096, 0x7000_0000_0000, 10, 64, 64 * 656 + 16, 656, "x")
    assert (base, page, row) == (256, (64 * 656 + 16) // 16, 41)
    # a pool whose last row lies 32 GiB past the base does not fit; one just below does
    with pytest.raises(ValueError, match="32 GiB"):
        sparse._offsets16(2**35, 0, 1, 1, 0, 0, "extra_k_cache")
    sparse._offsets16(2**35 - 16, 0, 1, 1, 0, 0, "extra_k_cache")
    sparse._offsets16(-(2**35), 0, 1, 1, 0, 0, "extra_k_cache")
    with pytest.raises(ValueError, match="32 GiB"):
        sparse._offsets16(-(2**35) - 16, 0, 1, 1, 0, 0, "extra_k_cache")
    with pytest.raises(ValueError, match="16-byte boundary"):
        sparse._offsets16(8, 0, 1, 1, 0, 0, "extra_k_cache")


def _view(name, shape, strides, dtype="bfloat16", itemsize=2, ptr=1 << 20):
    return TensorView(None, name, ptr, shape, strides, dtype, itemsize, 0, "cupy")


def _problem(b=3, s_q=2, h_q=16, topk=100, fp8=True, q_strides=None, sink=False, extra=False):
    q = _view("q", (b, s_q, h_q, 576), q_strides or (s_q * h_q * 576, h_q * 576, 576, 1))
    row = 656 if fp8 else 576
    kv = _view("k_cache", (50, 64, 1, row), (64 * row, row, row, 1), "uint8" if fp8 else "bfloat16",
               1 if fp8 else 2, ptr=1 << 30)
    pool = sparse.SparsePool(kv, 50, 64, 64 * row // 16 * (1 if fp8 else 2), row // 16 * (1 if fp8 else 2), 0)
    idx = _view("indices", (b, s_q, topk), (s_q * topk, topk, 1), "int32", 4)
    ex = eidx = None
    if extra:
        ex = sparse.SparsePool(kv, 7, 3, 100, 41, -5)
        eidx = _view("extra", (b, s_q, 9), (s_q * 9, 9, 1), "int32", 4)
    return sparse.SparseProblem(b, s_q, h_q, topk, 9 if extra else 0, "bfloat16", 0, fp8, 0.05, q, pool, ex, idx,
                                None, eidx, None, _view("sink", (h_q,), (1,), "float32", 4) if sink else None)


class _Ws:
    def ptr(self, name):
        return {"sp_lists": 0x1000, "sp_counts": 0x2000, "sp_lse": 0x3000, "sp_q": 0x4000, "ws_o": 0x5000,
                "ws_ml": 0x6000, "counters": 0x7000}[name]


@pytest.mark.parametrize("fp8", [True, False])
def test_dense_problem_reads_the_lists_as_one_token_pages(fp8):
    sp = _problem(fp8=fp8)
    dense = sparse.dense_problem(sp, 0x1000, 0x2000, 0)
    assert (dense.b, dense.s_q, dense.h_q, dense.h_kv, dense.group, dense.page_size) == (6, 1, 16, 1, 16, 1)
    assert dense.max_blocks == dense.capacity == 100 and dense.m_rows == 16 and not dense.causal
    fam = FAMILIES["seesaw_fp8" if fp8 else "seesaw"]
    f = mla_plan.args_fields(dense, MlaVariant(fam, "bfloat16"), (16 * 512, 0, 512), 0x9000, 0x3000, _Ws(), 2)
    assert f["k_stride_block"] == 8 and f["k_stride_tok"] == 0 and f["k_stride_head"] == 0  # 16 bytes, 2-byte units
    assert f["k_cache"] == sp.pool.view.ptr and f["block_table"] == 0x1000 and f["cache_seqlens"] == 0x2000
    assert f["bt_stride"] == 100 and f["max_blocks"] == 100 and f["page_size"] == 1 and f["page_shift"] == 0
    assert (f["q_stride_b"], f["q_stride_h"]) == (16 * 576, 576) and f["q"] == sp.q.ptr
    assert (f["b"], f["s_q"], f["m_rows"]) == (6, 1, 16)
    assert not mla_plan.tma_ok(dense)
    # every list on one CTA of a balanced grid: the flag, and no partial slots in the workspace
    assert dense.no_cut and f["flags"] & ks.FLAG_NO_CUT
    if not fp8:
        bal = MlaVariant(FAMILIES["seesaw_bal_cp"], "bfloat16")
        sizes = mla_plan.workspace_sizes(dense, bal, 132)
        assert sizes["ws_o"][0] == sizes["ws_ml"][0] == 0 and sizes["counters"][0] == 6


def test_unmergeable_q_is_packed_and_flags_follow_the_features():
    sp = _problem(q_strides=(10 * 16 * 576, 16 * 576, 576, 1))       # requests 10 tokens apart, s_q 2
    assert not sp.q_mergeable and "sp_q" in sparse.workspace_sizes(sp)
    dense = sparse.dense_problem(sp, 1, 2, 0x4000)
    assert dense.q.ptr == 0x4000 and dense.q.strides[0] == 16 * 576
    f = sparse.args_fields(sp, _Ws(), 0x9000, (2 * 16 * 512, 16 * 512, 512, 1), 0x8000, 0x3000)
    assert f["flags"] == sparse.FLAG_PACK_Q | sparse.FLAG_WRITE_LSE | sparse.FLAG_OUT_BF16
    assert f["q_packed"] == 0x4000 and f["o_stride_r"] == 16 * 512 and f["cap"] == 100
    one = _problem(s_q=1, sink=True, extra=True)
    assert one.q_mergeable and "sp_q" not in sparse.workspace_sizes(one) and "sp_lse" not in sparse.workspace_sizes(one)
    f = sparse.args_fields(one, _Ws(), 0x9000, (16 * 512, 16 * 512, 512, 1), 0x8000, 0x8000)
    assert f["flags"] == sparse.FLAG_SINK | sparse.FLAG_OUT_BF16 and sparse.needs_finish(one)
    assert (f["extra_slots"], f["extra_base16"], f["extra_page_size"], f["cap"]) == (21, -5, 3, 109)
    assert not sparse.needs_finish(_problem(s_q=1))
    assert sparse.gather_geometry(sp)[0] == (6, 1, 1)
    assert sparse.finish_geometry(sp, sparse.FLAG_SINK | sparse.FLAG_WRITE_LSE)[0] == (-(-6 * 16 // 4), 1, 1)
    assert sparse.finish_geometry(sp, sparse.FLAG_WRITE_LSE)[0] == (1, 1, 1)  # one unit per thread: 96 <= 128
    assert one.config()[0] == "sparse" and one.config() != _problem(s_q=1, sink=True).config()


def test_the_sink_folds_into_the_dense_epilogue_where_no_item_is_split():
    """With attn_sink, the dense kernel applies the sink in its epilogue (FLAG_SINK, out = O / (L + exp(sink)
    in the row's units)) when its family's epilogue can (seesaw, first kernel) and no item is split (the
    balanced grid without cuts, or one split); the finish launch then neither scales out nor runs at all
    for s_q 1. Otherwise (narrow / FP8 kernels, split items) the finish launch scales out as before."""
    one = _problem(s_q=1, sink=True, extra=True)
    fam = FAMILIES
    assert sparse.fold_sink(one, fam["seesaw_bal_cp"], 132, True) and sparse.fold_sink(one, fam["seesaw"], 1, False)
    assert sparse.fold_sink(one, fam["mma"], 1, False) and sparse.fold_sink(one, fam["seesaw_nope_bal"], 66, True)
    assert not sparse.fold_sink(one, fam["seesaw"], 2, False)          # split items: the merge does not apply it
    assert not sparse.fold_sink(one, fam["narrow16_fp8"], 1, False) and not sparse.fold_sink(one, fam["wide64_fp8"], 1, False)
    assert not sparse.fold_sink(_problem(s_q=1), fam["seesaw_bal_cp"], 132, True)  # no sink
    assert not sparse.needs_finish(one, fold_sink=True) and sparse.needs_finish(one)
    assert sparse.needs_finish(_problem(s_q=2, sink=True), fold_sink=True)        # the LSE transpose stays
    f = sparse.args_fields(one, _Ws(), 0x9000, (16 * 512, 16 * 512, 512, 1), 0x8000, 0x8000, fold_sink=True)
    assert f["flags"] == sparse.FLAG_OUT_BF16
    dense = sparse.dense_problem(one, 1, 2, 0, fold_sink=True)
    assert dense.sink_ptr == one.attn_sink.ptr and sparse.dense_problem(one, 1, 2, 0).sink_ptr == 0
    v = MlaVariant(FAMILIES["seesaw_bal_cp"], "bfloat16")
    a = mla_plan.args_fields(dense, v, (512, 0, 512), 0x9000, 0x8000, None, 132)
    assert a["flags"] & ks.FLAG_SINK and a["sink"] == one.attn_sink.ptr
    assert not mla_plan.args_fields(sparse.dense_problem(one, 1, 2, 0), v, (512, 0, 512), 0x9000, 0x8000, None,
                                    132)["flags"] & ks.FLAG_SINK


def test_every_arch_builds_both_entries():
    for arch in ("sm_90a", "sm_100a", "sm_110a"):
        assert [v.name for v in sparse.variants_for_arch(arch)] == ["mla_sparse_gather", "mla_sparse_finish"]
    assert sparse.variants_for_arch("sm_80") == sparse.variants_for_arch("sm_86") == []  # no MLA kernels there
    assert ks.D_V == 512


# ----------------------------------------------------------------------------- contract (CPU fakes, fp16)
def _inputs(**over):
    import numpy as np

    from tests.fakes import fake

    t = dict(q=fake((2, 3, 16, 576)), k=fake((5, 7, 1, 576)), idx=fake((2, 3, 40), np.int32), dv=512, scale=None,
             causal=False, fp8=False, sink=None, ek=None, eidx=None, tl=None, etl=None)
    t.update(over)
    return t


def _validate(t):
    return sparse.validate_sparse(t["q"], t["k"], t["idx"], t["dv"], t["scale"], t["causal"], stream=None,
                                  is_fp8_kvcache=t["fp8"], attn_sink=t["sink"], extra_k_cache=t["ek"],
                                  extra_indices=t["eidx"], topk_length=t["tl"], extra_topk_length=t["etl"])


def test_valid_sparse_problem_any_page_size():
    import numpy as np

    from tests.fakes import fake

    p = _validate(_inputs(tl=fake((2,), np.int32), sink=fake((16,), np.float32), ek=fake((3, 53, 1, 576)),
                          eidx=fake((2, 3, 9), np.int32), etl=fake((2,), np.int32)))
    assert (p.b, p.s_q, p.h_q, p.topk, p.extra_topk, p.cap, p.rows) == (2, 3, 16, 40, 9, 49, 6)
    assert (p.pool.page, p.pool.slots, p.extra.page, p.extra.slots) == (7, 35, 53, 159)
    assert p.pool.row16 == 576 * 2 // 16 and p.pool.page16 == 7 * 576 * 2 // 16 and p.q_mergeable


def _bad_cases():
    import numpy as np

    from tests.fakes import FakeCudaArray, fake

    return [
        (dict(causal=True), ValueError, "causal=True is not defined on the sparse path"),
        (dict(dv=576), ValueError, "head_dim_v"),
        (dict(idx=fake((2, 3, 40), np.int64)), TypeError, "indices must have dtype int32"),
        (dict(idx=fake((2, 2, 40), np.int32)), ValueError, r"indices must have shape \[2, 3, topk"),
        (dict(idx=fake((2, 3, 0), np.int32)), ValueError, "indices must have shape"),
        (dict(k=fake((5, 7, 2, 576))), ValueError, "h_kv must be 1"),
        (dict(k=fake((5, 7, 1, 656), np.uint8)), TypeError, "is_fp8_kvcache=True"),
        (dict(fp8=True, k=fake((5, 7, 1, 656), np.uint8)), TypeError, "bfloat16 q"),
        (dict(k=fake((5, 7, 1, 576), np.float32)), TypeError, "k_cache must have the dtype of q"),
        (dict(q=fake((2, 3, 129, 576))), ValueError, "h_q must be in"),
        (dict(sink=fake((16,), np.float16)), TypeError, "attn_sink must have dtype float32"),
        (dict(sink=fake((15,), np.float32)), ValueError, r"attn_sink must have shape \(16,\)"),
        (dict(tl=fake((3,), np.int32)), ValueError, r"topk_length must have shape \(2,\)"),
        (dict(tl=fake((2,), np.int64)), TypeError, "topk_length must have dtype int32"),
        (dict(ek=fake((3, 5, 1, 576))), ValueError, "go together"),
        (dict(eidx=fake((2, 3, 4), np.int32)), ValueError, "go together"),
        (dict(etl=fake((2,), np.int32)), ValueError, "extra_topk_length needs"),
        (dict(ek=fake((3, 5, 1, 576)), eidx=fake((2, 3, 4), np.int64)), TypeError, "extra_indices_in_kvcache"),
        (dict(k=FakeCudaArray(np.zeros((5, 7, 1, 580), np.float16)[..., :576])), ValueError, "multiples of"),
        (dict(scale=-1.0), ValueError, "softmax_scale"),
        (dict(fp8=1), TypeError, "is_fp8_kvcache must be a bool"),
    ]


@pytest.mark.parametrize("case", range(21))
def test_sparse_contract_errors(case):
    over, exc, msg = _bad_cases()[case]
    with pytest.raises(exc, match=msg):
        _validate(_inputs(**over))
