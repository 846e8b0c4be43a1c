"""Public GQA decode API: the convenience call and the prepared (graph-capturable) launch.

    out = gqa_decode(q, kv, sequence_lengths, out=None, q_scale=1.0, sm_scale=None, stream=None)
    p   = prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lens}, num_splits=None)
    o   = launch_prepared(p)          # one cuLaunchKernelEx: no validation, allocation or host read

The op-neutral machinery (kernel loading, plan and replay caches, workspace pool, ``Prepared``,
``launch_prepared``) lives in ``gqadrv.ops``; launches are built by ``gqa.plan.build_launch``.
Seed-compatible aliases (``sm110_*``) are in ``gqa.compat``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar, overload

from ..ops import workspace as _workspace
from ..ops.plans import launch_packed
from ..runtime.module import launch_plans
from ..ops import outputs as _outputs
from ..ops.layouts import LayoutCache, LayoutEntry, TmapSlot, call_kind, call_streams
from ..ops.prepared import PreparedDecode, prepare_streams
from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.streams import device_hint, order_fast, order_inputs, resolve_stream
from ..types import ArrayT, Backend, DLPackArray, OutT, StreamLike
from . import contract as _contract
from . import layout_family as _family
from . import plan as _plan
from . import routes as _routes
from .kv_dtype import fp8_args_given, kv_is_8bit

__all__ = ["PreparedGqaDecode", "gqa_decode", "prepare_gqa_decode"]

STATUS_NAMES = ((1, "empty"), (2, "clamped"))


# ----------------------------------------------------------------------------- layout plans
# A convenience call whose four tensors come from one framework the fast readers know (CuPy, torch,
# JAX arrays, and XLA FFI buffers with out given, i.e. gqadrv.jax's callbacks under jax.jit:
# runtime.tensors.fast_kind) is keyed by layout: framework, shape / strides / dtype of each
# tensor, whether out is given, device, q_scale, sm_scale, backend, the tuning environment and the
# resolved launch stream. Not by addresses: a later call with the same key and new tensors re-reads
# only the addresses (each framework's cheap attribute), orders the producers, re-checks what
# depends on the address (alignment, out overlapping an input; ops.layouts), patches the address
# fields of the packed GqaArgs and the KV tensor map, and launches the plan built the first time.
# A call with the very same addresses patches nothing (the former exact-pointer replay).
# Processes that see several GPUs use it too: the device is part of the key and the launch makes
# its context current. Anything unusual (mixed frameworks, 0-d array scalars, a failed check) takes
# the full path, which validates, routes and launches, and remembers the layout when it succeeded.
_layouts = LayoutCache(1024)
_MISS = object()
_ALIGNS = (16, 16, 4, 16)   # q, kv (TMA), lengths, out
_FIELDS = (((0, "args.q"),), ((0, "args.kv"),), ((0, "args.lengths"),), ((0, "args.out"),))


def _call_facts(q, kv, lens, out, q_scale, sm_scale, stream, backend) -> tuple | None:
    """(key, ptrs, kind, device, stream, current stream) of a call the layout cache can serve, or
    None (see above)."""
    kind = call_kind((q, kv, lens), (), (out,))
    if kind is None or (kind == "xla" and out is None):  # XLA buffers: only as a callback's out=
        return None
    t = type(q_scale)
    if t is not float and t is not int:
        return None
    if sm_scale is not None and type(sm_scale) is not float and type(sm_scale) is not int:
        return None
    if backend is not None and type(backend) is not str:
        return None
    read = _tensors.FAST_READERS[kind]
    try:
        fq, fk, fl = read(q), read(kv), read(lens)
        fo = read(out) if out is not None else None
    except Exception:  # noqa: BLE001 - anything unusual is explained by the full path
        return None
    if fq is None or fk is None or fl is None or (out is not None and fo is None):
        return None
    dev = fq[2]
    if fk[2] != dev or fl[2] != dev or (fo is not None and fo[2] != dev):
        return None
    s, cur = call_streams(kind, dev, stream)
    key = (kind, fq[0], fk[0], fl[0], None if fo is None else fo[0], dev, q_scale, sm_scale, backend,
           _routes.tuning_env(), s)
    return key, (fq[1], fk[1], fl[1], 0 if fo is None else fo[1]), kind, dev, s, cur


def _launch_layout(e: LayoutEntry, facts: tuple, q, kv, lens, out, backend):
    if e.size is not None and e.size != _family.key_size(facts[0]):
        # a family's re-sizable entry now holds another layout's sizes: this layout gets its own entry
        return _family_call(facts, q, kv, lens, out, backend, private=True)
    _key, ptrs, kind, dev, s, cur = facts
    order_fast(kind, (q, kv, lens, out), dev, s, cur)
    o = None
    if out is None:
        o = _outputs.allocate(q, e.out_shape, e.out_dtype, dev, s, cur)
        ptrs = ptrs[:3] + (o.ptr,)
    with e.lock:
        if e.size is not None and e.size != _family.key_size(facts[0]):  # re-sized meanwhile by another thread
            return _MISS
        if not e.bind(ptrs):
            return _MISS
        e.launch()
    return out if o is None else _outputs.hand_back(o, q, s, dev)


def _layout_entry(problem, variant, plan, ws, out_ptr: int, dev: int, s: int) -> LayoutEntry:
    """The layout entry of a validated call: its plan, where each address goes, the address rules."""
    views = (problem.q, problem.kv, problem.lengths)
    spans = [(lo - v.ptr, hi - v.ptr) for v in views for lo, hi in (v.byte_range(),)]
    if problem.out is not None:
        lo, hi = problem.out.byte_range()
        spans.append((lo - problem.out.ptr, hi - problem.out.ptr))
    else:
        spans.append((0, problem.q.nbytes))
    tmaps = ()
    if variant.family.uses_tma:
        tmaps = (TmapSlot(0, "kv_map", 1, _plan.kv_tensor_spec(problem, variant), plan.args.param_bytes("kv_map")),)
    ptrs = (problem.q.ptr, problem.kv.ptr, problem.lengths.ptr, out_ptr)
    return LayoutEntry((plan,), _FIELDS, _ALIGNS, tuple(spans), 3, tmaps, ptrs, dev, s, keep=(ws,),
                       out_shape=problem.q.shape, out_dtype=problem.dtype)


def _remember(facts: tuple, problem, variant, loaded, plan, ws, out_ptr: int) -> None:
    """Keep the plan of a validated call under its layout key, and its problem and entry as the
    template of the layout's family (gqa.layout_family), when the full path saw exactly the facts
    the key was made of (device, stream, addresses)."""
    key, ptrs, _kind, dev, s, _cur = facts
    seen = (problem.q.ptr, problem.kv.ptr, problem.lengths.ptr, problem.out.ptr if problem.out is not None else 0)
    if problem.device != dev or plan.stream != s or seen[:3] != ptrs[:3] or (ptrs[3] and seen[3] != ptrs[3]):
        return
    e = _layouts.remember(key, _layout_entry(problem, variant, plan, ws, out_ptr, dev, s))
    side = _plan.route_side(dev, problem.batch, problem.num_kv_heads, problem.capacity, problem.head_dim)
    _family.remember(key, problem, side, (variant, loaded, e))


def _family_call(facts: tuple, q, kv, lens, out, backend, private: bool = False):
    """First call of a new layout of a known family (gqa.layout_family); _MISS (nothing launched)
    when the layout is not a member, its family is unknown or an address rule fails. The re-sizable
    entry of its route side and batch size serves it when there is one (``private``: build the layout
    an entry of its own, for a layout whose sizes that entry no longer holds)."""
    key, ptrs, kind, dev, s, cur = facts
    split = _family.split_key(key)
    fam = None if split is None else _family.families.get(split[0])
    if fam is None:
        return _MISS
    _fk, B, C = split
    t = fam.template
    Hq, Hkv, D = t.num_q_heads, t.num_kv_heads, t.head_dim
    side = _plan.route_side(dev, B, Hkv, C, D)
    built = fam.built.get(side)
    flex = None if private or built is None else fam.flex.get((side, B))
    if built is None:  # the family's first member on this route side: built from the template's problem
        problem = _family.member_problem(t, B, C, (q, kv, lens, out), ptrs)
        variant, loaded = _plan.route(problem, backend)
    else:  # re-size the entry of this side and B, or copy a built member's arguments with new sizes
        variant, loaded, base = built
    splits = _plan.splits_for(variant, loaded, dev, B, Hkv, C)
    ws = None
    if splits > 1:
        ws = _workspace.pooled(dev, s, _plan.workspace_sizes_for(B, Hkv, t.group, D, splits), _plan.WORKSPACE_ZERO)
    o = None
    if out is None:
        o = _outputs.allocate(q, (B, Hq, D), t.dtype, dev, s, cur)
        ptrs = ptrs[:3] + (o.ptr,)
    if flex is not None:
        e = flex
    elif built is None:
        plan = _plan.build_launch(problem, variant, loaded, out_ptr=ptrs[3], ws=ws, status_ptr=0, splits=splits,
                                  stream=s)
        e = _layout_entry(problem, variant, plan, ws, ptrs[3], dev, s)
        if not e.check(e.ptrs):  # alignment, out overlapping an input: the full path raises the error
            return _MISS
        fam.built.setdefault(side, (variant, loaded, e))
    else:
        e = _family.copy_member(base, variant, loaded, t, B, C, ptrs, ws, splits, dev, s)
        if e is None:  # alignment, out overlapping an input: the full path raises the error
            return _MISS
    if not private and (side, B) not in fam.flex:
        # the first member entry of this side and batch size becomes their re-sizable one (it also stays
        # this layout's entry)
        fam.flex.setdefault((side, B), _family.make_flexible(e, variant, loaded, t, dev, B, C))
    order_fast(kind, (q, kv, lens, out), dev, s, cur)
    with e.lock:
        if flex is not None:
            if flex.size != (B, C):
                _family.resize(flex, B, C, splits, ws, ptrs[1])
            if not flex.bind(ptrs):  # alignment, out overlapping an input: the full path raises the error
                return _MISS
        e.launch()
    _layouts.remember(key, e)
    return out if o is None else _outputs.hand_back(o, q, s, dev)


# ----------------------------------------------------------------------------- convenience API
@overload
def gqa_decode(q: ArrayT, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: None = None,
               q_scale: float = 1.0, sm_scale: float | None = None, stream: StreamLike | None = None,
               backend: Backend | None = None, lse: None = None, return_lse: Literal[False] = False,
               deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
               v_scale: float | DLPackArray | None = None) -> ArrayT: ...
@overload
def gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: OutT, q_scale: float = 1.0,
               sm_scale: float | None = None, stream: StreamLike | None = None,
               backend: Backend | None = None, lse: None = None, return_lse: Literal[False] = False,
               deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
               v_scale: float | DLPackArray | None = None) -> OutT: ...
@overload
def gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: DLPackArray | None = None,
               q_scale: float = 1.0, sm_scale: float | None = None, stream: StreamLike | None = None,
               backend: Backend | None = None, lse: DLPackArray | None = None, return_lse: bool = False,
               deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
               v_scale: float | DLPackArray | None = None) -> tuple[Any, Any]: ...
def gqa_decode(q: DLPackArray, kv: DLPackArray, sequence_lengths: DLPackArray, *, out: DLPackArray | None = None,
               q_scale: float = 1.0, sm_scale: float | None = None, stream: StreamLike | None = None,
               backend: Backend | None = None, lse: DLPackArray | None = None, return_lse: bool = False,
               deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
               v_scale: float | DLPackArray | None = None) -> Any:
    """GQA decode from a contiguous cache.

    q [B, Hq, D] (one query token) or [B, s_q, Hq, D] (s_q 1..16: query token j sees keys
    [0, len - (s_q - 1 - j)), bottom-right causal), kv [B, 2, Hkv, C, D] (K at 0, V at 1),
    sequence_lengths int32 [B] on the device, out (shape of q) optional. fp16 or bf16; Hq % Hkv == 0
    with group 1..16; D in {64, 128, 256}.
    Softmax scale: ``softmax(sm_scale * q.k)``. ``sm_scale`` is absolute (default ``1/sqrt(D)``);
    the seed's ``q_scale`` multiplies that default (``q_scale = sm_scale * sqrt(D)``). Give one of
    them: ``sm_scale`` with a ``q_scale`` other than 1.0 is a ValueError.
    Returns ``out`` (the caller's object) or a new array of the caller's framework; with
    ``return_lse=True`` (or ``lse`` given: fp32 [B, Hq] or [B, s_q, Hq]) the pair (out, lse), lse
    the natural-log sum of exp(sm_scale * q.k) over the row's keys, +inf for a row without keys.
    ``deterministic=True``: each request's result is bitwise independent of the batch it is in and
    of the run (fixed split size, ordered merge; see gqadrv.gqa.paged).
    Asynchronous on ``stream`` (default: the current torch stream for torch tensors, else CuPy's
    current stream); every input's producer is ordered before the launch, whatever framework it
    comes from. Lengths are clamped on the device to [0, C]; an empty request yields zeros.
    ``backend``: None/'auto', 'hopper', 'tcgen05' or 'portable' (also GQADRV_BACKEND).
    Repeated one-token calls with the same layout (new tensors allowed) re-use the first call's plan;
    4-D q, LSE, deterministic and FP8 calls take the paged family's route (gqadrv.gqa.paged).
    FP8 cache: kv float8_e4m3fn, or uint8 / int8 e4m3 codes with ``kv_dtype='e4m3'``; ``k_scale`` /
    ``v_scale`` None, a number or a float32 device array () / (1,) / (Hkv,) (gqadrv.gqa.kv_dtype).
    """
    if (lse is not None or return_lse is not False or deterministic is not False or getattr(q, "ndim", 3) == 4
            or fp8_args_given(kv_dtype, k_scale, v_scale)):
        return _paged_contiguous(q, kv, sequence_lengths, out, lse, return_lse, deterministic, q_scale, sm_scale,
                                 stream, backend, kv_dtype, k_scale, v_scale)
    facts = _call_facts(q, kv, sequence_lengths, out, q_scale, sm_scale, stream, backend)
    if facts is not None:
        e = _layouts.get(facts[0])  # (a layout key includes the dtypes: an FP8 cache never hits)
        r = (_family_call(facts, q, kv, sequence_lengths, out, backend) if e is None
             else _launch_layout(e, facts, q, kv, sequence_lengths, out, backend))
        if r is not _MISS:
            return r
    if kv_is_8bit(kv):
        return _paged_contiguous(q, kv, sequence_lengths, out, lse, return_lse, deterministic, q_scale, sm_scale,
                                 stream, backend, kv_dtype, k_scale, v_scale)
    return _full_call(facts, q, kv, sequence_lengths, out, q_scale, sm_scale, stream, backend)


def _paged_contiguous(q, kv, lengths, out, lse, return_lse, deterministic, q_scale, sm_scale, stream, backend,
                      kv_dtype, k_scale, v_scale):
    from . import paged as _paged

    return _paged.contiguous_decode(q, kv, lengths, out=out, lse=lse, return_lse=return_lse,
                                    deterministic=deterministic, q_scale=q_scale, sm_scale=sm_scale, stream=stream,
                                    backend=backend, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)


def _full_call(facts, q, kv, sequence_lengths, out, q_scale, sm_scale, stream, backend):
    _contract.check_scale_pair(q_scale, sm_scale)
    _routes.check_backend(backend)
    _drv.ensure_init()
    fw = _tensors.framework_of(q)
    dev_hint = device_hint(q)
    s = resolve_stream(stream, dev_hint, fw)
    dl_stream = order_inputs((q, kv, sequence_lengths, out), dev_hint, s)
    problem = _contract.validate(q, kv, sequence_lengths, out, q_scale, stream=dl_stream, sm_scale=sm_scale)
    variant, loaded = _plan.route(problem, backend)
    splits = _plan.default_splits(problem, variant, loaded)
    o = None
    if out is None:
        cur = facts[5] if facts is not None and facts[3] == problem.device and facts[4] == s else None
        o = _outputs.allocate(q, problem.q.shape, problem.dtype, problem.device, s, cur)
        out_ptr = o.ptr
    else:
        out_ptr = problem.out.ptr
    ws = None
    if splits > 1:
        ws = _workspace.pooled(problem.device, s, _plan.workspace_sizes(problem, splits), _plan.WORKSPACE_ZERO)
    if facts is not None:
        plan = _plan.build_launch(problem, variant, loaded, out_ptr=out_ptr, ws=ws, status_ptr=0, splits=splits,
                                  stream=s)
        launch_plans((plan,), problem.device)
        _remember(facts, problem, variant, loaded, plan, ws, out_ptr)
    else:
        grid, block, smem, cluster = _plan.launch_shape(variant, loaded, problem.device, problem.batch,
                                                        problem.num_kv_heads, splits)
        args = _plan.args_fields(problem, out_ptr, ws, 0, splits, variant, loaded)
        launch_packed(loaded.kernel, grid, block, smem, variant.family.signature, s,
                      _plan.param_values(problem, variant, args), problem.device, cluster=cluster)
    return out if o is None else _outputs.hand_back(o, q, s, problem.device)


# ----------------------------------------------------------------------------- prepared API
_R = TypeVar("_R")


@dataclasses.dataclass(frozen=True, repr=False)
class PreparedGqaDecode(PreparedDecode[_R]):
    """Immutable result of ``prepare_gqa_decode``; ``launch_prepared`` returns ``O`` (type ``_R``)."""


_PREP_KEYS = ("Q", "KV", "O", "sequence_lengths")


_SCALE_KEYS = ("q_scale", "sm_scale")


def _inputs_from_dict(inputs: Any, Q, KV, O, sequence_lengths, q_scale, sm_scale):
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict with keys {list(_PREP_KEYS)}, got {type(inputs).__name__}")
    missing = [k for k in _PREP_KEYS if k not in inputs]
    if missing:
        raise ValueError(f"inputs is missing {missing}; required keys: {list(_PREP_KEYS)} "
                         "(+ optional 'q_scale' or 'sm_scale')")
    extra = set(inputs) - set(_PREP_KEYS) - set(_SCALE_KEYS)
    if extra:
        raise ValueError(f"unknown inputs keys {sorted(extra)}; expected {list(_PREP_KEYS)} and optional 'q_scale' "
                         "or 'sm_scale'")
    if any(x is not None for x in (Q, KV, O, sequence_lengths)):
        raise ValueError("pass tensors either in `inputs` or as keywords, not both")
    Q, KV, O, sequence_lengths = (inputs[k] for k in _PREP_KEYS)
    if q_scale is None:
        q_scale = inputs.get("q_scale", None)
    if sm_scale is None:
        sm_scale = inputs.get("sm_scale", None)
    return Q, KV, O, sequence_lengths, q_scale, sm_scale


@overload
def prepare_gqa_decode(inputs: dict[str, Any], *, q_scale: float | None = None, sm_scale: float | None = None,
                       num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: Backend | None = None, LSE: DLPackArray | None = None,
                       deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                       v_scale: float | DLPackArray | None = None) -> PreparedGqaDecode[Any]: ...
@overload
def prepare_gqa_decode(inputs: None = None, *, Q: DLPackArray, KV: DLPackArray, O: OutT,
                       sequence_lengths: DLPackArray, q_scale: float | None = None, sm_scale: float | None = None,
                       num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: Backend | None = None, LSE: None = None,
                       deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                       v_scale: float | DLPackArray | None = None) -> PreparedGqaDecode[OutT]: ...
@overload
def prepare_gqa_decode(inputs: None = None, *, Q: DLPackArray, KV: DLPackArray, O: DLPackArray,
                       sequence_lengths: DLPackArray, q_scale: float | None = None, sm_scale: float | None = None,
                       num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: Backend | None = None, LSE: DLPackArray,
                       deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                       v_scale: float | DLPackArray | None = None) -> PreparedGqaDecode[tuple[Any, Any]]: ...
def prepare_gqa_decode(inputs: dict[str, Any] | None = None, *, Q: DLPackArray | None = None,
                       KV: DLPackArray | None = None, O: DLPackArray | None = None,
                       sequence_lengths: DLPackArray | None = None, q_scale: float | None = None,
                       sm_scale: float | None = None, num_splits: int | None = None, stream: StreamLike | None = None,
                       backend: Backend | None = None, LSE: DLPackArray | None = None,
                       deterministic: bool = False, kv_dtype: str | None = None, k_scale: float | DLPackArray | None = None,
                       v_scale: float | DLPackArray | None = None) -> PreparedGqaDecode[Any]:
    """Validate, route, compile, allocate the workspace, encode tensor maps and pack the launch once.

    ``inputs`` is the seed's dict {"Q", "KV", "O", "sequence_lengths", optional "q_scale" or
    "sm_scale"}; the same can be given as keywords. Softmax scale as in ``gqa_decode``:
    ``softmax(sm_scale * q.k)``, sm_scale absolute (default 1/sqrt(D)) or q_scale = sm_scale * sqrt(D);
    giving both (q_scale other than None / 1.0) is a ValueError. ``num_splits``: None (heuristic) or
    an int in [1, 64]. Call outside CUDA-graph capture; ``launch_prepared`` may then be captured and
    replayed. A 4-D Q [B, s_q, Hq, D], an ``LSE`` output (fp32 [B, Hq] / [B, s_q, Hq]; then
    ``launch_prepared`` returns (O, LSE)) or ``deterministic=True`` prepare the paged family's
    kernel on the contiguous cache (gqadrv.gqa.paged; ``PreparedGqaPagedDecode``), as does an FP8
    cache (``kv_dtype``, ``k_scale``, ``v_scale`` as in ``gqa_decode``).
    """
    if inputs is not None:
        Q, KV, O, sequence_lengths, q_scale, sm_scale = _inputs_from_dict(inputs, Q, KV, O, sequence_lengths, q_scale,
                                                                          sm_scale)
    _contract.check_scale_pair(q_scale, sm_scale)
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
    if (LSE is not None or deterministic is not False or getattr(Q, "ndim", 3) == 4
            or fp8_args_given(kv_dtype, k_scale, v_scale) or kv_is_8bit(KV)):
        return _prepare_contiguous_paged(Q, KV, O, sequence_lengths, LSE, q_scale, sm_scale, deterministic,
                                         splits_req, stream, backend, (kv_dtype, k_scale, v_scale))
    s, dl_stream = prepare_streams(Q, (Q, KV, sequence_lengths, O), stream, "prepare_gqa_decode")
    problem = _contract.validate(Q, KV, sequence_lengths, O, q_scale, stream=dl_stream,
                                 names=("Q", "KV", "sequence_lengths", "O"), sm_scale=sm_scale)
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


def _prepare_contiguous_paged(Q, KV, O, lengths, LSE, q_scale, sm_scale, deterministic, splits_req, stream, backend,
                              fp8=(None, None, None)):
    from . import paged as _paged

    kv_dtype, k_scale, v_scale = fp8
    _paged._check_flags(False, deterministic)
    b = _routes.check_backend(backend)
    s, dl_stream = prepare_streams(Q, (Q, KV, lengths, O, LSE, k_scale, v_scale), stream, "prepare_gqa_decode")
    problem = _paged.contiguous_problem(Q, KV, lengths, O, LSE, q_scale, sm_scale, stream=dl_stream,
                                        names=("Q", "KV", "sequence_lengths", "O", "LSE"), kv_dtype=kv_dtype,
                                        k_scale=k_scale, v_scale=v_scale)
    result = O if LSE is None else (O, LSE)
    return _paged.prepare_problem(problem, (Q, KV, O, lengths, LSE), result, deterministic=deterministic,
                                  splits_req=splits_req, backend=b, s=s)
