"""Bad input on real device arrays: every invalid call raises the documented exception class with a
message naming the problem, before anything is launched (LaunchPlan.launch is counted)."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

B, HQ, HKV, C, D = 2, 32, 8, 256, 128


@pytest.fixture
def launches(monkeypatch):
    from gqadrv.runtime import module

    calls = []
    real = module.LaunchPlan.launch

    def counting(self, stream=None):
        calls.append(self.kernel.name)
        return real(self, stream)

    monkeypatch.setattr(module.LaunchPlan, "launch", counting)
    return calls


def base():
    import cupy as cp

    return dict(q=cp.zeros((B, HQ, D), cp.float16), kv=cp.zeros((B, 2, HKV, C, D), cp.float16),
                lens=cp.full(B, C, cp.int32))


def arena():
    """One allocation with aligned views into it, to build overlapping tensors."""
    import cupy as cp

    nq = B * HQ * D
    buf = cp.zeros(nq * 4, cp.float16)
    return buf, buf[:nq].reshape(B, HQ, D)


def call_decode(**over):
    import gqadrv

    t = base()
    kw = {k: over.pop(k) for k in ("out", "q_scale", "stream", "backend") if k in over}
    t.update(over)
    return gqadrv.gqa_decode(t["q"], t["kv"], t["lens"], **kw)


def call_prepare(num_splits=None, **over):
    import cupy as cp

    import gqadrv

    t = base()
    t["O"] = cp.empty((B, HQ, D), cp.float16)
    extra = {k: over.pop(k) for k in ("stream", "backend") if k in over}
    inputs = {"Q": t["q"], "KV": t["kv"], "O": t["O"], "sequence_lengths": t["lens"]}
    inputs.update(over)
    return gqadrv.prepare_gqa_decode(inputs, num_splits=num_splits, **extra)


def _cases():
    import cupy as cp

    def q_overlap_full():
        buf, q = arena()
        return call_decode(q=q, out=q)

    def q_overlap_partial():
        buf, q = arena()
        return call_decode(q=q, out=buf[q.size // 2: q.size // 2 + q.size].reshape(q.shape))

    def out_overlaps_kv():
        t = base()
        return call_decode(kv=t["kv"], out=t["kv"].reshape(-1)[: B * HQ * D].reshape(B, HQ, D))

    def out_overlaps_lengths():
        raw = cp.zeros(B * HQ * D * 2 + 64, cp.uint8)
        out = raw[: B * HQ * D * 2].view(cp.float16).reshape(B, HQ, D)
        lens = raw[256: 256 + 4 * B].view(cp.int32)
        return call_decode(out=out, lens=lens)

    def misaligned_q():
        buf = cp.zeros(B * HQ * D + 8, cp.float16)
        return call_decode(q=buf[1: 1 + B * HQ * D].reshape(B, HQ, D))

    def prepared_bad_stream():
        import gqadrv

        return gqadrv.launch_prepared(call_prepare(), stream="stream-0")

    def prepare_not_a_dict():
        import gqadrv

        return gqadrv.prepare_gqa_decode([1, 2, 3])

    def prepare_missing_out():
        import gqadrv

        t = base()
        return gqadrv.prepare_gqa_decode(Q=t["q"], KV=t["kv"], sequence_lengths=t["lens"])

    def prepare_both_forms():
        import gqadrv

        t = base()
        return gqadrv.prepare_gqa_decode({"Q": t["q"], "KV": t["kv"], "O": cp.empty_like(t["q"]), "sequence_lengths": t["lens"]}, Q=t["q"])

    def short_route_split():
        import gqadrv

        q = cp.zeros((1, 32, 128), cp.float16)
        return gqadrv.prepare_gqa_decode(Q=q, KV=cp.zeros((1, 2, 8, 64, 128), cp.float16), O=cp.empty_like(q),
                                         sequence_lengths=cp.ones(1, cp.int32), num_splits=4)

    def sm110_alias():
        import gqadrv

        t = base()
        return gqadrv.sm110_gqa_decode(t["q"], t["kv"], t["lens"])

    Z = cp.zeros
    return [
        ("q fp32", lambda: call_decode(q=Z((B, HQ, D), cp.float32)), TypeError, "q must have dtype float16 or bfloat16"),
        ("q int8", lambda: call_decode(q=Z((B, HQ, D), cp.int8)), TypeError, "got int8"),
        ("kv fp32", lambda: call_decode(kv=Z((B, 2, HKV, C, D), cp.float32)), TypeError, "kv must have the dtype of q"),
        ("kv bf16 vs q fp16", lambda: call_decode(kv=Z((B, 2, HKV, C, D), cp.uint16)), TypeError, "kv must have the dtype"),
        ("lens int64", lambda: call_decode(lens=Z(B, cp.int64)), TypeError, "sequence_lengths must have dtype int32"),
        ("lens float32", lambda: call_decode(lens=Z(B, cp.float32)), TypeError, "int32"),
        ("lens uint32", lambda: call_decode(lens=Z(B, cp.uint32)), TypeError, "int32"),
        ("q rank 2", lambda: call_decode(q=Z((B, HQ * D), cp.float16)), ValueError, "q must have shape"),
        # a 4-D q is [B, s_q, Hq, D] (multi-token decode): [B, Hq, 1, D] reads as s_q = Hq = 32 > 16
        ("q rank 4", lambda: call_decode(q=Z((B, HQ, 1, D), cp.float16)), ValueError, r"s_q \(query tokens"),
        ("q rank 5", lambda: call_decode(q=Z((B, 1, HQ, 1, D), cp.float16)), ValueError, "q must have shape"),
        ("kv rank 4", lambda: call_decode(kv=Z((B, 2, HKV * C, D), cp.float16)), ValueError, "kv must have shape"),
        ("batch 0", lambda: call_decode(q=Z((0, HQ, D), cp.float16), kv=Z((0, 2, HKV, C, D), cp.float16), lens=Z(0, cp.int32)), ValueError, "batch must be positive"),
        ("capacity 0", lambda: call_decode(kv=Z((B, 2, HKV, 0, D), cp.float16)), ValueError, "capacity must be positive"),
        ("head dim 96", lambda: call_decode(q=Z((B, HQ, 96), cp.float16), kv=Z((B, 2, HKV, C, 96), cp.float16)), ValueError, "supported: 64, 128, 256"),
        ("head dim 512", lambda: call_decode(q=Z((B, HQ, 512), cp.float16), kv=Z((B, 2, HKV, C, 512), cp.float16)), ValueError, "head_dim 512 is not supported"),
        ("group 17", lambda: call_decode(q=Z((B, 17, D), cp.float16), kv=Z((B, 2, 1, C, D), cp.float16)), ValueError, "supported: 1..16"),
        ("Hq not multiple", lambda: call_decode(kv=Z((B, 2, 5, C, D), cp.float16)), ValueError, "multiple of num_kv_heads"),
        ("kv batch mismatch", lambda: call_decode(kv=Z((B + 1, 2, HKV, C, D), cp.float16)), ValueError, "does not match q batch"),
        ("kv planes 3", lambda: call_decode(kv=Z((B, 3, HKV, C, D), cp.float16)), ValueError, "dim 1 must be 2"),
        ("kv head dim mismatch", lambda: call_decode(kv=Z((B, 2, HKV, C, 64), cp.float16)), ValueError, "does not match q head_dim"),
        ("lens shape 2-D", lambda: call_decode(lens=Z((B, 1), cp.int32)), ValueError, "sequence_lengths must have shape"),
        ("lens too long", lambda: call_decode(lens=Z(B + 1, cp.int32)), ValueError, "one length per request"),
        ("q on CPU", lambda: call_decode(q=np.zeros((B, HQ, D), np.float16)), ValueError, "q must be a CUDA array; got a CPU array"),
        ("kv on CPU", lambda: call_decode(kv=np.zeros((B, 2, HKV, C, D), np.float16)), ValueError, "kv must be a CUDA array"),
        ("lens on CPU", lambda: call_decode(lens=np.full(B, C, np.int32)), ValueError, "sequence_lengths must be a CUDA array"),
        ("q is a list", lambda: call_decode(q=[[0.0]]), TypeError, "q must be a CUDA array supporting DLPack"),
        ("kv is None", lambda: call_decode(kv=None), TypeError, "kv must be a CUDA array supporting DLPack"),
        ("q non-contiguous", lambda: call_decode(q=Z((B, D, HQ), cp.float16).transpose(0, 2, 1)), ValueError, "q must be contiguous"),
        ("kv non-contiguous", lambda: call_decode(kv=Z((B, 2, HKV, 2 * C, D), cp.float16)[:, :, :, ::2]), ValueError, "kv must be contiguous"),
        ("lens strided", lambda: call_decode(lens=Z(2 * B, cp.int32)[::2]), ValueError, "sequence_lengths must be contiguous"),
        ("out wrong shape", lambda: call_decode(out=Z((B, HQ, 64), cp.float16)), ValueError, "out must have the shape of q"),
        ("out wrong dtype", lambda: call_decode(out=Z((B, HQ, D), cp.float32)), TypeError, "out must have the dtype of q"),
        ("out non-contiguous", lambda: call_decode(out=Z((B, D, HQ), cp.float16).transpose(0, 2, 1)), ValueError, "out must be contiguous"),
        ("out is q", q_overlap_full, ValueError, "out must not overlap q"),
        ("out overlaps q partly", q_overlap_partial, ValueError, "out must not overlap q"),
        ("out overlaps kv", out_overlaps_kv, ValueError, "out must not overlap kv"),
        ("out overlaps lengths", out_overlaps_lengths, ValueError, "out must not overlap sequence_lengths"),
        ("q misaligned", misaligned_q, ValueError, "16-byte aligned"),
        ("q_scale NaN", lambda: call_decode(q_scale=math.nan), ValueError, "q_scale must be a finite number > 0"),
        ("q_scale inf", lambda: call_decode(q_scale=math.inf), ValueError, "q_scale must be a finite number > 0"),
        ("q_scale -inf", lambda: call_decode(q_scale=-math.inf), ValueError, "q_scale"),
        ("q_scale 0", lambda: call_decode(q_scale=0.0), ValueError, "q_scale"),
        ("q_scale negative", lambda: call_decode(q_scale=-0.5), ValueError, "q_scale"),
        ("q_scale string", lambda: call_decode(q_scale="1"), ValueError, "q_scale"),
        ("q_scale None", lambda: call_decode(q_scale=None), ValueError, "q_scale"),
        ("q_scale complex", lambda: call_decode(q_scale=1j), ValueError, "q_scale"),
        ("stream string", lambda: call_decode(stream="s"), TypeError, "stream must be"),
        ("stream negative", lambda: call_decode(stream=-4), ValueError, "stream handle must be >= 0"),
        ("stream bool", lambda: call_decode(stream=True), TypeError, "not a bool"),
        ("backend unknown", lambda: call_decode(backend="cuda"), ValueError, "backend must be one of"),
        ("backend tcgen05 on this GPU", lambda: call_decode(backend="tcgen05"), RuntimeError, "needs compute capability 10.0 or 11.0"),
        ("num_splits 0", lambda: call_prepare(0), ValueError, "num_splits must be None or an int in"),
        ("num_splits 65", lambda: call_prepare(65), ValueError, "num_splits"),
        ("num_splits -1", lambda: call_prepare(-1), ValueError, "num_splits"),
        ("num_splits float", lambda: call_prepare(2.0), ValueError, "num_splits"),
        ("num_splits bool", lambda: call_prepare(True), ValueError, "num_splits"),
        ("num_splits string", lambda: call_prepare("4"), ValueError, "num_splits"),
        ("num_splits on short route", short_route_split, ValueError, "cannot split"),
        ("prepare O overlaps Q", _prep_alias, ValueError, "O must not overlap Q"),
        ("prepare q_scale NaN", lambda: call_prepare(q_scale=math.nan), ValueError, "q_scale"),
        ("prepare missing key", _prep_missing, ValueError, r"inputs is missing \['sequence_lengths'\]"),
        ("prepare missing O", _prep_missing_o, ValueError, r"inputs is missing \['O'\]"),
        ("q_scale overflows float32", lambda: call_decode(q_scale=1e300), ValueError, "q_scale=1e.300 is too large"),
        ("prepare q_scale overflows float32", lambda: call_prepare(q_scale=1e300), ValueError, "too large"),
        ("backend not a string", lambda: call_decode(backend=123), TypeError, "backend must be None or one of"),
        ("prepare backend not a string", lambda: call_prepare(backend=123), TypeError, "backend must be None or one of"),
        ("launch_prepared(None)", _launch_none, TypeError, "launch_prepared expects an object returned by a prepare_"),
        ("torch q requires grad", _torch_requires_grad, ValueError, "q requires grad"),
        ("prepare unknown key", lambda: call_prepare(scale=2.0), ValueError, "unknown inputs keys"),
        ("prepare not a dict", prepare_not_a_dict, TypeError, "inputs must be a dict"),
        ("prepare without O", prepare_missing_out, ValueError, r"O \(the output tensor\) is required"),
        ("prepare both forms", prepare_both_forms, ValueError, "not both"),
        ("prepare lens int64", lambda: call_prepare(sequence_lengths=cp.zeros(B, cp.int64)), TypeError, "int32"),
        ("launch bad stream", prepared_bad_stream, TypeError, "stream must be"),
        ("sm110 alias on this GPU", sm110_alias, RuntimeError, "requires compute capability 11.0"),
    ]


def _prep_alias():
    import gqadrv

    t = base()
    return gqadrv.prepare_gqa_decode({"Q": t["q"], "KV": t["kv"], "O": t["q"], "sequence_lengths": t["lens"]})


def _prep_missing():
    import cupy as cp

    import gqadrv

    t = base()
    return gqadrv.prepare_gqa_decode({"Q": t["q"], "KV": t["kv"], "O": cp.empty_like(t["q"])})


def _prep_missing_o():
    import gqadrv

    t = base()
    return gqadrv.prepare_gqa_decode({"Q": t["q"], "KV": t["kv"], "sequence_lengths": t["lens"]})


def _launch_none():
    import gqadrv

    return gqadrv.launch_prepared(None)


def _torch_requires_grad():
    torch = pytest.importorskip("torch")
    import gqadrv

    t = base()
    q = torch.from_dlpack(t["q"]).float().half().requires_grad_(True)
    return gqadrv.gqa_decode(q, torch.from_dlpack(t["kv"]), torch.from_dlpack(t["lens"]))


CASES = None


def _case_table():
    global CASES
    if CASES is None:
        CASES = _cases()
    return CASES


def test_suite_is_large_enough():
    assert len(_case_table()) >= 40
    assert len({c[0] for c in _case_table()}) == len(_case_table())


@pytest.mark.parametrize("idx", range(80))
def test_bad_input_raises_before_any_launch(idx, launches, report):
    table = _case_table()
    if idx >= len(table):
        pytest.skip("no such case")
    name, fn, exc, msg = table[idx]
    if name == "sm110 alias on this GPU":
        from gqadrv.runtime.driver import device_info

        if device_info(0).cc == (11, 0):
            pytest.skip("SM110 device")
    if name == "launch bad stream":
        with pytest.raises(exc, match=msg):
            fn()
        assert launches == []  # prepare does not launch either
        return
    with pytest.raises(exc, match=msg):
        fn()
    assert launches == [], f"{name}: a kernel was launched before the error"
    if idx == len(table) - 1:
        report(f"bad-input suite: {len(table)} distinct invalid calls, each raised before any launch")
