"""Benchmark metrics on hand-made timelines."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from expeditor.bench.metrics import (
    KVSample,
    RequestTimeline,
    TargetResult,
    compute_result,
    e2e,
    itls,
    kv_stats,
    peak_concurrency,
    tpot,
    ttft,
)
from expeditor.bench.workloads import skewed
from ipc.schema import StepTimes
from shared.stats import percentile, summarize


def _timeline(
    rid: str, arrival: float, times: list[float], finish: float, prompt: int = 8
) -> RequestTimeline:
    return RequestTimeline(rid, arrival, times, finish, prompt, len(times))


def test_per_request_metrics() -> None:
    # arrives at 10.0, tokens at 10.5, 10.7, 11.0, 11.6, finishes at 11.6
    t = _timeline("a", 10.0, [10.5, 10.7, 11.0, 11.6], 11.6)
    assert ttft(t) == pytest.approx(0.5)
    assert e2e(t) == pytest.approx(1.6)
    assert tpot(t) == pytest.approx((1.6 - 0.5) / 3)
    assert itls(t) == pytest.approx([0.2, 0.3, 0.6])


def test_tpot_uses_finish_and_output_count() -> None:
    # finish a little after the last token counts in TPOT, as (E2E - TTFT) / (out - 1)
    t = _timeline("a", 0.0, [1.0, 2.0, 3.0], 4.0)
    assert tpot(t) == pytest.approx((4.0 - 1.0) / 2)


def test_one_token_request_has_no_tpot_or_itl() -> None:
    t = _timeline("a", 1.0, [1.25], 1.25)
    assert ttft(t) == pytest.approx(0.25)
    assert tpot(t) is None
    assert itls(t) == []


def test_no_tokens() -> None:
    t = _timeline("a", 1.0, [], 2.0)
    assert ttft(t) is None and tpot(t) is None and itls(t) == []
    assert e2e(t) == pytest.approx(1.0)


def test_at_finish_timeline() -> None:
    t = RequestTimeline.at_finish("a", 1.0, 3.0, num_prompt_tokens=5, num_output_tokens=4)
    assert t.token_times_s == [3.0] * 4 and t.num_output_tokens == 4
    assert ttft(t) == pytest.approx(e2e(t)) == pytest.approx(2.0)
    assert tpot(t) == 0.0
    assert itls(t) == [0.0, 0.0, 0.0]


def test_percentiles_linear_interpolation() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0], 25) == pytest.approx(1.75)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize() -> None:
    summary = summarize(float(v) for v in range(1, 101))
    assert summary == pytest.approx({"mean": 50.5, "p50": 50.5, "p99": 99.01})
    assert summarize([2.0]) == {"mean": 2.0, "p50": 2.0, "p99": 2.0}
    assert summarize([]) is None


def test_kv_stats() -> None:
    samples = [
        KVSample(time_s=0.0, used_blocks=2, total_blocks=10, allocated_slots=32, filled_slots=24),
        KVSample(time_s=1.0, used_blocks=8, total_blocks=10, allocated_slots=128, filled_slots=96),
        KVSample(time_s=2.0, used_blocks=0, total_blocks=10, allocated_slots=0, filled_slots=0),
    ]
    stats = kv_stats(samples)
    assert stats == pytest.approx({"mean_usage": 1 / 3, "peak_usage": 0.8, "mean_waste": 0.25})
    idle = [KVSample(0.0, 0, 10, 0, 0)]
    assert kv_stats(idle) == {"mean_usage": 0.0, "peak_usage": 0.0, "mean_waste": 0.0}
    assert kv_stats([]) is None
    assert kv_stats([KVSample(0.0, 0, 0, 0, 0)]) is None


def test_compute_result() -> None:
    timelines = [
        _timeline("a", 0.0, [0.1, 0.2, 0.4], 0.4, prompt=10),
        _timeline("b", 0.5, [0.8], 0.8, prompt=20),
        _timeline("c", 1.0, [1.2, 1.3, 1.4, 1.5, 2.0], 2.0, prompt=30),
    ]
    result = compute_result(
        "inprocess",
        "skewed",
        timelines,
        kv_samples=[KVSample(0.0, 5, 10, 16, 12)],
        preemptions={"swap": 2, "recompute": 1},
        prefix_hit_rate=0.5,
    )
    assert isinstance(result, TargetResult)
    assert result.target == "inprocess" and result.workload == "skewed"
    assert result.num_requests == 3
    assert result.duration_s == pytest.approx(2.0)  # first arrival 0.0 -> last finish 2.0
    assert result.total_output_tokens == 9
    assert result.total_prompt_tokens == 60
    assert result.request_throughput == pytest.approx(1.5)
    assert result.output_throughput == pytest.approx(4.5)
    assert result.ttft_ms is not None and result.ttft_ms["mean"] == pytest.approx(200.0)
    assert result.ttft_ms["p50"] == pytest.approx(200.0)
    assert result.ttft_ms["p99"] == pytest.approx(298.0)  # rank 1.98 of [100, 200, 300]
    # TPOT: a -> (0.4 - 0.1) / 2 = 0.15, c -> (1.0 - 0.2) / 4 = 0.2; b has none
    assert result.tpot_ms == pytest.approx({"mean": 175.0, "p50": 175.0, "p99": 199.5})
    # ITLs pooled: a: 0.1, 0.2; c: 0.1, 0.1, 0.1, 0.5
    assert result.itl_ms is not None
    assert result.itl_ms["mean"] == pytest.approx(1100 / 6)
    assert result.itl_ms["p50"] == pytest.approx(100.0)
    # E2E: 0.4, 0.3, 1.0
    assert result.e2e_ms is not None
    assert result.e2e_ms["mean"] == pytest.approx(1700 / 3)
    assert result.e2e_ms["p50"] == pytest.approx(400.0)
    assert result.kv == pytest.approx({"mean_usage": 0.5, "peak_usage": 0.5, "mean_waste": 0.25})
    assert result.preemptions == {"swap": 2, "recompute": 1}
    assert result.prefix_cache_hit_rate == 0.5
    assert result.notes == []
    assert result.peak_concurrency == 1  # a, b and c never generate at the same time
    encoded = msgspec.json.decode(msgspec.json.encode(result), type=TargetResult)
    assert encoded == result


def test_peak_concurrency_counts_requests_generating_at_once() -> None:
    timelines = [
        _timeline("a", 0.0, [1.0, 2.0], 5.0),  # generating over 1-5
        _timeline("b", 0.0, [2.0, 3.0], 4.0),  # 2-4
        _timeline("c", 0.0, [3.5], 6.0),  # 3.5-6: a, b and c at 3.5-4
        _timeline("d", 0.0, [6.0], 7.0),  # starts as c finishes: no overlap
        _timeline("e", 0.0, [], 9.0),  # no tokens: never generating
    ]
    assert peak_concurrency(timelines) == 3
    assert peak_concurrency(timelines[3:]) == 1
    assert peak_concurrency([]) == 0


def test_compute_result_explicit_duration_and_workload_object() -> None:
    timelines = [_timeline("a", 0.0, [0.5, 1.0], 1.0)]
    result = compute_result("static", skewed(1, seed=0), timelines, 4.0)
    assert result.workload == "skewed"
    assert result.duration_s == 4.0
    assert result.request_throughput == pytest.approx(0.25)
    assert result.output_throughput == pytest.approx(0.5)
    assert result.kv is None and result.preemptions is None
    assert result.prefix_cache_hit_rate is None


def test_compute_result_single_token_requests() -> None:
    timelines = [_timeline("a", 0.0, [0.5], 0.5), _timeline("b", 0.0, [1.0], 1.0)]
    result = compute_result("t", "w", timelines, None)
    assert result.tpot_ms is None and result.itl_ms is None
    assert result.ttft_ms == pytest.approx({"mean": 750.0, "p50": 750.0, "p99": 995.0})
    assert any("TPOT and ITL undefined" in note for note in result.notes)


def test_compute_result_notes() -> None:
    silent = compute_result("t", "w", [_timeline("a", 0.0, [], 1.0)])
    assert silent.ttft_ms is None and silent.e2e_ms == {"mean": 1e3, "p50": 1e3, "p99": 1e3}
    assert any("no output tokens" in note for note in silent.notes)

    at_end = [RequestTimeline.at_finish("a", 0.0, 2.0, 4, 3)]
    result = compute_result("hf", "w", at_end)
    assert result.ttft_ms == result.e2e_ms
    assert result.tpot_ms == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    assert any("only at finish" in note for note in result.notes)

    zero = compute_result("t", "w", [_timeline("a", 0.0, [0.0], 0.0)])
    assert zero.request_throughput == 0.0 and zero.output_throughput == 0.0
    assert any("not positive" in note for note in zero.notes)

    empty = compute_result("t", "w", [])
    assert empty.num_requests == 0 and empty.duration_s == 0.0 and empty.notes == []
    assert empty.ttft_ms is None and empty.e2e_ms is None


STEP_MS_KEYS = {"schedule", "transfer", "prepare", "swap", "forward", "sample", "outputs", "steps"}
STEP_MS_KEYS |= {"forward_gflops"}


def check_step_ms(entry: dict) -> None:
    """A ``--json`` result's ``step_ms``: every part, non-negative, over some steps."""
    step_ms = entry["step_ms"]
    assert set(step_ms) == STEP_MS_KEYS
    assert all(isinstance(v, int | float) and v >= 0 for v in step_ms.values()), step_ms
    assert step_ms["steps"] > 0
    assert step_ms["forward_gflops"] > 0  # the worker counted its forwards' arithmetic


def test_compute_result_carries_step_times() -> None:
    times = StepTimes(schedule=0.1, forward=2.0, steps=3)
    result = compute_result("inprocess", "skewed", [_timeline("a", 0.0, [0.5], 1.0)])
    assert result.step_ms is None
    result = compute_result(
        "inprocess", "skewed", [_timeline("a", 0.0, [0.5], 1.0)], step_times=times
    )
    assert result.step_ms == times
    assert msgspec.json.decode(msgspec.json.encode(result), type=TargetResult) == result


def test_inprocess_bench_json_reports_step_ms(model: Path) -> None:
    from expeditor.bench.run import parse_target, report_json, run_bench

    load = skewed(4, seed=0, prompt_len=(8, 24), mean_output=4, max_output=8)
    results = run_bench(
        load,
        [parse_target("inprocess"), parse_target("static")],
        model=model,
        base_config={"max_num_seqs": 4},
        device="cpu",
        on_done=lambda label: None,
    )
    report = json.loads(report_json(load, [r for r, _ in results], seed=0, model=model))
    inprocess, static = report["results"]
    check_step_ms(inprocess)
    assert static["step_ms"] is None  # no step engine


def test_the_expeditor_target_takes_serve_settings_in_its_brackets() -> None:
    from expeditor.bench.run import parse_target, target_config
    from expeditor.bench.workloads import make_workload

    spec = parse_target("expeditor[tensor_parallel_size=2,max_num_seqs=8]")
    assert spec.overrides == {"max_num_seqs": 8}
    config = target_config(make_workload("skewed", 4, 0), {}, spec)
    assert config["serve"] == {"tensor_parallel_size": 2} and config["max_num_seqs"] == 8
    spec = parse_target("expeditor[cpu_threads=1,model_impl=transformers,cuda_graphs=false]")
    assert target_config(skewed(4), {}, spec)["serve"] == {
        "cpu_threads": 1,
        "model_impl": "transformers",
        "cuda_graphs": False,
    }
    spec = parse_target(
        "expeditor[num_speculative_tokens=4,speculative_model=smollm2-135m-instruct]"
    )
    assert spec.overrides == {"num_speculative_tokens": 4}
    assert target_config(skewed(4), {}, spec)["serve"] == {
        "speculative_model": "smollm2-135m-instruct"
    }
    with pytest.raises(ValueError, match="scheduler config key"):
        parse_target("static[tensor_parallel_size=2]")  # only serve takes it
