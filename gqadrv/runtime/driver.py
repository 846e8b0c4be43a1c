"""CUDA driver access: lazy import, error translation, device facts and primary contexts.

Everything goes through ``cuda.bindings.driver``. Nothing here touches the GPU at import time, so
the package imports (and NVRTC compiles) on machines without a driver; ``gpu_status()`` says why no
GPU is usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

__all__ = [
    "CudaDriverError",
    "DeviceInfo",
    "NoGpuError",
    "check",
    "device_info",
    "device_count",
    "multi_device",
    "device_scope",
    "driver",
    "enter_device",
    "leave_device",
    "driver_version",
    "ensure_init",
    "gpu_status",
    "primary_context",
]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed. ``result`` holds the CUresult name (e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, what: str, result_name: str, result_text: str, code: int):
        super().__init__(f"{what} failed: {result_name} ({result_text})")
        self.result = result_name
        self.code = code


class NoGpuError(RuntimeError):
    """No usable CUDA GPU (no driver library, no device, or cuInit failed)."""


@functools.cache
def driver():
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    from cuda.bindings import driver as drv

    return drv


def _result_strings(err) -> tuple[str, str]:
    drv = driver()
    try:
        name = drv.cuGetErrorName(err)[1]
        text = drv.cuGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - error reporting must never fail
        name, text = getattr(err, "name", str(err)), "no description"
    return name, text


def check(result, what: str):
    """Unpack a ``(CUresult, *outputs)`` tuple, raising CudaDriverError on failure."""
    err = result[0]
    if int(err) != 0:
        name, text = _result_strings(err)
        raise CudaDriverError(what, name, text, int(err))
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


_init_lock = threading.Lock()
_init_state: tuple[bool, str] | None = None


def gpu_status() -> tuple[bool, str]:
    """(usable, reason). Never raises: a missing driver or device is reported as text."""
    global _init_state
    if _init_state is not None:
        return _init_state
    with _init_lock:
        if _init_state is not None:
            return _init_state
        try:
            drv = driver()
        except Exception as exc:  # noqa: BLE001
            _init_state = (False, f"cuda.bindings is not importable: {exc}")
            return _init_state
        try:
            err = drv.cuInit(0)[0]
        except Exception as exc:  # noqa: BLE001 - DynamicLibNotFoundError when libcuda is absent
            _init_state = (False, f"no NVIDIA driver library (libcuda) on this machine: {type(exc).__name__}")
            return _init_state
        if int(err) != 0:
            name, text = _result_strings(err)
            _init_state = (False, f"cuInit failed: {name} ({text})")
            return _init_state
        err, n = drv.cuDeviceGetCount()
        if int(err) != 0 or n == 0:
            _init_state = (False, "the NVIDIA driver reports no CUDA device")
            return _init_state
        _init_state = (True, f"{n} CUDA device(s)")
        return _init_state


def ensure_init() -> None:
    ok, why = gpu_status()
    if not ok:
        raise NoGpuError(f"gqadrv needs an NVIDIA GPU: {why}")


def device_count() -> int:
    ok, _ = gpu_status()
    if not ok:
        return 0
    return check(driver().cuDeviceGetCount(), "cuDeviceGetCount")


_multi: list = []


def multi_device() -> bool:
    """True in a process that sees more than one GPU: launches must then make the target device's
    primary context current (``device_scope``), since the caller's current context may belong to
    another GPU. Computed once per process (the device count does not change)."""
    if not _multi:
        _multi.append(device_count() > 1)
    return _multi[0]


def driver_version() -> int | None:
    """CUDA version the driver supports (e.g. 13000), or None without a driver."""
    try:
        return int(check(driver().cuDriverGetVersion(), "cuDriverGetVersion"))
    except Exception:  # noqa: BLE001
        return None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    cc: tuple[int, int]
    sm_count: int
    smem_optin: int
    l2_bytes: int
    total_memory: int
    mem_clock_khz: int = 0   # peak memory clock (CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE); 0: not reported
    mem_bus_bits: int = 0    # global memory bus width (CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)

    @property
    def arch(self) -> str:
        return f"{self.cc[0]}.{self.cc[1]}"

    @property
    def peak_dram_bytes_per_s(self) -> float | None:
        """The datasheet DRAM bandwidth, 2 transfers per memory clock x bus width (H100 SXM 3.35e12,
        H200 4.9e12); None when the driver reports no memory clock or bus width."""
        if self.mem_clock_khz <= 0 or self.mem_bus_bits <= 0:
            return None
        return 2.0 * self.mem_clock_khz * 1e3 * self.mem_bus_bits / 8


@functools.cache
def device_info(ordinal: int) -> DeviceInfo:
    ensure_init()
    drv = driver()
    n = device_count()
    if not 0 <= ordinal < n:
        raise ValueError(f"CUDA device {ordinal} does not exist (this machine has {n})")
    dev = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    A = drv.CUdevice_attribute

    def attr(a):
        return int(check(drv.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute"))

    raw = check(drv.cuDeviceGetName(128, dev), "cuDeviceGetName")
    name = raw.split(b"\0")[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return DeviceInfo(
        ordinal=ordinal,
        name=name,
        cc=(attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        smem_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        l2_bytes=attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        total_memory=int(check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
        mem_clock_khz=attr(A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
        mem_bus_bits=attr(A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
    )


_ctx_lock = threading.Lock()
_primary: dict[int, object] = {}


def primary_context(ordinal: int):
    """The device's primary context (retained once; shared with CuPy, torch and cuda.core)."""
    ctx = _primary.get(ordinal)
    if ctx is not None:
        return ctx
    with _ctx_lock:
        ctx = _primary.get(ordinal)
        if ctx is None:
            ensure_init()
            drv = driver()
            dev = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _primary[ordinal] = ctx
    return ctx


@contextlib.contextmanager
def device_scope(ordinal: int):
    """Make ``ordinal``'s primary context current for the block, restoring the previous one."""
    drv = driver()
    target = primary_context(ordinal)
    prev = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    switch = int(prev) != int(target)
    if switch:
        check(drv.cuCtxSetCurrent(target), "cuCtxSetCurrent")
    try:
        yield
    finally:
        if switch:
            check(drv.cuCtxSetCurrent(prev), "cuCtxSetCurrent")


_primary_int: dict[int, int] = {}


def enter_device(ordinal: int):
    """Make ``ordinal``'s primary context current; returns the context to restore with
    ``leave_device`` (None when it already was current). The cheap form of ``device_scope`` for
    per-launch paths: one cuCtxGetCurrent when nothing has to change."""
    drv = driver()
    target = primary_context(ordinal)
    t = _primary_int.get(ordinal)
    if t is None:
        t = _primary_int[ordinal] = int(target)
    prev = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(prev) == t:
        return None
    check(drv.cuCtxSetCurrent(target), "cuCtxSetCurrent")
    return prev


def leave_device(prev) -> None:
    if prev is not None:
        check(driver().cuCtxSetCurrent(prev), "cuCtxSetCurrent")
