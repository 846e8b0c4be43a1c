"""Negative control of tests/typing_usage.py: every line marked ``# E: <code>`` is a misuse that
``mypy --strict`` must report with that error code, and nothing else may be reported (checked by
tests/test_typing.py). Never run."""

from __future__ import annotations

from typing import Any

import numpy as np

from gqadrv import (
    check_status,
    flash_mla_with_kvcache,
    gqa_decode,
    gqa_decode_paged,
    launch_prepared,
    merge_state,
    merge_states,
    prepare_gqa_decode,
    prepare_mla_decode,
    quantize_k_cache,
    quantize_kv_fp8,
)


class Array:
    def __dlpack__(self, *, stream: Any | None = None) -> Any:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[int, int]:
        raise NotImplementedError


class Other(Array):
    pass


def misuse(q: Array, lens: Array, o: Other, name: str) -> None:
    gqa_decode(q, q, lens, backend=123)  # E: call-overload
    gqa_decode(q, q, lens, backend="cuda")  # E: call-overload
    gqa_decode(q, q, lens, backend=name)  # E: call-overload
    gqa_decode(q, q, lens, stream="0")  # E: call-overload
    gqa_decode(q, q, lens, stream=1.5)  # E: call-overload
    gqa_decode([1.0], q, lens)  # E: call-overload
    gqa_decode(q, q, lens, q_scale="2")  # E: call-overload
    gqa_decode(q, q, lens, sm_scale="0.1")  # E: call-overload
    prepare_gqa_decode(Q=q, KV=q, O=o, sequence_lengths=lens, sm_scale="0.1")  # E: call-overload
    wrong: Other = gqa_decode(q, q, lens)  # E: assignment
    right: Other = gqa_decode(q, q, lens, out=o)
    prepare_gqa_decode(Q=q, KV=q, sequence_lengths=lens)  # E: call-overload
    prepare_gqa_decode({"Q": q}, Q=q)  # E: call-overload
    prepare_gqa_decode(Q=q, KV=q, O=o, sequence_lengths=lens, num_splits="4")  # E: call-overload
    launch_prepared(q)  # E: arg-type
    p = prepare_gqa_decode(Q=q, KV=q, O=o, sequence_lengths=lens)
    launch_prepared(p, stream="default")  # E: arg-type
    check_status(p)["empty"].append("x")  # E: arg-type
    flash_mla_with_kvcache(q, q, lens, lens, backend="hopper")  # E: arg-type
    flash_mla_with_kvcache(q, q, lens, lens, num_splits=1.5)  # E: arg-type
    flash_mla_with_kvcache(q, q, lens, lens, tile_scheduler_metadata=object())  # E: arg-type
    prepare_mla_decode(q, q, lens, lens, softmax_scale="0.1")  # E: arg-type
    prepare_mla_decode(np.float32(1.0), q, lens, lens)  # E: type-var
    merge_state(q, lens, q)  # E: call-arg
    merge_states([q], [lens], stream="side")  # E: arg-type
    merged: Other = merge_states(q, lens)[0]  # E: assignment
    quantize_k_cache(q, stream="side")  # E: arg-type
    quantize_kv_fp8(q, "0.5")  # E: call-overload
    quantize_kv_fp8(q, 0.5, head_axis=1)  # E: call-overload
    gqa_decode_paged(q, q, None, lens, lens, kv_layout=3)  # E: call-overload
    del wrong, right, merged
