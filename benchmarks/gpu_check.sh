#!/usr/bin/env bash
# On a CUDA machine: the kernel tests on the GPU against the torch references, the
# greedy oracle and engine tests on the GPU, then paged-attention bandwidth, swap
# bandwidth and engine throughput. Uses the machine's own Python (torch + triton +
# transformers already installed); set PYTHON to pick another.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
step() { echo; echo "== $*"; "$@" || status=1; }
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
step env EXPEDITOR_GPU_TESTS=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -m gpu
step env EXPEDITOR_GPU_TESTS=1 EXPEDITOR_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_oracle.py tests/test_engine.py tests/test_sampler.py
step "$PY" benchmarks/attention_bandwidth.py
step "$PY" benchmarks/swap_bandwidth.py --device cuda
step "$PY" benchmarks/swap_bandwidth.py --device cuda --scattered
step "$PY" benchmarks/engine_throughput.py --device cuda
exit $status
