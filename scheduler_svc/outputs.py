"""Turning scheduler progress into client events: detokenize, stop strings, Finished.

The step loop hands on what each step produced
(:class:`~scheduler_svc.core.step_records.StepOutput`, ``Scheduler.update``'s return
value: plain ids and tokens); the :class:`OutputProcessor` turns that into Delta /
Finished / ErrorReply messages, in the daemon in its own task while the workers compute
the next step, in ``LLM`` inline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from ipc.schema import (
    Delta,
    DeltaBatch,
    ErrorCode,
    ErrorReply,
    Finished,
    ServerMessage,
    Timings,
    Usage,
)
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.metrics import RequestMetrics
from shared.outputs import Completion, CompletionSample, FinishReason, PromptLogprobs
from shared.sampling import SamplingParams

RECENTLY_FINISHED = 16_384
"""Finished request ids remembered (with their owner), so a late Abort is answered
``aborted=False`` rather than ``unknown_request``."""


@dataclass(slots=True)
class ClientRequest:
    request_id: str
    client: bytes
    """The connection replies go to."""
    owner: bytes
    """Who may abort it: the client's CURVE key, else its connection (frontend.frame_owner)."""
    stream: bool
    params: SamplingParams
    prompt_token_ids: list[int]
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    """When the latest step with a token of this request was processed."""
    cached_tokens: int = 0
    samples: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    reasons: dict[int, FinishReason] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    prompt_entries: list[dict[int, float]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    """The prompt logprobs held so far, of positions 1..len (with prompt_logprobs)."""
    prompt_logprobs_sent: bool = False
    """Streaming: they went out on its first Delta."""
    ending: bool = False
    """Aborted or failed; its Finished / ErrorReply is on its way."""


@dataclass(slots=True, frozen=True)
class RequestEnded:
    """A request ended outside a step (aborted, its client gone, failed): it gets
    Finished with reason ``abort``, or, given a ``code``, ErrorReply(code, message)."""

    request_id: str
    code: ErrorCode | None = None
    message: str = ""


Send = Callable[[bytes, ServerMessage], None]
Logprobs = dict[int, float] | None
"""One token's logprobs (token id -> logprob), where the request asked for them."""


def _stop_reason(
    req: ClientRequest, detok: IncrementalDetokenizer, reason: FinishReason
) -> str | int | None:
    """The stop string, or the stop token id that ended a sample (None for EOS)."""
    if reason != FinishReason.STOP:
        return None
    if detok.stop_reason is not None:
        return detok.stop_reason
    last = detok.token_ids[-1] if detok.token_ids else None
    return last if last in req.params.stop_token_ids else None


def _hold_prompt_logprobs(req: ClientRequest, chunk: PromptLogprobs) -> str | None:
    """Add a step's prompt logprobs to ``req``'s: the positions it does not hold yet
    (a recomputed prefill reports its positions again). A gap is a server bug: its
    description is returned (the request fails) and nothing is added."""
    wanted = len(req.prompt_entries) + 1
    if chunk.first > wanted:
        return (
            f"prompt logprobs of position {chunk.first} arrived before those of position {wanted}"
        )
    skip = wanted - chunk.first
    req.prompt_entries.extend(chunk.entries[skip:])
    req.prompt_ranks.extend(chunk.ranks[skip:])
    return None


def _prompt_logprobs(req: ClientRequest) -> PromptLogprobs | None:
    if req.params.prompt_logprobs is None:
        return None
    return PromptLogprobs(first=1, entries=req.prompt_entries, ranks=req.prompt_ranks)


def _first_prompt_logprobs(req: ClientRequest) -> PromptLogprobs | None:
    """``req``'s prompt logprobs for the first Delta it sends, else None."""
    if req.prompt_logprobs_sent:
        return None
    req.prompt_logprobs_sent = True
    return _prompt_logprobs(req)


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, send: Send, finish_seq: Callable[[str], str | None]
    ) -> None:
        """``finish_seq(seq_id)`` ends a sample a stop string stopped and returns its
        request id when that ended the request (see ``StepEngine.stop_seq``)."""
        self.tokenizer = tokenizer
        self.send = send
        self.finish_seq = finish_seq
        self.requests: dict[str, ClientRequest] = {}
        self.finished_owners: OrderedDict[str, bytes] = OrderedDict()
        """The last RECENTLY_FINISHED requests that ended, by id -> owner."""
        self.metrics = RequestMetrics()

    def _forget(self, request_id: str) -> ClientRequest | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.finished_owners[request_id] = req.owner
            if len(self.finished_owners) > RECENTLY_FINISHED:
                self.finished_owners.popitem(last=False)
        return req

    def _sample(self, req: ClientRequest, index: int) -> IncrementalDetokenizer:
        detok = req.samples.get(index)
        if detok is None:
            assert self.tokenizer is not None, "outputs before the tokenizer was loaded"
            # Text matters only at the end of a request that neither streams nor stops
            # on a string: decode it once then, not a window every step.
            lazy = not req.stream and not req.params.stop
            detok = req.samples[index] = IncrementalDetokenizer(
                self.tokenizer,
                req.params.stop,
                lazy=lazy,
                keep_stop=req.params.include_stop_str_in_output,
                min_tokens=req.params.min_tokens,
            )
        return detok

    def handle(self, item: StepOutput | RequestEnded) -> None:
        if isinstance(item, StepOutput):
            self.on_step(item)
        elif item.code is not None:
            self.fail(item.request_id, item.code, item.message)
        else:
            self.finish(item.request_id)

    def on_step(self, output: StepOutput) -> None:
        if output.lost:
            return  # nothing of it reached the clients: its requests were re-queued
        for request_id, why in output.failed:  # what the request asked cannot go on
            self.fail(request_id, ErrorCode.BAD_REQUEST, why)
        now = output.time
        metrics = self.metrics
        plan = output.plan
        for new in plan.new_seqs:
            # A request's first sample (re)sent in full: its first time counts.
            if new.sample_index:
                continue
            req = self.requests.get(new.request_id)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = output.planned_at or now
                req.cached_tokens = new.num_computed_tokens  # its prefix-cache hit
                metrics.on_scheduled(len(req.prompt_token_ids))
        for request_id, chunk in output.prompt_logprobs:
            req = self.requests.get(request_id)
            if req is not None and (gap := _hold_prompt_logprobs(req, chunk)) is not None:
                self.fail(request_id, ErrorCode.INTERNAL, gap)
        generated = 0
        itl = metrics.itl
        ended = {(rid, index): reason for rid, index, reason in output.finished_seqs}
        stopped: list[str] = []
        outbox: dict[bytes, list[Delta]] = {}
        # Decode every sample's window in one batch, then advance each detokenizer.
        pending: list[tuple[ClientRequest, int, str, int, IncrementalDetokenizer, Logprobs]] = []
        windows: list[list[int]] = []
        for at, (request_id, index, seq_id, token) in enumerate(output.tokens):
            req = self.requests.get(request_id)
            if req is None:
                continue
            detok = self._sample(req, index)
            if detok.stopped:
                continue  # tokens after a stop string are not part of the output
            generated += 1
            if req.first_token is None:
                req.first_token = now
            elif req.last_token != now:  # once per request and step (n > 1: per sample)
                itl.observe(now - req.last_token)  # type: ignore[operator]  # set with first
            req.last_token = now
            entry = output.logprobs.get(at)
            if entry is not None:
                req.logprobs.setdefault(index, []).append(entry)
            if (window := detok.push(token)) is not None:  # None: decoded at the end
                pending.append((req, index, seq_id, token, detok, entry))
                windows.extend(window)
        metrics.on_step(plan.total_tokens, generated)
        decoded: list[str] = []
        if windows:
            assert self.tokenizer is not None
            decoded = self.tokenizer.decode_batch(windows, skip_special_tokens=True)
        for position, (req, index, seq_id, token, detok, entry) in enumerate(pending):
            request_id = req.request_id
            text = detok.advance(decoded[2 * position], decoded[2 * position + 1])
            reason = ended.get((request_id, index))
            if detok.stopped and index not in req.reasons:
                reason = FinishReason.STOP
                stopped.append(seq_id)
            if reason is not None:
                req.reasons.setdefault(index, reason)
                text += detok.flush()
            if req.stream:
                outbox.setdefault(req.client, []).append(
                    Delta(
                        request_id=request_id,
                        index=index,
                        token_ids=[token],
                        text=text,
                        finish_reason=reason,
                        logprobs=None if entry is None else [entry],
                        stop_reason=None if reason is None else _stop_reason(req, detok, reason),
                        prompt_logprobs=_first_prompt_logprobs(req),
                    )
                )
        for client, deltas in outbox.items():
            self.send(client, deltas[0] if len(deltas) == 1 else DeltaBatch(deltas=deltas))
        for request_id, index, reason in output.finished_seqs:
            req = self.requests.get(request_id)
            if req is not None:
                req.reasons.setdefault(index, reason)
        for seq_id in stopped:  # after their last Delta went out
            if (request_id := self.finish_seq(seq_id)) is not None:
                self.finish(request_id)
        for request_id in output.finished_requests:
            self.finish(request_id)

    def finish(self, request_id: str, reason_for_rest: FinishReason = FinishReason.ABORT) -> None:
        """Send Finished; samples with no reason yet end with ``reason_for_rest``."""
        req = self._forget(request_id)
        if req is None:
            return
        now = time.monotonic()
        samples = []
        for index in range(req.params.n):
            detok = self._sample(req, index)
            reason = req.reasons.get(index, reason_for_rest)
            tail = detok.flush()
            stop_reason = _stop_reason(req, detok, reason)
            if req.stream and (tail or index not in req.reasons):
                self.send(
                    req.client,
                    Delta(
                        request_id=request_id,
                        index=index,
                        token_ids=[],
                        text=tail,
                        finish_reason=reason,
                        stop_reason=stop_reason,
                        prompt_logprobs=_first_prompt_logprobs(req),
                    ),
                )
            samples.append(
                CompletionSample(
                    index=index,
                    token_ids=list(detok.token_ids),
                    text=detok.text,
                    finish_reason=reason,
                    logprobs=req.logprobs.get(index),
                    stop_reason=stop_reason,
                )
            )
        first_scheduled = req.first_scheduled if req.first_scheduled is not None else now
        first_token = req.first_token if req.first_token is not None else now
        self.metrics.on_finished(
            samples[0].finish_reason,
            first_scheduled - req.arrival,
            None if req.first_token is None else first_token - req.arrival,
            now - req.arrival,
        )
        self.send(
            req.client,
            Finished(
                request_id=request_id,
                completion=Completion(
                    request_id=request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    samples=samples,
                    prompt_logprobs=_prompt_logprobs(req),
                ),
                usage=Usage(
                    prompt_tokens=len(req.prompt_token_ids),
                    completion_tokens=sum(len(s.token_ids) for s in samples),
                    cached_tokens=req.cached_tokens,
                ),
                timings=Timings(
                    queue_s=first_scheduled - req.arrival,
                    ttft_s=first_token - req.arrival,
                    total_s=now - req.arrival,
                ),
            ),
        )

    def fail(self, request_id: str, code: ErrorCode, message: str) -> None:
        req = self._forget(request_id)
        if req is not None:
            self.send(req.client, ErrorReply(request_id=request_id, code=code, message=message))
