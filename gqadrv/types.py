"""Public type aliases and protocols of gqadrv's API (for type checkers; nothing here runs a GPU).

gqadrv takes tensors of any framework through DLPack and streams in every common spelling, so its
signatures are written against protocols, not classes:

* ``DLPackArray``: anything with ``__dlpack__`` and ``__dlpack_device__`` (CuPy, torch, JAX, ...).
  At run time the array must also live on a CUDA device; a type checker cannot tell.
* ``ArrayT`` / ``OutT``: the output follows the caller's types. A new output array is handed back in
  q's framework (CuPy, torch or JAX; a producer of another framework gets a CuPy array).
* ``StreamLike``: an int handle (0 = legacy default stream), an object with ``__cuda_stream__()``
  (CuPy >= 14, cuda.core), with a ``.cuda_stream`` int (torch) or a ``.ptr`` int (CuPy), or a
  ``cuda.bindings`` ``CUstream``. ``None`` (the default stream) is written out where accepted.
* ``Backend`` / ``MlaBackend``: the ``backend=`` names of GQA and MLA decode.

This module imports nothing from gqadrv (floor 0 in the package's import order).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "ArrayT", "Backend", "CUstreamLike", "CudaStreamProtocol", "DLPackArray", "HasCudaStream", "HasPtr",
    "LseT", "MlaBackend", "OutT", "ScaleT", "StreamLike",
]


@runtime_checkable
class DLPackArray(Protocol):
    """A DLPack producer (array API ``__dlpack__`` / ``__dlpack_device__``).

    Only ``stream=`` is required of ``__dlpack__`` (gqadrv passes the consumer stream); newer
    keywords (``max_version``, ``dl_device``, ``copy``) may be present. The device type is an int
    or an int-like enum (JAX types it as ``enum.Enum``), hence ``Any``."""

    def __dlpack__(self, *, stream: Any = None) -> Any: ...

    def __dlpack_device__(self) -> tuple[Any, int]: ...


class CudaStreamProtocol(Protocol):
    """CUDA stream protocol (CuPy >= 14, cuda.core): ``__cuda_stream__() -> (0, handle)``."""

    def __cuda_stream__(self) -> tuple[int, int]: ...


class HasCudaStream(Protocol):
    """An object with an int ``.cuda_stream`` handle (``torch.cuda.Stream``)."""

    @property
    def cuda_stream(self) -> int: ...


class HasPtr(Protocol):
    """An object with an int ``.ptr`` handle (``cupy.cuda.Stream``)."""

    @property
    def ptr(self) -> int: ...


class CUstreamLike(Protocol):
    """A ``cuda.bindings.driver.CUstream`` (converted with ``int()``)."""

    def getPtr(self) -> int: ...

    def __int__(self) -> int: ...


StreamLike = int | CudaStreamProtocol | HasCudaStream | HasPtr | CUstreamLike
"""Every stream spelling gqadrv accepts besides ``None``."""

Backend = Literal["auto", "hopper", "tcgen05", "portable"]
"""``backend=`` of GQA decode (``gqa_decode``, ``prepare_gqa_decode``); None means 'auto'."""

MlaBackend = Literal["auto", "seesaw", "seesaw_tma", "seesaw_bal", "seesaw_bal_cp", "seesaw_nope_bal", "narrow16", "narrow32",
                     "narrow16_tma", "narrow32_tma", "narrow16x2_tma", "narrow16_bal", "narrow16_fp8", "wide64_fp8", "seesaw_fp8",
                     "seesaw_nope", "wgmma", "mma", "mma_fp8", "mma_nope"]
"""``backend=`` of MLA decode (``flash_mla_with_kvcache``, ``prepare_mla_decode``); None means 'auto'."""

ArrayT = TypeVar("ArrayT", bound=DLPackArray)
"""The type of ``q``: outputs gqadrv allocates come back as this type."""

OutT = TypeVar("OutT", bound=DLPackArray)
"""The type of a caller-given output (returned as given)."""

LseT = TypeVar("LseT", bound=DLPackArray)
"""The type of a caller-given MLA ``lse`` output (returned as given)."""

ScaleT = TypeVar("ScaleT", bound=DLPackArray)
"""The type of a caller-given FP8 scale array (``quantize_kv_fp8``'s ``scale`` / ``out_scale``; returned as given)."""
