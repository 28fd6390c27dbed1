#!/usr/bin/env bash
# Throughput of serve --data-parallel-size 2 against one replica, side by side: the same
# expeditor bench workload (skewed, token-id prompts over the OpenAI API) against
# `serve --http` with 1 and 2 replicas, interleaved over ROUNDS rounds; medians.
#
#   benchmarks/data_parallel.sh      # figures: docs/benchmarks.md "Data-parallel replicas"
#
# Settings (environment): SIZE (tiny | small, the generated checkpoint; small), ROUNDS
# (3), REQUESTS (128), CONCURRENCY (32), PORT (18400). On a machine with N cores each of
# two replicas gets N/2 threads; on GPUs each its own (CUDA_VISIBLE_DEVICES split).
set -euo pipefail
cd "$(dirname "$0")/.."
./run setup
SIZE=${SIZE:-small}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-128}
CONCURRENCY=${CONCURRENCY:-32}
PORT=${PORT:-18400}
OUT=out/data_parallel
mkdir -p "$OUT"
rm -f "$OUT/results.jsonl"
MODEL="$OUT/$SIZE"
[ -f "$MODEL/config.json" ] || .venv/bin/expeditor make-tiny-model --size "$SIZE" "$MODEL" >/dev/null
SERVE_PID=
trap '[ -n "$SERVE_PID" ] && kill -TERM "$SERVE_PID" 2>/dev/null; wait' EXIT

for round in $(seq "$ROUNDS"); do
  for dp in 1 2; do
    .venv/bin/expeditor serve --model "$MODEL" --http "127.0.0.1:$PORT" \
      --data-parallel-size "$dp" > "$OUT/serve-dp$dp.log" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq 1200); do
      curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break
      sleep 0.1
    done
    .venv/bin/expeditor bench --workload skewed --num-requests "$REQUESTS" --model "$MODEL" \
      --target "openai:http://127.0.0.1:$PORT[api=completions,max_concurrency=$CONCURRENCY]" \
      --json | .venv/bin/python -c "
import json, sys
report = json.load(sys.stdin)
(entry,) = report['results']
print(json.dumps({'dp': $dp, 'round': $round, 'output_tok_s': entry['output_throughput'],
                  'ttft_mean_ms': entry['ttft_ms']['mean']}))" | tee -a "$OUT/results.jsonl"
    kill -TERM "$SERVE_PID"
    wait "$SERVE_PID" || true
    SERVE_PID=
  done
done

.venv/bin/python - "$OUT/results.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
median = {dp: statistics.median(r["output_tok_s"] for r in rows if r["dp"] == dp) for dp in (1, 2)}
print(f"replicas 1: {median[1]:.1f} out tok/s, replicas 2: {median[2]:.1f} out tok/s, "
      f"ratio {median[2] / median[1]:.2f}x (medians of {len(rows) // 2} rounds)")
EOF
