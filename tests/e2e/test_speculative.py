"""Speculative decoding on the model runner: prompt lookup and a draft model change no
output.

Greedy: the tokens with proposals equal those without, on every tiny architecture,
under chunked prefill, prefix hits, swap, recompute, n=3 and overlapped scheduling
(the in-process engine plans ahead as the daemon does). Sampling: each position of a
speculating step draws as a decode there would (the same key for a seeded request), so
seeded outputs equal those without proposals token for token, and the distribution of
unseeded ones is the same (a chi-square test over the second and third tokens).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.hf_reference import PROMPTS
from transformers import AutoModelForCausalLM

from expeditor.llm import LLM
from gpu_worker.tiny_model import ARCHS
from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from shared.sampling import SamplingParams

DEVICE = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")
"""``cuda`` runs these on the GPU (Triton kernels), in float32."""

REPEATING = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 10 + [40], list(range(50, 70)) * 2]
"""Prompts a model tends to continue by copying: prompt lookup proposes there."""

SCENARIOS: dict[str, dict[str, object]] = {
    "chunked": {"block_size": 8, "num_gpu_blocks": 256, "max_num_batched_tokens": 16},
    "prefix": {"block_size": 4, "num_gpu_blocks": 256, "max_num_batched_tokens": 512},
    "swap": {
        "block_size": 4,
        "num_gpu_blocks": 40,
        "num_cpu_blocks": 256,
        "max_num_batched_tokens": 64,
        "preemption_mode": "swap",
        "watermark": 0.0,
    },
    "recompute": {
        "block_size": 4,
        "num_gpu_blocks": 40,
        "max_num_batched_tokens": 64,
        "preemption_mode": "recompute",
        "watermark": 0.0,
    },
}


class Counting:
    """Counts the proposals the runner verified (made by the scheduler or drafted by
    the worker) and the tokens it accepted."""

    def __init__(self, llm: LLM) -> None:
        self.proposed = self.accepted = 0
        inner = llm.runner.execute

        def execute(plan: BatchPlan) -> StepResult:
            result = inner(plan)
            lengths = {seq_id: len(p) for seq_id, p in plan.proposals.items()}
            for seq_id, length in (lengths | plan.draft_lengths).items():
                self.proposed += length
                self.accepted += len(result.sampled_token_ids[seq_id]) - 1
            return result

        llm.runner.execute = execute  # type: ignore[method-assign]


@pytest.fixture
def engine(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(arch: str = "llama", **config: object) -> LLM:
        llm = LLM(
            tiny_checkpoint(arch), device=DEVICE, dtype=torch.float32, max_model_len=256, **config
        )
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


def tokens(llm: LLM, prompts: list, params: SamplingParams) -> list[list[list[int]]]:
    return [[s.token_ids for s in c.samples] for c in llm.generate(prompts, params)]


OTHER_DRAFT = {"llama": "qwen3"}
"""The different tiny checkpoint that drafts for each architecture (same vocabulary,
other weights): llama's for every other one."""


def proposers(tiny_checkpoint: Callable[[str], Path], arch: str) -> dict[str, dict[str, object]]:
    """Speculation settings by name: prompt lookup, the model drafting for itself (its
    drafts are its own greedy tokens) and another checkpoint drafting (they are
    mostly rejected; back-off off, so that it keeps drafting)."""
    other = tiny_checkpoint(OTHER_DRAFT.get(arch, "llama"))
    return {
        "lookup": {},
        "draft-self": {"speculative_model": str(tiny_checkpoint(arch))},
        "draft-other": {"speculative_model": str(other), "speculative_backoff": False},
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_proposals_equals_greedy_without(
    engine, tiny_checkpoint: Callable[[str], Path], arch: str
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    prompts = PROMPTS + REPEATING
    expected = tokens(engine(arch), prompts, greedy)
    for name, settings in proposers(tiny_checkpoint, arch).items():
        llm = engine(arch, num_speculative_tokens=4, **settings)
        counts = Counting(llm)
        assert tokens(llm, prompts, greedy) == expected, name
        if name == "draft-self":  # its own greedy tokens: (nearly) all accepted
            assert counts.accepted > 0.9 * counts.proposed, name
        else:
            assert counts.proposed > counts.accepted, name
        if name == "lookup":
            assert counts.accepted > 0
        assert check_invariants(llm.scheduler) == [], name
        assert llm.scheduler.kv.pool.num_free == llm.scheduler.kv.pool.num_blocks, name


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_with_proposals_holds_under_every_scheduling_case(
    engine, tiny_checkpoint: Callable[[str], Path], scenario: str
) -> None:
    config = SCENARIOS[scenario]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, n=3)
    prompts = REPEATING + PROMPTS + REPEATING  # the repeats: prefix hits
    expected = tokens(engine("qwen3", **config), prompts, greedy)
    for name, settings in proposers(tiny_checkpoint, "qwen3").items():
        llm = engine("qwen3", num_speculative_tokens=4, **settings, **config)
        counts = Counting(llm)
        assert tokens(llm, prompts, greedy) == expected, name
        if name == "draft-self":  # the draft's K/V kept right through every case
            assert counts.accepted > 0.9 * counts.proposed, name
        if name != "draft-other":
            assert counts.accepted > 0, name
        assert counts.proposed > 0, name
        sched = llm.scheduler
        if scenario in ("swap", "recompute"):
            assert sched.preemptions[scenario] > 0, name
        if scenario == "prefix":
            assert sched.kv.hit_tokens > 0, name
        assert check_invariants(sched) == [], name


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_draft_proposes_its_own_greedy_continuation_of_every_context(
    engine, tiny_checkpoint: Callable[[str], Path], scenario: str
) -> None:
    """The draft's K/V stays right as its proposals are mostly rejected, blocks are
    copied on write, swapped, recomputed and shared: each proposal equals the draft
    checkpoint's greedy tokens after the sequence's whole context, run from scratch."""
    draft_dir = tiny_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    llm = engine(
        "qwen3",
        num_speculative_tokens=3,
        speculative_model=str(draft_dir),
        speculative_backoff=False,
        **SCENARIOS[scenario],
    )
    drafter = llm.runner.draft
    assert drafter is not None
    inner = drafter.draft
    checked = mismatched = 0

    def draft(seqs):
        nonlocal checked, mismatched
        drafts = inner(seqs)
        for seq, k in seqs:
            context = list(seq.token_ids)
            with torch.inference_mode():
                for _ in range(k):
                    logits = reference(torch.tensor([context])).logits[0, -1]
                    context.append(int(logits.argmax()))
            checked += 1
            mismatched += drafts[seq.seq_id] != context[len(seq.token_ids) :]
        return drafts

    drafter.draft = draft  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, n=3)
    tokens(llm, REPEATING + PROMPTS + REPEATING, greedy)
    sched = llm.scheduler
    assert checked > 100
    assert mismatched <= checked // 100, (mismatched, checked)  # float rounding only
    assert sched.speculation.num_accepted_tokens < sched.speculation.num_draft_tokens / 2
    if scenario in ("swap", "recompute"):
        assert sched.preemptions[scenario] > 0


def test_seeded_samples_are_the_same_draws_with_and_without_proposals(
    engine, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Seeds, penalties, bias, min_tokens, bad words and logprobs: every control a
    draw sees at each position of a speculating step."""
    params = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        seed=11,
        max_tokens=24,
        min_tokens=6,
        n=2,
        logprobs=2,
        repetition_penalty=1.1,
        logit_bias={5: 3.0, 6: 3.0, 7: 3.0},
        bad_words_token_ids=((8, 9),),
    )
    prompts = REPEATING
    plain = engine("qwen2").generate(prompts, params)
    for name, settings in proposers(tiny_checkpoint, "qwen2").items():
        llm = engine("qwen2", num_speculative_tokens=4, **settings)
        counts = Counting(llm)
        again = llm.generate(prompts, params)
        assert counts.proposed > 0, name
        if name != "draft-other":
            assert counts.accepted > 0, name
        for one, other in zip(plain, again, strict=True):
            for a, b in zip(one.samples, other.samples, strict=True):
                assert a.token_ids == b.token_ids, name
                assert a.logprobs is not None and b.logprobs is not None
                assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


CHI2_8_AT_0_001 = 26.124
"""The chi-square critical value for 8 degrees of freedom at significance 0.001."""


def test_unseeded_samples_have_the_same_distribution_with_and_without_proposals(
    engine,
) -> None:
    """The second and third tokens (9 cells) of 3000 samples per side, over three
    allowed tokens at a high temperature (a spread distribution); the prompt holds
    every pair of them, so every decode proposes (back-off off: its measure would
    turn proposals off at this acceptance)."""
    prompt = [5, 5, 6, 5, 7, 6, 6, 7, 7, 5] * 2
    params = SamplingParams(temperature=8.0, max_tokens=3, n=30, allowed_token_ids=(5, 6, 7))
    cells: dict[int, Counter[tuple[int, int]]] = {}
    for k in (0, 4):
        llm = engine("qwen3", num_speculative_tokens=k, speculative_backoff=False, max_num_seqs=256)
        counts = Counting(llm)
        out = tokens(llm, [prompt] * 100, params)
        if k:
            assert counts.proposed > 2000 and counts.accepted > 300
        cells[k] = Counter((sample[1], sample[2]) for samples in out for sample in samples)
    keys = sorted(set(cells[0]) | set(cells[4]))
    total = {k: sum(cells[k].values()) for k in cells}
    statistic = 0.0
    for key in keys:
        row = cells[0][key] + cells[4][key]
        for k in cells:
            expected = row * total[k] / (total[0] + total[4])
            statistic += (cells[k][key] - expected) ** 2 / expected
    assert len(keys) == 9 and min(cells[0].values()) > 30  # spread over every cell
    assert statistic < CHI2_8_AT_0_001, (statistic, cells)
