"""What routers and orchestrators read from a gateway, end to end on one HTTPS
``expeditor serve --http`` (``--metrics-prefix both``): liveness apart from readiness,
/version, the render routes (the token ids generation uses, the chat template as
transformers renders it), every metric under both prefixes, cache_config_info, TLS."""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from support.kv_event_sub import drain_stored
from support.serve import running_http_serve
from transformers import AutoTokenizer

from ipc.client import Client
from scheduler_svc.launch import free_port

KV_EVENTS = f"tcp://127.0.0.1:{free_port()}"
KV_REPLAY = f"tcp://127.0.0.1:{free_port()}"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl, as an operator
    would make one)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def server(model: Path, tls_files: tuple[Path, Path]):
    cert, key = tls_files
    flags = ("--num-gpu-blocks", "64", "--metrics-prefix", "both")
    flags += ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    flags += ("--kv-events-endpoint", KV_EVENTS, "--kv-events-topic", "kv@test")
    flags += ("--kv-events-replay-endpoint", KV_REPLAY)
    with running_http_serve(model, *flags) as served:
        yield served


def _https(
    server, method: str, path: str, body: object = None, trust: Path | None = None
) -> tuple[int, bytes]:
    url = server[1]
    assert url.startswith("https://")
    host, port = url.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(trust)) if trust else None
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        payload = None if body is None else json.dumps(body).encode()
        conn.request(method, path, payload, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def call(server, tls_files):
    def send(method: str, path: str, body: object = None) -> tuple[int, object]:
        status, payload = _https(server, method, path, body, trust=tls_files[0])
        return status, json.loads(payload) if payload[:1] in (b"{", b"[") else payload

    return send


def test_https_only_and_the_certificate_is_checked(server, tls_files) -> None:
    host, port = server[1].removeprefix("https://").rsplit(":", 1)
    plain = http.client.HTTPConnection(host, int(port), timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/live")
        plain.getresponse()
    plain.close()
    with pytest.raises(ssl.SSLCertVerificationError):  # an untrusted certificate
        _https(server, "GET", "/live", trust=None)
    assert _https(server, "GET", "/live", trust=tls_files[0])[0] == 200


def test_liveness_readiness_and_version(call) -> None:
    assert call("GET", "/live") == (200, {"status": "alive"})
    status, health = call("GET", "/health")
    assert status == 200 and health["workers_ready"] == 1  # type: ignore[index]
    version = importlib.metadata.version("expeditor")
    assert call("GET", "/version") == (200, {"version": version})


def test_a_router_finds_the_kv_events_from_the_worker_url(server, call) -> None:
    """vllm-router's discovery (no static --kv-event-source): /get_server_info names
    the cache identity, /kv_event_sources the publisher, which then streams the
    prompt's blocks."""
    status, info = call("GET", "/get_server_info")
    assert status == 200
    with Client(server[0], timeout=30) as client:
        state = client.inspect()
    block_size = int(state.config["block_size"])  # type: ignore[call-overload]
    assert info["kv_block_size"] == block_size  # type: ignore[index]
    assert info["model_id"] == call("GET", "/v1/models")[1]["data"][0]["id"]  # type: ignore[index]
    assert isinstance(info["instance_id"], str) and info["instance_id"]  # type: ignore[index]
    status, sources = call("GET", "/kv_event_sources")
    assert status == 200 and list(sources) == ["0"]  # type: ignore[arg-type]
    source = sources["0"]  # type: ignore[index]
    assert source["endpoint"] == KV_EVENTS and source["topic"] == "kv@test"
    assert source["replay_endpoint"] == KV_REPLAY
    assert (source["publisher"], source["encoding"], source["schema_version"]) == (
        "zmq",
        "msgpack",
        1,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.connect(source["endpoint"])
    time.sleep(0.5)  # the subscription reaches the publisher
    prompt = list(range(40, 40 + 2 * block_size))  # two full blocks
    with Client(server[0], timeout=30) as client:
        client.generate(prompt_token_ids=prompt, max_tokens=1)
    stored = drain_stored(sub)
    sub.close(linger=0)
    ctx.term()
    assert [t for event in stored for t in event.token_ids] == prompt


def test_completions_render_gives_the_ids_generation_uses(server, call, model) -> None:
    status, models = call("GET", "/v1/models")
    name = models["data"][0]["id"]  # type: ignore[index]
    text = "The capital of France is"
    body = {"model": name, "prompt": [text, [5, 6, 7]], "max_tokens": 3, "temperature": 0}
    status, rendered = call("POST", "/v1/completions/render", body)
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 2
    with Client(server[0], timeout=30) as client:  # what the scheduler itself tokenizes
        scheduled = client.generate(text, max_tokens=1).prompt_token_ids
    assert rendered[0]["token_ids"] == scheduled
    assert rendered[1]["token_ids"] == [5, 6, 7]
    assert rendered[0]["sampling_params"]["max_tokens"] == 3
    assert rendered[0]["request_id"].startswith("cmpl-") and rendered[0]["model"] == name
    # Fields a router adds that this server does not know are listed as ignored, not
    # refused: only the ids and the checked sampling parameters matter here.
    body |= {"no_stop_trim": False, "router_hint": "x", "routing_key": 1}
    status, again = call("POST", "/v1/completions/render", body)
    assert status == 200 and again[0]["token_ids"] == scheduled
    assert again[0]["ignored_fields"] == ["router_hint", "routing_key"]
    assert "ignored_fields" not in rendered[0]
    status, error = call("POST", "/v1/completions/render", {"model": name, "prompt": "x", "n": 0})
    assert status == 400 and error["error"]["param"] == "n"  # type: ignore[index]


def test_chat_render_is_the_template_transformers_renders(call, model) -> None:
    status, rendered = call("POST", "/v1/chat/completions/render", {"messages": MESSAGES})
    assert status == 200 and isinstance(rendered, dict)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert rendered["token_ids"] == list(expected)
    status, answer = call(
        "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    )
    assert answer["usage"]["prompt_tokens"] == len(expected)  # type: ignore[index]


def test_every_metric_under_both_prefixes_with_the_cache_config(call) -> None:
    status, text = call("GET", "/metrics")
    assert status == 200 and isinstance(text, bytes)
    samples: dict[str, dict[tuple, float]] = {"expeditor:": {}, "vllm:": {}}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            prefix = sample.name.split(":", 1)[0] + ":"
            key = (sample.name.split(":", 1)[1], tuple(sorted(sample.labels.items())))
            samples[prefix][key] = sample.value
    assert samples["vllm:"] == samples["expeditor:"] and len(samples["vllm:"]) > 50
    names = {name for name, _ in samples["vllm:"]}
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket"):  # fmt: skip
        assert name in names, name
    (info,) = [dict(labels) for name, labels in samples["vllm:"] if name == "cache_config_info"]
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "64"
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"
