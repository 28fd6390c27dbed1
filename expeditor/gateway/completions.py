"""``/v1/completions`` and ``/v1/chat/completions``: each endpoint's part of the
request handler (:class:`~expeditor.gateway.handler.Handler`): checking its body,
building its prompts, and its choices and chunks (completions: echo, the legacy
logprobs object; chat: the rendered conversation, the assistant's opening chunk).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from expeditor.gateway.chat import render_messages
from expeditor.gateway.handler import Handler
from expeditor.gateway.limits import (
    check_batch,
    check_response_size,
    echo_tokens,
    prompt_logprob_tokens,
    response_tokens,
)
from expeditor.gateway.protocol import ChatCompletionRequest, CompletionRequest, GatewayRequestError
from expeditor.gateway.responses import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    sse,
)
from expeditor.gateway.tool_parsers import ToolCallDelta, ToolCallReader, parse_tool_calls
from expeditor.gateway.tools import ToolPlan, call_id, plan_tools, tool_call_body
from ipc.async_client import ClientCompletion
from ipc.errors import ServerError
from ipc.schema import Delta
from shared.outputs import CompletionSample, FinishReason

__all__ = ["ChatHandler", "CompletionHandler"]

INLINE_DECODE_TOKENS = 16_384
"""Echoed prompts of more tokens than this (all together) are decoded on a thread."""


class CompletionHandler(Handler):
    ID_PREFIX = "cmpl-"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    body: CompletionRequest

    async def prepare(self) -> None:
        body = self.body
        self.params = body.check(self.model.encode_text)
        prompts = body.prompts()
        n = self.params.n
        config = self.gateway.config
        check_batch(len(prompts), n, config)
        sizes = [echo_tokens(p) for p in prompts]
        echoed = sizes if body.echo else [0] * len(prompts)
        # vLLM's prompt_logprobs come with every choice
        listed = n * prompt_logprob_tokens(sizes, body.prompt_logprobs)
        check_response_size(
            response_tokens(n, echoed, self._max_new_tokens(prompts), body.logprobs, listed),
            config,
            "n" if n > 1 else "max_tokens",
        )
        self.prompts = [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompts]
        self.echoed = [""] * len(self.prompts)
        """The prompt text each choice starts with (echo), not sent yet when streaming."""
        if body.echo:
            self.echoed = await self._echoed_texts(sum(echoed))
        self.first_pending = set(range(len(self.prompts) * n))
        """Choices whose first chunk is not sent yet (it carries the echo)."""
        self.text_offsets = [len(self.echoed[i // n]) for i in range(len(self.prompts) * n)]
        """Per choice: where its next token's text starts (the logprobs' text_offset)."""

    def _max_new_tokens(self, prompts: list[str | list[int]]) -> int:
        """The most tokens a sample may generate (max_tokens null: up to the context)."""
        if self.body.max_tokens is not None:
            return self.body.max_tokens
        limit = self.model.max_model_len or 0
        shortest = min((len(p) for p in prompts if not isinstance(p, str)), default=0)
        return max(0, limit - shortest)

    async def _echoed_texts(self, tokens: int) -> list[str]:
        """Every prompt's text; token id prompts decoded (on a thread when long)."""
        ids = [token_ids or [] for _, token_ids in self.prompts]
        if tokens <= INLINE_DECODE_TOKENS:
            decoded = [self.model.decode(i) if i else "" for i in ids]
        else:
            decoded = await asyncio.to_thread(self.model.decode_batch, ids)
        return [
            text if text is not None else d
            for (text, _), d in zip(self.prompts, decoded, strict=True)
        ]

    def _echoed_logprobs(self, prompt_index: int) -> dict[str, Any] | None:
        """With echo and logprobs: the legacy ``logprobs`` of the echoed prompt."""
        if not self.body.echo_logprobs:
            return None
        return echo_logprobs(
            self.prompt_ids[prompt_index],
            self.prompt_lps[prompt_index],
            self.token_text,
            self.body.logprobs or 0,
        )

    def _choice(self, index: int, prompt_index: int, sample: CompletionSample) -> dict[str, Any]:
        echoed = self.echoed[prompt_index]
        logprobs = None
        if sample.logprobs is not None:
            logprobs = completion_logprobs(
                sample.token_ids, sample.logprobs, self.token_text, len(echoed)
            )
        if (head := self._echoed_logprobs(prompt_index)) is not None:
            logprobs = join_logprobs(head, logprobs)
        choice = {
            "index": index,
            "text": echoed + sample.text,
            "logprobs": logprobs,
            "finish_reason": str(sample.finish_reason),
            "stop_reason": sample.stop_reason,
        }
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_index)
        return choice

    def _delta_chunk(self, index: int, prompt_index: int, delta: Delta) -> dict[str, Any] | None:
        text = delta.text
        first = index in self.first_pending
        if first:
            self.first_pending.discard(index)
            text = self.echoed[prompt_index] + text
        # the first chunk carries the echo and the prompt's logprobs, if any
        opening = first and (self.body.echo or self.body.prompt_logprobs is not None)
        if not (opening or text or delta.finish_reason is not None or delta.logprobs is not None):
            return None
        logprobs = None
        if delta.logprobs is not None:
            logprobs = completion_logprobs(
                delta.token_ids, delta.logprobs, self.token_text, self.text_offsets[index]
            )
            self.text_offsets[index] += sum(len(t) for t in logprobs["tokens"])
        if first and (head := self._echoed_logprobs(prompt_index)) is not None:
            logprobs = join_logprobs(head, logprobs)
        reason = None if delta.finish_reason is None else str(delta.finish_reason)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": delta.stop_reason,
        }
        if first and self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_index)
        return {**self._chunk_head(), "choices": [choice]}


class ChatHandler(Handler):
    ID_PREFIX = "chatcmpl-"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    body: ChatCompletionRequest

    async def prepare(self) -> None:
        body = self.body
        config = self.gateway.config
        self.tool_plan: ToolPlan | None = plan_tools(
            body.tools, body.tool_choice, body.parallel_tool_calls, config.tool_call_parser
        )
        plan = self.tool_plan
        grammar = plan.grammar() if plan is not None and plan.forced else None
        self.params = body.check(self.model.encode_text, grammar)
        n = self.params.n
        check_batch(1, n, config)
        self.calls_format = plan.format if plan is not None and plan.reads_calls else None
        """The format calls are read in (None: the output is plain content)."""
        self.readers = (
            [ToolCallReader(self.calls_format) for _ in range(n)]
            if body.stream and self.calls_format
            else []
        )
        """Streaming with tools: per choice, its output read for calls as it arrives."""
        self.call_ids: dict[tuple[int, int], str] = {}
        text = await render_messages(
            self.model.template(),
            body.messages,
            max_messages=config.max_messages,
            max_bytes=self.gateway.max_prompt_bytes,
            timeout_s=config.render_timeout_s,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            extra=body.chat_template_kwargs,
            tools=body.tools,
        )
        token_ids = await self.gateway.encode(self.model, text, special=False, field="messages")
        if not token_ids:
            raise GatewayRequestError("messages: the rendered prompt is empty", param="messages")
        limit = body.limit
        if limit is None:  # up to the context
            limit = max(0, (self.model.max_model_len or 0) - len(token_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        listed = prompt_logprob_tokens([len(token_ids)], body.prompt_logprobs)
        check_response_size(
            response_tokens(n, [0], limit, logprobs, listed), config, "n" if n > 1 else field
        )
        self.prompts = [(None, token_ids)]
        self.top_n = body.top_logprobs or 0
        self.prompt_logprobs_pending = body.prompt_logprobs is not None
        """Streaming: the prompt's logprobs go on the first chunk after the opening."""

    def _opening(self, prompt_index: int) -> list[bytes]:
        head = self._chunk_head()
        return [
            sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
            for index in range(self.params.n)
        ]

    def _response_extra(self) -> dict[str, Any]:
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self._prompt_logprobs(0)}

    async def _generate(self, index: int) -> ClientCompletion:
        try:
            return await super()._generate(index)
        except ServerError as exc:
            raise self._tool_error(exc) from None

    async def _one_stream(self, index: int) -> AsyncIterator[tuple[int, Delta]]:
        try:
            async for item in super()._one_stream(index):
                yield item
        except ServerError as exc:
            raise self._tool_error(exc) from None

    def _tool_error(self, exc: ServerError) -> Exception:
        """A forced call's grammar the scheduler refused: a 400 naming the tools."""
        plan = self.tool_plan
        prefix = "structured_outputs: grammar: "
        if plan is None or not plan.forced or not exc.message.startswith(prefix):
            return exc
        return GatewayRequestError(
            "tools: a tool's parameters cannot be enforced as a JSON schema: "
            + exc.message[len(prefix) :],
            param="tools",
        )

    def _finish_reason(self, reason: FinishReason, has_calls: bool) -> str:
        if has_calls and reason == FinishReason.STOP:
            return "tool_calls"
        return str(reason)

    def _choice(self, index: int, prompt_index: int, sample: CompletionSample) -> dict[str, Any]:
        logprobs = sample.logprobs
        message: dict[str, Any] = {"role": "assistant", "content": sample.text}
        reason = str(sample.finish_reason)
        if self.calls_format is not None:
            assert self.tool_plan is not None
            content, calls = parse_tool_calls(self.calls_format, sample.text)
            calls = [call for i, call in enumerate(calls) if self.tool_plan.keeps(i)]
            message = {"role": "assistant", "content": content or None}
            if calls:  # OpenAI leaves the key out when there are none
                message["tool_calls"] = [tool_call_body(call, call_id()) for call in calls]
            reason = self._finish_reason(sample.finish_reason, bool(calls))
        return {
            "index": index,
            "message": message,
            "logprobs": None
            if logprobs is None
            else chat_logprobs(sample.token_ids, logprobs, self.token_text, self.top_n),
            "finish_reason": reason,
            "stop_reason": sample.stop_reason,
        }

    def _read_calls(self, index: int, delta: Delta) -> tuple[str, list[dict[str, Any]]]:
        """Streaming with tools: the delta's content and ``delta.tool_calls`` entries."""
        reader = self.readers[index]
        content, calls = reader.feed(delta.text, final=delta.finish_reason is not None)
        assert self.tool_plan is not None
        keeps = self.tool_plan.keeps
        return content, [self._call_delta(index, call) for call in calls if keeps(call.index)]

    def _call_delta(self, choice: int, call: ToolCallDelta) -> dict[str, Any]:
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        identifier = self.call_ids.setdefault((choice, call.index), call_id())
        return {
            "index": call.index,
            "id": identifier,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _delta_chunk(self, index: int, prompt_index: int, delta: Delta) -> dict[str, Any] | None:
        first = self.prompt_logprobs_pending
        content, calls = self._read_calls(index, delta) if self.readers else (delta.text, [])
        if not (
            first
            or content
            or calls
            or delta.finish_reason is not None
            or delta.logprobs is not None
        ):
            return None
        self.prompt_logprobs_pending = False
        logprobs = None
        if delta.logprobs is not None:
            logprobs = chat_logprobs(delta.token_ids, delta.logprobs, self.token_text, self.top_n)
        body: dict[str, Any] = {"content": content} if content else {}
        if calls:
            body["tool_calls"] = calls
        reason = None
        if delta.finish_reason is not None:
            has_calls = any(key[0] == index for key in self.call_ids)
            reason = self._finish_reason(delta.finish_reason, has_calls)
        choice = {
            "index": index,
            "delta": body,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": delta.stop_reason,
        }
        if first:
            return {**self._chunk_head(), "choices": [choice], **self._response_extra()}
        return {**self._chunk_head(), "choices": [choice]}
