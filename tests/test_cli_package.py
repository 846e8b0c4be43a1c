"""CLI on a machine without a GPU (exit statuses, one-line errors, JSON schemas, compile progress,
parallel compiles, cache warming, cache info / clear), and the wheel: built from the repo,
installed elsewhere, it must find and compile its kernels."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gqadrv import cli
from gqadrv._version import __version__
from gqadrv.runtime.driver import gpu_status

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = not gpu_status()[0]


def run(*args, env=None, cwd=ROOT):
    e = dict(os.environ)
    e.pop("GQADRV_LOG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gqadrv", *args], capture_output=True, text=True, cwd=cwd, env=e, timeout=600)


def one_line_error(r, status=2):
    """A failed command: the given exit status, one `gqadrv <cmd>: error: ...` line, no traceback."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"^gqadrv( \w+)*: error: ", lines[0]), r.stderr
    return lines[0]


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gqadrv {__version__}", r.stdout + r.stderr


def test_help_documents_the_exit_statuses():
    for args in ((), ("compile",), ("selftest",)):
        r = run(*args, "--help")
        assert r.returncode == 0
        for code in ("0 ", "1 ", "2 ", "3 ", "130"):
            assert f"  {code}" in r.stdout, (args, r.stdout)


def test_info_without_gpu_reports_versions():
    r = run("info")
    assert r.returncode == 0, r.stderr
    for key in ("cuda.bindings", "cupy", "nvrtc", "cache"):
        assert key in r.stdout
    if NO_GPU:
        assert "GPU            none" in r.stdout


def test_info_json_schema(tmp_path):
    r = run("info", "--json", env={"GQADRV_CACHE_DIR": str(tmp_path / "c"), "GQADRV_CACHE_MAX_BYTES": "5M"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert tuple(d) == cli.INFO_KEYS and d["schema"] == "gqadrv.info/1" and d["version"] == __version__
    for key in ("gqadrv", "cuda.bindings", "cupy", "nvrtc"):
        assert key in d["versions"]
    assert tuple(d["cache"]) == cli.CACHE_KEYS
    assert d["cache"]["dir"] == str(tmp_path / "c") and d["cache"]["entries"] == 0 and d["cache"]["max_bytes"] == 5_000_000
    assert isinstance(d["gpu"]["available"], bool) and isinstance(d["gpu"]["reason"], str)
    assert d["gpu"]["available"] == (not NO_GPU)
    for dev in d["devices"]:
        assert tuple(dev) == cli.DEVICE_KEYS
    if NO_GPU:
        assert d["devices"] == []
    assert {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_110a", "sm_120"} <= set(d["compile_arches"])


@pytest.mark.parametrize("arch", ["sm_110a", "sm_100a", "sm_90a", "sm_80"])
def test_compile_command_writes_ptx_and_cubin(arch, tmp_path):
    r = run("compile", "--arch", arch, "--out", str(tmp_path), env={"GQADRV_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == "", r.stderr  # no log output unless GQADRV_LOG is set
    cubins = sorted(tmp_path.glob(f"*.{arch}.cubin"))
    ptxs = sorted(tmp_path.glob(f"*.{arch}.ptx"))
    assert cubins and len(cubins) == len(ptxs)
    assert "spill st/ld" in r.stdout and "0/0" in r.stdout
    n = len(cubins)
    progress = [ln for ln in r.stdout.splitlines() if re.match(r"^\[ *\d+/\d+\] ", ln)]
    assert len(progress) == n and progress[-1].startswith(f"[{n}/{n}]")
    assert progress[0].startswith(f"[{1:>{len(str(n))}}/{n}]")
    assert f"{n} modules for {arch}: {n} compiled, 0 from the cache, 0 failed, 0 spilling" in r.stdout
    text = ptxs[0].read_text()
    assert ".target sm_" in text


@pytest.fixture(scope="module")
def sm86(tmp_path_factory):
    """`compile --arch sm_86 --json` with --jobs 1 and --jobs 2, each into its own cache and --out."""
    out = {}
    for jobs in (1, 2):
        base = tmp_path_factory.mktemp(f"sm86_j{jobs}")
        r = run("compile", "--arch", "sm_86", "--jobs", str(jobs), "--json", "--out", str(base / "out"),
                env={"GQADRV_CACHE_DIR": str(base / "cache")})
        out[jobs] = (r, base)
    return out


def test_compile_json_schema_and_progress(sm86):
    r, base = sm86[1]
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # stdout holds the JSON object only
    assert tuple(d) == cli.COMPILE_KEYS and d["schema"] == "gqadrv.compile/1"
    assert d["arches"] == ["sm_86"] and d["jobs"] == 1 and d["ok"] is True
    assert d["out"] == str(base / "out") and d["cache"] == {"dir": str(base / "cache"), "enabled": True}
    assert tuple(d["summary"]) == cli.SUMMARY_KEYS
    n = len(d["modules"])
    assert n == d["summary"]["modules"] == d["summary"]["compiled"] > 0
    assert d["summary"]["cached"] == d["summary"]["failed"] == d["summary"]["spilling"] == 0
    for m in d["modules"]:
        assert tuple(m) == cli.MODULE_KEYS
        assert m["arch"] == "sm_86" and m["ok"] and m["error"] is None and not m["cached"]
        assert m["regs"] > 0 and m["spill_stores"] == m["spill_loads"] == 0 and len(m["key"]) == 64
        assert isinstance(m["seconds"], float)
    # the table and the [i/N] progress lines go to stderr with --json
    assert re.search(rf"^\[ *1/{n}\] ", r.stderr, re.M) and re.search(rf"^\[{n}/{n}\] ", r.stderr, re.M)
    assert len(list((base / "out").glob("*.sm_86.cubin"))) == n


def test_compile_jobs_2_equals_jobs_1(sm86):
    (r1, b1), (r2, b2) = sm86[1], sm86[2]
    assert r2.returncode == 0, r2.stderr
    d1, d2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert d2["jobs"] == 2
    drop = ("seconds",)
    strip = lambda d: [{k: v for k, v in m.items() if k not in drop} for m in d["modules"]]  # noqa: E731
    assert strip(d1) == strip(d2)  # same modules, same order, same keys and resources
    for f in (b1 / "out").iterdir():
        assert (b2 / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    names = [sorted(p.name for p in (b / "cache").rglob("*.cubin.gq")) for b in (b1, b2)]
    assert names[0] == names[1] and len(names[0]) == len(d1["modules"])


def test_compile_sm86_warms_exactly_what_the_runtime_loads_there(sm86):
    """On an sm_86 GPU the GQA router picks the portable / short families (declared for sm_80; the
    merge_state family and the FP8 quantizers too) and ops.kernels.load compiles them for arch_for_cc((8, 6)) = sm_86: `compile --arch sm_86` must have
    written exactly those cache entries (same source, arch and defines: same key)."""
    from gqadrv.gqa import routes
    from gqadrv.gqa.contract import MAX_GROUP, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
    from gqadrv.runtime.cache import CubinCache
    from gqadrv.runtime.compiler import arch_for_cc, compile_module

    r, base = sm86[1]
    compiled = {m["key"] for m in json.loads(r.stdout)["modules"]}
    cache = CubinCache(base / "cache")
    cc = (8, 6)
    routed = set()
    for dtype in SUPPORTED_DTYPES:
        for d in SUPPORTED_HEAD_DIMS:
            for group in range(1, MAX_GROUP + 1):
                for capacity in (16, routes.SHORT_CAPACITY_MAX, 4096, 65536):
                    for backend in (None, "portable"):
                        v = routes.select_variant(cc, capacity, d, dtype, group, backend=backend, ctas=4096, sm_count=84)
                        m = compile_module(v.family.source, arch_for_cc(cc), v.defines, cache=cache)
                        assert m.from_cache, f"{v.name} for sm_86 was not warmed"
                        routed.add(m.key)
                for rows in (4, 16, 64):  # the paged family (cp.async: the only paged route off sm_90)
                    for kv8 in (False, True):  # fp16 / bf16 caches and e4m3 caches
                        v = routes.select_paged_variant(cc, d, dtype, rows, kv8=kv8)
                        m = compile_module(v.family.source, arch_for_cc(cc), v.defines, cache=cache)
                        assert m.from_cache, f"{v.name} for sm_86 was not warmed"
                        routed.add(m.key)
    from gqadrv.gqa import merge  # the LSE state merge: one module per dtype and load batch

    for dtype in merge.SUPPORTED_DTYPES:
        for num_states in (1, 2, 3, 64, 1000):
            v = merge.variant_for(dtype, num_states)
            m = compile_module(v.family.source, arch_for_cc(cc), v.defines, cache=cache)
            assert m.from_cache, f"{v.name} for sm_86 was not warmed"
            routed.add(m.key)
    # the FP8 quantizers: what kv_fp8.route (amax and quantize per dtype) and fp8_cache.route load
    from gqadrv.gqa import kv_fp8
    from gqadrv.mla import fp8_cache

    fp8_variants = [kv_fp8.KvFp8Variant(fam, dt) for fam in (kv_fp8.AMAX, kv_fp8.QUANTIZE)
                    for dt in kv_fp8.SUPPORTED_DTYPES]
    fp8_variants += [fp8_cache.Fp8CacheVariant(fam) for fam in (fp8_cache.QUANTIZE, fp8_cache.DEQUANTIZE)]
    for v in fp8_variants:
        m = compile_module(v.family.source, arch_for_cc(cc), v.defines, cache=cache)
        assert m.from_cache, f"{v.name} for sm_86 was not warmed"
        routed.add(m.key)
    assert routed == compiled


@pytest.mark.parametrize("arch", ["hopper", "sm_101a", "sm_90", "sm_75", "sm_80,bogus"])
def test_compile_rejects_a_bad_arch(arch):
    r = run("compile", "--arch", arch)
    line = one_line_error(r, 2)
    assert "invalid architecture" in line or "unsupported architecture" in line
    assert "sm_86" in line and "sm_90a" in line  # names the accepted targets


def test_compile_accepts_every_target_the_runtime_picks(tmp_path):
    from gqadrv.runtime.compiler import arch_for_cc

    arches = [arch_for_cc(cc) for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0))]
    assert arches == ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_110a", "sm_120"]
    r = run("compile", "--arch", ",".join(arches), "--arch", "sm_86", "--only", "short_float16_d128_r8_*",
            "--json", "-j", "2", env={"GQADRV_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["arches"] == arches  # deduplicated, in order
    assert [m["arch"] for m in d["modules"]] == arches and all(m["ok"] for m in d["modules"])


def test_compile_arch_all_lists_every_target():
    from gqadrv.runtime.compiler import target_arches

    r = run("compile", "--arch", "all", "--only", "no_such_module*")
    line = one_line_error(r, 2)
    assert "no module of " + ", ".join(target_arches()) + " matches" in line


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
def test_compile_arch_auto_needs_a_gpu():
    line = one_line_error(run("compile", "--arch", "auto"), 2)
    assert "--arch auto needs a GPU" in line


def test_compile_rejects_an_unusable_out(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in one_line_error(run("compile", "--arch", "sm_80", "--out", str(f)))
    assert "--out /proc/forbidden" in one_line_error(run("compile", "--arch", "sm_80", "--out", "/proc/forbidden"))
    assert "--out" in one_line_error(run("compile", "--arch", "sm_80", "--out", str(f / "sub")))


@pytest.mark.parametrize("args", [
    ("bench", "--op", "nosuch"), ("bench", "--reps", "0"), ("compile", "--arch", "sm_80", "--jobs", "-1"),
    ("compile", "--arch", "sm_80", "--jobs", "many"), ("compile",), ("demo", "--capacity", "0"),
    ("demo", "--capacity", "x"), ("nosuch",), ("cache",), ("cache", "purge"), ()])
def test_bad_arguments_are_one_line_errors(args):
    one_line_error(run(*args), 2)


def _in_process(monkeypatch, tmp_path, argv, capsys):
    from gqadrv.runtime import cache as cache_mod

    monkeypatch.setenv("GQADRV_CACHE_DIR", str(tmp_path))
    cache_mod.reset_default_cache()
    try:
        rc = cli.main(argv)
    finally:
        cache_mod.reset_default_cache()
    return rc, capsys.readouterr()


def test_compile_exits_1_when_nothing_is_compiled(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "compile_jobs", lambda arches: [])  # e.g. an arch no family builds for
    rc, io = _in_process(monkeypatch, tmp_path, ["compile", "--arch", "sm_86"], capsys)
    assert rc == 1 and io.err.startswith("gqadrv compile: error: nothing to compile for sm_86"), io.err


def test_compile_exits_1_on_a_compile_error(monkeypatch, tmp_path, capsys):
    real = cli.compile_jobs
    broken = ("broken", "sm_86", "no/such.cu", "k", {})
    monkeypatch.setattr(cli, "compile_jobs", lambda arches: real(arches)[:1] + [broken])
    rc, io = _in_process(monkeypatch, tmp_path, ["compile", "--arch", "sm_86", "--json"], capsys)
    assert rc == 1 and "Traceback" not in io.err
    d = json.loads(io.out)
    assert d["ok"] is False and d["summary"]["failed"] == 1 and d["summary"]["compiled"] == 1
    bad = d["modules"][1]
    assert bad["name"] == "broken" and not bad["ok"] and "no/such.cu not found" in bad["error"] and bad["regs"] is None
    assert re.search(r"^\[2/2\] broken +FAILED: kernel source no/such.cu not found", io.err, re.M)
    assert io.err.strip().splitlines()[-1].startswith("gqadrv compile: error: 1 module(s) failed")


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_gpu_commands_explain_the_missing_gpu(cmd):
    r = run(cmd)
    assert "no usable NVIDIA GPU" in one_line_error(r, 2)


def test_selftest_cpu_part():
    r = run("selftest", "--cpu-only")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "oracle vs direct formula" in r.stdout and "CPU part passed" in r.stdout


def test_selftest_exits_3_when_the_gpu_half_is_skipped():
    r = run("selftest")
    assert "oracle vs direct formula" in r.stdout
    if NO_GPU:
        assert r.returncode == 3, r.stdout + r.stderr
        assert "GPU part skipped" in r.stdout and "exit status 3" in r.stderr and "--cpu-only" in r.stderr
    else:
        assert r.returncode == 0, r.stdout + r.stderr


def test_cache_info_and_clear(tmp_path):
    cdir = tmp_path / "cache"
    env = {"GQADRV_CACHE_DIR": str(cdir)}
    r = run("compile", "--arch", "sm_80", "--only", "short_float16_d64_*", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (cdir / "README").write_text("not gqadrv's")  # foreign files in the directory stay
    sub = next(p for p in cdir.iterdir() if p.is_dir() and len(p.name) == 2)
    (sub / "notes.txt").write_text("not gqadrv's either")
    r = run("cache", "info", "--json", env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["schema"] == "gqadrv.cache/1" and tuple(info)[1:] == cli.CACHE_KEYS
    assert info["dir"] == str(cdir) and info["enabled"] is True and info["entries"] == 2 and info["bytes"] > 0
    assert info["max_bytes"] is None
    r = run("cache", "info", env=env)
    assert r.returncode == 0 and "entries    2" in r.stdout and str(cdir) in r.stdout
    r = run("cache", "clear", "--json", env=env)
    assert r.returncode == 0, r.stderr
    cleared = json.loads(r.stdout)
    assert cleared["removed_entries"] == 2 and cleared["removed_bytes"] == info["bytes"]
    assert (cdir / "README").exists() and (sub / "notes.txt").exists()
    assert json.loads(run("cache", "info", "--json", env=env).stdout)["entries"] == 0
    r = run("cache", "clear", env=env)
    assert r.returncode == 0 and r.stdout.startswith("removed 0 entries")


def test_wheel_ships_and_compiles_its_kernels(tmp_path):
    wheel_dir = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT)]
    try:  # without network (GPU machines) build with the local setuptools when it is recent enough
        import setuptools
        import wheel  # noqa: F401

        if int(setuptools.__version__.split(".")[0]) >= 68:
            cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    b = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout + b.stderr
    wheels = list(wheel_dir.glob("gqadrv-*.whl"))
    assert len(wheels) == 1
    import zipfile

    shipped = {n for n in zipfile.ZipFile(wheels[0]).namelist() if n.startswith("gqadrv/_kernels/")}
    kernels = ROOT / "kernels"
    sources = {"gqadrv/_kernels/" + p.relative_to(kernels).as_posix() for p in kernels.rglob("*")
               if p.suffix in (".cu", ".cuh")}
    assert len(sources) > 10 and sources <= shipped, f"kernels missing from the wheel: {sorted(sources - shipped)}"
    py = {n for n in zipfile.ZipFile(wheels[0]).namelist() if n.endswith(".py")}
    for pkg in ("gqadrv/ops/__init__.py", "gqadrv/gqa/__init__.py", "gqadrv/runtime/__init__.py"):
        assert pkg in py, f"{pkg} missing from the wheel"
    site = tmp_path / "site"
    i = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheels[0])],
                       capture_output=True, text=True, timeout=600)
    assert i.returncode == 0, i.stdout + i.stderr
    probe = (
        "import gqadrv, gqadrv.runtime.compiler as c\n"
        "from gqadrv.runtime.cache import CubinCache\n"
        "root = c.kernels_root()\n"
        "assert str(root).startswith(%r), root\n"
        "m = c.compile_module('gqa/sm90/decode_tma.cu', 'sm_90a', dict(GQA_DT=0, GQA_D=128, GQA_ROWS=8, GQA_WARPS=4, GQA_TOK=32, GQA_STAGES=2), cache=CubinCache(None, False))\n"
        "print('ok', root, len(m.cubin))\n"
    ) % str(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok")


def test_constraints_pin_only_declared_dependencies():
    """constraints/tested-h200.txt pins the tested set of gqadrv's own dependencies (nothing else),
    each with a version specifier."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    pins = [ln.strip() for ln in (root / "constraints" / "tested-h200.txt").read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]
    names = {re.split(r"[<>=!~;\[ ]", p, maxsplit=1)[0].lower() for p in pins}
    assert pins and names <= declared, names - declared
    assert {"cuda-bindings", "cuda-core", "cupy-cuda13x", "nvidia-cuda-nvrtc"} <= names
    assert all(re.search(r"(==|<|>)", p) for p in pins), pins


@pytest.mark.parametrize("shape", ["1,64,1", "1,64,[1;2]", "x,64", "1", "1,64,[65]", "0,64", "1,64,32,8",
                                   "16,4096,32,8,128,float32"])
@pytest.mark.parametrize("opt", ["--only", "--shapes"])
def test_bench_rejects_a_malformed_shape_before_looking_for_a_gpu(opt, shape):
    line = one_line_error(run("bench", opt, shape), 2)
    assert f"{opt}: shape {shape!r}" in line, line


def test_bench_shape_parser_accepts_the_documented_forms():
    from gqadrv.gqa.bench import GEOMETRY_SHAPES, LARGE_SHAPES, SEED_SHAPES, parse_shape

    for text in SEED_SHAPES + LARGE_SHAPES + GEOMETRY_SHAPES:
        parse_shape(text)
    s = parse_shape("2,64,[1;64],16,4,256,bfloat16")
    assert (s.batch, s.capacity, s.lengths, s.hq, s.hkv, s.d, s.dtype) == (2, 64, [1, 64], 16, 4, 256, "bfloat16")
