#!/usr/bin/env bash
# Run the GPU suite on the dependency set a fresh `pip install .` resolves today (cuda-bindings,
# cuda-core, cuda-pathfinder, nvidia-cuda-nvrtc), next to the pinned set of constraints/tested-h200.txt.
#
#   tools/fresh_deps_suite.sh download DIR    # on a machine with internet (any OS): wheels for CPython 3.12
#                                             # x86_64 into DIR; NVRTC repacked as an xz archive (the GPU
#                                             # machine takes at most 64 MiB of carried files)
#   tools/fresh_deps_suite.sh run DIR         # on the GPU machine, from the repository root: a venv over the
#                                             # image's packages with the fresh wheels in it, then the suite
set -u
cmd=${1:-}; dir=${2:-.fresh}
case "$cmd" in
download)
    mkdir -p "$dir" && cd "$dir" || exit 2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        cuda-bindings cuda-core cuda-pathfinder nvidia-cuda-nvrtc || exit 1
    rm -rf x && mkdir x && (cd x && unzip -q ../nvidia_cuda_nvrtc-*.whl) || exit 1
    (cd x && tar -cf - . | xz -9 -T0 > ../nvrtc.tar.xz) && rm -rf x nvidia_cuda_nvrtc-*.whl
    ls -la
    ;;
run)
    python3 -m venv --system-site-packages /tmp/fv
    /tmp/fv/bin/python -m pip install -q --no-deps --no-index "$dir"/*.whl || exit 1
    sp=$(/tmp/fv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    tar -xJf "$dir"/nvrtc*.tar.xz -C "$sp" || exit 1
    # the image's own package directories (numpy, cupy, pytest, torch, jax ...) after the venv's
    python3 -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
        > "$sp/zz_image_site.pth"
    export PYTHONPATH=$PWD
    /tmp/fv/bin/python -m gqadrv info | head -12
    /tmp/fv/bin/python -m pytest -q -m gpu --timeout=300 -p no:cacheprovider tests
    ;;
*)
    echo "usage: $0 download DIR | run DIR" >&2; exit 2 ;;
esac
