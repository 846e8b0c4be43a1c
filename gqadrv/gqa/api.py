"""Public GQA decode API: the convenience call, the prepared (graph-capturable) launch, seed aliases.

    out = gqa_decode(q, kv, sequence_lengths, out=None, q_scale=1.0, stream=None)
    p   = prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, num_splits=None)
    o   = launch_prepared(p)          # one cuLaunchKernelEx: no validation, allocation or host read

Concurrency rule for prepared objects: a prepared object owns a mutable split workspace, so two
launches of the same object must not run concurrently (different streams without ordering, or two
graphs replayed concurrently). Give each concurrently running stream or graph its own prepared
object; ordered reuse (same stream, or streams ordered by events) is fine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
from typing import Any

from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.compiler import arch_for_cc, compile_module
from ..runtime.module import ArgPack, Kernel, LaunchPlan, load_library
from ..runtime.streams import is_capturing, resolve_stream
from ..runtime.tensormap import TmaSpec, encode_tiled
from . import contract as _contract
from . import routes as _routes

__all__ = [
    "PreparedGqaDecode",
    "check_status",
    "gqa_decode",
    "launch_prepared",
    "launch_sm110_gqa_decode_prepared",
    "prepare_gqa_decode",
    "prepare_sm110_gqa_decode",
    "sm110_gqa_decode",
]

_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- kernels per device
@dataclasses.dataclass(frozen=True)
class _Loaded:
    kernel: Kernel
    arch: str
    ctas_per_sm: int


_loaded: dict[tuple, _Loaded] = {}
_loaded_lock = threading.Lock()


def _load(variant: _routes.Variant, device: int) -> _Loaded:
    key = (variant, device)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    with _loaded_lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        info = _drv.device_info(device)
        arch = arch_for_cc(info.cc)
        mod = compile_module(variant.family.source, arch, variant.defines)
        lib = load_library(mod.cubin, variant.name)
        k = lib.kernel(variant.family.entry, device)
        k.ensure_dynamic_smem(variant.dynamic_smem)
        drv = _drv.driver()
        with _drv.device_scope(device):
            occ = _drv.check(
                drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.function, variant.block[0], variant.dynamic_smem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        hit = _Loaded(k, arch, max(1, int(occ)))
        _loaded[key] = hit
        return hit


_ENV_KEYS = ("GQADRV_BACKEND", "GQADRV_TILING", "GQADRV_SHORT_TILING", "GQADRV_PREFETCH", "GQADRV_L2_EVICT_FIRST",
             "GQADRV_TRACE")
_route_cache: dict = {}


def _tuning_env() -> tuple:
    """The tuning variables that change routing, compiled switches or launch flags (part of the
    route and replay keys)."""
    env = os.environ
    return tuple(env.get(k) for k in _ENV_KEYS)


def _route(problem: _contract.GqaProblem, backend: str | None) -> tuple[_routes.Variant, _Loaded]:
    info = _drv.device_info(problem.device)
    ctas = problem.batch * problem.num_kv_heads
    large = _routes.prefers_portable(info.cc, problem.head_dim, ctas, info.sm_count)
    key = (problem.device, problem.capacity, problem.head_dim, problem.dtype, problem.group, backend, large,
           _tuning_env())
    hit = _route_cache.get(key)
    if hit is None:
        variant = _routes.select_variant(info.cc, problem.capacity, problem.head_dim, problem.dtype, problem.group,
                                         backend, ctas, info.sm_count)
        hit = (variant, _load(variant, problem.device))
        if len(_route_cache) > 1024:
            _route_cache.clear()
        _route_cache[key] = hit
    return hit


_tmap_cache: dict = {}


def _kv_tensor_map(problem: _contract.GqaProblem, variant: _routes.Variant) -> bytes:
    """Encoded once per (KV address, geometry, tile); the 128 bytes are copied into each launch."""
    B, Hkv, C, D = problem.batch, problem.num_kv_heads, problem.capacity, problem.head_dim
    key = (problem.device, problem.kv.ptr, B, Hkv, C, D, problem.dtype, variant.tiling.tok)
    hit = _tmap_cache.get(key)
    if hit is not None:
        return hit
    if len(_tmap_cache) > 512:
        _tmap_cache.clear()
    hit = _tmap_cache[key] = _encode_kv_map(problem, variant)
    return hit


def _encode_kv_map(problem: _contract.GqaProblem, variant: _routes.Variant) -> bytes:
    B, Hkv, C, D = problem.batch, problem.num_kv_heads, problem.capacity, problem.head_dim
    return encode_tiled(TmaSpec(
        dtype=problem.dtype,
        address=problem.kv.ptr,
        dims=(D, C, Hkv, 2 * B),
        strides=(D * 2, C * D * 2, Hkv * C * D * 2),
        box=(64, variant.tiling.tok, 1, 1),
        swizzle="128b",
    ))


# ----------------------------------------------------------------------------- split workspace
@dataclasses.dataclass
class _Workspace:
    arrays: tuple          # CuPy arrays kept alive
    ws_o: int
    ws_ml: int
    counters: int
    nbytes: int


def _workspace_bytes(batch: int, hkv: int, group: int, head_dim: int, splits: int) -> tuple[int, int, int]:
    n_o = batch * hkv * splits * group * head_dim
    n_ml = batch * hkv * splits * group * 2
    return n_o, n_ml, batch * hkv


def _alloc_workspace(device: int, stream: int, n_o: int, n_ml: int, n_cnt: int) -> _Workspace:
    import cupy

    with cupy.cuda.Device(device):
        ws_o = cupy.empty(max(n_o, 1), dtype=cupy.float32)
        ws_ml = cupy.empty(max(n_ml, 1), dtype=cupy.float32)
        cnt = cupy.empty(max(n_cnt, 1), dtype=cupy.uint32)
    drv = _drv.driver()
    with _drv.device_scope(device):
        _drv.check(drv.cuMemsetD32Async(int(cnt.data.ptr), 0, max(n_cnt, 1), stream), "cuMemsetD32Async(counters)")
    return _Workspace((ws_o, ws_ml, cnt), int(ws_o.data.ptr), int(ws_ml.data.ptr), int(cnt.data.ptr),
                      4 * (n_o + n_ml + n_cnt))


# Convenience calls reuse one workspace per (device, stream): launches on one stream are ordered,
# and the last CTA of every (batch, KV head) leaves its counter at zero.
_pool: dict[tuple[int, int], _Workspace] = {}
_pool_lock = threading.Lock()


def _pooled_workspace(device: int, stream: int, n_o: int, n_ml: int, n_cnt: int) -> _Workspace:
    key = (device, stream)
    with _pool_lock:
        ws = _pool.get(key)
        if ws is None or ws.arrays[0].size < n_o or ws.arrays[1].size < n_ml or ws.arrays[2].size < n_cnt:
            old = ws
            ws = _alloc_workspace(device, stream, max(n_o, old.arrays[0].size if old else 0) * (2 if old else 1),
                                  max(n_ml, old.arrays[1].size if old else 0) * (2 if old else 1),
                                  max(n_cnt, old.arrays[2].size if old else 0) * (2 if old else 1))
            if old is not None:
                # An older launch on this stream may still use it: keep it alive for the process.
                _retired.append(old)
            _pool[key] = ws
        return ws


_retired: list[_Workspace] = []


# ----------------------------------------------------------------------------- argument packing
def _flags(problem, variant, loaded: _Loaded, splits: int) -> int:
    """GqaArgs.flags of a launch: L2 evict-first for KV footprints above half the L2
    (GQADRV_L2_EVICT_FIRST=0/1 overrides) and the L2 prefetch rule of routes.l2_prefetch_pays."""
    info = _drv.device_info(problem.device)
    env = os.environ.get("GQADRV_L2_EVICT_FIRST")
    if env is not None:
        f = _routes.GQA_FLAG_L2_EVICT_FIRST if env == "1" else 0
    else:
        f = _routes.GQA_FLAG_L2_EVICT_FIRST if problem.kv.nbytes * 2 > info.l2_bytes else 0
    if _routes.l2_prefetch_pays(variant, problem.batch, problem.num_kv_heads, problem.capacity, splits,
                                info.sm_count, loaded.ctas_per_sm):
        f |= _routes.GQA_FLAG_L2_PREFETCH
    return f


def _args_tuple(problem, out_ptr, ws: _Workspace | None, status_ptr: int, splits: int, variant,
                loaded: _Loaded) -> tuple:
    scale_log2 = problem.q_scale / math.sqrt(problem.head_dim) / _LN2
    return (
        problem.q.ptr, problem.kv.ptr, out_ptr, problem.lengths.ptr,
        ws.ws_o if ws else 0, ws.ws_ml if ws else 0, ws.counters if ws else 0, status_ptr,
        scale_log2, problem.num_kv_heads, problem.group, problem.capacity, splits,
        _flags(problem, variant, loaded, splits),
    )


def _tmap_of(problem, variant) -> bytes | None:
    return _kv_tensor_map(problem, variant) if variant.family.uses_tma else None


def _pack_into(pack: ArgPack, args: tuple, tmap: bytes | None) -> ArgPack:
    """Fill a kernel's argument buffer: (tensor map, args) for TMA families, (args) otherwise."""
    return pack.pack(tmap, args) if tmap is not None else pack.pack(args)


def _pack(variant, problem, args: tuple) -> ArgPack:
    return _pack_into(ArgPack(variant.family.signature), args, _tmap_of(problem, variant))


class _ExternalStream:
    """Minimal __cuda_stream__ carrier, so CuPy can treat a raw handle as its current stream."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_ext_streams: dict = {}


def _on_stream(stream: int, device: int):
    """A CuPy stream object for a raw handle (cached), usable as ``with`` context."""
    key = (device, stream)
    st = _ext_streams.get(key)
    if st is None:
        import cupy

        with cupy.cuda.Device(device):
            st = cupy.cuda.Stream.from_external(_ExternalStream(stream))
        if len(_ext_streams) > 256:
            _ext_streams.clear()
        _ext_streams[key] = st
    return st


# Convenience launches reuse one LaunchPlan (config + argument buffer) per (kernel, grid, stream);
# the lock covers packing and enqueueing, so concurrent threads cannot interleave arguments.
_plans: dict = {}
_plans_lock = threading.Lock()


def _launch_convenience(loaded: _Loaded, variant, problem, grid, block, smem, s, out_ptr, ws, splits) -> None:
    key = (loaded.kernel.function_int, grid, smem, s)
    args = _args_tuple(problem, out_ptr, ws, 0, splits, variant, loaded)
    tmap = _tmap_of(problem, variant)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) > 256:
                _plans.clear()
            plan = _plans[key] = LaunchPlan(loaded.kernel, grid, block, smem, ArgPack(variant.family.signature),
                                            stream=s, pdl=True)
        _pack_into(plan.args, args, tmap)
        if _MULTI_DEVICE[0]:
            with _drv.device_scope(problem.device):
                plan.launch()
        else:
            plan.launch()


_MULTI_DEVICE = [None]


def _note_devices() -> None:
    if _MULTI_DEVICE[0] is None:
        _MULTI_DEVICE[0] = _drv.device_count() > 1


# ----------------------------------------------------------------------------- convenience replays
# A convenience call whose tensors are all CuPy arrays on the current device (single-GPU processes)
# is keyed by everything validation and routing looked at: pointers, shapes, strides and dtypes of
# the four tensors, q_scale, backend, the tuning environment, device and the resolved stream (with
# a flag when it is not CuPy's current one: the input-ordering event is then recorded again at
# every replay, as on the first call). A call with the
# same key skips ingestion, validation, routing and packing: it reuses the launch (and allocates a
# new output when out is None). Equal pointers with equal shapes, strides and dtypes describe the same
# memory layout, so every validated fact (alignment, contiguity, aliasing) still holds.
class _Replay:
    __slots__ = ("plan", "args", "shape", "dtype", "lock")

    def __init__(self, plan: LaunchPlan, args: tuple, shape, dtype):
        self.plan, self.args, self.shape, self.dtype = plan, args, shape, dtype
        self.lock = threading.Lock()

    def launch(self, out):
        if out is not None:
            with self.lock:
                self.plan.launch()
            return out
        import cupy

        # current device (the key says so), allocated in stream order on the launch stream
        s = self.plan._stream
        if s == cupy.cuda.get_current_stream().ptr:
            o = cupy.empty(self.shape, self.dtype)
        else:
            with _on_stream(s, cupy.cuda.runtime.getDevice()):
                o = cupy.empty(self.shape, self.dtype)
        args = self.args
        args = args[:2] + (o.data.ptr,) + args[3:]
        with self.lock:
            self.plan.args.set("args", args)
            self.plan.launch()
        return o


_replays: dict = {}
_replays_lock = threading.Lock()


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
    dev = q.device.id
    if dev != cp.cuda.runtime.getDevice():
        return None
    cur = cp.cuda.get_current_stream().ptr
    s = cur if stream is None else resolve_stream(stream, dev, "cupy")
    return (_array_key(q), _array_key(kv), _array_key(lens), None if out is None else _array_key(out), q_scale,
            backend, _tuning_env(), _MULTI_DEVICE[0], s != cur, s, dev)


def _remember_replay(key, loaded, variant, problem, grid, block, smem, s, ws, splits) -> None:
    if _MULTI_DEVICE[0]:  # launches must make the device's context current: not replayed
        return
    args = _args_tuple(problem, problem.out.ptr if problem.out is not None else 0, ws, 0, splits, variant, loaded)
    plan = LaunchPlan(loaded.kernel, grid, block, smem, _pack(variant, problem, args), stream=s, pdl=True)
    with _replays_lock:
        if len(_replays) > 1024:
            _replays.clear()
        _replays[key] = _Replay(plan, args, problem.q.shape, _tensors._np_dtype(problem.dtype))


# ----------------------------------------------------------------------------- convenience API
def gqa_decode(q: Any, kv: Any, sequence_lengths: Any, *, out: Any = None, q_scale: float = 1.0,
               stream: Any = None, backend: str | None = None) -> Any:
    """One-token GQA decode.

    q [B, Hq, D], kv [B, 2, Hkv, C, D] (K at 0, V at 1), sequence_lengths int32 [B] on the device,
    out [B, Hq, D] optional. fp16 or bf16; Hq % Hkv == 0 with group 1..16; D in {64, 128, 256}.
    Returns ``out`` (the caller's object) or a new array of the caller's framework. Asynchronous on
    ``stream`` (default: the current torch stream for torch tensors, else CuPy's current stream).
    Lengths are clamped on the device to [0, C]; an empty request yields zeros.
    ``backend``: None/'auto', 'hopper' or 'portable' (also GQADRV_BACKEND).
    """
    key = _replay_key(q, kv, sequence_lengths, out, q_scale, stream, backend)
    if key is not None:
        hit = _replays.get(key)
        if hit is not None:
            if key[-3]:  # a stream other than CuPy's current one: order the inputs first
                _dlpack_stream("cupy", key[-1], key[-2])
            return hit.launch(out)
    _drv.ensure_init()
    _note_devices()
    fw = _tensors.framework_of(q)
    dev_hint = _device_hint(q)
    s = resolve_stream(stream, dev_hint, fw)
    problem = _contract.validate(q, kv, sequence_lengths, out, q_scale, stream=_dlpack_stream(fw, dev_hint, s))
    variant, loaded = _route(problem, backend)
    info = _drv.device_info(problem.device)
    splits = _routes.default_splits(variant, problem.batch, problem.num_kv_heads, problem.capacity,
                                    info.sm_count, loaded.ctas_per_sm)
    if out is None:
        with _on_stream(s, problem.device):
            out_arr = _tensors.empty(problem.q.shape, problem.dtype, problem.device)
        out_ptr = int(out_arr.data.ptr)
    else:
        out_arr, out_ptr = None, problem.out.ptr
    ws = None
    if splits > 1:
        ws = _pooled_workspace(problem.device, s, *_workspace_bytes(problem.batch, problem.num_kv_heads,
                                                                     problem.group, problem.head_dim, splits))
    grid, block, smem = _routes.launch_geometry(variant, problem.batch, problem.num_kv_heads, splits)
    _launch_convenience(loaded, variant, problem, grid, block, smem, s, out_ptr, ws, splits)
    if key is not None and key[-1] == problem.device and key[-2] == s:
        _remember_replay(key, loaded, variant, problem, grid, block, smem, s, ws, splits)
    if out is not None:
        return out
    with _on_stream(s, problem.device):
        return _tensors.export_like(out_arr, q)


def _dlpack_stream(framework: str, device: int, s: int) -> int | None:
    """The stream to hand to producers' __dlpack__ so inputs are ordered before the launch on ``s``.

    CuPy arrays are ordered by CuPy's current stream: when that is ``s`` nothing is needed, else one
    event wait orders all inputs at once (instead of one handshake per tensor). Other producers get
    ``s`` (the DLPack protocol). During graph capture no handshake is made: inputs must already be
    ordered on the capturing stream."""
    if is_capturing(s):
        return None
    if framework == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            cur = cupy.cuda.get_current_stream()
            if int(cur.ptr) != s:
                ev = _order_events.get((device, s))
                if ev is None:
                    ev = _order_events[(device, s)] = cupy.cuda.Event(block=False, disable_timing=True)
                ev.record(cur)  # re-recording is fine: a wait captures the event's state when issued
                _drv.check(_drv.driver().cuStreamWaitEvent(s, int(ev.ptr), 0), "cuStreamWaitEvent")
        return None
    return s


_order_events: dict = {}


def _device_hint(obj: Any) -> int:
    try:
        t, d = obj.__dlpack_device__()
        return int(d) if int(t) in (2, 13) else 0
    except Exception:  # noqa: BLE001 - validation reports the real problem
        return 0


def _require_sm110(device: int) -> None:
    cc = _drv.device_info(device).cc
    if cc != (11, 0):
        raise RuntimeError(
            f"sm110_gqa_decode requires compute capability 11.0 (Jetson Thor), got {cc[0]}.{cc[1]}; "
            "use gqadrv.gqa_decode, the portable entry point, on other GPUs"
        )


def sm110_gqa_decode(q: Any, kv: Any, sequence_lengths: Any, *, out: Any = None, q_scale: float = 1.0,
                     stream: Any = None) -> Any:
    """Seed-compatible name: like ``gqa_decode`` but raises RuntimeError unless the GPU is SM110."""
    _drv.ensure_init()
    _require_sm110(_device_hint(q))
    return gqa_decode(q, kv, sequence_lengths, out=out, q_scale=q_scale, stream=stream)


# ----------------------------------------------------------------------------- prepared API
@dataclasses.dataclass(frozen=True, repr=False)
class PreparedGqaDecode:
    """Immutable result of ``prepare_gqa_decode``; launch it with ``launch_prepared``."""

    route: str
    num_splits: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int
    workspace_bytes: int
    arch: str
    device: int
    batch: int
    capacity: int
    _plan: LaunchPlan = dataclasses.field(compare=False)
    _out: Any = dataclasses.field(compare=False)
    _keep: tuple = dataclasses.field(compare=False)
    _status: Any = dataclasses.field(compare=False)
    _stream: int = dataclasses.field(compare=False)

    def __repr__(self) -> str:
        return (f"PreparedGqaDecode(route={self.route!r}, num_splits={self.num_splits}, grid={self.grid}, "
                f"block={self.block}, smem={self.dynamic_smem}, workspace_bytes={self.workspace_bytes}, "
                f"arch={self.arch!r}, device={self.device})")

    @property
    def output(self) -> Any:
        return self._out


_PREP_KEYS = ("Q", "KV", "O", "sequence_lengths")


def prepare_gqa_decode(inputs: dict | None = None, *, Q: Any = None, KV: Any = None, O: Any = None,
                       sequence_lengths: Any = None, q_scale: Any = None, num_splits: Any = None,
                       stream: Any = None, backend: str | None = None) -> PreparedGqaDecode:
    """Validate, route, compile, allocate the workspace, encode tensor maps and pack the launch once.

    ``inputs`` is the seed's dict {"Q", "KV", "O", "sequence_lengths", optional "q_scale"}; the same
    can be given as keywords. ``num_splits``: None (heuristic) or an int in [1, 64]. Call outside
    CUDA-graph capture; ``launch_prepared`` may then be captured and replayed.
    """
    if inputs is not None:
        if not isinstance(inputs, dict):
            raise TypeError(f"inputs must be a dict with keys {_PREP_KEYS}, got {type(inputs).__name__}")
        missing = [k for k in _PREP_KEYS if k not in inputs]
        if missing:
            raise KeyError(f"inputs is missing {missing}; required keys: {list(_PREP_KEYS)} (+ optional 'q_scale')")
        extra = set(inputs) - set(_PREP_KEYS) - {"q_scale"}
        if extra:
            raise ValueError(f"unknown inputs keys {sorted(extra)}; expected {list(_PREP_KEYS)} and optional 'q_scale'")
        if any(x is not None for x in (Q, KV, O, sequence_lengths)):
            raise ValueError("pass tensors either in `inputs` or as keywords, not both")
        Q, KV, O, sequence_lengths = (inputs[k] for k in _PREP_KEYS)
        if q_scale is None:
            q_scale = inputs.get("q_scale", 1.0)
    if q_scale is None:
        q_scale = 1.0
    if Q is None or KV is None or sequence_lengths is None:
        raise ValueError("Q, KV and sequence_lengths are required")
    if O is None:
        raise ValueError("O (the output tensor) is required by the prepared API")
    _drv.ensure_init()
    _note_devices()
    splits_req = _contract.check_num_splits(num_splits)
    fw = _tensors.framework_of(Q)
    s = resolve_stream(stream, _device_hint(Q), fw)
    if is_capturing(s):
        raise RuntimeError("prepare_gqa_decode must be called outside CUDA-graph capture "
                           "(it allocates and synchronizes); capture launch_prepared instead")
    problem = _contract.validate(Q, KV, sequence_lengths, O, q_scale, stream=s, names=("Q", "KV", "sequence_lengths", "O"))
    variant, loaded = _route(problem, backend)
    info = _drv.device_info(problem.device)
    if splits_req is None:
        splits = _routes.default_splits(variant, problem.batch, problem.num_kv_heads, problem.capacity,
                                        info.sm_count, loaded.ctas_per_sm)
    else:
        if splits_req > 1 and not variant.family.splittable:
            raise ValueError(
                f"num_splits={splits_req}: route {variant.family.name!r} (capacity {problem.capacity} <= "
                f"{_routes.SHORT_CAPACITY_MAX}) cannot split; use num_splits=None or 1"
            )
        splits = splits_req
    ws = None
    if splits > 1:
        ws = _alloc_workspace(problem.device, s, *_workspace_bytes(problem.batch, problem.num_kv_heads,
                                                                   problem.group, problem.head_dim, splits))
    import cupy

    with cupy.cuda.Device(problem.device):
        status = cupy.empty(problem.batch, dtype=cupy.uint32)
    grid, block, smem = _routes.launch_geometry(variant, problem.batch, problem.num_kv_heads, splits)
    pack = _pack(variant, problem, _args_tuple(problem, problem.out.ptr, ws, int(status.data.ptr), splits, variant, loaded))
    plan = LaunchPlan(loaded.kernel, grid, block, smem, pack, stream=s, pdl=True)
    drv = _drv.driver()
    with _drv.device_scope(problem.device):
        _drv.check(drv.cuMemsetD32Async(int(status.data.ptr), 0, problem.batch, s), "cuMemsetD32Async(status)")
        # the workspace counters and the status must be zero before the first launch on any stream
        _drv.check(drv.cuStreamSynchronize(s), "cuStreamSynchronize(prepare)")
    keep = (Q, KV, O, sequence_lengths, ws, status)
    return PreparedGqaDecode(
        route=variant.name, num_splits=splits, grid=grid, block=block, dynamic_smem=smem,
        workspace_bytes=ws.nbytes if ws else 0, arch=loaded.arch, device=problem.device,
        batch=problem.batch, capacity=problem.capacity,
        _plan=plan, _out=O, _keep=keep, _status=status, _stream=s,
    )


def launch_prepared(prepared: PreparedGqaDecode, stream: Any = None) -> Any:
    """Enqueue one prepared decode (graph-capturable; no validation, allocation or host read).

    ``stream``: None = the stream given at prepare time; any accepted stream spelling otherwise.
    Returns the caller's O object.
    """
    plan = prepared._plan
    h = None if stream is None else resolve_stream(stream, prepared.device)
    if _MULTI_DEVICE[0]:
        with _drv.device_scope(prepared.device):
            plan.launch(h)
    else:
        plan.launch(h)
    return prepared._out


def prepare_sm110_gqa_decode(inputs: dict, num_splits: Any = None, stream: Any = None) -> PreparedGqaDecode:
    """Seed-compatible name of ``prepare_gqa_decode``; RuntimeError unless the GPU is SM110."""
    _drv.ensure_init()
    if isinstance(inputs, dict) and "Q" in inputs:
        _require_sm110(_device_hint(inputs["Q"]))
    return prepare_gqa_decode(inputs, num_splits=num_splits, stream=stream)


def launch_sm110_gqa_decode_prepared(prepared: PreparedGqaDecode, stream: Any = None) -> Any:
    """Seed-compatible name of ``launch_prepared``."""
    return launch_prepared(prepared, stream)


def check_status(prepared: PreparedGqaDecode) -> dict:
    """Synchronizing debug helper: which requests of the last launch had out-of-range lengths.

    Returns {"clamped": [...], "empty": [...]} with request indices: ``empty`` lengths were <= 0
    (zeros were written), ``clamped`` lengths were > capacity (clamped to capacity).
    """
    drv = _drv.driver()
    with _drv.device_scope(prepared.device):
        _drv.check(drv.cuCtxSynchronize(), "cuCtxSynchronize(check_status)")
        codes = prepared._status.get().tolist()
    return {
        "empty": [i for i, c in enumerate(codes) if c == 1],
        "clamped": [i for i, c in enumerate(codes) if c == 2],
    }
