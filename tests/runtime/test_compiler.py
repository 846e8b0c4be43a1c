"""NVRTC compiler and cubin cache (CPU only: NVRTC needs no GPU)."""

import os
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest

from gqadrv.runtime import cache as cache_mod
from gqadrv.runtime.cache import CubinCache, decode_entry, encode_entry
from gqadrv.runtime.compiler import (
    ARCHES,
    CompileError,
    arch_for_cc,
    compile_module,
    normalize_arch,
    parse_ptxas_report,
    source_closure,
)
from gqadrv.gqa import routes

SM_BYTE = {"sm_80": 0x50, "sm_90a": 0x5A, "sm_100a": 0x64, "sm_110a": 0x6E}


def elf_sm(cubin: bytes) -> int:
    assert cubin[:4] == b"\x7fELF", "not an ELF cubin"
    e_flags = struct.unpack_from("<I", cubin, 0x30)[0]  # ELF64 e_flags
    return (e_flags >> 8) & 0xFF


@pytest.mark.parametrize("arch", ARCHES)
def test_compiles_for_every_claimed_arch(arch, isolated_cache):
    v = routes.select_variant((9, 0) if arch == "sm_90a" else (8, 0), 1000, 128, "float16", 4)
    srcs = [("gqa/smxx/decode_short.cu", "gqa_decode_short", routes.Variant(routes.FAMILIES["short"], "float16", 128, 8, routes.tiling_for("short", 128)).defines)]
    srcs.append((v.family.source, v.family.entry, v.defines))
    if arch != "sm_80":
        srcs.append(("runtime/tma_ring_reduce.cu", "tma_ring_reduce", {"PROOF_DT": 0}))
    for src, entry, defines in srcs:
        m = compile_module(src, arch, defines, cache=isolated_cache)
        assert elf_sm(m.cubin) == SM_BYTE[arch]
        r = m.resources[entry]
        assert r.registers > 0 and r.spill_stores == 0 and r.spill_loads == 0
        assert b".entry " + entry.encode() in m.ptx


def test_arch_names():
    assert normalize_arch("90a") == "sm_90a"
    assert normalize_arch("SM_110A") == "sm_110a"
    assert arch_for_cc((9, 0)) == "sm_90a" and arch_for_cc((11, 0)) == "sm_110a" and arch_for_cc((8, 6)) == "sm_86"
    with pytest.raises(ValueError, match="invalid architecture"):
        normalize_arch("hopper")


def test_unsupported_arch_is_reported(isolated_cache):
    with pytest.raises(CompileError, match="cannot target sm_101a"):
        compile_module("runtime/stream_read.cu", "sm_101a", cache=isolated_cache)


def test_cache_hit_miss_and_key(tmp_path):
    c = CubinCache(tmp_path)
    a = compile_module("runtime/tma_ring_reduce.cu", "sm_90a", {"PROOF_DT": 2}, cache=c)
    assert not a.from_cache and c.misses == 1
    c2 = CubinCache(tmp_path)  # fresh process view: served from disk
    b = compile_module("runtime/tma_ring_reduce.cu", "sm_90a", {"PROOF_DT": 2}, cache=c2)
    assert b.from_cache and b.cubin == a.cubin and b.key == a.key and b.resources == a.resources
    d = compile_module("runtime/tma_ring_reduce.cu", "sm_90a", {"PROOF_DT": 1}, cache=c2)
    assert not d.from_cache and d.key != a.key
    e = compile_module("runtime/tma_ring_reduce.cu", "sm_100a", {"PROOF_DT": 2}, cache=c2)
    assert not e.from_cache and e.key != a.key
    assert c2.disk_usage()[0] == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupted_entry_is_detected_and_rebuilt(tmp_path, damage):
    c = CubinCache(tmp_path)
    a = compile_module("runtime/stream_read.cu", "sm_90a", cache=c)
    path = c._path(a.key)
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    else:
        path.write_bytes(b"not a cache entry")
    c2 = CubinCache(tmp_path)
    b = compile_module("runtime/stream_read.cu", "sm_90a", cache=c2)
    assert not b.from_cache and c2.corrupt == 1 and b.cubin == a.cubin
    assert decode_entry(path.read_bytes()) is not None  # rewritten intact


def test_entry_format_roundtrip():
    payload = os.urandom(1000)
    assert decode_entry(encode_entry(payload)) == payload
    assert decode_entry(encode_entry(payload)[:-1]) is None
    assert decode_entry(b"") is None


def test_concurrent_writers_leave_one_intact_entry(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from gqadrv.runtime.cache import CubinCache
        from gqadrv.runtime.compiler import compile_module
        m = compile_module("gqa/sm90/decode_tma.cu", "sm_90a",
                           dict(GQA_DT=0, GQA_D=128, GQA_ROWS=8, GQA_WARPS=4, GQA_TOK=32, GQA_STAGES=2),
                           cache=CubinCache(sys.argv[1]))
        print(m.key)
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    keys = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(keys) == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1, files  # no torn or duplicated entries, no leftover temp files
    assert decode_entry(files[0].read_bytes()) is not None


def test_cache_can_be_disabled_and_moved(tmp_path, monkeypatch):
    monkeypatch.setenv("GQADRV_CACHE_DIR", str(tmp_path / "moved"))
    monkeypatch.setenv("GQADRV_CACHE", "0")
    cache_mod.reset_default_cache()
    try:
        c = cache_mod.default_cache()
        assert c.directory == tmp_path / "moved" and not c.enabled
        compile_module("runtime/stream_read.cu", "sm_90a")
        assert not (tmp_path / "moved").exists()
        monkeypatch.setenv("GQADRV_CACHE", "1")
        cache_mod.reset_default_cache()
        compile_module("runtime/stream_read.cu", "sm_90a")
        assert cache_mod.default_cache().disk_usage()[0] == 1
    finally:
        cache_mod.reset_default_cache()


def test_unwritable_cache_falls_back_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    c = CubinCache(blocker / "sub")  # cannot create a directory under a file
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = compile_module("runtime/stream_read.cu", "sm_90a", cache=c)
        b = compile_module("runtime/stream_read.cu", "sm_100a", cache=c)
    msgs = [x for x in w if "not usable" in str(x.message)]
    assert len(msgs) == 1 and not c.enabled
    assert compile_module("runtime/stream_read.cu", "sm_90a", cache=c).from_cache  # memory hit
    assert a.cubin and b.cubin


def test_compile_error_names_file_and_line(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "bad.cuh").write_text("#pragma once\n\n__device__ int f() { return undefined_symbol; }\n")
    (tmp_path / "k.cu").write_text('#include "common/bad.cuh"\nextern "C" __global__ void k(int* p) { *p = f(); }\n')
    with pytest.raises(CompileError) as ei:
        compile_module("k.cu", "sm_90a", root=tmp_path, cache=CubinCache(None, False))
    err = ei.value
    assert err.location == ("common/bad.cuh", 3)
    assert "undefined_symbol" in str(err) and "common/bad.cuh:3" in str(err)
    assert "undefined_symbol" in err.log


def test_include_once_and_missing_file(tmp_path):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\nint b;\n')
    (tmp_path / "m.cu").write_text('#include "a.cuh"\n#include "missing.cuh"\n')
    text, closure = source_closure("a.cuh", tmp_path)  # mutual includes: each file inlined once
    assert [n for n, _ in closure] == ["a.cuh", "b.cuh"] and text.count("int a;") == 1
    with pytest.raises(CompileError, match="missing.cuh not found"):
        source_closure("m.cu", tmp_path)


def test_source_closure_covers_every_header():
    text, closure = source_closure("gqa/sm90/decode_tma.cu")
    names = [n for n, _ in closure]
    assert names[0] == "gqa/sm90/decode_tma.cu"
    assert {"common/ptx.cuh", "common/swizzle.cuh", "common/softmax_state.cuh", "common/trace.cuh",
            "gqa/common/config.cuh", "gqa/common/args.cuh", "gqa/common/cta.cuh", "gqa/common/warp.cuh"} <= set(names)
    assert '#line 1 "common/ptx.cuh"' in text and "#include" not in text.replace("#include <", "")


def test_ptxas_report_parser():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'\n"
        "ptxas info    : Function properties for kern_a\n"
        "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'kern_b' for 'sm_90a'\n"
        "ptxas info    : Function properties for kern_b\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 32 registers, 380 bytes cmem[0]\n"
    )
    r = parse_ptxas_report(log)
    assert r["kern_a"].registers == 168 and r["kern_a"].spill_stores == 12 and r["kern_a"].spill_loads == 16
    assert r["kern_a"].shared_bytes == 2048 and r["kern_a"].stack_bytes == 8 and r["kern_a"].barriers == 1
    assert r["kern_b"].registers == 32 and r["kern_b"].shared_bytes == 0


def test_cuda_toolkit_headers_resolve(tmp_path):
    (tmp_path / "h.cu").write_text(
        '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n'
        'extern "C" __global__ void h(const __nv_bfloat16* a, __half* b) { b[0] = __float2half(__bfloat162float(a[0])); }\n'
    )
    m = compile_module("h.cu", "sm_90a", root=tmp_path, need_cuda_headers=True, cache=CubinCache(None, False))
    assert "h" in m.resources


def test_kernels_root_is_the_imported_checkouts_own(tmp_path):
    """A second source tree put on PYTHONPATH compiles its own kernels/ (not those of an editable
    install of another checkout, which gqadrv._kernels may point to)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import gqadrv

    src = Path(gqadrv.__file__).resolve().parents[1]
    if not (src / "kernels" / "common" / "ptx.cuh").is_file():
        import pytest

        pytest.skip("gqadrv is imported from an installed wheel here, not from a source checkout")
    shutil.copytree(src / "gqadrv", tmp_path / "gqadrv", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(src / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-c", "from gqadrv.runtime.compiler import kernels_root; print(kernels_root())"],
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": ""}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == (tmp_path / "kernels").resolve()
