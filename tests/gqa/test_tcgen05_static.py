"""Static checks of the tcgen05 GQA decode kernels (sm_100a / sm_110a), CPU only.

No sm_100 / sm_110 GPU exists here: these kernels are compile-verified only and have never run.
What is checked, for both architectures and every (dtype, head dim, rows) of both kernels:
NVRTC accepts the source, the PTX holds the tcgen05 / TMA instructions the design relies on (with
the MMA count and the instruction descriptors re-derived here from the PTX ISA bit layout), ptxas
reports no spills, no stack, a register count that fits the block, and static + dynamic shared
memory within the 227 KiB opt-in limit; the host tables (gqa/tcgen05.py) agree with the kernels
(a static_assert on GQA_TC_SMEM, tensor-map box, grid rule, entry names).
"""

from __future__ import annotations

import re

import pytest

from gqadrv.gqa import routes as rt
from gqadrv.gqa import tcgen05 as tcf
from gqadrv.runtime.cache import CubinCache
from gqadrv.runtime.compiler import CompileError, arch_number, compile_module, kernels_root, nvrtc_supported_archs
from gqadrv.runtime.tensormap import TmaSpec, validate_tiled

ARCHES = ("sm_100a", "sm_110a")
DTYPES = {"float16": 0, "bfloat16": 1}
HEAD_DIMS = (64, 128, 256)
ROWS = (8, 16)
SMEM_OPTIN = 232448  # sm_100a / sm_110a per-block opt-in limit (bytes)

REQUIRED_PTX = (
    "tcgen05.alloc",
    "tcgen05.relinquish_alloc_permit",
    "tcgen05.dealloc",
    "tcgen05.mma.cta_group::1.kind::f16",
    "tcgen05.commit.cta_group::1.mbarrier::arrive::one",
    "tcgen05.ld.sync.aligned.32x32b.x16.b32",
    "tcgen05.wait::ld",
    "tcgen05.st.sync.aligned.32x32b.x16.b32",
    "tcgen05.wait::st",
    "tcgen05.fence::before_thread_sync",
    "tcgen05.fence::after_thread_sync",
    "fence.proxy.async.shared::cta",
    "mbarrier.try_wait.parity",
)

VARIANTS = [
    pytest.param(fam, arch, dt, d, rows, id=f"{fam}-{arch}-{dt}-d{d}-r{rows}")
    for fam in tcf.TC_FAMILIES
    for arch in ARCHES
    for dt in DTYPES
    for d in HEAD_DIMS
    for rows in ROWS
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return CubinCache(tmp_path_factory.mktemp("tc_cubins"))


def _need_arch(arch: str) -> None:
    if arch_number(arch) not in nvrtc_supported_archs():
        pytest.skip(f"this NVRTC cannot target {arch}")


def _compile(fam: str, arch: str, dt: int, d: int, rows: int, cache, **extra):
    _, tok, stages = tcf.TC_TILINGS[(fam, d)]
    defines = tcf.tc_defines(fam, dt, d, rows, tok, stages)
    defines.update(extra)
    return compile_module(tcf.TC_SOURCE[fam], arch, defines, cache=cache)


# ----------------------------------------------------------------------------- PTX ISA facts, re-derived
def idesc_f16(dt: int, m: int, n: int, a_mn: bool, b_mn: bool) -> int:
    """tcgen05 instruction descriptor, .kind::f16, fp32 accumulator (PTX ISA bit layout)."""
    assert m in (64, 128) and n % 8 == 0 and 8 <= n <= 256
    return (1 << 4) | (dt << 7) | (dt << 10) | (int(a_mn) << 15) | (int(b_mn) << 16) | ((n >> 3) << 17) | ((m >> 4) << 24)


def test_idesc_matches_seed_decoding():
    # The seed's published descriptors (M=64 tiles, fp16) decode with the same layout.
    assert idesc_f16(0, 64, 64, False, False) == 0x04100010
    assert idesc_f16(0, 64, 32, False, False) == 0x04080010
    assert idesc_f16(0, 64, 128, False, True) == 0x04210010


@pytest.mark.parametrize("fam,arch,dtype,d,rows", VARIANTS)
def test_variant_compiles_and_fits(fam, arch, dtype, d, rows, cache, report):
    _need_arch(arch)
    dt = DTYPES[dtype]
    m = _compile(fam, arch, dt, d, rows, cache)
    entry = tcf.TC_ENTRY[fam]
    threads, tok, stages = tcf.TC_TILINGS[(fam, d)]
    ptx = m.ptx.decode()
    assert f".entry {entry}(" in ptx
    for needle in REQUIRED_PTX:
        assert needle in ptx, f"{needle} missing from the PTX of {fam} {arch}"
    if tcf.tc_uses_tma(fam):
        assert "cp.async.bulk.tensor.4d" in ptx and "mbarrier.arrive.expect_tx" in ptx
    else:
        assert "cp.async.bulk.tensor" not in ptx
    # One TMEM allocation, one deallocation (same warp, every path: see the kernel's control flow).
    assert ptx.count("tcgen05.alloc.") == 1 and ptx.count("tcgen05.dealloc.") == 1
    # MMAs: D/16 QK steps + 8 P.V steps per 128 head dims (fully unrolled, one issuing thread).
    halves = 2 if d == 256 else 1
    assert ptx.count("tcgen05.mma.") == d // 16 + (tok // 16) * halves
    # Instruction descriptors: QK M=128 N=16 K-major/K-major; PV M=128 (64 for D=64) N=16,
    # A (V) MN-major, B (P^T) K-major.
    qk = idesc_f16(dt, 128, tcf.TC_NUM_QK_HEADS, False, False)
    pv = idesc_f16(dt, 64 if d == 64 else 128, tcf.TC_NUM_QK_HEADS, True, False)
    consts = {int(x) for x in re.findall(r"mov\.b32\s+%r\d+,\s*(\d+);", ptx)}
    assert qk in consts, f"QK instruction descriptor 0x{qk:08x} not found"
    assert pv in consts, f"PV instruction descriptor 0x{pv:08x} not found"
    assert ".local" not in ptx
    r = m.resources[entry]
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    assert 0 < r.registers <= min(255, 65536 // threads), r
    dyn = tcf.tc_dynamic_smem(fam, d, rows, tok, stages)
    assert r.shared_bytes + dyn <= SMEM_OPTIN, (r.shared_bytes, dyn)
    report(f"{fam:8s} {arch} {dtype:8s} D{d:3d} R{rows:2d}: {r.registers:3d} regs, "
           f"{r.shared_bytes} B static + {dyn} B dynamic smem, spills {r.spill_stores}/{r.spill_loads}")


# ----------------------------------------------------------------------------- host tables vs kernels
@pytest.mark.parametrize("fam", tcf.TC_FAMILIES)
def test_smem_size_is_checked_by_the_kernel(fam, cache):
    """tc_defines passes GQA_TC_SMEM; the kernel static_asserts it equals its own smem map."""
    _need_arch("sm_100a")
    _, tok, stages = tcf.TC_TILINGS[(fam, 128)]
    good = tcf.tc_dynamic_smem(fam, 128, 16, tok, stages)
    _compile(fam, "sm_100a", 0, 128, 16, cache)  # matching value compiles
    with pytest.raises(CompileError, match="disagrees with the kernel smem map"):
        _compile(fam, "sm_100a", 0, 128, 16, cache, GQA_TC_SMEM=good + 1024)


def test_tiling_table():
    assert set(tcf.TC_TILINGS) == {(f, d) for f in tcf.TC_FAMILIES for d in HEAD_DIMS}
    for (fam, d), (threads, tok, stages) in tcf.TC_TILINGS.items():
        assert threads == {"tc_short": 160, "tc_long": 192}[fam]  # 4 softmax warps + MMA (+ TMA)
        assert tok == tcf.TC_TOK == 128                            # M of the QK MMA
        assert stages >= 2 if fam == "tc_long" else stages == 1
        for rows in ROWS:
            smem = tcf.tc_dynamic_smem(fam, d, rows, tok, stages)
            assert smem % 1024 == 0 and smem + 1024 <= SMEM_OPTIN
            defs = tcf.tc_defines(fam, 1, d, rows, tok, stages)
            assert defs["GQA_WARPS"] * 32 == threads and defs["GQA_TC_SMEM"] == smem
            assert defs["GQA_TOK"] == tok and defs["GQA_STAGES"] == stages and defs["GQA_D"] == d


def test_dynamic_smem_formula():
    # tc_long D=128: 3 ring slots of 128x128 fp16 + Q (16x128) + P^T (16x128)
    assert tcf.tc_dynamic_smem("tc_long", 128, 16, 128, 3) == 3 * 32768 + 4096 + 4096
    assert tcf.tc_dynamic_smem("tc_short", 256, 8, 128, 1) == 2 * 65536 + 8192 + 4096
    # the merge area (1 state) and the split-merge scratch fit inside the K/V buffers
    scratch = (3 * 64 * 16 + 16) * 4
    for d in HEAD_DIMS:
        merge = (16 * 2 + 16 * (d + tcf.STATE_ROW_PAD)) * 4
        assert max(merge, scratch) <= 2 * 128 * d * 2
    with pytest.raises(ValueError):
        tcf.tc_dynamic_smem("tc_long", 128, 16, 64, 3)
    with pytest.raises(ValueError):
        tcf.tc_dynamic_smem("tc_long", 128, 16, 128, 1)
    with pytest.raises(ValueError):
        tcf.tc_defines("tc_mystery", 0, 128, 16, 128, 3)


def test_tmem_allocation_constant():
    cols = tcf.TC_TMEM_COLUMNS
    assert cols >= 32 and cols & (cols - 1) == 0 and cols <= 512
    # S^T double buffer (2 x 16) + O^T (16 per 128 head dims, 2 blocks for D=256)
    assert 2 * tcf.TC_NUM_QK_HEADS + 2 * tcf.TC_NUM_QK_HEADS <= cols
    src = (kernels_root() / "gqa" / "common" / "tc_core.cuh").read_text()
    assert re.search(rf"constexpr u32 TMEM_COLS = {cols};", src)


def _source(fam: str) -> str:
    return (kernels_root() / tcf.TC_SOURCE[fam]).read_text()


def test_entry_points_and_signatures():
    long_src, short_src = _source("tc_long"), _source("tc_short")
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(NTHREADS, 1\)\s+gqa_decode_tc_long\('
                     r"const __grid_constant__ TmaDesc kv_map, const GqaArgs args\)", long_src)
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(NTHREADS\) gqa_decode_tc_short\('
                     r"const GqaArgs args\)", short_src)
    for fam, src in (("tc_long", long_src), ("tc_short", short_src)):
        assert f"void __launch_bounds__" in src and tcf.TC_ENTRY[fam] in src
        assert f"constexpr int NTHREADS = {tcf.TC_TILINGS[(fam, 128)][0]};" in src
        # the CTA <-> (batch, KV head, split) mapping and the sub-tile partition come from gqa/common/args.cuh
        assert "make_schedule(args, TOK)" in src
        # only the splittable family compiles the split merger (routes.Family.splittable)
        splits = "" if fam == "tc_long" else ", false"
        assert f"tc_cta_epilogue<DT, D, ROWS, NTHREADS, WARP_MMA{splits}>(args, sc, smem, &s_ticket, tmem, warp);" in src
        assert rt.FAMILIES[fam].splittable == (fam == "tc_long")
    core = (kernels_root() / "gqa" / "common" / "tc_core.cuh").read_text()
    assert "tmem_dealloc(tmem, tc::TMEM_COLS)" in core and "tmem_alloc(smem_u32(s_tmem), tc::TMEM_COLS)" in core
    assert "cta_epilogue<DT, D, ROWS, 1, NTHREADS, SPLITS>(a, sc, smem, s_ticket);" in core


def test_tensor_map_box_matches_kernel():
    """The host encodes box {64, TOK, 1, 1}; the kernel expects TOK*D*2 bytes per K or V sub-tile."""
    src = _source("tc_long")
    # one box load per 64 head dims at (x = 64*box, token, kv head, plane 2b / 2b+1)
    assert "tma_load_4d(dst + (u32)box * G::BOX_BYTES, &kv_map, bar, 64 * box, tok0, sc.kvh, plane);" in src
    assert "const int plane = 2 * sc.b + (item & 1);" in src
    assert "mbar_arrive_expect_tx(bar, G::TILE_BYTES);" in src
    core = (kernels_root() / "gqa" / "common" / "tc_core.cuh").read_text()
    assert "TILE_BYTES = (u32)tc::TOK * D * 2;" in core and "BOX_BYTES = (u32)tc::TOK * 128;" in core
    for d in HEAD_DIMS:
        box = tcf.tc_kv_box("tc_long", d)
        assert box == (64, 128, 1, 1)
        assert (d // 64) * box[0] * box[1] * 2 == 128 * d * 2  # D/64 boxes fill one sub-tile
        for B, hkv, C in ((1, 8, 65), (4, 2, 4096), (3, 1, 100000)):
            # exactly the spec gqadrv/gqa/plan.py builds; a box taller than C is legal (OOB zero fill)
            validate_tiled(TmaSpec(dtype="bfloat16", address=0x10000, dims=(d, C, hkv, 2 * B),
                                   strides=(d * 2, C * d * 2, hkv * C * d * 2), box=box, swizzle="128b"))
    with pytest.raises(ValueError):
        tcf.tc_kv_box("tc_short", 128)


def _schedule(block: int, num_splits: int, hkv: int, raw_len: int, capacity: int, tok: int):
    """Python mirror of make_schedule (kernels/gqa/common/args.cuh): capacity-based split boundaries
    clipped to the length when len >= 3C/4, length-based boundaries otherwise."""
    split, bh = block % num_splits, block // num_splits
    b, kvh = bh // hkv, bh % hkv
    ln = min(max(raw_len, 0), capacity)
    nsub = -(-ln // tok)
    if 4 * ln >= 3 * capacity:
        ncap = -(-capacity // tok)
        beg, end = ncap * split // num_splits, ncap * (split + 1) // num_splits
        end = min(end, nsub)
        beg = min(beg, end)
    else:
        beg, end = nsub * split // num_splits, nsub * (split + 1) // num_splits
    return b, kvh, split, ln, beg, end


def test_grid_rule_partitions_every_token_once():
    cta = (kernels_root() / "gqa" / "common" / "args.cuh").read_text()
    assert "s.split = blockIdx.x % a.num_splits;" in cta and "s.bh = blockIdx.x / a.num_splits;" in cta
    assert "if (4LL * s.len >= 3LL * a.capacity) {" in cta  # the rule mirrored by _schedule
    tok = tcf.TC_TOK
    B, hkv = 2, 3
    for capacity in (1, 64, 65, 128, 129, 1000, 4096):
        for raw in (-5, 0, 1, 63, 64, 127, 128, 129, capacity, capacity + 7):
            for S in (1, 2, 3, 7, 64):
                seen = {}
                for block in range(B * hkv * S):  # grid = B*Hkv*S
                    b, kvh, split, ln, beg, end = _schedule(block, S, hkv, raw, capacity, tok)
                    assert 0 <= beg <= end
                    for sub in range(beg, end):
                        assert sub * tok < ln  # every owned sub-tile has a valid token
                        key = (b, kvh, sub)
                        assert key not in seen
                        seen[key] = split
                ln = min(max(raw, 0), capacity)
                assert len(seen) == B * hkv * (-(-ln // tok))
