"""Every example runs to completion on the GPU (each checks its own result and exits non-zero on error)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script,args", [
    ("serving_loop_cupy.py", []),
    ("prepared_graph.py", []),
    ("prepared_graph.py", ["--graph"]),
    ("prepared_graph.py", ["--graph", "--batch", "4", "--capacity", "256"]),
    ("torch_interop.py", []),
    ("jax_interop.py", []),
    ("tensor_parallel_decode.py", []),
    ("mla_decode_cupy.py", []),
])
def test_example(script, args, report):
    if script.startswith("torch"):
        pytest.importorskip("torch")
    if script.startswith("jax"):
        pytest.importorskip("jax")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0")
    # the checkout's package first, also where it is not pip-installed (a bare GPU machine)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES.parent), os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report(f"$ python examples/{script} {' '.join(args)}".rstrip())
    for ln in r.stdout.strip().splitlines()[-3:]:
        report("  " + ln)
