"""gqadrv's ops inside ``jax.jit`` / ``jax.lax.scan``, through ``jax.experimental.buffer_callback``.

    import gqadrv.jax as gj
    out = jax.jit(gj.gqa_decode)(q, kv, lengths)
    out, lse = gj.gqa_decode(q4, kv, lengths, return_lse=True)
    out = gj.gqa_decode_paged(q, k_pages, v_pages, block_table, seq_lens)
    v, s = gj.merge_state(v_a, s_a, v_b, s_b)
    out, lse = gj.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512)
    codes, scale = gj.quantize_kv_fp8(k)
    k8 = gj.quantize_k_cache(k_bf16); k16 = gj.dequantize_k_cache(k8)
    out, lse = gj.flash_mla_with_kvcache(q, k8, block_table, cache_seqlens, 512, is_fp8_kvcache=True)
    out, lse = gj.flash_mla_with_kvcache(q, k8, None, None, 512, is_fp8_kvcache=True, indices=indices,
                                         attn_sink=sink, topk_length=topk_length)   # sparse decode
    out, max_logits, lse = gj.flash_mla_sparse_fwd(q, kv, indices, sm_scale)   # sparse prefill

Each call becomes one XLA custom call whose Python callback receives JAX's CUDA stream
(``ExecutionContext.stream``) and XLA's device buffers (``Buffer``: DLPack-exportable, C-contiguous,
inputs read-only, outputs writable). The callback hands them to gqadrv as inputs and ``out=`` /
``lse=`` and launches on that stream, so the outputs are JAX-owned and ordered like any other XLA op.
Lengths and block tables are JAX arrays read on the device, so one compiled function serves every
length. The scalar options (``q_scale``, ``sm_scale``, ``softmax_scale``, ``causal``, ``num_splits``,
``backend``, ``is_fp8_kvcache``, ``head_axis``, a numeric quantizer scale, the sparse prefill's ``d_v``)
are static Python values, not traced arrays; which of the optional arrays (the MLA sparse arguments,
the sparse prefill's sinks, lengths and cu_seqlens) are given is static too.

The callback runs at every execution (it is not recorded into XLA command buffers), costing one
Python call and gqadrv's convenience-call host time per op; ``gqa_decode`` with one query token and
no LSE re-launches its layout's plan from the second execution on (XLA's buffers have a fast reader). gqadrv's split workspace comes from its
per-(device, stream) pool. There is no JVP / transpose rule (no gradients) and no batching rule.

Needs the ``jax`` extra (``pip install 'gqadrv[jax]'``, JAX >= 0.7 with a CUDA backend).
"""

from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised by tests/integrations/test_integrations_host.py
    raise ImportError("gqadrv.jax needs JAX >= 0.7 (jax.experimental.buffer_callback); install the extra: "
                      "pip install 'gqadrv[jax]'") from exc
try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:  # jax < 0.7
    raise ImportError(f"gqadrv.jax needs JAX >= 0.7 (jax.experimental.buffer_callback); found jax {jax.__version__}: "
                      "pip install 'gqadrv[jax]'") from exc

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, cast

from .gqa.api import gqa_decode as _gqa_decode
from .gqa.kv_fp8 import check_head_axis as _check_head_axis
from .gqa.kv_fp8 import check_scale_value as _check_scale_value
from .gqa.kv_fp8 import quantize_kv_fp8 as _quantize_kv_fp8
from .gqa.merge import merge_state as _merge_state
from .gqa.merge import merge_states as _merge_states
from .gqa.paged import gqa_decode_paged as _gqa_decode_paged
from .mla import contract as _mla_contract
from .mla import sparse_prefill as _sparse_prefill
from .mla import trace_checks as _trace
from .mla.api import flash_mla_with_kvcache as _flash_mla
from .mla.fp8_cache import dequantize_k_cache as _dequantize_k_cache
from .mla.fp8_cache import quantize_k_cache as _quantize_k_cache
from .ops import contract as _ops_contract
from .runtime.driver import device_scope

__all__ = ["dequantize_k_cache", "flash_mla_sparse_fwd", "flash_mla_with_kvcache", "gqa_decode", "gqa_decode_paged",
           "merge_state", "merge_states", "quantize_k_cache", "quantize_kv_fp8"]

_CACHE = 256  # compiled-callable cache entries per op (static options x shapes)


_MLA_OP = "gqadrv.jax.flash_mla_with_kvcache"  # the prefix of the MLA trace-time errors (mla.trace_checks)

def _static_float(name: str, v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except Exception as exc:  # a tracer: the scale is baked into the callback, it must be static
        raise TypeError(f"{name} must be a static Python number, not a traced value ({type(v).__name__})") from exc


_KDL_CUDA = 2


def _fp8_statics(kv_dtype: Any, k_scale: Any, v_scale: Any) -> tuple[tuple, tuple]:
    """FP8 options split into the static part of a callable's key ((kv_dtype, k number, v number,
    k is an array, v is an array)) and the array operands (device scales, in k, v order)."""
    kd = None if kv_dtype is None else str(kv_dtype).replace("jnp.", "")
    arrays = []
    nums: list = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None or isinstance(x, (int, float)) and not isinstance(x, bool):
            nums.append(_static_float(name, x))
        else:
            nums.append(None)
            arrays.append(x)
    flags = (k_scale is not None and nums[0] is None, v_scale is not None and nums[1] is None)
    return (kd, nums[0], nums[1]) + flags, tuple(arrays)


def _fp8_kwargs(static: tuple, scale_arrays: tuple) -> dict:
    """The library's FP8 keywords inside a callback: numbers from the key, arrays from the operands."""
    kd, kn, vn, k_arr, v_arr = static
    arrays = list(scale_arrays)
    kw: dict = {}
    if kd is not None:
        kw["kv_dtype"] = kd
    k = arrays.pop(0) if k_arr else kn
    v = arrays.pop(0) if v_arr else vn
    if k is not None:
        kw["k_scale"] = k
    if v is not None:
        kw["v_scale"] = v
    return kw


def _sds(shape: tuple[int, ...], dtype: Any) -> Any:
    """The output type of a callback (``jax.ShapeDtypeStruct``)."""
    return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]


def _cuda_target(ctx: Any, first_input: Any) -> tuple[int, int]:
    """(JAX's CUDA stream of this execution, the buffers' device ordinal); a clear error where the
    buffers are not CUDA memory (XLA's CPU backend has no stream: the callback would otherwise fail
    with an opaque FFI error)."""
    dev_type, ordinal = first_input.__dlpack_device__()
    if int(dev_type) != _KDL_CUDA:
        raise ValueError("gqadrv.jax runs on CUDA devices only; this computation was placed on a non-CUDA "
                         f"backend (DLPack device type {int(dev_type)}): put the arrays on a GPU")
    return int(ctx.stream), int(ordinal)


# ----------------------------------------------------------------------------- GQA decode
@functools.lru_cache(maxsize=_CACHE)
def _gqa_callable(shape: tuple[int, ...], dtype: Any, q_scale: float, sm_scale: float | None,
                  backend: str | None) -> Callable[..., Any]:
    """One buffer_callback per (output type, static options): the same callable object for equal
    calls, so eager (un-jitted) calls hit JAX's compilation cache."""
    scale_kw = {} if sm_scale is None else {"sm_scale": sm_scale}

    def run(ctx: Any, out: Any, q: Any, kv: Any, lengths: Any) -> None:
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):  # the callback runs on an XLA thread: XLA's context
            _gqa_decode(q, kv, lengths, out=out, q_scale=q_scale, stream=stream,
                        backend=backend, **scale_kw)  # type: ignore[arg-type]

    return cast("Callable[..., Any]", buffer_callback(run, _sds(shape, dtype)))


@functools.lru_cache(maxsize=_CACHE)
def _gqa_lse_callable(shape: tuple[int, ...], dtype: Any, q_scale: float, sm_scale: float | None,
                      deterministic: bool, backend: str | None, fp8: tuple = (None, None, None, False, False)
                      ) -> Callable[..., Any]:
    """gqa_decode with the LSE output (and/or the batch-invariant mode, an FP8 cache): two outputs;
    device FP8 scales are extra operands after the lengths."""
    scale_kw = {} if sm_scale is None else {"sm_scale": sm_scale}

    def run(ctx: Any, outs: Any, q: Any, kv: Any, lengths: Any, *scales: Any) -> None:
        out, lse = outs
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):
            _gqa_decode(q, kv, lengths, out=out, lse=lse, q_scale=q_scale, deterministic=deterministic,
                        stream=stream, backend=backend, **scale_kw,  # type: ignore[arg-type]
                        **_fp8_kwargs(fp8, scales))

    return cast("Callable[..., Any]", buffer_callback(run, (_sds(shape, dtype), _sds(shape[:-1], jnp.float32))))


def gqa_decode(q: jax.Array, kv: jax.Array, sequence_lengths: jax.Array, *, q_scale: float = 1.0,
               sm_scale: float | None = None, backend: str | None = None, return_lse: bool = False,
               deterministic: bool = False, kv_dtype: Any = None, k_scale: Any = None, v_scale: Any = None) -> Any:
    """``gqadrv.gqa_decode`` as an XLA custom call (usable under ``jax.jit``, ``lax.scan``, ...).

    q [B, Hq, D] or [B, s_q, Hq, D], kv [B, 2, Hkv, C, D], sequence_lengths int32 [B]; returns a new
    JAX array of q's shape and dtype, and with ``return_lse=True`` also the fp32 LSE [B, Hq] /
    [B, s_q, Hq]. Softmax scale ``q_scale / sqrt(D)``, or the absolute ``sm_scale`` (forwarded only
    when not None). ``return_lse`` and ``deterministic`` are static. FP8 caches: uint8 codes with
    ``kv_dtype='e4m3'`` (static) or a float8_e4m3fn kv; ``k_scale`` / ``v_scale`` static numbers or
    float32 arrays () / (1,) / (Hkv,) (operands: they may change between calls under jit).
    """
    if jnp.ndim(q) not in (3, 4) or jnp.ndim(kv) != 5:
        raise ValueError(f"gqadrv.jax.gqa_decode expects q [B, Hq, D] or [B, s_q, Hq, D] and kv [B, 2, Hkv, C, D], "
                         f"got q of rank {jnp.ndim(q)} and kv of rank {jnp.ndim(kv)}")
    qs, sm = _static_float("q_scale", q_scale), _static_float("sm_scale", sm_scale)
    fp8, scale_arrays = _fp8_statics(kv_dtype, k_scale, v_scale)
    is_fp8 = fp8 != (None, None, None, False, False) or "float8" in str(kv.dtype)
    if return_lse or deterministic or jnp.ndim(q) == 4 or is_fp8:
        fn = _gqa_lse_callable(tuple(q.shape), jnp.dtype(q.dtype), qs, sm, bool(deterministic), backend, fp8)
        out, lse = fn(q, kv, sequence_lengths, *scale_arrays)
        return (out, lse) if return_lse else out
    fn = _gqa_callable(tuple(q.shape), jnp.dtype(q.dtype), qs, sm, backend)
    return fn(q, kv, sequence_lengths)


# ----------------------------------------------------------------------------- paged GQA decode
@functools.lru_cache(maxsize=_CACHE)
def _paged_callable(shape: tuple[int, ...], dtype: Any, combined: bool, kv_layout: str, q_scale: float,
                    sm_scale: float | None, deterministic: bool, num_splits: int | None,
                    backend: str | None, fp8: tuple = (None, None, None, False, False)) -> Callable[..., Any]:
    scale_kw = {} if sm_scale is None else {"sm_scale": sm_scale}

    def launch(ctx: Any, outs: Any, q: Any, k: Any, v: Any, table: Any, lens: Any, scales: tuple) -> None:
        out, lse = outs
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):
            _gqa_decode_paged(q, k, v, table, lens, kv_layout=kv_layout, out=out, lse=lse, q_scale=q_scale,
                              deterministic=deterministic, num_splits=num_splits, stream=stream,
                              backend=backend, **scale_kw, **_fp8_kwargs(fp8, scales))  # type: ignore[arg-type]

    def run_combined(ctx: Any, outs: Any, q: Any, k: Any, table: Any, lens: Any, *scales: Any) -> None:
        launch(ctx, outs, q, k, None, table, lens, scales)

    def run_separate(ctx: Any, outs: Any, q: Any, k: Any, v: Any, table: Any, lens: Any, *scales: Any) -> None:
        launch(ctx, outs, q, k, v, table, lens, scales)

    result = (_sds(shape, dtype), _sds(shape[:-1], jnp.float32))
    return cast("Callable[..., Any]", buffer_callback(run_combined if combined else run_separate, result))


def gqa_decode_paged(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array | None, block_table: jax.Array,
                     seq_lens: jax.Array, *, kv_layout: str = "NHD", q_scale: float = 1.0,
                     sm_scale: float | None = None, return_lse: bool = False, deterministic: bool = False,
                     num_splits: int | None = None, backend: str | None = None, kv_dtype: Any = None,
                     k_scale: Any = None, v_scale: Any = None) -> Any:
    """``gqadrv.gqa_decode_paged`` as an XLA custom call: new out (q's shape) and, with
    ``return_lse=True``, the fp32 LSE. Tables and lengths are read on the device (one compilation
    serves every value); ``kv_layout``, the scales, ``deterministic`` and ``num_splits`` are static.
    FP8 pages: uint8 codes with ``kv_dtype='e4m3'`` (static) or float8_e4m3fn pages; ``k_scale`` /
    ``v_scale`` static numbers or float32 arrays () / (1,) / (Hkv,) (operands)."""
    if jnp.ndim(q) not in (3, 4):
        raise ValueError(f"gqadrv.jax.gqa_decode_paged expects q [B, Hq, D] or [B, s_q, Hq, D], got rank {jnp.ndim(q)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be None or a static int, got {type(num_splits).__name__}")
    fp8, scale_arrays = _fp8_statics(kv_dtype, k_scale, v_scale)
    fn = _paged_callable(tuple(q.shape), jnp.dtype(q.dtype), v_cache is None, str(kv_layout),
                         _static_float("q_scale", q_scale), _static_float("sm_scale", sm_scale), bool(deterministic),
                         num_splits, backend, fp8)
    args = (q, k_cache, block_table, seq_lens) if v_cache is None else (q, k_cache, v_cache, block_table, seq_lens)
    out, lse = fn(*args, *scale_arrays)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- LSE state merge
@functools.lru_cache(maxsize=_CACHE)
def _merge_callable(v_shape: tuple[int, ...], dtype: Any, stacked: bool) -> Callable[..., Any]:
    shape = (v_shape[0],) + v_shape[2:] if stacked else v_shape
    result = (_sds(shape, dtype), _sds(shape[:-1], jnp.float32))

    def run_pair(ctx: Any, outs: Any, v_a: Any, s_a: Any, v_b: Any, s_b: Any) -> None:
        out, lse = outs
        stream, ordinal = _cuda_target(ctx, v_a)
        with device_scope(ordinal):
            _merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=lse, stream=stream)

    def run_stacked(ctx: Any, outs: Any, v: Any, s: Any) -> None:
        out, lse = outs
        stream, ordinal = _cuda_target(ctx, v)
        with device_scope(ordinal):
            _merge_states(v, s, out=out, out_lse=lse, stream=stream)

    return cast("Callable[..., Any]", buffer_callback(run_stacked if stacked else run_pair, result))


def merge_state(v_a: jax.Array, s_a: jax.Array, v_b: jax.Array, s_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``gqadrv.merge_state`` as an XLA custom call: new (v, s)."""
    out, lse = _merge_callable(tuple(v_a.shape), jnp.dtype(v_a.dtype), False)(v_a, s_a, v_b, s_b)
    return out, lse


def merge_states(v: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``gqadrv.merge_states`` (stacked form: v [N, K, H, D], s [N, K, H]) as an XLA custom call:
    new (v [N, H, D], s [N, H])."""
    if jnp.ndim(v) != 4:
        raise ValueError(f"gqadrv.jax.merge_states expects stacked states v [N, K, H, D], got rank {jnp.ndim(v)}")
    out, lse = _merge_callable(tuple(v.shape), jnp.dtype(v.dtype), True)(v, s)
    return out, lse


# ----------------------------------------------------------------------------- MLA decode
# FlashMLA's V3.2 FP8 cache (512 e4m3 codes, 4 fp32 scales, 64 bf16 RoPE channels): the library's own rules
_MLA_FP8_ROW_BYTES = _mla_contract.FP8_ROW_BYTES
_MLA_D_QK = _mla_contract.D_QK
_FP8_CACHE_DTYPES = _mla_contract.FP8_CACHE_DTYPES


def _as_fp8_bytes(x: jax.Array) -> jax.Array:
    """A float8_e4m3fn array as its uint8 bits (an XLA bitcast: same shape, same bytes), because a
    callback's float8 buffer may not be DLPack-exportable; uint8 / int8 pass unchanged."""
    if jnp.dtype(x.dtype).name == "float8_e4m3fn":
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    return x


def _static_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a static Python bool, got {type(v).__name__}")
    return v


_MLA_DENSE_OPERANDS = ("block_table", "cache_seqlens")
_MLA_SPARSE_ARGS = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                    "extra_topk_length")


@functools.lru_cache(maxsize=_CACHE)
def _mla_callable(q_shape: tuple[int, ...], dtype: Any, head_dim_v: int, num_splits: int | None,
                  softmax_scale: float | None, causal: bool, backend: str | None,
                  is_fp8_kvcache: bool = False, operands: tuple[str, ...] = _MLA_DENSE_OPERANDS) -> Callable[..., Any]:
    """``operands``: the names of the array operands after q and k_cache, in order (the dense path:
    block_table, cache_seqlens; the sparse path: the optional arrays given). Those not named are None
    in the library call; the sparse ones are forwarded only when given."""
    b, s_q, h_q, _ = q_shape
    result = (_sds((b, s_q, h_q, head_dim_v), dtype), _sds((b, h_q, s_q), jnp.float32))

    def run(ctx: Any, outs: Any, q: Any, k_cache: Any, *arrays: Any) -> None:
        out, lse = outs
        given = dict(zip(operands, arrays))
        block_table, cache_seqlens = given.pop("block_table", None), given.pop("cache_seqlens", None)
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):  # the callback runs on an XLA thread: XLA's context
            _flash_mla(q, k_cache, block_table, cache_seqlens, head_dim_v, None, num_splits, softmax_scale, causal,
                       is_fp8_kvcache=is_fp8_kvcache, out=out, lse=lse, stream=stream,
                       backend=backend, **given)  # type: ignore[arg-type]

    return cast("Callable[..., Any]", buffer_callback(run, result))


def _dtype_str(x: Any) -> str:
    return str(jnp.dtype(x.dtype).name)


def _check_mla_fp8_cache(name: str, q: Any, k: Any) -> None:
    if jnp.dtype(q.dtype) != jnp.bfloat16:
        raise TypeError(f"gqadrv.jax.flash_mla_with_kvcache: is_fp8_kvcache=True needs a bfloat16 q, got {q.dtype}")
    if jnp.ndim(k) != 4 or k.shape[-1] != _MLA_FP8_ROW_BYTES or _dtype_str(k) not in _FP8_CACHE_DTYPES:
        raise ValueError(f"gqadrv.jax.flash_mla_with_kvcache: is_fp8_kvcache=True needs {name} [num_blocks, "
                         f"page_size, h_kv, {_MLA_FP8_ROW_BYTES}] of dtype {' / '.join(_FP8_CACHE_DTYPES)}, got "
                         f"{tuple(k.shape)} {k.dtype}")


def _meta(x: Any) -> _trace.Meta | None:
    return None if x is None else _trace.Meta(tuple(int(d) for d in x.shape), _dtype_str(x))


def _check_mla_sparse(q: Any, k_cache: Any, head_dim_v: int, causal: bool, is_fp8_kvcache: bool,
                      sparse: dict) -> None:
    """Trace-time form of gqadrv's sparse-path rules (shapes and dtypes, mla.trace_checks; the library
    checks everything again in the callback)."""
    _trace.check_sparse_decode(_MLA_OP, _meta(q), _meta(k_cache), head_dim_v, causal, is_fp8_kvcache,
                               {k: _meta(v) for k, v in sparse.items()})


def flash_mla_with_kvcache(q: jax.Array, k_cache: jax.Array, block_table: jax.Array | None = None,
                           cache_seqlens: jax.Array | None = None, head_dim_v: int = 512,
                           tile_scheduler_metadata: Any = None, num_splits: int | None = None,
                           softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: jax.Array | None = None, attn_sink: jax.Array | None = None,
                           extra_k_cache: jax.Array | None = None, extra_indices_in_kvcache: jax.Array | None = None,
                           topk_length: jax.Array | None = None, extra_topk_length: jax.Array | None = None, *,
                           backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``gqadrv.flash_mla_with_kvcache`` (FlashMLA's names and order, dense and sparse paths) as an XLA
    custom call.

    Returns new JAX arrays ``(out [b, s_q, h_q, head_dim_v] in q's dtype, lse fp32 [b, h_q, s_q])``.
    ``tile_scheduler_metadata`` is accepted for FlashMLA compatibility and ignored.
    ``is_fp8_kvcache=True`` (static): k_cache is FlashMLA's 656-byte FP8 cache [num_blocks, page_size,
    h_kv, 656] (uint8 / int8 / float8_e4m3fn, as ``quantize_k_cache`` writes it) and q must be bfloat16.

    Dense path (``indices`` None): block_table int32 [b, max_blocks] and cache_seqlens int32 [b] are
    required; the sparse arguments must be None.

    Sparse path (``indices`` int32 [b, s_q, topk] given): k_cache [num_blocks, page_size, 1, 656] FP8 or
    [num_blocks, page_size, 1, 576] of q's dtype; ``attn_sink`` float32 [h_q]; ``topk_length`` int32
    [b]; ``extra_k_cache`` (same format, own num_blocks / page) with ``extra_indices_in_kvcache`` int32
    [b, s_q, extra_topk] and ``extra_topk_length`` int32 [b]; block_table / cache_seqlens are ignored
    (may be None); causal must be False; head_dim_v 512. The arrays given are operands (their values
    may change between calls of one compilation); which of them are given is static.
    """
    del tile_scheduler_metadata
    if jnp.ndim(q) != 4:
        raise ValueError(f"gqadrv.jax.flash_mla_with_kvcache expects q [b, s_q, h_q, d], got rank {jnp.ndim(q)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be None or a static int, got {type(num_splits).__name__}")
    fp8 = _static_bool("is_fp8_kvcache", is_fp8_kvcache)
    sparse = dict(zip(_MLA_SPARSE_ARGS, (indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                                         extra_topk_length)))
    statics = (tuple(q.shape), jnp.dtype(q.dtype), int(head_dim_v), num_splits,
               _static_float("softmax_scale", softmax_scale))
    if indices is None:
        _trace.check_dense_arguments(_MLA_OP, block_table is not None, cache_seqlens is not None,
                                     [k for k, v in sparse.items() if v is not None])
        if fp8:
            _check_mla_fp8_cache("k_cache", q, k_cache)
            k_cache = _as_fp8_bytes(k_cache)
        fn = _mla_callable(*statics, bool(causal), backend, fp8)
        out, lse = fn(q, k_cache, block_table, cache_seqlens)
        return out, lse
    causal = _static_bool("causal", causal)
    _check_mla_sparse(q, k_cache, int(head_dim_v), causal, fp8, sparse)
    if fp8:   # float8 pools travel as their uint8 bytes
        k_cache = _as_fp8_bytes(k_cache)
        if extra_k_cache is not None:
            sparse["extra_k_cache"] = _as_fp8_bytes(extra_k_cache)
    # block_table / cache_seqlens are ignored by the sparse path: not operands
    names = tuple(k for k, v in sparse.items() if v is not None)
    fn = _mla_callable(*statics, causal, backend, fp8, names)
    out, lse = fn(q, k_cache, *(sparse[k] for k in names))
    return out, lse


# ----------------------------------------------------------------------------- sparse MLA prefill
_SPARSE_D_QKS = _sparse_prefill.D_QKS
_SPARSE_FWD_OPERANDS = ("attn_sink", "topk_length", "cu_seqlens_q", "cu_seqlens_kv")


def _sparse_fwd_into(q: Any, kv: Any, indices: Any, sm_scale: float, d_v: int, attn_sink: Any, topk_length: Any,
                     cu_seqlens_q: Any, cu_seqlens_kv: Any, *, out: Any, stats: Any, stream: int,
                     backend: str | None) -> None:
    """``gqadrv.flash_mla_sparse_fwd`` writing into the framework-allocated ``out`` bf16 [s_q, h_q, 512]
    and ``stats`` fp32 [2, s_q, h_q] (``stats[0]`` max_logits, ``stats[1]`` lse: the kernel writes a
    row's max logit at a fixed offset from its LSE, so both live in one buffer), on ``stream``."""
    _sparse_prefill.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, out=out, stats=stats,
                                         stream=stream, backend=backend)


@functools.lru_cache(maxsize=_CACHE)
def _sparse_fwd_callable(s_q: int, h_q: int, sm_scale: float, d_v: int, backend: str | None,
                         operands: tuple[str, ...] = ()) -> Callable[..., Any]:
    """Outputs (out bf16 [s_q, h_q, 512], stats fp32 [2, s_q, h_q]); ``operands``: the names of the
    optional arrays given after q, kv and indices, in ``_SPARSE_FWD_OPERANDS`` order."""
    result = (_sds((s_q, h_q, _mla_contract.D_V), jnp.bfloat16), _sds((2, s_q, h_q), jnp.float32))

    def run(ctx: Any, outs: Any, q: Any, kv: Any, indices: Any, *arrays: Any) -> None:
        out, stats = outs
        given = dict(zip(operands, arrays))
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):  # the callback runs on an XLA thread: XLA's context
            _sparse_fwd_into(q, kv, indices, sm_scale, d_v, given.get("attn_sink"), given.get("topk_length"),
                             given.get("cu_seqlens_q"), given.get("cu_seqlens_kv"), out=out, stats=stats,
                             stream=stream, backend=backend)

    return cast("Callable[..., Any]", buffer_callback(run, result))


def _check_sparse_fwd(q: Any, kv: Any, indices: Any, d_v: int, given: dict) -> tuple[int, int]:
    """Trace-time form of gqadrv's sparse-prefill rules (shapes and dtypes, mla.trace_checks; the library
    checks everything again in the callback): (s_q, h_q)."""
    return _trace.check_sparse_prefill("gqadrv.jax.flash_mla_sparse_fwd", _meta(q), _meta(kv), _meta(indices), None,
                                       d_v, *(_meta(given.get(n)) for n in ("attn_sink", "topk_length", "cu_seqlens_q",
                                                                             "cu_seqlens_kv")))


def flash_mla_sparse_fwd(q: jax.Array, kv: jax.Array, indices: jax.Array, sm_scale: float, d_v: int = 512,
                         attn_sink: jax.Array | None = None, topk_length: jax.Array | None = None, *,
                         cu_seqlens_q: jax.Array | None = None, cu_seqlens_kv: jax.Array | None = None,
                         backend: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``gqadrv.flash_mla_sparse_fwd`` (FlashMLA's DeepSeek sparse prefill, its names and order) as an
    XLA custom call.

    q bf16 [s_q, h_q, d_qk] (d_qk 576 or 512, h_q 1..128), kv bf16 [s_kv, 1, d_qk], indices int32
    [s_q, 1, topk] (an index < 0 or >= s_kv, or outside the request's KV rows in the varlen form, is
    invalid); ``sm_scale`` (absolute, required) and ``d_v`` (512) static; ``attn_sink`` float32
    [h_q]; ``topk_length`` int32 [s_q]; ``cu_seqlens_q`` / ``cu_seqlens_kv`` int32 [n + 1] (both or
    neither: request i's query tokens index its own KV rows from 0). The arrays given are operands
    (their values may change between calls of one compilation); which of them are given is static.
    Returns new JAX arrays ``(out bf16 [s_q, h_q, 512], max_logits fp32 [s_q, h_q], lse fp32 [s_q,
    h_q])``; a row without a valid index gives out 0, max_logits -inf, lse +inf. (The callback writes
    max_logits and lse into one fp32 [2, s_q, h_q] output, sliced here.)
    """
    if sm_scale is None:
        raise TypeError("sm_scale is required (FlashMLA's flash_mla_sparse_fwd has no default), e.g. d_qk ** -0.5")
    scale = _ops_contract.check_positive_scale("sm_scale", _static_float("sm_scale", sm_scale),
                                               limit=_ops_contract.F32_MAX / math.log2(math.e))
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral):
        raise TypeError(f"d_v must be a static int, got {type(d_v).__name__}")
    arrays = dict(zip(_SPARSE_FWD_OPERANDS, (attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv)))
    given = {n: x for n, x in arrays.items() if x is not None}
    s_q, h_q = _check_sparse_fwd(q, kv, indices, int(d_v), given)
    fn = _sparse_fwd_callable(s_q, h_q, scale, int(d_v), backend, tuple(given))
    out, stats = fn(q, kv, indices, *given.values())
    return out, stats[0], stats[1]


# ----------------------------------------------------------------------------- FP8 KV quantizer
_KV_FP8_INPUTS = ("float16", "bfloat16", "float32")


@functools.lru_cache(maxsize=_CACHE)
def _kv_fp8_callable(shape: tuple[int, ...], mode: str, value: float | None,
                     head_axis: int | None) -> Callable[..., Any]:
    """``mode``: "computed" (outputs codes and the float32 () scale), "value" (a static number: codes
    only), "array" (a float32 device scale operand, per tensor or per head along ``head_axis``: codes
    only)."""
    codes_t = _sds(shape, jnp.uint8)

    def run_computed(ctx: Any, outs: Any, x: Any) -> None:
        codes, scale = outs
        stream, ordinal = _cuda_target(ctx, x)
        with device_scope(ordinal):
            _quantize_kv_fp8(x, None, out=codes, out_scale=scale, stream=stream)

    def run_value(ctx: Any, codes: Any, x: Any) -> None:
        stream, ordinal = _cuda_target(ctx, x)
        with device_scope(ordinal):
            _quantize_kv_fp8(x, value, out=codes, stream=stream)

    def run_array(ctx: Any, codes: Any, x: Any, scale: Any) -> None:
        stream, ordinal = _cuda_target(ctx, x)
        with device_scope(ordinal):
            _quantize_kv_fp8(x, scale, head_axis=head_axis, out=codes, stream=stream)

    if mode == "computed":
        return cast("Callable[..., Any]", buffer_callback(run_computed, (codes_t, _sds((), jnp.float32))))
    return cast("Callable[..., Any]", buffer_callback(run_value if mode == "value" else run_array, codes_t))


def quantize_kv_fp8(x: jax.Array, scale: Any = None, *, head_axis: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``gqadrv.quantize_kv_fp8`` as an XLA custom call: ``(codes, scale)`` with codes a new uint8 array
    of x's shape (e4m3 bits; ``jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)`` gives JAX's float8).

    x float16 / bfloat16 / float32, any shape. ``scale``:

    * None: computed on the device (``max(amax / 448, 2^-126)``); returned as a new float32 array ().
    * a Python / numpy number > 0: static (baked into the callback); returned as ``jnp.float32(scale)``.
    * a float32 array (one element, or [H] with the static ``head_axis``): an operand read on the
      device (it may change between calls under jit); returned as given.
    """
    if jnp.dtype(x.dtype).name not in _KV_FP8_INPUTS:
        raise TypeError(f"gqadrv.jax.quantize_kv_fp8 expects x float16, bfloat16 or float32, got {x.dtype}")
    shape = tuple(x.shape)
    if scale is None:
        if head_axis is not None:
            raise ValueError("head_axis selects per-head scales, which must be given (scale=array [H]); a computed "
                             "scale is per tensor: pass head_axis=None")
        codes, s = _kv_fp8_callable(shape, "computed", None, None)(x)
        return codes, s
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if head_axis is not None:
            raise ValueError("head_axis needs per-head scales as a float32 array [H], not a number")
        value = _check_scale_value(scale)   # float32(scale), validated as the library does
        codes = _kv_fp8_callable(shape, "value", value, None)(x)
        return codes, jnp.asarray(value, dtype=jnp.float32)
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
        raise TypeError(f"scale must be None, a number or a float32 array, got {type(scale).__name__}")
    if jnp.dtype(scale.dtype) != jnp.float32:
        raise TypeError(f"a device scale must be float32, got {scale.dtype}")
    axis = None
    if head_axis is None:
        if int(jnp.size(scale)) != 1:
            raise ValueError(f"a per-tensor scale has one element (shape () or (1,)), got {tuple(scale.shape)}; "
                             "per-KV-head scales [H] need head_axis (the axis of x that indexes them)")
    else:
        axis = _check_head_axis(head_axis, len(shape))
        if tuple(scale.shape) != (shape[axis],):
            raise ValueError(f"per-head scales must have shape ({shape[axis]},) (x.shape[{head_axis}]), got "
                             f"{tuple(scale.shape)}")
    codes = _kv_fp8_callable(shape, "array", None, axis)(x, scale)
    return codes, scale


# ----------------------------------------------------------------------------- FP8 MLA cache (656 bytes per token)
def _k_cache_shape(op: str, k: Any, last: int, dtypes: tuple[str, ...]) -> tuple[int, int]:
    if jnp.ndim(k) != 4 or k.shape[2] != 1 or k.shape[3] != last:
        raise ValueError(f"gqadrv.jax.{op} expects [num_blocks, page_size, 1, {last}], got {tuple(k.shape)}")
    if jnp.dtype(k.dtype).name not in dtypes:
        raise TypeError(f"gqadrv.jax.{op} expects dtype {' or '.join(dtypes)}, got {k.dtype}")
    return int(k.shape[0]), int(k.shape[1])


@functools.lru_cache(maxsize=_CACHE)
def _k_cache_callable(nb: int, page: int, quantize: bool) -> Callable[..., Any]:
    def run_quantize(ctx: Any, out: Any, k: Any) -> None:
        stream, ordinal = _cuda_target(ctx, k)
        with device_scope(ordinal):
            _quantize_k_cache(k, out=out, stream=stream)

    def run_dequantize(ctx: Any, out: Any, k: Any) -> None:
        stream, ordinal = _cuda_target(ctx, k)
        with device_scope(ordinal):
            _dequantize_k_cache(k, out=out, stream=stream)

    if quantize:
        return cast("Callable[..., Any]", buffer_callback(run_quantize, _sds((nb, page, 1, _MLA_FP8_ROW_BYTES),
                                                                             jnp.uint8)))
    return cast("Callable[..., Any]", buffer_callback(run_dequantize, _sds((nb, page, 1, _MLA_D_QK), jnp.bfloat16)))


def quantize_k_cache(k_bf16: jax.Array) -> jax.Array:
    """``gqadrv.quantize_k_cache`` as an XLA custom call: bf16 [num_blocks, page, 1, 576] to a new uint8
    [num_blocks, page, 1, 656] (FlashMLA's V3.2 FP8 format)."""
    nb, page = _k_cache_shape("quantize_k_cache", k_bf16, _MLA_D_QK, ("bfloat16",))
    out: jax.Array = _k_cache_callable(nb, page, True)(k_bf16)
    return out


def dequantize_k_cache(k_fp8: jax.Array) -> jax.Array:
    """``gqadrv.dequantize_k_cache`` as an XLA custom call: uint8 / int8 / float8_e4m3fn [num_blocks,
    page, 1, 656] to a new bf16 [num_blocks, page, 1, 576] (float8 is bitcast to uint8 first)."""
    nb, page = _k_cache_shape("dequantize_k_cache", k_fp8, _MLA_FP8_ROW_BYTES, _FP8_CACHE_DTYPES)
    out: jax.Array = _k_cache_callable(nb, page, False)(_as_fp8_bytes(k_fp8))
    return out
