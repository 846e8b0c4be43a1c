"""The cluster split merge's host rules on the CPU (kernels/gqa/common/cluster_merge.cuh): which
launches merge their splits in a cluster, the receive area the host adds to the shared memory (the
kernel's RecvArea), and the launch shape every GQA launch path takes from ``plan.launch_shape``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gqadrv.gqa import plan, routes
from gqadrv.ops import kernels
from tests.host_stubs import stub_gpu

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _variant(family="tma", D=128, rows=8, dtype="float16"):
    return routes.Variant(routes.FAMILIES[family], dtype, D, rows, routes.tiling_for(family, D),
                          routes.switches_for(family))


def test_receive_area_matches_the_kernel():
    src = (KERNELS / "gqa/common/cluster_merge.cuh").read_text()
    assert int(re.search(r"constexpr int CLUSTER_MERGE_MAX = (\d+);", src).group(1)) == routes.CLUSTER_MERGE_MAX
    assert "static constexpr u32 ENTRIES = (u32)(ROWS * D / 8 + CLUSTER_MERGE_MAX);" in src
    assert "static constexpr u32 BYTES = ENTRIES * 40u;" in src
    tma = (KERNELS / "gqa/sm90/decode_tma.cu").read_text()
    assert f"constexpr bool CLUSTER_MERGE = D <= {routes.CLUSTER_MERGE_MAX_HEAD_DIM};" in tma
    assert routes.cluster_recv_bytes(_variant(D=128, rows=8)) == (8 * 16 + 16) * 40
    assert routes.cluster_recv_bytes(_variant(D=64, rows=16)) == (16 * 8 + 16) * 40
    # every CTA's S x ceil(items / S) entries fit, for every group the rows serve and every S
    for D, rows in ((64, 8), (64, 16), (128, 8), (128, 16)):
        entries = routes.cluster_recv_bytes(_variant(D=D, rows=rows)) // 40
        for group in range(1, rows + 1):
            items = group * D // 8
            assert all(S * -(-items // S) <= entries for S in range(2, routes.CLUSTER_MERGE_MAX + 1))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rows", [8, 16])
def test_which_launches_merge_in_a_cluster(monkeypatch, D, rows):
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = _variant(D=D, rows=rows)
    assert v.dynamic_smem + routes.cluster_recv_bytes(v) <= routes.ARCH_SMEM_OPTIN["sm_90a"]
    assert [s for s in range(1, 20) if routes.cluster_merge_applies(v, s)] == list(range(2, 17))
    for fam in ("portable", "short"):
        assert not routes.cluster_merge_applies(_variant(fam, D=D, rows=rows), 4)
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")
    assert not routes.cluster_merge_applies(v, 4)
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "8")    # portable clusters only
    assert [s for s in range(1, 20) if routes.cluster_merge_applies(v, s)] == list(range(2, 9))
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "1")    # the default
    assert [s for s in range(1, 20) if routes.cluster_merge_applies(v, s)] == list(range(2, 17))


def test_head_dim_256_keeps_the_ticket():
    for rows in (8, 16):
        assert not any(routes.cluster_merge_applies(_variant(D=256, rows=rows), s) for s in range(2, 17))


def test_launch_shape_needs_every_cluster_resident(monkeypatch):
    stub_gpu(monkeypatch)
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = _variant()
    loaded = kernels.load(v, 0)
    asked = []

    def fits(n):
        def f(loaded, size, smem, block, device):
            asked.append((size, smem, block))
            return n
        return f

    monkeypatch.setattr(kernels, "max_active_clusters", fits(16))
    grid, block, smem, cluster = plan.launch_shape(v, loaded, 0, 1, 8, 8)
    assert grid == (64, 1, 1) and cluster == (8, 1, 1)
    assert smem == v.dynamic_smem + routes.cluster_recv_bytes(v)
    assert asked[-1] == (8, smem, block)
    # 17 (batch, KV head) clusters but 16 resident at once: the ticket merge, no receive area
    assert plan.launch_shape(v, loaded, 0, 1, 17, 8) == ((136, 1, 1), block, v.dynamic_smem, None)
    monkeypatch.setattr(kernels, "max_active_clusters", fits(0))
    assert plan.launch_shape(v, loaded, 0, 1, 1, 2)[3] is None
    monkeypatch.setattr(kernels, "max_active_clusters", fits(16))
    for splits in (1, 17):
        assert plan.launch_shape(v, loaded, 0, 1, 8, splits) == (
            routes.launch_geometry(v, 1, 8, splits) + (None,))


# clusters of S CTAs (one per SM: ring + receive area) an H100 runs at once (cuOccupancyMaxActiveClusters
# for the TMA kernel, docs/RESULTS.md 2026-12-07 "all-to-all")
H100_FITS = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15, 9: 9, 10: 7, 11: 7, 12: 7, 13: 7, 14: 7, 15: 7, 16: 7}


@pytest.mark.parametrize("B,C,ticket,want", [
    (1, 1024, 8, 8),     # one round per CTA either way: clusters of 8
    (1, 2048, 16, 8),    # 2 rounds in clusters of 8 against 1 with the ticket: clusters
    (1, 4096, 16, 16),   # 4 rounds in clusters of 8 against 2: the ticket
    (1, 1500, 12, 6),    # 2 rounds from 6 splits on (ties take the smaller cluster)
    (1, 512, 4, 4),
    (2, 1024, 8, 4),     # 16 clusters of 8 do not fit: 2 rounds in clusters of 4
    (4, 256, 1, 1),      # unsplit stays unsplit
    (1, 32768, 16, 16),
])
def test_cluster_split_counts(monkeypatch, B, C, ticket, want):
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = _variant()
    assert routes.default_splits(v, B, 8, C, 132, 1) == ticket
    assert routes.cluster_splits(v, B, 8, C, ticket, H100_FITS.get) == want
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")
    assert routes.cluster_splits(v, B, 8, C, ticket, H100_FITS.get) == ticket
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE")
    assert routes.cluster_splits(_variant(D=256), B, 8, C, ticket, H100_FITS.get) == ticket


@pytest.mark.parametrize("hkv,C,ticket,want", [
    (4, 2048, 16, 8),    # portable first: 8 in clusters (2 rounds) beat 16 in clusters (1) on an H100
    (4, 4096, 32, 16),   # portable sizes need 4 rounds against 1: 16 in clusters (2 rounds)
    (2, 4096, 32, 16),
    (1, 4096, 32, 16),
    (4, 8192, 33, 33),   # 16 in clusters would stream 4 rounds against 2: the ticket
    (8, 4096, 16, 16),   # 8 clusters of 16 do not fit (7 do): the ticket
])
def test_non_portable_clusters_when_portable_ones_fall_short(monkeypatch, hkv, C, ticket, want):
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = _variant()
    assert routes.default_splits(v, 1, hkv, C, 132, 1) == ticket
    assert routes.cluster_splits(v, 1, hkv, C, ticket, H100_FITS.get) == want
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "8")    # portable only
    got = routes.cluster_splits(v, 1, hkv, C, ticket, H100_FITS.get)
    assert got <= 8 or got == ticket
    fits = {**H100_FITS, **{S: 8 for S in range(9, 17)}}
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE")
    assert routes.cluster_splits(v, 1, 8, 4096, 16, fits.get) == 16      # where 8 clusters of 16 fit


def test_default_splits_of_the_plan_take_the_cluster_count(monkeypatch):
    stub_gpu(monkeypatch)
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    monkeypatch.setattr(plan, "_splits", plan.BoundedMap(16))
    monkeypatch.setattr(kernels, "max_active_clusters", lambda loaded, S, smem, block, device: H100_FITS[S])
    v = _variant()
    loaded = kernels.load(v, 0)
    assert plan.splits_for(v, loaded, 0, 2, 8, 1024) == 4
    assert plan.launch_shape(v, loaded, 0, 2, 8, 4)[3] == (4, 1, 1)
    assert plan.splits_for(v, loaded, 0, 1, 8, 4096) == 16
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")   # part of the cache key
    assert plan.splits_for(v, loaded, 0, 2, 8, 1024) == 8


def test_paged_launch_shape(monkeypatch):
    """The paged TMA kernel's balanced splits run as clusters of ``splits`` CTAs when every unit's
    cluster is resident; the batch-invariant mode (split_subs > 0), the cp.async family and too
    many units keep the ticket."""
    import types

    from gqadrv.gqa import paged

    stub_gpu(monkeypatch)
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = routes.select_paged_variant((9, 0), 128, "float16", 4, None, tma_ok=True)
    assert v.family.name == "paged_tma" and routes.cluster_merge_applies(v, 16)
    loaded = kernels.load(v, 0)
    monkeypatch.setattr(kernels, "max_active_clusters", lambda loaded, S, smem, block, device: 8)
    pr = types.SimpleNamespace(batch=1, num_kv_heads=8, rows=4, device=0)
    grid, block, smem, cluster = paged.launch_shape(pr, v, loaded, 16, 0)
    assert grid == (128, 1, 1) and cluster == (16, 1, 1) and smem == v.dynamic_smem + routes.cluster_recv_bytes(v)
    assert paged.launch_shape(pr, v, loaded, 16, 4)[2:] == (v.dynamic_smem, None)         # deterministic
    pr9 = types.SimpleNamespace(batch=1, num_kv_heads=9, rows=4, device=0)                # 9 units, 8 resident
    assert paged.launch_shape(pr9, v, loaded, 16, 0)[3] is None
    pr_rb = types.SimpleNamespace(batch=1, num_kv_heads=2, rows=64, device=0)            # 4 row blocks of 16
    vr = routes.select_paged_variant((9, 0), 128, "float16", 64, None, tma_ok=True)
    assert paged.launch_shape(pr_rb, vr, kernels.load(vr, 0), 4, 0) == ((32, 1, 1), vr.block,
                                                                          vr.dynamic_smem + routes.cluster_recv_bytes(vr),
                                                                          (4, 1, 1))
    cp_async = routes.select_paged_variant((9, 0), 128, "float16", 4, None, tma_ok=False)
    assert cp_async.family.name == "paged" and not routes.cluster_merge_applies(cp_async, 4)
    monkeypatch.setenv("GQADRV_CLUSTER_MERGE", "0")
    assert paged.launch_shape(pr, v, loaded, 16, 0)[3] is None


def test_paged_speculation_one_wave_only(monkeypatch):
    """The paged TMA kernel's speculative ring fill (GQA_PAGED_FLAG_SPEC, defined alike in the
    header) is asked for one-wave grids of the TMA family with D <= 128 only, and
    GQADRV_PAGED_SPEC=0 turns it off."""
    import re
    import types

    from gqadrv.gqa import paged, paged_args
    from gqadrv.runtime.compiler import kernels_root

    text = (kernels_root() / "gqa" / "common" / "paged_args.cuh").read_text()
    assert int(re.search(r"#define GQA_PAGED_FLAG_SPEC (\d+)", text).group(1)) == paged_args.GQA_PAGED_FLAG_SPEC
    kernel = (kernels_root() / "gqa" / "sm90" / "decode_paged_tma.cu").read_text()
    assert int(re.search(r"constexpr bool SPEC_BUILD = D <= (\d+);", kernel).group(1)) == paged.SPEC_MAX_HEAD_DIM
    stub_gpu(monkeypatch)  # 132 SMs
    monkeypatch.delenv("GQADRV_PAGED_SPEC", raising=False)
    v = routes.select_paged_variant((9, 0), 128, "float16", 4, None, tma_ok=True)
    pr = types.SimpleNamespace(batch=1, num_kv_heads=8, rows=4, device=0, table=object())
    assert paged.speculates(pr, v, 1, 16)                       # 128 CTAs
    assert not paged.speculates(pr, v, 1, 17)                   # 136 CTAs: more than one wave
    assert paged.speculates(pr, v, 2, 33)                       # 264 CTAs at two per SM
    assert not paged.speculates(types.SimpleNamespace(**{**vars(pr), "table": None}), v, 1, 1)
    cp_async = routes.select_paged_variant((9, 0), 128, "float16", 4, None, tma_ok=False)
    assert not paged.speculates(pr, cp_async, 1, 1)
    d256 = routes.select_paged_variant((9, 0), 256, "float16", 4, None, tma_ok=True)
    assert d256.family.name == "paged_tma" and not paged.speculates(pr, d256, 1, 1)
    monkeypatch.setenv("GQADRV_PAGED_SPEC", "0")
    assert not paged.speculates(pr, v, 1, 16)


def test_paged_split_counts_take_no_extra_round(monkeypatch):
    monkeypatch.delenv("GQADRV_CLUSTER_MERGE", raising=False)
    v = routes.select_paged_variant((9, 0), 128, "float16", 4, None, tma_ok=True)
    assert v.tiling.tokens_per_round == 256
    assert routes.default_splits(v, 1, 8, 4096, 132, 1) == 16
    # clusters of 16 do not fit 8 at once; 8 would stream 2 rounds per CTA against 1: the ticket
    assert routes.cluster_splits(v, 1, 8, 4096, 16, H100_FITS.get, extra_rounds=0) == 16
    assert routes.cluster_splits(v, 1, 8, 4096, 16, H100_FITS.get) == 8   # the contiguous rule would cluster
    assert routes.cluster_splits(v, 1, 8, 2048, routes.default_splits(v, 1, 8, 2048, 132, 1), H100_FITS.get,
                                 extra_rounds=0) == 8


def test_residency_query_allows_non_portable_sizes_first(monkeypatch):
    """max_active_clusters sets the kernel's non-portable-cluster attribute before it asks the driver
    about clusters of more than 8 CTAs (once), not for portable sizes; a driver that refuses the
    attribute gives 0 clusters of that size (the ticket); answers are cached."""
    import contextlib
    import types

    from gqadrv.runtime import driver as drv_mod

    asked, allowed = [], []

    class Kernel:
        function, function_int = object(), 1234

        def ensure_dynamic_smem(self, n):
            pass

        def allow_non_portable_clusters(self):
            if refuse:
                raise drv_mod.CudaDriverError("cuFuncSetAttribute", "CUDA_ERROR_INVALID_VALUE", "", 1)
            allowed.append(True)

    fake = types.SimpleNamespace(
        CUlaunchConfig=lambda: types.SimpleNamespace(),
        CUlaunchAttribute=lambda: types.SimpleNamespace(value=types.SimpleNamespace(clusterDim=types.SimpleNamespace())),
        CUlaunchAttributeID=types.SimpleNamespace(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION=4),
        cuOccupancyMaxActiveClusters=lambda f, cfg: (asked.append(cfg.attrs[0].value.clusterDim.x), (0, 7))[1],
    )
    monkeypatch.setattr(drv_mod, "driver", lambda: fake)
    monkeypatch.setattr(drv_mod, "device_scope", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(kernels, "_clusters", kernels.BoundedMap(16))
    loaded = types.SimpleNamespace(kernel=Kernel())
    refuse = False
    assert kernels.max_active_clusters(loaded, 8, 1000, (128, 1, 1), 0) == 7 and allowed == []
    assert kernels.max_active_clusters(loaded, 16, 1000, (128, 1, 1), 0) == 7 and allowed == [True]
    assert kernels.max_active_clusters(loaded, 16, 1000, (128, 1, 1), 0) == 7 and asked == [8, 16]   # cached
    refuse = True
    assert kernels.max_active_clusters(loaded, 12, 1000, (128, 1, 1), 0) == 0 and asked == [8, 16]
