"""The OpenAI request bodies the gateway accepts, decoded and checked with msgspec, and
their translation into :class:`~shared.sampling.SamplingParams`.

Fields follow the OpenAI API and vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output``, ``priority``:
lower is served first), and this server's ``num_speculative_tokens`` (speculative
decoding for this request: at most the server's, 0 = off). No field is dropped
silently: a field this server does not know is a 400 naming it, those of
:data:`IGNORED` are accepted with no effect (each with its reason), and known features
it does not implement (:data:`REFUSED`, ``suffix``) are a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import msgspec

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "GatewayRequestError",
    "StreamOptions",
    "TokenizeRequest",
    "decode_body",
]


INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
"""Token ids above this are refused by the gateway (every vocabulary is far smaller);
the scheduler refuses those beyond the model's own vocabulary."""

Int = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""An integer field: a signed 64-bit value, as the scheduler's messages carry (a bigger
one is a 400 naming the field, not an encoding failure further on)."""
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_MAX)]
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
MAX_JSON_DEPTH = 64
"""Deepest nesting of a free-form field (messages, chat_template_kwargs, ...): deeper
ones are a 400, before a template or an encoder recurses through them. (The decoder
itself stops near 1,000 levels: a 400 as well.)"""


class GatewayRequestError(Exception):
    """A request the gateway refuses before it reaches the scheduler (HTTP ``status``)."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind or {400: "BadRequestError", 404: "NotFoundError"}.get(
            status, "BadRequestError"
        )


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM: usage on every chunk (accepted, and honoured)."""


IGNORED: dict[str, str] = {
    "user": "the end user's label: fair share counts requests per API key, not per label",
    "metadata": "OpenAI's stored-completion tags: nothing is stored",
    "store": "OpenAI's stored completions: nothing is stored",
    "service_tier": "one tier here",
    "guided_decoding_backend": "one structured-output backend here (llguidance)",
}
"""Fields accepted with no effect, and why (docs/deploy.md lists them). Any other field
this server does not know is a 400 naming it."""

REFUSED: dict[str, str] = {
    "guided_whitespace_pattern": "JSON whitespace is not configurable here",
    "functions": "OpenAI's deprecated function calling; give tools instead",
    "function_call": "OpenAI's deprecated function calling; give tool_choice instead",
    "typical_p": "typical sampling is not supported",
    "reasoning_effort": "this model does not reason on request",
}
"""Fields known from OpenAI's, vLLM's or llama.cpp's APIs that this server does not
implement: any value but null is a 400 naming the field."""


_STRUCTURED_FORMS = ("structured_outputs", "guided_json", "json_schema", "response_format")
"""The structured-output fields that hold JSON of any shape (schemas)."""


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share."""

    FREE_FORM: ClassVar[tuple[str, ...]] = _STRUCTURED_FORMS
    """Fields of any shape: their nesting is checked (:data:`MAX_JSON_DEPTH`)."""

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> bias in [-100, 100]."""
    # vLLM's extra sampling fields
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    priority: Int = 0
    return_tokens_as_token_ids: bool = False
    """vLLM: logprob tokens as ``token_id:N`` (exact, where text is ambiguous)."""
    best_of: Int | None = None
    prompt_logprobs: Int | None = None
    """vLLM: the prompt tokens' logprobs, with this many top tokens per position."""
    num_speculative_tokens: Int | None = None
    """Tokens prompt lookup may propose per step for this request (at most the
    server's ``num_speculative_tokens``; 0 = none; unset = the server's)."""
    skip_special_tokens: bool = True
    """vLLM's: the text leaves special tokens out; it always does here (false is
    refused)."""
    # SGLang's, which routers (vllm-router, smg) add to every body they forward
    no_stop_trim: bool = False
    """SGLang's: true keeps the matched stop string in the text, as
    ``include_stop_str_in_output``."""
    return_hidden_states: bool = False
    """SGLang's: true is refused (hidden states are not returned)."""
    # structured output, in every form (one per request): vLLM's, its older guided_*
    # fields, llama.cpp's; response_format is the endpoints' own
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Any = None
    grammar: str | None = None
    """llama.cpp's: a GBNF grammar."""
    json_schema: dict[str, Any] | None = None
    """llama.cpp's: a JSON schema."""
    # known but not implemented: refused unless null (REFUSED says why)
    guided_whitespace_pattern: Any = None
    typical_p: Any = None
    reasoning_effort: Any = None

    def _refuse_unsupported(self) -> None:
        for name, why in REFUSED.items():
            if getattr(self, name, None) is not None:
                message = f"{name}: not supported by this server ({why})"
                raise GatewayRequestError(message, param=name)
        if not self.skip_special_tokens:
            raise GatewayRequestError(
                "skip_special_tokens: false is not supported (the text always leaves "
                "special tokens out; return_tokens_as_token_ids gives every token)",
                param="skip_special_tokens",
            )
        if self.return_hidden_states:
            raise GatewayRequestError(
                "return_hidden_states: not supported by this server (hidden states are "
                "not returned)",
                param="return_hidden_states",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise GatewayRequestError(
                f"best_of: only best_of == n is supported, got best_of={self.best_of}, n={self.n}",
                param="best_of",
            )
        if self.stream_options is not None and not self.stream:
            raise GatewayRequestError(
                "stream_options: only allowed when stream is true", param="stream_options"
            )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise GatewayRequestError(
                "allowed_token_ids: must not be empty (leave it out to allow every token)",
                param="allowed_token_ids",
            )

    def sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        encode: Callable[[str], list[int]] | None = None,
        tool_grammar: str | None = None,
    ) -> SamplingParams:
        """The scheduler's SamplingParams; its validation errors name the field.

        ``max_tokens`` 0 is valid here (some clients ask for no new tokens: scoring with
        echo, load generators drawing lengths from 0, see :attr:`zero_tokens`): the
        params are then checked as if for one token, and the handler answers without
        running the model. ``encode`` (text -> token ids, no special tokens) turns
        ``bad_words`` into token sequences."""
        self._refuse_unsupported()
        if max_tokens == 0 and self.min_tokens:
            raise GatewayRequestError(
                f"min_tokens: must be <= max_tokens (0), got {self.min_tokens}",
                param="min_tokens",
            )
        fields: dict[str, Any] = {
            "max_tokens": 1 if max_tokens == 0 else max_tokens,
            "min_tokens": self.min_tokens,
            "n": self.n,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "seed": self.seed,
            "include_stop_str_in_output": self.include_stop_str_in_output or self.no_stop_trim,
            "prompt_logprobs": self.prompt_logprobs,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        for name in ("temperature", "top_p", "min_p") + PENALTIES:
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.top_k is not None:
            fields["top_k"] = 0 if self.top_k == -1 else self.top_k  # vLLM: -1 = off
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stop_token_ids is not None:
            fields["stop_token_ids"] = self.stop_token_ids
        if self.allowed_token_ids:
            fields["allowed_token_ids"] = self.allowed_token_ids
        if self.logit_bias:
            fields["logit_bias"] = _token_keys(self.logit_bias)
        if self.bad_words:
            if encode is None:
                raise GatewayRequestError("bad_words: not supported here", param="bad_words")
            fields["bad_words_token_ids"] = bad_words_token_ids(self.bad_words, encode)
        structured = self._structured(tool_grammar)
        if structured is not None:
            fields["structured_outputs"] = structured[1]
        try:
            return SamplingParams(**fields)
        except InvalidRequestError as exc:
            field = "bad_words" if exc.field == "bad_words_token_ids" else exc.field
            if field == "structured_outputs" and structured is not None:
                field = structured[0]  # the form the client used
                message = str(exc).replace("structured_outputs", field, 1)
                raise GatewayRequestError(message, param=field) from None
            raise GatewayRequestError(str(exc), param=field) from None

    def _structured(self, tool_grammar: str | None) -> tuple[str, dict[str, Any]] | None:
        """(the field given, its :class:`~shared.structured_output.StructuredOutput`
        fields) of the one structured-output form the body uses, if any."""
        forms: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            forms.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                          ("grammar", "grammar"), ("json_schema", "json")):  # fmt: skip
            if getattr(self, name) is not None:
                forms.append((name, {key: getattr(self, name)}))
        if tool_grammar is not None:
            forms.append(("tool_choice", {"grammar": tool_grammar}))
        response_format = getattr(self, "response_format", None)
        if response_format is not None:
            form = _response_format(response_format)
            if form is not None:
                forms.append(("response_format", form))
        if len(forms) > 1:
            names = ", ".join(name for name, _ in forms)
            raise GatewayRequestError(
                f"{forms[1][0]}: give one structured-output form, got {names}",
                param=forms[1][0],
            )
        return forms[0] if forms else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as StructuredOutput fields (None for text)."""
    if not isinstance(value, dict) or value.get("type") not in (
        "text",
        "json_object",
        "json_schema",
    ):
        raise GatewayRequestError(
            "response_format: expected {type: text | json_object | json_schema}",
            param="response_format",
        )
    kind = value["type"]
    spec = value.get("json_schema")
    extra = sorted({*value} - {"type", *(("json_schema",) if kind == "json_schema" else ())})
    if isinstance(spec, dict):
        extra += sorted({*spec} - {"name", "description", "schema", "strict"})
    if extra:
        raise GatewayRequestError(
            f"response_format: unknown field {extra[0]!r} for type {kind}",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise GatewayRequestError(
            "response_format: json_schema needs {json_schema: {name, schema}}",
            param="response_format",
        )
    return {"json": spec.get("schema", {})}


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[Any]
    """Text, token ids, or a batch: a list of texts or of token id lists."""
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None

    @property
    def zero_tokens(self) -> bool:
        """No new tokens asked for (max_tokens 0)."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids (a list of them is a batch)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise GatewayRequestError("prompt: must not be empty", param="prompt")
        if all(_is_token_id(item) for item in prompt):
            return [prompt]
        if all(type(item) is int for item in prompt):
            index = next(i for i, item in enumerate(prompt) if not _is_token_id(item))
            raise GatewayRequestError(
                f"prompt[{index}]: token ids are integers from 0 to {TOKEN_ID_MAX}",
                param="prompt",
            )
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                continue
            if not isinstance(item, list) or not item or not all(map(_is_token_id, item)):
                raise GatewayRequestError(
                    f"prompt[{index}]: expected a string or a non-empty list of token ids "
                    f"(integers from 0 to {TOKEN_ID_MAX})",
                    param="prompt",
                )
        return list(prompt)

    def check(self, encode: Callable[[str], list[int]] | None = None) -> SamplingParams:
        if self.suffix:
            raise GatewayRequestError("suffix: not supported by this server", param="suffix")
        params = self.sampling(self.max_tokens, self.logprobs, encode)
        if self.echo_logprobs:  # the echoed prompt's logprobs: the prompt's
            wanted = max(self.logprobs or 0, self.prompt_logprobs or 0)
            params = msgspec.structs.replace(params, prompt_logprobs=wanted)
        return params

    @property
    def echo_logprobs(self) -> bool:
        """Echo with logprobs: the echoed prompt's tokens come with theirs."""
        return self.echo and self.logprobs is not None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    FREE_FORM: ClassVar[tuple[str, ...]] = (
        "messages",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        *_STRUCTURED_FORMS,
    )
    """Fields of any shape: their nesting is checked (:data:`MAX_JSON_DEPTH`)."""

    @property
    def limit(self) -> int | None:
        """max_completion_tokens, else max_tokens (None: up to max_model_len)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def zero_tokens(self) -> bool:
        """No new tokens asked for (a limit of 0)."""
        return self.limit == 0

    def check(
        self, encode: Callable[[str], list[int]] | None = None, tool_grammar: str | None = None
    ) -> SamplingParams:
        """The scheduler's SamplingParams; ``tool_grammar``: the calls ``tool_choice``
        forces (:meth:`~expeditor.gateway.tools.ToolPlan.grammar`), a structured-output
        form of its own."""
        if self.top_logprobs is not None and not self.logprobs:
            raise GatewayRequestError(
                "top_logprobs: needs logprobs set to true", param="top_logprobs"
            )
        _check_messages(self.messages)
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise GatewayRequestError(
                    "max_tokens: differs from max_completion_tokens; give one",
                    param="max_tokens",
                )
        max_tokens = self.limit
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self.sampling(max_tokens, logprobs, encode, tool_grammar)
        except GatewayRequestError as exc:
            if exc.param == "logprobs":  # the scheduler's field is our top_logprobs
                exc.param = "top_logprobs"
                exc.message = exc.message.replace("logprobs", "top_logprobs", 1)
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
                exc.message = exc.message.replace("max_tokens", "max_completion_tokens", 1)
            raise GatewayRequestError(exc.message, param=exc.param) from None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /tokenize``: ``prompt`` text, or chat ``messages`` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    """With messages: the tools the chat template is given (vLLM's)."""
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    FREE_FORM: ClassVar[tuple[str, ...]] = ("messages", "tools")

    def check(self) -> None:
        """A 400 naming the field unless the body gives a prompt or some messages."""
        if (self.prompt is None) == (self.messages is None):
            raise GatewayRequestError("give exactly one of prompt and messages", param="prompt")
        if self.messages is not None:
            _check_messages(self.messages)


def _check_messages(messages: list[dict[str, Any]] | None) -> None:
    if not messages:
        raise GatewayRequestError("messages: must not be empty", param="messages")


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys (token ids written as strings) as ints."""
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit() or int(key) > TOKEN_ID_MAX:
            raise GatewayRequestError(
                f"logit_bias: keys are token ids (integers from 0 to {TOKEN_ID_MAX} written "
                f"as strings), got {key!r}",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as written (leading spaces
    stripped) and with one leading space, the second kept when it is another token
    sequence of the same length (a word-initial token)."""
    out: list[list[int]] = []
    for index, word in enumerate(words):
        plain = encode(word.lstrip())
        if not plain:
            raise GatewayRequestError(
                f"bad_words[{index}]: no tokens in {word!r}", param="bad_words"
            )
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _is_token_id(value: object) -> bool:
    return type(value) is int and 0 <= value <= TOKEN_ID_MAX


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into ``kind``; a malformed body or a wrong type is a 400 naming
    the field (``max_tokens: expected `int`, got `str```)."""
    try:
        decoded = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise GatewayRequestError(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise GatewayRequestError("the body: JSON nested too deeply") from None
    for field in getattr(kind, "FREE_FORM", ()):
        _check_depth(getattr(decoded, field), field)
    return decoded


def _check_depth(value: object, field: str) -> None:
    """400 when ``value`` nests lists and objects deeper than MAX_JSON_DEPTH."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= MAX_JSON_DEPTH:
            raise GatewayRequestError(
                f"{field}: nested deeper than {MAX_JSON_DEPTH} levels", param=field
            )
        stack.extend((child, depth + 1) for child in children)


def _validation_error(text: str) -> GatewayRequestError:
    problem, sep, where = text.partition(" - at `$")
    if sep:
        path = where.rstrip("`").lstrip(".")
        field = path.split("[", 1)[0].split(".", 1)[0] or None
        return GatewayRequestError(f"{path}: {problem[:1].lower()}{problem[1:]}", param=field)
    if text.startswith("Object contains unknown field `"):
        field = text.split("`")[1]
        return GatewayRequestError(
            f"{field}: unknown field; this server does not implement it (docs/deploy.md lists "
            "the fields it accepts)",
            param=field,
        )
    if text.startswith("Object missing required field `"):
        field = text.split("`")[1]
        return GatewayRequestError(f"{field}: this field is required", param=field)
    return GatewayRequestError(f"the body: {text}")
