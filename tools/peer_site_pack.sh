#!/usr/bin/env bash
# Pack the FlashInfer peer (the wheels that ../shared/tools/peer_wheels.sh downloads into .whl/) as one
# unpacked, trimmed site folder in .fisite.tgz (~29 MB instead of ~62 MiB of wheels), so that it fits the
# device call's 64 MiB carry beside the working tree. Removed: the JIT sources of kernel families that the
# benchmarks never build (FlashInfer's MoE, sampling, GEMM, linear-attention and vendor-specific folders
# under flashinfer/data/csrc); the Python package and the attention / page / norm sources stay, so
# `import flashinfer` and its decode, paged-decode and MLA wrappers JIT-compile as from the wheels.
# On the GPU machine (tools/gpu_evidence.sh does it when .fisite.tgz is carried):
#   mkdir -p /tmp/site && tar xzf .fisite.tgz -C /tmp/site && export PYTHONPATH=$PYTHONPATH:/tmp/site
set -euo pipefail
src=${1:-.whl}
out=${2:-.fisite.tgz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shopt -s nullglob
whls=("$src"/*.whl)
[ ${#whls[@]} -gt 0 ] || { echo "no wheels in $src (run ../shared/tools/peer_wheels.sh first)" >&2; exit 2; }
for w in "${whls[@]}"; do python3 -m zipfile -e "$w" "$tmp"; done
csrc="$tmp/flashinfer/data/csrc"
if [ -d "$csrc" ]; then
  rm -rf "$csrc"/cake_* "$csrc"/kda "$csrc"/fused_moe "$csrc"/gdn "$csrc"/blackwell_* "$csrc"/nv_internal \
         "$csrc"/alphamoe*
fi
tar czf "$out" -C "$tmp" .
ls -la "$out"
