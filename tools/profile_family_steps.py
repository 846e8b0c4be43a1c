"""Host time of each step of a GQA layout-family member's first call, on the GPU host.

For 64 new capacities of one family (B1 Hq32 Hkv8 D128 fp16, output allocated), the steps of
``gqa.api._family_call`` on the re-sizable entry of the route side and batch size (``gqa.layout_family.resize``) are run
one by one with the same functions and timed (median per step), then ``gqadrv.gqa_decode`` itself on 64 more new capacities
(with and without Python's garbage collector), and CuPy's ``cp.empty`` alone. The step list mirrors
those two functions; keep it in step when they change. docs/RESULTS.md ("Layout families") has a run.

    python tools/profile_family_steps.py [cupy] [torch]
"""
import gc
import statistics
import sys
import time

import numpy as np
import cupy as cp
import gqadrv
from gqadrv.gqa import api, plan as _plan, layout_family as _family, routes as _routes
from gqadrv.ops import workspace as _workspace, outputs as _outputs
from gqadrv.runtime import driver as _drv
from gqadrv.runtime.streams import order_fast
pc = time.perf_counter
B, Hq, Hkv, D, C0 = 1, 32, 8, 128, 1024
def run(fw, n=64):
    if fw == "torch":
        import torch
        mk = lambda shape, dt=torch.float16: torch.zeros(shape, dtype=dt, device="cuda")
        lensf = lambda c: torch.full((B,), c, dtype=torch.int32, device="cuda")
    else:
        mk = lambda shape, dt=np.float16: cp.zeros(shape, dtype=dt)
        lensf = lambda c: cp.full((B,), c, dtype=np.int32)
    for i in range(3):
        gqadrv.gqa_decode(mk((B, Hq, D)), mk((B, 2, Hkv, C0 + 8 * i, D)), lensf(C0))
    sets = [(mk((B, Hq, D)), mk((B, 2, Hkv, C0 + 128 * (i + 1), D)), lensf(C0)) for i in range(n)]
    cp.cuda.Device().synchronize()
    acc = {}
    def mark(name, t0):
        t = pc(); acc.setdefault(name, []).append(t - t0); return t
    tot = []
    keep = []
    for q, kv, lens in sets:
        out = None
        T0 = t0 = pc()
        facts = api._call_facts(q, kv, lens, out, 1.0, None, None, None); t0 = mark('facts', t0)
        key, ptrs, kind, dev, s, cur = facts
        split = _family.split_key(key); t0 = mark('split_key', t0)
        fam = _family.families.get(split[0]); _fk, b, c = split; tt = fam.template
        side = _plan.route_side(dev, b, Hkv, c, D); built = fam.built.get(side); t0 = mark('side', t0)
        variant, loaded, base = built
        splits = _routes.default_splits(variant, b, Hkv, c, _drv.device_info(dev).sm_count, loaded.ctas_per_sm)
        ws = None
        if splits > 1:
            ws = _workspace.pooled(dev, s, _plan.workspace_sizes_for(b, Hkv, tt.group, D, splits), _plan.WORKSPACE_ZERO)
        t0 = mark('splits+ws', t0)
        o = _outputs.allocate(q, (b, Hq, D), tt.dtype, dev, s, cur); t0 = mark('allocate', t0)
        ptrs = ptrs[:3] + (o.ptr,)
        flex = fam.flex.get((side, b))
        order_fast(kind, (q, kv, lens, out), dev, s, cur); t0 = mark('order_fast', t0)
        with flex.lock:
            if flex.size != (b, c):
                _family.resize(flex, b, c, splits, ws, ptrs[1])
            t0 = mark('resize', t0)
            flex.bind(ptrs); t0 = mark('bind', t0)
            flex.launch(); t0 = mark('launch', t0)
        api._layouts.remember(key, flex); t0 = mark('remember', t0)
        r = _outputs.hand_back(o, q, s, dev); t0 = mark('hand_back', t0)
        tot.append(t0 - T0)
        keep.append(r)
    cp.cuda.Device().synchronize()
    print(f"{fw}: step medians (us) over {n} new layouts; total median {statistics.median(tot)*1e6:.1f}")
    for k, v in acc.items():
        print(f"  {k:12s} {statistics.median(v)*1e6:7.2f}  (max {max(v)*1e6:7.1f})")
    # the API call itself on more new layouts
    sets = [(mk((B, Hq, D)), mk((B, 2, Hkv, C0 + 128 * (n + i + 1), D)), lensf(C0)) for i in range(n)]
    cp.cuda.Device().synchronize()
    ts = []
    for q, kv, lens in sets:
        t0 = pc(); r = gqadrv.gqa_decode(q, kv, lens); ts.append(pc() - t0); keep.append(r)
    print(f"  gqa_decode first call (family member) median {statistics.median(ts)*1e6:.1f} min {min(ts)*1e6:.1f}")
    gc.disable()
    sets = [(mk((B, Hq, D)), mk((B, 2, Hkv, C0 + 128 * (2 * n + i + 1), D)), lensf(C0)) for i in range(n)]
    cp.cuda.Device().synchronize()
    ts = []
    for q, kv, lens in sets:
        t0 = pc(); r = gqadrv.gqa_decode(q, kv, lens); ts.append(pc() - t0); keep.append(r)
    gc.enable()
    print(f"  same, gc disabled: median {statistics.median(ts)*1e6:.1f} min {min(ts)*1e6:.1f}")
    if fw == "cupy":
        ts = []
        for i in range(200):
            t0 = pc(); a = cp.empty((B, Hq, D), np.float16); ts.append(pc() - t0); keep.append(a)
        print(f"  cp.empty (kept) median {statistics.median(ts)*1e6:.2f}")
        ts = []
        for i in range(200):
            t0 = pc(); a = cp.empty((B, Hq, D), np.float16); ts.append(pc() - t0)
        print(f"  cp.empty (dropped) median {statistics.median(ts)*1e6:.2f}")
if __name__ == "__main__":
    for name in sys.argv[1:] or ["cupy", "torch"]:
        run(name)
