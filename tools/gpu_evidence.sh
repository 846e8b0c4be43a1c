#!/usr/bin/env bash
# One GPU call that gathers the evidence of docs/RESULTS.md on a lent H200 (run from the repo root):
# the GPU test suite, the benchmark with the peers (FlashInfer wheels carried in .whl/), per-CTA
# traces of the long single-wave rows, a split/route sweep and Nsight Compute on the rows that miss
# their targets. Summaries go to $OUT (default ./evidence); steps can be picked: tests bench trace tune ncu
# (NCU_SHAPES="B,C[,lengths] ..." replaces the ncu step's shapes), and for MLA: mla_bench (the MLA
# table; FlashMLA joins when a built flash_mla package is on PYTHONPATH, e.g. FMLA=/path/to/built
# folder, or after the fmla step, which builds it from a carried .fmla/ or .fmla.txz), mla_rounds (the
# same table, --rounds 2, providers in a rotating order), mla_routes16 (h_q 16: the seesaw against the
# narrow route), mla_modes (tools/mla_launch_modes.py: stream vs graph, PDL on / off), mla_sanitize
# (compute-sanitizer memcheck + racecheck over the MLA routes); for the paged GQA family: paged_bench
# (`bench --op gqa_paged` with FlashInfer's paged wrappers), fp8_bench (`bench --op gqa_fp8`: the
# FP8-e4m3 KV paged decode against our fp16 one and FlashInfer's fp8 / fp16 paged decode on the
# ANCHORS rows), paged_tests / fp8_tests (the GPU test files of the paged / FP8 issues, pytest's output and its
# max-error lines kept), paged_sanitize (memcheck + racecheck over the paged routes and merge_state),
# integrations (tests/integrations on the GPU: torch.compile, torch graphs, jax.jit, incl. the
# paged / LSE / merge ops), paged_tune (tools/paged_tune.py: the paged routes under tuning
# switches); step_bench (`bench --op gqa_step`: a 64-layer decode step, a distinct KV cache per
# layer, in one CUDA graph at B1 / B16 C4096, us per layer for gqadrv and FlashInfer; needs ~35 GB
# of GPU memory at B16; first run 2026-12-01); mla_fp8_bench (`bench --op mla_fp8`: MLA decode on the
# 656-byte FP8 cache against our bf16 cache); mla_fp8_ncu (Nsight Compute on the FP8 and the bf16 MLA
# kernels at b128 h_q 64 L8192: warp states and the top stall locations, benchmarks/ncu_mla_target.py);
# layouts (the GPU tests of the layout-keyed convenience plans and of the files whose repeated calls
# take them); host (tools/profile_convenience.py: host cost per framework, GQA and MLA, jax.jit);
# family (gqa_decode's layout families: GPU tests, host cost, tools/profile_family_steps.py);
# mla_varlen (the MLA rows of unequal lengths with both peers; run fmla first for FlashMLA);
# mla_sched (the balanced grid's schedule experiments, GQADRV_MLA_EXPERIMENTS=1, against the default
# schedule in the same rows); mla_pl2 (partials kept in L2 until merged, MLA_PARTIAL_L2, the balanced default, against _nopl2); mla_trace
# (tools/mla_trace.py: per-CTA timelines, per-SM speed across launches); mla_fp8_src (the same two kernels at b128 h_q 64 L4096, per-SASS-instruction stall samples, reduced
# by tools/ncu_source_stalls.py to per-role regions and the hottest instructions); prefill_bench (`bench --op
# mla_sparse_prefill` with FlashMLA: run fmla first); prefill_ab (the sparse prefill's experiment builds: their bit-identity
# test, then the prefill rows beside the default build, 3 rounds, GQADRV_MLA_EXPERIMENTS=1); prefill_ncu (Nsight
# Compute on our prefill kernel and FlashMLA's, two rows; run fmla first). FlashInfer comes from .whl/*.whl or,
# where the wheels do not fit the carry, from .fisite.tgz (tools/peer_site_pack.sh).
# Default: the GQA steps. short_rows: the short route's rows with FlashInfer, three rounds; tmap: the tensor-map
# writer's GPU test (written maps against the driver's), layout-plan files and host cost with GQADRV_TMAP_PATCH off / on.
# On a device call use OUT=$OUT PACK=1: a call returns at most 8 files, PACK=1 returns one tarball instead.
set -u
find_ncu() { command -v ncu || (set +f; ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); }
set -f  # shapes such as "1,4096,[3968]" are words, not glob patterns
OUT=${OUT:-$PWD/evidence}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} GQADRV_CACHE_DIR=/tmp/gqc CUDA_CACHE_DISABLE=1 \
       XLA_PYTHON_CLIENT_PREALLOCATE=false
STEPS=${*:-tests bench trace tune ncu}
set +f; WHLS=$(ls .whl/*.whl 2>/dev/null | tr '\n' ' '); set -f  # (globbing is off for the shapes)
if [ -f .fisite.tgz ]; then
  # the trimmed, unpacked FlashInfer of tools/peer_site_pack.sh (fits the 64 MiB carry; the wheels do not)
  mkdir -p /tmp/site && tar xzf .fisite.tgz -C /tmp/site && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif [ -n "$WHLS" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site $WHLS && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv; git log -1 --format='%h %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
for step in $STEPS; do
  case $step in
  tests) python3 -m pytest -q -m gpu --timeout=150 tests -p no:cacheprovider > "$OUT/tests.log" 2>&1
         { grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40; tail -5 "$OUT/tests.log"; } > "$OUT/tests.txt"
         rm -f "$OUT/tests.log" ;;
  bench) python3 -m gqadrv bench --no-geometry --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1 ;;
  fmla) # build FlashMLA (the MLA peer) from the carried folder of ../shared/tools/peer_flashmla_prepare.sh,
        # .fmla/ or its archive .fmla.txz (tar -cJf: ~1.5 MB instead of ~30 MiB of the 64 MiB carry), and put
        # it on FMLA for the later steps of this call (mla_bench, mla_rounds); ~2 min on 16 cores
        src=.fmla
        if [ ! -d .fmla ] && [ -f .fmla.txz ]; then mkdir -p /tmp/fmla_x && tar -xJf .fmla.txz -C /tmp/fmla_x; src=/tmp/fmla_x/.fmla; fi
        if [ ! -d "$src/FlashMLA" ]; then echo "no .fmla/ or .fmla.txz carried" > "$OUT/fmla.txt"; continue; fi
        set +f; python3 -m pip install -q --no-index --no-deps --target /tmp/nj "$src"/wheels/*.whl > "$OUT/fmla.txt" 2>&1; set -f
        ( cd "$src/FlashMLA" && PATH=/tmp/nj/bin:$PATH PYTHONPATH=/tmp/nj CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl \
            FLASH_MLA_DISABLE_SM100=1 MAX_JOBS=14 NVCC_THREADS=2 python3 setup.py build_ext --inplace ) >> "$OUT/fmla.txt" 2>&1
        rc=$?; [ $rc = 0 ] && FMLA=$(cd "$src/FlashMLA" && pwd); echo "FlashMLA build rc $rc FMLA=${FMLA:-}" >> "$OUT/fmla.txt" ;;
  mla_bench) PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} python3 -m gqadrv bench --op mla --reps 10 \
               --json "$OUT/mla_bench.json" > "$OUT/mla_bench.txt" 2>&1 ;;
  mla_rounds) # the MLA table with both peers, providers timed twice in a rotating order (run fmla first)
              PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} python3 -m gqadrv bench --op mla --rounds 2 --reps 10 \
                --json "$OUT/mla_rounds.json" > "$OUT/mla_rounds.txt" 2>&1 ;;
  mla_routes16) # h_q 16: the seesaw (split and balanced grids) beside the narrow route, with the peers when
                # importable (run fmla first for FlashMLA): the route for M <= 16 was chosen on the H200 before
                # the balanced grids existed, and an H100 run (2026-12-05) measured the seesaw 1-4 % faster
                PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} python3 -m gqadrv bench --op mla --rounds 3 --reps 10 \
                  --mla-also seesaw_bal seesaw_tma narrow16x2_tma --mla-rows 128,1,16,4096 128,1,16,8192 \
                  128,1,16,16384 128,1,16,32768 128,1,16,8192,varlen 128,1,16,4096,skew 64,1,16,8192 \
                  --json "$OUT/mla_routes16.json" > "$OUT/mla_routes16.txt" 2>&1 ;;
  mla_sched) # the balanced grid's schedule experiments (kernel_spec.SCHEDULE_EXPERIMENTS) beside the default,
             # same rows, rounds interleaved: seesaw_bal at h_q 64 / 128, narrow16_bal at h_q 16
             for fam in seesaw_bal:64,128 narrow16_bal:16; do
               name=${fam%%:*}; rows=""
               for h in $(echo "${fam#*:}" | tr , ' '); do
                 rows="$rows 128,1,$h,4096,spread 128,1,$h,8192,spread 128,1,$h,4096,skew 128,1,$h,8192,varlen"
                 rows="$rows 110,1,$h,8192 110,1,$h,4096 128,1,$h,4096 128,1,$h,8192"
               done
               # shellcheck disable=SC2086  # one word per row
               GQADRV_MLA_EXPERIMENTS=1 python3 -m gqadrv bench --op mla --no-peers --rounds 3 --reps 10 \
                 --mla-also ${name}_snap16 ${name}_snap32 ${name}_cut32 --mla-rows $rows \
                 --json "$OUT/mla_sched_$name.json" > "$OUT/mla_sched_$name.txt" 2>&1
             done ;;
  mla_pl2) # split partials kept in L2 until merged (MLA_PARTIAL_L2, the balanced variants' default since 2026-12-05)
           # against the same builds without it (<variant>_nopl2, kernel_spec.partial_l2_experiments), rows with
           # cuts and uniform rows (h_q 64 L 16K / 32K: the rows that moved +8 % in the H200 table of 2026-12-05
           # 18:09 while the peers moved +4-6 %); first the GPU test that requires both bit-identical on every launch
           python3 -m pytest -q -m gpu --timeout=600 -p no:cacheprovider -rf tests/mla/test_mla_experiments_gpu.py \
             > "$OUT/mla_experiments_tests.txt" 2>&1
           GQADRV_MLA_EXPERIMENTS=1 python3 -m gqadrv bench --op mla --no-peers --rounds 3 --reps 10 \
             --mla-also seesaw_bal_nopl2 seesaw_bal_cut32 seesaw_bal_cut32_nopl2 --mla-rows 128,1,64,4096 \
             128,1,64,16384 128,1,64,32768 128,1,64,8192,spread 128,1,64,4096,skew 128,1,128,8192,spread \
             128,1,128,8192,varlen \
             --json "$OUT/mla_pl2.json" > "$OUT/mla_pl2.txt" 2>&1
           GQADRV_MLA_EXPERIMENTS=1 python3 -m gqadrv bench --op mla --no-peers --rounds 3 --reps 10 \
             --mla-also narrow16_bal_nopl2 narrow16_bal_cut32 narrow16_bal_cut32_nopl2 --mla-rows 128,1,16,4096 \
             128,1,16,32768 128,1,16,8192,spread 128,1,16,4096,skew 128,1,16,8192,varlen \
             --json "$OUT/mla_pl2_16.json" > "$OUT/mla_pl2_16.txt" 2>&1 ;;
  mla_trace) # per-CTA timelines of the balanced MLA kernels (tools/mla_trace.py, MLA_TRACE builds): whether the
             # same SMs stream slowest in every launch, the cut mode's epilogues and merges; raw stamps kept
             GQADRV_MLA_EXPERIMENTS=1 python3 tools/mla_trace.py 128,1,16,4096 128,1,64,4096 128,1,64,8192,spread \
               --backends narrow16_bal,narrow16_bal_cut32 seesaw_bal,seesaw_bal_cut32 --launches 3 \
               --json "$OUT/mla_trace.json" > "$OUT/mla_trace.txt" 2>&1 ;;
  layouts) # the layout-keyed convenience plans (GQA, MLA, jax.jit's XLA buffers) and the files whose second
           # calls take them (the MLA grid, torch / JAX integrations)
           python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider -rf tests/gqa/test_layout_cache_gpu.py \
             tests/mla/test_mla_layout_cache_gpu.py tests/gqa/test_paged_layout_cache_gpu.py tests/gqa/test_merge_layout_cache_gpu.py \
             tests/gqa/test_merge_gpu.py tests/mla/test_mla_gpu.py \
             tests/gqa/test_paged_gpu.py tests/integrations/test_jax_gpu.py tests/integrations/test_jax_paged_gpu.py \
             tests/integrations/test_torch_gpu.py tests/integrations/test_torch_paged_gpu.py > "$OUT/layouts.log" 2>&1
           { grep -E "^(FAILED|ERROR)" "$OUT/layouts.log" | head -40; tail -3 "$OUT/layouts.log"; } > "$OUT/layouts.txt"
           rm -f "$OUT/layouts.log" ;;
  host) python3 tools/profile_convenience.py --json "$OUT/host.json" > "$OUT/host.txt" 2>&1 ;;
  family) # layout families of gqa_decode: their GPU tests, the host cost per framework and the member
          # path's steps (tools/profile_family_steps.py)
          python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider -rf tests/gqa/test_layout_family_gpu.py \
            tests/gqa/test_layout_cache_gpu.py > "$OUT/family_tests.txt" 2>&1
          python3 tools/profile_convenience.py --frameworks cupy,torch --calls 500 --rounds 3 --layouts 64 \
            --json "$OUT/family_host.json" > "$OUT/family_host.txt" 2>&1
          python3 tools/profile_family_steps.py cupy torch > "$OUT/family_steps.txt" 2>&1 ;;
  mla_varlen) # the MLA rows of unequal lengths with FlashInfer's page lists (mla.bench.flashinfer_csr)
              PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} python3 -m gqadrv bench --op mla --rounds 2 --reps 10 \
                --mla-rows 128,1,128,8192,varlen 128,1,16,8192,varlen 128,1,64,8192,spread 128,1,16,4096,skew \
                --json "$OUT/mla_varlen.json" > "$OUT/mla_varlen.txt" 2>&1 ;;
  prefill_bench) PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} python3 -m gqadrv bench --op mla_sparse_prefill --reps 5 \
                  --graph-calls 5 --rounds 3 --json "$OUT/prefill_bench.json" > "$OUT/prefill_bench.txt" 2>&1 ;;
  prefill_ab) GQADRV_MLA_EXPERIMENTS=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
                "tests/mla/test_mla_experiments_gpu.py::test_prefill_builds_agree" > "$OUT/prefill_ab_tests.txt" 2>&1
              GQADRV_MLA_EXPERIMENTS=1 python3 -m gqadrv bench --op mla_sparse_prefill --no-peers --reps 5 --graph-calls 5 \
                --rounds 3 --mla-sparse-prefill-also seesaw_bal_cp_bt0 \
                --json "$OUT/prefill_ab.json" > "$OUT/prefill_ab.txt" 2>&1 ;;
  prefill_ncu) # Nsight Compute on the sparse prefill's dense kernel and on FlashMLA's (run fmla first) at h_q 64
               # d512 topk 512 and h_q 128 d576 topk 2048 (s_q 1024), s_kv 8K, sink: speed of light, memory,
               # pipes, warp states (benchmarks/ncu_prefill_target.py)
               NCU=$(find_ncu)
               if [ -z "$NCU" ]; then echo "ncu not found (PATH, /usr/local/cuda*/bin)" > "$OUT/prefill_ncu.txt"; continue; fi
               for spec in "4096,64,512,512,8192,,1:mla_dense_decode_seesaw" "4096,64,512,512,8192,flashmla,1:sparse_attn_fwd" \
                           "1024,128,576,2048,8192,,1:mla_dense_decode_seesaw" "1024,128,576,2048,8192,flashmla,1:sparse_attn_fwd"; do
                 echo "=== ${spec%%:*}"
                 PYTHONPATH=$PYTHONPATH${FMLA:+:$FMLA} "$NCU" --clock-control none -k "regex:${spec#*:}" --launch-skip 1 \
                   --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                   --section SchedulerStats --section WarpStateStats --section Occupancy \
                   python3 benchmarks/ncu_prefill_target.py "${spec%%:*}" 2>&1 | grep -v "^==PROF=="
               done > "$OUT/prefill_ncu.txt" 2>&1 ;;
  mla_modes) python3 tools/mla_launch_modes.py --json "$OUT/mla_modes.json" > "$OUT/mla_modes.txt" 2>&1 ;;
  mla_sanitize) for t in memcheck racecheck; do
                  compute-sanitizer --tool $t --report-api-errors no --error-exitcode 9 \
                    python3 tools/sanitize_routes.py --mla-only > "$OUT/mla_$t.log" 2>&1
                  echo "$t rc $?"; grep -E "FAIL|SUMMARY" "$OUT/mla_$t.log"
                done > "$OUT/mla_sanitize.txt" 2>&1 ;;
  paged_tests) # issue #17's GPU files: the paged oracle grid, merge, invariance, graphs, status, layout caches,
               # torch / JAX interop of the paged ops (run before paged_bench and paged_sanitize on an H200)
               python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider tests/gqa/test_paged_gpu.py \
                 tests/gqa/test_merge_gpu.py tests/gqa/test_paged_layout_cache_gpu.py tests/gqa/test_merge_layout_cache_gpu.py \
                 tests/integrations/test_torch_paged_gpu.py tests/integrations/test_jax_paged_gpu.py > "$OUT/paged_tests.txt" 2>&1 ;;
  fp8_tests) # issue #18's GQA / format GPU files: FP8 paged grid, the quantizers, the 656-byte MLA format, interop
             python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider tests/gqa/test_paged_fp8_gpu.py \
               tests/gqa/test_kv_fp8_gpu.py tests/ops/test_fp8_codec_gpu.py tests/mla/test_fp8_cache_gpu.py \
               tests/integrations/test_torch_fp8_gpu.py tests/integrations/test_jax_fp8_gpu.py > "$OUT/fp8_tests.txt" 2>&1 ;;
  paged_bench) python3 -m gqadrv bench --op gqa_paged --reps 10 --json "$OUT/paged_bench.json" \
                 > "$OUT/paged_bench.txt" 2>&1 ;;
  fp8_bench) python3 -m gqadrv bench --op gqa_fp8 --reps 10 --json "$OUT/fp8_bench.json" \
               > "$OUT/fp8_bench.txt" 2>&1 ;;
  step_bench) python3 -m gqadrv bench --op gqa_step --reps 10 --json "$OUT/step_bench.json" \
                > "$OUT/step_bench.txt" 2>&1 ;;
  paged_sanitize) for t in memcheck racecheck; do
                    compute-sanitizer --tool $t --report-api-errors no --error-exitcode 9 \
                      python3 tools/sanitize_routes.py --paged-only > "$OUT/paged_$t.log" 2>&1
                    echo "$t rc $?"; grep -E "FAIL|SUMMARY" "$OUT/paged_$t.log"
                  done > "$OUT/paged_sanitize.txt" 2>&1 ;;
  paged_tune) python3 tools/paged_tune.py > "$OUT/paged_tune.txt" 2>&1 ;;
  tmap) # tensor maps written from learned class layouts (the default; GQADRV_TMAP_PATCH=0 turns it off): the GPU
        # test against the driver, the layout-plan GPU files, and the host cost per framework off / on / off / on
        python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider tests/runtime/test_tmap_geometry_gpu.py \
          > "$OUT/tmap_tests.txt" 2>&1
        python3 -m pytest -q -m gpu --timeout=150 -p no:cacheprovider tests/gqa/test_layout_family_gpu.py \
          tests/gqa/test_layout_cache_gpu.py tests/gqa/test_paged_layout_cache_gpu.py tests/mla/test_mla_layout_cache_gpu.py \
          >> "$OUT/tmap_tests.txt" 2>&1
        for r in 1 2; do for p in 0 1; do
          GQADRV_TMAP_PATCH=$p python3 tools/profile_convenience.py --frameworks cupy,torch --calls 300 --rounds 3 \
            --layouts 64 --label "patch=$p" --json "$OUT/tmap_host${p}_$r.json" > "$OUT/tmap_host${p}_$r.txt" 2>&1
        done; done ;;
  short_rows) # the short route's rows (B1 C64 at lengths 1, 33, 64 and a full B8 row) with FlashInfer, three
              # rounds (docs/GQA.md, "Start of the short kernel"; ~1 min). On a fresh machine FlashInfer JIT-builds
              # its decode module in the first bench that uses it (more than 50 s, 2026-12-07): no time limit here
              for r in 1 2 3; do
                python3 -m gqadrv bench --reps 10 --no-geometry \
                  --only "1,64,[1]" "1,64,[33]" "1,64,[64]" "8,64,[64;64;64;64;64;64;64;64]" \
                  --json "$OUT/short_rows_$r.json" > "$OUT/short_rows_$r.txt" 2>&1
              done ;;
  mla_fp8_bench) python3 -m gqadrv bench --op mla_fp8 --reps 10 --json "$OUT/mla_fp8_bench.json" \
                   > "$OUT/mla_fp8_bench.txt" 2>&1 ;;
  mla_fp8_ncu) NCU=$(find_ncu)
               if [ -z "$NCU" ]; then echo "ncu not found (PATH, /usr/local/cuda*/bin)" > "$OUT/mla_fp8_ncu.txt"; continue; fi
               for k in mla_dense_decode_seesaw_fp8 mla_dense_decode_seesaw_tma; do
                 echo "=== $k"
                 "$NCU" --clock-control none -k "regex:$k" --launch-skip 1 --launch-count 1 --import-source no \
                   --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
                   --section WarpStateStats --section SourceCounters --print-details all \
                   python3 benchmarks/ncu_mla_target.py 128,64,8192 2>&1 | grep -v "^==PROF==" | grep -E \
                   "mla_dense|Duration|Throughput|Busy|Eligible|Issued|Stall|stall|Location|Sampl|cycles|DRAM|L2"
               done > "$OUT/mla_fp8_ncu.txt" 2>&1 ;;
  mla_fp8_src) NCU=$(find_ncu)
               if [ -z "$NCU" ]; then echo "ncu not found (PATH, /usr/local/cuda*/bin)" > "$OUT/mla_fp8_src.txt"; continue; fi
               for k in mla_dense_decode_seesaw_fp8 mla_dense_decode_seesaw_tma; do
                 "$NCU" --clock-control none -k "regex:$k" --launch-skip 1 --launch-count 1 --import-source yes \
                   --section SourceCounters --section WarpStateStats --page source --csv --print-source sass \
                   python3 benchmarks/ncu_mla_target.py 128,64,4096 > "$OUT/src_$k.csv" 2>/dev/null
                 echo "=== $k"; python3 tools/ncu_source_stalls.py "$OUT/src_$k.csv" --top 25
               done > "$OUT/mla_fp8_src.txt" 2>&1 ;;
  integrations) python3 -m pytest -q -m gpu --timeout=300 -p no:cacheprovider -rf tests/integrations \
                  > "$OUT/integrations.txt" 2>&1 ;;
  trace) python3 tools/trace_decode.py "1,32768" "16,4096" "1,4096,[3968]" "1,1024,[1024]" > "$OUT/trace.txt" 2>&1 ;;
  tune)  python3 benchmarks/tune.py --configs base,portable --shapes "1,32768" "1,4096,[3968]" \
           --small-splits 8,16,31 --large-splits 8,12,16,24,33 --reps 10 > "$OUT/tune.txt" 2>&1 ;;
  ncu)   NCU=$(find_ncu)
         if [ -z "$NCU" ]; then echo "ncu not found (PATH, /usr/local/cuda*/bin)" > "$OUT/ncu.txt"; continue; fi
         for shape in ${NCU_SHAPES:-"1,4096,[3968]" "1,32768" "64,4096"}; do
           echo "=== $shape"
           "$NCU" --clock-control none -k regex:gqa_decode --launch-skip 2 --launch-count 1 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
             --section SchedulerStats --section WarpStateStats --section LaunchStats \
             python3 benchmarks/ncu_target.py "$shape" 2>&1 | grep -v "^==PROF==" | grep -E \
             "gqa_decode|Duration|Throughput|Busy|Eligible|Active Warps|No Eligible|Issued Warp|Block Limit|Achieved Occ|Grid Size|Waves|Stall|cycles|Hit Rate|L2|DRAM"
         done > "$OUT/ncu.txt" 2>&1 ;;
  esac
done
grep -h "\[bench\] .*gqadrv hot" "$OUT"/short_rows_?.txt 2>/dev/null
tail -n 1 "$OUT/tmap_tests.txt" 2>/dev/null
tail -3 "$OUT/tests.txt" 2>/dev/null; tail -30 "$OUT/bench.txt" 2>/dev/null; tail -12 "$OUT/tune.txt" 2>/dev/null
tail -20 "$OUT/mla_bench.txt" 2>/dev/null; tail -1 "$OUT/fmla.txt" 2>/dev/null; tail -24 "$OUT/mla_rounds.txt" 2>/dev/null; grep -E "^\|" "$OUT/mla_routes16.txt" 2>/dev/null; cat "$OUT/mla_modes.txt" "$OUT/mla_sanitize.txt" 2>/dev/null
grep -E "^\||^- " "$OUT/paged_bench.txt" 2>/dev/null; grep -E "^\||^- " "$OUT/fp8_bench.txt" 2>/dev/null
grep -E "^\||^- " "$OUT/step_bench.txt" 2>/dev/null
grep -E "^\||^- " "$OUT/mla_fp8_bench.txt" 2>/dev/null; head -80 "$OUT/mla_fp8_ncu.txt" 2>/dev/null; head -60 "$OUT/mla_fp8_src.txt" 2>/dev/null
cat "$OUT/paged_tune.txt" 2>/dev/null; cat "$OUT/paged_sanitize.txt" 2>/dev/null
tail -4 "$OUT/integrations.txt" 2>/dev/null
# PACK=1 (for a device call, which returns at most 8 files from $OUT): more than 8 files in $OUT are replaced by
# one tarball of them, evidence.tgz (this deletes $OUT's other files: use it only on a fresh $OUT)
if [ "${PACK:-0}" = 1 ] && [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  tar czf /tmp/evidence.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/evidence.tgz "$OUT/evidence.tgz"
fi
