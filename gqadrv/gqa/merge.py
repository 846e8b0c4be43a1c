"""Merging partial attention states (LSE merge), torch-free: FlashInfer's ``merge_state`` /
``merge_states`` on any DLPack arrays, one kernel launch (``kernels/gqa/smxx/merge_state.cu``).

    v, s = merge_state(v_a, s_a, v_b, s_b)          # two states [..., H, D] / [..., H]
    v, s = merge_states(v, s)                        # stacked [N, K, H, D] / [N, K, H]
    v, s = merge_states([v_0, ..., v_k], [s_0, ..., s_k])   # a list of states [..., H, D] / [..., H]

A *state* is ``(v, s)``: ``v`` the normalised attention output over some subset of the keys, ``s``
its log-sum-exp in natural log, ``s = log(sum_j exp(score_j))``. A state without keys has ``v = 0``
and ``s = +inf`` (gqadrv's LSE convention for empty rows, as in FlashMLA); ``s = -inf`` also means
empty. The merged state of disjoint key sets is the state of their union:

    m = max of the finite s_i,  w_i = exp(s_i - m) (0 for an empty state),
    v = sum_i w_i v_i / sum_i w_i,  s = m + log(sum_i w_i);  every state empty: v = 0, s = +inf.

Empty states are skipped entirely (NaN stored in their ``v`` never reaches the result); NaN in
``s`` or ``v`` of a non-empty state propagates. The kernel accumulates in fp32 in the fixed order of
the states, so a result is bitwise reproducible.

This module holds the whole family: the argument structs (mirrors of the kernel's ``MergeArgs`` /
``MergeTable``), the kernel family and variants (one per dtype), the contract (``validate_pair``,
``validate_list``, ``validate_stacked``), the launch, the public calls, the selftest cases and the
``OP`` record the CLI iterates (``compile``, ``info``, ``selftest``).
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

from ..ops import contract as _oc
from ..ops.kernels import Loaded, load
from ..ops import outputs as _outputs
from ..ops.plans import launch_packed
from ..ops.registry import ElementwiseGeometry, KernelFamily, OpRecord
from ..runtime import driver as _drv
from ..runtime import tensors as _tensors
from ..runtime.module import ArgPack, LaunchPlan, NamedStruct, ParamKind, Signature, launch_plans
from ..runtime.streams import launch_streams
from ..runtime.tensors import TensorView
from ..types import ArrayT, DLPackArray, LseT, OutT, StreamLike
from . import merge_layouts as _merge_layouts

__all__ = ["merge_state", "merge_states"]

# ----------------------------------------------------------------------------- limits
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIM_MULTIPLE = 8     # every row (and every state of a stacked array) stays 16-byte aligned
MAX_HEAD_DIM = 1024
MAX_LIST_STATES = 64      # MERGE_MAX_TABLE: pointers of the list form, passed by value in the parameter block
THREADS = 128             # MERGE_THREADS
MAX_ITEMS = 2**31 - 1     # rows x 16-byte chunks per row (32-bit item index in the kernel)
_DT_CODE = {"float16": 0, "bfloat16": 1, "float32": 2}

# ----------------------------------------------------------------------------- argument structs
MERGE_FLAG_TABLE = 1      # state k's bases from the table (list form), else table[0] + k * state stride
MERGE_FLAG_VEC16 = 2      # every v base and the output 16-byte aligned: vector loads / stores

MERGE_ARGS = NamedStruct(
    "MergeArgs",
    ("out", "Q"),             # void* [R, D] merged v (dtype of the states)
    ("out_lse", "Q"),         # float* [R] merged natural-log LSE
    ("v_state_stride", "q"),  # v elements from state k to k + 1 (stacked: H*D; table form: 0)
    ("s_state_stride", "q"),  # s elements from state k to k + 1 (stacked: H; table form: 0)
    ("v_outer_stride", "q"),  # v elements from n to n + 1 (stacked: K*H*D; list: H*D)
    ("s_outer_stride", "q"),  # s elements from n to n + 1 (stacked: K*H; list: H)
    ("rows", "i"),            # R = N*H output rows
    ("heads", "i"),           # H
    ("head_dim", "i"),        # D
    ("chunks", "i"),          # 16-byte chunks per row: D * itemsize / 16
    ("num_states", "i"),      # K >= 1
    ("flags", "i"),           # MERGE_FLAG_* bits
)
# struct MergeTable { const void* v[64]; const float* s[64]; }: by value, packed as raw bytes
MERGE_TABLE = ParamKind("struct MergeTable", 2 * 8 * MAX_LIST_STATES, 8, None)
SIGNATURE = Signature(("args", MERGE_ARGS), ("table", MERGE_TABLE))


def pack_table(v_ptrs: Sequence[int], s_ptrs: Sequence[int]) -> bytes:
    """The ``MergeTable`` bytes: state bases in order, unused entries zero."""
    if not 1 <= len(v_ptrs) == len(s_ptrs) <= MAX_LIST_STATES:
        raise ValueError(f"a merge table holds 1..{MAX_LIST_STATES} states, got {len(v_ptrs)} / {len(s_ptrs)}")
    pad = [0] * (MAX_LIST_STATES - len(v_ptrs))
    return struct.pack(f"<{2 * MAX_LIST_STATES}Q", *v_ptrs, *pad, *s_ptrs, *pad)


# ----------------------------------------------------------------------------- family and variants
_ARCHES = ("sm_80", "sm_90a", "sm_100a", "sm_110a")
FAMILY = KernelFamily("merge_state", "gqa/smxx/merge_state.cu", "merge_state", _ARCHES, SIGNATURE,
                      frozenset({"fp16", "bf16", "fp32", "lse_merge", "list_states", "stacked_states"}))


@dataclasses.dataclass(frozen=True)
class MergeVariant(ElementwiseGeometry):
    """One compiled module: the family for one dtype and load batch (``ops.kernels.load`` needs
    name, family, defines, block and dynamic_smem). ``batch``: states whose loads a thread issues
    together (MERGE_BATCH): 2 for K <= 2, else 4 (``batch_for``)."""

    THREADS: ClassVar[int] = THREADS
    family: KernelFamily
    dtype: str
    batch: int = 4

    @property
    def name(self) -> str:
        return f"merge_state_{self.dtype}_b{self.batch}"

    @property
    def defines(self) -> dict:
        return {"MERGE_DT": _DT_CODE[self.dtype], "MERGE_BATCH": self.batch}



# States per batch of loads. Measured on the H200 (stacked fp16 [16384, K, 32, 128], CuPy copy 4.0 TB/s):
# K = 2: batch 2 3.24 TB/s, batch 4 2.96 (its registers leave fewer threads resident); K = 3: batch 4
# 3.58, batch 2 2.82; K = 4: batch 4 4.00, batch 2 3.24; K = 8, 16: batch 4 4.0-4.25 (batch 8 no faster).
BATCHES = (2, 4)


def batch_for(num_states: int) -> int:
    return 2 if num_states <= 2 else 4


def variant_for(dtype: str, num_states: int = 2) -> MergeVariant:
    return MergeVariant(FAMILY, dtype, batch_for(num_states))


def variants_for_arch(arch: str) -> list[MergeVariant]:
    """Every module ``python -m gqadrv compile --arch ARCH`` builds for this family."""
    if arch not in FAMILY.arches:
        return []
    return [MergeVariant(FAMILY, dt, b) for dt in SUPPORTED_DTYPES for b in BATCHES]


def check_cc(cc: tuple[int, int]) -> None:
    if cc[0] < 8:
        raise RuntimeError(f"merge_state needs compute capability 8.0 or newer; this GPU has {cc[0]}.{cc[1]}")


def route(dtype: str, num_states: int, device: int) -> tuple[MergeVariant, Loaded]:
    check_cc(_drv.device_info(device).cc)
    v = variant_for(dtype, num_states)
    return v, load(v, device)


# ----------------------------------------------------------------------------- contract
@dataclasses.dataclass(frozen=True)
class MergeProblem:
    """What the launch needs. ``form``: "list" (one view per state; merge_state is a list of two) or
    "stacked" (one view of [N, K, H, D])."""

    form: str
    dtype: str
    device: int
    num_states: int
    rows: int
    heads: int
    head_dim: int
    v: tuple[TensorView, ...]
    s: tuple[TensorView, ...]
    out: TensorView | None
    out_lse: TensorView | None
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]

    @property
    def chunks(self) -> int:
        return self.head_dim * _tensors.DTYPE_BYTES[self.dtype] // 16

    @property
    def items(self) -> int:
        return self.rows * self.chunks


_shape = _oc.shape_str


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def check_head_dim(d: int, name: str) -> None:
    if d % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim (last dimension) must be a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {d}")




def _check_v(vv: TensorView, ref: TensorView | None) -> None:
    """One v array: dtype, contiguity, device, element alignment, grad (and shape / dtype of ``ref``)."""
    if ref is None:
        _oc.require_dtype(vv, SUPPORTED_DTYPES)
    else:
        if vv.shape != ref.shape:
            raise ValueError(f"{vv.name} must have the shape of {ref.name} {_shape(ref)}, got {_shape(vv)}")
        _oc.require_dtype(vv, SUPPORTED_DTYPES, like=ref)
        _oc.require_same_device(vv, ref)
    _oc.require_contiguous_or_empty(vv)
    _oc.require_aligned(vv, vv.itemsize)
    _oc.require_no_grad(vv)


def _check_s(sv: TensorView, vv: TensorView, shape: tuple[int, ...], what: str) -> None:
    if sv.dtype != "float32":
        raise TypeError(f"{sv.name} must have dtype float32 (the natural-log LSE), got {sv.dtype}")
    if tuple(sv.shape) != tuple(shape):
        raise ValueError(f"{sv.name} must have shape {_fmt(shape)} ({what}), got {_shape(sv)}")
    _oc.require_contiguous_or_empty(sv)
    _oc.require_same_device(sv, vv)
    _oc.require_aligned(sv, 4)
    _oc.require_no_grad(sv)


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _check_outputs(out: Any, out_lse: Any, ref: TensorView, out_shape: tuple[int, ...], lse_shape: tuple[int, ...],
                   inputs: tuple[TensorView, ...], stream: int | None,
                   names: tuple[str, str] = ("out", "out_lse")) -> tuple[TensorView | None, TensorView | None]:
    ov = lv = None
    if out is not None:
        ov = _oc.view_without_grad(out, names[0], stream)
        _oc.require_output(ov, ref, inputs, shape=out_shape, align=ov.itemsize)
    if out_lse is not None:
        lv = _oc.view_without_grad(out_lse, names[1], stream)
        _oc.require_output(lv, ref, inputs + ((ov,) if ov is not None else ()), shape=lse_shape, align=4,
                           dtype="float32")
    return ov, lv


def check_list_counts(k: int, k_s: int) -> None:
    """The list form's state count: 1 <= K <= MAX_LIST_STATES, as many LSE arrays as v arrays."""
    if k < 1:
        raise ValueError("merge_states needs at least one state; got an empty list")
    if k_s != k:
        raise ValueError(f"v and s must list the same number of states; got {k} v arrays and {k_s} s arrays")
    if k > MAX_LIST_STATES:
        raise ValueError(f"the list form merges at most {MAX_LIST_STATES} states in one launch, got {k}; stack "
                         "them into v [N, K, H, D] / s [N, K, H] arrays (any K), or merge in groups")


def _check_items(rows: int, d: int, dtype: str, name: str) -> None:
    items = rows * (d * _tensors.DTYPE_BYTES[dtype] // 16)
    if items > MAX_ITEMS:
        raise ValueError(f"{name} is too large for one merge launch: {rows} rows of {d} elements make {items} "
                         f"16-byte chunks (at most {MAX_ITEMS}); merge it in parts")


def validate_list(vs: Sequence[Any], ss: Sequence[Any], out: Any, out_lse: Any, *, stream: int | None,
                  names: Sequence[tuple[str, str]] | None = None) -> MergeProblem:
    """K = len(vs) states v_i [..., H, D] with LSEs s_i [..., H] (the list form of ``merge_states``
    and, with two states, ``merge_state``). ``names``: (v name, s name) per state for messages."""
    k = len(vs)
    if names is None:
        names = [(f"v[{i}]", f"s[{i}]") for i in range(k)]
    check_list_counts(k, len(ss))
    views_v: list[TensorView] = []
    views_s: list[TensorView] = []
    ref: TensorView | None = None
    for i in range(k):
        vv = _oc.view_without_grad(vs[i], names[i][0], stream)
        if ref is None:
            if vv.ndim < 2:
                raise ValueError(f"{vv.name} must have shape [..., H, D] (at least 2 dimensions), got {_shape(vv)}")
            _check_v(vv, None)
            check_head_dim(vv.shape[-1], vv.name)
            ref = vv
        else:
            _check_v(vv, ref)
        sv = _oc.view_without_grad(ss[i], names[i][1], stream)
        _check_s(sv, vv, tuple(vv.shape[:-1]), f"the shape of {vv.name} without its last dimension")
        views_v.append(vv)
        views_s.append(sv)
    assert ref is not None
    shape = tuple(int(d) for d in ref.shape)
    rows = _prod(shape[:-1])
    _check_items(rows, shape[-1], ref.dtype, ref.name)
    ov, lv = _check_outputs(out, out_lse, ref, shape, shape[:-1], tuple(views_v) + tuple(views_s), stream)
    return MergeProblem("list", ref.dtype, ref.device, k, rows, shape[-2], shape[-1], tuple(views_v),
                        tuple(views_s), ov, lv, shape, shape[:-1])


def validate_pair(v_a: Any, s_a: Any, v_b: Any, s_b: Any, out: Any, out_lse: Any, *,
                  stream: int | None) -> MergeProblem:
    """``merge_state``'s two states: v_a, v_b [..., H, D] of one shape and dtype, s_a, s_b fp32 [..., H]."""
    return validate_list((v_a, v_b), (s_a, s_b), out, out_lse, stream=stream,
                         names=(("v_a", "s_a"), ("v_b", "s_b")))


def validate_stacked(v: Any, s: Any, out: Any, out_lse: Any, *, stream: int | None) -> MergeProblem:
    """FlashInfer's stacked layout: v [N, K, H, D], s fp32 [N, K, H] (state index in dim 1)."""
    vv = _oc.view_without_grad(v, "v", stream)
    if vv.ndim != 4:
        raise ValueError(f"v must have shape [N, K, H, D] (K states stacked in dim 1) or be a list of arrays "
                         f"[..., H, D]; got {_shape(vv)}")
    n, k, h, d = (int(x) for x in vv.shape)
    if k < 1:
        raise ValueError(f"v must hold at least one state (K = dim 1 >= 1); got {_shape(vv)}")
    _check_v(vv, None)
    check_head_dim(d, "v")
    sv = _oc.view_without_grad(s, "s", stream)
    _check_s(sv, vv, (n, k, h), "[N, K, H]: v's shape without its last dimension")
    rows = n * h
    _check_items(rows, d, vv.dtype, "v")
    ov, lv = _check_outputs(out, out_lse, vv, (n, h, d), (n, h), (vv, sv), stream)
    return MergeProblem("stacked", vv.dtype, vv.device, k, rows, h, d, (vv,), (sv,), ov, lv, (n, h, d), (n, h))


# ----------------------------------------------------------------------------- launch
def args_fields(problem: MergeProblem, out_ptr: int, lse_ptr: int) -> tuple[dict, bytes]:
    """The ``MergeArgs`` fields (by name) and the ``MergeTable`` bytes of a launch."""
    h, d, k = problem.heads, problem.head_dim, problem.num_states
    v_ptrs = [v.ptr for v in problem.v]
    s_ptrs = [s.ptr for s in problem.s]
    if problem.form == "stacked":
        flags = 0
        strides = {"v_state_stride": h * d, "s_state_stride": h, "v_outer_stride": k * h * d,
                   "s_outer_stride": k * h}
    else:
        flags = MERGE_FLAG_TABLE
        strides = {"v_state_stride": 0, "s_state_stride": 0, "v_outer_stride": h * d, "s_outer_stride": h}
    if all(p % 16 == 0 for p in v_ptrs) and out_ptr % 16 == 0:
        flags |= MERGE_FLAG_VEC16
    fields = dict(out=out_ptr, out_lse=lse_ptr, rows=problem.rows, heads=max(h, 1), head_dim=d,
                  chunks=problem.chunks, num_states=k, flags=flags, **strides)
    return fields, pack_table(v_ptrs, s_ptrs)


def launch_geometry(problem: MergeProblem) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, dynamic smem): one thread per (row, 16-byte chunk)."""
    return (-(-problem.items // THREADS), 1, 1), (THREADS, 1, 1), 0


def _run(problem: MergeProblem, like: Any, out: Any, out_lse: Any, s: int, facts: tuple | None = None) -> tuple[Any, Any]:
    """Allocate the outputs the caller did not give (ops.outputs: torch's allocator for torch inputs
    on torch's current stream, else CuPy on ``s``), launch, hand them back in like's framework.
    ``facts`` (the call's layout key, gqa/merge_layouts.py): the launch gets a plan of its own, kept
    under that key."""
    dev = problem.device
    o_new = _outputs.allocate(like, problem.out_shape, problem.dtype, dev, s) if problem.out is None else None
    l_new = _outputs.allocate(like, problem.lse_shape, "float32", dev, s) if problem.out_lse is None else None
    o_ptr = problem.out.ptr if o_new is None else o_new.ptr
    l_ptr = problem.out_lse.ptr if l_new is None else l_new.ptr
    if problem.rows > 0:
        _variant, loaded = route(problem.dtype, problem.num_states, problem.device)
        fields, table = args_fields(problem, o_ptr, l_ptr)
        grid, block, smem = launch_geometry(problem)
        if facts is None:
            launch_packed(loaded.kernel, grid, block, smem, SIGNATURE, s, (fields, table), problem.device)
        else:
            plan = LaunchPlan(loaded.kernel, grid, block, smem, ArgPack(SIGNATURE).pack(fields, table), stream=s,
                              pdl=True)
            launch_plans((plan,), dev)
            ptrs = (*(v.ptr for v in problem.v), *(x.ptr for x in problem.s), o_ptr, l_ptr)
            _merge_layouts.remember(facts, problem, plan, (0, 8 * MAX_LIST_STATES),
                                    bool(fields["flags"] & MERGE_FLAG_VEC16), ptrs)
    o = out if o_new is None else _outputs.hand_back(o_new, like, s, dev)
    lo = out_lse if l_new is None else _outputs.hand_back(l_new, like, s, dev)
    return o, lo



# ----------------------------------------------------------------------------- public API
def merge_state(v_a: ArrayT, s_a: DLPackArray, v_b: DLPackArray, s_b: DLPackArray, *, out: OutT | None = None,
                out_lse: LseT | None = None,
                stream: StreamLike | None = None) -> tuple[OutT | ArrayT, LseT | ArrayT]:
    """Merge two partial attention states over disjoint key sets into the state of their union.

    ``v_a``, ``v_b``: [..., H, D] (any leading dimensions, e.g. [N, H, D] or [B, s_q, H, D]), one shape
    and dtype (float16, bfloat16 or float32), contiguous; D a multiple of 8 in [8, 1024].
    ``s_a``, ``s_b``: float32 [..., H] (v's shape without D), the natural-log LSEs; +inf or -inf
    marks a state without keys (weight 0; its v is never read into the result).
    Returns ``(v, s)``: v of v_a's shape and dtype, s float32 [..., H] with
    ``m = max finite s_i, w_i = exp(s_i - m), v = sum w_i v_i / sum w_i, s = m + log(sum w_i)``;
    both empty: v = 0, s = +inf. NaN in a non-empty state propagates. fp32 accumulation, fixed
    order: bitwise reproducible.

    ``out`` / ``out_lse``: preallocated outputs (checked: shape, dtype, device, contiguity, writable,
    no overlap with the inputs or each other), returned as given; missing ones are allocated and
    returned in v_a's framework (CuPy, torch, JAX; other producers get CuPy arrays).
    Asynchronous on ``stream`` (default: torch's current stream for torch tensors, else CuPy's
    current stream); every input's producer is ordered before the launch. With ``out`` and
    ``out_lse`` given the call allocates nothing, never synchronises and reads no device data on the
    host, so it can be captured into a CUDA graph (after one call outside capture has loaded the
    kernel).
    """
    facts = _merge_layouts.call_facts("pair", (v_a, v_b), (s_a, s_b), out, out_lse, stream)
    r = _from_layout(facts, v_a, (v_a, s_a, v_b, s_b, out, out_lse), out, out_lse)
    if r is not None:
        return r
    s, dl = launch_streams(v_a, (v_a, s_a, v_b, s_b, out, out_lse), stream)
    problem = validate_pair(v_a, s_a, v_b, s_b, out, out_lse, stream=dl)
    return _run(problem, v_a, out, out_lse, s, facts)


def _from_layout(facts: tuple | None, like: Any, tensors: tuple, out: Any, out_lse: Any) -> tuple[Any, Any] | None:
    """The result of a call served by its layout's plan (gqa/merge_layouts.py), or None."""
    if facts is None:
        return None
    e = _merge_layouts.layouts.get(facts[0])
    if e is None:
        return None
    r = _merge_layouts.launch_layout(e, facts, like, tensors, out, out_lse)
    return None if r is _merge_layouts.MISS else r


def merge_states(v: ArrayT | Sequence[ArrayT], s: DLPackArray | Sequence[DLPackArray], *, out: OutT | None = None,
                 out_lse: LseT | None = None,
                 stream: StreamLike | None = None) -> tuple[OutT | ArrayT, LseT | ArrayT]:
    """Merge K >= 1 partial attention states (see ``merge_state`` for the semantics), in one launch.

    Two forms:

    * stacked (FlashInfer's ``merge_states`` layout): ``v`` [N, K, H, D], ``s`` float32 [N, K, H], the
      state index in dim 1; any K >= 1. Returns v [N, H, D], s [N, H].
    * a list (or tuple) of K arrays ``v_i`` [..., H, D] (one shape and dtype) with a list of K
      float32 ``s_i`` [..., H]; 1 <= K <= 64 (the state pointers travel by value in the kernel's
      parameter block). Returns v [..., H, D], s [..., H].

    dtype float16, bfloat16 or float32; D a multiple of 8 in [8, 1024]; inputs contiguous and on one
    device. ``out`` / ``out_lse``, the stream, framework hand-back and CUDA-graph capture as in
    ``merge_state``. States are combined in index order (bitwise reproducible).
    """
    listed = isinstance(v, (list, tuple))
    if listed != isinstance(s, (list, tuple)):
        raise TypeError("v and s must both be arrays (stacked form: v [N, K, H, D], s [N, K, H]) or both be lists "
                        f"of arrays (one per state); got v: {type(v).__name__}, s: {type(s).__name__}")
    if listed:
        vs, ss = list(v), list(s)
        check_list_counts(len(vs), len(ss))  # before the GPU is looked for
        facts = _merge_layouts.call_facts("list", tuple(vs), tuple(ss), out, out_lse, stream)
        r = _from_layout(facts, vs[0], (*vs, *ss, out, out_lse), out, out_lse)
        if r is not None:
            return r
        st, dl = launch_streams(vs[0], (*vs, *ss, out, out_lse), stream)
        problem = validate_list(vs, ss, out, out_lse, stream=dl)
        return _run(problem, vs[0], out, out_lse, st, facts)
    facts = _merge_layouts.call_facts("stacked", (v,), (s,), out, out_lse, stream)
    r = _from_layout(facts, v, (v, s, out, out_lse), out, out_lse)
    if r is not None:
        return r
    st, dl = launch_streams(v, (v, s, out, out_lse), stream)
    problem = validate_stacked(v, s, out, out_lse, stream=dl)
    return _run(problem, v, out, out_lse, st, facts)


# ----------------------------------------------------------------------------- CLI record
def _describe(cc: tuple[int, int]) -> str:
    check_cc(cc)
    return (f"LSE state merge: kernel family {FAMILY.name!r} (float16 / bfloat16 / float32, D % 8 == 0 up to "
            f"{MAX_HEAD_DIM}; stacked K any, list K <= {MAX_LIST_STATES})")


def _oracle_case(rng: Any, rows: int, d: int, k: int, n_keys: int) -> tuple[list, list, Any, Any]:
    """Partial states of random attention rows over k contiguous key ranges (some may be empty), and
    the float64 attention over all keys."""
    import numpy as np

    from ..ops import oracle

    scores = rng.standard_normal((rows, n_keys)) * 2.0
    vals = rng.standard_normal((rows, n_keys, d))
    cuts = np.sort(rng.integers(0, n_keys + 1, size=k - 1))
    bounds = [0, *cuts.tolist(), n_keys]
    vs, ss = [], []
    for a, b in itertools.pairwise(bounds):
        vi, si = oracle.attend(scores[:, a:b], True, vals[:, a:b])
        vs.append(vi)
        ss.append(si)
    ref_v, ref_s = oracle.attend(scores, True, vals)
    return vs, ss, ref_v, ref_s


def _selftest(rng: Any, gpu: bool) -> list:
    import numpy as np

    from ..ops import oracle

    vs, ss, ref_v, ref_s = _oracle_case(rng, 6, 16, 4, 20)
    mv, ms = oracle.merge_states(vs, ss)
    err = float(max(np.max(np.abs(mv - ref_v)), np.max(np.abs(ms - ref_s))))
    cases = [("merge_state oracle: merged parts = attention over the union", err, err < 1e-12)]
    if not gpu:
        return cases
    import cupy as cp

    for dtype, tol in (("float16", 4e-3), ("float32", 1e-5)):
        vs, ss, ref_v, ref_s = _oracle_case(rng, 40, 128, 3, 50)
        # rows = (n, h) with N 8, H 5; stacked layout [N, K, H, D]
        dv = cp.asarray(np.stack(vs, axis=1).reshape(8, 5, 3, 128).transpose(0, 2, 1, 3).astype(dtype))
        ds = cp.asarray(np.stack(ss, axis=1).reshape(8, 5, 3).transpose(0, 2, 1).astype(np.float32))
        got_v, got_s = merge_states(dv, ds)
        gv = cp.asnumpy(got_v).astype(np.float64).reshape(40, 128)
        gs = cp.asnumpy(got_s).astype(np.float64).reshape(40)
        err = float(max(np.max(np.abs(gv - ref_v)), np.max(np.abs(gs - ref_s))))
        ok = bool(np.all(np.abs(gv - ref_v) <= tol + tol * np.abs(ref_v))
                  and np.all(np.abs(gs - ref_s) <= 1e-5 + 1e-5 * np.abs(ref_s)))
        cases.append((f"merge_states {dtype} N8 K3 H5 D128", err, ok))
    return cases


OP = OpRecord(name="merge_state", variants_for_arch=variants_for_arch, describe=_describe, selftest=_selftest)
