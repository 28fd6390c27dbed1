"""The gateway's parts without processes: request decoding and checks, chat templates
against transformers, the Prometheus rendering, the [gateway] settings."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from expeditor.gateway.chat import load_chat_template
from expeditor.gateway.metrics import render_metrics
from expeditor.gateway.protocol import (
    IGNORED,
    ChatCompletionRequest,
    CompletionRequest,
    GatewayRequestError,
    decode_body,
)
from expeditor.gateway.tools import plan_tools
from ipc.schema import HistogramData, MetricsReply, Usage
from scheduler_svc.metrics import Histogram, RequestMetrics
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig, load_gateway_config, parse_http_address


def _refused(body: bytes, kind: type = CompletionRequest) -> GatewayRequestError:
    with pytest.raises(GatewayRequestError) as info:
        decode_body(body, kind).check()
    return info.value


# -- request bodies ---------------------------------------------------------------------


def test_completion_body_becomes_sampling_params() -> None:
    body = decode_body(
        b'{"prompt": [1, 2], "max_tokens": 5, "temperature": 0, "top_k": -1, '
        b'"stop": "END", "stop_token_ids": [7], "min_tokens": 2, "ignore_eos": true, '
        b'"seed": 3, "n": 2, "logprobs": 1, "priority": -4, "user": "ignored"}',
        CompletionRequest,
    )
    params = body.check()
    assert (params.max_tokens, params.temperature, params.top_k) == (5, 0.0, 0)
    assert (params.stop, params.stop_token_ids, params.min_tokens) == (("END",), (7,), 2)
    assert (params.ignore_eos, params.seed, params.n, params.logprobs) == (True, 3, 2, 1)
    assert body.priority == -4 and body.prompts() == [[1, 2]]
    default = decode_body(b'{"prompt": "hi"}', CompletionRequest).check()
    assert default.max_tokens == 16 and default.temperature == 1.0


def test_prompt_forms() -> None:
    def prompts(raw: bytes) -> list:
        return decode_body(raw, CompletionRequest).prompts()

    assert prompts(b'{"prompt": "a"}') == ["a"]
    assert prompts(b'{"prompt": ["a", [1, 2]]}') == ["a", [1, 2]]
    assert prompts(b'{"prompt": [[3], [4, 5]]}') == [[3], [4, 5]]
    for bad in (b'{"prompt": []}', b'{"prompt": [[1], 2]}', b'{"prompt": [[]]}',
                b'{"prompt": [-1]}', b'{"prompt": [true]}', b'{"prompt": [{"a": 1}]}'):  # fmt: skip
        with pytest.raises(GatewayRequestError) as info:
            prompts(bad)
        assert info.value.param == "prompt", bad


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        (b'{"prompt": "x", "max_tokens": "2"}', "max_tokens", "expected `int | null`"),
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", ">= 1"),
        (b'{"prompt": "x", "top_p": 1.5}', "top_p", "(0, 1]"),
        (b'{"prompt": "x", "stop": [1]}', "stop", "expected `str`"),
        (b'{"prompt": "x", "frequency_penalty": 3}', "frequency_penalty", "between -2 and 2"),
        (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty", "> 0"),
        (b'{"prompt": "x", "logit_bias": {"-5": 1}}', "logit_bias", "token ids"),
        (b'{"prompt": "x", "logit_bias": {"5": -101}}', "logit_bias", "between -100 and 100"),
        (b'{"prompt": "x", "extra": 1}', "extra", "unknown field"),
        (b'{"prompt": "x", "guided_regex": 5}', "guided_regex", "expected `str | null`"),
        (b'{"prompt": "x", "guided_choice": []}', "guided_choice", "between 1 and"),
        (b'{"prompt": "x", "guided_regex": "a", "grammar": "g"}', "grammar", "one structured"),
        (
            b'{"prompt": "x", "structured_outputs": {"regex": "a", "json": {}}}',
            "structured_outputs",
            "exactly one",
        ),
        (
            b'{"prompt": "x", "structured_outputs": {"whitespace": 1}}',
            "structured_outputs",
            "unknown field",
        ),
        (b'{"prompt": "x", "response_format": {"type": "xml"}}', "response_format", "json_schema"),
        (
            b'{"prompt": "x", "response_format": {"type": "json_object", "extra": 1}}',
            "response_format",
            "unknown field 'extra'",
        ),
        (
            b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
            b'{"name": "n", "schema": {}, "strict": true, "x": 1}}}',
            "response_format",
            "unknown field 'x'",
        ),
        (
            b'{"prompt": "x", "guided_whitespace_pattern": " "}',
            "guided_whitespace_pattern",
            "not supported",
        ),
        (b'{"prompt": "x", "prompt_logprobs": 21}', "prompt_logprobs", "between 0 and 20"),
        (b'{"prompt": "x", "best_of": 3}', "best_of", "best_of == n"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix", "not supported"),
        (b'{"prompt": "x", "echo": true, "logprobs": 21}', "logprobs", "between 0 and 20"),
        (b'{"max_tokens": 1}', "prompt", "required"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options", ""),
    ],
)
def test_bad_completion_bodies_name_the_field(raw: bytes, field: str, words: str) -> None:
    error = _refused(raw)
    assert error.status == 400 and error.param == field
    assert error.message.startswith(field) and words in error.message


# Fields of OpenAI's completions and chat references and of vLLM's and llama.cpp's
# extensions, each with a value that is not the default: (field, value, outcome).
# "honoured" = it reaches the SamplingParams (or the body's own handling, BODY_FIELDS);
# "refused" = a 400 naming it; "ignored" = on the documented list of no-effect fields.
SHARED_FIELDS = [
    ("temperature", 0.5, "honoured"), ("top_p", 0.5, "honoured"), ("n", 2, "honoured"),
    ("stop", ["x"], "honoured"), ("seed", 1, "honoured"), ("max_tokens", 3, "honoured"),
    ("presence_penalty", 0.5, "honoured"), ("frequency_penalty", 0.5, "honoured"),
    ("logit_bias", {"5": 1.0}, "honoured"), ("top_k", 5, "honoured"),
    ("min_p", 0.1, "honoured"), ("repetition_penalty", 1.2, "honoured"),
    ("min_tokens", 1, "honoured"), ("ignore_eos", True, "honoured"),
    ("stop_token_ids", [5], "honoured"), ("allowed_token_ids", [5, 6], "honoured"),
    ("bad_words", ["hello"], "honoured"), ("include_stop_str_in_output", True, "honoured"),
    ("stream", True, "honoured"), ("priority", 1, "honoured"),
    ("return_tokens_as_token_ids", True, "honoured"), ("best_of", 1, "honoured"),
    ("user", "u", "ignored"), ("metadata", {"a": "b"}, "ignored"), ("store", True, "ignored"),
    ("service_tier", "auto", "ignored"),
    ("guided_json", {"type": "object"}, "honoured"), ("guided_regex", "a+", "honoured"),
    ("guided_choice", ["a"], "honoured"), ("guided_grammar", "g", "honoured"),
    ("guided_decoding_backend", "xgrammar", "ignored"),
    ("guided_whitespace_pattern", " ", "refused"),
    ("structured_outputs", {"json": {}}, "honoured"), ("grammar", "g", "honoured"),
    ("json_schema", {}, "honoured"), ("response_format", {"type": "json_object"}, "honoured"),
    ("typical_p", 0.9, "refused"),
    ("prompt_logprobs", 1, "honoured"), ("reasoning_effort", "low", "refused"),
    ("best_of", 3, "refused"), ("top_a", 0.1, "refused"), ("mirostat", 2, "refused"),
    ("length_penalty", 1.1, "refused"), ("use_beam_search", True, "refused"),
    ("skip_special_tokens", False, "refused"), ("no_stop_trim", True, "honoured"),
    ("return_hidden_states", True, "refused"),
]  # fmt: skip
COMPLETION_FIELDS = [
    ("logprobs", 2, "honoured"), ("echo", True, "honoured"), ("suffix", "y", "refused"),
]  # fmt: skip
CHAT_FIELDS = [
    ("max_completion_tokens", 3, "honoured"), ("logprobs", True, "honoured"),
    ("add_generation_prompt", False, "honoured"), ("continue_final_message", True, "honoured"),
    ("chat_template_kwargs", {"x": 1}, "honoured"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "honoured"),
    ("tool_choice", "none", "honoured"), ("functions", [{"name": "f"}], "refused"),
    ("function_call", "auto", "refused"),
    ("parallel_tool_calls", False, "honoured"), ("modalities", ["text"], "refused"),
    ("audio", {"voice": "x"}, "refused"), ("prediction", {"type": "content"}, "refused"),
    ("web_search_options", {}, "refused"), ("documents", [], "refused"),
]  # fmt: skip
BODY_FIELDS = {
    "stream", "priority", "return_tokens_as_token_ids", "best_of", "echo",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip
"""Fields the handlers act on themselves (not through SamplingParams; tools:
:func:`~expeditor.gateway.tools.plan_tools`, tested below)."""


@pytest.mark.parametrize(
    ("kind", "field", "value", "outcome"),
    [(CompletionRequest, *case) for case in SHARED_FIELDS + COMPLETION_FIELDS]
    + [(ChatCompletionRequest, *case) for case in SHARED_FIELDS + CHAT_FIELDS],
)
def test_every_field_is_honoured_refused_or_listed(
    kind: type, field: str, value: object, outcome: str
) -> None:
    """No field is dropped silently: each one from the references is honoured, refused
    with a 400 naming it, or on the documented list of fields that have no effect."""
    base = {"prompt": "x"} if kind is CompletionRequest else {"messages": [{"role": "user"}]}
    if field == "stream":
        base["stream_options"] = {"include_usage": True}
    default = decode_body(msgspec.json.encode(base), kind)
    raw = msgspec.json.encode({**base, field: value})
    if outcome == "refused":
        error = _refused(raw, kind)
        assert error.status == 400 and error.param == field and error.message.startswith(field)
        return
    body = decode_body(raw, kind)
    params = body.check(lambda text: [ord(c) for c in text])
    assert (field in IGNORED) == (outcome == "ignored"), f"{field}: {outcome} but listed"
    if outcome == "honoured" and field not in BODY_FIELDS:
        assert params != default.check(), f"{field} did not reach the sampling params"
    if outcome == "honoured" and field in BODY_FIELDS:
        assert getattr(body, field) == value != getattr(default, field)


def test_chat_body_checks() -> None:
    messages = b'"messages": [{"role": "user", "content": "hi"}]'
    body = decode_body(
        b"{" + messages + b', "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 2}',
        ChatCompletionRequest,
    )
    params = body.check()
    assert (params.max_tokens, params.logprobs) == (9, 2)
    assert decode_body(b"{" + messages + b"}", ChatCompletionRequest).check().max_tokens is None
    assert decode_body(b"{" + messages + b', "logprobs": true}', ChatCompletionRequest).check(
    ).logprobs == 0  # fmt: skip
    for extra, field in (
        (b', "top_logprobs": 2', "top_logprobs"),
        (b', "logprobs": true, "top_logprobs": 99', "top_logprobs"),
        (b', "max_completion_tokens": -2', "max_completion_tokens"),
        (b', "max_tokens": 3, "max_completion_tokens": 4', "max_tokens"),
        (b', "response_format": {"type": "json_schema"}', "response_format"),
    ):
        error = _refused(b"{" + messages + extra + b"}", ChatCompletionRequest)
        assert error.param == field and error.message.startswith(field), (extra, error.message)
    assert _refused(b'{"messages": []}', ChatCompletionRequest).param == "messages"


def test_malformed_json_is_a_400() -> None:
    error = _refused(b'{"prompt": ')
    assert error.status == 400 and "not valid JSON" in error.message


# -- chat templates ---------------------------------------------------------------------


CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": 'Ünïcödé and "quotes"'},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(
    model: Path, conversation: list, generation_prompt: bool
) -> None:
    template = load_chat_template(model)
    assert template is not None
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation_prompt
    )
    got = template.render(conversation, add_generation_prompt=generation_prompt)
    assert got == want


def test_text_parts_are_joined_and_other_parts_refused(model: Path) -> None:
    template = load_chat_template(model)
    assert template is not None
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = [{"role": "user", "content": text_parts}]
    assert template.render(parts) == template.render([{"role": "user", "content": "a\nb"}])
    with pytest.raises(GatewayRequestError, match="only text parts"):
        template.render([{"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(GatewayRequestError, match="role"):
        template.render([{"content": "no role"}])


def test_chat_template_override_and_missing_template(model: Path, tmp_path: Path) -> None:
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    template = load_chat_template(model, override)
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]) == "[user]x"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path) is None
    refusing = tmp_path / "r.jinja"
    refusing.write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(GatewayRequestError, match="no system role"):
        load_chat_template(model, refusing).render([{"role": "user", "content": "x"}])


# -- metrics ------------------------------------------------------------------------------


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    data = histogram.data()
    assert data.counts == [2, 2, 1] and data.count == 5
    assert data.sum == pytest.approx(4.65)
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_request_metrics_count_what_they_are_told() -> None:
    metrics = RequestMetrics()
    metrics.on_scheduled(10)
    metrics.on_step(10, 1)
    metrics.on_step(1, 1)
    metrics.on_finished("length", 0.01, 0.02, 0.5)
    metrics.on_finished("abort", 0.3, None, 0.3)  # aborted before its first token
    assert (metrics.prompt_tokens, metrics.generation_tokens) == (10, 2)
    assert dict(metrics.request_success) == {"length": 1, "abort": 1}
    hist = metrics.histograms()
    assert hist["time_to_first_token_seconds"].count == 1
    assert hist["e2e_request_latency_seconds"].count == 2
    assert hist["iteration_tokens_total"].sum == 11


def test_rendered_metrics_parse_with_cumulative_buckets() -> None:
    reply = MetricsReply(
        model="m",
        num_requests_running=2,
        num_requests_waiting=3,
        num_requests_swapped=1,
        kv_cache_usage_perc=0.25,
        cpu_swap_usage_perc=0.5,
        num_preemptions={"swap": 4, "recompute": 1},
        prompt_tokens=100,
        generation_tokens=50,
        prefix_cache_queries=100,
        prefix_cache_hits=32,
        request_success={"stop": 2, "length": 5},
        spec_decode_num_drafts=6,
        spec_decode_num_draft_tokens=24,
        spec_decode_num_accepted_tokens=9,
        spec_decode_num_accepted_tokens_per_pos=[5, 3, 1, 0],
        histograms={
            "time_to_first_token_seconds": HistogramData(
                bounds=[0.1, 1.0], counts=[3, 1, 2], sum=9.5, count=6
            )
        },
    )
    text = render_metrics(reply, "served").decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    model = (("model_name", "served"),)
    assert samples[("expeditor:num_requests_waiting", model)] == 3
    assert samples[("expeditor:kv_cache_usage_perc", model)] == 0.25
    assert samples[("expeditor:prefix_cache_hits_total", model)] == 32
    # vLLM's series has no label beyond the model; the modes have their own counter
    assert samples[("expeditor:num_preemptions_total", model)] == 5
    by_mode = "expeditor:num_preemptions_by_mode_total"
    assert samples[(by_mode, (("mode", "recompute"), *model))] == 1
    assert samples[(by_mode, (("mode", "swap"), *model))] == 4
    assert samples[("expeditor:spec_decode_num_draft_tokens_total", model)] == 24
    assert samples[("expeditor:spec_decode_num_accepted_tokens_total", model)] == 9
    per_pos = "expeditor:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, (*model, ("position", str(i))))] for i in range(4)] == [5, 3, 1, 0]
    success = (("finished_reason", "abort"), *model)
    assert samples[("expeditor:request_success_total", success)] == 0
    ttft = "expeditor:time_to_first_token_seconds"
    assert samples[(f"{ttft}_bucket", (("le", "0.1"), *model))] == 3
    assert samples[(f"{ttft}_bucket", (("le", "1.0"), *model))] == 4
    assert samples[(f"{ttft}_bucket", (("le", "+Inf"), *model))] == 6
    assert samples[(f"{ttft}_count", model)] == 6 and samples[(f"{ttft}_sum", model)] == 9.5


def test_usage_is_backward_compatible() -> None:
    old = msgspec.msgpack.encode({"prompt_tokens": 3, "completion_tokens": 4})
    assert msgspec.msgpack.decode(old, type=Usage).cached_tokens == 0


# -- settings --------------------------------------------------------------------------------


def test_gateway_settings(tmp_path: Path) -> None:
    assert GatewayConfig().host == "127.0.0.1"
    with pytest.raises(ConfigError, match="API key"):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="0.0.0.0", api_key="k").read_api_key() == "k"
    with pytest.raises(ConfigError, match="not both"):
        GatewayConfig(api_key="k", api_key_file="f")
    key = tmp_path / "key"
    key.write_text("  secret\n")
    assert GatewayConfig(host="::", api_key_file=str(key)).read_api_key() == "secret"
    key.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        GatewayConfig(api_key_file=str(key)).read_api_key()
    with pytest.raises(ConfigError, match="cannot read"):
        GatewayConfig(api_key_file=str(tmp_path / "missing")).read_api_key()
    with pytest.raises(ConfigError, match="port"):
        GatewayConfig(port=70000)
    with pytest.raises(ConfigError, match=r"^ssl_keyfile: HTTPS needs both") as info:
        GatewayConfig(ssl_certfile="cert.pem")
    assert info.value.field == "ssl_keyfile"
    with pytest.raises(ConfigError, match=r"^ssl_certfile: HTTPS needs both"):
        GatewayConfig(ssl_keyfile="key.pem")
    with pytest.raises(ConfigError, match=r"^metrics_prefix: "):
        GatewayConfig(metrics_prefix="prom")  # type: ignore[arg-type]
    toml = tmp_path / "x.toml"
    toml.write_text('[server]\nmodel = ""\n[gateway]\nport = 9001\nmax_body_bytes = 4096\n')
    loaded = load_gateway_config(toml, env={"EXPEDITOR_API_KEY": "from-env"})
    assert (loaded.port, loaded.max_body_bytes, loaded.read_api_key()) == (9001, 4096, "from-env")


def test_parse_http_address() -> None:
    assert parse_http_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_http_address("[::1]:9") == ("::1", 9)
    for bad in ("8000", "host:", ":80", "h:0", "h:99999", "h:x"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_http_address(bad)


# -- streams that fell behind --------------------------------------------------------------


def test_merge_deltas_joins_each_samples_deltas_in_order() -> None:
    from expeditor.gateway.handler import merge_deltas
    from ipc.schema import Delta

    def delta(index: int, token: int, text: str, lp: bool = True, reason=None) -> Delta:
        logprobs = [{token: -0.5}] if lp else None
        return Delta(request_id="r", index=index, token_ids=[token], text=text,
                     finish_reason=reason, logprobs=logprobs)  # fmt: skip

    merged = merge_deltas([delta(0, 1, "a"), delta(1, 7, "x"), delta(0, 2, "b", reason="length")])
    assert [(d.index, d.token_ids, d.text, d.finish_reason) for d in merged] == [
        (0, [1, 2], "ab", "length"),
        (1, [7], "x", None),
    ]
    assert merged[0].logprobs == [{1: -0.5}, {2: -0.5}]
    flush = Delta(request_id="r", index=0, token_ids=[], text="!", finish_reason="stop")
    (only,) = merge_deltas([delta(0, 3, "c", lp=False), flush])
    assert (only.token_ids, only.text, only.logprobs, only.finish_reason) == (
        [3],
        "c!",
        None,
        "stop",
    )


def test_stream_ready_takes_what_arrived_and_leaves_the_end() -> None:
    import asyncio

    from ipc.schema import Accepted, Delta, Finished, Generate, Timings
    from ipc.stream import AsyncStream
    from shared.outputs import Completion

    class FakeClient:
        def __init__(self) -> None:
            self.queue: asyncio.Queue = asyncio.Queue()

        def _ensure_started(self) -> None: ...

        def _register(self, request_id: str) -> asyncio.Queue:
            return self.queue

        async def _send(self, message: object) -> None: ...

        def _forget(self, request_id: str, queue: asyncio.Queue, *, abort: bool) -> None: ...

        def _forget_threadsafe(self, request_id: str, queue: asyncio.Queue) -> None: ...

    def delta(token: int) -> Delta:
        return Delta(request_id="r", index=0, token_ids=[token], text=str(token))

    async def scenario() -> tuple[list, list, list, object]:
        client = FakeClient()
        stream = AsyncStream(client, Generate(request_id="r", prompt="x", stream=True), None)
        for event in (Accepted(request_id="r", prompt_token_ids=[5, 6]), delta(1), delta(2)):
            client.queue.put_nowait(event)
        first = [await stream.__anext__()]
        ready = stream.ready()
        assert stream.prompt_token_ids == [5, 6]
        client.queue.put_nowait(delta(3))
        client.queue.put_nowait(
            Finished(
                request_id="r",
                completion=Completion(request_id="r", prompt_token_ids=[5, 6], samples=[]),
                usage=Usage(prompt_tokens=2, completion_tokens=3),
                timings=Timings(queue_s=0, ttft_s=0, total_s=0),
            )
        )
        client.queue.put_nowait(delta(99))  # never seen: the stream ended before it
        more = stream.ready()
        assert stream.ready() == []  # the Finished is held, not lost
        rest = [d async for d in stream]
        return first, ready, more + rest, stream.completion

    first, ready, tail, completion = asyncio.run(scenario())
    assert [d.token_ids for d in first + ready + tail] == [[1], [2], [3]]
    assert completion is not None and completion.usage.completion_tokens == 3


def test_serve_refuses_bad_gateway_settings_before_starting_anything() -> None:
    from typer.testing import CliRunner

    from expeditor.cli import app

    runner = CliRunner()
    cases = [
        (["serve", "--http", "0.0.0.0:8141"], "[gateway] host: 0.0.0.0 is reachable"),
        (["serve", "--http", "8141"], "--http: expected HOST:PORT"),
        (["serve", "--api-key", "k"], "need --http HOST:PORT"),
        (["gateway", "--frontend", "ipc:///nowhere.sock", "--chat-template", "/no/such"],
         "chat_template: /no/such is not a file"),
    ]  # fmt: skip
    for args, words in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert words in " ".join(result.output.split()), (args, result.output)


def test_a_checkpoint_without_chat_template_refuses_chat_naming_the_fix(model: Path) -> None:
    from tokenizers import Tokenizer

    from expeditor.gateway.model import ServedModel

    served = ServedModel(
        name="m",
        path=str(model),
        tokenizer=Tokenizer.from_file(str(model / "tokenizer.json")),
        chat_template=None,
        max_model_len=64,
    )
    with pytest.raises(GatewayRequestError, match="--chat-template FILE") as info:
        served.template()
    assert info.value.param == "messages" and info.value.status == 400
    (h,) = served.encode("H", add_special_tokens=False)
    assert served.token_text(h) == "H"
    assert served.decode(served.encode("hi", add_special_tokens=False)) == "hi"


def _tool(name: str, **function: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, **function}}


def test_tool_plans() -> None:
    """What each tool_choice asks for: nothing forced (none, auto), a grammar of one or
    more calls of any tool (required; one without parallel calls), one call of the named
    tool; tools without a parser on the server only with none."""
    tools = [_tool("f", parameters={"type": "object"}), _tool("g")]
    assert plan_tools(None, None, None, "hermes") is None
    assert plan_tools(None, "none", None, "hermes") is None
    auto = plan_tools(tools, None, None, "hermes")
    assert auto is not None and auto.reads_calls and not auto.forced and auto.choice == "auto"
    none = plan_tools(tools, "none", None, "none")
    assert none is not None and not none.reads_calls
    required = plan_tools(tools, "required", None, "hermes")
    assert required is not None and required.forced
    grammar = required.grammar()
    assert '\\"f\\"' in grammar and '\\"g\\"' in grammar and '("\\n" block)*' in grammar
    single = plan_tools(tools, "required", False, "hermes")
    assert single is not None and "block)*" not in single.grammar()
    assert single.keeps(0) and not single.keeps(1) and required.keeps(5)
    named = plan_tools(tools, {"type": "function", "function": {"name": "g"}}, None, "mistral")
    assert named is not None and named.named == "g"
    assert '\\"g\\"' in named.grammar() and '\\"f\\"' not in named.grammar()
    assert "[TOOL_CALLS]" in named.grammar()
    cases = [
        (([], None, None, "hermes"), "tools", "must not be empty"),
        (([{"type": "function"}], None, None, "hermes"), "tools", "tools[0]"),
        (([_tool("f", extra=1)], None, None, "hermes"), "tools", "unknown field 'extra'"),
        (([_tool("f", parameters=[])], None, None, "hermes"), "tools", "JSON schema object"),
        (([_tool("f", parameters={"x-guidance": [1]})], "required", None, "hermes"), "tools",
         "x-guidance"),
        (([_tool("f")], "auto", None, "none"), "tool_choice", "tool_call_parser"),
        (([_tool("f")], None, "yes", "hermes"), "parallel_tool_calls", "boolean"),
        ((None, {"type": "function", "function": {"name": "f"}}, None, "hermes"),
         "tool_choice", "needs tools"),
        (([_tool("f")], {"type": "function", "function": {"name": "f"}, "x": 1}, None, "hermes"),
         "tool_choice", "unknown field 'x'"),
        (([_tool("f")], {"type": "function", "function": {"name": "f", "y": 2}}, None, "hermes"),
         "tool_choice", "unknown field 'y'"),
    ]  # fmt: skip
    for args, param, words in cases:
        with pytest.raises(GatewayRequestError) as info:
            plan_tools(*args)  # type: ignore[arg-type]
        assert info.value.param == param and words in info.value.message, (args, info.value)


def test_an_unloadable_certificate_is_refused_by_name(tmp_path: Path) -> None:
    from expeditor.gateway.server import _check_tls

    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"^ssl_certfile/ssl_keyfile: cannot load .*cert\.pem"):
        _check_tls(str(cert), str(tmp_path / "key.pem"))


def test_the_body_routers_forward_is_accepted() -> None:
    """vllm-router re-serializes a completion with SGLang's fields at their defaults
    (smg adds echo and stream): accepted, and meaning what they say."""
    raw = (
        b'{"model": "m", "prompt": "x", "max_tokens": 2, "stream": false, "echo": false,'
        b' "no_stop_trim": false, "ignore_eos": false, "skip_special_tokens": true,'
        b' "return_hidden_states": false}'
    )
    params = decode_body(raw, CompletionRequest).check(lambda text: [ord(c) for c in text])
    assert params.include_stop_str_in_output is False and params.max_tokens == 2
    kept = raw.replace(b'"no_stop_trim": false', b'"no_stop_trim": true')
    assert decode_body(kept, CompletionRequest).check().include_stop_str_in_output is True


def test_the_schedulers_refusals_name_the_body_field_they_name() -> None:
    """A scheduler's 400 carries the field its reply names (``ErrorReply.field``, through
    ``ServerError.field``) as ``param``, as the body calls it; none for a field the body
    does not have, or a reply that names none."""
    from expeditor.gateway.responses import error_of
    from ipc.errors import ServerError, error_from_reply
    from ipc.schema import ErrorCode, ErrorReply

    for field, param in (
        ("logit_bias", "logit_bias"),
        ("prompt_token_ids", "prompt"),
        ("bad_words_token_ids", "bad_words"),
        ("structured_outputs", "structured_outputs"),
        ("worker_state", None),
        (None, None),
    ):
        message = f"{field}: refused"
        reply = ErrorReply(request_id="r", code=ErrorCode.BAD_REQUEST, message=message, field=field)
        error = error_of(error_from_reply(reply))["error"]
        assert (error["code"], error["param"], error["message"]) == (400, param, message)
    internal = error_of(ServerError(ErrorCode.INTERNAL, "prompt: a bug", field="prompt"))["error"]
    assert (internal["code"], internal["param"]) == (500, None)
