"""The typed public API: ``mypy --strict`` on the public surface and a typed caller's use of it
(tests/typing_usage.py), a negative control (tests/typing_usage_bad.py: each marked misuse must be
reported), ``py.typed`` shipped, the exported names, and the backend literals in step with the
route registries. CPU only; the mypy tests skip where mypy is not installed (the ``test`` extra
installs it)."""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib
import re
import subprocess
import sys
import typing

import numpy as np
import pytest

import gqadrv
from gqadrv import gqa, mla, runtime
from gqadrv.ops import registry
from gqadrv.types import Backend, DLPackArray, MlaBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOOD = "tests/typing_usage.py"
BAD = "tests/typing_usage_bad.py"


# ----------------------------------------------------------------------------- exported names
def test_top_level_all_covers_each_family():
    assert set(gqa.__all__) | set(mla.__all__) <= set(gqadrv.__all__)
    assert len(gqadrv.__all__) == len(set(gqadrv.__all__))
    for name in gqadrv.__all__:
        assert hasattr(gqadrv, name), name
    for fam in (gqa, mla):
        for name in fam.__all__:
            assert getattr(gqadrv, name) is getattr(fam, name), name


def test_error_types_exported():
    for name, mod in (("CudaDriverError", runtime), ("NoGpuError", runtime), ("CompileError", runtime),
                      ("TensorMapError", runtime), ("FeatureError", registry)):
        assert name in gqadrv.__all__
        cls = getattr(gqadrv, name)
        assert cls is getattr(mod, name) and issubclass(cls, Exception)


def test_backend_literals_match_route_registries():
    assert typing.get_args(Backend) == gqa.routes.BACKENDS
    assert typing.get_args(MlaBackend) == mla.routes.BACKENDS


def test_dlpack_protocol_is_runtime_checkable():
    assert isinstance(np.zeros(2), DLPackArray)
    assert not isinstance([1.0, 2.0], DLPackArray)


# ----------------------------------------------------------------------------- py.typed
def test_py_typed_marker_is_package_data():
    assert importlib.resources.files("gqadrv").joinpath("py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the line as written
        assert re.search(r'^"gqadrv" = \[[^\]]*"py\.typed"', text, re.MULTILINE)
        return
    data = tomllib.loads(text)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["gqadrv"]


# ----------------------------------------------------------------------------- mypy
_ERROR = re.compile(r"^(?P<path>[^:\n]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$", re.MULTILINE)
_MARK = re.compile(r"#\s*E:\s*(?P<code>[a-z-]+)\s*$")


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install '.[test]' installs it)")
    cache = tmp_path_factory.mktemp("mypy_cache")  # shared: the second run reuses the first's stubs

    def run(*files: str) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", "pyproject.toml", "--cache-dir",
               str(cache), "--no-color-output", *files]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           check=False)
        return p.returncode, p.stdout + p.stderr

    return run


def test_mypy_strict_public_surface_is_clean(mypy_run):
    rc, out = mypy_run()  # the files of [tool.mypy]: gqadrv/__init__.py, gqadrv/types.py, ..., tests/typing_usage.py
    assert rc == 0, out
    assert "Success: no issues found" in out, out


def test_mypy_rejects_each_marked_misuse(mypy_run):
    rc, out = mypy_run(BAD)
    assert rc == 1, out
    expected = {(i, m["code"]) for i, line in enumerate((ROOT / BAD).read_text().splitlines(), 1)
                if (m := _MARK.search(line))}
    assert len(expected) >= 15
    found = set()
    for m in _ERROR.finditer(out):
        assert pathlib.Path(m["path"]).as_posix() == BAD, m.group(0)
        found.add((int(m["line"]), m["code"]))
    assert found == expected, f"missing {sorted(expected - found)}, unexpected {sorted(found - expected)}\n{out}"
