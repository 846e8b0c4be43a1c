"""gqadrv.mla: multi-head latent attention (DeepSeek MLA, FlashMLA's API without torch): dense and sparse
decode, sparse prefill, the FP8 cache format."""

from ..ops.registry import OpRecord as _OpRecord
from . import routes as _routes
from .api import (
    MlaSchedMeta,
    PreparedMlaDecode,
    flash_mla_with_kvcache,
    get_mla_metadata,
    prepare_mla_decode,
)
from .fp8_cache import dequantize_k_cache, quantize_k_cache
from .reference import mla_decode_reference
from .sparse_prefill import (
    PreparedMlaSparseFwd,
    flash_mla_sparse_fwd,
    prepare_mla_sparse_fwd,
)

__all__ = ["MlaSchedMeta", "PreparedMlaDecode", "PreparedMlaSparseFwd", "dequantize_k_cache", "flash_mla_sparse_fwd",
           "flash_mla_with_kvcache", "get_mla_metadata", "mla_decode_reference", "prepare_mla_decode",
           "prepare_mla_sparse_fwd", "quantize_k_cache"]


def _describe(cc: tuple[int, int]) -> str:
    try:
        return f"MLA decode: backend {_routes.backend_for_cc(cc)!r}"
    except RuntimeError as exc:
        return f"MLA decode: unavailable ({exc})"


def _selftest(rng, gpu: bool) -> list:
    from . import selftest

    return selftest.cpu_cases(rng) + (selftest.gpu_cases(rng) if gpu else [])


def _bench_spec():
    from .bench import SPEC

    return SPEC


OP = _OpRecord(name="mla", variants_for_arch=_routes.variants_for_arch, describe=_describe, selftest=_selftest,
               bench_spec=_bench_spec)
