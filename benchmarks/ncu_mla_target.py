"""A tiny MLA workload for Nsight Compute: three prepared launches of the dense decode on the bf16
cache and on the 656-byte FP8 cache quantized from it (the FP8 kernel runs at half the bf16 speed:
docs/MLA.md), so --launch-skip / --launch-count can pick a warm launch of either.

    ncu --clock-control none -k regex:mla_dense_decode_seesaw_fp8 --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats ... python benchmarks/ncu_mla_target.py 128,64,8192
Arguments: 'b,h_q,L[,fp8_backend]' shapes (page 64, s_q 1; the FP8 launches forced onto fp8_backend,
e.g. narrow16_fp8, when given); default 128,64,8192."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv):
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import gqadrv

    for text in argv or ["128,64,8192"]:
        parts = text.split(",")
        b, h_q, L = (int(x) for x in parts[:3])
        fp8_backend = parts[3] if len(parts) > 3 else None
        page, mb = 64, -(-L // 64)
        rs = cp.random.RandomState(7)
        k = (rs.standard_normal((b * mb, page, 1, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
        q = (rs.standard_normal((b, 1, h_q, 576), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
        bt = cp.arange(b * mb, dtype=cp.int32).reshape(b, mb)
        sl = cp.asarray(np.full(b, L, np.int32))
        for cache, fp8 in ((k, False), (gqadrv.quantize_k_cache(k), True)):
            p = gqadrv.prepare_mla_decode(q, cache, bt, sl, is_fp8_kvcache=fp8, backend=fp8_backend if fp8 else None)
            for _ in range(3):
                gqadrv.launch_prepared(p)
            cp.cuda.Device().synchronize()
            print(text, p.route, p.num_splits, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
