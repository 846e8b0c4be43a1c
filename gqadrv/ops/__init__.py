"""gqadrv.ops: what every op family is made of, on top of ``gqadrv.runtime``.

Registry base with declared features, kernel load per (variant, device), launch-plan caches and
the layout-keyed convenience plans (``layouts``), the split-workspace pool, ``Prepared`` (a tuple of launch plans) with the one public
``launch_prepared``, contract helpers, float64 oracle helpers and the benchmark harness.

This floor takes values from an op family (keys, packed arguments, a bench spec) and never
imports one: ``gqadrv.gqa``, ``gqadrv.mla`` and ``gqadrv.merge`` import it, not the other way round.
"""

from .prepared import Prepared, check_status, launch_prepared
from .registry import FeatureError, OpRecord

__all__ = ["FeatureError", "OpRecord", "Prepared", "check_status", "launch_prepared"]
