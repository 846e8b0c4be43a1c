"""Prepared launches: validated, compiled, allocated and packed once; launched many times.

``Prepared`` holds a tuple of ``LaunchPlan`` objects (one kernel, or a chain such as scheduler ->
split kernel -> combine, chained with programmatic dependent launch), the caller's output object,
the device objects it must keep alive, and an optional per-request status buffer.
``launch_prepared`` is the one public launch for every op family: no validation, allocation,
encoding or host read, so it can be captured into CUDA graphs (cuda-python, CuPy, torch).

Concurrency rule: a prepared object owns mutable device state (split workspace, counters), so two
launches of the same object must not run concurrently (different streams without ordering, or two
graphs replayed concurrently). Give each concurrently running stream or graph its own object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

from ..runtime import driver as _drv
from ..runtime.module import LaunchPlan, launch_plans
from ..runtime.streams import is_capturing, launch_streams, resolve_stream
from ..types import StreamLike

__all__ = ["Prepared", "PreparedDecode", "check_status", "launch_prepared", "prepare_streams"]

R = TypeVar("R")
"""What ``launch_prepared`` returns for a prepared object (its caller-visible output)."""


@dataclasses.dataclass(frozen=True, repr=False)
class Prepared(Generic[R]):
    """Base of every prepared object (``PreparedGqaDecode``, ``PreparedMlaDecode``, ...); generic in
    what ``launch_prepared`` returns for it."""

    device: int
    _plans: tuple[LaunchPlan, ...] = dataclasses.field(compare=False)  # launched in order
    _out: R = dataclasses.field(compare=False)                # what launch_prepared returns
    _keep: tuple[Any, ...] = dataclasses.field(compare=False)  # inputs and buffers kept alive
    _status: Any = dataclasses.field(compare=False)           # CuPy uint32 [n] or None
    _status_names: tuple[tuple[int, str], ...] = dataclasses.field(compare=False)  # for check_status

    @property
    def output(self) -> R:
        return self._out

    @property
    def stream(self) -> int:
        """The stream given at prepare time (launches without a ``stream`` argument go there)."""
        return self._plans[0].stream

    @property
    def plans(self) -> tuple[LaunchPlan, ...]:
        return self._plans


@dataclasses.dataclass(frozen=True, repr=False)
class PreparedDecode(Prepared[R]):
    """A prepared decode launch with the facts a user may want to inspect (route = module name)."""

    route: str
    num_splits: int
    grid: tuple[int, ...]
    block: tuple[int, ...]
    dynamic_smem: int
    workspace_bytes: int
    arch: str
    batch: int
    capacity: int

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(route={self.route!r}, num_splits={self.num_splits}, grid={self.grid}, "
                f"block={self.block}, smem={self.dynamic_smem}, workspace_bytes={self.workspace_bytes}, "
                f"arch={self.arch!r}, device={self.device})")


def prepare_streams(first: Any, tensors: tuple[Any, ...], stream: StreamLike | None, op: str) -> tuple[int, int | None]:
    """(launch stream, DLPack handshake stream) of a ``prepare_*`` call whose first tensor is
    ``first``: the stream resolved as for the convenience calls, every input's producer ordered
    before it (``runtime.streams.order_inputs``). A prepare call allocates and synchronizes, so a
    stream under CUDA-graph capture is refused (RuntimeError naming ``op``)."""
    s, dl_stream = launch_streams(first, tensors, stream)  # (no ordering is done under capture)
    if is_capturing(s):
        raise RuntimeError(f"{op} must be called outside CUDA-graph capture (it allocates and synchronizes); "
                           "capture launch_prepared instead")
    return s, dl_stream


def launch_prepared(prepared: Prepared[R], stream: StreamLike | None = None) -> R:
    """Enqueue one prepared launch (graph-capturable; no validation, allocation or host read).

    ``stream``: None = the stream given at prepare time; any accepted stream spelling otherwise,
    for this launch only (a later call without ``stream`` goes to the prepare-time stream again).
    Returns the caller's output object (for ops with several outputs, their tuple).
    """
    try:
        plans = prepared._plans
    except AttributeError:
        raise TypeError(f"launch_prepared expects an object returned by a prepare_* function (e.g. "
                        f"gqadrv.prepare_gqa_decode), got {type(prepared).__name__}") from None
    launch_plans(plans, prepared.device, None if stream is None else resolve_stream(stream, prepared.device))
    return prepared._out


def check_status(prepared: Prepared[Any]) -> dict[str, list[int]]:
    """Synchronizing debug helper: which requests of the last launch had out-of-range device data.

    Returns {name: [request indices]} for the op's status codes (GQA decode: ``empty`` lengths
    were <= 0 and zeros were written, ``clamped`` lengths were > capacity and were clamped; the
    paged GQA decode adds ``bad_page``: a used block-table entry outside [0, num_pages), read as
    zeros).
    """
    if not isinstance(prepared, Prepared):
        raise TypeError(f"check_status expects a prepared object, got {type(prepared).__name__}")
    if prepared._status is None:
        raise ValueError(f"{type(prepared).__name__} keeps no status buffer")
    drv = _drv.driver()
    with _drv.device_scope(prepared.device):
        _drv.check(drv.cuCtxSynchronize(), "cuCtxSynchronize(check_status)")
        words = prepared._status.get()
    decode = getattr(prepared, "_decode_status", None)
    if decode is not None:  # a family with several status words per request decodes them itself
        decoded: dict[str, list[int]] = decode(words)
        return decoded
    codes = words.tolist()
    return {name: [i for i, c in enumerate(codes) if c == code] for code, name in prepared._status_names}
