"""The json bench workload: seeded schemas on every request; the inprocess target
constrains them, constraints=off runs the same
requests unconstrained at the constrained run's lengths; targets that cannot constrain
refuse the workload."""

from __future__ import annotations

import pytest

from expeditor.bench.json_workload import json_schemas
from expeditor.bench.run import parse_target, run_bench, unconstrained
from expeditor.bench.schema_family import schemas
from expeditor.bench.targets import TargetError
from expeditor.bench.workloads import make_workload


def test_the_workload_is_seeded_with_a_schema_per_request() -> None:
    load = make_workload("json", 12, seed=5)
    assert load == json_schemas(12, seed=5) and load != json_schemas(12, seed=6)
    assert [r.structured_outputs for r in load.requests] == [
        {"json": s} for s in schemas(seed=5, count=12)
    ]
    assert all(not r.ignore_eos and r.arrival_s == 0 for r in load.requests)
    with pytest.raises(ValueError, match="max_output"):
        json_schemas(2, max_output=0)


def test_constraints_off_replays_the_constrained_lengths() -> None:
    load = json_schemas(3, seed=1, max_output=50)
    lengths = {r.request_id: 7 + i for i, r in enumerate(load.requests)}
    plain, note = unconstrained(load, lengths, "inprocess")
    assert [(r.structured_outputs, r.max_tokens, r.ignore_eos) for r in plain.requests] == [
        (None, 7, True), (None, 8, True), (None, 9, True),
    ]  # fmt: skip
    assert [r.prompt_token_ids for r in plain.requests] == [
        r.prompt_token_ids for r in load.requests
    ]
    assert "as under inprocess" in note
    alone, note = unconstrained(load, None, None)
    assert [r.max_tokens for r in alone.requests] == [50] * 3 and "EOS" in note
    assert parse_target("inprocess[constraints=off]").options == {"constraints": False}
    with pytest.raises(ValueError, match="on or off"):
        parse_target("inprocess[constraints=maybe]")


def test_inprocess_constrains_and_constraints_off_matches_its_lengths(model) -> None:
    load = json_schemas(4, seed=2, max_output=48)
    results = run_bench(
        load,
        [parse_target("inprocess"), parse_target("inprocess[constraints=off]")],
        model=model,
        base_config={"max_num_seqs": 4},
        device="cpu",
        on_done=lambda label: None,
    )
    (constrained, _), (plain, _) = results
    assert constrained.total_output_tokens == plain.total_output_tokens > 0
    assert any("as under inprocess" in note for note in plain.notes)
    with pytest.raises(TargetError, match="constraints=off"):
        run_bench(load, [parse_target("static")], model=model, base_config={},
                  device="cpu", on_done=lambda label: None)  # fmt: skip
