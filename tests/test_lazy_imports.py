"""Every relative import inside a gqadrv function (the lazy imports of bench, GPU-only and optional
paths, which no CPU test executes) names a module that exists. A moved file once left
``from .gqa.reference import ...`` in gqadrv/gqa/bench.py, which only failed on the GPU machine."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import gqadrv

PKG = Path(gqadrv.__file__).parent


def _function_imports():
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        package = ".".join(parts[:-1])  # the package a relative import starts from (also for __init__)
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    yield pytest.param(package, node, id=f"{path.relative_to(PKG)}:{node.lineno}")


@pytest.mark.parametrize(("package", "node"), list(_function_imports()))
def test_relative_import_in_function_resolves(package, node):
    name = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"line {node.lineno}: module {name} does not exist"
    if node.module is None:  # from . import x: x is a submodule or a name of the package
        for alias in node.names:
            sub = importlib.util.find_spec(f"{name}.{alias.name}")
            assert sub is not None or hasattr(importlib.import_module(name), alias.name), (
                f"line {node.lineno}: {name} has no {alias.name}")
