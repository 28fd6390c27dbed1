"""The scheduler's swappable policies: queue order, victim choice, swap vs recompute.

Each is a small class with one decision, so it can be tested and replaced alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Literal, Protocol

from scheduler_svc.request import Request, Sequence
from shared.config import SchedulerConfig

QueueKey = tuple[float, int, int]
PreemptionMode = Literal["swap", "recompute"]


class QueueOrder(Protocol):
    def key(self, request: Request, sample_index: int) -> QueueKey:
        """Static sort key: the smaller key runs first, in every queue."""
        ...


class FcfsOrder:
    """First come, first served."""

    def key(self, request: Request, sample_index: int) -> QueueKey:
        return (0.0, request.arrival_seq, sample_index)


class PriorityOrder:
    """Lower priority value first, FIFO within a priority, with aging.

    A request's effective priority at step ``t`` is ``priority - aging_rate * (t -
    arrival_step)``. Every request ages at the same rate, so comparing two requests at
    any ``t`` reduces to comparing ``priority + aging_rate * arrival_step``: the order is
    static and the queues never need re-sorting.

    Starvation bound: a request of priority ``p`` arriving at step ``a`` ranks ahead of
    every request arriving after step ``a + (p - p_min) / aging_rate``, where ``p_min``
    is the best priority in use. So it waits only for the finite set of requests that
    arrived before that step.
    """

    def __init__(self, aging_rate: float) -> None:
        self.aging_rate = aging_rate

    def key(self, request: Request, sample_index: int) -> QueueKey:
        return (
            request.priority + self.aging_rate * request.arrival_step,
            request.arrival_seq,
            sample_index,
        )


def make_queue_order(config: SchedulerConfig) -> QueueOrder:
    if config.policy == "priority":
        return PriorityOrder(config.aging_rate)
    return FcfsOrder()


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
        mode: Literal["auto", "swap", "recompute"],
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

    def swap_seconds(self, num_blocks: int) -> float:
        copied = 2 * num_blocks * self.kv_bytes_per_block
        return self.swap_overhead_s + copied / self.swap_bandwidth_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def choose(self, seq: Sequence, cpu_free_blocks: int) -> PreemptionMode:
        num_blocks = len(seq.block_table)
        if self.mode == "recompute" or not 0 < num_blocks <= cpu_free_blocks:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        swap_s = self.swap_seconds(num_blocks)
        recompute_s = self.recompute_seconds(seq.num_computed_tokens)
        return "swap" if swap_s < recompute_s else "recompute"
