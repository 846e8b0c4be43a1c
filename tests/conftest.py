"""Shared test setup: the `gpu` marker skips cleanly (with the reason) on machines without a GPU."""

import os

import pytest

# The driver's JIT cache (~/.nv/ComputeCache) lets NVRTC skip ptxas for a module it compiled before
# on a machine with a driver, and then the ptxas resource report is empty. Tests read that report.
os.environ.setdefault("CUDA_CACHE_DISABLE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU; skipped with a reason where there is none")


def pytest_collection_modifyitems(config, items):
    from gqadrv.runtime.driver import gpu_status

    ok, why = gpu_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def launches(monkeypatch):
    """Counts LaunchPlan launches (wrapping the real one): the kernel of each, in order."""
    from gqadrv.runtime.module import LaunchPlan

    calls = []
    orig = LaunchPlan.launch

    def counted(self, stream=None):
        calls.append(self.kernel.name)
        return orig(self, stream)

    monkeypatch.setattr(LaunchPlan, "launch", counted)
    return calls


@pytest.fixture(scope="session")
def isolated_cache(tmp_path_factory):
    from gqadrv.runtime.cache import CubinCache

    return CubinCache(tmp_path_factory.mktemp("cubins"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import os
    import sys

    mod = sys.modules.get("tests.helpers")
    lines = []
    if mod is not None and getattr(mod, "MAX_ERRORS", None):
        lines.append("max |gqadrv - float64 oracle| per path and dtype:")
        for k, v in sorted(mod.MAX_ERRORS.items()):
            lines.append(f"  {k:40s} {v:.3e}")
    extra = getattr(config, "_gqadrv_report", [])
    lines.extend(extra)
    if lines:
        terminalreporter.write_sep("=", "gqadrv report")
        for ln in lines:
            terminalreporter.write_line(ln)
        path = os.environ.get("GQADRV_TEST_REPORT")
        if path:
            with open(path, "a") as f:
                f.write("\n".join(lines) + "\n")


@pytest.fixture
def report(request):
    """Append a line to the end-of-run gqadrv report (printed and written to $GQADRV_TEST_REPORT)."""
    lines = request.config.__dict__.setdefault("_gqadrv_report", [])
    return lines.append
