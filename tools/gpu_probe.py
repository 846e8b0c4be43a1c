"""Small GPU-side probes used while developing (one process, prints facts):
1) does NVRTC print the ptxas report for a module it already compiled in this process (driver JIT cache)?
2) where does the convenience call spend its host time (cProfile)?"""

import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    import cupy as cp

    import gqadrv
    from gqadrv.runtime.cache import CubinCache
    from gqadrv.runtime.compiler import compile_module

    d = dict(GQA_DT=0, GQA_D=64, GQA_ROWS=8, GQA_WARPS=4, GQA_TOK=16, GQA_LABEL_PROBE=os.getpid())
    cp.zeros(1)  # initialise the driver first
    for i in range(2):
        m = compile_module("sm90/gqa_decode_short.cu", "sm_90a", d, cache=CubinCache(None, False))
        print(f"probe compile {i}: resources={list(m.resources)} log_has_ptxas={'Compiling entry' in m.log}", flush=True)
    print("ComputeCache:", os.path.exists(os.path.expanduser("~/.nv/ComputeCache")), "CUDA_CACHE_DISABLE=",
          os.environ.get("CUDA_CACHE_DISABLE"))
    q = cp.random.standard_normal((1, 32, 128), dtype=cp.float32).astype(cp.float16)
    kv = cp.random.standard_normal((1, 2, 8, 1024, 128), dtype=cp.float32).astype(cp.float16)
    lens = cp.asarray([1024], cp.int32)
    s = cp.cuda.Stream(non_blocking=True)
    for _ in range(50):
        gqadrv.gqa_decode(q, kv, lens, stream=s)
    s.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        gqadrv.gqa_decode(q, kv, lens, stream=s)
    pr.disable()
    s.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
