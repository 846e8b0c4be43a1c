"""gqadrv.gqa: GQA decode (contract, route registry, launch plans, API, numpy oracle, bench spec)."""

from ..ops.registry import OpRecord as _OpRecord
from . import routes as _routes
from .api import PreparedGqaDecode, gqa_decode, prepare_gqa_decode
from .compat import launch_sm110_gqa_decode_prepared, prepare_sm110_gqa_decode, sm110_gqa_decode
from .paged import PreparedGqaPagedDecode, gqa_decode_paged, prepare_gqa_decode_paged
from .reference import gqa_decode_reference

__all__ = [
    "PreparedGqaDecode", "PreparedGqaPagedDecode", "gqa_decode", "gqa_decode_paged", "gqa_decode_reference",
    "launch_sm110_gqa_decode_prepared", "prepare_gqa_decode", "prepare_gqa_decode_paged", "prepare_sm110_gqa_decode",
    "sm110_gqa_decode",
]


def _describe(cc: tuple[int, int]) -> str:
    backend = _routes.backend_for_cc(cc)
    return f"GQA decode: backend {backend!r}, kernel families {', '.join(_routes.BACKEND_FAMILIES[backend])}"


def _selftest(rng, gpu: bool) -> list:
    from . import selftest

    return selftest.cpu_cases(rng) + (selftest.gpu_cases(rng) if gpu else [])


def _bench_spec():
    from .bench import SPEC

    return SPEC


OP = _OpRecord(name="gqa", variants_for_arch=_routes.variants_for_arch, describe=_describe, selftest=_selftest,
               bench_spec=_bench_spec)
