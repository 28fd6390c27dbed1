#!/usr/bin/env bash
# Side by side over HTTP: `transformers serve` (continuous batching, CPU) and
# `expeditor serve --http`, both driven by the same `expeditor bench --target openai:URL`
# workload, so each is measured as an OpenAI client sees it.
#
#   bash benchmarks/peer_openai.sh [tiny|small]      (from the repository root)
#
# Environment (defaults in brackets):
#   N [64]            requests in the workload          C [16]   max_concurrency
#   WORKLOAD [skewed] expeditor bench --workload        SEED [0] --seed
#   WARMUP [8]        requests of an unmeasured run against each server first (0: none)
#   OUT [out/peer]    where the JSON results, server logs and summary.txt go
#   MODEL [-]         a checkpoint directory instead of the embedded preset
#   HF_THREADS [1]    OMP_NUM_THREADS of transformers serve (empty: torch's default)
#   HF_PORT, EXP_PORT [free ports]                      PYTHON [python3] for .venv-peer
#   SKIP_EXPEDITOR [0] 1: measure transformers serve only
#   READY_TIMEOUT [300] seconds a server may take to answer GET /v1/models
#
# Needs the project's .venv (expeditor bench, expeditor serve). Makes .venv-peer (torch
# 2.13.0 CPU wheel first, so that pip does not pull a CUDA build, then transformers[serving])
# on first use. transformers serve is driven with api=chat: its /v1/completions takes only
# string prompts and refuses ignore_eos (HTTP 422).
set -euo pipefail

cd "$(dirname "$0")/.."
SIZE=${1:-tiny}
N=${N:-64}
C=${C:-16}
WORKLOAD=${WORKLOAD:-skewed}
SEED=${SEED:-0}
WARMUP=${WARMUP:-8}
OUT=${OUT:-out/peer}
HF_THREADS=${HF_THREADS-1}
SKIP_EXPEDITOR=${SKIP_EXPEDITOR:-0}
PY=.venv/bin/python
EXPEDITOR=.venv/bin/expeditor

[[ -x $EXPEDITOR ]] || { echo "no $EXPEDITOR: set up the project's .venv first" >&2; exit 1; }
case $SIZE in tiny | small) ;; *) echo "usage: $0 [tiny|small]" >&2; exit 2 ;; esac
mkdir -p "$OUT"
# shellcheck source=benchmarks/openai_servers.sh
source benchmarks/openai_servers.sh # servers stopped on exit

bench() { # NAME TARGET: the measured run into $OUT/NAME.json, after a warm-up run
    local name=$1 target=$2
    if ((WARMUP > 0)); then
        "$EXPEDITOR" bench --model "$DIR" --workload "$WORKLOAD" --num-requests "$WARMUP" \
            --seed $((SEED + 1)) --target "$target" --json >"$OUT/$name.warmup.json"
    fi
    echo "bench: $name: $target"
    "$EXPEDITOR" bench --model "$DIR" --workload "$WORKLOAD" --num-requests "$N" \
        --seed "$SEED" --target "$target" --json >"$OUT/$name.json"
}

DIR=$(checkpoint_dir "$SIZE")
echo "model: $DIR"

# -- transformers serve ------------------------------------------------------------------
ensure_peer_venv
echo "transformers $(.venv-peer/bin/python -c 'import transformers; print(transformers.__version__)')"
HF_PORT=${HF_PORT:-$(free_port)}
HF_URL=http://127.0.0.1:$HF_PORT
start_transformers_serve "$DIR" "$HF_PORT" "$OUT/transformers-serve.log"
HF_PID=$SERVER_PID
wait_ready "$HF_URL" "$HF_PID" "$OUT/transformers-serve.log"
RUNS=(transformers-serve-chat)
bench transformers-serve-chat "openai:$HF_URL[api=chat,max_concurrency=$C]"
stop_server "$HF_PID"

# -- expeditor serve --http (the OpenAI gateway) -------------------------------------------
if [[ $SKIP_EXPEDITOR == 1 ]]; then
    echo "SKIP_EXPEDITOR=1: expeditor serve not measured"
elif ! has_http_gateway; then
    echo "this expeditor serve has no --http: expeditor not measured" >&2
else
    EXP_PORT=${EXP_PORT:-$(free_port)}
    EXP_URL=http://127.0.0.1:$EXP_PORT
    start_expeditor_serve "$DIR" "$EXP_PORT" "$OUT/expeditor-serve.log"
    EXP_PID=$SERVER_PID
    wait_ready "$EXP_URL" "$EXP_PID" "$OUT/expeditor-serve.log"
    RUNS+=(expeditor-chat expeditor-completions)
    bench expeditor-chat "openai:$EXP_URL[api=chat,max_concurrency=$C]"
    bench expeditor-completions "openai:$EXP_URL[max_concurrency=$C]"
    stop_server "$EXP_PID"
fi

# -- the table ---------------------------------------------------------------------------
"$PY" - "$OUT" "${RUNS[@]}" <<'EOF' | tee "$OUT/summary.txt"
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
rows = []
for name in names:
    report = json.loads((out / f"{name}.json").read_text())
    [result] = report["results"]
    rows.append((name, result))
first = rows[0][1]
print(
    f"{report['workload']}, {report['num_requests']} requests, seed {report['seed']}, "
    f"model {report['model']}"
)
print(f"{'target':<26}{'out tok/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
      f"{'E2E p99 ms':>12}{'out tokens':>12}{'vs transformers':>17}")
for name, r in rows:
    ttft = r["ttft_ms"] or {}
    e2e = r["e2e_ms"] or {}
    ratio = r["output_throughput"] / first["output_throughput"] if first["output_throughput"] else 0
    print(
        f"{name:<26}{r['output_throughput']:>10.0f}{ttft.get('p50', float('nan')):>13.1f}"
        f"{ttft.get('p99', float('nan')):>13.1f}{e2e.get('p99', float('nan')):>12.0f}"
        f"{r['total_output_tokens']:>12}{ratio:>16.2f}x"
    )
for name, r in rows:
    for note in r["notes"]:
        if any(word in note for word in ("failed", "not applied", "ended before")):
            print(f"{name}: {note}")
EOF
