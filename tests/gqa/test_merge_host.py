"""LSE state merge (gqadrv.merge_state / merge_states) without a GPU: the contract (every error
before any launch), the argument structs against kernels/gqa/smxx/merge_state.cu, the launch
fields of both forms, the CLI registration, and an NVRTC compile of every variant for every arch
the family is registered for."""

import re

import numpy as np
import pytest

from gqadrv.gqa import merge
from gqadrv.runtime.compiler import kernels_root
from tests.fakes import FakeCudaArray, fake

N, H, D = 3, 4, 64


def pair(**over):
    t = {"v_a": fake((N, H, D)), "s_a": fake((N, H), np.float32), "v_b": fake((N, H, D)),
         "s_b": fake((N, H), np.float32), "out": None, "out_lse": None}
    t.update(over)
    return t


def run_pair(t):
    return merge.validate_pair(t["v_a"], t["s_a"], t["v_b"], t["s_b"], t["out"], t["out_lse"], stream=None)


def stacked(**over):
    t = {"v": fake((N, 3, H, D)), "s": fake((N, 3, H), np.float32), "out": None, "out_lse": None}
    t.update(over)
    return t


def run_stacked(t):
    return merge.validate_stacked(t["v"], t["s"], t["out"], t["out_lse"], stream=None)


def noncontig(shape, dtype):
    """A transposed view (last two dims swapped): not row-major."""
    a = np.zeros(shape[:-2] + (shape[-1], shape[-2]), dtype)
    return FakeCudaArray(np.swapaxes(a, -1, -2))


# ----------------------------------------------------------------------------- contract
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape", [(1, 1, 8), (5, 8, 128), (3, 2, 4, 256), (2, 1024), (7, 3, 8)])
def test_valid_pair(shape, dtype):
    t = pair(v_a=fake(shape, dtype), v_b=fake(shape, dtype), s_a=fake(shape[:-1], np.float32),
             s_b=fake(shape[:-1], np.float32), out=fake(shape, dtype), out_lse=fake(shape[:-1], np.float32))
    p = run_pair(t)
    rows = int(np.prod(shape[:-1]))
    assert (p.form, p.num_states, p.rows, p.heads, p.head_dim) == ("list", 2, rows, shape[-2], shape[-1])
    assert p.out_shape == shape and p.lse_shape == shape[:-1]
    assert p.dtype == np.dtype(dtype).name and p.chunks == shape[-1] * np.dtype(dtype).itemsize // 16


def test_valid_stacked_and_list():
    p = run_stacked(stacked())
    assert (p.form, p.num_states, p.rows, p.heads, p.head_dim, p.out_shape, p.lse_shape) == \
        ("stacked", 3, N * H, H, D, (N, H, D), (N, H))
    vs = [fake((2, 5, H, D)) for _ in range(7)]
    ss = [fake((2, 5, H), np.float32) for _ in range(7)]
    p = merge.validate_list(vs, ss, None, None, stream=None)
    assert (p.form, p.num_states, p.rows, p.heads, p.out_shape, p.lse_shape) == \
        ("list", 7, 2 * 5 * H, H, (2, 5, H, D), (2, 5, H))
    assert [v.name for v in p.v] == [f"v[{i}]" for i in range(7)] and p.s[6].name == "s[6]"
    p = merge.validate_list(vs[:1], ss[:1], None, None, stream=None)  # K = 1
    assert p.num_states == 1
    # zero rows: valid (nothing is launched)
    p = run_stacked(stacked(v=fake((0, 2, H, D)), s=fake((0, 2, H), np.float32)))
    assert p.rows == 0 and p.items == 0


@pytest.mark.parametrize("over,exc,msg", [
    ({"v_a": fake((N, H, D), np.float64), "v_b": fake((N, H, D), np.float64)}, TypeError,
     "v_a must have dtype float16 or bfloat16 or float32, got float64"),
    ({"v_a": fake((N, H, D), np.int32), "v_b": fake((N, H, D), np.int32)}, TypeError, "v_a must have dtype"),
    ({"v_b": fake((N, H, D), np.float32)}, TypeError, "v_b must have the dtype of v_a"),
    ({"s_a": fake((N, H), np.float16)}, TypeError, "s_a must have dtype float32"),
    ({"s_b": fake((N, H), np.float64)}, TypeError, "s_b must have dtype float32"),
    ({"v_b": fake((N, H + 1, D))}, ValueError, r"v_b must have the shape of v_a \(3, 4, 64\)"),
    ({"s_a": fake((N, H + 1), np.float32)}, ValueError, r"s_a must have shape \(3, 4\)"),
    ({"s_b": fake((N, H, 1), np.float32)}, ValueError, r"s_b must have shape \(3, 4\)"),
    ({"s_a": fake((N * H,), np.float32)}, ValueError, r"s_a must have shape \(3, 4\)"),
    ({"v_a": fake((D,)), "v_b": fake((D,)), "s_a": fake((), np.float32), "s_b": fake((), np.float32)}, ValueError,
     "at least 2 dimensions"),
    ({"v_a": fake((N, H, 60)), "v_b": fake((N, H, 60))}, ValueError, "multiple of 8 in \\[8, 1024\\], got 60"),
    ({"v_a": fake((N, H, 4)), "v_b": fake((N, H, 4))}, ValueError, "multiple of 8"),
    ({"v_a": fake((1, 2, 2048)), "v_b": fake((1, 2, 2048)), "s_a": fake((1, 2), np.float32),
      "s_b": fake((1, 2), np.float32)},
     ValueError, "got 2048"),
    ({"v_a": noncontig((N, H, D), np.float16)}, ValueError, "v_a must be contiguous"),
    ({"v_b": noncontig((N, H, D), np.float16)}, ValueError, "v_b must be contiguous"),
    ({"s_a": FakeCudaArray(np.zeros((H, N), np.float32).T)}, ValueError, "s_a must be contiguous"),
    ({"v_b": fake((N, H, D), device=1)}, ValueError, "all tensors must share one device"),
    ({"s_b": fake((N, H), np.float32, device=2)}, ValueError, "share one device"),
    ({"v_a": np.zeros((N, H, D), np.float16)}, ValueError, "v_a must be a CUDA array; got a CPU array"),
    ({"s_b": [[0.0]]}, TypeError, "s_b must be a CUDA array supporting DLPack"),
    ({"out": fake((N, H, D + 8))}, ValueError, r"out must have shape \(3, 4, 64\)"),
    ({"out": fake((N, H, D), np.float32)}, TypeError, "out must have the dtype of v_a"),
    ({"out": noncontig((N, H, D), np.float16)}, ValueError, "out must be contiguous"),
    ({"out": fake((N, H, D), device=1)}, ValueError, "share one device"),
    ({"out_lse": fake((N, H), np.float16)}, TypeError, "out_lse must have dtype float32"),
    ({"out_lse": fake((N, H, 1), np.float32)}, ValueError, r"out_lse must have shape \(3, 4\)"),
    ({"out_lse": FakeCudaArray(np.zeros((H, N), np.float32).T)}, ValueError, "out_lse must be contiguous"),
])
def test_pair_contract_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        run_pair(pair(**over))


@pytest.mark.parametrize("over,exc,msg", [
    ({"v": fake((N, H, D))}, ValueError, r"v must have shape \[N, K, H, D\]"),
    ({"v": fake((N, 1, 3, H, D))}, ValueError, r"\[N, K, H, D\]"),
    ({"v": fake((N, 0, H, D)), "s": fake((N, 0, H), np.float32)}, ValueError, "at least one state"),
    ({"s": fake((N, 3, H, 1), np.float32)}, ValueError, r"s must have shape \(3, 3, 4\)"),
    ({"s": fake((N, H), np.float32)}, ValueError, r"s must have shape \(3, 3, 4\)"),
    ({"s": fake((N, 3, H), np.float16)}, TypeError, "s must have dtype float32"),
    ({"v": fake((N, 3, H, D), np.float64)}, TypeError, "v must have dtype"),
    ({"v": fake((N, 3, H, 12))}, ValueError, "multiple of 8"),
    ({"v": noncontig((N, 3, H, D), np.float16)}, ValueError, "v must be contiguous"),
    ({"out": fake((N, 3, H, D))}, ValueError, r"out must have shape \(3, 4, 64\)"),
    ({"out_lse": fake((N, 3, H), np.float32)}, ValueError, r"out_lse must have shape \(3, 4\)"),
    ({"out": fake((N, H, D), np.dtype("float32"))}, TypeError, "out must have the dtype of v"),
])
def test_stacked_contract_errors(over, exc, msg):
    with pytest.raises(exc, match=msg):
        run_stacked(stacked(**over))


def test_list_contract_errors():
    vs = [fake((N, H, D)) for _ in range(3)]
    ss = [fake((N, H), np.float32) for _ in range(3)]
    with pytest.raises(ValueError, match="at least one state; got an empty list"):
        merge.validate_list([], [], None, None, stream=None)
    with pytest.raises(ValueError, match="same number of states; got 3 v arrays and 2 s arrays"):
        merge.validate_list(vs, ss[:2], None, None, stream=None)
    with pytest.raises(ValueError, match="at most 64 states"):
        merge.validate_list(vs * 22, ss * 22, None, None, stream=None)
    merge.validate_list(vs * 21 + vs[:1], ss * 21 + ss[:1], None, None, stream=None)  # 64 states: accepted
    with pytest.raises(ValueError, match=r"v\[2\] must have the shape of v\[0\]"):
        merge.validate_list(vs[:2] + [fake((N, H, D + 8))], ss, None, None, stream=None)
    with pytest.raises(TypeError, match=r"v\[1\] must have the dtype of v\[0\]"):
        merge.validate_list([vs[0], fake((N, H, D), np.float32), vs[2]], ss, None, None, stream=None)
    with pytest.raises(ValueError, match=r"s\[1\] must have shape \(3, 4\)"):
        merge.validate_list(vs, [ss[0], fake((N, H + 1), np.float32), ss[2]], None, None, stream=None)
    with pytest.raises(ValueError, match=r"v\[2\] must be contiguous"):
        merge.validate_list(vs[:2] + [noncontig((N, H, D), np.float16)], ss, None, None, stream=None)


def test_public_calls_refuse_bad_state_lists_before_any_gpu_work():
    """Structural errors of merge_states are raised before the GPU is looked for (also here)."""
    import gqadrv

    with pytest.raises(ValueError, match="at least one state; got an empty list"):
        gqadrv.merge_states([], [])
    with pytest.raises(ValueError, match="at least one state"):
        gqadrv.merge_states((), ())
    with pytest.raises(ValueError, match="same number of states"):
        gqadrv.merge_states([fake((N, H, D))], [])
    with pytest.raises(ValueError, match="at most 64 states"):
        gqadrv.merge_states([fake((N, H, D))] * 65, [fake((N, H), np.float32)] * 65)
    with pytest.raises(TypeError, match="both be arrays .* or both be lists"):
        gqadrv.merge_states([fake((N, H, D))], fake((N, H), np.float32))
    with pytest.raises(TypeError, match="both be arrays"):
        gqadrv.merge_states(fake((N, 1, H, D)), [fake((N, 1, H), np.float32)])


def test_outputs_must_not_overlap_inputs_or_each_other():
    buf = np.zeros(3 * N * H * D, np.float16)
    va = FakeCudaArray(buf[: N * H * D].reshape(N, H, D))
    vb = FakeCudaArray(buf[N * H * D: 2 * N * H * D].reshape(N, H, D))
    free = FakeCudaArray(buf[2 * N * H * D:].reshape(N, H, D))
    with pytest.raises(ValueError, match="out must not overlap v_a"):
        run_pair(pair(v_a=va, v_b=vb, out=FakeCudaArray(buf[: N * H * D].reshape(N, H, D))))
    with pytest.raises(ValueError, match="out must not overlap v_b"):
        run_pair(pair(v_a=va, v_b=vb, out=FakeCudaArray(buf[N * H * D + 8: 2 * N * H * D + 8].reshape(N, H, D))))
    run_pair(pair(v_a=va, v_b=vb, out=free))
    sbuf = np.zeros(4 * N * H, np.float32)
    sa = FakeCudaArray(sbuf[: N * H].reshape(N, H))
    sb = FakeCudaArray(sbuf[N * H: 2 * N * H].reshape(N, H))
    with pytest.raises(ValueError, match="out_lse must not overlap s_b"):
        run_pair(pair(s_a=sa, s_b=sb, out_lse=FakeCudaArray(sbuf[N * H: 2 * N * H].reshape(N, H))))
    with pytest.raises(ValueError, match="out must not overlap s_a"):  # out's bytes cover s_a
        big = np.zeros(N * H * D, np.float16)
        s_in = FakeCudaArray(big.view(np.float32)[: N * H].reshape(N, H))
        run_pair(pair(s_a=s_in, out=FakeCudaArray(big.reshape(N, H, D))))
    # out_lse inside out
    o = np.zeros(N * H * D, np.float32)
    with pytest.raises(ValueError, match="out_lse must not overlap out"):
        run_pair(pair(v_a=fake((N, H, D), np.float32), v_b=fake((N, H, D), np.float32),
                      out=FakeCudaArray(o.reshape(N, H, D)), out_lse=FakeCudaArray(o[5:5 + N * H].reshape(N, H))))
    # stacked form
    st = np.zeros(N * 3 * H * D, np.float16)
    with pytest.raises(ValueError, match="out must not overlap v"):
        run_stacked(stacked(v=FakeCudaArray(st.reshape(N, 3, H, D)),
                            out=FakeCudaArray(st[: N * H * D].reshape(N, H, D))))


def test_too_many_items_for_one_launch():
    merge._check_items(2**31 // 8 - 1, 64, "float16", "v")  # 8 chunks per row: just below the limit
    with pytest.raises(ValueError, match="too large for one merge launch"):
        merge._check_items(2**31 // 8, 64, "float16", "v")


# ----------------------------------------------------------------------------- launch fields
def test_launch_fields_of_both_forms():
    p = run_stacked(stacked(v=fake((2, 5, 3, 128)), s=fake((2, 5, 3), np.float32)))
    f, table = merge.args_fields(p, 0x1000, 0x2000)
    assert f == {"out": 0x1000, "out_lse": 0x2000, "v_state_stride": 3 * 128, "s_state_stride": 3,
                 "v_outer_stride": 5 * 3 * 128, "s_outer_stride": 5 * 3, "rows": 6, "heads": 3, "head_dim": 128,
                 "chunks": 16, "num_states": 5, "flags": merge.MERGE_FLAG_VEC16 if p.v[0].ptr % 16 == 0 else 0}
    ptrs = np.frombuffer(table, np.uint64)
    assert len(table) == merge.MERGE_TABLE.size == 1024
    assert ptrs[0] == p.v[0].ptr and ptrs[64] == p.s[0].ptr and not ptrs[1:64].any() and not ptrs[65:].any()
    assert merge.launch_geometry(p) == ((1, 1, 1), (128, 1, 1), 0)  # 6 rows x 16 chunks = 96 items

    vs = [fake((2, 4, 3, 64), np.float32) for _ in range(7)]
    ss = [fake((2, 4, 3), np.float32) for _ in range(7)]
    p = merge.validate_list(vs, ss, None, None, stream=None)
    f, table = merge.args_fields(p, 0x1000, 0x2004)
    assert (f["v_state_stride"], f["s_state_stride"], f["v_outer_stride"], f["s_outer_stride"]) == (0, 0, 3 * 64, 3)
    assert (f["rows"], f["heads"], f["chunks"], f["num_states"]) == (24, 3, 16, 7)
    assert f["flags"] & merge.MERGE_FLAG_TABLE
    ptrs = np.frombuffer(table, np.uint64)
    assert list(ptrs[:7]) == [v.ptr for v in p.v] and list(ptrs[64:71]) == [s.ptr for s in p.s]
    assert not ptrs[7:64].any() and not ptrs[71:].any()
    assert merge.launch_geometry(p) == ((3, 1, 1), (128, 1, 1), 0)  # 24 x 16 = 384 items
    # a v base that is not 16-byte aligned: element loads, no VEC16
    buf = np.zeros(2 * 4 * 3 * 64 + 8, np.float32)
    off = (-buf.ctypes.data % 16) // 4 + 1
    odd = FakeCudaArray(buf[off:off + 2 * 4 * 3 * 64].reshape(2, 4, 3, 64))
    p = merge.validate_list(vs[:2] + [odd], ss[:3], None, None, stream=None)
    assert not merge.args_fields(p, 0x1000, 0x2000)[0]["flags"] & merge.MERGE_FLAG_VEC16
    p = merge.validate_list(vs[:3], ss[:3], None, None, stream=None)
    assert not merge.args_fields(p, 0x1008, 0x2000)[0]["flags"] & merge.MERGE_FLAG_VEC16  # output misaligned
    with pytest.raises(ValueError, match="1..64 states"):
        merge.pack_table([], [])


def test_views_off_their_element_alignment_are_rejected():
    raw = np.zeros(2 * N * H * D + 4, np.uint8)
    start = 1 if raw.ctypes.data % 2 == 0 else 0
    odd = np.frombuffer(raw.data, dtype=np.float16, count=N * H * D, offset=start).reshape(N, H, D)
    with pytest.raises(ValueError, match="v_a must start at a 2-byte aligned address"):
        run_pair(pair(v_a=FakeCudaArray(odd), v_b=fake((N, H, D))))


# ----------------------------------------------------------------------------- kernel struct mirror
def _source() -> str:
    return (kernels_root() / "gqa" / "smxx" / "merge_state.cu").read_text()


def test_argument_structs_match_the_kernel():
    """gqa/merge.py mirrors struct MergeArgs and struct MergeTable of merge_state.cu: same field names,
    order, offsets and types; the defines (table size, threads, flags) agree."""
    from tests.helpers import c_struct_fields, python_struct_fields

    text = _source()
    c = [(n, o, "Q" if ch in "qQ" else ch) for n, o, ch in c_struct_fields(text, "MergeArgs")]
    assert c == python_struct_fields(merge.MERGE_ARGS)
    assert merge.MERGE_ARGS.size == 72
    defs = {k: int(v) for k, v in re.findall(r"#define (MERGE_\w+) (\d+)", text)}
    assert defs["MERGE_MAX_TABLE"] == merge.MAX_LIST_STATES
    assert defs["MERGE_THREADS"] == merge.THREADS
    assert defs["MERGE_FLAG_TABLE"] == merge.MERGE_FLAG_TABLE and defs["MERGE_FLAG_VEC16"] == merge.MERGE_FLAG_VEC16
    body = text[text.index("struct MergeTable {"):]
    body = body[:body.index("};")]
    fields = re.findall(r"const (\w+)\* (\w+)\[(\w+)\];", body)
    assert fields == [("void", "v", "MERGE_MAX_TABLE"), ("float", "s", "MERGE_MAX_TABLE")]
    assert merge.MERGE_TABLE.size == 2 * 8 * merge.MAX_LIST_STATES and merge.MERGE_TABLE.align == 8
    entry = [ln for ln in text.splitlines() if ln.startswith('extern "C" __global__')]
    assert len(entry) == 1 and "merge_state(const MergeArgs args, const MergeTable table)" in entry[0], entry
    assert merge.SIGNATURE.names == ("args", "table") and merge.SIGNATURE.offsets == (0, 72)
    assert merge.SIGNATURE.size == 72 + 1024 <= 4096  # the classic 4 KB kernel parameter limit


def test_kernel_file_opens_with_the_header_comment():
    head = _source().split("#include")[0]
    for part in ("CTA work", "Warps", "Smem map", "Barriers"):
        assert part in head, part


# ----------------------------------------------------------------------------- registry / CLI
def test_family_registration_and_cli_jobs():
    from gqadrv import cli

    assert merge.FAMILY.arches == ("sm_80", "sm_90a", "sm_100a", "sm_110a")
    names = [f"merge_state_{dt}_b{b}" for dt in ("float16", "bfloat16", "float32") for b in (2, 4)]
    assert [v.name for v in merge.variants_for_arch("sm_90a")] == names
    assert merge.variants_for_arch("sm_75") == []
    assert merge.OP in cli._ops() and merge.OP.name == "merge_state"
    for arch in ("sm_80", "sm_86", "sm_90a", "sm_100a", "sm_110a", "sm_120"):
        assert [j[0] for j in cli.compile_jobs([arch]) if j[2] == merge.FAMILY.source] == names, arch
    # the runtime routes every K to a module compile builds: batch 2 for K <= 2, else 4
    assert [merge.variant_for("float16", k).batch for k in (1, 2, 3, 4, 7, 64, 10**6)] == [2, 2, 4, 4, 4, 4, 4]
    assert {merge.variant_for(dt, k) for dt in merge.SUPPORTED_DTYPES for k in (1, 2, 3, 100)} == \
        set(merge.variants_for_arch("sm_80"))
    assert "merge_state" in merge.OP.describe((9, 0))
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        merge.OP.describe((7, 5))
    v = merge.variant_for("bfloat16", 5)
    assert v.defines == {"MERGE_DT": 1, "MERGE_BATCH": 4} and v.block == (128, 1, 1) and v.dynamic_smem == 0
    assert merge.variant_for("float32", 2).defines == {"MERGE_DT": 2, "MERGE_BATCH": 2}


def test_selftest_cpu_case():
    cases = merge.OP.selftest(np.random.default_rng(0), gpu=False)
    assert len(cases) == 1 and cases[0][2], cases


@pytest.mark.parametrize("arch", merge.FAMILY.arches)
def test_every_variant_compiles_for_every_registered_arch(arch, isolated_cache):
    from gqadrv.runtime.compiler import compile_module

    for v in merge.variants_for_arch(arch):
        m = compile_module(v.family.source, arch, v.defines, cache=isolated_cache)
        r = m.resources[v.family.entry]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, (arch, v.name, r)
        assert r.shared_bytes == 0 and r.registers <= 255
        ptx = m.ptx.decode()
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx and "st.global.v4.u32" in ptx, v.name
        assert ("griddepcontrol.wait" in ptx) == (arch != "sm_80"), v.name
        assert ".local" not in ptx, v.name  # the state table is read from the parameter space, never copied


# ----------------------------------------------------------------------------- oracle
def test_oracle_merge_of_parts_is_attention_over_the_union():
    from gqadrv.ops import oracle

    rng = np.random.default_rng(3)
    for k in (1, 2, 3, 7):
        vs, ss, ref_v, ref_s = merge._oracle_case(rng, 10, 16, k, 12)
        mv, ms = oracle.merge_states(vs, ss)
        np.testing.assert_allclose(mv, ref_v, atol=1e-12)
        np.testing.assert_allclose(ms, ref_s, atol=1e-12)
    # -inf means empty too; all empty gives v = 0, s = +inf
    v = np.ones((2, 8))
    mv, ms = oracle.merge_states([v, 2 * v], [np.array([np.inf, -np.inf]), np.array([-np.inf, np.inf])])
    assert np.all(mv == 0) and np.all(ms == np.inf)
