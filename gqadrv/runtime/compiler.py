"""NVRTC -> CUBIN compilation with a content-addressed disk cache and ptxas resource reports.

Sources live in the package's ``kernels`` tree (shipped as package data). Quoted includes are
inlined here (with ``#line`` markers, so NVRTC errors name the original file and line), which
makes a compile independent of the file system and lets the cache key cover the exact source
closure. Angle includes (CUDA toolkit headers) are resolved only for modules that ask for them:
NVRTC >= 13.3 bundled headers, else the nvidia-cuda-runtime wheel, else $CUDA_HOME/include.

Targets: ``arch_for_cc(cc)`` is what the runtime compiles for on a GPU; ``target_arches()`` lists
it for every compute capability 8.0+ this NVRTC supports (``compile --arch`` accepts exactly
these); ``build_arch(target)`` says which claimed arch's kernel families a GPU of that target
loads (sm_86, sm_120, ... load the sm_80 families, compiled for their own target).

Every compile is logged on the ``gqadrv.compiler`` logger (runtime/log.py, GQADRV_LOG): label,
arch, cache hit (memory / disk) or miss, seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from pathlib import Path

from . import cache as _cache
from .log import get_logger

__all__ = [
    "ARCHES",
    "CompileError",
    "CompiledModule",
    "ResourceUsage",
    "arch_for_cc",
    "arch_number",
    "build_arch",
    "cc_for_arch",
    "check_target_arch",
    "compile_module",
    "cuda_header_options",
    "kernels_root",
    "nvrtc_version",
    "parse_ptxas_report",
    "source_closure",
    "target_arches",
]

# Architectures gqadrv claims (each kernel family says which of these it builds for).
ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
# Families built for this plain target use no arch-specific feature: on every GPU of compute
# capability 8.0+ whose target (arch_for_cc) is not in ARCHES, they are what the routers load.
PORTABLE_ARCH = "sm_80"
CACHE_FORMAT = 1
_log = get_logger("compiler")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel. ``log`` holds the full NVRTC log; ``location`` the first error."""

    def __init__(self, message: str, log: str = "", location: tuple[str, int] | None = None):
        super().__init__(message)
        self.log = log
        self.location = location


@dataclasses.dataclass(frozen=True)
class ResourceUsage:
    kernel: str
    registers: int
    shared_bytes: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    barriers: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CompiledModule:
    key: str
    source: str
    arch: str
    options: tuple[str, ...]
    cubin: bytes
    ptx: bytes
    log: str
    resources: dict  # kernel name -> ResourceUsage
    sources: tuple[str, ...]
    from_cache: bool
    seconds: float


# ----------------------------------------------------------------------------- locations
@functools.cache
def kernels_root() -> Path:
    """Directory holding the .cu/.cuh sources: the source checkout this package was imported from
    (``kernels/`` beside ``gqadrv/``), else the installed package data (gqadrv._kernels). The checkout
    comes first so that a second tree put on PYTHONPATH compiles its own kernels even where an
    editable install maps gqadrv._kernels to another checkout."""
    p = Path(__file__).resolve().parents[2] / "kernels"
    if (p / "common" / "ptx.cuh").is_file():
        return p
    try:
        import importlib.resources as ir

        p = Path(str(ir.files("gqadrv._kernels")))
        if (p / "common" / "ptx.cuh").is_file():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError(
        "gqadrv kernel sources were not found: neither the installed package data (gqadrv._kernels) "
        f"nor a source checkout ({p}) contains kernels/common/ptx.cuh. Reinstall gqadrv."
    )


# ----------------------------------------------------------------------------- NVRTC facts
def _nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


def _nck(result, what: str):
    err = result[0]
    if int(err) != 0:
        nv = _nvrtc()
        msg = nv.nvrtcGetErrorString(err)[1]
        msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise CompileError(f"{what} failed: {getattr(err, 'name', err)} ({msg})")
    return None if len(result) == 1 else (result[1] if len(result) == 2 else result[1:])


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    major, minor = _nck(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


@functools.cache
def nvrtc_supported_archs() -> tuple[int, ...]:
    return tuple(int(a) for a in _nck(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


_ARCH_RE = re.compile(r"^(?:sm_?)?(\d{2,3})([af]?)$")


def normalize_arch(arch: str) -> str:
    m = _ARCH_RE.match(arch.strip().lower())
    if not m:
        raise ValueError(f"invalid architecture {arch!r}: expected e.g. sm_80, sm_90a, sm_100a, sm_110a")
    return f"sm_{m.group(1)}{m.group(2)}"


def arch_number(arch: str) -> int:
    """sm_90a -> 90, sm_110a -> 110."""
    return int(_ARCH_RE.match(normalize_arch(arch)).group(1))


def arch_for_cc(cc: tuple[int, int]) -> str:
    """The NVRTC target for a device: arch-specific ('a') targets where gqadrv uses their features."""
    major, minor = cc
    if (major, minor) in ((9, 0), (10, 0), (10, 3), (11, 0)):
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


def cc_for_arch(arch: str) -> tuple[int, int]:
    """sm_86 -> (8, 6), sm_90a -> (9, 0), sm_120 -> (12, 0)."""
    n = arch_number(arch)
    return divmod(n, 10)


def target_arches() -> tuple[str, ...]:
    """Every target the runtime compiles for on a GPU of compute capability 8.0+ that this NVRTC
    can build: ``arch_for_cc(cc)`` for each supported cc (sm_80, sm_86, ..., sm_90a, sm_100a, sm_103a,
    sm_110a, sm_120, ...). ``python -m gqadrv compile --arch`` accepts exactly these."""
    out = []
    for n in nvrtc_supported_archs():
        if n >= 80:
            a = arch_for_cc(divmod(n, 10))
            if a not in out:
                out.append(a)
    return tuple(out)


def check_target_arch(arch: str) -> str:
    """``arch`` normalised, if it is one of target_arches(); ValueError naming the accepted ones."""
    accepted = target_arches()
    try:
        a = normalize_arch(arch)
    except ValueError:
        raise ValueError(f"invalid architecture {arch!r}: expected one of {', '.join(accepted)}") from None
    if a in accepted:
        return a
    hint = ""
    cc = cc_for_arch(a)
    if cc >= (8, 0) and arch_number(a) in nvrtc_supported_archs() and arch_for_cc(cc) != a:
        hint = f"; on compute capability {cc[0]}.{cc[1]} the runtime compiles for {arch_for_cc(cc)}"
    elif cc < (8, 0):
        hint = "; gqadrv needs compute capability 8.0 or newer"
    raise ValueError(
        f"unsupported architecture {a}{hint}; accepted (what the runtime compiles for on each GPU, "
        f"NVRTC {'.'.join(map(str, nvrtc_version()))}): {', '.join(accepted)}"
    )


def build_arch(target: str) -> str:
    """The entry of ARCHES whose kernel families a device with NVRTC target ``target`` loads:
    ``target`` itself when gqadrv claims it, else PORTABLE_ARCH (sm_86, sm_89, sm_103a, sm_120, ...
    load the families built for plain sm_80, compiled for ``target`` by ``ops.kernels.load``)."""
    a = normalize_arch(target)
    return a if a in ARCHES else PORTABLE_ARCH


# ----------------------------------------------------------------------------- headers
@functools.cache
def cuda_header_options() -> tuple[str, ...]:
    """Include options for CUDA toolkit headers (cuda_fp16.h & co.) that work on a clean machine."""
    major, minor = nvrtc_version()
    nv = _nvrtc()
    if (major, minor) >= (13, 3) and hasattr(nv, "nvrtcInstallBundledHeaders"):
        target = _cache.cache_dir() / f"nvrtc-headers-{major}.{minor}"
        try:
            target.mkdir(parents=True, exist_ok=True)
            _nck(nv.nvrtcInstallBundledHeaders(str(target).encode(), 0), "nvrtcInstallBundledHeaders")
            return (f"-I{target}", f"-I{target / 'cccl'}")
        except (OSError, CompileError):
            pass  # fall through to the wheel / toolkit headers
    try:
        import cuda.pathfinder as pf

        d = pf.find_nvidia_header_directory("cudart")
        if d and (Path(d) / "cuda_fp16.h").is_file():
            return (f"-I{d}",)
    except Exception:  # noqa: BLE001 - pathfinder is optional here
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return (f"-I{Path(root) / 'include'}",)
    raise CompileError(
        "CUDA headers (cuda_fp16.h) not found: install NVRTC >= 13.3 (pip install -U nvidia-cuda-nvrtc), "
        "or the nvidia-cuda-runtime wheel, or set CUDA_HOME to a CUDA toolkit"
    )


# ----------------------------------------------------------------------------- sources
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*$')
_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def source_closure(source: str, root: Path | None = None) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Inline the quoted includes of ``source`` (relative to the kernels root).

    Returns (translation unit text with #line markers, ((relpath, sha256), ...) in include order).
    """
    root = Path(root) if root is not None else kernels_root()
    seen: list[tuple[str, str]] = []
    done: set[str] = set()
    out: list[str] = []

    def visit(rel: str, stack: tuple[str, ...]):
        path = (root / rel).resolve()
        try:
            relpath = path.relative_to(root.resolve()).as_posix()
        except ValueError:
            raise CompileError(f"include {rel!r} escapes the kernels tree") from None
        if relpath in done:  # every file is included once (all our headers are #pragma once)
            return
        try:
            text = path.read_text()
        except FileNotFoundError:
            where = f" (included from {stack[-1]})" if stack else ""
            raise CompileError(f"kernel source {relpath} not found{where}") from None
        done.add(relpath)
        seen.append((relpath, hashlib.sha256(text.encode()).hexdigest()))
        out.append(f'#line 1 "{relpath}"')
        base = Path(relpath).parent
        for n, line in enumerate(text.splitlines(), start=1):
            m = _INCLUDE_RE.match(line)
            if m:
                visit((base / m.group(1)).as_posix(), stack + (relpath,))
                out.append(f'#line {n + 1} "{relpath}"')
            elif _ONCE_RE.match(line):
                out.append("")
            else:
                out.append(line)

    visit(source, ())
    return "\n".join(out) + "\n", tuple(seen)


# ----------------------------------------------------------------------------- ptxas report
_FUNC_RE = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_$][\w$]*)'?")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, ResourceUsage]:
    """Per-kernel resources from NVRTC's ``--ptxas-options=-v`` log."""
    cur: str | None = None
    rec: dict[str, dict] = {}
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            cur = m.group(1)
            rec.setdefault(cur, dict(registers=0, shared_bytes=0, spill_stores=0, spill_loads=0, stack_bytes=0, barriers=0))
            continue
        if cur is None:
            continue
        m = _STACK_RE.search(line)
        if m:
            rec[cur].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _USED_RE.search(line)
        if m:
            rec[cur].update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), shared_bytes=int(m.group(3) or 0))
    return {k: ResourceUsage(kernel=k, **v) for k, v in rec.items()}


_ERR_RE = re.compile(r"^(.*?)\((\d+)\): (?:catastrophic )?error[: ]\s*(.*)$", re.M)


# ----------------------------------------------------------------------------- compile
_key_locks: dict[str, threading.Lock] = {}
_key_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _key_locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def _options(arch: str, defines: dict, extra: tuple[str, ...], need_headers: bool) -> tuple[str, ...]:
    opts = [f"-arch={arch}", "-std=c++17", "--ptxas-options=-v", "-lineinfo", f"-DGQADRV_ARCH={arch_number(arch)}"]
    for k in sorted(defines):
        opts.append(f"-D{k}={defines[k]}")
    if need_headers:
        opts.extend(cuda_header_options())
    opts.extend(extra)
    return tuple(opts)


def _pack_payload(meta: dict, cubin: bytes, ptx: bytes) -> bytes:
    head = json.dumps(meta, sort_keys=True).encode()
    return struct.pack("<III", len(head), len(cubin), len(ptx)) + head + cubin + ptx


def _unpack_payload(payload: bytes) -> tuple[dict, bytes, bytes]:
    nh, nc, npx = struct.unpack_from("<III", payload, 0)
    off = 12
    meta = json.loads(payload[off:off + nh])
    off += nh
    return meta, payload[off:off + nc], payload[off + nc:off + nc + npx]


def compile_module(
    source: str,
    arch: str,
    defines: dict | None = None,
    *,
    extra_options: tuple[str, ...] = (),
    need_cuda_headers: bool = False,
    cache: "_cache.CubinCache | None" = None,
    root: Path | None = None,
    label: str | None = None,
) -> CompiledModule:
    """Compile ``source`` (path under the kernels root, or under ``root``) for ``arch``; cached by content.

    ``label`` names the module in the log (default: the source and its defines); it is not part
    of the cache key."""
    arch = normalize_arch(arch)
    num = arch_number(arch)
    if num not in nvrtc_supported_archs():
        raise CompileError(
            f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {arch} "
            f"(supported: {', '.join(f'sm_{a}' for a in nvrtc_supported_archs())})"
        )
    defines = dict(defines or {})
    text, closure = source_closure(source, root)
    opts = _options(arch, defines, tuple(extra_options), need_cuda_headers)
    h = hashlib.sha256()
    h.update(f"gqadrv-cubin-v{CACHE_FORMAT}\0{arch}\0nvrtc{nvrtc_version()}\0".encode())
    h.update("\0".join(opts).encode())
    for rel, digest in closure:
        h.update(f"\0{rel}\0{digest}".encode())
    key = h.hexdigest()
    cache = cache if cache is not None else _cache.default_cache()

    if label is None:
        label = source + "".join(f" {k}={defines[k]}" for k in sorted(defines))

    with _lock_for(key):
        t0 = time.perf_counter()
        payload, where = cache.lookup(key) if hasattr(cache, "lookup") else (cache.get(key), "cache")
        if payload is not None:
            try:
                meta, cubin, ptx = _unpack_payload(payload)
                mod = CompiledModule(
                    key=key, source=source, arch=arch, options=opts, cubin=cubin, ptx=ptx, log=meta["log"],
                    resources={k: ResourceUsage(**v) for k, v in meta["resources"].items()},
                    sources=tuple(r for r, _ in closure), from_cache=True, seconds=0.0,
                )
                # a memory hit repeats a lookup of this process: DEBUG; a disk hit or a compile: INFO
                _log.log(logging.DEBUG if where == "memory" else logging.INFO, "%s for %s: cache hit (%s), %.3f s",
                         label, arch, where, time.perf_counter() - t0)
                _log.debug("  key %s", key)
                return mod
            except (ValueError, KeyError, TypeError, struct.error):
                where = "unreadable"  # unreadable payload from an older layout: rebuild below
        t0 = time.perf_counter()
        try:
            cubin, ptx, log = _run_nvrtc(text, source, arch, opts)
        except CompileError as exc:
            _log.info("%s for %s: cache miss, NVRTC failed after %.2f s: %s", label, arch, time.perf_counter() - t0,
                      str(exc).splitlines()[0])
            raise
        seconds = time.perf_counter() - t0
        resources = parse_ptxas_report(log)
        meta = {"log": log, "resources": {k: v.to_dict() for k, v in resources.items()}, "source": source, "arch": arch}
        cache.put(key, _pack_payload(meta, cubin, ptx))
        why = "" if where in ("miss", "cache") else f" ({where} entry)"
        _log.info("%s for %s: cache miss%s, compiled in %.2f s", label, arch, why, seconds)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("  key %s; options %s", key, " ".join(opts))
            for r in resources.values():
                _log.debug("  %s: %d registers, %d B smem, %d B stack, spill %d/%d B", r.kernel, r.registers,
                           r.shared_bytes, r.stack_bytes, r.spill_stores, r.spill_loads)
        return CompiledModule(
            key=key, source=source, arch=arch, options=opts, cubin=cubin, ptx=ptx, log=log, resources=resources,
            sources=tuple(r for r, _ in closure), from_cache=False, seconds=seconds,
        )


def _run_nvrtc(text: str, source: str, arch: str, opts: tuple[str, ...]) -> tuple[bytes, bytes, str]:
    nv = _nvrtc()
    prog = _nck(nv.nvrtcCreateProgram(text.encode(), source.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        enc = [o.encode() for o in opts]
        res = nv.nvrtcCompileProgram(prog, len(enc), enc)
        n = _nck(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * n
        _nck(nv.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if int(res[0]) != 0:
            m = _ERR_RE.search(log)
            loc = (m.group(1), int(m.group(2))) if m else None
            first = f" at {loc[0]}:{loc[1]}: {m.group(3).strip()}" if m else ""
            raise CompileError(f"NVRTC failed to compile {source} for {arch}{first}\n--- NVRTC log ---\n{log}", log, loc)
        n = _nck(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * n
        _nck(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        n = _nck(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * n
        _nck(nv.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return bytes(cubin), bytes(ptx).rstrip(b"\0"), log
    finally:
        nv.nvrtcDestroyProgram(prog)
