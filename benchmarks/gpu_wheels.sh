#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.sh installs on a GPU machine with no network:
# the project's dependencies that such a machine may lack (msgspec, pyzmq), for its
# Python (default 3.12, x86_64 Linux). Run on a machine with network; the wheels land
# in .gpu-wheels/ (git-ignored), which travels with the checkout.
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
mkdir -p .gpu-wheels
python3 -m pip download -q --only-binary=:all: --no-deps -d .gpu-wheels \
    --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    "msgspec>=0.18" "pyzmq>=26"
ls -l .gpu-wheels
