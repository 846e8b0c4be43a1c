"""LaunchPlan's launch configuration on the CPU, with a fake driver module: grid, block, shared
memory, stream and the launch attributes (PDL, cluster dims), which are built once per combination
and shared by the plans that use it (runtime/module._launch_attributes)."""

from __future__ import annotations

import types

import pytest

from gqadrv.runtime import driver, module


class FakeDriver:
    PDL, CLUSTER = 6, 4

    class CUlaunchAttributeID:
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
        CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4

    class CUlaunchConfig:
        pass

    class CUlaunchAttribute:
        made = 0

        def __init__(self):
            FakeDriver.CUlaunchAttribute.made += 1
            self.id = None
            self.value = types.SimpleNamespace(clusterDim=types.SimpleNamespace(x=0, y=0, z=0))

    @staticmethod
    def cuLaunchKernelEx(cfg, func, args, extra):
        return (0,)


class Kern:
    name, function = "k", 1

    def ensure_dynamic_smem(self, n):
        pass


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setattr(driver, "driver", lambda: FakeDriver)
    monkeypatch.setattr(module, "_ATTRIBUTES", {})
    FakeDriver.CUlaunchAttribute.made = 0
    return FakeDriver


def _plan(pdl=False, cluster=None, grid=(8, 1, 1)):
    return module.LaunchPlan(Kern(), grid, (128, 1, 1), 4096, types.SimpleNamespace(address=0), stream=7, pdl=pdl,
                             cluster=cluster)


def test_configuration_fields(fake_driver):
    p = _plan(pdl=True, grid=(8, 2, 1))
    cfg = p._cfg
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (8, 2, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (128, 1, 1)
    assert cfg.sharedMemBytes == 4096 and cfg.hStream == 7
    (a,) = cfg.attrs
    assert cfg.numAttrs == 1 and a.id == FakeDriver.PDL and a.value.programmaticStreamSerializationAllowed == 1


def test_attributes_are_built_once_per_combination(fake_driver):
    plans = [_plan(pdl=True, grid=(g, 1, 1)) for g in (1, 2, 3)]
    assert fake_driver.CUlaunchAttribute.made == 1
    assert all(p._cfg.attrs is plans[0]._cfg.attrs for p in plans)
    none = _plan(pdl=False)
    assert none._cfg.attrs == [] and none._cfg.numAttrs == 0
    both = _plan(pdl=True, cluster=[2, 1, 1], grid=(4, 1, 1))
    assert [a.id for a in both._cfg.attrs] == [FakeDriver.PDL, FakeDriver.CLUSTER]
    c = both._cfg.attrs[1].value.clusterDim
    assert (c.x, c.y, c.z) == (2, 1, 1)
    other = _plan(pdl=True, cluster=(4, 1, 1), grid=(4, 1, 1))
    assert other._cfg.attrs[1].value.clusterDim.x == 4 and both._cfg.attrs[1].value.clusterDim.x == 2
    assert fake_driver.CUlaunchAttribute.made == 1 + 2 + 2


def test_grid_width_changes_in_place(fake_driver):
    """reshape with the same shared memory and cluster (a layout entry re-sized for another batch or
    split count) rewrites the configuration's grid.x and refuses widths the launch could not take."""
    p = _plan(grid=(8, 2, 1))
    cfg = p._cfg
    p.reshape(24, p.smem, None)
    assert p._cfg is cfg and (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (24, 2, 1) and p.grid == (24, 2, 1)
    with pytest.raises(ValueError, match="positive"):
        p.reshape(0, p.smem, None)
    c = _plan(cluster=(2, 1, 1), grid=(8, 1, 1))
    with pytest.raises(ValueError, match="multiple of cluster"):
        c.reshape(9, c.smem, c.cluster)
    c.reshape(10, c.smem, c.cluster)
    assert c._cfg.gridDimX == 10


def test_reshape_switches_cluster_and_shared_memory(fake_driver):
    """reshape (a layout entry re-sized across the cluster-merge boundary) rewrites grid.x, the
    dynamic shared memory (opted in first) and the attributes in place, and refuses a grid that is
    not a multiple of the new cluster."""
    opted = []

    class K(Kern):
        def ensure_dynamic_smem(self, n):
            opted.append(n)

    p = module.LaunchPlan(K(), (16, 1, 1), (128, 1, 1), 4096, types.SimpleNamespace(address=0), stream=7, pdl=True)
    cfg = p._cfg
    p.reshape(64, 8192, (8, 1, 1))
    assert p._cfg is cfg and p.grid == (64, 1, 1) and cfg.gridDimX == 64
    assert p.smem == cfg.sharedMemBytes == 8192 and opted[-1] == 8192
    assert p.cluster == (8, 1, 1) and [a.id for a in cfg.attrs] == [FakeDriver.PDL, FakeDriver.CLUSTER]
    assert cfg.numAttrs == 2 and cfg.attrs[1].value.clusterDim.x == 8
    p.reshape(128, 4096, None)
    assert p.cluster is None and [a.id for a in cfg.attrs] == [FakeDriver.PDL] and cfg.numAttrs == 1
    assert p.smem == cfg.sharedMemBytes == 4096 and p.grid == (128, 1, 1)
    with pytest.raises(ValueError, match="multiple of cluster"):
        p.reshape(12, 8192, (8, 1, 1))
    assert p.cluster is None and p.grid == (128, 1, 1) and p.smem == 4096  # nothing changed
    with pytest.raises(ValueError, match="positive"):
        p.reshape(0, 4096, None)
