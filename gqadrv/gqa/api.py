"""Public GQA decode API: the convenience call and the prepared (graph-capturable) launch.

    out = gqa_decode(q, kv, sequence_lengths, out=None, q_scale=1.0, stream=None)
    p   = prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, num_splits=None)
    o   = launch_prepared(p)          # one cuLaunchKernelEx: no validation, allocation or host read

The op-neutral machinery (kernel loading, plan and replay caches, workspace pool, ``Prepared``,
``launch_prepared``) lives in ``gqadrv.ops``; launches are built by ``gqa.plan.build_launch``.
Seed-compatible aliases (``sm110_*``) are in ``gqa.compat``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar, overload

from ..ops import workspace as _workspace
from ..ops.plans import launch_packed
from ..ops.prepared import PreparedDecode
from ..ops.replay import ReplayCache
from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.streams import device_hint, is_capturing, on_stream, order_cupy, order_inputs, resolve_stream
from ..types import ArrayT, Backend, DLPackArray, OutT, StreamLike
from . import contract as _contract
from . import plan as _plan
from . import routes as _routes

__all__ = ["PreparedGqaDecode", "gqa_decode", "prepare_gqa_decode"]

STATUS_NAMES = ((1, "empty"), (2, "clamped"))


# ----------------------------------------------------------------------------- convenience replays
# A convenience call whose tensors are all CuPy arrays on CuPy's current device is keyed by
# everything validation and routing looked at: pointers, shapes, strides and dtypes of the four
# tensors, q_scale, backend, the tuning environment, the device and the resolved stream (with a flag
# when it is not CuPy's current one: the input-ordering event is then recorded again at every
# replay, as on the first call). Processes that see several GPUs replay too: the device is part of
# the key and the replay makes its context current (ops.replay).
_replays = ReplayCache(1024)


def _array_key(a) -> tuple:
    return (a.data.ptr, a.shape, a.strides, a.dtype)


def _replay_key(q, kv, lens, out, q_scale, stream, backend) -> tuple | None:
    """The replay key of a call, or None when the call is not eligible (see above)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    nd = cp.ndarray
    if type(q) is not nd or type(kv) is not nd or type(lens) is not nd or (out is not None and type(out) is not nd):
        return None
    if type(q_scale) is not float and type(q_scale) is not int:
        return None
    if backend is not None and type(backend) is not str:
        return None
    dev = q.device.id
    if dev != cp.cuda.runtime.getDevice():
        return None
    cur = cp.cuda.get_current_stream().ptr
    s = cur if stream is None else resolve_stream(stream, dev, "cupy")
    return (_array_key(q), _array_key(kv), _array_key(lens), None if out is None else _array_key(out), q_scale,
            backend, _routes.tuning_env(), s != cur, s, dev)


# ----------------------------------------------------------------------------- convenience API
@overload
def gqa_decode(q: ArrayT, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: None = None,
               q_scale: float = 1.0, stream: StreamLike | None = None, backend: Backend | None = None) -> ArrayT: ...
@overload
def gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: OutT, q_scale: float = 1.0,
               stream: StreamLike | None = None, backend: Backend | None = None) -> OutT: ...
def gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: DLPackArray | None = None,
               q_scale: float = 1.0, stream: StreamLike | None = None,
               backend: Backend | None = None) -> DLPackArray:
    """One-token GQA decode.

    q [B, Hq, D], kv [B, 2, Hkv, C, D] (K at 0, V at 1), sequence_lengths int32 [B] on the device,
    out [B, Hq, D] optional. fp16 or bf16; Hq % Hkv == 0 with group 1..16; D in {64, 128, 256}.
    The softmax scale is ``q_scale / sqrt(D)`` (q_scale multiplies the default 1/sqrt(D)).
    Returns ``out`` (the caller's object) or a new array of the caller's framework. Asynchronous on
    ``stream`` (default: the current torch stream for torch tensors, else CuPy's current stream);
    every input's producer is ordered before the launch, whatever framework it comes from.
    Lengths are clamped on the device to [0, C]; an empty request yields zeros.
    ``backend``: None/'auto', 'hopper', 'tcgen05' or 'portable' (also GQADRV_BACKEND).
    """
    key = _replay_key(q, kv, sequence_lengths, out, q_scale, stream, backend)
    if key is not None:
        hit = _replays.get(key)
        if hit is not None:
            if key[-3]:  # a stream other than CuPy's current one: order the inputs first
                order_cupy(key[-1], key[-2])
            return hit.launch(out)
    _routes.check_backend(backend)
    _drv.ensure_init()
    fw = _tensors.framework_of(q)
    dev_hint = device_hint(q)
    s = resolve_stream(stream, dev_hint, fw)
    dl_stream = order_inputs((q, kv, sequence_lengths, out), dev_hint, s)
    problem = _contract.validate(q, kv, sequence_lengths, out, q_scale, stream=dl_stream)
    variant, loaded = _plan.route(problem, backend)
    splits = _plan.default_splits(problem, variant, loaded)
    if out is None:
        with on_stream(s, problem.device):
            out_arr = _tensors.empty(problem.q.shape, problem.dtype, problem.device)
        out_ptr = int(out_arr.data.ptr)
    else:
        out_arr, out_ptr = None, problem.out.ptr
    ws = None
    if splits > 1:
        ws = _workspace.pooled(problem.device, s, _plan.workspace_sizes(problem, splits), _plan.WORKSPACE_ZERO)
    grid, block, smem = _routes.launch_geometry(variant, problem.batch, problem.num_kv_heads, splits)
    args = _plan.args_fields(problem, out_ptr, ws, 0, splits, variant, loaded)
    launch_packed(loaded.kernel, grid, block, smem, variant.family.signature, s,
                  _plan.param_values(problem, variant, args), problem.device)
    if key is not None and key[-1] == problem.device and key[-2] == s:
        plan = _plan.build_launch(problem, variant, loaded, out_ptr=out_ptr if out is not None else 0, ws=ws,
                                  status_ptr=0, splits=splits, stream=s)
        _replays.remember(key, (plan,), 0, "args.out", problem.q.shape, _tensors._np_dtype(problem.dtype),
                          problem.device, s)
    if out is not None:
        return out
    with on_stream(s, problem.device):
        return _tensors.export_like(out_arr, q)


# ----------------------------------------------------------------------------- prepared API
_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True, repr=False)
class PreparedGqaDecode(PreparedDecode[_R]):
    """Immutable result of ``prepare_gqa_decode``; ``launch_prepared`` returns ``O`` (type ``_R``)."""


_PREP_KEYS = ("Q", "KV", "O", "sequence_lengths")


def _inputs_from_dict(inputs: Any, Q, KV, O, sequence_lengths, q_scale):
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict with keys {list(_PREP_KEYS)}, got {type(inputs).__name__}")
    missing = [k for k in _PREP_KEYS if k not in inputs]
    if missing:
        raise ValueError(f"inputs is missing {missing}; required keys: {list(_PREP_KEYS)} (+ optional 'q_scale')")
    extra = set(inputs) - set(_PREP_KEYS) - {"q_scale"}
    if extra:
        raise ValueError(f"unknown inputs keys {sorted(extra)}; expected {list(_PREP_KEYS)} and optional 'q_scale'")
    if any(x is not None for x in (Q, KV, O, sequence_lengths)):
        raise ValueError("pass tensors either in `inputs` or as keywords, not both")
    Q, KV, O, sequence_lengths = (inputs[k] for k in _PREP_KEYS)
    if q_scale is None:
        q_scale = inputs.get("q_scale", 1.0)
    return Q, KV, O, sequence_lengths, q_scale


@overload
def prepare_gqa_decode(inputs: dict[str, Any], *, q_scale: float | None = None, num_splits: int | None = None,
                       stream: StreamLike | None = None, backend: Backend | None = None) -> PreparedGqaDecode[Any]: ...
@overload
def prepare_gqa_decode(inputs: None = None, *, Q: DLPackArray, KV: DLPackArray, O: OutT,
                       sequence_lengths: DLPackArray, q_scale: float | None = None, num_splits: int | None = None,
                       stream: StreamLike | None = None, backend: Backend | None = None) -> PreparedGqaDecode[OutT]: ...
def prepare_gqa_decode(inputs: dict[str, Any] | None = None, *, Q: DLPackArray | None = None,
                       KV: DLPackArray | None = None, O: DLPackArray | None = None,
                       sequence_lengths: DLPackArray | None = None, q_scale: float | None = None,
                       num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: Backend | None = None) -> PreparedGqaDecode[Any]:
    """Validate, route, compile, allocate the workspace, encode tensor maps and pack the launch once.

    ``inputs`` is the seed's dict {"Q", "KV", "O", "sequence_lengths", optional "q_scale"}; the same
    can be given as keywords. ``num_splits``: None (heuristic) or an int in [1, 64]. Call outside
    CUDA-graph capture; ``launch_prepared`` may then be captured and replayed.
    """
    if inputs is not None:
        Q, KV, O, sequence_lengths, q_scale = _inputs_from_dict(inputs, Q, KV, O, sequence_lengths, q_scale)
    if q_scale is None:
        q_scale = 1.0
    missing = [n for n, v in (("Q", Q), ("KV", KV), ("sequence_lengths", sequence_lengths)) if v is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required "
                         "(Q, KV, O and sequence_lengths)")
    if O is None:
        raise ValueError("O (the output tensor) is required by the prepared API")
    _routes.check_backend(backend)
    splits_req = _contract.check_num_splits(num_splits)
    _drv.ensure_init()
    fw = _tensors.framework_of(Q)
    dev_hint = device_hint(Q)
    s = resolve_stream(stream, dev_hint, fw)
    if is_capturing(s):
        raise RuntimeError("prepare_gqa_decode must be called outside CUDA-graph capture "
                           "(it allocates and synchronizes); capture launch_prepared instead")
    dl_stream = order_inputs((Q, KV, sequence_lengths, O), dev_hint, s)
    problem = _contract.validate(Q, KV, sequence_lengths, O, q_scale, stream=dl_stream,
                                 names=("Q", "KV", "sequence_lengths", "O"))
    variant, loaded = _plan.route(problem, backend)
    if splits_req is None:
        splits = _plan.default_splits(problem, variant, loaded)
    else:
        if splits_req > 1 and not variant.family.splittable:
            raise ValueError(
                f"num_splits={splits_req}: route {variant.family.name!r} (capacity {problem.capacity} <= "
                f"{_routes.SHORT_CAPACITY_MAX}) cannot split; use num_splits=None or 1"
            )
        splits = splits_req
    ws = None
    if splits > 1:
        ws = _workspace.alloc(problem.device, s, _plan.workspace_sizes(problem, splits), _plan.WORKSPACE_ZERO)
    import cupy

    with cupy.cuda.Device(problem.device):
        status = cupy.empty(problem.batch, dtype=cupy.uint32)
    plan = _plan.build_launch(problem, variant, loaded, out_ptr=problem.out.ptr, ws=ws,
                              status_ptr=int(status.data.ptr), splits=splits, stream=s)
    drv = _drv.driver()
    with _drv.device_scope(problem.device):
        _drv.check(drv.cuMemsetD32Async(int(status.data.ptr), 0, problem.batch, s), "cuMemsetD32Async(status)")
        # the workspace counters and the status must be zero before the first launch on any stream
        _drv.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize(prepare)")
    return PreparedGqaDecode(
        device=problem.device, _plans=(plan,), _out=O, _keep=(Q, KV, O, sequence_lengths, ws, status),
        _status=status, _status_names=STATUS_NAMES,
        route=variant.name, num_splits=splits, grid=plan.grid, block=plan.block, dynamic_smem=plan.smem,
        workspace_bytes=ws.nbytes if ws else 0, arch=loaded.arch, batch=problem.batch, capacity=problem.capacity,
    )
