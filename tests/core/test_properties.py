"""Property tests: random traces through the real scheduler core and the fake worker.

After every step the simulation checks the scheduler's invariants and the fake worker
verifies every K/V slot attention reads; here we also check budgets per step and, at
the end, that every request ended with exactly the tokens it would have produced alone.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.hypothesis_profiles import hypothesis_profile

from scheduler_svc.simulator import Simulation, TraceRequest
from shared.config import SchedulerConfig

PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28, 29]]


@st.composite
def configs(draw: st.DrawFn, pool_tokens: tuple[int, int] = (40, 100)) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    return SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=draw(
            st.integers(pool_tokens[0] // block_size, pool_tokens[1] // block_size)
        ),
        num_cpu_blocks=draw(st.sampled_from([0, 8, 64])) * 4 // block_size,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_model_len=40,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])),
        watermark=draw(st.sampled_from([0.0, 0.05])),
        preemption_mode=draw(st.sampled_from(["auto", "swap", "recompute"])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        aging_rate=draw(st.sampled_from([0.0, 0.1, 1.0])),
        max_preemptions=draw(st.integers(1, 4)),
        enable_prefix_caching=draw(st.booleans()),
        # Make swap and recompute both plausible under "auto".
        prefill_tokens_per_s=draw(st.sampled_from([1e3, 1e6])),
    )


@st.composite
def traces(draw: st.DrawFn, min_count: int = 1, max_arrival: int = 6) -> list[TraceRequest]:
    count = draw(st.integers(min_count, 12))
    requests = []
    for index in range(count):
        prefix = draw(st.sampled_from(PREFIXES))
        suffix_len = draw(st.integers(0 if prefix else 1, 12))
        suffix = [100 + index * 20 + i for i in range(suffix_len)]
        if draw(st.booleans()) and prefix:
            suffix = []  # identical prompts
        arrival = draw(st.integers(0, max_arrival))
        requests.append(
            TraceRequest(
                id=f"q{index}",
                arrival_step=arrival,
                prompt_token_ids=prefix + suffix,
                max_tokens=draw(st.integers(1, 16)),
                priority=draw(st.integers(0, 3)),
                n=draw(st.sampled_from([1, 1, 2, 3])),
                eos_at=draw(st.none() | st.integers(1, 8)),
                abort_step=draw(st.none() | st.integers(arrival, arrival + 12)),
                client=draw(st.sampled_from([None, "a", "b", "c"])),
            )
        )
    return requests


def _never_fits(req: TraceRequest, cfg: SchedulerConfig) -> bool:
    assert req.prompt_token_ids is not None and cfg.num_gpu_blocks is not None
    total = len(req.prompt_token_ids) + req.max_tokens
    capacity = cfg.num_gpu_blocks - cfg.watermark_blocks(cfg.num_gpu_blocks)
    blocks = -(-total // cfg.block_size)
    return total > cfg.max_model_len or blocks > capacity or req.n > cfg.max_num_seqs


SETTINGS = settings(
    # max_examples comes from the Hypothesis profile (tests/conftest.py): 300 in ci
    # (derandomized), 150 in dev, 1000 in thorough.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(cfg=configs(), trace=traces(), overlap=st.booleans())
def test_random_traces_end_correctly(
    cfg: SchedulerConfig, trace: list[TraceRequest], overlap: bool
) -> None:
    _run_and_check(cfg, trace, overlap)


@SETTINGS
@given(
    cfg=configs(pool_tokens=(40, 56)),
    trace=traces(min_count=6, max_arrival=1),
    overlap=st.booleans(),
)
def test_tiny_pools_force_preemption(
    cfg: SchedulerConfig, trace: list[TraceRequest], overlap: bool
) -> None:
    _run_and_check(cfg, trace, overlap)


def test_profiles_keep_the_property_tests_strong() -> None:
    """The profiles of tests/conftest.py: ci derandomized (reproducible) with at least
    the 150 examples the property tests always had; thorough more than dev; and the
    property tests take their count from the profile in use."""
    ci, dev, thorough = (settings.get_profile(name) for name in ("ci", "dev", "thorough"))
    assert ci.derandomize and ci.database is None and ci.print_blob
    assert not dev.derandomize and not thorough.derandomize
    assert ci.max_examples >= 150 and dev.max_examples >= 150
    assert thorough.max_examples > dev.max_examples
    assert ci.deadline is None and dev.deadline is None and thorough.deadline is None
    assert SETTINGS.max_examples == settings().max_examples >= 150
    assert hypothesis_profile({}) == "dev"
    assert hypothesis_profile({"CI": "true"}) == "ci"
    assert hypothesis_profile({"CI": "false"}) == "dev"
    assert hypothesis_profile({"CI": "true", "HYPOTHESIS_PROFILE": "thorough"}) == "thorough"


def _run_and_check(cfg: SchedulerConfig, trace: list[TraceRequest], overlap: bool) -> None:
    """``overlap``: the next step is planned before each result is applied, with
    placeholders (the fake worker fills them in, as a real one does)."""
    sim = Simulation(trace, cfg, verify_kv=True, check_invariants=True, overlap=overlap)
    records: list[dict] = []
    result = sim.run(records.append)
    for mode, count in result.summary["preemptions"].items():
        event(f"{mode} preemptions: {'some' if count else 'none'}")
    event(f"prefix hits: {any(any(r['prefix_hit_tokens'].values()) for r in records)}")
    event(f"overlap: {overlap}")

    for record in records:
        assert sum(record["scheduled"].values()) <= cfg.max_num_batched_tokens
        assert len(record["scheduled"]) <= cfg.max_num_seqs
        assert record["num_running"] <= cfg.max_num_seqs

    by_id = {r.id: r for r in trace}
    assert set(result.rejected) == {r.id for r in trace if _never_fits(r, cfg)}
    for request_id, reason in result.rejected.items():
        assert reason, request_id
    assert set(result.finish_reasons) | set(result.rejected) == set(by_id)

    model = sim.model
    for request_id, outputs in result.outputs.items():
        req = by_id[request_id]
        assert req.prompt_token_ids is not None
        reason = result.finish_reasons[request_id]
        if reason != "abort":
            assert len(outputs) == req.n
        for seq_id, tokens in outputs.items():
            sample = int(seq_id.rsplit("/", 1)[1]) if req.n > 1 else 0
            expected, expected_reason = model.reference_output(
                request_id, sample, len(req.prompt_token_ids), req.params(), cfg.max_model_len
            )
            if reason == "abort":
                assert tokens == expected[: len(tokens)], seq_id
            else:
                assert tokens == expected, seq_id
                assert result.seq_finish_reasons[seq_id] == expected_reason, seq_id

    pool = sim.scheduler.kv.pool
    assert all(ref == 0 for ref in pool.ref_cnt)
    assert pool.num_free == pool.num_blocks
    assert sim.scheduler.kv.cpu_pool.num_free == cfg.num_cpu_blocks
    assert result.summary["invariants_ok"] is True
    assert not sim.worker.seqs, "the worker still holds sequences the scheduler ended"


def _starvation_trace(steps: int) -> list[TraceRequest]:
    low = TraceRequest(id="low", arrival_step=0, prompt_len=8, max_tokens=8, priority=5)
    stream = [
        TraceRequest(id=f"hi{s}", arrival_step=s, prompt_len=8, max_tokens=8, priority=0)
        for s in range(steps)
    ]
    return [low, *stream]


def _finish_step(cfg: SchedulerConfig, trace: list[TraceRequest], horizon: int) -> int | None:
    finished_at: dict[str, int] = {}

    def on_step(record: dict) -> None:
        for item in record["finished"]:
            finished_at[item["id"]] = record["step"]

    sim = Simulation(trace, cfg, max_steps=horizon + 10_000)
    sim.run(on_step)
    return finished_at.get("low")


def test_aging_bounds_the_wait_of_a_low_priority_request() -> None:
    """High-priority requests arrive faster than they are served. With aging 0.05 the
    priority-5 request ranks ahead of everything arriving after step 5/0.05 = 100, so
    it finishes once the requests that arrived before that are served; without aging
    it waits for the whole stream."""
    trace = _starvation_trace(400)
    base = {"num_gpu_blocks": 64, "block_size": 4, "max_num_seqs": 4, "policy": "priority"}
    aged = _finish_step(SchedulerConfig(**base, aging_rate=0.05), trace, 400)
    unaged = _finish_step(SchedulerConfig(**base, aging_rate=0.0), trace, 400)
    # 101 requests rank ahead of it (arrivals at steps 0..100), 4 at a time, 9 steps
    # each (1 prefill + 8 decodes): 26 rounds of 9 steps, plus its own 9.
    assert aged is not None and aged <= 27 * 9 + 9
    assert unaged is not None and unaged > 400
