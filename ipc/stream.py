"""One request as the client sees it: :class:`AsyncStream` (its events, which
:meth:`~ipc.async_client.AsyncClient.generate` and
:meth:`~ipc.async_client.AsyncClient.stream` both consume), its result
:class:`ClientCompletion`, and the checks that build its ``Generate`` frame. The stream
reaches its client only through :class:`StreamClient`."""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import msgspec

from ipc.errors import (
    ClientClosedError,
    ClientTimeoutError,
    ServerUnavailableError,
    error_from_reply,
)
from ipc.schema import (
    Accepted,
    ClientMessage,
    Delta,
    ErrorReply,
    Finished,
    Generate,
    Timings,
    Usage,
)
from shared.outputs import CompletionSample, FinishReason, PromptLogprobs
from shared.sampling import SamplingParams

__all__ = [
    "AsyncStream",
    "ClientCompletion",
    "Event",
    "Failure",
    "RepliesLostError",
    "StreamClient",
    "generate_message",
]

_T = TypeVar("_T")


class ClientCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request as the client sees it.

    The server's :class:`~shared.outputs.Completion` flattened, with what ``Finished``
    adds: ``token_ids``, ``text`` and ``finish_reason`` are those of sample 0 (the only
    one unless ``n > 1``); ``samples`` holds all of them.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    samples: list[CompletionSample]
    usage: Usage
    timings: Timings
    """``queue_s`` (arrival to first scheduled), ``ttft_s`` (to first token),
    ``total_s`` (to finish), all measured by the server."""
    prompt_logprobs: PromptLogprobs | None = None
    """With ``prompt_logprobs``: the logprobs of every prompt position from 1."""

    @classmethod
    def from_finished(cls, finished: Finished) -> ClientCompletion:
        samples = sorted(finished.completion.samples, key=lambda sample: sample.index)
        first = samples[0] if samples else None
        return cls(
            request_id=finished.request_id,
            prompt_token_ids=finished.completion.prompt_token_ids,
            token_ids=first.token_ids if first else [],
            text=first.text if first else "",
            finish_reason=first.finish_reason if first else FinishReason.ABORT,
            samples=samples,
            usage=finished.usage,
            timings=finished.timings,
            prompt_logprobs=finished.completion.prompt_logprobs,
        )


class RepliesLostError(ServerUnavailableError):
    """Replies of the server to this client were lost on the way (a gap in their
    numbers), or the server started numbering afresh while calls waited (it restarted,
    or took this client as gone): every call that was waiting fails with this, since
    any of them may have lost its reply. A 503 in the gateway, like a silent server."""

    def __init__(self, address: str, detail: str) -> None:
        ConnectionError.__init__(self, f"replies from the server at {address} were lost: {detail}")
        self.address = address
        self.silent_s = 0.0
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.address, self.detail))


Failure = ClientClosedError | ServerUnavailableError
"""What fails every waiting call at once (see ``AsyncClient._fail_all``)."""

Event = Accepted | Delta | Finished | ErrorReply | Failure
"""What the receiver (or ``_fail_all``) hands a request's queue."""


class StreamClient(Protocol):
    """What an :class:`AsyncStream` needs of its client (an
    :class:`~ipc.async_client.AsyncClient`)."""

    def _ensure_started(self) -> None: ...

    def _register(self, request_id: str) -> asyncio.Queue[Event]: ...

    async def _send(self, message: ClientMessage) -> None: ...

    def _forget(self, request_id: str, queue: asyncio.Queue[Event], *, abort: bool) -> None: ...

    def _forget_threadsafe(self, request_id: str, queue: asyncio.Queue[Event]) -> None: ...


class _StreamState(enum.Enum):
    NEW = "new"  # not sent yet
    OPEN = "open"  # registered with the client and sent
    DONE = "done"  # finished, failed, timed out or closed


class AsyncStream:
    """The Delta events of one streaming request: ``async for delta in stream``.

    Made by :meth:`~ipc.async_client.AsyncClient.stream`; the request is sent on the
    first iteration (or on ``async with``). Iteration ends cleanly after the server's
    ``Finished``, whose :class:`ClientCompletion` is then :attr:`completion`; an
    ``ErrorReply`` raises the matching :class:`~ipc.errors.ServerError`, the deadline
    :class:`~ipc.errors.ClientTimeoutError`, and a server silent for the client's
    ``server_timeout_s`` :class:`~ipc.errors.ServerUnavailableError` (the request is
    then aborted on the server without waiting, in case it was only stalled).
    ``timeout`` bounds the whole request, from sending to ``Finished``.

    Leaving early (``break``, an exception, :meth:`aclose`, or dropping the object)
    aborts the request on the server, best effort. ``async with`` makes that explicit::

        async with client.stream("Hi", max_tokens=100) as stream:
            async for delta in stream:
                if "." in delta.text:
                    break  # the request is aborted on exit
    """

    def __init__(
        self,
        client: StreamClient,
        request: Generate,
        timeout: float | None,
        operation: str = "stream",
    ) -> None:
        self._client = client
        self._request = request
        self._timeout = timeout
        self._operation = operation
        self._state = _StreamState.NEW
        self._queue: asyncio.Queue[Event] | None = None
        self._held: Event | None = None
        """An event :meth:`ready` took that is not a Delta: the next one iteration sees."""
        self._deadline: float | None = None
        self.request_id: str = request.request_id
        self.prompt_token_ids: list[int] | None = None
        """The prompt as the server tokenized it, once ``Accepted`` arrived."""
        self.completion: ClientCompletion | None = None
        """The result, once iteration ended with ``Finished``."""

    @property
    def done(self) -> bool:
        return self._state is _StreamState.DONE

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delta:
        delta = await self._next_or_none()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def __aenter__(self) -> Self:
        await self._guarded(self._open())
        return self

    def ready(self) -> list[Delta]:
        """The Deltas that already arrived, taken without waiting (empty when none): a
        consumer that fell behind can handle several steps' output at once. Anything
        else (the end, an error) is left for the next iteration."""
        deltas: list[Delta] = []
        queue = self._queue
        if self._state is not _StreamState.OPEN or queue is None:
            return deltas
        while self._held is None and not queue.empty():
            event = queue.get_nowait()
            if isinstance(event, Delta):
                deltas.append(event)
            elif isinstance(event, Accepted):
                self.prompt_token_ids = event.prompt_token_ids
            else:
                self._held = event
        return deltas

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: a request still running is aborted on the server (without waiting)."""
        self._finish(abort=self._state is _StreamState.OPEN)

    async def _next_or_none(self) -> Delta | None:
        """The next Delta, or None once the request finished."""
        if self._state is _StreamState.DONE:
            return None
        return await self._guarded(self._next_delta())

    async def _guarded(self, step: Coroutine[Any, Any, _T]) -> _T:
        """Run ``step``; on a timeout, a cancellation or any failure, leave the stream
        done and abort the request on the server if it was sent."""
        try:
            return await step
        except TimeoutError:
            self._finish(abort=True)
            if self._timeout is None:
                raise
            raise ClientTimeoutError(self.request_id, self._timeout, self._operation) from None
        except BaseException:
            self._finish(abort=True)
            raise

    async def _open(self) -> None:
        if self._state is not _StreamState.NEW:
            return
        client = self._client
        client._ensure_started()
        self._queue = client._register(self.request_id)
        self._state = _StreamState.OPEN
        if self._timeout is not None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout
        async with asyncio.timeout_at(self._deadline):
            await client._send(self._request)

    async def _next_delta(self) -> Delta | None:
        await self._open()
        while True:
            event = await self._next_event()
            if isinstance(event, Delta):
                return event
            if isinstance(event, Accepted):
                self.prompt_token_ids = event.prompt_token_ids
                continue
            self._finish(abort=False)
            if isinstance(event, Finished):
                self.completion = ClientCompletion.from_finished(event)
                return None
            if isinstance(event, ErrorReply):
                raise error_from_reply(event)
            raise event

    async def _next_event(self) -> Event:
        if self._held is not None:
            event, self._held = self._held, None
            return event
        queue = self._queue
        assert queue is not None
        if not queue.empty():  # whatever already arrived wins over the deadline
            return queue.get_nowait()
        if self._deadline is None:
            return await queue.get()
        async with asyncio.timeout_at(self._deadline):
            return await queue.get()

    def _finish(self, *, abort: bool) -> None:
        if self._state is _StreamState.OPEN:
            assert self._queue is not None
            self._client._forget(self.request_id, self._queue, abort=abort)
        self._state = _StreamState.DONE

    def __del__(self) -> None:
        if getattr(self, "_state", None) is _StreamState.OPEN and self._queue is not None:
            self._client._forget_threadsafe(self.request_id, self._queue)


def generate_message(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    request_id: str | None,
    priority: int,
    sampling: SamplingParams | None,
    sampling_fields: dict[str, Any],
    stream: bool,
    user: str = "",
) -> Generate:
    """Check the arguments of generate/stream and build the Generate frame."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt and prompt_token_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
    if prompt_token_ids is not None:
        prompt_token_ids = list(prompt_token_ids)
        if not all(type(token) is int for token in prompt_token_ids):
            raise ValueError("prompt_token_ids: expected a list of integers")
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: expected a non-empty string, got {request_id!r}")
    if type(priority) is not int:
        raise ValueError(f"priority: expected an integer, got {priority!r}")
    if not isinstance(user, str):
        raise ValueError(f"user: expected a string, got {type(user).__name__}")
    if sampling is None:
        sampling = SamplingParams.from_dict(sampling_fields)
    elif sampling_fields:
        raise ValueError("give either sampling or SamplingParams fields as keywords, not both")
    return Generate(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        priority=priority,
        stream=stream,
        user=user,
    )
