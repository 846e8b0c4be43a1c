"""Loading cubins, per-device kernel handles, argument packing and launches.

* ``Library``: one cubin loaded with ``cuLibraryLoadData`` (context independent), shared by every
  device; ``Library.kernel(name, device)`` gives a ``Kernel`` for that device's primary context.
* ``Kernel``: CUfunction of one device, dynamic shared memory opted in once per (kernel, device).
* ``Signature``: the kernel's parameter list, described by us (the H200 driver lacks
  cuFuncGetParamCount), e.g. ``Signature(("desc", TMAP), ("args", NamedStruct("GqaArgs", ("q", "Q"), ...)))``.
* ``NamedStruct``: a by-value C struct parameter with named fields (mirrors a ``struct`` in a
  kernel header; offsets follow the C layout rules, checked by the CPU layout tests).
* ``ArgPack``: one host buffer holding every argument plus the ``void*[]`` pointing into it,
  packed once and reused by every launch; ``set_field("args.out", ptr)`` patches one field.
* ``LaunchPlan``: a pre-built ``CUlaunchConfig`` (grid, block, dynamic smem, stream, PDL and
  cluster attributes). ``LaunchPlan.launch()`` is a single ``cuLaunchKernelEx`` call.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import struct
import threading

from . import driver as _drv

__all__ = ["PTR", "I32", "U32", "F32", "TMAP", "Struct", "NamedStruct", "Signature", "ArgPack", "Library", "Kernel", "LaunchPlan", "load_library"]


@dataclasses.dataclass(frozen=True)
class ParamKind:
    name: str
    size: int
    align: int
    fmt: str | None  # struct format for scalars; None for raw byte blobs
    fields: tuple[tuple[str, int, str], ...] = ()  # NamedStruct: (name, byte offset, format char)


PTR = ParamKind("ptr", 8, 8, "<Q")
I32 = ParamKind("i32", 4, 4, "<i")
U32 = ParamKind("u32", 4, 4, "<I")
F32 = ParamKind("f32", 4, 4, "<f")
TMAP = ParamKind("tmap", 128, 64, None)  # CUtensorMap by value (128 raw bytes)


def Struct(fmt: str, align: int = 8) -> ParamKind:
    """A by-value C struct parameter laid out by a ``struct`` format (explicit padding included)."""
    return ParamKind(f"struct{fmt}", struct.calcsize(fmt), align, fmt)


_C_SIZES = {"Q": 8, "q": 8, "d": 8, "i": 4, "I": 4, "f": 4, "h": 2, "H": 2, "b": 1, "B": 1}


def NamedStruct(c_name: str, *fields: tuple[str, str]) -> ParamKind:
    """A by-value C struct whose fields are named: ``fields`` = (name, struct format char) in
    declaration order ("Q" pointer/int64, "i" int32, "I" uint32, "f" float). Offsets and the total
    size follow the C rules (each field at a multiple of its size, the struct padded to its largest
    alignment), so the Python mirror of a kernel header needs no hand-written padding."""
    off, out, fmt, align = 0, [], "<", 1
    for name, ch in fields:
        size = _C_SIZES[ch]
        pad = (-off) % size
        if pad:
            fmt += f"{pad}x"
            off += pad
        out.append((name, off, ch))
        fmt += ch
        off += size
        align = max(align, size)
    tail = (-off) % align
    if tail:
        fmt += f"{tail}x"
    kind = ParamKind(f"struct {c_name}", struct.calcsize(fmt), align, fmt, tuple(out))
    assert kind.size == off + tail
    return kind


class Signature:
    """Ordered (name, ParamKind) pairs of a kernel's parameters."""

    def __init__(self, *params: tuple[str, ParamKind]):
        self.params = tuple(params)
        self.names = tuple(n for n, _ in params)
        offs, off = [], 0
        for _, kind in params:
            off = (off + kind.align - 1) // kind.align * kind.align
            offs.append(off)
            off += kind.size
        self.offsets = tuple(offs)
        self.size = off
        # "param.field" -> (absolute byte offset, struct format) for ArgPack.set_field
        self.field_offsets: dict[str, tuple[int, str]] = {}
        for (pname, kind), poff in zip(params, offs):
            for fname, foff, ch in kind.fields:
                self.field_offsets[f"{pname}.{fname}"] = (poff + foff, "<" + ch)

    def __repr__(self) -> str:
        return "Signature(" + ", ".join(f"{n}: {k.name}" for n, k in self.params) + ")"


class ArgPack:
    """Host storage of one argument list: ``address`` is the ``void**`` for cuLaunchKernelEx."""

    def __init__(self, sig: Signature):
        self.sig = sig
        # 64-byte aligned storage (a tensor map is copied in by value; alignment is for tidiness).
        self._raw = ctypes.create_string_buffer(sig.size + 64)
        base = ctypes.addressof(self._raw)
        self._base = base + (-base) % 64
        n = max(1, len(sig.params))
        self._ptrs = (ctypes.c_void_p * n)(*[self._base + o for o in sig.offsets])
        self.address = ctypes.addressof(self._ptrs)
        self._view = (ctypes.c_char * max(1, sig.size)).from_address(self._base)

    def copy(self) -> "ArgPack":
        """A new pack of the same signature holding these bytes."""
        new = ArgPack(self.sig)
        ctypes.memmove(new._base, self._base, self.sig.size)
        return new

    def set(self, name: str, value) -> None:
        i = self.sig.names.index(name)
        self._write(i, value)

    def set_field(self, path: str, value) -> None:
        """Patch one field of a NamedStruct parameter, e.g. ``set_field("args.out", ptr)``."""
        try:
            off, fmt = self.sig.field_offsets[path]
        except KeyError:
            raise KeyError(f"{self.sig} has no struct field {path!r}") from None
        struct.pack_into(fmt, self._view, off, value)

    def get_field(self, path: str):
        off, fmt = self.sig.field_offsets[path]
        return struct.unpack_from(fmt, self._view, off)[0]

    def param_offset(self, name: str) -> int:
        """Byte offset of parameter ``name`` in the packed buffer (for ``patch``)."""
        return self.sig.offsets[self.sig.names.index(name)]

    def patch(self, offset: int, fmt: str, value) -> None:
        """Write ``value`` (``struct`` format ``fmt``) at absolute byte ``offset`` of the packed
        buffer: e.g. the 8 address bytes inside a by-value tensor map (``param_offset`` + k)."""
        struct.pack_into(fmt, self._view, offset, value)

    def param_bytes(self, name: str) -> bytes:
        """The packed bytes of one parameter."""
        i = self.sig.names.index(name)
        off = self.sig.offsets[i]
        return bytes(self._view[off:off + self.sig.params[i][1].size])

    def pack(self, *values) -> "ArgPack":
        if len(values) != len(self.sig.params):
            raise TypeError(f"{self.sig} takes {len(self.sig.params)} arguments, got {len(values)}")
        for i, v in enumerate(values):
            self._write(i, v)
        return self

    def _write(self, i: int, value) -> None:
        name, kind = self.sig.params[i]
        addr = self._base + self.sig.offsets[i]
        if kind.fmt is None or kind is TMAP:
            data = bytes(value)
            if len(data) != kind.size:
                raise ValueError(f"argument {name!r} needs {kind.size} bytes, got {len(data)}")
            ctypes.memmove(addr, data, kind.size)
        elif kind.name.startswith("struct"):
            if isinstance(value, dict):  # NamedStruct given by field name
                try:
                    ordered = [value[n] for n, _, _ in kind.fields]
                except KeyError:
                    ordered = None
                if ordered is None or len(value) != len(kind.fields):
                    missing = [n for n, _, _ in kind.fields if n not in value]
                    extra = set(value) - {n for n, _, _ in kind.fields}
                    raise ValueError(f"argument {name!r} ({kind.name}): missing fields {missing}, unknown {sorted(extra)}")
                value = ordered
            ctypes.memmove(addr, struct.pack(kind.fmt, *value), kind.size)
        else:
            ctypes.memmove(addr, struct.pack(kind.fmt, value), kind.size)

    def bytes(self) -> bytes:
        return ctypes.string_at(self._base, self.sig.size)


PORTABLE_CLUSTER_MAX = 8  # clusters up to this size run on every cluster-capable GPU; larger ones need
                          # Kernel.allow_non_portable_clusters


class Kernel:
    """One kernel of a loaded library on one device."""

    def __init__(self, library: "Library", name: str, device: int):
        drv = _drv.driver()
        self.library = library
        self.name = name
        self.device = device
        self.handle = _drv.check(drv.cuLibraryGetKernel(library.handle, name.encode()), f"cuLibraryGetKernel({name})")
        with _drv.device_scope(device):
            self.function = _drv.check(drv.cuKernelGetFunction(self.handle), f"cuKernelGetFunction({name})")
            # Force the lazy load now (never during graph capture or timing).
            A = drv.CUfunction_attribute
            self.num_regs = int(_drv.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, self.function), "cuFuncGetAttribute"))
            self.static_smem = int(
                _drv.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.function), "cuFuncGetAttribute")
            )
        self.function_int = int(self.function)
        self._smem_optin = 48 * 1024
        self._non_portable_clusters = False
        self._lock = threading.Lock()

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory (once per kernel and device)."""
        if nbytes <= self._smem_optin:
            return
        with self._lock:
            if nbytes <= self._smem_optin:
                return
            info = _drv.device_info(self.device)
            if nbytes + self.static_smem > info.smem_optin:
                raise RuntimeError(
                    f"kernel {self.name} needs {nbytes} B dynamic + {self.static_smem} B static shared memory; "
                    f"device {self.device} ({info.name}) allows {info.smem_optin} B per block"
                )
            drv = _drv.driver()
            A = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            with _drv.device_scope(self.device):
                _drv.check(drv.cuFuncSetAttribute(self.function, A, nbytes), f"cuFuncSetAttribute({self.name}, smem={nbytes})")
            self._smem_optin = nbytes

    def allow_non_portable_clusters(self) -> None:
        """Let launches use clusters of more than PORTABLE_CLUSTER_MAX CTAs (once per kernel and device;
        sm_90 runs up to 16). Set before cuOccupancyMaxActiveClusters is asked about such a size,
        which it refuses otherwise, and so before any launch with one."""
        if self._non_portable_clusters:
            return
        drv = _drv.driver()
        A = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        with self._lock, _drv.device_scope(self.device):
            _drv.check(drv.cuFuncSetAttribute(self.function, A, 1), f"cuFuncSetAttribute({self.name}, non-portable clusters)")
            self._non_portable_clusters = True


class Library:
    """A cubin loaded once per process with cuLibraryLoadData."""

    def __init__(self, cubin: bytes, label: str = ""):
        _drv.ensure_init()
        drv = _drv.driver()
        self.label = label
        self.cubin = cubin
        self.handle = _drv.check(drv.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), f"cuLibraryLoadData({label})")
        self._kernels: dict[tuple[str, int], Kernel] = {}
        self._lock = threading.Lock()

    def kernel(self, name: str, device: int) -> Kernel:
        k = self._kernels.get((name, device))
        if k is None:
            with self._lock:
                k = self._kernels.get((name, device))
                if k is None:
                    k = Kernel(self, name, device)
                    self._kernels[(name, device)] = k
        return k


_libraries: dict[str, Library] = {}
_lib_lock = threading.Lock()


def load_library(cubin: bytes, label: str = "") -> Library:
    """Load (or reuse) the library for this exact cubin."""
    key = hashlib.sha256(cubin).hexdigest()
    lib = _libraries.get(key)
    if lib is None:
        with _lib_lock:
            lib = _libraries.get(key)
            if lib is None:
                lib = Library(cubin, label)
                _libraries[key] = lib
    return lib


_ATTRIBUTES: dict = {}   # (driver module id, pdl, cluster) -> the launch attributes (never mutated)


def _launch_attributes(drv, pdl: bool, cluster: tuple[int, int, int] | None) -> list:
    """The launch attributes of a configuration (PDL, cluster dims), built once per combination:
    making a CUlaunchAttribute costs more than the rest of a launch configuration."""
    key = (id(drv), pdl, cluster)
    attrs = _ATTRIBUTES.get(key)
    if attrs is None:
        attrs = []
        if pdl:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if cluster is not None:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
            attrs.append(a)
        if len(_ATTRIBUTES) > 64:
            _ATTRIBUTES.clear()
        _ATTRIBUTES[key] = attrs
    return attrs


class LaunchPlan:
    """A kernel with its launch configuration and arguments, ready for repeated launches."""

    def __init__(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        args: ArgPack,
        stream: int = 0,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ):
        drv = _drv.driver()
        if min(grid) < 1 or min(block) < 1:
            raise ValueError(f"launch of {kernel.name}: grid {grid} and block {block} must be positive")
        if cluster is not None and grid[0] % cluster[0]:
            raise ValueError(f"launch of {kernel.name}: grid.x {grid[0]} is not a multiple of cluster.x {cluster[0]}")
        kernel.ensure_dynamic_smem(smem)
        self.kernel = kernel
        self.grid, self.block, self.smem, self.args = tuple(grid), tuple(block), int(smem), args
        self.pdl, self.cluster = bool(pdl), None if cluster is None else tuple(cluster)
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        cfg.hStream = int(stream)
        attrs = _launch_attributes(drv, self.pdl, None if cluster is None else tuple(cluster))
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self._attrs = attrs  # keep alive
        self._cfg = cfg
        self._stream = int(stream)
        self._launch = drv.cuLaunchKernelEx
        self._func = kernel.function

    def set_stream(self, stream: int) -> None:
        if stream != self._stream:
            self._cfg.hStream = stream
            self._stream = stream

    def reshape(self, grid_x: int, smem: int, cluster: tuple[int, int, int] | None) -> None:
        """Another grid width, dynamic shared-memory size and cluster shape (a layout entry re-sized
        for another batch size or split count, whose launch may switch between the ticket and the
        cluster merge); nothing changes when the new shape is refused."""
        if grid_x < 1:
            raise ValueError(f"launch of {self.kernel.name}: grid.x {grid_x} must be positive")
        cluster = None if cluster is None else tuple(cluster)
        if cluster is not None and grid_x % cluster[0]:
            raise ValueError(f"launch of {self.kernel.name}: grid.x {grid_x} is not a multiple of cluster.x {cluster[0]}")
        if smem != self.smem:
            self.kernel.ensure_dynamic_smem(smem)
            self._cfg.sharedMemBytes = self.smem = int(smem)
        if cluster != self.cluster:
            attrs = _launch_attributes(_drv.driver(), self.pdl, cluster)
            self._cfg.attrs = attrs
            self._cfg.numAttrs = len(attrs)
            self._attrs, self.cluster = attrs, cluster
        if grid_x != self.grid[0]:
            self._cfg.gridDimX = grid_x
            self.grid = (grid_x,) + self.grid[1:]

    @property
    def stream(self) -> int:
        """The plan's own stream (the one given at construction or by set_stream)."""
        return self._stream

    def launch(self, stream: int | None = None) -> None:
        """One cuLaunchKernelEx on the plan's stream, or on ``stream`` for this launch only (the
        plan's own stream is restored: a later ``launch()`` goes to the plan's stream again)."""
        if stream is None or stream == self._stream:
            err = self._launch(self._cfg, self._func, self.args.address, 0)[0]
        else:
            cfg = self._cfg
            cfg.hStream = stream
            try:
                err = self._launch(cfg, self._func, self.args.address, 0)[0]
            finally:
                cfg.hStream = self._stream
        if err:
            _drv.check((err,), f"cuLaunchKernelEx({self.kernel.name}, grid={self.grid}, block={self.block}, smem={self.smem})")


def launch_plans(plans, device: int, stream: int | None = None) -> None:
    """Launch ``plans`` in order (``LaunchPlan.launch(stream)``); in processes that see several GPUs
    with ``device``'s primary context current (``driver.enter_device``: one cuCtxGetCurrent when it
    already is), restored afterwards even when a launch raises. The per-launch form shared by
    ``launch_prepared`` and the layout-keyed convenience plans."""
    if _drv.multi_device():
        prev = _drv.enter_device(device)
        try:
            for p in plans:
                p.launch(stream)
        finally:
            _drv.leave_device(prev)
    else:
        for p in plans:
            p.launch(stream)
