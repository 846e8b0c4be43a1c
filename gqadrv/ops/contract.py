"""Contract helpers shared by the op families: each raises the documented error class with a
message that names the tensor, what was expected, what was given and how to fix it.

Error classes: TypeError for dtypes (and arguments of the wrong kind), ValueError for shapes,
devices, contiguity, alignment, aliasing, scales and split counts."""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

from ..runtime.tensors import TensorView, as_view, framework_of, overlaps

__all__ = [
    "F32_MAX",
    "check_choice",
    "check_num_splits",
    "check_positive_scale",
    "require_aligned",
    "require_contiguous",
    "require_contiguous_or_empty",
    "view_without_grad",
    "require_dtype",
    "require_inner_contiguous",
    "require_no_grad",
    "require_no_overlap",
    "require_output",
    "require_same_device",
    "require_writable",
    "scale_view",
    "shape_str",
]

F32_MAX = 3.4028234663852886e38


def shape_str(v: TensorView) -> str:
    return "(" + ", ".join(str(d) for d in v.shape) + ")"


def require_contiguous(v: TensorView) -> None:
    if not v.contiguous:
        raise ValueError(f"{v.name} must be contiguous (row-major); got shape {shape_str(v)} with strides "
                         f"{v.strides} (elements)")


def require_contiguous_or_empty(v: TensorView) -> None:
    """``require_contiguous``, except for a zero-size array (no memory to lay out; any strides)."""
    if v.size:
        require_contiguous(v)


def view_without_grad(obj: Any, name: str, stream: int | None) -> TensorView:
    """``as_view`` (CuPy producers already ordered) after refusing a torch tensor that requires grad:
    gqadrv has no backward pass, and torch would refuse the DLPack export with a less helpful error."""
    if framework_of(obj) == "torch" and getattr(obj, "requires_grad", False):
        raise ValueError(f"{name} requires grad, but gqadrv kernels have no backward pass; pass {name}.detach() "
                         "(inference) or compute gradients with another implementation")
    return as_view(obj, name, stream=stream, cupy_ordered=True)


def scale_view(value: Any, name: str, ref: TensorView, stream: int | None) -> TensorView:
    """A device scale array (the FP8 quantizers' and the e4m3 decoders' ``scale`` / ``k_scale`` /
    ``v_scale``): float32 (TypeError otherwise), on ``ref``'s device, 4-byte aligned, no grad. Its
    shape is the caller's rule."""
    sv = view_without_grad(value, name, stream)
    if sv.dtype != "float32":
        raise TypeError(f"{name} must have dtype float32, got {sv.dtype}")
    require_same_device(sv, ref)
    require_aligned(sv, 4)
    return sv


def require_inner_contiguous(v: TensorView) -> None:
    """The last dimension has stride 1 (other strides are free)."""
    if v.ndim and v.shape[-1] > 1 and v.strides[-1] != 1:
        raise ValueError(f"{v.name} must have a contiguous last dimension (stride 1); got strides {v.strides} "
                         f"(elements) for shape {shape_str(v)}")


def require_same_device(v: TensorView, ref: TensorView) -> None:
    if v.device != ref.device:
        raise ValueError(f"{v.name} is on cuda:{v.device} but {ref.name} is on cuda:{ref.device}; all tensors "
                         "must share one device")


def require_aligned(v: TensorView, n: int = 16) -> None:
    if v.ptr % n:
        raise ValueError(f"{v.name} must start at a {n}-byte aligned address (got 0x{v.ptr:x}); pass a freshly "
                         "allocated tensor, not an offset view")


def require_dtype(v: TensorView, allowed: tuple, like: TensorView | None = None) -> None:
    if like is not None:
        if v.dtype != like.dtype:
            raise TypeError(f"{v.name} must have the dtype of {like.name} ({like.dtype}), got {v.dtype}")
        return
    if v.dtype not in allowed:
        raise TypeError(f"{v.name} must have dtype {' or '.join(allowed)}, got {v.dtype}")


def require_no_overlap(out: TensorView, inputs: tuple) -> None:
    for other in inputs:
        if other is not None and overlaps(out, other):
            raise ValueError(f"{out.name} must not overlap {other.name} in memory (its bytes alias the input)")


def require_output(v: TensorView, ref: TensorView, inputs: tuple, *, shape: tuple[int, ...], align: int,
                   dtype: str | None = None, hint: str = "") -> None:
    """An output the caller gave: ``shape`` (``hint`` says where it comes from), ``dtype`` (None:
    ``ref``'s dtype), contiguous (unless empty), on ``ref``'s device, ``align``-byte aligned, writable, overlapping
    none of ``inputs`` (None entries allowed), not requiring grad."""
    if tuple(v.shape) != tuple(shape):
        raise ValueError(f"{v.name} must have shape ({', '.join(str(d) for d in shape)}){hint}, got {shape_str(v)}")
    if dtype is None:
        require_dtype(v, (), like=ref)
    elif v.dtype != dtype:
        raise TypeError(f"{v.name} must have dtype {dtype}, got {v.dtype}")
    require_contiguous_or_empty(v)
    require_same_device(v, ref)
    require_aligned(v, align)
    require_writable(v)
    require_no_overlap(v, inputs)
    require_no_grad(v)


def require_writable(v: TensorView) -> None:
    """A ``jax.Array`` is immutable and cannot be an output. Other objects of JAX's modules, such
    as the writable output buffers that ``jax.experimental.buffer_callback`` hands to a callback
    (gqadrv.jax), are accepted."""
    if v.framework == "jax" and _is_jax_array(v.obj):
        raise ValueError(f"{v.name} is a JAX array, and JAX arrays are immutable: omit {v.name} and use the "
                         "returned array")


def _is_jax_array(obj: Any) -> bool:
    jax = sys.modules.get("jax")
    array_type = getattr(jax, "Array", None) if jax is not None else None
    return array_type is None or isinstance(obj, array_type)


def require_no_grad(v: TensorView) -> None:
    """gqadrv has no backward pass: a torch tensor that requires grad would silently drop out of
    autograd, so it is refused (pass ``t.detach()``)."""
    if v.framework == "torch" and getattr(v.obj, "requires_grad", False):
        raise ValueError(f"{v.name} requires grad, but gqadrv kernels have no backward pass; pass "
                         f"{v.name}.detach() (inference) or compute gradients with another implementation")


def check_positive_scale(name: str, value: Any, limit: float = F32_MAX) -> float:
    """A real, finite number > 0 that stays finite in the kernels' float32 arithmetic (numpy and
    0-d framework scalars are accepted)."""
    bad = ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if value is None or isinstance(value, (bool, str, bytes, complex)):
        raise bad
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise bad from None
    if not math.isfinite(v) or v <= 0.0:
        raise bad
    if v > limit:
        raise ValueError(f"{name}={value!r} is too large: the kernels compute in float32, which needs {name} <= "
                         f"{limit:.4g}")
    return v


def check_num_splits(num_splits: Any, max_splits: int) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise ValueError(f"num_splits must be None or an int in [1, {max_splits}], got {num_splits!r}")
    n = int(num_splits)
    if not 1 <= n <= max_splits:
        raise ValueError(f"num_splits must be None or an int in [1, {max_splits}], got {n}")
    return n


def check_choice(name: str, value: Any, choices: tuple) -> str | None:
    """None or one of ``choices`` (case-insensitive string)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be None or one of {', '.join(repr(c) for c in choices)}; got "
                        f"{type(value).__name__} {value!r}")
    v = value.strip().lower()
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return v
