"""Pieces shared by the benches that time gqadrv's sparse MLA paths against FlashMLA
(``bench_sparse.py``: ``--op mla_sparse``; ``bench_sparse_prefill.py``: ``--op mla_sparse_prefill``):
importing the optional peers, reading a timed variant out of a row's results, ratio makers for the
table and the target lines, number formatting."""

from __future__ import annotations

from ..ops.bench import log

__all__ = ["fmt", "import_peers", "tflops_over", "time_over", "us_of"]


def import_peers(args) -> None:
    """Import torch and FlashMLA (``flash_mla``) when present (``--no-peers``: torch only), logging
    what is missing."""
    for mod in ("torch", "flash_mla"):
        if getattr(args, "no_peers", False) and mod != "torch":
            continue
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001
            log(f"[bench] {mod} not available: {type(exc).__name__}: {str(exc)[:100]}"
                + (" (CuPy graphs time the hot runs; no FlashMLA)" if mod == "torch" else ""))


def us_of(res: dict, name: str, key: str):
    """The ``key`` time of variant ``name`` of a row's results; None when it is missing or failed."""
    v = res.get(name, {})
    return v.get(key) if "error" not in v else None


def time_over(num: str | tuple, den: str):
    """ratio(res, key) = time of ``num`` (the fastest of a tuple) / time of ``den``; None if one is missing."""
    names = (num,) if isinstance(num, str) else num

    def ratio(res: dict, key: str):
        ts = [t for t in (us_of(res, n, key) for n in names) if t]
        d = us_of(res, den, key)
        return min(ts) / d if ts and d else None

    return ratio


def tflops_over(target: float, name: str = "gqadrv"):
    """ratio(res, key) = TFLOPS of variant ``name`` (hot or cold as ``key`` says) / ``target``."""
    def ratio(res: dict, key: str):
        v = res.get(name, {})
        t = v.get(key.replace("_us", "_TFLOPS")) if "error" not in v else None
        return t / target if t else None

    return ratio


def fmt(x, spec: str) -> str:
    """``x`` formatted with ``spec``, or "-" when it is not a number."""
    return format(x, spec) if isinstance(x, (int, float)) else "-"
