"""A small sparse-prefill workload for Nsight Compute: three prepared launches of
``flash_mla_sparse_fwd`` (bf16 q and kv, indices = 64 random permutations of [0, s_kv) cut to topk and
repeated over s_q, as in ``bench --op mla_sparse_prefill``), so --launch-skip / --launch-count pick a
warm launch of the dense kernel (the prefill's main launch: mla_dense_decode_seesaw for the cp.async
builds).

    ncu --clock-control none -k regex:mla_dense_decode_seesaw --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight ... python benchmarks/ncu_prefill_target.py 1024,64,512,512,8192
Arguments: 's_q,h_q,d_qk,topk,s_kv[,backend[,sink]]' (sink: 1 for an N(0, 1) attn_sink; backend
'flashmla': FlashMLA's kernel on data of the same shapes, needs torch and a built flash_mla); default
1024,64,512,512,8192."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv):
    import cupy as cp
    import ml_dtypes

    import gqadrv
    from gqadrv.mla.bench_sparse_prefill import _indices

    for text in argv or ["1024,64,512,512,8192"]:
        parts = text.split(",")
        s_q, h_q, d_qk, topk, s_kv = (int(x) for x in parts[:5])
        backend = parts[5] if len(parts) > 5 and parts[5] else None
        sink_on = len(parts) > 6 and parts[6] == "1"
        if backend == "flashmla":  # the peer on the same data (torch + a built flash_mla on PYTHONPATH)
            flashmla_launches(s_q, h_q, d_qk, topk, s_kv, sink_on)
            print(text, "flash_mla", flush=True)
            continue
        rs = cp.random.RandomState(7)
        kv = (rs.standard_normal((s_kv, 1, d_qk), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
        q = (rs.standard_normal((s_q, h_q, d_qk), dtype=cp.float32) / 10).astype(ml_dtypes.bfloat16)
        idx = _indices(cp, rs, s_q, topk, s_kv)
        sink = rs.standard_normal((h_q,), dtype=cp.float32) if sink_on else None
        kw = {"attn_sink": sink} if sink_on else {}
        if backend:
            kw["backend"] = backend
        p = gqadrv.prepare_mla_sparse_fwd(q, kv, idx, d_qk ** -0.5, 512, **kw)
        for _ in range(3):
            gqadrv.launch_prepared(p)
        cp.cuda.Device().synchronize()
        print(text, p.route, flush=True)


def flashmla_launches(s_q, h_q, d_qk, topk, s_kv, sink_on):
    """Three launches of FlashMLA's flash_mla_sparse_fwd on data of the same shapes (its kernel names
    differ: pick them with e.g. -k regex:sparse)."""
    import torch
    import flash_mla

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(s_q, h_q, d_qk, dtype=torch.bfloat16, device=dev, generator=g) / 10
    kv = torch.randn(s_kv, 1, d_qk, dtype=torch.bfloat16, device=dev, generator=g) / 10
    perms = torch.stack([torch.randperm(s_kv, device=dev, generator=g)[:topk] for _ in range(min(64, s_q))])
    idx = perms.repeat(-(-s_q // perms.shape[0]), 1)[:s_q].view(s_q, 1, topk).to(torch.int32).contiguous()
    sink = torch.randn(h_q, dtype=torch.float32, device=dev, generator=g) if sink_on else None
    kw = {"attn_sink": sink} if sink_on else {}
    for _ in range(3):
        flash_mla.flash_mla_sparse_fwd(q, kv, idx, d_qk ** -0.5, 512, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
