"""Host-side mirror of the MLA dense decode kernel (kernels/mla/sm90/dense_decode.cu).

Everything the host needs to build, size and launch the kernel, with no GPU access and no imports
outside the standard library (``gqadrv.runtime`` is imported lazily, only by ``signature()``):

* ``FIELDS`` / ``FORMAT``: the by-value ``MlaDecodeArgs`` struct (kernels/mla/common/args.cuh), in
  order, with explicit padding; ``pack_args(**values)`` gives the tuple for ``ArgPack.pack``.
* ``SOURCE``, ``ENTRY``, ``BLOCK_THREADS``, ``defines(dtype, variant)``, ``dynamic_smem_bytes()``.
* ``launch_geometry(b, s_q, h_q, h_kv, num_splits) -> (grid, block, smem)``.
* ``workspace_sizes(b, s_q, h_q, h_kv, num_splits)`` and ``choose_num_splits(...)``.

Variants: "wgmma" (MLA_MMA=1, sm_90a only) and "mma" (MLA_MMA=0, mma.sync + ldmatrix; compiles for
sm_90a and sm_100a; the 226 KB shared-memory footprint rules out sm_80/sm_120 launches).
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

SOURCE = "mla/sm90/dense_decode.cu"  # relative to the kernels root (compile_module's `source`)
ARGS_HEADER = "mla/common/args.cuh"
ENTRY = "mla_dense_decode"
BLOCK_THREADS = 256
BLOCK_M = 64        # packed query rows (s_q x heads of one KV head) per CTA
BLOCK_N = 64        # tokens per K tile
D_QK = 576
D_V = 512
MAX_SPLITS = 512
PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256
FLAG_CAUSAL = 1
VARIANTS = {"wgmma": 1, "mma": 0}
VARIANT_ARCHES = {"wgmma": ("sm_90a",), "mma": ("sm_90a", "sm_100a")}  # 226 KB of smem: no sm_80/sm_120
DTYPES = {"float16": 0, "bfloat16": 1}

# (field, struct format char) in MlaDecodeArgs order. Q: pointer, q: int64, i: int32, f: float.
FIELDS = (
    ("q", "Q"),
    ("k_cache", "Q"),
    ("block_table", "Q"),
    ("cache_seqlens", "Q"),
    ("out", "Q"),
    ("lse", "Q"),
    ("ws_o", "Q"),
    ("ws_ml", "Q"),
    ("counters", "Q"),
    ("q_stride_b", "q"),
    ("q_stride_s", "q"),
    ("q_stride_h", "q"),
    ("k_stride_block", "q"),
    ("k_stride_tok", "q"),
    ("k_stride_head", "q"),
    ("o_stride_b", "q"),
    ("o_stride_s", "q"),
    ("o_stride_h", "q"),
    ("bt_stride", "q"),
    ("b", "i"),
    ("s_q", "i"),
    ("h_q", "i"),
    ("h_kv", "i"),
    ("group", "i"),
    ("m_rows", "i"),
    ("num_m_blocks", "i"),
    ("page_size", "i"),
    ("page_shift", "i"),
    ("max_blocks", "i"),
    ("num_splits", "i"),
    ("flags", "i"),
    ("scale_log2", "f"),
    ("pad0", "i"),  # explicit padding: struct size is a multiple of 8
)
FORMAT = "<" + "".join(c for _, c in FIELDS)
ARGS_BYTES = struct.calcsize(FORMAT)
assert ARGS_BYTES % 8 == 0, ARGS_BYTES

# Shared-memory map (mirrors the constants in dense_decode.cu, which static_asserts against
# MLA_SMEM_BYTES): Q + 2 K stages (64 x 576 x 2 B each), P (64 x 64 x 2 B), 2 x 512 B exchanges,
# 16 B ticket, plus 1 KB so the kernel can round its base up to a 1024-byte boundary.
_TILE_BYTES = BLOCK_N * D_QK * 2
_SMEM_USED = 3 * _TILE_BYTES + BLOCK_M * BLOCK_N * 2 + 512 + 512 + 16
SMEM_BYTES = _SMEM_USED + 1024  # 231440 (the H100/H200 opt-in limit is 232448)


def dynamic_smem_bytes(defines: dict | None = None) -> int:
    """Dynamic shared memory per CTA (the same for every define combination today)."""
    return SMEM_BYTES


def defines(dtype: str, variant: str = "wgmma") -> dict:
    """Compile-time defines for one module: dtype 'bfloat16'/'bf16' or 'float16'/'fp16'."""
    dt = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if dt not in DTYPES:
        raise ValueError(f"MLA decode supports float16 and bfloat16, got {dtype!r}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown MLA variant {variant!r}; use one of {sorted(VARIANTS)}")
    return {"MLA_DT": DTYPES[dt], "MLA_MMA": VARIANTS[variant], "MLA_SMEM_BYTES": SMEM_BYTES}


def num_m_blocks(s_q: int, h_q: int, h_kv: int) -> int:
    return -(-(s_q * (h_q // h_kv)) // BLOCK_M)


def launch_geometry(b: int, s_q: int, h_q: int, h_kv: int, num_splits: int):
    """((grid_x, grid_y, grid_z), (256, 1, 1), dynamic smem bytes). grid = (nmb * S, h_kv, b)."""
    _check_heads(h_q, h_kv)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if not 1 <= b <= 65535:
        raise ValueError(f"batch {b} out of range for grid.z (1..65535)")
    nmb = num_m_blocks(s_q, h_q, h_kv)
    return (nmb * num_splits, h_kv, b), (BLOCK_THREADS, 1, 1), SMEM_BYTES


def workspace_sizes(b: int, s_q: int, h_q: int, h_kv: int, num_splits: int) -> dict:
    """Bytes of each workspace buffer. ws_o / ws_ml are 0 when num_splits == 1 (unused; pass 0).

    counters must be zeroed once at allocation; the kernel leaves them at zero after every launch.
    """
    nmb = num_m_blocks(s_q, h_q, h_kv)
    units = b * h_kv * nmb
    if num_splits == 1:
        return {"ws_o": 0, "ws_ml": 0, "counters": 4 * units}
    rows = units * num_splits * BLOCK_M
    return {"ws_o": 4 * rows * D_V, "ws_ml": 8 * rows, "counters": 4 * units}


def choose_num_splits(b: int, s_q: int, h_q: int, h_kv: int, capacity_tokens: int, sm_count: int,
                      min_tiles_per_split: int = 4) -> int:
    """Splits per (request, KV head, m-block), from host-known sizes only (never the lengths).

    Enough CTAs to fill the SMs once (1 CTA per SM), each split keeping at least
    ``min_tiles_per_split`` 64-token tiles of the capacity, since the merge of S partials
    (S x 128 KB per m-block, read by one CTA) is not free.
    """
    units = b * h_kv * num_m_blocks(s_q, h_q, h_kv)
    if units >= sm_count:
        return 1
    tiles = max(1, -(-capacity_tokens // BLOCK_N))
    s = -(-sm_count // units)
    s = min(s, max(1, tiles // max(1, min_tiles_per_split)), MAX_SPLITS)
    return max(1, s)


def pack_args(**values) -> tuple:
    """Values in FIELDS order (missing 'pad0' -> 0; unknown or missing fields raise)."""
    values.setdefault("pad0", 0)
    names = [n for n, _ in FIELDS]
    extra = set(values) - set(names)
    if extra:
        raise TypeError(f"unknown MlaDecodeArgs fields: {sorted(extra)}")
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"missing MlaDecodeArgs fields: {missing}")
    out = []
    for n, c in FIELDS:
        v = values[n]
        out.append(float(v) if c == "f" else int(v))
    return tuple(out)


def scale_log2(softmax_scale: float | None) -> float:
    s = D_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    return s * math.log2(math.e)


def page_shift(page_size: int) -> int:
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size must be a power of two in [1, 256], got {page_size}")
    return page_size.bit_length() - 1


def signature():
    """gqadrv.runtime Signature of the kernel: one by-value struct parameter ``args``.

    Uses ``NamedStruct`` where the runtime has it (ArgPack.set_field("args.out", ptr) then works),
    else a plain ``Struct(FORMAT)``; both give the same 208-byte layout (FIELDS has no implicit
    padding), and ``ArgPack.pack(pack_args(...))`` works with either.
    """
    from gqadrv.runtime import module as _m

    named = getattr(_m, "NamedStruct", None)
    kind = named("MlaDecodeArgs", *FIELDS) if named is not None else _m.Struct(FORMAT)
    assert kind.size == ARGS_BYTES and kind.fmt == FORMAT, (kind.size, kind.fmt)
    return _m.Signature(("args", kind))


def _check_heads(h_q: int, h_kv: int) -> None:
    if h_kv < 1 or h_q < 1 or h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a positive multiple of h_kv ({h_kv})")


# ----------------------------------------------------------------------------- self-check
_C_TYPES = {"Q": ("const u16*", "const i32*", "u16*", "float*", "u32*"), "q": ("long long",), "i": ("int",),
            "f": ("float",)}


def check_against_header(kernels_root: str | Path | None = None) -> None:
    """Compare FIELDS with the struct in args.cuh (names, order, C types). Raises AssertionError."""
    root = Path(kernels_root) if kernels_root else Path(__file__).resolve().parents[2] / "kernels"
    text = (root / ARGS_HEADER).read_text()
    body = re.search(r"struct MlaDecodeArgs \{(.*?)\n\};", text, re.S)
    assert body, "struct MlaDecodeArgs not found in args.cuh"
    decl = re.compile(r"^\s*((?:const\s+)?[A-Za-z_][\w ]*?\*?)\s*([A-Za-z_]\w*);", re.M)
    fields = [(m.group(2), " ".join(m.group(1).split())) for m in decl.finditer(body.group(1))]
    assert [f for f, _ in fields] == [n for n, _ in FIELDS], (fields, FIELDS)
    for (name, ctype), (_, c) in zip(fields, FIELDS):
        assert ctype in _C_TYPES[c], f"{name}: C type {ctype!r} does not match format {c!r}"


if __name__ == "__main__":
    check_against_header()
    print(f"MlaDecodeArgs: {len(FIELDS)} fields, {ARGS_BYTES} bytes, FORMAT {FORMAT}; smem {SMEM_BYTES} B")
