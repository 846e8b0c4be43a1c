"""CLI on a machine without a GPU, and the wheel: built from the repo, installed elsewhere, it must
find and compile its kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gqadrv.runtime.driver import gpu_status

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = not gpu_status()[0]


def run(*args, env=None, cwd=ROOT):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gqadrv", *args], capture_output=True, text=True, cwd=cwd, env=e, timeout=600)


def test_info_without_gpu_reports_versions():
    r = run("info")
    assert r.returncode == 0, r.stderr
    for key in ("cuda.bindings", "cupy", "nvrtc", "cache"):
        assert key in r.stdout
    if NO_GPU:
        assert "GPU            none" in r.stdout


@pytest.mark.parametrize("arch", ["sm_110a", "sm_100a", "sm_90a", "sm_80"])
def test_compile_command_writes_ptx_and_cubin(arch, tmp_path):
    r = run("compile", "--arch", arch, "--out", str(tmp_path), env={"GQADRV_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    cubins = sorted(tmp_path.glob(f"*.{arch}.cubin"))
    ptxs = sorted(tmp_path.glob(f"*.{arch}.ptx"))
    assert cubins and len(cubins) == len(ptxs)
    assert "spill st/ld" in r.stdout and "0/0" in r.stdout
    text = ptxs[0].read_text()
    assert ".target sm_" in text


def test_compile_rejects_a_bad_arch():
    r = run("compile", "--arch", "hopper")
    assert r.returncode != 0 and "invalid architecture" in r.stderr


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_gpu_commands_explain_the_missing_gpu(cmd):
    r = run(cmd)
    assert r.returncode == 2
    assert "no usable NVIDIA GPU" in r.stderr


def test_selftest_cpu_part():
    r = run("selftest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "oracle vs direct formula" in r.stdout


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
