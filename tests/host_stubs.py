"""The GPU-facing steps of the convenience paths stubbed out, so that their Python work runs on a
machine without a GPU: the host-cost tool (tools/profile_host_cpu.py) and the CPU tests that compare
two host paths' launches byte for byte (tests/gqa/test_layout_family_host.py).

``stub_gpu(monkeypatch)`` replaces the driver (init, device facts, launch configuration,
cuLaunchKernelEx), module loading, tensor-map encoding (a fixed 128-byte pattern holding the
address), workspace allocation, stream queries and producer ordering; ``FakeT`` arrays (numpy
buffers that say they live on a CUDA device) are read by a registered fast reader, like CuPy arrays.
"""

from __future__ import annotations

import contextlib
import types

import pytest

from tests.fakes import FakeCudaArray, register_fast_kind


class FakeT(FakeCudaArray):
    """A fake device array of the fast readers' registered kind."""


def stub_gpu(mp: pytest.MonkeyPatch) -> None:
    """Replace every GPU-facing step the convenience paths take (see the module docstring)."""
    from gqadrv.gqa import api as gqa_api
    from gqadrv.gqa import contract as gqa_contract
    from gqadrv.gqa import merge, merge_layouts, paged, paged_contract, paged_layouts
    from gqadrv.ops import contract as ops_contract
    from gqadrv.mla import api as mla_api
    from gqadrv.mla import contract as mla_contract
    from gqadrv.mla import layout_plans as mla_lp
    from gqadrv.ops import kernels, workspace
    from gqadrv.runtime import driver, module, streams, tensormap, tensors

    register_fast_kind(mp, FakeT)
    for mod in (gqa_api, mla_lp, paged_layouts, merge_layouts):
        mp.setattr(mod, "order_fast", lambda *a: None)
    for mod in (paged, merge):
        mp.setattr(mod, "launch_streams", lambda first, tensors, stream: (int(stream or 7), int(stream or 7)))
    mp.setattr(driver, "ensure_init", lambda: None)
    info = types.SimpleNamespace(cc=(9, 0), sm_count=132, name="H200 (stub)", l2_bytes=60 << 20,
                                 peak_dram_bytes_per_s=4.9e12)
    mp.setattr(driver, "device_info", lambda d: info)

    class Kernel:
        name, function = "stub", 1

        def ensure_dynamic_smem(self, n):
            pass

    loaded = types.SimpleNamespace(kernel=Kernel(), ctas_per_sm=1, arch="sm_90a")
    mp.setattr(kernels, "load", lambda variant, device: loaded)
    # an H100 / H200 runs 16 clusters of 2..8 CTAs of the TMA kernel at once (cuOccupancyMaxActiveClusters)
    mp.setattr(kernels, "max_active_clusters", lambda loaded, size, smem, block, device: 16)
    mp.setattr(merge, "load", lambda variant, device: loaded)
    mp.setattr(driver, "device_scope", lambda device: contextlib.nullcontext())
    mp.setattr(tensormap, "_encode", lambda spec: bytes(16) + spec.address.to_bytes(8, "little") + bytes(104))
    mp.setattr(tensormap, "_offset_state", [])
    mp.setattr(streams, "is_capturing", lambda s: False)
    for mod in (gqa_api, mla_api):
        mp.setattr(mod, "order_inputs", lambda t, d, s: s)
    mp.setattr(mla_api, "on_stream", lambda s, d: contextlib.nullcontext())

    class Ws:
        nbytes = 0

        def ptr(self, name):
            return 0x9000_0000

    mp.setattr(workspace, "pooled", lambda *a, **k: Ws())
    mp.setattr(module.LaunchPlan, "launch", lambda self, stream=None: None)

    class Drv:
        class CUlaunchConfig:
            pass

        class CUlaunchAttribute:
            def __init__(self):
                self.value, self.id = types.SimpleNamespace(clusterDim=types.SimpleNamespace()), 0

        class CUlaunchAttributeID:
            CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1
            CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4

        cuLaunchKernelEx = None

    mp.setattr(driver, "driver", lambda: Drv)

    def cupy_like_view(obj, name, *, stream=None, dtype=None, cupy_ordered=False):
        a = obj.a
        npdt = a.dtype
        dt = dtype or tensors._DT_NAMES.get(npdt) or tensors._DT_NAMES.setdefault(npdt, tensors._dtype_name(npdt))
        it = npdt.itemsize
        return tensors.TensorView(obj, name, a.__array_interface__["data"][0], a.shape,
                                  tuple(st // it for st in a.strides), dt, it, obj.device, "cupy")

    for mod in (gqa_contract, mla_contract, paged_contract, ops_contract):
        mp.setattr(mod, "as_view", cupy_like_view)
    mp.setattr(streams, "resolve_stream", lambda stream, device=0, framework=None: int(stream or 7))
