"""What ``/v1/completions`` and ``/v1/chat/completions`` share: one :class:`Handler` per
HTTP request, which turns the body into scheduler requests (one per prompt; ``n``
samples each) and their results into an OpenAI response, whole or streamed; the
endpoints' own parts are in :mod:`expeditor.gateway.completions`.

Choice ``index`` is ``prompt_index * n + sample_index``. Streaming sends one chunk per
sample and step with new text, the finish reason on the sample's last chunk, then
(with ``stream_options.include_usage``) a chunk with ``choices: []`` and ``usage``, then
``data: [DONE]``. A failure after the first chunk is sent as an error event before
``[DONE]``; one before it is the HTTP error itself.

What one request may cost is checked in :meth:`Handler.prepare`, before any work
(:mod:`expeditor.gateway.limits`, :func:`~expeditor.gateway.chat.render_messages`); a
batch's scheduler requests start a few at a time (:mod:`expeditor.gateway.fanout`) and
a stream's unsent output is bounded (:mod:`expeditor.gateway.stream_buffer`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from expeditor.gateway.fanout import fan_out
from expeditor.gateway.model import ServedModel
from expeditor.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GatewayRequestError,
)
from expeditor.gateway.responses import (
    DONE,
    add_usage,
    error_of,
    prompt_logprobs_body,
    sse,
    usage_body,
)
from expeditor.gateway.stream_buffer import bounded_stream
from ipc.async_client import AsyncClient, ClientCompletion
from ipc.schema import Delta, Timings, Usage
from shared.outputs import CompletionSample, FinishReason, PromptLogprobs
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from expeditor.gateway.app import Gateway

__all__ = ["Handler", "Prompt", "merge_deltas", "token_id_text", "without_output"]

Prompt = tuple[str | None, list[int] | None]
"""(text, token ids): exactly one is set."""


class Handler:
    ID_PREFIX: ClassVar[str]
    OBJECT: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]

    def __init__(
        self,
        gateway: Gateway,
        model: ServedModel,
        body: CompletionRequest | ChatCompletionRequest,
        response_id: str,
    ) -> None:
        self.gateway = gateway
        assert gateway.client is not None
        self.client: AsyncClient = gateway.client
        self.model = model
        self.body = body
        self.response_id = response_id
        self.user = ""
        """The end user the scheduler counts its requests under (set by the app)."""
        self.created = int(time.time())
        self.params = SamplingParams()
        self.prompts: list[Prompt] = []
        self.usages: list[Usage | None] = []
        self.prompt_tokens: list[int] = []
        """Prompt length per prompt, once the scheduler accepted it (streaming usage)."""
        self.prompt_ids: dict[int, list[int]] = {}
        self.prompt_lps: dict[int, PromptLogprobs] = {}
        """Per prompt index, with prompt logprobs: its token ids and their logprobs."""
        self.token_text = token_id_text if body.return_tokens_as_token_ids else model.token_text

    async def prepare(self) -> None:
        """Check the body and build the prompts (400s are raised here)."""
        raise NotImplementedError

    # -- running the scheduler requests ------------------------------------------------

    def _request_id(self, index: int) -> str:
        return f"{self.response_id}-{index}"

    def _request_args(self, index: int) -> dict[str, Any]:
        """The client call's arguments for prompt ``index`` but its text."""
        return {
            "prompt_token_ids": self.prompts[index][1],
            "request_id": self._request_id(index),
            "priority": self.body.priority,
            "sampling": self.params,
            "timeout": None,
            "user": self.user,
        }

    async def _replica(self, index: int) -> int | None:
        """The replica that runs prompt ``index`` (None: a single scheduler), its load
        counted until :meth:`_released`. A text prompt the gateway tokenizes to route
        it is sent as its ids (tokenized as the scheduler would: not twice)."""
        replicas = self.gateway.replicas
        if replicas is None:
            return None
        ids = None
        if replicas.kv_events:
            ids = await self._prompt_ids(index)
            self.prompts[index] = (None, ids)
        replica = replicas.pick(ids)
        replicas.load[replica] += 1
        return replica

    def _released(self, replica: int | None, exc: BaseException | None) -> None:
        replicas = self.gateway.replicas
        if replicas is not None and replica is not None:
            replicas.load[replica] -= 1
            if exc is not None:
                replicas.failed(replica, exc)

    def _client_of(self, replica: int | None) -> AsyncClient:
        return self.client if replica is None else self.gateway.clients[replica]

    async def _generate(self, index: int) -> ClientCompletion:
        if self.body.zero_tokens and self.params.prompt_logprobs is None:
            return self._nothing_to_generate(index, await self._prompt_ids(index))
        replica = await self._replica(index)
        text = self.prompts[index][0]
        try:
            done = await self._client_of(replica).generate(text, **self._request_args(index))
        except BaseException as exc:
            self._released(replica, exc)
            raise
        self._released(replica, None)
        if done.prompt_logprobs is not None:
            self.prompt_ids[index] = done.prompt_token_ids
            self.prompt_lps[index] = done.prompt_logprobs
        if self.body.zero_tokens:  # ran for the prompt's logprobs: its token is dropped
            return without_output(done)
        return done

    async def render(self) -> list[dict[str, Any]]:
        """What each scheduler request of this body would be, without running it
        (``/v1/completions/render``, ``/v1/chat/completions/render``, as vLLM's): its id,
        the token ids the scheduler sees (the same template and tokenizer path as
        generation, so a router's keys are the prefix cache's), the sampling params."""
        params = msgspec.to_builtins(self.params)
        return [
            {
                "request_id": self._request_id(index),
                "model": self.model.name,
                "token_ids": await self._prompt_ids(index),
                "features": None,
                "sampling_params": params,
                "stream": bool(self.body.stream),
            }
            for index in range(len(self.prompts))
        ]

    async def complete(self) -> dict[str, Any]:
        """Run every prompt to the end; the whole response body. One failure (or a
        disconnect) cancels, so aborts, the rest."""
        results = await fan_out(len(self.prompts), self._generate)
        choices = []
        for prompt_index, result in enumerate(results):
            for sample in result.samples:
                choices.append(
                    self._choice(prompt_index * self.params.n + sample.index, prompt_index, sample)
                )
        choices.sort(key=lambda choice: choice["index"])
        return {
            "id": self.response_id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.model.name,
            "choices": choices,
            "usage": add_usage([r.usage for r in results]),
            **self._response_extra(),
        }

    def _events(self) -> AsyncIterator[tuple[int, Delta]]:
        """(prompt index, Delta) of every prompt's stream, merged; ``usages`` filled."""
        self.usages = [None] * len(self.prompts)
        self.prompt_tokens = [0] * len(self.prompts)
        if len(self.prompts) == 1:
            return self._one_stream(0)
        return self._merged()

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for _, delta in self._one_stream(index):
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        starter = asyncio.ensure_future(fan_out(len(self.prompts), pump))
        try:
            running = len(self.prompts)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            starter.cancel()  # and so every pump
            await asyncio.gather(starter, return_exceptions=True)

    async def _prompt_ids(self, index: int) -> list[int]:
        """Prompt ``index`` as token ids, tokenized as the scheduler would (a long text
        on a thread)."""
        text, token_ids = self.prompts[index]
        if token_ids is not None:
            return token_ids
        return await self.gateway.encode(self.model, text or "", special=True)

    def _nothing_to_generate(self, index: int, prompt: list[int]) -> ClientCompletion:
        """The answer to max_tokens 0 for ``prompt`` (prompt ``index``'s ids), without
        the scheduler: every sample empty, ended by length."""
        limit = self.model.max_model_len
        if limit is not None and len(prompt) > limit:
            raise GatewayRequestError(
                f"prompt: {len(prompt)} tokens, beyond max_model_len={limit}", param="prompt"
            )
        samples = [
            CompletionSample(index=i, token_ids=[], text="", finish_reason=FinishReason.LENGTH)
            for i in range(self.params.n)
        ]
        return ClientCompletion(
            request_id=self._request_id(index),
            prompt_token_ids=prompt,
            token_ids=[],
            text="",
            finish_reason=FinishReason.LENGTH,
            samples=samples,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=0),
            timings=Timings(queue_s=0.0, ttft_s=0.0, total_s=0.0),
        )

    async def _one_stream(self, index: int) -> AsyncIterator[tuple[int, Delta]]:
        if self.body.zero_tokens:
            done = await self._generate(index)
            self.prompt_tokens[index] = done.usage.prompt_tokens
            self.usages[index] = done.usage
            for sample in done.samples:
                yield (
                    index,
                    Delta(
                        request_id=done.request_id,
                        index=sample.index,
                        token_ids=[],
                        text="",
                        finish_reason=sample.finish_reason,
                    ),
                )
            return
        replica = await self._replica(index)
        text = self.prompts[index][0]
        failure: BaseException | None = None
        try:
            stream = self._client_of(replica).stream(text, **self._request_args(index))
            async with stream:  # leaving early (disconnect, error) aborts the request
                async for delta in stream:
                    if stream.prompt_token_ids is not None and not self.prompt_tokens[index]:
                        self.prompt_tokens[index] = len(stream.prompt_token_ids)
                    if delta.prompt_logprobs is not None and stream.prompt_token_ids is not None:
                        self.prompt_ids[index] = stream.prompt_token_ids
                        self.prompt_lps[index] = delta.prompt_logprobs
                    more = stream.ready()  # fell behind: one chunk per sample for all of it
                    if not more:
                        yield index, delta
                        continue
                    for merged in merge_deltas([delta, *more]):
                        yield index, merged
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._released(replica, failure)
        assert stream.completion is not None
        self.usages[index] = stream.completion.usage

    def stream(self) -> AsyncIterator[bytes]:
        """The SSE events. Errors before the first event are raised (the caller answers
        with an HTTP error); later ones become an error event. At most
        ``max_stream_buffer_bytes`` wait unsent (beyond, the request is aborted)."""
        limit = self.gateway.config.max_stream_buffer_bytes
        return bounded_stream(self._sse(), limit, self.response_id)

    async def _sse(self) -> AsyncIterator[bytes]:
        started = False
        n = self.params.n
        continuous_usage = self.body.continuous_usage
        completion_tokens = [0] * (len(self.prompts) * n)
        try:
            async for prompt_index, delta in self._events():
                index = prompt_index * n + delta.index
                if not started:
                    started = True
                    for event in self._opening(prompt_index):
                        yield event
                completion_tokens[index] += len(delta.token_ids)
                chunk = self._delta_chunk(index, prompt_index, delta)
                if chunk is None:
                    continue
                if continuous_usage:
                    chunk["usage"] = self._running_usage(completion_tokens)
                yield sse(chunk)
        except Exception as exc:
            if not started:
                raise
            yield sse(error_of(exc))
            yield DONE
            return
        if not started:  # every sample ended without text (yield the opening anyway)
            for event in self._opening(0):
                yield event
        if self.body.include_usage:
            yield sse({**self._chunk_head(), "choices": [], "usage": self._final_usage()})
        yield DONE

    def _running_usage(self, completion_tokens: list[int]) -> dict[str, Any]:
        return usage_body(sum(self.prompt_tokens), sum(completion_tokens), 0)

    def _final_usage(self) -> dict[str, Any]:
        return add_usage([u for u in self.usages if u is not None])

    def _chunk_head(self) -> dict[str, Any]:
        """The fields every chunk starts with (shared: copy, never change it)."""
        head = self.__dict__.get("_head")
        if head is None:
            head = self._head = {
                "id": self.response_id,
                "object": self.CHUNK_OBJECT,
                "created": self.created,
                "model": self.model.name,
            }
        return head

    # -- per endpoint -------------------------------------------------------------------

    def _opening(self, prompt_index: int) -> list[bytes]:
        return []

    def _response_extra(self) -> dict[str, Any]:
        """Top-level fields of the whole response beyond the common ones."""
        return {}

    def _prompt_logprobs(self, prompt_index: int) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` of prompt ``prompt_index``, when asked for."""
        if self.body.prompt_logprobs is None or prompt_index not in self.prompt_lps:
            return None
        return prompt_logprobs_body(
            self.prompt_ids[prompt_index], self.prompt_lps[prompt_index], self.token_text
        )

    def _choice(self, index: int, prompt_index: int, sample: CompletionSample) -> dict[str, Any]:
        raise NotImplementedError

    def _delta_chunk(self, index: int, prompt_index: int, delta: Delta) -> dict[str, Any] | None:
        raise NotImplementedError


def merge_deltas(deltas: list[Delta]) -> list[Delta]:
    """Consecutive Deltas as one per sample (in order of first appearance): tokens,
    text and logprobs joined, the last one's finish reason."""
    groups: dict[int, list[Delta]] = {}
    for delta in deltas:
        groups.setdefault(delta.index, []).append(delta)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        with_logprobs = [d.logprobs for d in group if d.logprobs is not None]
        merged.append(
            Delta(
                request_id=group[0].request_id,
                index=group[0].index,
                token_ids=[t for d in group for t in d.token_ids],
                text="".join(d.text for d in group),
                finish_reason=group[-1].finish_reason,
                stop_reason=group[-1].stop_reason,
                logprobs=[e for lp in with_logprobs for e in lp] if with_logprobs else None,
                prompt_logprobs=next(
                    (d.prompt_logprobs for d in group if d.prompt_logprobs is not None), None
                ),
            )
        )
    return merged


def without_output(done: ClientCompletion) -> ClientCompletion:
    """``done`` as if it generated nothing (max_tokens 0: it ran for the prompt's
    logprobs only); every sample empty, ended by length."""
    samples = [
        CompletionSample(index=s.index, token_ids=[], text="", finish_reason=FinishReason.LENGTH)
        for s in done.samples
    ]
    return msgspec.structs.replace(
        done,
        token_ids=[],
        text="",
        finish_reason=FinishReason.LENGTH,
        samples=samples,
        usage=msgspec.structs.replace(done.usage, completion_tokens=0),
    )


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
