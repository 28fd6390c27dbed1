"""The correctness oracle: greedy outputs equal transformers' generate() run alone.

For each supported architecture (tiny random checkpoints), a mixed batch of prompts
goes through the in-process engine under configurations that force chunked prefill,
prefix-cache hits, swap and recompute preemption, and n>1 forks with copy-on-write.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.hf_reference import PROMPTS, Oracle
from support.schedules import SCENARIOS

from expeditor.llm import LLM
from gpu_worker.tiny_model import ARCHS, SLIDING_WINDOW
from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from shared.sampling import SamplingParams

MAX_TOKENS = 12
DEVICE = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")
"""``cuda`` runs the oracle on the GPU (Triton kernels), in float32 on both sides."""


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: Path, hf_oracle: Oracle) -> dict[int, list[int]]:
    """transformers' greedy output for each prompt, run alone."""
    return dict(enumerate(hf_oracle(checkpoint, PROMPTS, MAX_TOKENS, DEVICE)))


class PlanLog:
    """Records every plan and result the engine's runner sees."""

    def __init__(self, llm: LLM) -> None:
        self.plans: list[BatchPlan] = []
        inner = llm.runner.execute

        def execute(plan: BatchPlan) -> StepResult:
            self.plans.append(plan)
            return inner(plan)

        llm.runner.execute = execute  # type: ignore[method-assign]

    def count(self, field: str) -> int:
        return sum(len(getattr(p, field)) for p in self.plans)


@pytest.fixture
def engine_factory(checkpoint: Path) -> Iterator[type]:
    made: list[LLM] = []

    def make(**config: object) -> LLM:
        llm = LLM(checkpoint, device=DEVICE, dtype=torch.float32, max_model_len=256, **config)
        made.append(llm)
        return llm

    yield make  # type: ignore[misc]
    for llm in made:
        llm.close()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_transformers(
    scenario: str, engine_factory, expected: dict[int, list[int]]
) -> None:
    llm = engine_factory(**SCENARIOS[scenario])
    log = PlanLog(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, greedy)
    for index, completion in enumerate(outputs):
        assert completion.token_ids == expected[index], f"prompt {index} ({scenario})"
    sched = llm.scheduler
    assert check_invariants(sched) == []
    # Mistral windows every layer; qwen2, gemma2 and gemma3 mix windowed and full layers
    # (a cache of two layer groups): either way, blocks behind the window went back.
    model_type = llm.runner.config.model_type
    grouped = model_type in ("qwen2", "gemma2", "gemma3_text")
    windowed = grouped or model_type == "mistral"
    assert (sched.kv.window == SLIDING_WINDOW) == windowed
    assert sched.kv.num_groups == (2 if grouped else 1)
    assert (sched.kv.released_blocks > 0) == windowed
    if scenario == "chunked":
        assert max(p.total_tokens for p in log.plans) <= 16
        assert any(
            n > 1 and n < len(PROMPTS[2])
            for p in log.plans
            for n in p.num_scheduled_tokens.values()
        )
    if scenario == "prefix":
        assert sched.kv.hit_tokens >= 32 * 3
    if scenario == "swap":
        assert sched.preemptions["swap"] > 0 and sched.preemptions["recompute"] == 0
        assert log.count("swap_out") > 0 and log.count("swap_in") > 0
        assert llm.swap_pool is not None
    if scenario == "recompute":
        assert sched.preemptions["recompute"] > 0 and sched.preemptions["swap"] == 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_with_prompt_lookup_matches_transformers(
    scenario: str, engine_factory, expected: dict[int, list[int]]
) -> None:
    """Speculative decoding (prompt lookup, 4 tokens a step) changes no token."""
    llm = engine_factory(num_speculative_tokens=4, **SCENARIOS[scenario])
    log = PlanLog(llm)
    found = count_proposals(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, greedy)
    for index, completion in enumerate(outputs):
        assert completion.token_ids == expected[index], f"prompt {index} ({scenario})"
    assert check_invariants(llm.scheduler) == []
    if scenario in ("swap", "recompute"):
        # A pool this full may refuse every proposal the room (each needs blocks
        # beyond one for every later running sequence): lookup found some at least.
        assert log.count("proposals") > 0 or found[0] > 0
    else:
        assert log.count("proposals") > 0


def count_proposals(llm: LLM) -> list[int]:
    """A counter of the proposals prompt lookup finds (planned or not)."""
    found = [0]
    propose = llm.scheduler.proposer.propose

    def counted(seq, k):  # type: ignore[no-untyped-def]
        proposal = propose(seq, k)
        found[0] += bool(proposal)
        return proposal

    llm.scheduler.proposer.propose = counted  # type: ignore[method-assign]
    return found


def test_n_samples_fork_with_copy_on_write(engine_factory, expected: dict[int, list[int]]) -> None:
    llm = engine_factory(block_size=4, num_gpu_blocks=128, max_num_batched_tokens=64)
    log = PlanLog(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3)
    # Prompt 1 has 18 tokens: its last block is partial, so the samples copy it.
    outputs = llm.generate([PROMPTS[1], PROMPTS[3]], greedy)
    for completion, index in zip(outputs, (1, 3), strict=True):
        assert [s.index for s in completion.samples] == [0, 1, 2]
        for sample in completion.samples:
            assert sample.token_ids == expected[index]
    assert log.count("copies") >= 2
    assert any(p.num_samples for p in log.plans)
