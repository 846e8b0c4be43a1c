"""The e4m3 conversions of kernels/common/fp8.cuh on the GPU: the path the quantizers use on this
device (cvt.rn.satfinite.e4m3x2.f32 on sm_89+) against the software path (e4m3_from_f32_soft, the
only one on sm_80 / sm_86) for every one of the 2^32 fp32 bit patterns, both paths against the host
model (gqadrv.ops.fp8) on random patterns and special values, and the decoders for all 256 codes.
The test kernels are compiled from a copy of the two headers in a temporary kernels root."""

import shutil

import numpy as np
import pytest

from gqadrv.ops import fp8

pytestmark = pytest.mark.gpu

CHECK_SOURCE = r"""
#include "../common/fp8.cuh"

// Every bit pattern u in [start, start + count): the compiled path (both lanes, opposite signs) must
// equal the software path; mismatches are counted and the smallest one kept.
extern "C" __global__ void e4m3_paths(unsigned long long start, unsigned long long count, unsigned int* bad,
                                      unsigned int* first_bad) {
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const u32 u = (u32)(start + i);
    const float x = __uint_as_float(u), y = __uint_as_float(u ^ 0x80000000u);
    const u32 a = e4m3x2_from_f32(x, y);
    const u32 b = e4m3_from_f32_soft(x) | (e4m3_from_f32_soft(y) << 8);
    if (a != b) {
      atomicAdd(bad, 1u);
      atomicMin(first_bad, u);
    }
  }
}

// codes of n floats (n even)
extern "C" __global__ void e4m3_encode(const float* x, unsigned char* out, unsigned long long n) {
  const unsigned long long i = 2ull * ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) {
    const u32 c = e4m3x2_from_f32(x[i], x[i + 1]);
    out[i] = (unsigned char)c;
    out[i + 1] = (unsigned char)(c >> 8);
  }
}

// 256 words of four different codes each (byte k of word c: WORD_BYTE(c, k)), decoded by the compiled
// path (hw[4c + k]) and by the software decoder (sw[4c + k]): checks values and byte order
#define WORD_BYTE(c, k) (((c) * (2u * (k) + 1u) + 37u * (k)) & 255u)
extern "C" __global__ void e4m3_decode(float* hw, float* sw) {
  const u32 c = threadIdx.x;
  const u32 w = WORD_BYTE(c, 0u) | (WORD_BYTE(c, 1u) << 8) | (WORD_BYTE(c, 2u) << 16) | (WORD_BYTE(c, 3u) << 24);
  float v[4];
  e4m3x4_to_f32(w, v[0], v[1], v[2], v[3]);
  for (int k = 0; k < 4; ++k) {
    hw[4 * c + k] = v[k];
    sw[4 * c + k] = e4m3_to_f32_soft((w >> (8 * k)) & 255u);
  }
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """(default path module, software path module) for this GPU's arch."""
    from gqadrv.runtime.cache import CubinCache
    from gqadrv.runtime.compiler import arch_for_cc, compile_module, kernels_root
    from gqadrv.runtime.driver import device_info
    from gqadrv.runtime.module import load_library

    root = tmp_path_factory.mktemp("fp8root")
    (root / "common").mkdir()
    (root / "check").mkdir()
    for name in ("ptx.cuh", "fp8.cuh"):
        shutil.copy(kernels_root() / "common" / name, root / "common" / name)
    (root / "check" / "e4m3_check.cu").write_text(CHECK_SOURCE)
    cache = CubinCache(tmp_path_factory.mktemp("fp8cubins"))
    arch = arch_for_cc(device_info(0).cc)
    hw = compile_module("check/e4m3_check.cu", arch, {}, root=root, cache=cache)
    sw = compile_module("check/e4m3_check.cu", arch, {}, root=root, cache=cache,
                        extra_options=("-DGQADRV_FP8_SOFTWARE=1",))
    assert "e4m3x2" not in sw.ptx.decode()
    if device_info(0).cc >= (8, 9):
        assert "cvt.rn.satfinite.e4m3x2.f32" in hw.ptx.decode()
    return load_library(hw.cubin, "fp8_check_hw"), load_library(sw.cubin, "fp8_check_sw")


def _launch(lib, name, grid, block, sig, *values):
    import cupy as cp

    from gqadrv.runtime.module import ArgPack, LaunchPlan

    k = lib.kernel(name, 0)
    s = cp.cuda.get_current_stream()
    LaunchPlan(k, (grid, 1, 1), (block, 1, 1), 0, ArgPack(sig).pack(*values), stream=int(s.ptr)).launch()
    s.synchronize()


def test_hardware_and_software_paths_agree_on_every_fp32(modules, report):
    import cupy as cp

    from gqadrv.runtime.driver import device_info
    from gqadrv.runtime.module import PTR, Signature

    hw, _ = modules
    bad = cp.zeros(1, cp.uint32)
    first = cp.full(1, 0xFFFFFFFF, cp.uint32)
    sig = Signature(("start", PTR), ("count", PTR), ("bad", PTR), ("first", PTR))
    grid = device_info(0).sm_count * 8
    _launch(hw, "e4m3_paths", grid, 256, sig, 0, 2**32, int(bad.data.ptr), int(first.data.ptr))
    n_bad, f = int(bad.get()[0]), int(first.get()[0])
    report(f"e4m3 paths: {n_bad} of 2^32 fp32 patterns differ between the compiled and the software path")
    assert n_bad == 0, f"{n_bad} mismatches, first at bits 0x{f:08x}"


def _specials() -> np.ndarray:
    f = np.float32
    v = [0.0, -0.0, 448, -448, 449, 464, 465, 480, 1e30, -1e30, np.inf, -np.inf, np.nan, -np.nan, 2**-6, 2**-9,
         2**-10, 3 * 2**-11, 1e-40, -1e-40, 3.4e38]
    vals = fp8.e4m3_to_f32(np.arange(256, dtype=np.uint8))
    mids = (vals[:126].astype(np.float64) + vals[1:127]) / 2
    x = np.concatenate([np.array(v, f), vals, mids.astype(f), np.nextafter(mids.astype(f), f(np.inf)),
                        np.nextafter(mids.astype(f), f(-np.inf)), -mids.astype(f),
                        np.uint32([0x7F800001, 0xFFC00000, 0x7FFFFFFF]).view(f)])
    return x[: len(x) // 2 * 2]


@pytest.mark.parametrize("path", ["compiled", "software"])
def test_encoders_match_the_host_model(modules, path):
    import cupy as cp

    from gqadrv.runtime.module import PTR, Signature

    lib = modules[0] if path == "compiled" else modules[1]
    rng = np.random.default_rng(11)
    x = np.concatenate([_specials(), rng.integers(0, 2**32, size=1 << 22, dtype=np.uint64).astype(np.uint32)
                        .view(np.float32), (rng.standard_normal(1 << 20) * 300).astype(np.float32)])
    dx = cp.asarray(x)
    out = cp.zeros(x.size, cp.uint8)
    sig = Signature(("x", PTR), ("out", PTR), ("n", PTR))
    _launch(lib, "e4m3_encode", -(-x.size // 512), 256, sig, int(dx.data.ptr), int(out.data.ptr), x.size)
    got = out.get()
    want = fp8.e4m3_from_f32(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), int(got[i]), int(want[i])) for i in bad[:8]]


def test_decoders_are_exact(modules):
    import cupy as cp

    from gqadrv.runtime.module import PTR, Signature

    c = np.arange(256, dtype=np.uint32)[:, None]
    k = np.arange(4, dtype=np.uint32)[None, :]
    codes = ((c * (2 * k + 1) + 37 * k) & 255).astype(np.uint8).reshape(-1)    # WORD_BYTE of the kernel
    assert len(set(codes.tolist())) == 256
    want = fp8.e4m3_to_f32(codes)
    for lib in modules:
        hw = cp.zeros(1024, cp.float32)
        sw = cp.zeros(1024, cp.float32)
        _launch(lib, "e4m3_decode", 1, 256, Signature(("hw", PTR), ("sw", PTR)), int(hw.data.ptr), int(sw.data.ptr))
        for got in (hw.get(), sw.get()):
            assert np.array_equal(got, want, equal_nan=True)
            fin = ~np.isnan(want)
            assert np.array_equal(np.signbit(got[fin]), np.signbit(want[fin]))
