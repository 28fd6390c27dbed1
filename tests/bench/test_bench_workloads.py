"""Seeded benchmark workloads: reproducibility, documented distributions, jsonl loading."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import msgspec
import pytest
from support.paths import REPO

from expeditor.bench.workloads import (
    BOS_TOKEN_ID,
    DEFAULT_VOCAB,
    WORKLOADS,
    BenchRequest,
    Workload,
    from_jsonl,
    make_workload,
    poisson,
    pressure,
    shared_prefix,
    skewed,
)

GENERATORS = [skewed, poisson, shared_prefix, pressure]


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@pytest.mark.parametrize("gen", GENERATORS, ids=lambda g: g.__name__)
def test_seeded_and_reproducible(gen) -> None:
    first = gen(50, seed=7)
    assert first == gen(50, seed=7)
    assert first != gen(50, seed=8)
    assert len(first.requests) == 50
    assert len({r.request_id for r in first.requests}) == 50
    assert first.description


@pytest.mark.parametrize("gen", GENERATORS, ids=lambda g: g.__name__)
def test_prompts_start_with_bos_and_use_vocab(gen) -> None:
    workload = gen(40, seed=1)
    for request in workload.requests:
        assert request.prompt_token_ids[0] == BOS_TOKEN_ID
        assert all(token in DEFAULT_VOCAB for token in request.prompt_token_ids[1:])
        assert request.ignore_eos
        assert request.max_tokens >= 1
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)
    custom = gen(10, seed=1, vocab=range(100, 104))
    assert all(set(r.prompt_token_ids[1:]) <= set(range(100, 104)) for r in custom.requests)


@pytest.mark.parametrize("gen", GENERATORS, ids=lambda g: g.__name__)
def test_zero_requests_and_bad_count(gen) -> None:
    assert gen(0, seed=0).requests == []
    with pytest.raises(ValueError, match="num_requests"):
        gen(-1, seed=0)


def _expected_clamped_rounded_exponential_mean(mean: float, maximum: int) -> float:
    def cdf(x: float) -> float:
        return 1.0 - math.exp(-x / mean) if x > 0 else 0.0

    expected = 1 * cdf(1.5)  # round(X) in {0, 1} -> 1
    for k in range(2, maximum):
        expected += k * (cdf(k + 0.5) - cdf(k - 0.5))
    return expected + maximum * (1.0 - cdf(maximum - 0.5))


def test_skewed_distribution() -> None:
    workload = skewed(5000, seed=3, prompt_len=(16, 256), mean_output=64, max_output=256)
    assert workload.name == "skewed"
    assert all(r.arrival_s == 0.0 for r in workload.requests)
    lengths = [len(r.prompt_token_ids) for r in workload.requests]
    assert min(lengths) >= 16 and max(lengths) <= 256
    assert min(lengths) < 30 and max(lengths) > 240  # uniform over the whole range
    outputs = [r.max_tokens for r in workload.requests]
    assert all(1 <= o <= 256 for o in outputs)
    expected = _expected_clamped_rounded_exponential_mean(64, 256)
    standard_error = 64 / math.sqrt(len(outputs))
    assert abs(statistics.fmean(outputs) - expected) < 4 * standard_error
    assert abs(statistics.fmean(outputs) - 64) < 0.05 * 64
    # heavy tail: the median of an exponential is mean * ln 2
    assert abs(statistics.median(outputs) - 64 * math.log(2)) < 4


def test_skewed_clamps_outputs() -> None:
    outputs = [r.max_tokens for r in skewed(2000, seed=0, mean_output=64, max_output=32).requests]
    assert max(outputs) == 32
    assert min(outputs) == 1
    assert outputs.count(32) > 2000 * 0.5  # P(X >= 31.5) = exp(-31.5/64) ~ 0.61


def test_poisson_rate_and_burstiness() -> None:
    def gaps(workload: Workload) -> list[float]:
        arrivals = [r.arrival_s for r in workload.requests]
        return [b - a for a, b in pairwise(arrivals)]

    steady = poisson(5000, seed=2, rate=4.0)
    assert steady.name == "poisson"
    assert steady.requests[0].arrival_s == 0.0
    steady_gaps = gaps(steady)
    assert all(g >= 0 for g in steady_gaps)
    assert statistics.fmean(steady_gaps) == pytest.approx(1 / 4.0, rel=0.05)
    cv_steady = statistics.pstdev(steady_gaps) / statistics.fmean(steady_gaps)
    assert cv_steady == pytest.approx(1.0, abs=0.1)  # exponential gaps

    bursty_gaps = gaps(poisson(5000, seed=2, rate=4.0, burstiness=0.25))
    assert statistics.fmean(bursty_gaps) == pytest.approx(1 / 4.0, rel=0.1)
    cv_bursty = statistics.pstdev(bursty_gaps) / statistics.fmean(bursty_gaps)
    assert cv_bursty > 1.5 * cv_steady  # theoretical CV = 1 / sqrt(0.25) = 2

    outputs = [r.max_tokens for r in steady.requests]
    assert min(outputs) >= 16 and max(outputs) <= 128
    assert min(outputs) == 16 and max(outputs) == 128
    assert all(r.arrival_s == 0 for r in poisson(5, seed=0, rate=math.inf).requests)


def test_poisson_validation() -> None:
    with pytest.raises(ValueError, match="rate"):
        poisson(3, seed=0, rate=0)
    with pytest.raises(ValueError, match="burstiness"):
        poisson(3, seed=0, burstiness=-1.0)
    with pytest.raises(ValueError, match="output_len"):
        poisson(3, seed=0, output_len=(10, 5))


def test_shared_prefix_structure() -> None:
    workload = shared_prefix(
        50, seed=4, num_prefixes=4, prefix_len=192, suffix_len=(8, 32), output_len=(16, 48)
    )
    assert workload.name == "shared-prefix"
    assert all(r.arrival_s == 0.0 for r in workload.requests)
    prefixes = {tuple(r.prompt_token_ids[1:193]) for r in workload.requests}
    assert len(prefixes) == 4
    assert all(len(p) == 192 for p in prefixes)
    suffixes = [tuple(r.prompt_token_ids[193:]) for r in workload.requests]
    assert all(8 <= len(s) <= 32 for s in suffixes)
    assert len(set(suffixes)) == 50  # distinct suffixes, hence distinct prompts
    counts = [
        sum(tuple(r.prompt_token_ids[1:193]) == p for r in workload.requests) for p in prefixes
    ]
    assert sorted(counts) == [12, 12, 13, 13]
    assert all(16 <= r.max_tokens <= 48 for r in workload.requests)

    timed = shared_prefix(200, seed=4, rate=10.0)
    arrivals = [r.arrival_s for r in timed.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert arrivals[-1] / 199 == pytest.approx(0.1, rel=0.25)


def test_shared_prefix_single_prefix_and_too_small_vocab() -> None:
    one = shared_prefix(10, seed=0, num_prefixes=1, prefix_len=16)
    assert len({tuple(r.prompt_token_ids[1:17]) for r in one.requests}) == 1
    with pytest.raises(ValueError, match="distinct prefixes"):
        shared_prefix(3, seed=0, num_prefixes=3, prefix_len=1, vocab=range(3, 5))
    with pytest.raises(ValueError, match="distinct suffixes"):
        shared_prefix(5, seed=0, suffix_len=(1, 1), vocab=range(3, 5))


def test_pressure_pool_hint() -> None:
    workload = pressure(64, seed=5, block_size=16, pool_fraction=0.25)
    assert workload.name == "pressure"
    assert all(r.arrival_s == 0.0 for r in workload.requests)
    needs = [_blocks(len(r.prompt_token_ids) + r.max_tokens, 16) for r in workload.requests]
    pool = workload.config["num_gpu_blocks"]
    assert isinstance(pool, int)
    assert workload.config["block_size"] == 16
    assert pool == max(max(needs) + 1, int(0.25 * sum(needs)))
    assert pool < sum(needs) / 2  # far smaller than the working set
    assert pool > max(needs)  # every request fits on its own
    assert "preempt" in workload.description
    assert all(64 <= len(r.prompt_token_ids) <= 256 for r in workload.requests)
    assert all(64 <= r.max_tokens <= 192 for r in workload.requests)


def test_pressure_small_working_set_still_fits_one_request() -> None:
    workload = pressure(2, seed=0, pool_fraction=0.01)
    needs = [_blocks(len(r.prompt_token_ids) + r.max_tokens, 16) for r in workload.requests]
    assert workload.config["num_gpu_blocks"] == max(needs) + 1


def test_workload_properties_and_roundtrip() -> None:
    workload = pressure(5, seed=0)
    assert workload.num_requests == 5
    assert workload.total_prompt_tokens == sum(len(r.prompt_token_ids) for r in workload.requests)
    assert workload.total_output_tokens == sum(r.max_tokens for r in workload.requests)
    assert workload.max_seq_len == max(
        len(r.prompt_token_ids) + r.max_tokens for r in workload.requests
    )
    decoded = msgspec.json.decode(msgspec.json.encode(workload), type=Workload)
    assert decoded == workload
    assert skewed(3, seed=0).config == {}


# ---------------------------------------------------------------------------- jsonl


def _write(tmp_path: Path, text: str, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_from_jsonl(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '{"prompt_token_ids": [1, 5, 6], "max_tokens": 4, "arrival_s": 0.5, "id": "a"}\n'
        "\n"
        "# a comment\n"
        '{"prompt_len": 10, "max_tokens": 2}\n'
        '{"prompt_len": 3, "max_tokens": 7, "arrival_s": 0.25, "ignore_eos": false}\n',
    )
    workload = from_jsonl(path, seed=3)
    assert workload.name == "trace"
    assert str(path) in workload.description
    by_id = {r.request_id: r for r in workload.requests}
    assert set(by_id) == {"a", "trace-4", "trace-5"}
    assert by_id["a"] == BenchRequest("a", [1, 5, 6], 4, 0.5)
    generated = by_id["trace-4"]
    assert len(generated.prompt_token_ids) == 10
    assert generated.prompt_token_ids[0] == BOS_TOKEN_ID
    assert all(t in DEFAULT_VOCAB for t in generated.prompt_token_ids[1:])
    assert generated.arrival_s == 0.0 and generated.max_tokens == 2
    assert by_id["trace-5"].ignore_eos is False
    # ordered by arrival
    assert [r.request_id for r in workload.requests] == ["trace-4", "trace-5", "a"]
    assert from_jsonl(path, seed=3) == workload
    assert from_jsonl(path, seed=4) != workload
    assert [r.request_id for r in from_jsonl(path, num_requests=1).requests] == ["a"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt_len": 4}', "missing 'max_tokens'"),
        ('{"max_tokens": 4}', "exactly one of"),
        ('{"prompt_len": 4, "prompt_token_ids": [1], "max_tokens": 1}', "exactly one of"),
        ('{"prompt_token_ids": [], "max_tokens": 1}', "non-empty list"),
        ('{"prompt_token_ids": [1, "x"], "max_tokens": 1}', "list of integers"),
        ('{"prompt_len": 0, "max_tokens": 1}', "'prompt_len' must be"),
        ('{"prompt_len": 4, "max_tokens": 0}', "'max_tokens' must be"),
        ('{"prompt_len": 4, "max_tokens": 1.5}', "'max_tokens' must be"),
        ('{"prompt_len": 4, "max_tokens": 1, "arrival_s": -1}', "'arrival_s' must be"),
        ('{"prompt_len": 4, "max_tokens": 1, "arrival_s": "soon"}', "'arrival_s' must be"),
        ('{"prompt_len": 4, "max_tokens": 1, "id": 3}', "'id' must be"),
        ('{"prompt_len": 4, "max_tokens": 1, "ignore_eos": 1}', "'ignore_eos' must be"),
        ('{"prompt_len": 4, "max_token": 1}', "unknown key"),
        ('{"prompt_len": 4, "max_tokens": 1, "id": "x"}', "duplicate id 'x'"),
    ],
)
def test_from_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, '{"prompt_len": 4, "max_tokens": 1, "id": "x"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        from_jsonl(path)
    assert f"{path}:3:" in str(info.value)


def test_from_jsonl_empty_and_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        from_jsonl(_write(tmp_path, "\n# nothing\n"))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        from_jsonl(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------- registry


def test_make_workload(tmp_path: Path) -> None:
    assert set(WORKLOADS) == {"skewed", "poisson", "shared-prefix", "pressure"}
    for name, gen in WORKLOADS.items():
        assert make_workload(name, 20, 9) == gen(20, seed=9)
    assert make_workload("shared_prefix", 5, 1) == shared_prefix(5, seed=1)
    assert make_workload("poisson", 10, 1, rate=2.0) == poisson(10, seed=1, rate=2.0)
    with pytest.raises(ValueError, match="skewed, poisson, shared-prefix, pressure"):
        make_workload("nope", 10, 0)
    with pytest.raises(ValueError, match=r"does not take bogus.*accepts: .*rate"):
        make_workload("poisson", 10, 0, bogus=1)

    path = _write(tmp_path, '{"prompt_len": 4, "max_tokens": 1}\n' * 3, name="three.jsonl")
    assert make_workload(str(path), None, 0) == from_jsonl(path)
    assert len(make_workload(str(path), 2, 0).requests) == 2
    plain = _write(tmp_path, '{"prompt_len": 4, "max_tokens": 1}\n', name="trace.txt")
    assert make_workload(str(plain), None, 0).name == "trace"
    with pytest.raises(FileNotFoundError):
        make_workload(str(tmp_path / "absent.jsonl"), None, 0)


def test_no_torch_or_transformers_import() -> None:
    code = (
        "import sys, expeditor.bench.workloads, expeditor.bench.metrics;"
        "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    root = REPO
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_multi_turn_turns_re_send_their_history() -> None:
    load = make_workload("multi-turn", 12, seed=4, turns=3, think_s=5.0, stagger_s=1.0)
    assert load.name == "multi-turn" and len(load.requests) == 12
    by_id = {r.request_id: r for r in load.requests}
    system = by_id["chat-0-0"].prompt_token_ids[: 1 + 64]
    for conversation in range(4):
        turns = [by_id[f"chat-{conversation}-{turn}"] for turn in range(3)]
        assert [t.arrival_s for t in turns] == [conversation + 5.0 * t for t in range(3)]
        assert turns[0].prompt_token_ids[: 1 + 64] == system  # the shared system prompt
        for before, after in pairwise(turns):
            grown = len(after.prompt_token_ids) - len(before.prompt_token_ids)
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
            assert 48 + 16 <= grown <= 48 + 48  # an answer and a user message
        assert all(t.max_tokens == 48 and t.ignore_eos for t in turns)
    arrivals = [r.arrival_s for r in load.requests]
    assert arrivals == sorted(arrivals)
    working_set = sum(-(-(len(by_id[f"chat-{c}-2"].prompt_token_ids) + 48) // 16) for c in range(4))
    assert load.config == {
        "num_gpu_blocks": int(working_set / 3),
        "block_size": 16,
        "enable_prefix_caching": True,
    }
    assert (
        make_workload("multi-turn", 12, seed=4).requests
        == make_workload("multi-turn", 12, seed=4).requests
    )
    with pytest.raises(ValueError, match="turns must be"):
        make_workload("multi-turn", 12, turns=0)


def test_long_context_requests_reach_a_multiple_of_the_window() -> None:
    load = make_workload("long-context", 10, seed=2, window=20, output_len=[8, 12])
    assert load.name == "long-context" and len(load.requests) == 10
    for request in load.requests:
        assert len(request.prompt_token_ids) + request.max_tokens == 160  # 8 x 20
        assert 8 <= request.max_tokens <= 12 and request.arrival_s == 0.0
        assert request.prompt_token_ids[0] == 1 and request.ignore_eos
    assert len({tuple(r.prompt_token_ids) for r in load.requests}) == 10
    assert load.config == {"num_gpu_blocks": int(0.25 * 10 * 10), "block_size": 16}
    assert make_workload("long-context", 1).config["num_gpu_blocks"] == 12  # one context + 1
    again = make_workload("long-context", 10, seed=2, window=20, output_len=[8, 12])
    assert again.requests == load.requests
    assert make_workload("long-context", 10, seed=3).requests != load.requests
    with pytest.raises(ValueError, match="window must be"):
        make_workload("long-context", 4, window=0)
    with pytest.raises(ValueError, match="leaves no prompt"):
        make_workload("long-context", 4, window=4, context_multiple=2, output_len=[8, 8])
