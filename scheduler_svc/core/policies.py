"""The scheduler's swappable policies: queue order, victim choice, swap vs recompute.

Each is a small class with one decision, so it can be tested and replaced alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from typing import Literal, Protocol

from scheduler_svc.core.request import QueueKey, Request, Sequence
from shared.config import PreemptionSetting, SchedulerConfig

PreemptionMode = Literal["swap", "recompute"]


class QueueOrder(Protocol):
    def key(self, request: Request, sample_index: int) -> QueueKey:
        """Static sort key: the smaller key runs first, in every queue."""
        ...

    def priority_term(self, request: Request) -> float:
        """The key's first component: requests with equal terms share fair-share rounds."""
        ...


class _RoundRobin:
    """The rounds of one priority term: its virtual round and, per client with an
    unfinished request of that term, ``[next round, unfinished requests]``."""

    __slots__ = ("clients", "virtual_round")

    def __init__(self) -> None:
        self.virtual_round = 0
        self.clients: dict[str, list[int]] = {}


class FairShareRounds:
    """Start-time fair queuing by rounds: round-robin among clients at equal priority.

    Within one priority term (the key's first component), each client has a next
    round. A new request of client ``c`` gets round ``max(next_round[c],
    virtual_round)`` and sets ``next_round[c]`` to that plus one; ``virtual_round`` is
    the largest round of the term's requests admitted so far (first scheduled), so it
    only grows. Ordering by (term, round, arrival) then interleaves clients one request
    each within a term, keeps each client's own requests FIFO, and starts a client that
    was idle at the current round: no credit is saved up while idle. With one client
    the rounds rise with arrival, so the order is plain arrival order. A round is fixed
    at submission, so keys stay static and queues never re-sort.

    Rounds are kept per term because they only ever compare between requests of equal
    terms: with one global virtual round, a heavy client's better-priority request
    (whose round its backlog has pushed far ahead) would, once admitted, push every
    other client's next request behind that backlog.

    Preemption. Every running sequence was admitted, so its round is at most its
    term's virtual round, which is at most the round of any later arrival of that term;
    the arrival also has the largest arrival number. So a new request never ranks ahead
    of a running sequence of its own term, and ``_make_room`` (priority policy), which
    only preempts sequences ranked after the candidate, never preempts a heavy client's
    running request for a light client's new one: the light request takes the next
    free slot, ahead of the heavy client's queue. Only a sequence that was itself
    preempted (and keeps its old round, as it keeps its arrival number) can rank ahead
    of running ones of its term, exactly as without fair share. No livelock follows:
    keys are static and totally ordered, a sequence only ever preempts sequences
    ranked after it, so the best-ranked one always progresses, and ``max_preemptions``
    bounds how often any one is picked while others can be.

    State lives while it has unfinished requests: :meth:`arrive` counts one in,
    :meth:`depart` one out, and drops the client, then the term, at zero. A client's
    unfinished requests over every term are :meth:`unfinished` (the per-user cap).
    """

    def __init__(self) -> None:
        self._terms: dict[float, _RoundRobin] = {}

    def __len__(self) -> int:
        """(term, client) pairs with an unfinished request."""
        return sum(len(term.clients) for term in self._terms.values())

    def unfinished(self, client: str) -> int:
        """Requests of ``client`` that arrived and have not departed (waiting or running)."""
        return sum(
            state[1] for rounds in self._terms.values() if (state := rounds.clients.get(client))
        )

    def virtual_round(self, term: float) -> int:
        """The largest round of ``term`` admitted while it had unfinished requests."""
        rounds = self._terms.get(term)
        return 0 if rounds is None else rounds.virtual_round

    def arrive(self, term: float, client: str) -> int:
        """The round of a new request of ``client`` with priority term ``term``."""
        rounds = self._terms.get(term)
        if rounds is None:
            rounds = self._terms[term] = _RoundRobin()
        state = rounds.clients.get(client)
        if state is None:
            state = rounds.clients[client] = [0, 0]
        fair_round = max(state[0], rounds.virtual_round)
        state[0] = fair_round + 1
        state[1] += 1
        return fair_round

    def admitted(self, term: float, fair_round: int) -> None:
        """A request of ``term`` and ``fair_round`` was scheduled for the first time."""
        rounds = self._terms[term]
        if fair_round > rounds.virtual_round:
            rounds.virtual_round = fair_round

    def depart(self, term: float, client: str) -> None:
        """A request of ``client`` and ``term`` finished (or was aborted)."""
        rounds = self._terms[term]
        state = rounds.clients[client]
        state[1] -= 1
        if not state[1]:
            del rounds.clients[client]
            if not rounds.clients:
                del self._terms[term]


class _StaticOrder(ABC):
    """What both orders share: the key after the priority term is arrival number and
    sample index, with the request's fair-share round in front when ``fair_share``."""

    def __init__(self, *, fair_share: bool = False) -> None:
        self.fair_share = fair_share

    @abstractmethod
    def priority_term(self, request: Request) -> float:
        """The first key component; smaller runs first."""

    def key(self, request: Request, sample_index: int) -> QueueKey:
        term = self.priority_term(request)
        if self.fair_share:
            return (term, request.fair_round, request.arrival_seq, sample_index)
        return (term, request.arrival_seq, sample_index)


class FcfsOrder(_StaticOrder):
    """First come, first served (round-robin among clients with fair share)."""

    def priority_term(self, request: Request) -> float:
        return 0.0


class PriorityOrder(_StaticOrder):
    """Lower priority value first, FIFO within a priority, with aging.

    A request's effective priority at step ``t`` is ``priority - aging_rate * (t -
    arrival_step)``. Every request ages at the same rate, so comparing two requests at
    any ``t`` reduces to comparing ``priority + aging_rate * arrival_step``: the order is
    static and the queues never need re-sorting.

    Starvation bound: a request of priority ``p`` arriving at step ``a`` ranks ahead of
    every request arriving after step ``a + (p - p_min) / aging_rate``, where ``p_min``
    is the best priority in use. So it waits only for the finite set of requests that
    arrived before that step.

    Fair share orders requests with equal terms. With ``aging_rate > 0`` the term
    separates requests of one priority that arrived at different steps, so rounds then
    interleave clients only among same-step arrivals; with ``aging_rate = 0`` they
    interleave them across the whole priority, as under FCFS.
    """

    def __init__(self, aging_rate: float, *, fair_share: bool = False) -> None:
        super().__init__(fair_share=fair_share)
        self.aging_rate = aging_rate

    def priority_term(self, request: Request) -> float:
        return request.priority + self.aging_rate * request.arrival_step


def make_queue_order(config: SchedulerConfig) -> QueueOrder:
    if config.policy == "priority":
        return PriorityOrder(config.aging_rate, fair_share=config.fair_share)
    return FcfsOrder(fair_share=config.fair_share)


class VictimPolicy:
    """Which running sequence gives up its blocks when one cannot grow.

    ``running`` is in queue order, so candidates are the sequences after the one that
    needs room (lower priority, then newer). The lowest-ranked candidate still under the
    preemption cap goes first; if all are capped, the requester preempts itself while it
    is under the cap; if everyone is capped, the lowest-ranked goes anyway, since
    progress must beat the cap.
    """

    def __init__(self, max_preemptions: int) -> None:
        self.max_preemptions = max_preemptions

    def choose(self, running: Seq[Sequence], requester_index: int) -> int:
        cap = self.max_preemptions
        for index in range(len(running) - 1, requester_index, -1):
            if running[index].num_preemptions < cap:
                return index
        if running[requester_index].num_preemptions < cap:
            return requester_index
        return len(running) - 1

    def choose_for_admission(self, running: Seq[Sequence], key: QueueKey) -> int | None:
        """A running sequence ranked after ``key`` and under the cap, lowest first."""
        for index in range(len(running) - 1, -1, -1):
            seq = running[index]
            if seq.key < key:
                return None
            if seq.num_preemptions < self.max_preemptions:
                return index
        return None


class PreemptionCostModel:
    """Swap or recompute a victim, by estimated time to get its K/V back.

    - recompute: prefill its ``num_computed_tokens`` again, at ``prefill_tokens_per_s``;
    - swap: a fixed overhead plus copying its blocks out and back in at the host link
      bandwidth.
    Recompute wins for short contexts (the fixed swap overhead dominates), swap for long
    ones when the CPU pool has room. ``mode`` forces one of them (swap still falls back
    to recompute when the CPU pool is full).
    """

    def __init__(
        self,
        *,
        mode: PreemptionSetting,
        kv_bytes_per_block: int,
        swap_bandwidth_bytes_per_s: float,
        prefill_tokens_per_s: float,
        swap_overhead_s: float,
    ) -> None:
        self.mode = mode
        self.kv_bytes_per_block = kv_bytes_per_block
        self.swap_bandwidth_bytes_per_s = swap_bandwidth_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.swap_overhead_s = swap_overhead_s

    @classmethod
    def from_config(cls, config: SchedulerConfig, kv_bytes_per_block: int) -> PreemptionCostModel:
        return cls(
            mode=config.preemption_mode,
            kv_bytes_per_block=kv_bytes_per_block,
            swap_bandwidth_bytes_per_s=config.swap_bandwidth_gbps * 1e9,
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            swap_overhead_s=config.swap_overhead_ms / 1e3,
        )

    def copy_seconds(self, num_blocks: int) -> float:
        """Moving ``num_blocks`` blocks one way over the host link, overhead included."""
        return self.swap_overhead_s + (
            num_blocks * self.kv_bytes_per_block / self.swap_bandwidth_bytes_per_s
        )

    def swap_seconds(self, num_blocks: int) -> float:
        """Out and back in."""
        return self.copy_seconds(2 * num_blocks)

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def copy_in_pays(self, num_blocks: int, block_size: int, copies_per_block: int = 1) -> bool:
        """Whether copying ``num_blocks`` prefix blocks in from the host tier (one way)
        beats computing their tokens again (``copies_per_block``: a grouped table's
        blocks per logical block, :mod:`scheduler_svc.core.kv_groups`)."""
        return self.copy_seconds(num_blocks * copies_per_block) < self.recompute_seconds(
            num_blocks * block_size
        )

    def choose(self, seq: Sequence, cpu_free_blocks: int) -> PreemptionMode:
        num_blocks = seq.num_device_blocks
        if self.mode == "recompute" or not 0 < num_blocks <= cpu_free_blocks:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        swap_s = self.swap_seconds(num_blocks)
        recompute_s = self.recompute_seconds(seq.num_computed_tokens)
        return "swap" if swap_s < recompute_s else "recompute"
