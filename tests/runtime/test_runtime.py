"""Host-side runtime pieces without a GPU: DLPack ingestion, streams, tensor maps, argument packing."""

import ctypes
import struct

import numpy as np
import pytest

from tests.fakes import FakeCudaArray, fake
from gqadrv.runtime.module import F32, I32, PTR, TMAP, ArgPack, Signature, Struct
from gqadrv.runtime.streams import resolve_stream
from gqadrv.runtime.tensormap import TensorMapError, TmaSpec, validate_tiled
from gqadrv.runtime.tensors import as_view, overlaps


# ----------------------------------------------------------------------------- tensors
def test_cpu_array_is_rejected_with_clear_message():
    with pytest.raises(ValueError, match=r"q must be a CUDA array; got a CPU array \(numpy.ndarray\)"):
        as_view(np.zeros(4, np.float16), "q")


@pytest.mark.parametrize("obj", [[1, 2, 3], 3.0, "tensor", None, object()])
def test_non_dlpack_objects_are_type_errors(obj):
    with pytest.raises(TypeError, match="must be a CUDA array supporting DLPack"):
        as_view(obj, "kv")


def test_dlpack_view_fields_and_contiguity():
    a = np.zeros((2, 3, 4), np.float16)
    v = as_view(FakeCudaArray(a, device=3), "x")
    assert (v.ptr, v.shape, v.strides, v.dtype, v.itemsize, v.device) == (a.ctypes.data, (2, 3, 4), (12, 4, 1), "float16", 2, 3)
    assert v.contiguous and v.nbytes == 48
    t = as_view(FakeCudaArray(a.transpose(0, 2, 1)), "x")
    assert not t.contiguous
    s = as_view(FakeCudaArray(a[:, :, ::2]), "x")
    assert not s.contiguous
    one = as_view(FakeCudaArray(np.zeros((1, 5, 1), np.float32)), "x")
    assert one.contiguous and one.dtype == "float32"
    assert as_view(FakeCudaArray(np.zeros(3, np.int32)), "l").dtype == "int32"


def test_explicit_dtype_for_fp8_payloads():
    raw = np.zeros((4, 16), np.uint8)
    v = as_view(FakeCudaArray(raw), "kv", dtype="float8_e4m3fn")
    assert v.dtype == "float8_e4m3fn" and v.itemsize == 1


def test_overlap_detection():
    base = np.zeros(100, np.float16)
    a = as_view(FakeCudaArray(base[:50]), "a")
    b = as_view(FakeCudaArray(base[40:]), "b")
    c = as_view(FakeCudaArray(base[50:]), "c")
    assert overlaps(a, b) and overlaps(b, a) and not overlaps(a, c)
    assert overlaps(a, as_view(FakeCudaArray(base), "all"))


# ----------------------------------------------------------------------------- streams
class _Proto:
    def __init__(self, h, version=0):
        self.h, self.v = h, version

    def __cuda_stream__(self):
        return (self.v, self.h)


class _TorchLike:
    cuda_stream = 0x1234


class _CupyLike:
    ptr = 0x5678


def test_stream_spellings():
    assert resolve_stream(0) == 0 and resolve_stream(77) == 77
    assert resolve_stream(_Proto(0xABC)) == 0xABC
    assert resolve_stream(_TorchLike()) == 0x1234
    assert resolve_stream(_CupyLike()) == 0x5678


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (True, TypeError), ("stream", TypeError), (1.5, TypeError),
                                     (_Proto(1, version=3), TypeError), (object(), TypeError)])
def test_bad_streams(bad, exc):
    with pytest.raises(exc, match="stream"):
        resolve_stream(bad)


# ----------------------------------------------------------------------------- tensor maps
def _spec(**kw):
    base = dict(dtype="float16", address=0x10000, dims=(128, 1024, 8, 2), strides=(256, 256 * 1024, 256 * 1024 * 8),
                box=(64, 32, 1, 1), swizzle="128b")
    base.update(kw)
    return TmaSpec(**base)


def test_valid_spec_passes():
    validate_tiled(_spec())
    validate_tiled(_spec(dtype="float32", dims=(64, 3), strides=(256,), box=(16, 3), swizzle="none"))


@pytest.mark.parametrize("kw,msg", [
    (dict(dims=(1,) * 6, strides=(16,) * 5, box=(1,) * 6), "rank must be 1..5"),
    (dict(strides=(256, 300, 256 * 1024 * 8)), "stride of dim 2 is 300 bytes"),
    (dict(strides=(256, 256 * 1024)), "needs 3 strides"),
    (dict(box=(64, 300, 1, 1)), "box dim 1 is 300"),
    (dict(box=(64, 0, 1, 1)), "box dim 1 is 0"),
    (dict(box=(4, 32, 1, 1), swizzle="none"), "box dim 0 spans 8 bytes"),
    (dict(box=(128, 32, 1, 1)), "swizzle 128b allows at most 128"),
    (dict(address=0x10008), "16-byte aligned"),
    (dict(dims=(128, 0, 8, 2)), "dim 1 has size 0"),
    (dict(dtype="float64"), "dtype 'float64' is not supported"),
    (dict(swizzle="256b"), "swizzle must be one of"),
    (dict(element_strides=(1, 9, 1, 1)), "element stride of dim 1 is 9"),
    (dict(l2_promotion="512b"), "l2_promotion"),
])
def test_tensor_map_rules_name_the_dimension(kw, msg):
    with pytest.raises(TensorMapError, match=msg):
        validate_tiled(_spec(**kw))


# ----------------------------------------------------------------------------- argument packing
def test_signature_layout_and_packing():
    sig = Signature(("desc", TMAP), ("out", PTR), ("n", I32), ("scale", F32), ("args", Struct("<2Qi4x")))
    assert sig.offsets == (0, 128, 136, 140, 144) and sig.size == 168
    pack = ArgPack(sig).pack(bytes(range(128)), 0xDEADBEEF, -7, 0.5, (1, 2, 3))
    raw = pack.bytes()
    assert raw[:128] == bytes(range(128))
    assert struct.unpack_from("<Qif", raw, 128) == (0xDEADBEEF, -7, 0.5)
    assert struct.unpack_from("<2Qi", raw, 144) == (1, 2, 3)
    ptrs = (ctypes.c_void_p * 5).from_address(pack.address)
    base = ptrs[0]
    assert [p - base for p in ptrs] == list(sig.offsets)
    pack.set("n", 9)
    assert struct.unpack_from("<i", pack.bytes(), 136)[0] == 9
    with pytest.raises(ValueError, match="needs 128 bytes"):
        pack.set("desc", b"short")
    with pytest.raises(TypeError, match="takes 5 arguments"):
        pack.pack(1, 2)


def test_encode_passes_the_driver_enums_and_sizes(monkeypatch):
    """_encode (CPU, a fake driver module): every spec field reaches cuTensorMapEncodeTiled as the
    driver's enum member / typed value, with the enum tables built once per driver module."""
    import ctypes
    import enum
    import types

    from gqadrv.runtime import driver as drv_mod
    from gqadrv.runtime import tensormap

    def enum_of(name, *members):
        return enum.Enum(name, {m: i + 1 for i, m in enumerate(members)})

    calls = []
    desc = ctypes.create_string_buffer(bytes(range(128)), 128)

    class Map:
        def getPtr(self):
            return ctypes.addressof(desc)

    class U64(int):
        pass

    class U32(int):
        pass

    fake = types.SimpleNamespace(
        CUtensorMapDataType=enum_of("T", *(f"CU_TENSOR_MAP_DATA_TYPE_{n}" for n in
                                           ("UINT8", "UINT16", "UINT32", "INT32", "FLOAT16", "BFLOAT16", "FLOAT32"))),
        CUtensorMapSwizzle=enum_of("SW", *(f"CU_TENSOR_MAP_SWIZZLE_{n}" for n in ("NONE", "32B", "64B", "128B"))),
        CUtensorMapL2promotion=enum_of("L2", "CU_TENSOR_MAP_L2_PROMOTION_NONE", "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
                                       "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"),
        CUtensorMapFloatOOBfill=enum_of("OOB", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",
                                        "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA"),
        CUtensorMapInterleave=enum_of("IL", "CU_TENSOR_MAP_INTERLEAVE_NONE"),
        cuuint64_t=U64, cuuint32_t=U32,
        cuTensorMapEncodeTiled=lambda *a: (calls.append(a) or (0, Map())),
    )
    monkeypatch.setattr(drv_mod, "driver", lambda: fake)
    monkeypatch.setattr(drv_mod, "check", lambda r, what: r[1])
    monkeypatch.setattr(tensormap, "_ENUMS", {})
    spec = TmaSpec(dtype="bfloat16", address=0x7000_0000, dims=(64, 300, 9, 5), strides=(1152, 64 * 1152, 1152 * 64 * 9),
                   box=(64, 64, 4, 1), swizzle="64b", l2_promotion="256b", oob_nan=True)
    assert tensormap._encode(spec) == bytes(range(128))
    spec2 = TmaSpec(dtype="uint8", address=0x7000_0400, dims=(128, 16), strides=(656,), box=(128, 16),
                    element_strides=(1, 2))
    tensormap._encode(spec2)
    (a, b) = calls
    assert a[0] is fake.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 and a[1] == 4 and a[2] == 0x7000_0000
    assert [type(x) for x in a[3]] == [U64] * 4 and list(a[3]) == [64, 300, 9, 5]
    assert [type(x) for x in a[4]] == [U64] * 3 and list(a[4]) == [1152, 64 * 1152, 1152 * 64 * 9]
    assert [type(x) for x in a[5]] == [U32] * 4 and list(a[5]) == [64, 64, 4, 1]
    assert list(a[6]) == [1, 1, 1, 1] and [type(x) for x in a[6]] == [U32] * 4
    assert a[7] is fake.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert a[8] is fake.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B
    assert a[9] is fake.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
    assert a[10] is fake.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
    assert b[0] is fake.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8 and b[1] == 2
    assert list(b[6]) == [1, 2]
    assert b[8] is fake.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert b[9] is fake.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE
    assert b[10] is fake.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
    assert len(tensormap._ENUMS) == 1  # built once for this driver module
