"""The simulate / make-trace commands and the trace format, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expeditor.cli import app
from scheduler_svc.simulator import TraceError, parse_trace
from scheduler_svc.traces import generate_trace

runner = CliRunner()

STEP_KEYS = {
    "step",
    "scheduled",
    "preempted",
    "swapped_in",
    "finished",
    "rejected",
    "free_gpu_blocks",
    "free_cpu_blocks",
    "num_running",
    "num_waiting",
    "num_swapped",
    "prefix_hit_tokens",
}
SUMMARY_KEYS = {
    "steps",
    "generated_tokens",
    "finished",
    "rejected",
    "preemptions",
    "wait_steps",
    "step_time_us",
    "speculation",
    "invariants_ok",
}


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_simulate_writes_steps_and_summary(tmp_path: Path) -> None:
    trace = write_lines(
        tmp_path / "t.jsonl",
        [
            {"id": "a", "arrival_step": 0, "prompt_len": 10, "max_tokens": 3},
            {"id": "b", "arrival_step": 1, "prompt_len": 6, "max_tokens": 4, "n": 2},
            {"id": "c", "arrival_step": 1, "prompt_len": 6, "max_tokens": 9, "eos_at": 2},
            {"id": "d", "arrival_step": 0, "prompt_len": 500, "max_tokens": 4},
            {"id": "e", "arrival_step": 0, "prompt_len": 8, "max_tokens": 50, "abort_step": 3},
        ],
    )
    steps = tmp_path / "steps.jsonl"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--steps-out",
            str(steps),
            "--json",
            "--num-gpu-blocks",
            "16",
            "--block-size",
            "4",
            "--max-model-len",
            "128",
            "--verify-kv",
            "--check-invariants",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["finished"] == 4 and summary["rejected"] == 1
    assert summary["invariants_ok"] is True
    # a: 3 tokens, b: 2 samples x 4, c: EOS as its 2nd token; e aborted after a few.
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    assert all(set(r) == STEP_KEYS for r in records)
    assert [r["step"] for r in records] == list(range(len(records)))
    finished = {f["id"]: f["reason"] for r in records for f in r["finished"]}
    assert finished == {"a": "length", "b": "length", "c": "stop", "e": "abort"}
    rejected = [x for r in records for x in r["rejected"]]
    assert [x["id"] for x in rejected] == ["d"] and "max_model_len" in rejected[0]["reason"]
    scheduled_ids = {sid for r in records for sid in r["scheduled"]}
    assert {"b/0", "b/1"} <= scheduled_ids and "b" not in scheduled_ids
    generated = 3 + 2 * 4 + 2
    assert generated < summary["generated_tokens"] <= generated + 50
    last = records[-1]
    assert last["free_gpu_blocks"] == 16 and last["num_running"] == 0


def test_simulate_with_proposals_counts_them(tmp_path: Path) -> None:
    trace = write_lines(
        tmp_path / "t.jsonl",
        [{"id": f"r{i}", "arrival_step": i, "prompt_len": 8, "max_tokens": 40} for i in range(4)],
    )
    common = ["simulate", "--trace", str(trace), "--json", "--num-gpu-blocks", "64"]
    common += ["--block-size", "4", "--verify-kv", "--check-invariants"]
    plain = json.loads(runner.invoke(app, common).stdout)
    result = runner.invoke(
        app, [*common, "--num-speculative-tokens", "4", "--proposal-acceptance", "1.0"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    counts = summary["speculation"]
    assert counts["proposals"] > 0 and counts["accepted_tokens"] == counts["proposed_tokens"]
    assert summary["generated_tokens"] == plain["generated_tokens"] == 160
    assert summary["steps"] < plain["steps"] / 2
    assert plain["speculation"]["proposals"] == 0
    refused = runner.invoke(app, [*common, "--proposal-acceptance", "1.5"])
    assert refused.exit_code != 0 and "proposal-acceptance" in refused.output


def test_simulate_table_output_and_config_file(tmp_path: Path) -> None:
    trace = write_lines(
        tmp_path / "t.jsonl", [{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}]
    )
    config = tmp_path / "c.toml"
    config.write_text("[scheduler]\nnum_gpu_blocks = 8\nblock_size = 2\n")
    result = runner.invoke(app, ["simulate", "--trace", str(trace), "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "generated_tokens" in result.stdout and "invariants_ok" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "3"], "block_size"),
        (["--preemption-mode", "sometimes"], "sometimes"),
        (["--watermark", "1.5"], "watermark"),
    ],
)
def test_simulate_rejects_bad_config(tmp_path: Path, args: list[str], message: str) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [{"id": "a", "prompt_len": 3}])
    result = runner.invoke(app, ["simulate", "--trace", str(trace), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_simulate_rejects_bad_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "prompt_len": 3}\n{"id": "a", "prompt_len": 4}\n')
    result = runner.invoke(app, ["simulate", "--trace", str(trace)])
    assert result.exit_code == 2
    assert "t.jsonl:2" in result.output and "duplicate" in result.output
    missing = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2 and "cannot read trace" in missing.output


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a"}', "exactly one of prompt_len and prompt_token_ids"),
        ('{"id": "a", "prompt_len": 2, "prompt_token_ids": [1]}', "exactly one"),
        ('{"id": "a", "prompt_len": 0}', "prompt_len must be >= 1"),
        ('{"id": "a", "prompt_len": 2, "eos_at": 0}', "eos_at"),
        ('{"id": "a", "prompt_len": 2, "colour": 1}', "colour"),
        ('{"id": "a", "prompt_len": "2"}', "prompt_len"),
        ("not json", "trace:1"),
    ],
)
def test_parse_trace_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace([line])


def test_make_trace_then_simulate_1000_requests(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    made = runner.invoke(
        app,
        [
            "make-trace",
            str(trace),
            "--num-requests",
            "1000",
            "--arrival-rate",
            "4",
            "--priorities",
            "0,1,2",
            "--n",
            "1,2",
            "--eos-fraction",
            "0.3",
            "--abort-fraction",
            "0.05",
            "--shared-prefixes",
            "4",
        ],
    )
    assert made.exit_code == 0, made.output
    assert len(trace.read_text().splitlines()) == 1000
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--json",
            "--num-gpu-blocks",
            "1500",
            "--num-cpu-blocks",
            "3000",
            "--policy",
            "priority",
            "--check-invariants",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["finished"] + summary["rejected"] == 1000
    assert summary["invariants_ok"] is True
    assert sum(summary["preemptions"].values()) > 0
    assert set(summary["wait_steps"]) == {"0", "1", "2"}
    assert summary["leftover_blocks"] == {"gpu_in_use": 0, "cpu_in_use": 0}


def test_generated_traces_are_seeded_and_in_range() -> None:
    first = generate_trace(300, seed=7, prompt_len=(5, 9), output_len=(2, 4), arrival_rate=2.0)
    again = generate_trace(300, seed=7, prompt_len=(5, 9), output_len=(2, 4), arrival_rate=2.0)
    other = generate_trace(300, seed=8, prompt_len=(5, 9), output_len=(2, 4), arrival_rate=2.0)
    assert first == again and first != other
    assert {r.prompt_len for r in first} == set(range(5, 10))
    assert {r.max_tokens for r in first} == {2, 3, 4}
    arrivals = [r.arrival_step for r in first]
    assert arrivals == sorted(arrivals)
    # Poisson at 2 per step: 300 requests span about 150 steps.
    assert 110 < arrivals[-1] < 190
    with pytest.raises(ValueError, match="prompt_len"):
        generate_trace(1, prompt_len=(9, 5))


def test_shared_prefix_traces_share_their_first_tokens() -> None:
    trace = generate_trace(
        40, seed=1, prompt_len=(300, 400), shared_prefixes=2, shared_prefix_len=64
    )
    prefixes = {tuple(r.prompt_token_ids[:64]) for r in trace if r.prompt_token_ids}
    assert len(prefixes) == 2


def test_simulate_without_invariant_checks_runs_the_same_schedule(tmp_path: Path) -> None:
    trace = write_lines(
        tmp_path / "t.jsonl",
        [
            {"id": f"r{i}", "arrival_step": i % 3, "prompt_len": 20 + i, "max_tokens": 8 + i}
            for i in range(12)
        ],
    )
    summaries = {}
    for flags in (["--check-invariants"], ["--no-check-invariants"], []):
        result = runner.invoke(
            app,
            ["simulate", "--trace", str(trace), "--json", "--num-gpu-blocks", "24", *flags],
        )
        assert result.exit_code == 0, result.output
        summaries[" ".join(flags)] = json.loads(result.stdout)
    checked = summaries["--check-invariants"]
    unchecked, default = summaries["--no-check-invariants"], summaries[""]
    assert checked.pop("invariants_ok") is True
    assert unchecked.pop("invariants_ok") is None and default.pop("invariants_ok") is None
    assert sum(checked["preemptions"].values()) > 0
    for summary in (checked, unchecked, default):
        summary.pop("step_time_us")
    assert checked == unchecked == default
    table = runner.invoke(app, ["simulate", "--trace", str(trace), "--no-check-invariants"])
    assert table.exit_code == 0, table.output  # unchecked is not failed
