"""Seed-compatible names of FlashInfer's experimental SM110 GQA decode (seeds/000_*.txt).

They behave like the portable entry points but raise RuntimeError unless the GPU is SM110
(Jetson Thor), as the seed's functions do on other GPUs."""

from __future__ import annotations

from typing import Any, TypeVar, overload

from ..ops.prepared import launch_prepared
from ..runtime import driver as _drv
from ..runtime.streams import device_hint
from ..types import ArrayT, DLPackArray, OutT, StreamLike
from .api import PreparedGqaDecode, gqa_decode, prepare_gqa_decode

__all__ = ["launch_sm110_gqa_decode_prepared", "prepare_sm110_gqa_decode", "sm110_gqa_decode"]

_R = TypeVar("_R")


def _require_sm110(device: int) -> None:
    cc = _drv.device_info(device).cc
    if cc != (11, 0):
        raise RuntimeError(
            f"sm110_gqa_decode requires compute capability 11.0 (Jetson Thor), got {cc[0]}.{cc[1]}; "
            "use gqadrv.gqa_decode, the portable entry point, on other GPUs"
        )


@overload
def sm110_gqa_decode(q: ArrayT, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: None = None,
                     q_scale: float = 1.0, sm_scale: float | None = None,
                     stream: StreamLike | None = None) -> ArrayT: ...
@overload
def sm110_gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: OutT,
                     q_scale: float = 1.0, sm_scale: float | None = None,
                     stream: StreamLike | None = None) -> OutT: ...
def sm110_gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *,
                     out: DLPackArray | None = None, q_scale: float = 1.0, sm_scale: float | None = None,
                     stream: StreamLike | None = None) -> DLPackArray:
    """Seed-compatible name: like ``gqa_decode`` but raises RuntimeError unless the GPU is SM110.
    Softmax scale: softmax(sm_scale * q.k), sm_scale absolute (default 1/sqrt(D)) or
    q_scale = sm_scale * sqrt(D); not both."""
    from .contract import check_scale_pair

    check_scale_pair(q_scale, sm_scale)
    _drv.ensure_init()
    _require_sm110(device_hint(q))
    return gqa_decode(q, kv, sequence_lengths, out=out, q_scale=q_scale, sm_scale=sm_scale, stream=stream)


def prepare_sm110_gqa_decode(inputs: dict[str, Any], num_splits: int | None = None,
                             stream: StreamLike | None = None) -> PreparedGqaDecode[Any]:
    """Seed-compatible name of ``prepare_gqa_decode``; RuntimeError unless the GPU is SM110. The
    inputs dict may carry "q_scale" or "sm_scale" (not both, see ``gqa_decode``)."""
    from .contract import check_scale_pair

    if isinstance(inputs, dict):
        check_scale_pair(inputs.get("q_scale"), inputs.get("sm_scale"))
    _drv.ensure_init()
    if isinstance(inputs, dict) and "Q" in inputs:
        _require_sm110(device_hint(inputs["Q"]))
    return prepare_gqa_decode(inputs, num_splits=num_splits, stream=stream)


def launch_sm110_gqa_decode_prepared(prepared: PreparedGqaDecode[_R], stream: StreamLike | None = None) -> _R:
    """Seed-compatible name of ``launch_prepared``."""
    return launch_prepared(prepared, stream)
