"""Launch plans of convenience calls: one ``LaunchPlan`` (pre-built launch config + argument
buffer) per (kernel, grid, block, smem, stream), re-packed and launched under one lock so that
concurrent threads cannot interleave their arguments. The op packs its own values; this module
knows nothing about what they mean."""

from __future__ import annotations

import threading

from ..runtime import driver as _drv
from ..runtime.module import ArgPack, Kernel, LaunchPlan, Signature
from .bounded import BoundedMap

__all__ = ["launch_packed"]

_plans = BoundedMap(256)
_lock = threading.Lock()


def launch_packed(kernel: Kernel, grid: tuple, block: tuple, smem: int, signature: Signature, stream: int,
                  values: tuple, device: int, pdl: bool = True, cluster: tuple | None = None) -> None:
    """Pack ``values`` (one per parameter of ``signature``) into the cached plan and launch it on
    ``stream`` (with the device's context current in processes that see several GPUs)."""
    key = (kernel.function_int, grid, block, smem, stream, cluster)
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans.put(key, LaunchPlan(kernel, grid, block, smem, ArgPack(signature), stream=stream, pdl=pdl,
                                              cluster=cluster))
        plan.args.pack(*values)
        if _drv.multi_device():
            with _drv.device_scope(device):
                plan.launch()
        else:
            plan.launch()
