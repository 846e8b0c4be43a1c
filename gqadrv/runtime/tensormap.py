"""CUtensorMap (TMA descriptor) encoding with Python-side validation.

``encode_tiled`` checks every rule of ``cuTensorMapEncodeTiled`` first and names the offending
dimension, then asks the driver for the 128 descriptor bytes, which kernels receive by value
(``const __grid_constant__ TmaDesc``). Dimensions are given innermost first, as the driver wants.
"""

from __future__ import annotations

import ctypes
import dataclasses

from . import driver as _drv
from . import tmap_geometry as _geometry

__all__ = ["TensorMapError", "TmaSpec", "address_offset", "class_writer", "encode_tiled", "rebase", "validate_tiled",
           "ELEMENT_BYTES"]

# element size per data type name (there is no FP8 enum: fp8 data is described as uint8)
ELEMENT_BYTES = {"uint8": 1, "uint16": 2, "uint32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "float32": 4}
_SWIZZLE_SPAN = {"none": None, "32b": 32, "64b": 64, "128b": 128}
_L2 = ("none", "64b", "128b", "256b")


class TensorMapError(ValueError):
    """A tensor-map request breaks a TMA rule (raised before the driver is called)."""


@dataclasses.dataclass(frozen=True)
class TmaSpec:
    dtype: str
    address: int
    dims: tuple[int, ...]           # innermost first, elements
    strides: tuple[int, ...]        # bytes, for dims[1:] (rank - 1 entries)
    box: tuple[int, ...]            # innermost first, elements
    element_strides: tuple[int, ...] | None = None
    swizzle: str = "128b"
    l2_promotion: str = "none"
    oob_nan: bool = False           # False: out-of-bounds elements read as zero


def validate_tiled(spec: TmaSpec) -> None:
    rank = len(spec.dims)
    if spec.dtype not in ELEMENT_BYTES:
        raise TensorMapError(f"tensor map dtype {spec.dtype!r} is not supported; use one of {sorted(ELEMENT_BYTES)}")
    esize = ELEMENT_BYTES[spec.dtype]
    if not 1 <= rank <= 5:
        raise TensorMapError(f"tensor map rank must be 1..5, got {rank}")
    if len(spec.strides) != rank - 1:
        raise TensorMapError(f"tensor map of rank {rank} needs {rank - 1} strides (dims 1..{rank - 1}), got {len(spec.strides)}")
    if len(spec.box) != rank:
        raise TensorMapError(f"tensor map of rank {rank} needs {rank} box sizes, got {len(spec.box)}")
    es = spec.element_strides or (1,) * rank
    if len(es) != rank:
        raise TensorMapError(f"tensor map of rank {rank} needs {rank} element strides, got {len(es)}")
    if spec.address % 16:
        raise TensorMapError(f"tensor map global address 0x{spec.address:x} must be 16-byte aligned")
    for i, d in enumerate(spec.dims):
        if not 1 <= d <= 2**32:
            raise TensorMapError(f"tensor map dim {i} has size {d}; each size must be in [1, 2^32]")
    for i, s in enumerate(spec.strides, start=1):
        if s % 16:
            raise TensorMapError(f"tensor map stride of dim {i} is {s} bytes; strides must be multiples of 16 bytes")
        if not 0 < s < 2**40:
            raise TensorMapError(f"tensor map stride of dim {i} is {s} bytes; it must be in (0, 2^40)")
    for i, b in enumerate(spec.box):
        if not 1 <= b <= 256:
            raise TensorMapError(f"tensor map box dim {i} is {b}; box sizes must be in [1, 256]")
    for i, e in enumerate(es):
        if not 1 <= e <= 8:
            raise TensorMapError(f"tensor map element stride of dim {i} is {e}; it must be in [1, 8]")
    inner = spec.box[0] * esize
    if inner % 16:
        raise TensorMapError(f"tensor map box dim 0 spans {inner} bytes; it must be a multiple of 16 bytes")
    if spec.swizzle not in _SWIZZLE_SPAN:
        raise TensorMapError(f"swizzle must be one of {sorted(_SWIZZLE_SPAN)}, got {spec.swizzle!r}")
    span = _SWIZZLE_SPAN[spec.swizzle]
    if span is not None and inner > span:
        raise TensorMapError(f"tensor map box dim 0 spans {inner} bytes; swizzle {spec.swizzle} allows at most {span}")
    if spec.l2_promotion not in _L2:
        raise TensorMapError(f"l2_promotion must be one of {_L2}, got {spec.l2_promotion!r}")


def encode_tiled(spec: TmaSpec) -> bytes:
    """Validate, encode, and return the 128 descriptor bytes: unless GQADRV_TMAP_PATCH=0,
    written from a map of the same class where that class's geometry fields are known and checked
    (``runtime.tmap_geometry``), else encoded by the driver."""
    validate_tiled(spec)
    encode = _encode
    data = _geometry.patch(spec, encode)
    if data is None:
        data = encode(spec)
        _geometry.note(spec, data, encode)
    return data


def class_writer(spec: TmaSpec):
    """The writer of ``spec``'s map class learned against the driver (``tmap_geometry.writer``): a
    function (address, dims, strides) -> 128 bytes, or None from it for a value wider than its field
    was checked with; None while the class is not learned. The caller vouches that every geometry
    it writes passes ``validate_tiled`` (a family of layouts whose rules hold by construction)."""
    return _geometry.writer(spec, _encode)


_ENUMS: dict = {}  # driver enum members by our names, looked up once (not at every encoding)


def _enums(drv) -> dict:
    e = _ENUMS.get(id(drv))
    if e is None:
        T, SW, L2, OOB = drv.CUtensorMapDataType, drv.CUtensorMapSwizzle, drv.CUtensorMapL2promotion, drv.CUtensorMapFloatOOBfill
        e = _ENUMS[id(drv)] = {
            "dtype": {
                "uint8": T.CU_TENSOR_MAP_DATA_TYPE_UINT8,
                "uint16": T.CU_TENSOR_MAP_DATA_TYPE_UINT16,
                "uint32": T.CU_TENSOR_MAP_DATA_TYPE_UINT32,
                "int32": T.CU_TENSOR_MAP_DATA_TYPE_INT32,
                "float16": T.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                "bfloat16": T.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                "float32": T.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            },
            "swizzle": {
                "none": SW.CU_TENSOR_MAP_SWIZZLE_NONE,
                "32b": SW.CU_TENSOR_MAP_SWIZZLE_32B,
                "64b": SW.CU_TENSOR_MAP_SWIZZLE_64B,
                "128b": SW.CU_TENSOR_MAP_SWIZZLE_128B,
            },
            "l2": {
                "none": L2.CU_TENSOR_MAP_L2_PROMOTION_NONE,
                "64b": L2.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
                "128b": L2.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                "256b": L2.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            },
            "oob": (OOB.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, OOB.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA),
            "interleave": drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        }
    return e


def _encode(spec: TmaSpec) -> bytes:
    drv = _drv.driver()
    e = _enums(drv)
    dtype, swizzle, l2 = e["dtype"][spec.dtype], e["swizzle"][spec.swizzle], e["l2"][spec.l2_promotion]
    oob = e["oob"][1 if spec.oob_nan else 0]
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    rank = len(spec.dims)
    es = spec.element_strides or (1,) * rank
    tm = _drv.check(
        drv.cuTensorMapEncodeTiled(
            dtype,
            rank,
            spec.address,
            [u64(d) for d in spec.dims],
            [u64(s) for s in spec.strides],
            [u32(b) for b in spec.box],
            [u32(x) for x in es],
            e["interleave"],
            swizzle,
            l2,
            oob,
        ),
        "cuTensorMapEncodeTiled",
    )
    return ctypes.string_at(tm.getPtr(), 128)


# ----------------------------------------------------------------------------- rebasing
# A tensor map embeds its tensor's global address. Re-encoding it for a new address costs a driver
# call plus ~15 Python objects (10-20 us of host time); the descriptor layout is opaque, but the
# address is, on the drivers seen so far, one little-endian u64 field. ``address_offset`` learns
# where once per process by encoding one probe geometry at three addresses and checking that only
# those 8 bytes differ and that they hold the address; each map to be patched is checked again
# (its own u64 at that offset must equal the address it was encoded with). Wherever either check
# fails, callers re-encode (``rebase``): patching is an optimisation, never a guess.
_PROBE_ADDRESSES = (0x7F12_3456_7890, 0x0001_0203_0400, 0x0058_E0C1_A2F0)  # every byte 0..6 differs
_offset_state: list = []   # [] = not probed yet; [None] = no patchable field; [k] = byte offset


def _probe_offset() -> int | None:
    try:
        specs = [TmaSpec(dtype="float16", address=a, dims=(64, 256, 8, 2), strides=(128, 256 * 128, 8 * 256 * 128),
                         box=(64, 32, 1, 1), swizzle="128b") for a in _PROBE_ADDRESSES]
        for spec in specs:
            validate_tiled(spec)
        maps = [_encode(spec) for spec in specs]  # driver queries, not maps in use: tmap_geometry does not note them
    except Exception:  # noqa: BLE001 - no driver, or an encoder that refuses: no patching
        return None
    if any(len(m) != 128 for m in maps):
        return None
    for k in range(121):
        if all(int.from_bytes(m[k:k + 8], "little") == a for m, a in zip(maps, _PROBE_ADDRESSES)):
            rest = {m[:k] + m[k + 8:] for m in maps}
            return k if len(rest) == 1 else None
    return None


def address_offset(encoded: bytes, address: int) -> int | None:
    """The byte offset of the global-address field in ``encoded`` (a map encoded for ``address``),
    or None when this map cannot be patched safely (see above)."""
    if not _offset_state:
        _offset_state.append(_probe_offset())
    k = _offset_state[0]
    if k is None or len(encoded) != 128:
        return None
    if int.from_bytes(encoded[k:k + 8], "little") != address:
        return None
    return k


def rebase(encoded: bytes, spec: TmaSpec, address: int) -> bytes:
    """``encoded`` (the map of ``spec``) for a tensor at ``address`` instead of ``spec.address``:
    patched in place when the address field is known, otherwise encoded again."""
    if address % 16:
        raise TensorMapError(f"tensor map global address 0x{address:x} must be 16-byte aligned")
    k = address_offset(encoded, spec.address)
    if k is None:
        return encode_tiled(dataclasses.replace(spec, address=address))
    return encoded[:k] + address.to_bytes(8, "little") + encoded[k + 8:]
