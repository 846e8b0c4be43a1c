"""gqadrv.gqa: GQA decode (contract, route registry, API, numpy oracle)."""

from .api import (
    PreparedGqaDecode,
    check_status,
    gqa_decode,
    launch_prepared,
    launch_sm110_gqa_decode_prepared,
    prepare_gqa_decode,
    prepare_sm110_gqa_decode,
    sm110_gqa_decode,
)
from .reference import gqa_decode_reference

__all__ = [
    "PreparedGqaDecode", "check_status", "gqa_decode", "gqa_decode_reference", "launch_prepared",
    "launch_sm110_gqa_decode_prepared", "prepare_gqa_decode", "prepare_sm110_gqa_decode", "sm110_gqa_decode",
]
