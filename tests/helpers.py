"""Op-neutral test helpers: host <-> device copies that keep the dtype (fp16, bf16, int32, ...) and
the max-error registry that the end-of-run report prints (tests/conftest.py)."""

from __future__ import annotations

import numpy as np

MAX_ERRORS: dict = {}


def record_error(key: str, value: float) -> None:
    """Keep the largest |gqadrv - float64 oracle| seen under ``key`` (printed after the run)."""
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), float(value))


def to_device(h: np.ndarray):
    """Upload a host array (fp16, bf16, int32...) to a CuPy array of the same dtype."""
    import cupy as cp

    d = cp.empty(h.shape, dtype=h.dtype)
    d.data.copy_from_host(np.ascontiguousarray(h).ctypes.data, h.nbytes)
    return d


def to_host(d) -> np.ndarray:
    import cupy as cp

    h = np.empty(d.shape, dtype=d.dtype)
    d.data.copy_to_host(h.ctypes.data, h.nbytes)
    cp.cuda.get_current_stream().synchronize()
    return h


_C_TYPES = {"float": (4, "f"), "int": (4, "i"), "unsigned": (4, "I"), "u32": (4, "I"), "i32": (4, "i"),
            "int64_t": (8, "q"), "i64": (8, "q"), "long long": (8, "q"), "u64": (8, "Q")}


def c_struct_fields(header_text: str, name: str) -> list[tuple[str, int, str]]:
    """(field, byte offset, struct char) of ``struct name { ... };`` in a kernel header, laid out by
    the C rules (pointers 8 bytes). One declaration per line, comments allowed."""
    start = header_text.index(f"struct {name} {{")
    body = header_text[start:header_text.index("};", start)]
    out, off = [], 0
    for ln in body.splitlines()[1:]:
        decl = ln.split("//")[0].strip().rstrip(";").strip()
        if not decl:
            continue
        typ, _, field = decl.rpartition(" ")
        field = field.lstrip("*")
        typ = typ.replace("const ", "").strip()
        if "*" in typ or "*" in decl.split()[-1]:
            size, ch = 8, "Q"
        else:
            size, ch = _C_TYPES[typ]
        off += (-off) % size
        out.append((field, off, ch))
        off += size
    return out


def python_struct_fields(kind) -> list[tuple[str, int, str]]:
    """The same list for a gqadrv.runtime.module.NamedStruct (pointers and int64 both as 8-byte)."""
    return [(n, o, "Q" if c in "qQ" else c) for n, o, c in kind.fields]
