"""Numpy reference of FlashMLA's V3.2 FP8 MLA cache format (656 bytes per token), bit-exact with
the kernels of ``kernels/mla/smxx/fp8_cache.cu`` (``gqadrv.mla.quantize_k_cache`` /
``dequantize_k_cache``).

Layout of one token (h_kv = 1):

    bytes [0, 512)    512 float8_e4m3fn codes: latent channels 0..511
    bytes [512, 528)  4 float32 scales (little endian): scale k for channels [128k, 128k + 128)
    bytes [528, 656)  64 bf16 RoPE channels 512..575, copied bit for bit

Quantization, per token and 128-channel tile (all float32):

    amax = max |x| over the tile's finite values (NaN and +-Inf ignored; 0 for a tile without any)
    s    = amax / 448                             (rounded to nearest)
    s    = 2^ceil(log2(max(s, 1e-4)))             ("ue8m0": a power of two >= 2^-13), stored as fp32
    code = e4m3(x / s)                            (x / s is exact; gqadrv.ops.fp8 rounding: nearest
                                                   even, saturation at +-448, NaN -> 0x7F,
                                                   +-Inf -> +-448)

``2^ceil(log2(.))`` is computed on the bits (``ops.fp8.pow2_ceil``: the exact smallest power of two
>= s), so no logarithm rounding enters. Dequantization: ``bf16(float(code) * s)`` (the float32
product is exact for power-of-two scales; rounded to bf16 to nearest even; any NaN is stored as
0x7FFF). The RoPE channels come back unchanged.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..ops import fp8 as _fp8

__all__ = [
    "BYTES_PER_TOKEN",
    "D_NOPE",
    "D_QK",
    "D_ROPE",
    "ROPE_OFFSET",
    "SCALES_OFFSET",
    "SCALE_FLOOR",
    "TILE",
    "dequantize_k_cache_reference",
    "quantize_k_cache_reference",
    "split_k_cache",
    "tile_scales",
]

D_NOPE = 512             # quantized latent channels
D_ROPE = 64              # bf16 RoPE channels, copied
D_QK = D_NOPE + D_ROPE   # 576
TILE = 128               # channels per scale
NUM_TILES = D_NOPE // TILE
SCALES_OFFSET = D_NOPE                        # 512
ROPE_OFFSET = SCALES_OFFSET + 4 * NUM_TILES   # 528
BYTES_PER_TOKEN = ROPE_OFFSET + 2 * D_ROPE    # 656
SCALE_FLOOR = np.float32(1e-4)                # max(s, 1e-4) before the power-of-two rounding: s >= 2^-13
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16_bits(k: np.ndarray) -> np.ndarray:
    k = np.asarray(k)
    if k.dtype == _BF16:
        return k.view(np.uint16)
    if k.dtype == np.uint16:
        return k
    raise TypeError(f"k must be a bfloat16 (ml_dtypes) or uint16 (bf16 bits) array, got {k.dtype}")


def tile_scales(latent: np.ndarray) -> np.ndarray:
    """The fp32 scales [..., 4] of float32 latent channels [..., 512]."""
    x = np.asarray(latent, dtype=np.float32).reshape(*latent.shape[:-1], NUM_TILES, TILE)
    a = np.abs(x)
    a = np.where(np.isfinite(a), a, np.float32(0.0))
    amax = a.max(axis=-1) if a.size else np.zeros(a.shape[:-1], np.float32)
    s = np.maximum(amax / np.float32(_fp8.E4M3_MAX), SCALE_FLOOR).astype(np.float32)
    return _fp8.pow2_ceil(s)


def quantize_k_cache_reference(k: np.ndarray) -> np.ndarray:
    """bf16 k [..., 576] (ml_dtypes.bfloat16, or uint16 bits) -> uint8 [..., 656]."""
    bits = _bf16_bits(k)
    if bits.shape[-1] != D_QK:
        raise ValueError(f"k must have {D_QK} channels in its last dimension, got shape {bits.shape}")
    lead = bits.shape[:-1]
    x = (bits[..., :D_NOPE].astype(np.uint32) << np.uint32(16)).view(np.float32)
    s = tile_scales(x)
    scaled = (x.reshape(*lead, NUM_TILES, TILE) / s[..., None]).astype(np.float32)  # exact: s is a power of two
    out = np.empty((*lead, BYTES_PER_TOKEN), np.uint8)
    out[..., :D_NOPE] = _fp8.e4m3_from_f32(scaled).reshape(*lead, D_NOPE)
    out[..., SCALES_OFFSET:ROPE_OFFSET] = np.ascontiguousarray(s.astype("<f4")).view(np.uint8).reshape(*lead, 16)
    out[..., ROPE_OFFSET:] = np.ascontiguousarray(bits[..., D_NOPE:].astype("<u2")).view(np.uint8).reshape(*lead, 128)
    return out


def split_k_cache(k_fp8: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [..., 512], scales float32 [..., 4], rope bf16 bits uint16 [..., 64]) of a cache
    [..., 656] (uint8, int8 or float8_e4m3fn)."""
    c = np.asarray(k_fp8)
    if c.dtype != np.uint8:
        c = c.view(np.uint8)
    if c.shape[-1] != BYTES_PER_TOKEN:
        raise ValueError(f"k_fp8 must have {BYTES_PER_TOKEN} bytes per token in its last dimension, got {c.shape}")
    lead = c.shape[:-1]
    codes = c[..., :D_NOPE]
    scales = np.ascontiguousarray(c[..., SCALES_OFFSET:ROPE_OFFSET]).view("<f4").reshape(*lead, NUM_TILES)
    rope = np.ascontiguousarray(c[..., ROPE_OFFSET:]).view("<u2").reshape(*lead, D_ROPE)
    return codes, scales.astype(np.float32), rope.astype(np.uint16)


def dequantize_k_cache_reference(k_fp8: np.ndarray) -> np.ndarray:
    """uint8 [..., 656] -> bf16 [..., 576] (ml_dtypes.bfloat16)."""
    codes, scales, rope = split_k_cache(k_fp8)
    lead = codes.shape[:-1]
    vals = _fp8.e4m3_to_f32(codes).reshape(*lead, NUM_TILES, TILE)
    with np.errstate(invalid="ignore", over="ignore"):
        prod = (vals * scales[..., None]).astype(np.float32).reshape(*lead, D_NOPE)
    out = np.empty((*lead, D_QK), np.uint16)
    out[..., :D_NOPE] = _fp8.bf16_bits(prod)
    out[..., D_NOPE:] = rope
    return out.view(_BF16)
