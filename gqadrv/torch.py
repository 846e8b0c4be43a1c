"""gqadrv's ops as PyTorch custom ops: ``torch.compile(fullgraph=True)`` and ``torch.cuda.graph``.

    import gqadrv.torch as gt
    out = gt.gqa_decode(q, kv, lengths)                          # torch.ops.gqadrv.gqa_decode
    out, lse = gt.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512)

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

from typing import Any

from .gqa.api import gqa_decode as _gqa_decode
from .mla.api import flash_mla_with_kvcache as _flash_mla

__all__ = ["MLA_LSE_DTYPE", "NAMESPACE", "flash_mla_with_kvcache", "gqa_decode"]

NAMESPACE = "gqadrv"
MLA_LSE_DTYPE = torch.float32

_GQA_SCHEMA = "(Tensor q, Tensor kv, Tensor sequence_lengths, float q_scale, float? sm_scale, str? backend) -> Tensor"
_MLA_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, int head_dim_v, int? num_splits, "
               "float? softmax_scale, bool causal, str? backend) -> (Tensor, Tensor)")


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
    if q.dim() != 3 or kv.dim() != 5:
        raise ValueError(f"gqadrv::gqa_decode expects q [B, Hq, D] and kv [B, 2, Hkv, C, D], got q of rank {q.dim()} "
                         f"and kv of rank {kv.dim()}")
    return q.new_empty(q.shape)


def gqa_decode(q: torch.Tensor, kv: torch.Tensor, sequence_lengths: torch.Tensor, *, q_scale: float = 1.0,
               sm_scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """``gqadrv.gqa_decode`` as the custom op ``torch.ops.gqadrv.gqa_decode`` (traceable by
    ``torch.compile(fullgraph=True)``, capturable by ``torch.cuda.graph``).

    q [B, Hq, D], kv [B, 2, Hkv, C, D], sequence_lengths int32 [B] (read on the device). Returns a
    new tensor [B, Hq, D] of q's dtype, allocated by torch and written on torch's current stream.
    Softmax scale: ``q_scale / sqrt(D)``, or ``sm_scale`` (absolute) where the installed gqadrv
    supports it (forwarded only when not None).
    """
    out: torch.Tensor = torch.ops.gqadrv.gqa_decode(q, kv, sequence_lengths, float(q_scale),
                                                    None if sm_scale is None else float(sm_scale), backend)
    return out


# ----------------------------------------------------------------------------- MLA decode
def _mla_shapes(q: torch.Tensor, head_dim_v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if q.dim() != 4:
        raise ValueError(f"gqadrv::flash_mla_with_kvcache expects q [b, s_q, h_q, d], got rank {q.dim()}")
    b, s_q, h_q, _ = q.shape
    return (b, s_q, h_q, head_dim_v), (b, h_q, s_q)


@torch.library.custom_op(f"{NAMESPACE}::flash_mla_with_kvcache", mutates_args=(), device_types="cuda",
                         schema=_MLA_SCHEMA)
def _flash_mla_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                  head_dim_v: int, num_splits: int | None, softmax_scale: float | None, causal: bool,
                  backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    out_shape, lse_shape = _mla_shapes(q, head_dim_v)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=MLA_LSE_DTYPE, device=q.device)
    _flash_mla(q.detach(), k_cache.detach(), block_table.detach(), cache_seqlens.detach(), head_dim_v, None,
               num_splits, softmax_scale, causal, out=out, lse=lse, stream=_stream(q),
               backend=backend)  # type: ignore[arg-type]
    return out, lse


@_flash_mla_op.register_fake
def _flash_mla_fake(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                    head_dim_v: int, num_splits: int | None, softmax_scale: float | None, causal: bool,
                    backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    out_shape, lse_shape = _mla_shapes(q, head_dim_v)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=MLA_LSE_DTYPE)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int = 512, tile_scheduler_metadata: Any = None,
                           num_splits: int | None = None, softmax_scale: float | None = None, causal: bool = False,
                           *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gqadrv.flash_mla_with_kvcache`` (FlashMLA's names and order, dense path) as the custom op
    ``torch.ops.gqadrv.flash_mla_with_kvcache``.

    Returns new tensors ``(out [b, s_q, h_q, head_dim_v] in q's dtype, lse fp32 [b, h_q, s_q])``.
    ``tile_scheduler_metadata`` is accepted for FlashMLA compatibility and ignored (gqadrv plans the
    splits on the device; ``num_splits`` forces a count). ``softmax_scale`` is absolute (default
    ``576 ** -0.5``).
    """
    del tile_scheduler_metadata
    out, lse = torch.ops.gqadrv.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, int(head_dim_v),
                                                       None if num_splits is None else int(num_splits),
                                                       None if softmax_scale is None else float(softmax_scale),
                                                       bool(causal), backend)
    return out, lse
