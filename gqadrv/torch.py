"""gqadrv's ops as PyTorch custom ops: ``torch.compile(fullgraph=True)`` and ``torch.cuda.graph``.

    import gqadrv.torch as gt
    out = gt.gqa_decode(q, kv, lengths)                          # torch.ops.gqadrv.gqa_decode
    out, lse = gt.gqa_decode(q4, kv, lengths, return_lse=True)   # torch.ops.gqadrv.gqa_decode_lse
    out = gt.gqa_decode_paged(q, k_pages, v_pages, block_table, seq_lens)   # torch.ops.gqadrv.gqa_decode_paged
    v, s = gt.merge_state(v_a, s_a, v_b, s_b)                   # torch.ops.gqadrv.merge_state
    v, s = gt.merge_states(v_stacked, s_stacked)                # torch.ops.gqadrv.merge_states
    out, lse = gt.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512)
    codes, scale = gt.quantize_kv_fp8(k)                        # torch.ops.gqadrv.quantize_kv_fp8
    k8 = gt.quantize_k_cache(k_bf16)                            # torch.ops.gqadrv.quantize_k_cache
    k16 = gt.dequantize_k_cache(k8)                             # torch.ops.gqadrv.dequantize_k_cache
    out, lse = gt.flash_mla_with_kvcache(q, k8, block_table, cache_seqlens, 512, is_fp8_kvcache=True)
    out, lse = gt.flash_mla_with_kvcache(q, k8, None, None, 512, is_fp8_kvcache=True, indices=indices,
                                         attn_sink=sink, topk_length=topk_length)   # sparse decode
    out, max_logits, lse = gt.flash_mla_sparse_fwd(q, kv, indices, sm_scale)   # sparse prefill

Each op is registered with ``torch.library.custom_op`` in the ``gqadrv`` namespace, functional (no
argument is mutated; the outputs are new tensors that alias nothing) and with a fake implementation
that gives the output shapes and dtypes, so Dynamo / AOTAutograd / Inductor trace it as one node
without running it. At run time the outputs come from torch's allocator (``torch.empty`` on the input's
device: inside ``torch.cuda.graph`` capture that is the graph's private pool) and are handed to gqadrv
as ``out=`` / ``lse=``; the kernels are launched on torch's current stream of that device.

gqadrv's split workspace is not an output: it comes from gqadrv's per-(device, stream) pool (the
public ops take no workspace argument). Lengths, block tables and values are read on the device, so
a captured graph stays valid when they change in place. There is no backward pass (inputs are
detached; ``torch.autograd`` reports an error if a gradient through these ops is requested).

This is the only module of gqadrv (with ``gqadrv.jax``) that imports a framework; it needs the
``torch`` extra: ``pip install 'gqadrv[torch]'``.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by tests/integrations/test_integrations_host.py
    raise ImportError("gqadrv.torch needs PyTorch >= 2.4 (torch.library.custom_op); install the extra: "
                      "pip install 'gqadrv[torch]'") from exc
if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):  # torch < 2.4
    raise ImportError(f"gqadrv.torch needs PyTorch >= 2.4 (torch.library.custom_op); found torch {torch.__version__}: "
                      "pip install 'gqadrv[torch]'")

import numbers
from typing import Any

from .gqa.api import gqa_decode as _gqa_decode
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

__all__ = ["MLA_LSE_DTYPE", "NAMESPACE", "dequantize_k_cache", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
           "gqa_decode", "gqa_decode_paged", "merge_state", "merge_states", "quantize_k_cache", "quantize_kv_fp8"]

NAMESPACE = "gqadrv"
MLA_LSE_DTYPE = torch.float32

_GQA_SCHEMA = "(Tensor q, Tensor kv, Tensor sequence_lengths, float q_scale, float? sm_scale, str? backend) -> Tensor"
# FP8 caches: kv_dtype ('e4m3' for uint8 / int8 codes; None for float8_e4m3fn or fp16 / bf16 caches)
# and each scale as a number (k_scale_f) or a float32 tensor (k_scale_t), at most one of the two
_FP8_ARGS = "str? kv_dtype=None, float? k_scale_f=None, float? v_scale_f=None, Tensor? k_scale_t=None, Tensor? v_scale_t=None"
_GQA_LSE_SCHEMA = ("(Tensor q, Tensor kv, Tensor sequence_lengths, float q_scale, float? sm_scale, bool deterministic, "
                   f"str? backend, {_FP8_ARGS}) -> (Tensor, Tensor)")
_PAGED_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor? v_cache, Tensor block_table, Tensor seq_lens, str kv_layout, "
                 f"float q_scale, float? sm_scale, bool deterministic, int? num_splits, str? backend, {_FP8_ARGS}) "
                 "-> (Tensor, Tensor)")
_MERGE_PAIR_SCHEMA = "(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)"
_MERGE_STACKED_SCHEMA = "(Tensor v, Tensor s) -> (Tensor, Tensor)"
# is_fp8_kvcache (10th) and the sparse tensors after it defaulted: callers of the schema without them (the dense
# path, a bf16 / fp16 cache) keep working. block_table / cache_seqlens are optional: the sparse path (indices
# given) ignores them; the dense path needs both.
_MLA_SPARSE_ARGS = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                    "extra_topk_length")
_MLA_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor? block_table, Tensor? cache_seqlens, int head_dim_v, "
               "int? num_splits, float? softmax_scale, bool causal, str? backend, bool is_fp8_kvcache=False, "
               + ", ".join(f"Tensor? {n}=None" for n in _MLA_SPARSE_ARGS) + ") -> (Tensor, Tensor)")
# the FP8 KV quantizer: the scale is a float32 tensor (scale_t) or a number (scale_f), or neither (computed);
# the second output is always a float32 tensor (the computed scale, the number, or a copy of scale_t)
_KV_FP8_SCHEMA = "(Tensor x, Tensor? scale_t, float? scale_f, int? head_axis) -> (Tensor, Tensor)"
# sparse MLA prefill: the second output is fp32 [2, s_q, h_q] = (max_logits, lse) (one buffer: the kernel writes
# max_logits at a fixed offset from the LSE; gt.flash_mla_sparse_fwd returns its two halves)
_SPARSE_FWD_SCHEMA = ("(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, Tensor? attn_sink=None, "
                      "Tensor? topk_length=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
                      "str? backend=None) -> (Tensor, Tensor)")
_SPARSE_D_QKS = _sparse_prefill.D_QKS
_K_CACHE_Q_SCHEMA = "(Tensor k_bf16) -> Tensor"
_K_CACHE_DQ_SCHEMA = "(Tensor k_fp8) -> Tensor"


_MLA_OP = "gqadrv::flash_mla_with_kvcache"  # the prefix of the MLA trace-time errors (mla.trace_checks)

def _stream(t: torch.Tensor) -> int:
    """The raw handle of torch's current stream on ``t``'s device (the capturing stream under
    ``torch.cuda.graph``)."""
    return int(torch.cuda.current_stream(t.device).cuda_stream)


def _scale_kwargs(sm_scale: float | None) -> dict[str, float]:
    """``sm_scale`` is forwarded only when given, so the op works with gqadrv versions whose
    ``gqa_decode`` has no ``sm_scale`` keyword as long as it is not used."""
    return {} if sm_scale is None else {"sm_scale": sm_scale}


# ----------------------------------------------------------------------------- GQA decode
@torch.library.custom_op(f"{NAMESPACE}::gqa_decode", mutates_args=(), device_types="cuda", schema=_GQA_SCHEMA)
def _gqa_decode_op(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, q_scale: float,
                   sm_scale: float | None, backend: str | None) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _gqa_decode(q.detach(), kv.detach(), sequence_lengths.detach(), out=out, q_scale=q_scale, stream=_stream(q),
                backend=backend, **_scale_kwargs(sm_scale))  # type: ignore[arg-type]
    return out


@_gqa_decode_op.register_fake
def _gqa_decode_fake(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, q_scale: float,
                     sm_scale: float | None, backend: str | None) -> torch.Tensor:
    _check_gqa_ranks("gqa_decode", q, kv)
    return q.new_empty(q.shape)


def _check_gqa_ranks(op: str, q: torch.Tensor, kv: torch.Tensor) -> None:
    if q.dim() not in (3, 4) or kv.dim() != 5:
        raise ValueError(f"gqadrv::{op} expects q [B, Hq, D] or [B, s_q, Hq, D] and kv [B, 2, Hkv, C, D], got q of "
                         f"rank {q.dim()} and kv of rank {kv.dim()}")


def _fp8_kwargs(kv_dtype: str | None, k_scale_f: float | None, v_scale_f: float | None,
                k_scale_t: torch.Tensor | None, v_scale_t: torch.Tensor | None) -> dict:
    """The FP8 keywords of the library call (nothing for an fp16 / bf16 cache)."""
    kw: dict = {}
    if kv_dtype is not None:
        kw["kv_dtype"] = kv_dtype
    k = k_scale_t.detach() if k_scale_t is not None else k_scale_f
    v = v_scale_t.detach() if v_scale_t is not None else v_scale_f
    if k is not None:
        kw["k_scale"] = k
    if v is not None:
        kw["v_scale"] = v
    return kw


def _fp8_op_args(kv_dtype: Any, k_scale: Any, v_scale: Any) -> tuple:
    """(kv_dtype, k_scale_f, v_scale_f, k_scale_t, v_scale_t) for the op from the wrapper's keywords:
    a scale is a number or a tensor; kv_dtype a string or a torch dtype spelling e4m3fn."""
    kd = None if kv_dtype is None else str(kv_dtype).replace("torch.", "")

    def split(x: Any) -> tuple[float | None, torch.Tensor | None]:
        if x is None:
            return None, None
        if isinstance(x, torch.Tensor):
            return None, x
        return float(x), None

    kf, kt = split(k_scale)
    vf, vt = split(v_scale)
    return kd, kf, vf, kt, vt


def _lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    """[B, s_q, Hq] for a 4-D q, [B, Hq] for a 3-D q."""
    return tuple(q.shape[:-1])


@torch.library.custom_op(f"{NAMESPACE}::gqa_decode_lse", mutates_args=(), device_types="cuda",
                         schema=_GQA_LSE_SCHEMA)
def _gqa_decode_lse_op(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, q_scale: float,
                       sm_scale: float | None, deterministic: bool, backend: str | None, kv_dtype: str | None = None,
                       k_scale_f: float | None = None, v_scale_f: float | None = None,
                       k_scale_t: torch.Tensor | None = None,
                       v_scale_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    _gqa_decode(q.detach(), kv.detach(), sequence_lengths.detach(), out=out, lse=lse, q_scale=q_scale,
                deterministic=deterministic, stream=_stream(q), backend=backend,  # type: ignore[arg-type]
                **_scale_kwargs(sm_scale), **_fp8_kwargs(kv_dtype, k_scale_f, v_scale_f, k_scale_t, v_scale_t))
    return out, lse


@_gqa_decode_lse_op.register_fake
def _gqa_decode_lse_fake(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, q_scale: float,
                         sm_scale: float | None, deterministic: bool, backend: str | None,
                         kv_dtype: str | None = None, k_scale_f: float | None = None,
                         v_scale_f: float | None = None, k_scale_t: torch.Tensor | None = None,
                         v_scale_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_gqa_ranks("gqa_decode_lse", q, kv)
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=torch.float32)


def gqa_decode(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, *, q_scale: float = 1.0,
               sm_scale: float | None = None, backend: str | None = None, return_lse: bool = False,
               deterministic: bool = False, kv_dtype: Any = None, k_scale: Any = None, v_scale: Any = None) -> Any:
    """``gqadrv.gqa_decode`` as the custom op ``torch.ops.gqadrv.gqa_decode`` (or
    ``gqadrv::gqa_decode_lse`` with ``return_lse`` / ``deterministic``), traceable by
    ``torch.compile(fullgraph=True)`` and capturable by ``torch.cuda.graph``.

    q [B, Hq, D] or [B, s_q, Hq, D], kv [B, 2, Hkv, C, D], sequence_lengths int32 [B] (read on the
    device). Returns a new tensor of q's shape and dtype, allocated by torch and written on torch's
    current stream, and with ``return_lse=True`` also the fp32 LSE [B, Hq] / [B, s_q, Hq]. Softmax
    scale: ``q_scale / sqrt(D)``, or ``sm_scale`` (absolute; forwarded only when not None).
    FP8 caches (kv float8_e4m3fn, or uint8 codes with ``kv_dtype='e4m3'``; ``k_scale`` / ``v_scale`` a
    number or a float32 tensor () / (1,) / (Hkv,)) take ``gqadrv::gqa_decode_lse``.
    """
    sm = None if sm_scale is None else float(sm_scale)
    fp8 = kv_dtype is not None or k_scale is not None or v_scale is not None or str(kv.dtype).startswith("torch.float8")
    if return_lse or deterministic or fp8:
        out, lse = torch.ops.gqadrv.gqa_decode_lse(q, kv, sequence_lengths, float(q_scale), sm, bool(deterministic),
                                                   backend, *_fp8_op_args(kv_dtype, k_scale, v_scale))
        return (out, lse) if return_lse else out
    res: torch.Tensor = torch.ops.gqadrv.gqa_decode(q, kv, sequence_lengths, float(q_scale), sm, backend)
    return res


# ----------------------------------------------------------------------------- paged GQA decode
@torch.library.custom_op(f"{NAMESPACE}::gqa_decode_paged", mutates_args=(), device_types="cuda",
                         schema=_PAGED_SCHEMA)
def _gqa_decode_paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, kv_layout: str, q_scale: float,
                         sm_scale: float | None, deterministic: bool, num_splits: int | None,
                         backend: str | None, kv_dtype: str | None = None, k_scale_f: float | None = None,
                         v_scale_f: float | None = None, k_scale_t: torch.Tensor | None = None,
                         v_scale_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    _gqa_decode_paged(q.detach(), k_cache.detach(), None if v_cache is None else v_cache.detach(),
                      block_table.detach(), seq_lens.detach(), kv_layout=kv_layout, out=out, lse=lse,
                      q_scale=q_scale, deterministic=deterministic, num_splits=num_splits, stream=_stream(q),
                      backend=backend, **_scale_kwargs(sm_scale),  # type: ignore[arg-type]
                      **_fp8_kwargs(kv_dtype, k_scale_f, v_scale_f, k_scale_t, v_scale_t))
    return out, lse


@_gqa_decode_paged_op.register_fake
def _gqa_decode_paged_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, kv_layout: str, q_scale: float,
                           sm_scale: float | None, deterministic: bool, num_splits: int | None,
                           backend: str | None, kv_dtype: str | None = None, k_scale_f: float | None = None,
                           v_scale_f: float | None = None, k_scale_t: torch.Tensor | None = None,
                           v_scale_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dim() not in (3, 4) or k_cache.dim() not in (4, 5):
        raise ValueError(f"gqadrv::gqa_decode_paged expects q [B, Hq, D] or [B, s_q, Hq, D] and a 4-D (or combined "
                         f"5-D) k_cache, got ranks {q.dim()} and {k_cache.dim()}")
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=torch.float32)


def gqa_decode_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, kv_layout: str = "NHD", q_scale: float = 1.0,
                     sm_scale: float | None = None, return_lse: bool = False, deterministic: bool = False,
                     num_splits: int | None = None, backend: str | None = None, kv_dtype: Any = None,
                     k_scale: Any = None, v_scale: Any = None) -> Any:
    """``gqadrv.gqa_decode_paged`` as the custom op ``torch.ops.gqadrv.gqa_decode_paged``: returns
    a new out (q's shape) and, with ``return_lse=True``, the fp32 LSE (the op always computes it).
    FP8 caches: float8_e4m3fn pages, or uint8 codes with ``kv_dtype='e4m3'``; ``k_scale`` /
    ``v_scale`` numbers or float32 tensors () / (1,) / (Hkv,) (read on the device: graph replays
    follow in-place updates)."""
    out, lse = torch.ops.gqadrv.gqa_decode_paged(q, k_cache, v_cache, block_table, seq_lens, str(kv_layout),
                                                 float(q_scale), None if sm_scale is None else float(sm_scale),
                                                 bool(deterministic), None if num_splits is None else int(num_splits),
                                                 backend, *_fp8_op_args(kv_dtype, k_scale, v_scale))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- LSE state merge
@torch.library.custom_op(f"{NAMESPACE}::merge_state", mutates_args=(), device_types="cuda", schema=_MERGE_PAIR_SCHEMA)
def _merge_state_op(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                    s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s = torch.empty(v_a.shape[:-1], dtype=torch.float32, device=v_a.device)
    _merge_state(v_a.detach().contiguous(), s_a.detach().contiguous(), v_b.detach().contiguous(),
                 s_b.detach().contiguous(), out=v, out_lse=s, stream=_stream(v_a))
    return v, s


@_merge_state_op.register_fake
def _merge_state_fake(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                      s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return v_a.new_empty(v_a.shape), v_a.new_empty(v_a.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::merge_states", mutates_args=(), device_types="cuda",
                         schema=_MERGE_STACKED_SCHEMA)
def _merge_states_op(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (v.shape[0],) + tuple(v.shape[2:])
    out = torch.empty(shape, dtype=v.dtype, device=v.device)
    lse = torch.empty(shape[:-1], dtype=torch.float32, device=v.device)
    _merge_states(v.detach().contiguous(), s.detach().contiguous(), out=out, out_lse=lse, stream=_stream(v))
    return out, lse


@_merge_states_op.register_fake
def _merge_states_fake(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if v.dim() != 4:
        raise ValueError(f"gqadrv::merge_states expects stacked states v [N, K, H, D], got rank {v.dim()}")
    shape = (v.shape[0],) + tuple(v.shape[2:])
    return v.new_empty(shape), v.new_empty(shape[:-1], dtype=torch.float32)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqadrv.merge_state`` as ``torch.ops.gqadrv.merge_state``: new (v, s)."""
    v, s = torch.ops.gqadrv.merge_state(v_a, s_a, v_b, s_b)
    return v, s


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqadrv.merge_states`` (stacked form: v [N, K, H, D], s [N, K, H]) as
    ``torch.ops.gqadrv.merge_states``: new (v [N, H, D], s [N, H])."""
    out, lse = torch.ops.gqadrv.merge_states(v, s)
    return out, lse


# ----------------------------------------------------------------------------- MLA decode
# FlashMLA's V3.2 FP8 cache (512 e4m3 codes, 4 fp32 scales, 64 bf16 RoPE channels): the library's own rules
_MLA_FP8_ROW_BYTES = _mla_contract.FP8_ROW_BYTES
_MLA_D_QK = _mla_contract.D_QK
_FP8_CACHE_DTYPES = _mla_contract.FP8_CACHE_DTYPES


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _mla_shapes(q: torch.Tensor, head_dim_v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if q.dim() != 4:
        raise ValueError(f"gqadrv::flash_mla_with_kvcache expects q [b, s_q, h_q, d], got rank {q.dim()}")
    b, s_q, h_q, _ = q.shape
    return (b, s_q, h_q, head_dim_v), (b, h_q, s_q)


def _check_mla_fp8(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Trace-time form of gqadrv's FP8-cache rules (bf16 q; uint8 / int8 / float8_e4m3fn [..., 656])."""
    if q.dtype != torch.bfloat16:
        raise TypeError(f"gqadrv::flash_mla_with_kvcache: is_fp8_kvcache=True needs a bfloat16 q, got {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape[-1] != _MLA_FP8_ROW_BYTES or _dtype_name(k_cache) not in _FP8_CACHE_DTYPES:
        raise ValueError(f"gqadrv::flash_mla_with_kvcache: is_fp8_kvcache=True needs k_cache [num_blocks, page_size, "
                         f"h_kv, {_MLA_FP8_ROW_BYTES}] of dtype {' / '.join(_FP8_CACHE_DTYPES)}, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _meta(t: torch.Tensor | None) -> _trace.Meta | None:
    return None if t is None else _trace.Meta(tuple(int(x) for x in t.shape), _dtype_name(t))


def _check_mla_dense(block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None, sparse: dict) -> None:
    """Trace-time form of gqadrv's dense-path rules (mla.trace_checks)."""
    _trace.check_dense_arguments(_MLA_OP, block_table is not None, cache_seqlens is not None,
                                 [k for k, v in sparse.items() if v is not None])


def _check_mla_sparse(q: torch.Tensor, k_cache: torch.Tensor, head_dim_v: int, causal: bool, is_fp8_kvcache: bool,
                      sparse: dict) -> None:
    """Trace-time form of gqadrv's sparse-path rules (shapes and dtypes, mla.trace_checks; the library
    checks everything again at run time, strides and devices included)."""
    _trace.check_sparse_decode(_MLA_OP, _meta(q), _meta(k_cache), head_dim_v, causal, is_fp8_kvcache,
                               {k: _meta(v) for k, v in sparse.items()})


def _mla_sparse_dict(indices: torch.Tensor | None, attn_sink: torch.Tensor | None,
                     extra_k_cache: torch.Tensor | None, extra_indices_in_kvcache: torch.Tensor | None,
                     topk_length: torch.Tensor | None, extra_topk_length: torch.Tensor | None) -> dict:
    return dict(zip(_MLA_SPARSE_ARGS, (indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                                       extra_topk_length)))


def _check_mla(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
               cache_seqlens: torch.Tensor | None, head_dim_v: int, causal: bool, is_fp8_kvcache: bool,
               sparse: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The output shapes after the trace-time checks of the path the arguments select."""
    out_shape, lse_shape = _mla_shapes(q, head_dim_v)
    if sparse["indices"] is not None:
        _check_mla_sparse(q, k_cache, head_dim_v, causal, is_fp8_kvcache, sparse)
    else:
        _check_mla_dense(block_table, cache_seqlens, sparse)
        if is_fp8_kvcache:
            _check_mla_fp8(q, k_cache)
    return out_shape, lse_shape


@torch.library.custom_op(f"{NAMESPACE}::flash_mla_with_kvcache", mutates_args=(), device_types="cuda",
                         schema=_MLA_SCHEMA)
def _flash_mla_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                  cache_seqlens: torch.Tensor | None, head_dim_v: int, num_splits: int | None,
                  softmax_scale: float | None, causal: bool, backend: str | None, is_fp8_kvcache: bool = False,
                  indices: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                  extra_k_cache: torch.Tensor | None = None, extra_indices_in_kvcache: torch.Tensor | None = None,
                  topk_length: torch.Tensor | None = None,
                  extra_topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    sparse = _mla_sparse_dict(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                              extra_topk_length)
    out_shape, lse_shape = _mla_shapes(q, head_dim_v)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=MLA_LSE_DTYPE, device=q.device)
    # only the sparse tensors given are forwarded (the dense call is the library's dense signature)
    sparse_kw = {k: v.detach() for k, v in sparse.items() if v is not None}
    _flash_mla(q.detach(), k_cache.detach(), _detach(block_table), _detach(cache_seqlens), head_dim_v, None,
               num_splits, softmax_scale, causal, is_fp8_kvcache=is_fp8_kvcache, out=out, lse=lse,
               stream=_stream(q), backend=backend, **sparse_kw)  # type: ignore[arg-type]
    return out, lse


@_flash_mla_op.register_fake
def _flash_mla_fake(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                    cache_seqlens: torch.Tensor | None, head_dim_v: int, num_splits: int | None,
                    softmax_scale: float | None, causal: bool, backend: str | None, is_fp8_kvcache: bool = False,
                    indices: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                    extra_k_cache: torch.Tensor | None = None, extra_indices_in_kvcache: torch.Tensor | None = None,
                    topk_length: torch.Tensor | None = None,
                    extra_topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    sparse = _mla_sparse_dict(indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                              extra_topk_length)
    out_shape, lse_shape = _check_mla(q, k_cache, block_table, cache_seqlens, head_dim_v, causal, is_fp8_kvcache,
                                      sparse)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=MLA_LSE_DTYPE)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None = None,
                           cache_seqlens: torch.Tensor | None = None, head_dim_v: int = 512,
                           tile_scheduler_metadata: Any = None, num_splits: int | None = None,
                           softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                           extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           topk_length: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None, *,
                           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqadrv.flash_mla_with_kvcache`` (FlashMLA's names and order, dense and sparse paths) as the
    custom op ``torch.ops.gqadrv.flash_mla_with_kvcache``.

    Returns new tensors ``(out [b, s_q, h_q, head_dim_v] in q's dtype, lse fp32 [b, h_q, s_q])``.
    ``tile_scheduler_metadata`` is accepted for FlashMLA compatibility and ignored (gqadrv plans the
    splits on the device; ``num_splits`` forces a count). ``softmax_scale`` is absolute (default
    ``576 ** -0.5``). ``is_fp8_kvcache=True``: k_cache is FlashMLA's 656-byte FP8 cache
    [num_blocks, page_size, h_kv, 656] (uint8 / int8 / float8_e4m3fn, as ``quantize_k_cache`` writes
    it) and q must be bfloat16.

    Dense path (``indices`` None): block_table int32 [b, max_blocks] and cache_seqlens int32 [b] are
    required; the sparse arguments must be None.

    Sparse path (``indices`` int32 [b, s_q, topk] given; FlashMLA's DeepSeek sparse decode): k_cache
    [num_blocks, page_size, 1, 656] FP8 or [num_blocks, page_size, 1, 576] of q's dtype; ``attn_sink``
    float32 [h_q]; ``topk_length`` int32 [b]; ``extra_k_cache`` (same format, own num_blocks / page)
    with ``extra_indices_in_kvcache`` int32 [b, s_q, extra_topk] and ``extra_topk_length`` int32 [b];
    block_table / cache_seqlens are ignored (may be None); causal must be False; head_dim_v 512.
    Every tensor is read on the device, so a captured graph follows in-place updates of the indices,
    lengths, sinks and pools.
    """
    del tile_scheduler_metadata
    out, lse = torch.ops.gqadrv.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, int(head_dim_v),
                                                       None if num_splits is None else int(num_splits),
                                                       None if softmax_scale is None else float(softmax_scale),
                                                       bool(causal), backend, bool(is_fp8_kvcache), indices,
                                                       attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                                       topk_length, extra_topk_length)
    return out, lse


# ----------------------------------------------------------------------------- sparse MLA prefill
def _sparse_fwd_into(q: Any, kv: Any, indices: Any, sm_scale: float, d_v: int, attn_sink: Any, topk_length: Any,
                     cu_seqlens_q: Any, cu_seqlens_kv: Any, *, out: Any, stats: Any, stream: int,
                     backend: str | None) -> None:
    """``gqadrv.flash_mla_sparse_fwd`` writing into the framework-allocated ``out`` bf16 [s_q, h_q, 512]
    and ``stats`` fp32 [2, s_q, h_q] (``stats[0]`` max_logits, ``stats[1]`` lse: the kernel writes a
    row's max logit at a fixed offset from its LSE, so both live in one buffer), on ``stream``."""
    _sparse_prefill.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, out=out, stats=stats,
                                         stream=stream, backend=backend)


def _check_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                      attn_sink: torch.Tensor | None, topk_length: torch.Tensor | None,
                      cu_seqlens_q: torch.Tensor | None, cu_seqlens_kv: torch.Tensor | None) -> tuple[Any, Any]:
    """Trace-time form of gqadrv's sparse-prefill rules (shapes, dtypes, sm_scale, d_v; mla.trace_checks;
    the library checks everything again at run time, strides and devices included): (s_q, h_q)."""
    return _trace.check_sparse_prefill("gqadrv::flash_mla_sparse_fwd", _meta(q), _meta(kv), _meta(indices), sm_scale,
                                       d_v, _meta(attn_sink), _meta(topk_length), _meta(cu_seqlens_q),
                                       _meta(cu_seqlens_kv))


@torch.library.custom_op(f"{NAMESPACE}::flash_mla_sparse_fwd", mutates_args=(), device_types="cuda",
                         schema=_SPARSE_FWD_SCHEMA)
def _sparse_fwd_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                   attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                   cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
                   backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s_q, h_q = _check_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv)
    out = torch.empty((s_q, h_q, _mla_contract.D_V), dtype=torch.bfloat16, device=q.device)
    stats = torch.empty((2, s_q, h_q), dtype=torch.float32, device=q.device)
    _sparse_fwd_into(q.detach(), kv.detach(), indices.detach(), sm_scale, d_v, _detach(attn_sink),
                     _detach(topk_length), _detach(cu_seqlens_q), _detach(cu_seqlens_kv), out=out, stats=stats,
                     stream=_stream(q), backend=backend)
    return out, stats


@_sparse_fwd_op.register_fake
def _sparse_fwd_fake(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                     attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                     cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s_q, h_q = _check_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, cu_seqlens_q, cu_seqlens_kv)
    return (q.new_empty((s_q, h_q, _mla_contract.D_V), dtype=torch.bfloat16),
            q.new_empty((2, s_q, h_q), dtype=torch.float32))


def flash_mla_sparse_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                         attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None, *,
                         cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_kv: torch.Tensor | None = None,
                         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gqadrv.flash_mla_sparse_fwd`` (FlashMLA's DeepSeek sparse prefill, its names and order) as
    the custom op ``torch.ops.gqadrv.flash_mla_sparse_fwd``.

    q bf16 [s_q, h_q, d_qk] (d_qk 576 or 512, h_q 1..128), kv bf16 [s_kv, 1, d_qk], indices int32
    [s_q, 1, topk] (an index < 0 or >= s_kv, or outside the request's KV rows in the varlen form, is
    invalid); ``sm_scale`` absolute and required; d_v 512; ``attn_sink`` float32 [h_q];
    ``topk_length`` int32 [s_q]; ``cu_seqlens_q`` / ``cu_seqlens_kv`` int32 [n + 1] (both or
    neither: request i's query tokens index its own KV rows from 0). Returns new tensors ``(out bf16
    [s_q, h_q, 512], max_logits fp32 [s_q, h_q], lse fp32 [s_q, h_q])``; a row without a valid index
    gives out 0, max_logits -inf, lse +inf.

    The op returns ``(out, stats)`` with stats fp32 [2, s_q, h_q] (the kernel writes max_logits at a
    fixed offset from the LSE, and a custom op's outputs may not share storage); this wrapper hands
    back ``stats.unbind(0)`` (two views, no copy). Every tensor is read on the device, so a
    captured graph follows in-place updates of the indices, lengths, sinks and KV rows.
    """
    if sm_scale is None:
        raise TypeError("sm_scale is required (FlashMLA's flash_mla_sparse_fwd has no default), e.g. d_qk ** -0.5")
    out, stats = torch.ops.gqadrv.flash_mla_sparse_fwd(q, kv, indices, float(sm_scale), int(d_v), attn_sink,
                                                       topk_length, cu_seqlens_q, cu_seqlens_kv, backend)
    max_logits, lse = stats.unbind(0)
    return out, max_logits, lse


# ----------------------------------------------------------------------------- FP8 KV quantizer
_KV_FP8_INPUTS = (torch.float16, torch.bfloat16, torch.float32)


def _check_kv_fp8(x: torch.Tensor, scale_t: torch.Tensor | None, scale_f: float | None,
                  head_axis: int | None) -> None:
    """Trace-time form of gqadrv's argument rules (the library checks everything again at run time)."""
    if x.dtype not in _KV_FP8_INPUTS:
        raise TypeError(f"gqadrv::quantize_kv_fp8 expects x float16, bfloat16 or float32, got {x.dtype}")
    if scale_t is not None and scale_f is not None:
        raise ValueError("gqadrv::quantize_kv_fp8 takes the scale as a tensor (scale_t) or a number (scale_f), "
                         "not both")
    if head_axis is not None and scale_t is None:
        raise ValueError("head_axis selects per-head scales, which must be given as a float32 tensor [H] "
                         "(scale=...); a computed or numeric scale is per tensor: pass head_axis=None")
    if scale_t is not None and scale_t.dtype != torch.float32:
        raise TypeError(f"gqadrv::quantize_kv_fp8: a tensor scale must be float32, got {scale_t.dtype}")


@torch.library.custom_op(f"{NAMESPACE}::quantize_kv_fp8", mutates_args=(), device_types="cuda",
                         schema=_KV_FP8_SCHEMA)
def _quantize_kv_fp8_op(x: torch.Tensor, scale_t: torch.Tensor | None, scale_f: float | None,
                        head_axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_kv_fp8(x, scale_t, scale_f, head_axis)
    xd = x.detach().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if scale_t is not None:  # a device scale, read by the kernel; returned as a copy (outputs alias no input)
        _quantize_kv_fp8(xd, scale_t.detach(), head_axis=head_axis, out=codes, stream=_stream(x))
        return codes, scale_t.detach().clone()
    if scale_f is not None:  # a number: returned as float32(scale) in a new 0-d tensor
        _, value = _quantize_kv_fp8(xd, scale_f, out=codes, stream=_stream(x))
        return codes, torch.full((), float(value), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)  # computed on the device, never read back
    _quantize_kv_fp8(xd, None, out=codes, out_scale=scale, stream=_stream(x))
    return codes, scale


@_quantize_kv_fp8_op.register_fake
def _quantize_kv_fp8_fake(x: torch.Tensor, scale_t: torch.Tensor | None, scale_f: float | None,
                          head_axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_kv_fp8(x, scale_t, scale_f, head_axis)
    scale = torch.empty_like(scale_t) if scale_t is not None else x.new_empty((), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.uint8), scale


def quantize_kv_fp8(x: torch.Tensor, scale: Any = None, *,
                    head_axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqadrv.quantize_kv_fp8`` as the custom op ``torch.ops.gqadrv.quantize_kv_fp8``.

    x float16 / bfloat16 / float32, any shape. ``scale``: None (computed on the device, ``max(amax /
    448, 2^-126)``), a number > 0, a float32 tensor of one element, or float32 [H] with ``head_axis``
    (per-KV-head scales). Returns new tensors ``(codes, scale)``: codes uint8 of x's shape (e4m3
    bits: ``codes.view(torch.float8_e4m3fn)`` gives torch's float8 view), and the scale always as a
    float32 tensor: the computed one (shape ()), ``float32(scale)`` for a number (shape ()), or a
    copy of the given tensor (the op's outputs never alias its inputs).
    """
    if scale is None or isinstance(scale, torch.Tensor):
        scale_t, scale_f = scale, None
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        scale_t, scale_f = None, float(scale)
    else:
        raise TypeError(f"scale must be None, a number or a float32 tensor, got {type(scale).__name__}")
    if head_axis is not None and (isinstance(head_axis, bool) or not isinstance(head_axis, numbers.Integral)):
        raise TypeError(f"head_axis must be None or an int, got {type(head_axis).__name__}")
    codes, s = torch.ops.gqadrv.quantize_kv_fp8(x, scale_t, scale_f, None if head_axis is None else int(head_axis))
    return codes, s


# ----------------------------------------------------------------------------- FP8 MLA cache (656 bytes per token)
def _k_cache_shape(op: str, k: torch.Tensor, last: int, dtypes: tuple[str, ...]) -> tuple[int, int]:
    if k.dim() != 4 or k.shape[2] != 1 or k.shape[3] != last:
        raise ValueError(f"gqadrv::{op} expects [num_blocks, page_size, 1, {last}], got {tuple(k.shape)}")
    if _dtype_name(k) not in dtypes:
        raise TypeError(f"gqadrv::{op} expects dtype {' or '.join(dtypes)}, got {k.dtype}")
    return k.shape[0], k.shape[1]


@torch.library.custom_op(f"{NAMESPACE}::quantize_k_cache", mutates_args=(), device_types="cuda",
                         schema=_K_CACHE_Q_SCHEMA)
def _quantize_k_cache_op(k_bf16: torch.Tensor) -> torch.Tensor:
    nb, page = _k_cache_shape("quantize_k_cache", k_bf16, _MLA_D_QK, ("bfloat16",))
    out = torch.empty((nb, page, 1, _MLA_FP8_ROW_BYTES), dtype=torch.uint8, device=k_bf16.device)
    _quantize_k_cache(k_bf16.detach(), out=out, stream=_stream(k_bf16))
    return out


@_quantize_k_cache_op.register_fake
def _quantize_k_cache_fake(k_bf16: torch.Tensor) -> torch.Tensor:
    nb, page = _k_cache_shape("quantize_k_cache", k_bf16, _MLA_D_QK, ("bfloat16",))
    return k_bf16.new_empty((nb, page, 1, _MLA_FP8_ROW_BYTES), dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::dequantize_k_cache", mutates_args=(), device_types="cuda",
                         schema=_K_CACHE_DQ_SCHEMA)
def _dequantize_k_cache_op(k_fp8: torch.Tensor) -> torch.Tensor:
    nb, page = _k_cache_shape("dequantize_k_cache", k_fp8, _MLA_FP8_ROW_BYTES, _FP8_CACHE_DTYPES)
    out = torch.empty((nb, page, 1, _MLA_D_QK), dtype=torch.bfloat16, device=k_fp8.device)
    _dequantize_k_cache(k_fp8.detach(), out=out, stream=_stream(k_fp8))
    return out


@_dequantize_k_cache_op.register_fake
def _dequantize_k_cache_fake(k_fp8: torch.Tensor) -> torch.Tensor:
    nb, page = _k_cache_shape("dequantize_k_cache", k_fp8, _MLA_FP8_ROW_BYTES, _FP8_CACHE_DTYPES)
    return k_fp8.new_empty((nb, page, 1, _MLA_D_QK), dtype=torch.bfloat16)


def quantize_k_cache(k_bf16: torch.Tensor) -> torch.Tensor:
    """``gqadrv.quantize_k_cache`` as ``torch.ops.gqadrv.quantize_k_cache``: bf16 [num_blocks, page, 1,
    576] to a new uint8 [num_blocks, page, 1, 656] (FlashMLA's V3.2 FP8 format)."""
    out: torch.Tensor = torch.ops.gqadrv.quantize_k_cache(k_bf16)
    return out


def dequantize_k_cache(k_fp8: torch.Tensor) -> torch.Tensor:
    """``gqadrv.dequantize_k_cache`` as ``torch.ops.gqadrv.dequantize_k_cache``: uint8 / int8 /
    float8_e4m3fn [num_blocks, page, 1, 656] to a new bf16 [num_blocks, page, 1, 576]."""
    out: torch.Tensor = torch.ops.gqadrv.dequantize_k_cache(k_fp8)
    return out
