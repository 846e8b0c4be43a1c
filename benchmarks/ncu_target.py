"""A tiny workload for Nsight Compute: a few prepared launches per shape.

    ncu --clock-control none -k regex:gqa_decode --launch-skip 2 --launch-count 1 ... \
        python benchmarks/ncu_target.py 1,1024,[1024] 16,4096
(each shape: 3 launches, so --launch-skip/-count can pick the warm one)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv):
    import cupy as cp

    import gqadrv
    from gqadrv.gqa.bench import make_inputs, parse_shape

    for i, text in enumerate(argv or ["1,1024,[1024]"]):
        shape = parse_shape(text)
        q, kv, lens = make_inputs(shape, i)
        o = cp.empty_like(q)
        p = gqadrv.prepare_gqa_decode(Q=q, KV=kv, O=o, sequence_lengths=lens)
        for _ in range(3):
            gqadrv.launch_prepared(p)
        cp.cuda.Device().synchronize()
        print(shape.label, p, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
