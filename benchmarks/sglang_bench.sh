#!/usr/bin/env bash
# An external load generator against an OpenAI-compatible server: SGLang's
# `python -m sglang.bench_serving` (backend sglang-oai-chat, random token-id prompts),
# run from its own venv, against `expeditor serve --http` (or, SERVER=transformers,
# `transformers serve` as in peer_openai.sh). No GPU needed.
#
#   bash benchmarks/sglang_bench.sh [tiny|small]      (from the repository root)
#
# Environment (defaults in brackets):
#   SERVER [expeditor]  expeditor | transformers (.venv-peer, made as peer_openai.sh does)
#   NUM_PROMPTS [32]  MAX_CONCURRENCY [8]  INPUT_LEN [128]  OUTPUT_LEN [32]
#   SGLANG_ARGS []    more bench_serving flags, e.g. "--random-range-ratio 1" (lengths are
#                     drawn uniformly from [ratio*len, len]; sglang 0.5.1.post3's default
#                     ratio is 0.0, so prompts are 1..INPUT_LEN and outputs 0..OUTPUT_LEN
#                     tokens)
#   OUT [out/sglang]  bench_serving's --output-file (sglang-$SERVER.jsonl) and its printout
#                     (sglang-$SERVER.txt), with the server's log
#   MODEL [-]         a checkpoint directory instead of the embedded preset
#   PORT [a free port]  HF_THREADS [1] (transformers serve)  PYTHON [python3] for the venvs
#
# Makes .venv-sglang on first use: torch 2.13.0 (the CPU wheel) first, then
# sglang==0.5.1.post3 and pybase64; the plain sglang package does not bring what
# sglang.bench_serving imports (transformers, and pydantic through sglang/__init__), so
# those are installed too.
set -euo pipefail

cd "$(dirname "$0")/.."
SIZE=${1:-tiny}
SERVER=${SERVER:-expeditor}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-32}
SGLANG_ARGS=${SGLANG_ARGS:-}
OUT=${OUT:-out/sglang}
PY=.venv/bin/python
EXPEDITOR=.venv/bin/expeditor

[[ -x $EXPEDITOR ]] || { echo "no $EXPEDITOR: set up the project's .venv first" >&2; exit 1; }
case $SIZE in tiny | small) ;; *) echo "usage: $0 [tiny|small]" >&2; exit 2 ;; esac
case $SERVER in expeditor | transformers) ;; *) echo "SERVER: expeditor | transformers" >&2; exit 2 ;; esac
mkdir -p "$OUT"
# shellcheck source=benchmarks/openai_servers.sh
source benchmarks/openai_servers.sh # servers stopped on exit

if ! .venv-sglang/bin/python -c 'import sglang.bench_serving' 2>/dev/null; then
    echo "making .venv-sglang (torch 2.13.0, then sglang 0.5.1.post3)"
    [[ -x .venv-sglang/bin/python ]] || "${PYTHON:-python3}" -m venv .venv-sglang
    .venv-sglang/bin/pip install --quiet torch==2.13.0
    .venv-sglang/bin/pip install --quiet sglang==0.5.1.post3 pybase64
    .venv-sglang/bin/pip install --quiet transformers pydantic
    .venv-sglang/bin/python -c 'import sglang.bench_serving'
fi
echo "sglang $(.venv-sglang/bin/python -c 'import sglang; print(sglang.__version__)')"

DIR=$(checkpoint_dir "$SIZE")
echo "model: $DIR"
PORT=${PORT:-$(free_port)}
URL=http://127.0.0.1:$PORT
if [[ $SERVER == transformers ]]; then
    ensure_peer_venv
    start_transformers_serve "$DIR" "$PORT" "$OUT/transformers-serve.log"
    LOG=$OUT/transformers-serve.log
else
    has_http_gateway || { echo "this expeditor serve has no --http" >&2; exit 1; }
    start_expeditor_serve "$DIR" "$PORT" "$OUT/expeditor-serve.log"
    LOG=$OUT/expeditor-serve.log
fi
wait_ready "$URL" "$SERVER_PID" "$LOG"

# bench_serving sends one warm-up request before measuring (enough for transformers
# serve's slow first request). Its summary goes to stdout; --output-file appends a JSON line.
# shellcheck disable=SC2086 # SGLANG_ARGS is a list of flags
HF_HUB_OFFLINE=1 .venv-sglang/bin/python -m sglang.bench_serving \
    --backend sglang-oai-chat --base-url "$URL" --model "$DIR" --tokenizer "$DIR" \
    --dataset-name random-ids --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --num-prompts "$NUM_PROMPTS" --max-concurrency "$MAX_CONCURRENCY" \
    --output-file "$OUT/sglang-$SERVER.jsonl" $SGLANG_ARGS 2>&1 | tee "$OUT/sglang-$SERVER.txt"
stop_server "$SERVER_PID"
grep -q "Successful requests" "$OUT/sglang-$SERVER.txt" || {
    echo "bench_serving printed no result: see $OUT/sglang-$SERVER.txt" >&2
    exit 1
}
echo "results: $OUT/sglang-$SERVER.jsonl, $OUT/sglang-$SERVER.txt"
