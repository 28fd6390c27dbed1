# Helpers for the HTTP benchmark scripts (peer_openai.sh, sglang_bench.sh,
# gateway_vs_zmq.sh): sourced, not run.
# Expects the caller to be at the repository root with `set -euo pipefail`, and PY set to
# the project's python (.venv/bin/python).

READY_TIMEOUT=${READY_TIMEOUT:-300}
SERVER_PIDS=()

stop_server() { # PID: SIGTERM, then SIGKILL to its process group after 10 s
    local pid=$1
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL -- "-$pid" 2>/dev/null || true # whatever its group still holds
    wait "$pid" 2>/dev/null || true
}

stop_servers() {
    local pid
    for pid in "${SERVER_PIDS[@]}"; do stop_server "$pid"; done
}
trap stop_servers EXIT
trap 'exit 130' INT TERM

start_server() { # LOG CMD...: CMD in a session (and process group) of its own; sets SERVER_PID
    local log=$1
    shift
    setsid "$@" >"$log" 2>&1 &
    SERVER_PID=$!
    SERVER_PIDS+=("$SERVER_PID")
}

wait_ready() { # URL PID LOG: until GET URL/v1/models answers
    local url=$1 pid=$2 log=$3 waited=0
    until "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "$url/v1/models" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "server exited before answering $url/v1/models; end of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        if ((waited >= READY_TIMEOUT)); then
            echo "$url/v1/models did not answer in ${READY_TIMEOUT}s; end of $log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "ready: $url (${waited}s)"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

checkpoint_dir() { # SIZE: $MODEL if set, else the preset `expeditor bench --model SIZE` uses
    if [[ -n ${MODEL:-} ]]; then
        (cd "$MODEL" && pwd)
        return
    fi
    # No CLI command prints a preset's directory: ask the function behind
    # `expeditor bench --model tiny|small`, which builds the cached checkpoint if absent.
    "$PY" -c 'import sys
from gpu_worker.tiny_model import default_model_dir
print(default_model_dir(sys.argv[1]))' "$1"
}

ensure_peer_venv() { # .venv-peer with transformers serve (torch's CPU wheel first)
    if [[ ! -x .venv-peer/bin/transformers ]]; then
        echo "making .venv-peer (torch 2.13.0, then transformers[serving])"
        "${PYTHON:-python3}" -m venv .venv-peer
        .venv-peer/bin/pip install --quiet torch==2.13.0
        .venv-peer/bin/pip install --quiet "transformers[serving]"
    fi
}

start_transformers_serve() { # DIR PORT LOG: sets SERVER_PID
    local env=(env HF_HUB_OFFLINE=1)
    [[ -n ${HF_THREADS-1} ]] && env+=("OMP_NUM_THREADS=${HF_THREADS-1}")
    start_server "$3" "${env[@]}" .venv-peer/bin/transformers serve "$1" \
        --host 127.0.0.1 --port "$2" --device cpu --continuous-batching
}

has_http_gateway() {
    "$EXPEDITOR" serve --help | grep -q -- "--http"
}

start_expeditor_serve() { # DIR PORT LOG: sets SERVER_PID
    start_server "$3" "$EXPEDITOR" serve --model "$1" --http "127.0.0.1:$2"
}
