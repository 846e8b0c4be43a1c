"""Host mirror of the MLA decode kernels' argument block (kernels/mla/common/args.cuh:
struct MlaDecodeArgs). Field list from ``kernel_spec.FIELDS``; ``tests/mla/test_mla_host.py``
parses the header and compares names and offsets."""

from __future__ import annotations

from ..runtime.module import TMAP, NamedStruct, Signature
from . import kernel_spec as _ks

__all__ = ["MLA_ARGS", "SIG", "SIG_TMA", "SIG_TMA1"]

MLA_ARGS = NamedStruct("MlaDecodeArgs", *_ks.FIELDS)
SIG = Signature(("args", MLA_ARGS))
# the TMA seesaw: the two CUtensorMaps of k_cache (channel blocks 0..3 / 4..8) first
SIG_TMA = Signature(("k_lo", TMAP), ("k_hi", TMAP), ("args", MLA_ARGS))
# the TMA narrow kernels: one CUtensorMap of k_cache (one channel block per box) first
SIG_TMA1 = Signature(("k_cb", TMAP), ("args", MLA_ARGS))
