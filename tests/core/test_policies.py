"""Queue order (FCFS, priority with aging), victim choice and the swap/recompute cost model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from scheduler_svc.core.policies import (
    FairShareRounds,
    FcfsOrder,
    PreemptionCostModel,
    PriorityOrder,
    VictimPolicy,
    make_queue_order,
)
from scheduler_svc.core.request import Request
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams


def make_request(
    *, priority: int = 0, arrival_step: int = 0, arrival_seq: int = 1, client: str = ""
) -> Request:
    return Request(
        f"r{arrival_seq}",
        [1, 2, 3],
        SamplingParams(temperature=0.0),
        priority=priority,
        arrival_step=arrival_step,
        arrival_seq=arrival_seq,
        max_output_tokens=16,
        client=client,
    )


# --------------------------------------------------------------------------- queue order


def test_fcfs_key_is_arrival_then_sample() -> None:
    order = FcfsOrder()
    early = make_request(priority=5, arrival_step=3, arrival_seq=1)
    late = make_request(priority=-5, arrival_step=0, arrival_seq=2)
    assert order.key(early, 0) == (0.0, 1, 0)
    assert order.key(early, 0) < order.key(late, 0)  # priority is ignored
    assert order.key(early, 0) < order.key(early, 1) < order.key(late, 0)


def test_priority_key_orders_by_priority_then_fifo() -> None:
    order = PriorityOrder(aging_rate=0.0)
    low = make_request(priority=5, arrival_seq=1)
    high = make_request(priority=1, arrival_seq=2)
    high_later = make_request(priority=1, arrival_seq=3)
    assert order.key(high, 0) < order.key(high_later, 0) < order.key(low, 0)
    assert order.key(high, 0) < order.key(high, 1) < order.key(high_later, 0)
    assert order.key(low, 2) == (5.0, 1, 2)


@pytest.mark.parametrize(("p_low", "p_high", "rate"), [(10, 0, 0.5), (4, 1, 0.25), (3, -1, 1.0)])
def test_aging_lets_an_old_low_priority_request_overtake_after_the_bound(
    p_low: int, p_high: int, rate: float
) -> None:
    order = PriorityOrder(aging_rate=rate)
    old = make_request(priority=p_low, arrival_step=0, arrival_seq=1)
    threshold = (p_low - p_high) / rate
    assert threshold == int(threshold)
    threshold = int(threshold)
    old_key = order.key(old, 0)
    for steps in range(threshold + 3):
        new = make_request(priority=p_high, arrival_step=steps, arrival_seq=2 + steps)
        new_key = order.key(new, 0)
        if steps < threshold:
            assert new_key < old_key, f"the new request should still win after {steps} steps"
        else:
            assert old_key < new_key, f"the old request should win after {steps} steps"


def test_zero_aging_never_lets_low_priority_overtake() -> None:
    order = PriorityOrder(aging_rate=0.0)
    old = make_request(priority=1, arrival_step=0, arrival_seq=1)
    new = make_request(priority=0, arrival_step=10**6, arrival_seq=2)
    assert order.key(new, 0) < order.key(old, 0)


def test_make_queue_order_follows_the_policy() -> None:
    assert isinstance(make_queue_order(SchedulerConfig(policy="fcfs")), FcfsOrder)
    order = make_queue_order(SchedulerConfig(policy="priority", aging_rate=0.25))
    assert isinstance(order, PriorityOrder)
    assert order.aging_rate == 0.25


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("fair_share", [True, False])
def test_make_queue_order_follows_fair_share(policy: str, fair_share: bool) -> None:
    order = make_queue_order(SchedulerConfig(policy=policy, fair_share=fair_share))  # type: ignore[arg-type]
    assert isinstance(order, FcfsOrder | PriorityOrder)
    assert order.fair_share is fair_share


# --------------------------------------------------------------------------- fair share


class Arrivals:
    """Requests submitted in turn, their rounds from one ``FairShareRounds``."""

    def __init__(self, order: FcfsOrder | PriorityOrder) -> None:
        self.order = order
        self.rounds = FairShareRounds()
        self.count = 0

    def submit(self, client: str, *, priority: int = 0, arrival_step: int = 0) -> Request:
        self.count += 1
        request = make_request(
            priority=priority, arrival_step=arrival_step, arrival_seq=self.count, client=client
        )
        request.fair_round = self.rounds.arrive(self.order.priority_term(request), client)
        return request

    def sorted_ids(self, requests: list[Request]) -> list[str]:
        return queue_order(self.order, requests)


def queue_order(order: FcfsOrder | PriorityOrder, requests: list[Request]) -> list[str]:
    return [r.request_id for r in sorted(requests, key=lambda r: order.key(r, 0))]


@pytest.mark.parametrize("order", [FcfsOrder(fair_share=True), PriorityOrder(0.0, fair_share=True)])
def test_fair_share_keys_interleave_two_clients(order: FcfsOrder | PriorityOrder) -> None:
    arrivals = Arrivals(order)
    heavy = [arrivals.submit("heavy") for _ in range(5)]
    light = [arrivals.submit("light") for _ in range(2)]
    assert [r.fair_round for r in heavy] == [0, 1, 2, 3, 4]
    assert [r.fair_round for r in light] == [0, 1]
    h, lt = [r.request_id for r in heavy], [r.request_id for r in light]
    assert arrivals.sorted_ids(heavy + light) == [h[0], lt[0], h[1], lt[1], h[2], h[3], h[4]]
    assert order.key(heavy[2], 1) == (0.0, 2, 3, 1)
    # Off: strict arrival order.
    assert queue_order(FcfsOrder(), heavy + light) == h + lt


def test_fair_share_keeps_each_client_fifo() -> None:
    arrivals = Arrivals(FcfsOrder(fair_share=True))
    requests = [arrivals.submit(c) for c in "abacbbcaab"]
    order = arrivals.sorted_ids(requests)
    for client in "abc":
        mine = [r.request_id for r in requests if r.client == client]
        assert [i for i in order if i in mine] == mine


@pytest.mark.parametrize(
    ("fair", "plain"),
    [
        (FcfsOrder(fair_share=True), FcfsOrder()),
        (PriorityOrder(0.5, fair_share=True), PriorityOrder(0.5)),
    ],
)
def test_fair_share_with_one_client_is_arrival_order(
    fair: FcfsOrder | PriorityOrder, plain: FcfsOrder | PriorityOrder
) -> None:
    arrivals = Arrivals(fair)
    # Priority 1 at step 0 and priority 0 at step 2 tie on the aged term 1.0.
    requests = [
        arrivals.submit("", priority=p, arrival_step=a)
        for p, a in [(2, 0), (1, 0), (0, 0), (1, 1), (0, 2), (2, 2), (0, 2)]
    ]
    assert arrivals.sorted_ids(requests) == queue_order(plain, requests)


def test_fair_share_rounds_are_per_priority() -> None:
    arrivals = Arrivals(PriorityOrder(0.0, fair_share=True))
    backlog = [arrivals.submit("heavy", priority=1) for _ in range(5)]
    urgent = arrivals.submit("heavy", priority=0)
    assert urgent.fair_round == 0  # its priority-1 backlog does not push it back
    arrivals.rounds.admitted(0.0, urgent.fair_round)
    light = arrivals.submit("light", priority=1)
    # Admitting the urgent one does not push other clients' priority-1 requests back.
    assert light.fair_round == 0
    ids = arrivals.sorted_ids([*backlog, urgent, light])
    assert ids[:3] == [urgent.request_id, backlog[0].request_id, light.request_id]


def test_an_idle_client_rejoins_at_the_current_round() -> None:
    rounds = FairShareRounds()
    assert [rounds.arrive(0.0, "a") for _ in range(10)] == list(range(10))
    assert rounds.arrive(0.0, "b") == 0
    rounds.depart(0.0, "b")
    for fair_round in range(7):
        rounds.admitted(0.0, fair_round)
    assert rounds.virtual_round(0.0) == 6
    # Back after idling: the current round, not the round it would have had (1).
    assert rounds.arrive(0.0, "b") == 6
    assert rounds.arrive(0.0, "b") == 7
    rounds.admitted(0.0, 3)  # a preempted request re-admitted: the virtual round stays
    assert rounds.virtual_round(0.0) == 6
    # A client with requests still queued keeps its place: no jump back.
    assert rounds.arrive(0.0, "a") == 10


def test_an_active_client_behind_the_virtual_round_gets_no_credit() -> None:
    rounds = FairShareRounds()
    assert rounds.arrive(0.0, "light") == 0  # still unfinished (say, a long stream)
    for _ in range(20):
        rounds.admitted(0.0, rounds.arrive(0.0, "heavy"))
    assert rounds.arrive(0.0, "light") == 19


def test_fair_share_state_is_dropped_without_unfinished_requests() -> None:
    rounds = FairShareRounds()
    rounds.arrive(0.0, "a")
    rounds.arrive(0.0, "a")
    rounds.arrive(0.0, "b")
    rounds.arrive(1.5, "a")
    rounds.admitted(1.5, 0)
    assert len(rounds) == 3
    rounds.depart(0.0, "a")
    rounds.depart(1.5, "a")
    assert len(rounds) == 2
    assert rounds.virtual_round(1.5) == 0  # the term is gone with its last request
    rounds.depart(0.0, "b")
    rounds.depart(0.0, "a")
    assert len(rounds) == 0


# --------------------------------------------------------------------------- victims


def seqs(preemptions: list[int], keys: list[tuple[float, int, int]] | None = None) -> list:
    keys = keys or [(0.0, i + 1, 0) for i in range(len(preemptions))]
    return [
        SimpleNamespace(seq_id=f"s{i}", num_preemptions=p, key=k)
        for i, (p, k) in enumerate(zip(preemptions, keys, strict=True))
    ]


def test_choose_picks_the_lowest_ranked_candidate() -> None:
    policy = VictimPolicy(max_preemptions=2)
    assert policy.choose(seqs([0, 0, 0, 0]), 1) == 3
    assert policy.choose(seqs([0, 0, 0, 0]), 0) == 3


def test_choose_skips_capped_candidates() -> None:
    policy = VictimPolicy(max_preemptions=2)
    assert policy.choose(seqs([0, 0, 1, 2]), 1) == 2
    assert policy.choose(seqs([0, 0, 2, 5]), 0) == 1


def test_choose_never_picks_a_sequence_ranked_ahead_of_the_requester() -> None:
    policy = VictimPolicy(max_preemptions=2)
    # Everyone after the requester is capped: it preempts itself, not seq 0.
    assert policy.choose(seqs([0, 0, 2, 2]), 1) == 1
    # The requester is last: nobody after it.
    assert policy.choose(seqs([0, 0, 0]), 2) == 2


def test_choose_falls_back_to_the_last_when_everyone_is_capped() -> None:
    policy = VictimPolicy(max_preemptions=2)
    assert policy.choose(seqs([0, 2, 2, 3]), 1) == 3
    assert policy.choose(seqs([2]), 0) == 0


KEYS = [(1.0, 1, 0), (3.0, 2, 0), (5.0, 3, 0)]


def test_choose_for_admission_picks_the_lowest_ranked_after_the_key() -> None:
    policy = VictimPolicy(max_preemptions=2)
    assert policy.choose_for_admission(seqs([0, 0, 0], KEYS), (2.0, 9, 0)) == 2
    assert policy.choose_for_admission(seqs([0, 0, 2], KEYS), (2.0, 9, 0)) == 1


def test_choose_for_admission_never_picks_a_sequence_ranked_ahead() -> None:
    policy = VictimPolicy(max_preemptions=2)
    # Both sequences after the key are capped; seq 0 is ahead of it.
    assert policy.choose_for_admission(seqs([0, 2, 2], KEYS), (2.0, 9, 0)) is None
    # The key ranks after everyone.
    assert policy.choose_for_admission(seqs([0, 0, 0], KEYS), (6.0, 9, 0)) is None
    # Just after the last one (same priority, later arrival).
    assert policy.choose_for_admission(seqs([0, 0, 0], KEYS), (5.0, 4, 0)) is None
    # Ahead of everyone: the last one goes.
    assert policy.choose_for_admission(seqs([0, 0, 0], KEYS), (0.0, 9, 0)) == 2
    assert policy.choose_for_admission([], (0.0, 9, 0)) is None


# --------------------------------------------------------------------------- cost model

KV_BYTES = 200_000
BANDWIDTH = 1e9  # bytes/s
PREFILL = 10_000.0  # tokens/s
OVERHEAD = 0.01  # s
BLOCK_SIZE = 16


def cost_model(mode: str = "auto") -> PreemptionCostModel:
    return PreemptionCostModel(
        mode=mode,  # type: ignore[arg-type]
        kv_bytes_per_block=KV_BYTES,
        swap_bandwidth_bytes_per_s=BANDWIDTH,
        prefill_tokens_per_s=PREFILL,
        swap_overhead_s=OVERHEAD,
    )


def victim(num_blocks: int, num_tokens: int | None = None) -> SimpleNamespace:
    tokens = num_blocks * BLOCK_SIZE if num_tokens is None else num_tokens
    return SimpleNamespace(num_device_blocks=num_blocks, num_computed_tokens=tokens)


def test_cost_formulas() -> None:
    model = cost_model()
    assert model.swap_seconds(5) == pytest.approx(OVERHEAD + 2 * 5 * KV_BYTES / BANDWIDTH)
    assert model.recompute_seconds(80) == pytest.approx(80 / PREFILL)


def test_forced_recompute_ignores_cpu_room() -> None:
    model = cost_model("recompute")
    assert model.choose(victim(1000), cpu_free_blocks=10**6) == "recompute"


def test_forced_swap_swaps_even_a_short_context() -> None:
    model = cost_model("swap")
    assert model.choose(victim(1, 1), cpu_free_blocks=1) == "swap"


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_falls_back_to_recompute_without_cpu_room(mode: str) -> None:
    model = cost_model(mode)
    assert model.choose(victim(1000), cpu_free_blocks=999) == "recompute"
    assert model.choose(victim(1000), cpu_free_blocks=0) == "recompute"
    assert model.choose(victim(0, 0), cpu_free_blocks=10) == "recompute"


def test_auto_switches_from_recompute_to_swap_at_the_crossover() -> None:
    model = cost_model()
    # swap(b) = OVERHEAD + 2 b KV/BW; recompute(b) = b BS / PREFILL; equal at b*.
    per_block_gain = BLOCK_SIZE / PREFILL - 2 * KV_BYTES / BANDWIDTH
    assert per_block_gain > 0
    crossover = OVERHEAD / per_block_gain
    below = math.floor(crossover)
    if below == crossover:
        below -= 1
    above = below + 1
    assert below >= 1
    assert model.choose(victim(1), cpu_free_blocks=10**6) == "recompute"
    assert model.choose(victim(below), cpu_free_blocks=10**6) == "recompute"
    assert model.choose(victim(above), cpu_free_blocks=10**6) == "swap"
    assert model.choose(victim(10 * above), cpu_free_blocks=10**6) == "swap"
    # The same long context without CPU room is recomputed.
    assert model.choose(victim(above), cpu_free_blocks=above - 1) == "recompute"


def test_auto_never_swaps_when_copying_is_slower_than_prefill() -> None:
    model = PreemptionCostModel(
        mode="auto",
        kv_bytes_per_block=KV_BYTES,
        swap_bandwidth_bytes_per_s=1e6,
        prefill_tokens_per_s=PREFILL,
        swap_overhead_s=0.0,
    )
    assert model.choose(victim(500), cpu_free_blocks=10**6) == "recompute"


def test_from_config_converts_units() -> None:
    cfg = SchedulerConfig(
        preemption_mode="swap",
        swap_bandwidth_gbps=8.0,
        prefill_tokens_per_s=1234.0,
        swap_overhead_ms=2.5,
    )
    model = PreemptionCostModel.from_config(cfg, kv_bytes_per_block=4096)
    assert model.mode == "swap"
    assert model.kv_bytes_per_block == 4096
    assert model.swap_bandwidth_bytes_per_s == 8e9  # GB/s are 10**9 bytes/s
    assert model.prefill_tokens_per_s == 1234.0
    assert model.swap_overhead_s == pytest.approx(0.0025)


def test_auto_recomputes_on_a_tie() -> None:
    # Swap only when it is strictly faster: 2 blocks of 1 byte at 1 byte/s each way
    # take 4 s, as does recomputing 4 tokens at 1 token/s.
    model = PreemptionCostModel(
        mode="auto",
        kv_bytes_per_block=1,
        swap_bandwidth_bytes_per_s=1.0,
        prefill_tokens_per_s=1.0,
        swap_overhead_s=0.0,
    )
    assert model.swap_seconds(2) == model.recompute_seconds(4) == 4.0
    assert model.choose(victim(2, 4), cpu_free_blocks=2) == "recompute"
    assert model.choose(victim(2, 5), cpu_free_blocks=2) == "swap"


def test_a_clients_unfinished_requests_are_counted_over_every_term() -> None:
    """The per-user cap's count: arrivals in, departures out, per client, whatever the
    priority term; a client with none (or never seen) has 0."""
    rounds = FairShareRounds()
    for term, client in [(0.0, "a"), (0.0, "a"), (1.0, "a"), (0.0, "b")]:
        rounds.arrive(term, client)
    assert (rounds.unfinished("a"), rounds.unfinished("b"), rounds.unfinished("c")) == (3, 1, 0)
    rounds.depart(0.0, "a")
    rounds.depart(0.0, "b")
    assert (rounds.unfinished("a"), rounds.unfinished("b")) == (2, 0)
