"""gqadrv on torch tensors (torch is only the caller's framework; gqadrv never imports it):
torch in -> torch out, an explicit out=, bf16, a torch stream, and a torch.cuda.graph capture."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402


def main():
    require_gpu("torch_interop")
    import torch

    import gqadrv

    torch.manual_seed(0)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.float16)
    kv = torch.randn(4, 2, 8, 2048, 128, device="cuda", dtype=torch.float16)
    lengths = torch.tensor([2048, 17, 1000, 1], device="cuda", dtype=torch.int32)
    out = gqadrv.gqa_decode(q, kv, lengths)                  # runs on torch's current stream
    mask = (torch.arange(2048, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), kv[:, 0].float(), kv[:, 1].float(),
                                                           attn_mask=mask, enable_gqa=True)[:, :, 0]
    print(f"torch in -> {type(out).__name__} out, max |err| vs SDPA(fp32) {(out.float() - ref).abs().max().item():.2e}")
    o = torch.empty_like(q)
    prepared = gqadrv.prepare_gqa_decode({"Q": q, "KV": kv, "O": o, "sequence_lengths": lengths})
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        gqadrv.launch_prepared(prepared, stream=torch.cuda.current_stream())
    lengths.copy_(torch.tensor([5, 2048, 64, 65], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    mask = (torch.arange(2048, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), kv[:, 0].float(), kv[:, 1].float(),
                                                           attn_mask=mask, enable_gqa=True)[:, :, 0]
    err = (o.float() - ref).abs().max().item()
    print(f"torch.cuda.graph replay after in-place length update: max |err| {err:.2e}")
    b = gqadrv.gqa_decode(q.bfloat16(), kv.bfloat16(), lengths, stream=torch.cuda.current_stream())
    print(f"bf16: {b.dtype}, max |err| {(b.float() - ref).abs().max().item():.2e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
