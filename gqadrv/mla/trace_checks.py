"""Trace-time checks of the sparse MLA paths for the framework wrappers (``gqadrv.torch`` fake
implementations, ``gqadrv.jax`` abstract evaluation): shapes and dtypes only, on framework-neutral
``Meta`` records, so that a traced program fails where it is written instead of inside the launch.
The library checks everything again at run time (strides, devices and alignment included).
``op`` prefixes every message (``gqadrv::flash_mla_with_kvcache``, ``gqadrv.jax.flash_mla_sparse_fwd``)."""

from __future__ import annotations

import dataclasses
import math

from ..ops import contract as _oc
from . import contract as _contract

__all__ = ["Meta", "check_dense_arguments", "check_sparse_decode", "check_sparse_prefill"]

D_QKS = (576, 512)   # sparse prefill's d_qk


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a check needs of a tensor: its shape and its dtype name ("bfloat16", "int32", ...)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _int_array(op: str, name: str, m: Meta | None, shape: tuple, what: str) -> None:
    """An optional int32 array of ``shape`` (None entries: any size)."""
    if m is None:
        return
    if m.dtype != "int32":
        raise TypeError(f"{op}: {name} must have dtype int32, got {m.dtype}")
    if m.ndim != len(shape) or any(want is not None and have != want for have, want in zip(m.shape, shape)):
        raise ValueError(f"{op}: {name} must have shape {what}, got {m.shape}")


def _sink(op: str, m: Meta | None, h_q: int) -> None:
    if m is None:
        return
    if m.dtype != "float32":
        raise TypeError(f"{op}: attn_sink must have dtype float32, got {m.dtype}")
    if m.ndim != 1 or m.shape[0] != h_q:
        raise ValueError(f"{op}: attn_sink must have shape ({h_q},) (one value per query head), got {m.shape}")


def _pool(op: str, name: str, q: Meta, k: Meta, fp8: bool) -> None:
    """A sparse-path KV pool: [num_blocks, page_size, 1, 656] FP8 bytes or [num_blocks, page_size, 1, 576]
    of q's dtype."""
    fp8_dtype = k.dtype in _contract.FP8_CACHE_DTYPES
    if not fp8 and fp8_dtype:
        raise TypeError(f"{op}: {name} has dtype {k.dtype}: an FP8 cache needs is_fp8_kvcache=True")
    row = _contract.FP8_ROW_BYTES if fp8 else _contract.D_QK
    if k.ndim != 4 or k.shape[2] != 1 or k.shape[3] != row:
        raise ValueError(f"{op}: {name} must have shape [num_blocks, page_size, 1, {row}] on the sparse path "
                         f"(h_kv = 1), got {k.shape}")
    if fp8 and not fp8_dtype:
        raise TypeError(f"{op}: {name} must have dtype {' or '.join(_contract.FP8_CACHE_DTYPES)} with "
                        f"is_fp8_kvcache=True, got {k.dtype}")
    if not fp8 and k.dtype != q.dtype:
        raise TypeError(f"{op}: {name} must have q's dtype {q.dtype}, got {k.dtype}")


def check_dense_arguments(op: str, block_table_given: bool, cache_seqlens_given: bool, sparse_given: list[str]) -> None:
    """The dense path: no sparse argument without ``indices``, and the block table and lengths given."""
    if sparse_given:
        raise ValueError(f"{op}: {', '.join(sparse_given)} belong to the sparse MLA path: pass indices (int32 "
                         "[b, s_q, topk]) with them, or leave them None for dense decode")
    missing = [n for n, given in (("block_table", block_table_given), ("cache_seqlens", cache_seqlens_given))
               if not given]
    if missing:
        raise ValueError(f"{op}: dense MLA decode needs {' and '.join(missing)} (only the sparse path, with indices, "
                         "goes without them)")


def check_sparse_decode(op: str, q: Meta, k_cache: Meta, head_dim_v: int, causal: bool, is_fp8_kvcache: bool,
                        sparse: dict[str, Meta | None]) -> None:
    """``flash_mla_with_kvcache`` with ``indices`` (``sparse``: the six sparse arguments by name)."""
    if causal:
        raise ValueError(f"{op}: causal=True is not defined on the sparse path (indices name each query token's keys)")
    if head_dim_v != _contract.D_V:
        raise ValueError(f"{op}: head_dim_v must be {_contract.D_V}, got {head_dim_v}")
    if q.ndim != 4 or q.shape[3] != _contract.D_QK:
        raise ValueError(f"{op}: q must have shape [batch, s_q, h_q, {_contract.D_QK}], got {q.shape}")
    b, s_q, h_q, _ = q.shape
    if q.dtype not in _contract.SUPPORTED_DTYPES:
        raise TypeError(f"{op} expects q float16 or bfloat16, got {q.dtype}")
    if is_fp8_kvcache and q.dtype != "bfloat16":
        raise TypeError(f"{op}: is_fp8_kvcache=True needs a bfloat16 q, got {q.dtype}")
    _pool(op, "k_cache", q, k_cache, is_fp8_kvcache)
    _int_array(op, "indices", sparse["indices"], (b, s_q, None), f"[{b}, {s_q}, topk] (batch, s_q of q)")
    _int_array(op, "topk_length", sparse["topk_length"], (b,), f"({b},)")
    extra, extra_idx = sparse["extra_k_cache"], sparse["extra_indices_in_kvcache"]
    if (extra is None) != (extra_idx is None):
        raise ValueError(f"{op}: extra_k_cache and extra_indices_in_kvcache go together: give both or neither")
    if extra is None and sparse["extra_topk_length"] is not None:
        raise ValueError(f"{op}: extra_topk_length needs extra_k_cache and extra_indices_in_kvcache")
    if extra is not None:
        _pool(op, "extra_k_cache", q, extra, is_fp8_kvcache)
        _int_array(op, "extra_indices_in_kvcache", extra_idx, (b, s_q, None), f"[{b}, {s_q}, extra_topk]")
        _int_array(op, "extra_topk_length", sparse["extra_topk_length"], (b,), f"({b},)")
    _sink(op, sparse["attn_sink"], h_q)


def check_sparse_prefill(op: str, q: Meta, kv: Meta, indices: Meta, sm_scale: float | None, d_v: int,
                         attn_sink: Meta | None, topk_length: Meta | None, cu_seqlens_q: Meta | None,
                         cu_seqlens_kv: Meta | None) -> tuple[int, int]:
    """``flash_mla_sparse_fwd``: (s_q, h_q). ``sm_scale`` None skips its check (a JAX static the
    callback checks)."""
    if d_v != _contract.D_V:
        raise ValueError(f"{op}: d_v must be {_contract.D_V}, got {d_v}")
    if sm_scale is not None:
        _oc.check_positive_scale("sm_scale", sm_scale, limit=_oc.F32_MAX / math.log2(math.e))
    if q.ndim != 3 or q.shape[2] not in D_QKS:
        raise ValueError(f"{op}: q must have shape [s_q, h_q, d_qk] with d_qk 576 or 512, got {q.shape}")
    if q.dtype != "bfloat16":
        raise TypeError(f"{op}: q must have dtype bfloat16, got {q.dtype}")
    s_q, h_q, d = (int(x) for x in q.shape)
    if not 1 <= h_q <= _contract.MAX_HEADS_Q:
        raise ValueError(f"{op}: h_q must be in [1, {_contract.MAX_HEADS_Q}], got {h_q}")
    if kv.ndim != 3 or kv.shape[1] != 1 or kv.shape[2] != d:
        raise ValueError(f"{op}: kv must have shape [s_kv, 1, {d}] (q's d_qk; one KV head), got {kv.shape}")
    if kv.dtype != "bfloat16":
        raise TypeError(f"{op}: kv must have dtype bfloat16, got {kv.dtype}")
    _int_array(op, "indices", indices, (s_q, 1, None), f"[{s_q}, 1, topk] (s_q of q, one KV head)")
    _sink(op, attn_sink, h_q)
    _int_array(op, "topk_length", topk_length, (s_q,), f"({s_q},) (one length per query token)")
    if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_kv go together: give both (varlen batch) or neither")
    if cu_seqlens_q is not None and cu_seqlens_kv is not None:
        _int_array(op, "cu_seqlens_q", cu_seqlens_q, (None,), "[n + 1] (n requests)")
        _int_array(op, "cu_seqlens_kv", cu_seqlens_kv, (None,), "[n + 1] (n requests)")
        if cu_seqlens_q.shape != cu_seqlens_kv.shape:
            raise ValueError(f"{op}: cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_kv {cu_seqlens_kv.shape} must "
                             "have the same length (one entry per request + 1)")
    return s_q, h_q
