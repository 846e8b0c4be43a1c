"""End-to-end proof of the runtime on a real TMA + mbarrier kernel (not attention).

``tma_ring_reduce(x)`` sums every {B0 x B1} tile of a 4-D tensor x[N3, N2, N1, N0] (fp16, bf16
or fp32) with kernels/runtime/tma_ring_reduce.cu: a 4-D tensor map, a 3-stage full/empty
mbarrier ring in > 48 KB of dynamic shared memory, launched through cuLaunchKernelEx with PDL.
The result has shape [N3, N2, ceil(N1/B1), ceil(N0/B0)] (fp32); out-of-bounds elements count as 0.
"""

from __future__ import annotations

from typing import Any

from . import driver as _drv
from . import tensors as _tensors
from .compiler import arch_for_cc, arch_number, compile_module
from .module import I32, PTR, TMAP, ArgPack, LaunchPlan, Signature, load_library
from .streams import is_capturing, resolve_stream
from .tensormap import ELEMENT_BYTES, TmaSpec, encode_tiled

__all__ = ["tma_ring_reduce", "PROOF_SOURCE", "PROOF_SIGNATURE", "proof_ring_bytes"]

PROOF_SOURCE = "runtime/tma_ring_reduce.cu"
PROOF_SIGNATURE = Signature(("desc", TMAP), ("out", PTR), ("n2", I32), ("tiles_y", I32), ("tiles_x", I32), ("num_tiles", I32))
_DT = {"float16": 0, "bfloat16": 1, "float32": 2}
STAGES = 3


def proof_ring_bytes(dtype: str, box: tuple[int, int]) -> int:
    return STAGES * box[0] * box[1] * ELEMENT_BYTES[dtype]


def tma_ring_reduce(x: Any, *, box: tuple[int, int] | None = None, grid: int | None = None, stream: Any = None,
                    out: Any = None) -> Any:
    _drv.ensure_init()
    s = resolve_stream(stream, 0, _tensors.framework_of(x))
    v = _tensors.as_view(x, "x", stream=None if is_capturing(s) else s)
    if v.dtype not in _DT:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {v.dtype}")
    if v.ndim != 4:
        raise ValueError(f"x must be 4-D [N3, N2, N1, N0], got shape {v.shape}")
    if not v.contiguous:
        raise ValueError("x must be contiguous")
    N3, N2, N1, N0 = v.shape
    esize = ELEMENT_BYTES[v.dtype]
    if box is None:
        box = (64, 128) if esize == 4 else (128, 128)
    b0, b1 = box
    info = _drv.device_info(v.device)
    arch = arch_for_cc(info.cc)
    if arch_number(arch) < 90:
        raise RuntimeError(f"the TMA proof kernel needs compute capability 9.0+, device {v.device} is {info.arch}")
    spec = TmaSpec(v.dtype, v.ptr, (N0, N1, N2, N3), (N0 * esize, N0 * N1 * esize, N0 * N1 * N2 * esize), (b0, b1, 1, 1),
                   swizzle="none")
    desc = encode_tiled(spec)
    tiles_y, tiles_x = -(-N1 // b1), -(-N0 // b0)
    num_tiles = N3 * N2 * tiles_y * tiles_x
    if out is None:
        with _drv.device_scope(v.device):
            res = _tensors.empty((N3, N2, tiles_y, tiles_x), "float32", v.device)
        out_ptr = int(res.data.ptr)
    else:
        ov = _tensors.as_view(out, "out", stream=None if is_capturing(s) else s)
        if ov.shape != (N3, N2, tiles_y, tiles_x) or ov.dtype != "float32" or not ov.contiguous:
            raise ValueError(f"out must be a contiguous float32 array of shape {(N3, N2, tiles_y, tiles_x)}")
        res, out_ptr = out, ov.ptr
    mod = compile_module(PROOF_SOURCE, arch, {"PROOF_DT": _DT[v.dtype], "PROOF_B0": b0, "PROOF_B1": b1})
    kern = load_library(mod.cubin, "tma_ring_reduce").kernel("tma_ring_reduce", v.device)
    pack = ArgPack(PROOF_SIGNATURE).pack(desc, out_ptr, N2, tiles_y, tiles_x, num_tiles)
    g = grid if grid is not None else max(1, min(num_tiles, info.sm_count))
    with _drv.device_scope(v.device):
        LaunchPlan(kern, (g, 1, 1), (128, 1, 1), proof_ring_bytes(v.dtype, box), pack, stream=s, pdl=True).launch()
    return res if out is not None else _tensors.export_like(res, x)
