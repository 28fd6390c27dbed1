"""The pieces of the soak test's load (benchmarks/soak.py): random request specs and the
check of what came back, the ledger of every request's one outcome, the bad frames the
frontend must refuse, and samples of a process's RSS and open fds."""

from __future__ import annotations

import enum
import os
import random
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ipc.async_client import ClientCompletion
from ipc.schema import Generate, encode
from shared import stats
from shared.sampling import SamplingParams

TOKEN_IDS = (3, 250)
PROMPT_LEN = (1, 200)
MAX_TOKENS = (1, 64)
STOP_CHARS = "aeiou .,"
HUGE_FIELD_CHARS = 1_000_000
NESTED_FRAME = b"\x81\xa1a" * 1000 + b"\xc0"
EXAMPLES = 10


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    REFUSED = "refused"
    DISCONNECTED = "disconnected"
    FAILED = "failed"


@dataclass(slots=True)
class Record:
    """One request sent and what became of it."""

    kind: str
    request_id: str
    sent_at: float
    outcome: Outcome | None = None
    code: str = ""
    """The ErrorReply code of a refusal."""
    ended_at: float = 0.0


class Ledger:
    """Every request sent, each with exactly one terminal outcome."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.records: list[Record] = []
        self.unexpected: Counter[str] = Counter()
        """Unexpected errors by kind (an error code, an exception name...)."""
        self.examples: list[str] = []
        """The first of each kind of unexpected error, then more up to EXAMPLES."""

    def open(self, kind: str, request_id: str) -> Record:
        record = Record(kind, request_id, time.monotonic())
        self.records.append(record)
        return record

    def close(
        self,
        record: Record,
        outcome: Outcome,
        detail: str = "",
        *,
        code: str = "",
        unexpected: str = "",
    ) -> None:
        """Give ``record`` its outcome; a non-empty ``unexpected`` (the kind of error)
        counts it as an unexpected error."""
        if record.outcome is not None:
            self.flag("second outcome", f"{record.kind} {record.request_id}: {outcome}")
            return
        record.outcome, record.code, record.ended_at = outcome, code, time.monotonic()
        if unexpected:
            self.flag(unexpected, f"{record.kind} {record.request_id}: {outcome} {detail}")

    def flag(self, kind: str, what: str) -> None:
        new = kind not in self.unexpected
        self.unexpected[kind] += 1
        if new or len(self.examples) < EXAMPLES:
            self.examples.append(f"t={time.monotonic() - self.started:.1f}s {what}"[:400])


@dataclass(frozen=True, slots=True)
class Spec:
    """One random load request."""

    kind: str
    """generate | stream | stream_break | abort_by_id"""
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    break_after: int
    """Deltas read before a stream_break leaves."""
    abort_after_s: float
    """Delay before an abort_by_id aborts."""

    @classmethod
    def draw(cls, rng: random.Random) -> Spec:
        kind = rng.choices(
            ("generate", "stream", "stream_break", "abort_by_id"), weights=(40, 30, 15, 15)
        )[0]
        length = rng.randint(*PROMPT_LEN)
        text = rng.random() < 0.1
        prompt = "".join(rng.choices(string.ascii_letters + " ", k=length)) if text else None
        token_ids = None if text else [rng.randint(*TOKEN_IDS) for _ in range(length)]
        stop = tuple(rng.sample(STOP_CHARS, rng.randint(1, 2))) if rng.random() < 0.2 else ()
        sampling = SamplingParams(
            max_tokens=rng.randint(*MAX_TOKENS),
            temperature=rng.choice((0.0, 1.0)),
            seed=rng.randrange(2**31),
            n=2 if rng.random() < 0.1 else 1,
            stop=stop,
            ignore_eos=rng.random() < 0.3,
        )
        return cls(kind, prompt, token_ids, sampling, rng.randint(1, 4), rng.uniform(0.02, 1.0))


def check_completion(spec: Spec, completion: ClientCompletion) -> str:
    """What is inconsistent between a finished (not aborted) request and its spec."""
    params = spec.sampling
    if len(completion.samples) != params.n:
        return f"{len(completion.samples)} samples for n={params.n}"
    assert params.max_tokens is not None
    for sample in completion.samples:
        count, reason = len(sample.token_ids), sample.finish_reason
        if reason not in ("stop", "length"):
            return f"sample {sample.index} finished with {reason!r}"
        if count > params.max_tokens or (reason == "length" and count != params.max_tokens):
            return (
                f"sample {sample.index}: {count} tokens, {reason}, max_tokens {params.max_tokens}"
            )
        if reason == "stop" and params.ignore_eos and not params.stop:
            return f"sample {sample.index} stopped after {count} tokens despite ignore_eos"
    return ""


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, :func:`shared.stats.percentile`), None if empty."""
    return stats.percentile(values, q) if values else None


def bad_frame(kind: str, rng: random.Random, number: int) -> list[bytes]:
    """A message the frontend must refuse with an ErrorReply."""
    if kind == "random_bytes":
        return [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))]
    if kind == "truncated":
        valid = encode(
            Generate(
                request_id=f"truncated-{number}",
                prompt_token_ids=[rng.randint(*TOKEN_IDS) for _ in range(rng.randint(1, 20))],
                sampling=SamplingParams(max_tokens=4),
            )
        )
        return [valid[: rng.randrange(len(valid))]]
    if kind == "nested":
        return [NESTED_FRAME]
    if kind == "huge_string":
        return [
            msgspec.msgpack.encode(
                {
                    "type": "generate",
                    "request_id": f"huge-{number}",
                    "prompt": "x" * HUGE_FIELD_CHARS,
                    "priority": "high",
                }
            )
        ]
    if kind == "wrong_types":
        rid = f"wrong-{number}"
        return [
            msgspec.msgpack.encode(
                rng.choice(
                    [
                        {"type": "generate", "request_id": number, "prompt": "hi"},
                        {"type": "generate", "request_id": rid, "prompt_token_ids": ["a"]},
                        {"type": "generate", "request_id": rid, "prompt": "hi", "sampling": [1]},
                        {
                            "type": "generate",
                            "request_id": rid,
                            "prompt": "hi",
                            "sampling": {"max_tokens": "many"},
                        },
                        {"type": "generate", "request_id": rid, "prompt": "hi", "stream": "yes"},
                        {"type": "abort", "request_id": [rid]},
                        {"type": 7},
                        [1, 2, 3],
                    ]
                )
            )
        ]
    assert kind == "multipart"
    return [b"\x81\xa4type\xa4ping", b"a second part"]


BAD_FRAME_KINDS = ("random_bytes", "truncated", "nested", "huge_string", "wrong_types", "multipart")


def rss_mb_and_fds(pid: int) -> tuple[float, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024, fds
    return None


@dataclass(slots=True)
class Samples:
    """The scheduler's RSS (MB) and open fds over the run."""

    warmup_s: float
    at_warmup: tuple[float, int] | None = None
    max_rss_mb: float = 0.0
    max_fds: int = 0
    last: tuple[float, int] | None = None
    series: list[tuple[float, float, int]] = field(default_factory=list)
    """Every sample: (seconds into the run, RSS MB, fds)."""

    def add(self, elapsed: float, sample: tuple[float, int]) -> None:
        if self.at_warmup is None and elapsed >= self.warmup_s:
            self.at_warmup = sample
        self.max_rss_mb = max(self.max_rss_mb, sample[0])
        self.max_fds = max(self.max_fds, sample[1])
        self.last = sample
        self.series.append((elapsed, sample[0], sample[1]))

    def timeline(self, points: int = 11) -> list[list[float]]:
        """About ``points`` samples spread evenly over the run: [s, RSS MB, fds]."""
        if not self.series:
            return []
        stride = max(1, (len(self.series) - 1) // (points - 1))
        picked = self.series[::stride]
        if picked[-1] is not self.series[-1]:
            picked.append(self.series[-1])
        return [[round(t, 1), round(rss, 1), fds] for t, rss, fds in picked]

    def report(self) -> dict[str, Any]:
        warm, last = self.at_warmup, self.last
        return {
            "timeline": self.timeline(),
            "warmup_at_s": self.warmup_s,
            "rss_mb": {
                "warmup": warm and round(warm[0], 1),
                "max": round(self.max_rss_mb, 1),
                "final": last and round(last[0], 1),
                "growth": round(last[0] - warm[0], 1) if warm and last else None,
            },
            "fds": {
                "warmup": warm and warm[1],
                "max": self.max_fds,
                "final": last and last[1],
                "growth": last[1] - warm[1] if warm and last else None,
            },
        }
