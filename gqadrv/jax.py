"""gqadrv's ops inside ``jax.jit`` / ``jax.lax.scan``, through ``jax.experimental.buffer_callback``.

    import gqadrv.jax as gj
    out = jax.jit(gj.gqa_decode)(q, kv, lengths)
    out, lse = gj.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512)

Each call becomes one XLA custom call whose Python callback receives JAX's CUDA stream
(``ExecutionContext.stream``) and XLA's device buffers (``Buffer``: DLPack-exportable, C-contiguous,
inputs read-only, outputs writable). The callback hands them to gqadrv as inputs and ``out=`` /
``lse=`` and launches on that stream, so the outputs are JAX-owned and ordered like any other XLA op.
Lengths and block tables are JAX arrays read on the device, so one compiled function serves every
length. The scalar options (``q_scale``, ``sm_scale``, ``softmax_scale``, ``causal``, ``num_splits``,
``backend``) are static Python values, not traced arrays.

The callback runs at every execution (it is not recorded into XLA command buffers), costing one
Python call and gqadrv's convenience-call host time per op. gqadrv's split workspace comes from its
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
from collections.abc import Callable
from typing import Any, cast

from .gqa.api import gqa_decode as _gqa_decode
from .mla.api import flash_mla_with_kvcache as _flash_mla
from .runtime.driver import device_scope

__all__ = ["flash_mla_with_kvcache", "gqa_decode"]

_CACHE = 256  # compiled-callable cache entries per op (static options x shapes)


def _static_float(name: str, v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except Exception as exc:  # a tracer: the scale is baked into the callback, it must be static
        raise TypeError(f"{name} must be a static Python number, not a traced value ({type(v).__name__})") from exc


_KDL_CUDA = 2


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


def gqa_decode(q: jax.Array, kv: jax.Array, sequence_lengths: jax.Array, *, q_scale: float = 1.0,
               sm_scale: float | None = None, backend: str | None = None) -> jax.Array:
    """``gqadrv.gqa_decode`` as an XLA custom call (usable under ``jax.jit``, ``lax.scan``, ...).

    q [B, Hq, D], kv [B, 2, Hkv, C, D], sequence_lengths int32 [B]; returns a new JAX array
    [B, Hq, D] of q's dtype. Softmax scale ``q_scale / sqrt(D)``, or the absolute ``sm_scale`` where
    the installed gqadrv supports it (forwarded only when not None).
    """
    if jnp.ndim(q) != 3 or jnp.ndim(kv) != 5:
        raise ValueError(f"gqadrv.jax.gqa_decode expects q [B, Hq, D] and kv [B, 2, Hkv, C, D], got q of rank "
                         f"{jnp.ndim(q)} and kv of rank {jnp.ndim(kv)}")
    fn = _gqa_callable(tuple(q.shape), jnp.dtype(q.dtype), _static_float("q_scale", q_scale),
                       _static_float("sm_scale", sm_scale), backend)
    return fn(q, kv, sequence_lengths)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- MLA decode
@functools.lru_cache(maxsize=_CACHE)
def _mla_callable(q_shape: tuple[int, ...], dtype: Any, head_dim_v: int, num_splits: int | None,
                  softmax_scale: float | None, causal: bool, backend: str | None) -> Callable[..., Any]:
    b, s_q, h_q, _ = q_shape
    result = (_sds((b, s_q, h_q, head_dim_v), dtype), _sds((b, h_q, s_q), jnp.float32))

    def run(ctx: Any, outs: Any, q: Any, k_cache: Any, block_table: Any, cache_seqlens: Any) -> None:
        out, lse = outs
        stream, ordinal = _cuda_target(ctx, q)
        with device_scope(ordinal):  # the callback runs on an XLA thread: XLA's context
            _flash_mla(q, k_cache, block_table, cache_seqlens, head_dim_v, None, num_splits, softmax_scale, causal,
                       out=out, lse=lse, stream=stream, backend=backend)  # type: ignore[arg-type]

    return cast("Callable[..., Any]", buffer_callback(run, result))


def flash_mla_with_kvcache(q: jax.Array, k_cache: jax.Array, block_table: jax.Array, cache_seqlens: jax.Array,
                           head_dim_v: int = 512, tile_scheduler_metadata: Any = None, num_splits: int | None = None,
                           softmax_scale: float | None = None, causal: bool = False, *,
                           backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``gqadrv.flash_mla_with_kvcache`` (FlashMLA's names and order, dense path) as an XLA custom call.

    Returns new JAX arrays ``(out [b, s_q, h_q, head_dim_v] in q's dtype, lse fp32 [b, h_q, s_q])``.
    ``tile_scheduler_metadata`` is accepted for FlashMLA compatibility and ignored.
    """
    del tile_scheduler_metadata
    if jnp.ndim(q) != 4:
        raise ValueError(f"gqadrv.jax.flash_mla_with_kvcache expects q [b, s_q, h_q, d], got rank {jnp.ndim(q)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be None or a static int, got {type(num_splits).__name__}")
    fn = _mla_callable(tuple(q.shape), jnp.dtype(q.dtype), int(head_dim_v), num_splits,
                       _static_float("softmax_scale", softmax_scale), bool(causal), backend)
    out, lse = fn(q, k_cache, block_table, cache_seqlens)
    return out, lse
