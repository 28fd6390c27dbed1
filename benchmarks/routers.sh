#!/usr/bin/env bash
# expeditor replicas behind the routers fleets run, on loopback, side by side in one run:
# vllm-router (round_robin; kv_aware fed by expeditor's KV events, found through the
# replicas' /get_server_info and /kv_event_sources; cache_aware, its approximate tree on
# the request text) and SGLang's model gateway smg
# (round_robin, cache_aware on the request text), each in rounds, the policies
# interleaved, a fresh set of tenants per run (so no run finds another's prefixes).
# Then a replica is SIGKILLed under load behind vllm-router (kv_aware).
#
#   benchmarks/routers.sh            # figures: docs/benchmarks.md "Routers"
#
# Settings (environment): SIZE (the generated checkpoint: tiny, or small whose forward
# costs something), REPLICAS (4), ROUNDS (3), BLOCKS (KV blocks per replica, 512),
# TENANTS (14), PREFIX_CHARS (1800: about 113 blocks of 16 tokens each, so the tenants'
# prefixes are 3x one replica's cache), REQUESTS (192), CONCURRENCY (8), MAX_TOKENS (16),
# STREAM (1: streamed completions, as chat clients send them; 0: whole answers, which
# vllm-router's kv_aware counts as prefill until they end), SETUPS (the ROUTER/POLICY
# pairs run each round, in order), KILL (1: end with the replica-kill phase).
# The routers come from the registry into their own venv (.venv-routers), apart from
# the project's. Logs and JSON results: out/routers/.
set -euo pipefail
cd "$(dirname "$0")/.."
./run setup
SIZE=${SIZE:-tiny}
REPLICAS=${REPLICAS:-4}
ROUNDS=${ROUNDS:-3}
BLOCKS=${BLOCKS:-512}
TENANTS=${TENANTS:-14}
PREFIX_CHARS=${PREFIX_CHARS:-1800}
REQUESTS=${REQUESTS:-192}
CONCURRENCY=${CONCURRENCY:-8}
MAX_TOKENS=${MAX_TOKENS:-16}
STREAM=${STREAM:-1}
SETUPS=${SETUPS:-vllm-router/round_robin vllm-router/kv_aware vllm-router/cache_aware smg/round_robin smg/cache_aware}
KILL=${KILL:-1}
HTTP0=${HTTP0:-18100}
EVENTS0=${EVENTS0:-18200}
ROUTER_PORT=${ROUTER_PORT:-18300}
PROM_PORT=${PROM_PORT:-18301}
OUT=out/routers
RV=.venv-routers
mkdir -p "$OUT"
rm -f "$OUT"/results.jsonl

if [ ! -x "$RV/bin/vllm-router" ] || [ ! -x "$RV/bin/smg" ]; then
  python3 -m venv "$RV"
  "$RV/bin/pip" install -q "vllm-router==0.1.17" "smg==1.13.0"
fi

MODEL="$OUT/$SIZE"
[ -f "$MODEL/config.json" ] || .venv/bin/expeditor make-tiny-model --size "$SIZE" "$MODEL" >/dev/null
NAME=$SIZE
PIDS=()
cleanup() {
  for pgid in "${PIDS[@]}" "${ROUTER_PID:-}"; do
    [ -n "$pgid" ] && kill -TERM -- "-$pgid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT

wait_http() {  # URL PATH: until it answers 200 (60 s)
  for _ in $(seq 600); do
    curl -sf -o /dev/null "$1$2" && return 0
    sleep 0.1
  done
  echo "routers.sh: $1$2 never answered" >&2
  return 1
}

start_replica() {  # INDEX: one expeditor serve, its own session (process group)
  local i=$1
  setsid .venv/bin/expeditor serve --model "$MODEL" --served-model-name "$NAME" \
    --http "127.0.0.1:$((HTTP0 + i))" --kv-events-endpoint "tcp://127.0.0.1:$((EVENTS0 + i))" \
    --num-gpu-blocks "$BLOCKS" --block-size 16 --cpu-threads 1 \
    > "$OUT/replica$i.log" 2>&1 &
  PIDS[$i]=$!
}

URLS=()
for i in $(seq 0 $((REPLICAS - 1))); do
  start_replica "$i"
  URLS+=("http://127.0.0.1:$((HTTP0 + i))")
done
for url in "${URLS[@]}"; do wait_http "$url" /health; done
REPLICA_LIST=$(IFS=,; echo "${URLS[*]}")
ROUTER="http://127.0.0.1:$ROUTER_PORT"

port_free() {  # PORT: until nothing listens there (the last router may still be exiting)
  for _ in $(seq 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null || return 0
    sleep 0.1
  done
  echo "routers.sh: port $1 stays in use" >&2
  return 1
}

start_router() {  # ROUTER POLICY [extra flags]
  local router=$1 policy=$2
  shift 2
  port_free "$ROUTER_PORT"
  port_free "$PROM_PORT"
  case $router in
    vllm-router)
      setsid "$RV/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER_PORT" \
        --worker-urls "${URLS[@]}" --policy "$policy" --prometheus-port "$PROM_PORT" \
        --worker-startup-check-interval 1 --health-check-interval-secs 1 \
        --health-failure-threshold 1 --request-timeout-secs 30 --log-level warning "$@" \
        > "$OUT/router-$router-$policy.log" 2>&1 &
      ;;
    smg)
      setsid "$RV/bin/smg" launch --host 127.0.0.1 --port "$ROUTER_PORT" \
        --worker-urls "${URLS[@]}" --policy "$policy" --prometheus-host 127.0.0.1 \
        --prometheus-port "$PROM_PORT" --worker-startup-check-interval 1 \
        --health-check-interval-secs 1 --request-timeout-secs 30 --log-level warn "$@" \
        > "$OUT/router-$router-$policy.log" 2>&1 &
      ;;
  esac
  ROUTER_PID=$!
  # Ready once a completion goes through (smg registers its workers after it listens).
  for _ in $(seq 600); do
    if ! kill -0 "$ROUTER_PID" 2>/dev/null; then
      tail -5 "$OUT/router-$router-$policy.log" >&2
      echo "routers.sh: $router ($policy) exited" >&2
      return 1
    fi
    curl -sf -o /dev/null -H 'Content-Type: application/json' "$ROUTER/v1/completions" \
      -d "{\"model\":\"$NAME\",\"prompt\":\"ready?\",\"max_tokens\":1}" && return 0
    sleep 0.1
  done
  echo "routers.sh: $router ($policy) never routed a request" >&2
  return 1
}

stop_router() {
  kill -TERM -- "-$ROUTER_PID" 2>/dev/null || true
  wait "$ROUTER_PID" 2>/dev/null || true
  ROUTER_PID=
}

load() {  # LABEL SEED [extra flags]
  local label=$1 seed=$2
  shift 2
  .venv/bin/python benchmarks/routers_load.py --url "$ROUTER" --replicas "$REPLICA_LIST" \
    --model "$NAME" --label "$label" --seed "$seed" --tenants "$TENANTS" \
    --prefix-chars "$PREFIX_CHARS" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --max-tokens "$MAX_TOKENS" "$([ "$STREAM" = 1 ] && echo --stream || echo --no-stream)" \
    "$@" | tee -a "$OUT/results.jsonl"
}

seed=0
for round in $(seq "$ROUNDS"); do
  for setup in $SETUPS; do
    IFS=/ read -r router policy <<< "$setup"
    seed=$((seed + 1))
    start_router "$router" "$policy"
    load "$router/$policy" "$seed"
    stop_router
  done
done

# A replica killed under load behind vllm-router (kv_aware): its process group (serve,
# scheduler, worker, gateway) SIGKILLed after a quarter of the requests.
if [ "$KILL" = 1 ]; then
  start_router vllm-router kv_aware
  seed=$((seed + 1))
  load "kill/vllm-router/kv_aware" "$seed" --kill-pgid "${PIDS[$((REPLICAS - 1))]}" \
    --kill-after $((REQUESTS / 4)) --hang-s 60
  stop_router
fi

.venv/bin/python - "$OUT/results.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
runs = {}
for row in rows:
    runs.setdefault(row["label"], []).append(row)
print(f"\n{'router/policy':28} {'runs':>4} {'hit rate':>9} {'out tok/s':>10} "
      f"{'median lat s':>12} {'TTFT med/p90 s':>15} {'failed':>6}")
for label, group in runs.items():
    hit = statistics.median(r["hit_rate"] for r in group)
    tps = statistics.median(r["output_tok_s"] for r in group)
    lat = statistics.median(r["latency_median_s"] for r in group)
    failed = sum(r["requests"] - r["ok"] for r in group)
    if all(r.get("ttft_median_s") is not None for r in group):
        ttft = (f"{statistics.median(r['ttft_median_s'] for r in group):.3f}/"
                f"{statistics.median(r['ttft_p90_s'] for r in group):.3f}")
    else:
        ttft = "-"
    print(f"{label:28} {len(group):>4} {hit:>9.3f} {tps:>10.1f} {lat:>12.3f} {ttft:>15} "
          f"{failed:>6}")
    if label.startswith("kill/"):
        for r in group:
            print(f"  kill: {r['ok']}/{r['requests']} ok, {r['after_kill_ok']} ok after the kill, "
                  f"{r['hung']} hung, longest {r['latency_max_s']} s, share {r['share']}")
            for f in r["failures"]:
                print(f"    {f['status']}: {f.get('reason', '')[:120]}")
EOF
