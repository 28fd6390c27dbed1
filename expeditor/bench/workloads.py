"""Seeded benchmark workloads for ``expeditor bench``.

A :class:`Workload` is a named list of :class:`BenchRequest` (token ids, output length,
arrival time in seconds after the start of the run) plus optional scheduler-config hints.
Every generator draws from its own ``random.Random(seed)``: the same arguments and seed
give an identical workload, a different seed a different one. Token ids are drawn
uniformly from ``vocab`` (default ``range(3, 259)``, the byte tokens of the embedded tiny
model) and every prompt starts with the BOS id ``1``; prompt lengths always *include* that
BOS token. Requests are listed in order of arrival and ask for ``ignore_eos=True``, so each
one generates exactly ``max_tokens`` tokens.

Built-in workloads (see :data:`WORKLOADS` and :func:`make_workload`):

``skewed``
    All requests arrive at once; output lengths are exponential, so a few requests are far
    longer than the rest -- the case where static batching suffers head-of-line blocking.
``poisson``
    Arrivals with gamma-distributed gaps at a given mean rate (Poisson when
    ``burstiness == 1``), as vLLM's serving benchmark generates them.
``shared-prefix``
    A few long shared system prompts, each request adding a distinct suffix: exercises the
    prefix cache.
``pressure``
    All at once, with a ``num_gpu_blocks`` hint far below the working set: forces
    preemption (swap or recompute).
``json``
    All at once, each request constrained to a JSON schema of its own
    (:mod:`expeditor.bench.json_workload`).
``long-context``
    All at once, contexts several times a sliding window, a pool whole contexts overflow
    (:mod:`expeditor.bench.long_context_workload`).

A ``.jsonl`` file can be loaded instead with :func:`from_jsonl`.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

__all__ = [
    "BOS_TOKEN_ID",
    "DEFAULT_VOCAB",
    "WORKLOADS",
    "BenchRequest",
    "Workload",
    "from_jsonl",
    "generators",
    "make_workload",
    "poisson",
    "pressure",
    "shared_prefix",
    "skewed",
]

BOS_TOKEN_ID = 1
"""Token id every generated prompt starts with."""

DEFAULT_VOCAB = range(3, 259)
"""Token ids generated prompts are drawn from: the tiny model's byte tokens."""


class BenchRequest(msgspec.Struct, frozen=True):
    """One request of a workload.

    ``arrival_s`` is when the request is submitted, in seconds after the start of the run.
    ``ignore_eos`` asks the target to generate exactly ``max_tokens`` tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float
    ignore_eos: bool = True
    structured_outputs: dict[str, object] | None = None
    """What the output must match (:class:`~shared.structured_output.StructuredOutput`'s
    fields, e.g. ``{"json": schema}``); the json workload's."""


class Workload(msgspec.Struct, frozen=True):
    """A named, ordered list of requests.

    ``config`` holds scheduler-config hints (``SchedulerConfig`` field names, e.g.
    ``{"num_gpu_blocks": 40, "block_size": 16}`` for ``pressure``) that a target should
    apply for the workload to mean what its description says.
    """

    name: str
    requests: list[BenchRequest]
    description: str
    config: dict[str, object] = {}

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def constrained(self) -> bool:
        """Whether some request carries structured outputs (the json workload)."""
        return any(request.structured_outputs is not None for request in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(request.prompt_token_ids) for request in self.requests)

    @property
    def total_output_tokens(self) -> int:
        """Sum of ``max_tokens`` (exact when every request ignores EOS)."""
        return sum(request.max_tokens for request in self.requests)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + ``max_tokens`` of any request: the context a target must allow."""
        return max(
            (len(request.prompt_token_ids) + request.max_tokens for request in self.requests),
            default=0,
        )


# ---------------------------------------------------------------------------- helpers


def check_count(num_requests: int) -> None:
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")


def check_range(name: str, bounds: tuple[int, int], minimum: int = 1) -> tuple[int, int]:
    try:
        low, high = bounds
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair, got {bounds!r}") from None
    if not (isinstance(low, int) and isinstance(high, int) and minimum <= low <= high):
        raise ValueError(f"{name} must satisfy {minimum} <= low <= high, got {bounds!r}")
    return low, high


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and not math.isnan(value)):
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_pool_hint(pool_fraction: float, block_size: int) -> None:
    """The arguments a generator sizes its ``num_gpu_blocks`` hint from."""
    if not (isinstance(pool_fraction, int | float) and 0 < pool_fraction <= 1):
        raise ValueError(f"pool_fraction must be in (0, 1], got {pool_fraction!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")


def check_vocab(vocab: Sequence[int]) -> None:
    if len(vocab) == 0:
        raise ValueError("vocab must not be empty")


def _tokens(rng: random.Random, vocab: Sequence[int], count: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(count)]


def random_prompt(rng: random.Random, vocab: Sequence[int], length: int) -> list[int]:
    """BOS followed by ``length - 1`` random tokens (``length`` includes the BOS)."""
    return [BOS_TOKEN_ID, *_tokens(rng, vocab, length - 1)]


def _poisson_arrivals(
    rng: random.Random, count: int, rate: float, burstiness: float = 1.0
) -> list[float]:
    """First arrival at 0, then gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness))."""
    if math.isinf(rate):
        return [0.0] * count
    scale = 1.0 / (rate * burstiness)
    arrivals: list[float] = []
    now = 0.0
    for index in range(count):
        if index:
            now += rng.gammavariate(burstiness, scale)
        arrivals.append(now)
    return arrivals


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ---------------------------------------------------------------------------- generators


def skewed(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 256),
    mean_output: float = 64,
    max_output: int = 256,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """All requests at once with heavy-tailed output lengths (head-of-line blocking).

    - arrivals: every request at ``arrival_s = 0``;
    - prompt length (BOS included): uniform integer in ``[prompt_len[0], prompt_len[1]]``;
    - ``max_tokens``: ``round(X)`` with ``X ~ Exponential(mean=mean_output)``, clamped to
      ``[1, max_output]`` (so the realised mean is slightly below ``mean_output``: the
      clamp at ``max_output`` removes ``mean_output * exp(-max_output / mean_output)``).

    Static batching holds each batch until its longest request finishes, so the few long
    outputs block the many short ones; continuous batching refills the freed slots.
    """
    check_count(num_requests)
    low, high = check_range("prompt_len", prompt_len)
    _check_positive("mean_output", mean_output)
    if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
        raise ValueError(f"max_output must be an integer >= 1, got {max_output!r}")
    check_vocab(vocab)
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt = random_prompt(rng, vocab, rng.randint(low, high))
        output = min(max_output, max(1, round(rng.expovariate(1.0 / mean_output))))
        requests.append(BenchRequest(f"skewed-{index}", prompt, output, 0.0))
    return Workload(
        "skewed",
        requests,
        f"{num_requests} requests all arriving at t=0; prompt {low}-{high} tokens (uniform); "
        f"output exponential with mean {mean_output:g}, rounded and clamped to "
        f"[1, {max_output}]: a few long outputs head-of-line block static batching",
    )


def poisson(
    num_requests: int,
    *,
    seed: int = 0,
    rate: float = 4.0,
    burstiness: float = 1.0,
    prompt_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (16, 128),
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """Requests arriving over time at a mean ``rate`` per second.

    - arrivals: the first request at 0; each following one after a gap drawn from
      ``Gamma(shape=burstiness, scale=1 / (rate * burstiness))`` -- mean ``1 / rate``,
      coefficient of variation ``1 / sqrt(burstiness)``. ``burstiness == 1`` is a Poisson
      process (exponential gaps); ``< 1`` is burstier, ``> 1`` more regular (as in vLLM's
      ``benchmark_serving``). ``rate = inf`` puts every request at 0;
    - prompt length (BOS included): uniform integer in ``[prompt_len[0], prompt_len[1]]``;
    - ``max_tokens``: uniform integer in ``[output_len[0], output_len[1]]``.
    """
    check_count(num_requests)
    p_low, p_high = check_range("prompt_len", prompt_len)
    o_low, o_high = check_range("output_len", output_len)
    _check_positive("rate", rate)
    _check_positive("burstiness", burstiness)
    check_vocab(vocab)
    rng = random.Random(seed)
    arrivals = _poisson_arrivals(rng, num_requests, rate, burstiness)
    requests = []
    for index, arrival in enumerate(arrivals):
        prompt = random_prompt(rng, vocab, rng.randint(p_low, p_high))
        requests.append(
            BenchRequest(f"poisson-{index}", prompt, rng.randint(o_low, o_high), arrival)
        )
    kind = "Poisson" if burstiness == 1 else f"gamma (burstiness {burstiness:g})"
    return Workload(
        "poisson",
        requests,
        f"{num_requests} requests with {kind} arrivals at {rate:g} req/s; prompt "
        f"{p_low}-{p_high} tokens, output {o_low}-{o_high} tokens (uniform)",
    )


def shared_prefix(
    num_requests: int,
    *,
    seed: int = 0,
    num_prefixes: int = 4,
    prefix_len: int = 192,
    suffix_len: tuple[int, int] = (8, 32),
    output_len: tuple[int, int] = (16, 48),
    rate: float | None = None,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """A few long shared system prompts, each request adding its own suffix (prefix cache).

    - ``num_prefixes`` distinct random prefixes of exactly ``prefix_len`` tokens;
    - request prompt = ``[BOS] + prefix + suffix``, length ``1 + prefix_len + len(suffix)``;
      request ``i`` uses prefix ``i % num_prefixes`` before the requests are shuffled, so
      every prefix is used (``num_requests // num_prefixes`` or one more times) whenever
      ``num_requests >= num_prefixes``;
    - suffix length: uniform integer in ``[suffix_len[0], suffix_len[1]]``; suffixes are
      distinct across requests;
    - ``max_tokens``: uniform integer in ``[output_len[0], output_len[1]]``;
    - arrivals: every request at 0, or, when ``rate`` is given, a Poisson process at
      ``rate`` requests per second (first request at 0, exponential gaps of mean
      ``1 / rate``).
    """
    check_count(num_requests)
    if isinstance(num_prefixes, bool) or not isinstance(num_prefixes, int) or num_prefixes < 1:
        raise ValueError(f"num_prefixes must be an integer >= 1, got {num_prefixes!r}")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 1:
        raise ValueError(f"prefix_len must be an integer >= 1, got {prefix_len!r}")
    s_low, s_high = check_range("suffix_len", suffix_len)
    o_low, o_high = check_range("output_len", output_len)
    if rate is not None:
        _check_positive("rate", rate)
    check_vocab(vocab)
    rng = random.Random(seed)
    prefixes: list[list[int]] = []
    seen_prefixes: set[tuple[int, ...]] = set()
    while len(prefixes) < num_prefixes:
        for _attempt in range(1000):
            prefix = _tokens(rng, vocab, prefix_len)
            if tuple(prefix) not in seen_prefixes:
                break
        else:
            raise ValueError(
                f"cannot draw {num_prefixes} distinct prefixes of {prefix_len} tokens "
                f"from a vocabulary of {len(vocab)}"
            )
        seen_prefixes.add(tuple(prefix))
        prefixes.append(prefix)
    choice = [index % num_prefixes for index in range(num_requests)]
    rng.shuffle(choice)
    arrivals = (
        _poisson_arrivals(rng, num_requests, rate) if rate is not None else [0.0] * num_requests
    )
    seen_suffixes: set[tuple[int, ...]] = set()
    requests = []
    for index, (prefix_index, arrival) in enumerate(zip(choice, arrivals, strict=True)):
        for _attempt in range(1000):
            suffix = _tokens(rng, vocab, rng.randint(s_low, s_high))
            if tuple(suffix) not in seen_suffixes:
                break
        else:
            raise ValueError(
                f"cannot draw {num_requests} distinct suffixes of {s_low}-{s_high} tokens "
                f"from a vocabulary of {len(vocab)}"
            )
        seen_suffixes.add(tuple(suffix))
        prompt = [BOS_TOKEN_ID, *prefixes[prefix_index], *suffix]
        requests.append(
            BenchRequest(f"shared-prefix-{index}", prompt, rng.randint(o_low, o_high), arrival)
        )
    arrival_text = "all arriving at t=0" if rate is None else f"Poisson arrivals at {rate:g} req/s"
    return Workload(
        "shared-prefix",
        requests,
        f"{num_requests} requests {arrival_text}; prompt = BOS + one of {num_prefixes} shared "
        f"{prefix_len}-token prefixes + a distinct {s_low}-{s_high}-token suffix; output "
        f"{o_low}-{o_high} tokens (uniform): exercises the prefix cache",
    )


def pressure(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (64, 256),
    output_len: tuple[int, int] = (64, 192),
    pool_fraction: float = 0.25,
    block_size: int = 16,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """All requests at once against a KV pool far smaller than their working set.

    - arrivals: every request at 0;
    - prompt length (BOS included): uniform integer in ``[prompt_len[0], prompt_len[1]]``;
    - ``max_tokens``: uniform integer in ``[output_len[0], output_len[1]]``;
    - ``config`` hint: ``block_size`` and ``num_gpu_blocks = max(need_max + 1,
      int(pool_fraction * need_total))`` where a request needs
      ``ceil((prompt + max_tokens) / block_size)`` blocks, ``need_max`` is the largest such
      need and ``need_total`` their sum (the working set). Every request fits in the pool
      on its own, but all of them together do not, so the scheduler must preempt (swap or
      recompute).
    """
    check_count(num_requests)
    p_low, p_high = check_range("prompt_len", prompt_len)
    o_low, o_high = check_range("output_len", output_len)
    check_pool_hint(pool_fraction, block_size)
    check_vocab(vocab)
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt = random_prompt(rng, vocab, rng.randint(p_low, p_high))
        requests.append(BenchRequest(f"pressure-{index}", prompt, rng.randint(o_low, o_high), 0.0))
    needs = [_blocks(len(r.prompt_token_ids) + r.max_tokens, block_size) for r in requests]
    need_total = sum(needs)
    num_gpu_blocks = max(max(needs, default=0) + 1, int(pool_fraction * need_total))
    return Workload(
        "pressure",
        requests,
        f"{num_requests} requests all arriving at t=0; prompt {p_low}-{p_high} tokens, output "
        f"{o_low}-{o_high} tokens (uniform); KV pool hint of {num_gpu_blocks} blocks of "
        f"{block_size} tokens against a working set of {need_total} blocks "
        f"({pool_fraction:g} of it): far smaller than the working set, forcing preemption",
        config={"num_gpu_blocks": num_gpu_blocks, "block_size": block_size},
    )


# ---------------------------------------------------------------------------- jsonl

_JSONL_KEYS = ("prompt_token_ids", "prompt_len", "max_tokens", "arrival_s", "id", "ignore_eos")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_jsonl(
    path: str | Path,
    *,
    seed: int = 0,
    vocab: Sequence[int] = DEFAULT_VOCAB,
    num_requests: int | None = None,
) -> Workload:
    """Load a workload from a JSON-lines file, one request (a JSON object) per line.

    Keys: either ``"prompt_token_ids": [int, ...]`` (used as given, no BOS added) or
    ``"prompt_len": int`` (BOS + ``prompt_len - 1`` tokens drawn from ``vocab`` with
    ``random.Random(seed)``, in file order); ``"max_tokens": int >= 1``; optional
    ``"arrival_s": float >= 0`` (default 0), ``"id": str`` (default ``"<file stem>-<line>"``,
    must be unique) and ``"ignore_eos": bool`` (default true). Blank lines and lines
    starting with ``#`` are skipped; any other key is an error. Requests are ordered by
    arrival (stable, so file order among equal arrivals). ``num_requests`` keeps only the
    first that many requests of the file (``None``: all). Errors raise ``ValueError``
    naming the file and line.
    """
    path = Path(path)
    if num_requests is not None:
        check_count(num_requests)
    check_vocab(vocab)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"workload file not found: {path}") from None
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    ids: set[str] = set()
    for line_no, line in enumerate(text.splitlines(), start=1):
        if num_requests is not None and len(requests) >= num_requests:
            break
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path}:{line_no}"
        try:
            obj = msgspec.json.decode(stripped)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where}: invalid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(_JSONL_KEYS))
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(_JSONL_KEYS)}"
            )
        if ("prompt_token_ids" in obj) == ("prompt_len" in obj):
            raise ValueError(f"{where}: give exactly one of 'prompt_token_ids' or 'prompt_len'")
        if "prompt_token_ids" in obj:
            ids_value = obj["prompt_token_ids"]
            if (
                not isinstance(ids_value, list)
                or not ids_value
                or not all(_is_int(token) and token >= 0 for token in ids_value)
            ):
                raise ValueError(
                    f"{where}: 'prompt_token_ids' must be a non-empty list of integers >= 0"
                )
            prompt = list(ids_value)
        else:
            length = obj["prompt_len"]
            if not _is_int(length) or length < 1:
                raise ValueError(f"{where}: 'prompt_len' must be an integer >= 1, got {length!r}")
            prompt = random_prompt(rng, vocab, length)
        if "max_tokens" not in obj:
            raise ValueError(f"{where}: missing 'max_tokens'")
        max_tokens = obj["max_tokens"]
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
        arrival = obj.get("arrival_s", 0.0)
        if (
            not isinstance(arrival, int | float)
            or isinstance(arrival, bool)
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise ValueError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
        request_id = obj.get("id", f"{path.stem}-{line_no}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"{where}: 'id' must be a non-empty string, got {request_id!r}")
        if request_id in ids:
            raise ValueError(f"{where}: duplicate id {request_id!r}")
        ids.add(request_id)
        ignore_eos = obj.get("ignore_eos", True)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"{where}: 'ignore_eos' must be true or false, got {ignore_eos!r}")
        requests.append(BenchRequest(request_id, prompt, max_tokens, float(arrival), ignore_eos))
    if not requests:
        raise ValueError(f"{path}: no requests in file")
    requests.sort(key=lambda request: request.arrival_s)
    return Workload(
        path.stem,
        requests,
        f"{len(requests)} requests loaded from {path}",
    )


# ---------------------------------------------------------------------------- registry

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "skewed": skewed,
    "poisson": poisson,
    "shared-prefix": shared_prefix,
    "pressure": pressure,
}
"""Built-in workload generators by name; each is called as ``gen(num_requests, seed=...)``
(:func:`generators` adds ``json``, ``lookup``, ``multi-turn`` and ``long-context``, whose
modules build on this one)."""


def generators() -> dict[str, Callable[..., Workload]]:
    """Every built-in workload generator by name, those of other modules included."""
    from expeditor.bench.json_workload import json_schemas
    from expeditor.bench.long_context_workload import long_context
    from expeditor.bench.lookup_workload import lookup
    from expeditor.bench.multi_turn_workload import multi_turn

    return {
        **WORKLOADS,
        "json": json_schemas,
        "lookup": lookup,
        "multi-turn": multi_turn,
        "long-context": long_context,
    }


def _check_overrides(
    name: str, func: Callable[..., Workload], overrides: dict[str, object]
) -> None:
    params = inspect.signature(func).parameters
    accepted = [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]
    reserved = {"seed", "num_requests"}
    unknown = sorted((set(overrides) - set(accepted)) | (reserved & set(overrides)))
    if unknown:
        options = ", ".join(p for p in accepted if p not in reserved)
        raise ValueError(
            f"workload {name!r} does not take {', '.join(unknown)}; it accepts: {options}"
        )


def make_workload(
    name: str, num_requests: int | None, seed: int = 0, **overrides: object
) -> Workload:
    """Build the workload ``name`` with ``num_requests`` requests, seeded by ``seed``.

    ``name`` is a key of :func:`generators` (``_`` is accepted for ``-``), called with
    ``overrides`` as keyword arguments (e.g. ``rate=8.0``); or a path ending in ``.jsonl``
    or naming an existing file, loaded with :func:`from_jsonl` (``num_requests`` keeps the
    first that many requests; ``None`` all). An unknown name raises ``ValueError`` listing
    the valid ones; an override the generator does not take raises ``ValueError`` listing
    those it does.
    """
    key = name.replace("_", "-")
    known = generators()
    if key in known:
        if num_requests is None:
            raise ValueError(f"workload {name!r} needs a number of requests")
        func = known[key]
        _check_overrides(key, func, overrides)
        return func(num_requests, seed=seed, **overrides)
    if name.endswith(".jsonl") or Path(name).is_file():
        loader: Callable[..., Workload] = from_jsonl
        _check_overrides(name, loader, overrides)
        return loader(name, seed=seed, num_requests=num_requests, **overrides)
    raise ValueError(
        f"unknown workload {name!r}; valid: {', '.join(known)} (or a path to a .jsonl file)"
    )
