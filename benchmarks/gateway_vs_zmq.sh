#!/usr/bin/env bash
# The HTTP gateway against the ZeroMQ client library, same workload, same settings:
# `expeditor serve --http` driven through `--target openai:URL` (streamed completions,
# token-id prompts) and `--target expeditor` (serve started by the bench, streamed
# through ipc.AsyncClient; the --http server stays up meanwhile, idle), in one
# `expeditor bench` run per round, R rounds; prints
# each round and the median ratio of output tokens/s.
#
#   bash benchmarks/gateway_vs_zmq.sh [tiny|small]      (from the repository root)
#
# Environment (defaults in brackets): N [1024] requests, R [3] rounds, SEQS [64]
# max_num_seqs, WORKLOAD [skewed], OUT [out/gateway] for the JSON reports.
set -euo pipefail

cd "$(dirname "$0")/.."
SIZE=${1:-tiny}
N=${N:-1024}
R=${R:-3}
SEQS=${SEQS:-64}
WORKLOAD=${WORKLOAD:-skewed}
OUT=${OUT:-out/gateway}
PY=.venv/bin/python
EXPEDITOR=.venv/bin/expeditor
[[ -x $EXPEDITOR ]] || { echo "no $EXPEDITOR: set up the project's .venv first (./run setup)" >&2; exit 1; }
mkdir -p "$OUT"
# shellcheck source=benchmarks/openai_servers.sh
source benchmarks/openai_servers.sh # servers stopped on exit

DIR=$(checkpoint_dir "$SIZE")
PORT=$(free_port)
URL=http://127.0.0.1:$PORT
# The settings the bench gives the server it starts for --target expeditor.
start_server "$OUT/serve.log" "$EXPEDITOR" serve --model "$DIR" --http "127.0.0.1:$PORT" \
    --num-gpu-blocks 2048 --max-num-seqs "$SEQS" --device cpu
wait_ready "$URL" "$SERVER_PID" "$OUT/serve.log"
for round in $(seq 1 "$R"); do
    "$EXPEDITOR" bench --model "$DIR" --workload "$WORKLOAD" --num-requests "$N" \
        --max-num-seqs "$SEQS" --target "openai:$URL" --target expeditor --json \
        >"$OUT/round$round.json"
done
"$PY" - "$OUT" "$R" <<'PYEOF' | tee "$OUT/summary.txt"
import json
import statistics
import sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
ratios = []
for index in range(1, rounds + 1):
    http, zmq = json.loads((out / f"round{index}.json").read_text())["results"]
    ratio = http["output_throughput"] / zmq["output_throughput"]
    ratios.append(ratio)
    print(
        f"round {index}: gateway {http['output_throughput']:.0f} tok/s "
        f"(TTFT p99 {http['ttft_ms']['p99']:.0f} ms), ZeroMQ client "
        f"{zmq['output_throughput']:.0f} tok/s (TTFT p99 {zmq['ttft_ms']['p99']:.0f} ms): "
        f"{ratio:.2f}x"
    )
print(f"median gateway / ZeroMQ client: {statistics.median(ratios):.2f}x over {rounds} rounds")
PYEOF
