"""FlashMLA's V3.2 FP8 MLA cache (656 bytes per token) on any DLPack arrays: quantize a bf16 MLA
cache into it and dequantize it back, one launch each (``kernels/mla/smxx/fp8_cache.cu``).

    k_fp8 = quantize_k_cache(k_bf16)      # bf16 [num_blocks, page, 1, 576] -> uint8 [num_blocks, page, 1, 656]
    k_bf16 = dequantize_k_cache(k_fp8)    # uint8 / int8 / float8_e4m3fn [..., 656] -> bf16 [..., 576]

Per token: bytes [0, 512) the e4m3 codes of latent channels 0..511, [512, 528) four float32 scales
(scale k for channels [128k, 128k + 128)), [528, 656) the 64 bf16 RoPE channels 512..575 copied
bit for bit. Per token and 128-channel tile: ``s = 2^ceil(log2(max(amax / 448, 1e-4)))`` (a power of
two >= 2^-13; amax over the tile's finite values), ``code = e4m3(x / s)`` (round to nearest even,
saturating at +-448; NaN -> 0x7F, +-Inf -> +-448). Dequantization: ``bf16(float(code) * s)``
(exact for power-of-two scales), NaN stored as 0x7FFF. The numpy model is
``gqadrv.mla.fp8_reference`` (bit-exact); the format and its rules are in docs/MLA.md.

This module holds the family: the argument struct (mirror of the kernel's ``MlaFp8CacheArgs``), the
kernel families and variants, the contract, the launch, the public calls and the ``OP`` record the
CLI iterates (``compile``, ``info``, ``selftest``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..ops import contract as _oc
from ..ops import outputs as _outputs
from ..ops.kernels import Loaded, load
from ..ops.plans import launch_packed
from ..ops.registry import ElementwiseGeometry, KernelFamily, OpRecord
from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.module import NamedStruct, Signature
from ..runtime.streams import launch_streams
from ..runtime.tensors import TensorView
from ..types import ArrayT, OutT, StreamLike
from . import fp8_reference as _ref

__all__ = ["dequantize_k_cache", "quantize_k_cache"]

# ----------------------------------------------------------------------------- limits
D_QK = _ref.D_QK                          # 576 bf16 channels per token
BYTES_PER_TOKEN = _ref.BYTES_PER_TOKEN    # 656
FP8_DTYPES = ("uint8", "int8", "float8_e4m3fn")   # what an FP8 cache may be typed as (FlashMLA's choices)
WARPS = 4                                 # MLA_FP8_WARPS: tokens per CTA (one warp each)
THREADS = 32 * WARPS
MAX_TOKENS = 2**31 - 1                    # num_blocks * page_size (int in the kernel)

# ----------------------------------------------------------------------------- argument struct
MLA_FP8_FLAG_VEC16 = 1    # bases and strides of both sides multiples of 16 bytes: vector loads / stores

MLA_FP8_ARGS = NamedStruct(
    "MlaFp8CacheArgs",
    ("src", "Q"),              # const void*: quantize bf16 [nb, page, 1, 576]; dequantize u8 [nb, page, 1, 656]
    ("dst", "Q"),              # void*: quantize u8 [nb, page, 1, 656]; dequantize bf16 [nb, page, 1, 576]
    ("src_page_stride", "q"),  # bytes from page b to b + 1 of src
    ("src_row_stride", "q"),   # bytes from token p to p + 1 of src
    ("dst_page_stride", "q"),  # bytes from page b to b + 1 of dst
    ("dst_row_stride", "q"),   # bytes from token p to p + 1 of dst
    ("num_blocks", "i"),       # pages
    ("page_size", "i"),        # tokens per page
    ("tokens", "i"),           # num_blocks * page_size
    ("flags", "i"),            # MLA_FP8_FLAG_* bits
)
SIGNATURE = Signature(("args", MLA_FP8_ARGS))

# ----------------------------------------------------------------------------- families and variants
SOURCE = "mla/smxx/fp8_cache.cu"
_ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
_FEATURES = frozenset({"bf16", "fp8_e4m3", "mla_v32_fp8_format", "paged_views"})
QUANTIZE = KernelFamily("mla_fp8_quantize", SOURCE, "mla_fp8_quantize", _ARCHES, SIGNATURE, _FEATURES)
DEQUANTIZE = KernelFamily("mla_fp8_dequantize", SOURCE, "mla_fp8_dequantize", _ARCHES, SIGNATURE, _FEATURES)
_OP_CODE = {QUANTIZE.name: 0, DEQUANTIZE.name: 1}


@dataclasses.dataclass(frozen=True)
class Fp8CacheVariant(ElementwiseGeometry):
    """One compiled module (one entry point): ``ops.kernels.load`` needs name, family, defines,
    block and dynamic_smem."""

    THREADS: ClassVar[int] = THREADS
    family: KernelFamily

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def defines(self) -> dict:
        return {"MLA_FP8_OP": _OP_CODE[self.family.name]}



def variants_for_arch(arch: str) -> list[Fp8CacheVariant]:
    """Every module ``python -m gqadrv compile --arch ARCH`` builds for this family."""
    if arch not in _ARCHES:
        return []
    return [Fp8CacheVariant(QUANTIZE), Fp8CacheVariant(DEQUANTIZE)]


def check_cc(cc: tuple[int, int]) -> None:
    if cc[0] < 8:
        raise RuntimeError(f"the FP8 MLA cache kernels need compute capability 8.0 or newer; this GPU has "
                           f"{cc[0]}.{cc[1]}")


def route(family: KernelFamily, device: int) -> Loaded:
    check_cc(_drv.device_info(device).cc)
    return load(Fp8CacheVariant(family), device)


# ----------------------------------------------------------------------------- contract
@dataclasses.dataclass(frozen=True)
class Fp8CacheProblem:
    """One launch: ``op`` "quantize" or "dequantize"; byte strides of src and dst (0 for a dimension of
    size 1: never stepped)."""

    op: str
    device: int
    num_blocks: int
    page_size: int
    src: TensorView
    out: TensorView | None
    out_shape: tuple[int, ...]
    src_strides: tuple[int, int]      # (page, row) bytes
    out_dtype: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size


_shape = _oc.shape_str



def _cache_shape(v: TensorView, last: int, what: str) -> tuple[int, int]:
    if v.ndim != 4 or v.shape[2] != 1 or v.shape[3] != last:
        raise ValueError(f"{v.name} must have shape [num_blocks, page_size, 1, {last}] ({what}), got {_shape(v)}")
    nb, page = int(v.shape[0]), int(v.shape[1])
    if nb * page > MAX_TOKENS:
        raise ValueError(f"{v.name} holds {nb * page} tokens; one launch takes at most {MAX_TOKENS} "
                         "(num_blocks * page_size): convert it in parts")
    return nb, page


def _row_contiguous(v: TensorView) -> None:
    if v.size and v.strides[3] != 1:  # a zero-size array has no memory to lay out
        raise ValueError(f"{v.name} must have contiguous token rows (stride 1 in the last dimension); got strides "
                         f"{v.strides} (elements) for shape {_shape(v)}")


def _byte_strides(v: TensorView) -> tuple[int, int]:
    """(page, row) strides in bytes; 0 for a dimension of size 1 (its stride is never used)."""
    page = v.strides[0] * v.itemsize if v.shape[0] > 1 else 0
    row = v.strides[1] * v.itemsize if v.shape[1] > 1 else 0
    return int(page), int(row)


def _check_out(out: Any, ref: TensorView, shape: tuple[int, ...], dtypes: tuple[str, ...], row_bytes: int,
               fixed_row_stride: bool, stream: int | None) -> TensorView:
    """A caller-given output: shape, dtype, device, contiguous rows, rows that never overlap each other
    (page stride >= the page's span), writable, no overlap with the input, no grad."""
    ov = _oc.view_without_grad(out, "out", stream)
    if tuple(ov.shape) != shape:
        raise ValueError(f"out must have shape ({', '.join(map(str, shape))}), got {_shape(ov)}")
    if ov.dtype not in dtypes:
        raise TypeError(f"out must have dtype {' or '.join(dtypes)}, got {ov.dtype}")
    _oc.require_same_device(ov, ref)
    _row_contiguous(ov)
    _oc.require_aligned(ov, ov.itemsize)
    nb, page = shape[0], shape[1]
    page_b, row_b = _byte_strides(ov)
    if fixed_row_stride and page > 1 and row_b != row_bytes:
        raise ValueError(f"out must hold its tokens {row_bytes} bytes apart (stride(1) == {row_bytes // ov.itemsize}, "
                         f"the FP8 cache's layout); got strides {ov.strides} (elements)")
    if page > 1 and row_b < row_bytes:
        raise ValueError(f"out's token rows overlap: stride(1) must be at least {row_bytes // ov.itemsize} elements, "
                         f"got strides {ov.strides}")
    span = (page - 1) * row_b + row_bytes
    if nb > 1 and page > 0 and page_b < span:
        raise ValueError(f"out's pages overlap: stride(0) must be at least {span // ov.itemsize} elements (one "
                         f"page), got strides {ov.strides}")
    _oc.require_writable(ov)
    _oc.require_no_overlap(ov, (ref,))
    _oc.require_no_grad(ov)
    return ov


def validate_quantize(k_bf16: Any, out: Any, *, stream: int | None) -> Fp8CacheProblem:
    """k_bf16 bf16 [num_blocks, page, 1, 576] (rows contiguous, any page and row strides); out (optional)
    uint8 / int8 / float8_e4m3fn [num_blocks, page, 1, 656] with stride(1) == 656 and any page stride."""
    kv = _oc.view_without_grad(k_bf16, "k_bf16", stream)
    nb, page = _cache_shape(kv, D_QK, "a bf16 MLA cache: 512 latent + 64 RoPE channels")
    if kv.dtype != "bfloat16":
        raise TypeError(f"k_bf16 must have dtype bfloat16 (FlashMLA's FP8 format keeps the RoPE channels as bf16), "
                        f"got {kv.dtype}")
    _row_contiguous(kv)
    _oc.require_aligned(kv, 2)
    _oc.require_no_grad(kv)
    shape = (nb, page, 1, BYTES_PER_TOKEN)
    ov = None
    if out is not None:
        ov = _check_out(out, kv, shape, FP8_DTYPES, BYTES_PER_TOKEN, True, stream)
    return Fp8CacheProblem("quantize", kv.device, nb, page, kv, ov, shape, _byte_strides(kv), "uint8")


def validate_dequantize(k_fp8: Any, out: Any, *, stream: int | None) -> Fp8CacheProblem:
    """k_fp8 uint8 / int8 / float8_e4m3fn [num_blocks, page, 1, 656] (rows contiguous, any page and row
    strides); out (optional) bf16 [num_blocks, page, 1, 576] with contiguous, non-overlapping rows."""
    kv = _oc.view_without_grad(k_fp8, "k_fp8", stream)
    nb, page = _cache_shape(kv, BYTES_PER_TOKEN, "the FP8 MLA cache: 512 e4m3 + 4 fp32 scales + 64 bf16")
    if kv.dtype not in FP8_DTYPES:
        raise TypeError(f"k_fp8 must have dtype {' or '.join(FP8_DTYPES)} (the 656 bytes of each token), got "
                        f"{kv.dtype}")
    _row_contiguous(kv)
    _oc.require_no_grad(kv)
    shape = (nb, page, 1, D_QK)
    ov = None
    if out is not None:
        ov = _check_out(out, kv, shape, ("bfloat16",), 2 * D_QK, False, stream)
    return Fp8CacheProblem("dequantize", kv.device, nb, page, kv, ov, shape, _byte_strides(kv), "bfloat16")


# ----------------------------------------------------------------------------- launch
def args_fields(problem: Fp8CacheProblem, dst_ptr: int, dst_strides: tuple[int, int]) -> dict:
    """The ``MlaFp8CacheArgs`` fields (by name) of a launch."""
    sp, sr = problem.src_strides
    dp, dr = dst_strides
    vec = all(v % 16 == 0 for v in (problem.src.ptr, sp, sr, dst_ptr, dp, dr))
    return {"src": problem.src.ptr, "dst": dst_ptr, "src_page_stride": sp, "src_row_stride": sr, "dst_page_stride": dp,
            "dst_row_stride": dr, "num_blocks": problem.num_blocks, "page_size": problem.page_size,
            "tokens": problem.tokens, "flags": MLA_FP8_FLAG_VEC16 if vec else 0}


def launch_geometry(problem: Fp8CacheProblem) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, dynamic smem): one warp per token."""
    return (-(-problem.tokens // WARPS), 1, 1), (THREADS, 1, 1), 0


def _dense_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    page = shape[1] * shape[3] * itemsize if shape[0] > 1 else 0
    row = shape[3] * itemsize if shape[1] > 1 else 0
    return page, row


def _run(problem: Fp8CacheProblem, like: Any, out: Any, s: int) -> Any:
    family = QUANTIZE if problem.op == "quantize" else DEQUANTIZE
    new = None
    if problem.out is not None:
        dst_ptr, dst_strides = problem.out.ptr, _byte_strides(problem.out)
    else:
        new = _outputs.allocate(like, problem.out_shape, problem.out_dtype, problem.device, s)
        dst_ptr = new.ptr
        dst_strides = _dense_strides(problem.out_shape, _tensors.DTYPE_BYTES[problem.out_dtype])
    if problem.tokens > 0:
        loaded = route(family, problem.device)
        grid, block, smem = launch_geometry(problem)
        launch_packed(loaded.kernel, grid, block, smem, SIGNATURE, s, (args_fields(problem, dst_ptr, dst_strides),),
                      problem.device)
    if new is not None:
        return _outputs.hand_back(new, like, s, problem.device)
    return out



# ----------------------------------------------------------------------------- public API
def quantize_k_cache(k_bf16: ArrayT, *, out: OutT | None = None, stream: StreamLike | None = None) -> OutT | ArrayT:
    """Quantize a bf16 MLA cache into FlashMLA's V3.2 FP8 format (656 bytes per token).

    ``k_bf16``: bfloat16 [num_blocks, page_size, 1, 576] (512 latent + 64 RoPE channels); each token's
    576 channels contiguous, any page stride (a view of some pages of a bigger pool) and any token
    stride. Returns uint8 [num_blocks, page_size, 1, 656] in k_bf16's framework (CuPy, torch, JAX;
    view it as float8_e4m3fn if you like), or ``out`` filled and returned: uint8 / int8 /
    float8_e4m3fn of that shape with stride(1) == 656 and any stride(0) (pages of a bigger FP8 pool).

    Per token: bytes [0, 512) e4m3 codes of channels 0..511; [512, 528) 4 float32 scales, scale k for
    channels [128k, 128k + 128); [528, 656) the RoPE channels 512..575 copied bit for bit. Per
    128-channel tile: ``s = 2^ceil(log2(max(amax / 448, 1e-4)))`` (a power of two, at least 2^-13;
    amax = the largest |x| of the tile's finite values), ``code = e4m3(x / s)`` rounded to nearest even
    with saturation at +-448; NaN becomes the e4m3 NaN 0x7F and +-Inf saturates to +-448 (neither
    changes the tile's scale). Bit-exact with ``gqadrv.mla.fp8_reference.quantize_k_cache_reference``.

    Asynchronous on ``stream`` (default: torch's current stream for torch tensors, else CuPy's);
    the input's producer is ordered before the launch. With ``out`` given nothing is allocated and no
    device data is read on the host: the call can be captured into a CUDA graph (after one call
    outside capture has loaded the kernel).
    """
    s, dl = launch_streams(k_bf16, (k_bf16, out), stream)
    problem = validate_quantize(k_bf16, out, stream=dl)
    return _run(problem, k_bf16, out, s)


def dequantize_k_cache(k_fp8: ArrayT, *, out: OutT | None = None, stream: StreamLike | None = None) -> OutT | ArrayT:
    """Dequantize FlashMLA's V3.2 FP8 MLA cache (656 bytes per token) back to bf16.

    ``k_fp8``: uint8 / int8 / float8_e4m3fn [num_blocks, page_size, 1, 656] (each token's 656 bytes
    contiguous, any page and token stride). Returns bfloat16 [num_blocks, page_size, 1, 576] in
    k_fp8's framework, or ``out`` (bf16 of that shape, contiguous non-overlapping token rows, any
    strides) filled and returned. Channel c < 512 = ``bf16(float(code_c) * scale_{c // 128})`` (the
    float32 product is exact for power-of-two scales, then rounded to bf16 to nearest even; NaN
    codes give NaN, stored as 0x7FFF); channels 512..575 = the stored RoPE bf16 bits. Stream,
    ordering and graph capture as in ``quantize_k_cache``.
    """
    s, dl = launch_streams(k_fp8, (k_fp8, out), stream)
    problem = validate_dequantize(k_fp8, out, stream=dl)
    return _run(problem, k_fp8, out, s)


# ----------------------------------------------------------------------------- CLI record
def _describe(cc: tuple[int, int]) -> str:
    check_cc(cc)
    conv = "hardware cvt (sm_89+)" if cc >= (8, 9) else "software RNE (below sm_89)"
    return (f"FP8 MLA cache (656 B/token, V3.2): kernel families {QUANTIZE.name!r}, {DEQUANTIZE.name!r}; "
            f"e4m3 conversion: {conv}")


def _random_cache(rng: Any, nb: int, page: int) -> Any:
    import ml_dtypes
    import numpy as np

    x = rng.standard_normal((nb, page, 1, D_QK)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-20, 12, size=(nb, page, 1, 1)).astype(np.float32)
    return x.astype(ml_dtypes.bfloat16)


def _selftest(rng: Any, gpu: bool) -> list:
    import numpy as np

    k = _random_cache(rng, 3, 5)
    q = _ref.quantize_k_cache_reference(k)
    back = _ref.dequantize_k_cache_reference(q).astype(np.float32)
    kf = k.astype(np.float32)
    _, scales, _ = _ref.split_k_cache(q)
    bound = np.repeat(scales, _ref.TILE, axis=-1) * np.float32(16.0)   # half an e4m3 step <= s * 2^8 / 16
    err = np.abs(back[..., :512] - kf[..., :512])
    ok = bool(np.all(err <= bound) and np.array_equal(back[..., 512:], kf[..., 512:]))
    cases = [("mla fp8 cache reference round trip (error <= s * 16 per channel, RoPE exact)", float(err.max()), ok)]
    if not gpu:
        return cases
    import cupy as cp

    def up(h: Any) -> Any:
        d = cp.empty(h.shape, dtype=h.dtype)
        d.data.copy_from_host(np.ascontiguousarray(h).ctypes.data, h.nbytes)
        return d

    def down(d: Any) -> Any:
        h = np.empty(d.shape, dtype=d.dtype)
        cp.cuda.get_current_stream().synchronize()
        d.data.copy_to_host(h.ctypes.data, h.nbytes)
        return h

    got = down(quantize_k_cache(up(k)))
    bad = int(np.count_nonzero(got != q))
    cases.append(("mla fp8 cache quantize 3x5 tokens, bit-exact with the reference", float(bad), bad == 0))
    deq = down(dequantize_k_cache(up(q))).view(np.uint16)
    ref = _ref.dequantize_k_cache_reference(q)
    bad = int(np.count_nonzero(deq != ref.view(np.uint16)))
    cases.append(("mla fp8 cache dequantize 3x5 tokens, bit-exact with the reference", float(bad), bad == 0))
    return cases


OP = OpRecord(name="mla_fp8_cache", variants_for_arch=variants_for_arch, describe=_describe, selftest=_selftest)
