"""gqadrv's public surface as a typed caller uses it: checked by ``mypy --strict`` (tests/test_typing.py
and the ``files`` of ``[tool.mypy]`` in pyproject.toml), never run. ``assert_type`` pins the types
the hints promise (outputs follow the caller's array types, prepared objects carry their output).

Stand-in classes play the frameworks: CuPy has no type information (its arrays are ``Any`` to a
checker), torch and JAX type ``__dlpack__`` / ``__dlpack_device__`` the way these classes do.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

import gqadrv
from gqadrv import (
    CompileError,
    CudaDriverError,
    FeatureError,
    MlaSchedMeta,
    NoGpuError,
    Prepared,
    PreparedGqaDecode,
    PreparedMlaDecode,
    TensorMapError,
    check_status,
    dequantize_k_cache,
    flash_mla_with_kvcache,
    get_mla_metadata,
    gqa_decode,
    gqa_decode_paged,
    gqa_decode_reference,
    launch_prepared,
    launch_sm110_gqa_decode_prepared,
    merge_state,
    merge_states,
    mla_decode_reference,
    prepare_gqa_decode,
    prepare_mla_decode,
    prepare_sm110_gqa_decode,
    quantize_k_cache,
    quantize_kv_fp8,
    sm110_gqa_decode,
)
from gqadrv.types import Backend, DLPackArray, MlaBackend, StreamLike


class TorchLike:
    """torch.Tensor's DLPack signatures (device type an IntEnum)."""

    def __dlpack__(self, *, stream: Any | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[enum.IntEnum, int] | None = None, copy: bool | None = None) -> Any:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[enum.IntEnum, int]:
        raise NotImplementedError


class JaxLike:
    """jax.Array's DLPack signatures (device type an Enum)."""

    def __dlpack__(self, *, stream: int | Any | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[enum.Enum, int] | None = None, copy: bool | None = None) -> Any:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[enum.Enum, int]:
        raise NotImplementedError


class TorchStream:
    cuda_stream: int = 0


class CupyStream:
    @property
    def ptr(self) -> int:
        return 0


class CoreStream:
    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0)


def gqa(q: TorchLike, kv: TorchLike, lens: TorchLike, o: JaxLike, cupy_array: Any, backend: Backend,
        streams: list[StreamLike]) -> None:
    assert_type(gqa_decode(q, kv, lens), TorchLike)
    assert_type(gqa_decode(q, kv, lens, q_scale=0.5, stream=0, backend="hopper"), TorchLike)
    assert_type(gqa_decode(q, kv, lens, sm_scale=0.088), TorchLike)
    assert_type(gqa_decode(q, kv, lens, out=o, sm_scale=None), JaxLike)
    assert_type(gqa_decode(q, kv, lens, out=o), JaxLike)
    maybe_out: JaxLike | None = None
    assert_type(gqa_decode(q, kv, lens, out=maybe_out), TorchLike | JaxLike)
    assert_type(gqa_decode(cupy_array, cupy_array, cupy_array), Any)
    for s in (None, 7, TorchStream(), CupyStream(), CoreStream(), *streams):
        gqa_decode(q, kv, lens, stream=s, backend=backend)
    assert_type(gqa_decode_paged(q, kv, kv, lens, lens), TorchLike)
    assert_type(gqa_decode_paged(q, kv, None, lens, lens, kv_layout="HND", deterministic=True), TorchLike)
    assert_type(gqa_decode_paged(q, kv, kv, lens, lens, out=o), JaxLike)
    assert_type(gqa_decode_paged(q, kv, kv, lens, lens, return_lse=True), tuple[Any, Any])
    assert_type(gqa_decode(q, kv, lens, return_lse=True), tuple[Any, Any])
    assert_type(sm110_gqa_decode(q, kv, lens), TorchLike)
    assert_type(sm110_gqa_decode(q, kv, lens, out=o, stream=CoreStream()), JaxLike)
    assert_type(sm110_gqa_decode(q, kv, lens, sm_scale=0.1), TorchLike)

    p = prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens, num_splits=4, backend="portable")
    assert_type(p, PreparedGqaDecode[JaxLike])
    assert_type(launch_prepared(p), JaxLike)
    assert_type(launch_prepared(p, TorchStream()), JaxLike)
    assert_type(launch_sm110_gqa_decode_prepared(p), JaxLike)
    assert_type(p.output, JaxLike)
    assert_type(check_status(p), dict[str, list[int]])
    facts: tuple[str, int, tuple[int, ...], int, str, int] = (p.route, p.num_splits, p.grid, p.workspace_bytes,
                                                               p.arch, p.stream)
    del facts
    base: Prepared[JaxLike] = p
    del base

    d = prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, q_scale=2.0, stream=CupyStream())
    assert_type(prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens, sm_scale=0.1), PreparedGqaDecode[JaxLike])
    assert_type(prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, sm_scale=0.1),
                PreparedGqaDecode[Any])
    assert_type(d, PreparedGqaDecode[Any])
    assert_type(prepare_sm110_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, 2),
                PreparedGqaDecode[Any])


def mla(q: TorchLike, k_cache: TorchLike, block_table: TorchLike, lens: TorchLike, o: JaxLike, lse: JaxLike,
        backend: MlaBackend) -> None:
    meta, nothing = get_mla_metadata()
    assert_type(meta, MlaSchedMeta)
    assert_type(nothing, None)
    assert_type(meta.have_initialized, bool)
    get_mla_metadata(lens, 1, 1)  # FlashMLA's older calling form

    out, lse_new = flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, causal=True, backend="seesaw")
    assert_type(out, TorchLike)
    assert_type(lse_new, TorchLike)
    # caller-given outputs come back as given; a checker sees "given or q's type", exact when they agree
    assert_type(flash_mla_with_kvcache(q, k_cache, block_table, lens, out=q, lse=q), tuple[TorchLike, TorchLike])
    assert_type(flash_mla_with_kvcache(q, k_cache, block_table, lens, out=o, lse=lse),
                tuple[JaxLike | TorchLike, JaxLike | TorchLike])
    flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, None, 2, 0.04, False, False, None, stream=0,
                           backend=backend)

    p = prepare_mla_decode(q, k_cache, block_table, lens, softmax_scale=0.1, num_splits=8, stream=TorchStream())
    assert_type(p, PreparedMlaDecode[tuple[TorchLike, TorchLike]])
    out2, lse2 = launch_prepared(p)
    assert_type(out2, TorchLike)
    assert_type(lse2, TorchLike)
    assert_type(launch_prepared(prepare_mla_decode(q, k_cache, block_table, lens, out=q, lse=lse)),
                tuple[TorchLike, JaxLike | TorchLike])


def merge(v: TorchLike, s: TorchLike, o: JaxLike, lse: JaxLike, cupy_array: Any) -> None:
    mv, ms = merge_state(v, s, v, s)
    assert_type(mv, TorchLike)
    assert_type(ms, TorchLike)
    assert_type(merge_state(v, s, v, s, out=v, out_lse=v), tuple[TorchLike, TorchLike])
    assert_type(merge_state(v, s, v, s, out=o, out_lse=lse, stream=0),
                tuple[JaxLike | TorchLike, JaxLike | TorchLike])
    assert_type(merge_states(v, s), tuple[TorchLike, TorchLike])  # stacked [N, K, H, D] / [N, K, H]
    assert_type(merge_states([v, v, v], [s, s, s], stream=TorchStream()), tuple[TorchLike, TorchLike])
    assert_type(merge_states((v, v), (s, s), out=o), tuple[JaxLike | TorchLike, TorchLike])
    assert_type(merge_states(cupy_array, cupy_array, stream=CupyStream()), tuple[Any, Any])


def fp8(k: TorchLike, o: JaxLike, s: TorchLike, cupy_array: Any) -> None:
    assert_type(quantize_k_cache(k), TorchLike)
    assert_type(quantize_k_cache(k, out=o, stream=0), JaxLike | TorchLike)
    assert_type(dequantize_k_cache(k, stream=TorchStream()), TorchLike)
    assert_type(dequantize_k_cache(cupy_array, out=k), TorchLike | Any)
    codes, scale = quantize_kv_fp8(k)                      # computed scale: a device array in k's framework
    assert_type(codes, TorchLike)
    assert_type(scale, TorchLike)
    assert_type(quantize_kv_fp8(k, 0.5), tuple[TorchLike, float])
    assert_type(quantize_kv_fp8(k, s, head_axis=-2, out=o), tuple[JaxLike | TorchLike, TorchLike])
    assert_type(quantize_kv_fp8(k, out=o, out_scale=o, stream=CupyStream()),
                tuple[JaxLike | TorchLike, JaxLike | TorchLike])


def references(q: npt.NDArray[np.float16], kv: npt.NDArray[np.float16], k_cache: npt.NDArray[Any]) -> None:
    assert_type(gqa_decode_reference(q, kv, [3, 5], q_scale=0.5), npt.NDArray[np.float64])
    assert_type(gqa_decode_reference(q, kv, [3, 5], sm_scale=0.1), npt.NDArray[np.float64])
    ref_out, ref_lse = mla_decode_reference(q, k_cache, [[0, 1]], [7], 512, None, True)
    assert_type(ref_out, npt.NDArray[np.float64])
    assert_type(ref_lse, npt.NDArray[np.float64])


def errors_and_protocols() -> None:
    kinds: tuple[type[Exception], ...] = (CompileError, CudaDriverError, FeatureError, NoGpuError, TensorMapError)
    del kinds
    assert_type(gqadrv.__version__, str)
    host: DLPackArray = np.zeros(3)  # a DLPack producer (the CUDA device is checked at run time)
    assert isinstance(host, DLPackArray)
