"""Sampling controls end to end, through the in-process engine, against transformers'
``generate`` with the matching logits processors (``repetition_penalty``,
``sequence_bias``, ``bad_words_ids``, and processors written here from vLLM's
definitions where transformers has none): greedy outputs equal, each prompt alone, on
the tiny model and the real SmolLM2 checkpoint; the same with overlapped scheduling on
and off, under swap and recompute preemption, and for each sample of n=3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_reference import hf_greedy
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from expeditor.llm import LLM
from gpu_worker.model_source import resolve_model
from shared.sampling import SamplingParams

NEW_TOKENS = 16


class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties: over the output tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


class AllowedTokens(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[:, self.allowed] = True
        return scores.masked_fill(~keep, -torch.inf)


def cases(free: list[list[int]]) -> dict[str, tuple[dict[str, Any], Any]]:
    """Each control: (SamplingParams fields, per prompt index -> generate() arguments),
    its tokens chosen from the unconstrained greedy outputs ``free`` so that it bites."""
    first = sorted({out[0] for out in free})
    pair = next(out[2:4] for out in free if len(out) >= 4 and out[2] != out[3])
    allowed = sorted({t for out in free for t in out[:3]} | {t + 1 for t in first})
    return {
        "repetition": ({"repetition_penalty": 1.8}, lambda i, n: {"repetition_penalty": 1.8}),
        "presence-frequency": (
            {"presence_penalty": 1.5, "frequency_penalty": 0.7},
            lambda i, n: {"logits_processor": LogitsProcessorList([OutputPenalties(n, 1.5, 0.7)])},
        ),
        "logit-bias": (
            {"logit_bias": {first[0]: -30.0, first[0] + 1: 3.0}},
            lambda i, n: {"sequence_bias": {(first[0],): -30.0, (first[0] + 1,): 3.0}},
        ),
        "bad-words": (
            {"bad_words_token_ids": [[first[-1]], pair]},
            lambda i, n: {"bad_words_ids": [[first[-1]], pair]},
        ),
        "allowed": (
            {"allowed_token_ids": allowed},
            lambda i, n: {"logits_processor": LogitsProcessorList([AllowedTokens(allowed)])},
        ),
    }


def expected_outputs(
    checkpoint: Path, prompts: list[list[int]], per_prompt: Any
) -> list[list[int]]:
    return [
        hf_greedy(checkpoint, [p], NEW_TOKENS, **per_prompt(i, len(p)))[0]
        for i, p in enumerate(prompts)
    ]


PROMPTS = [[1, 5, 9, 13, 9, 5], [1, *range(40, 60)], [1, 77, 77, 77], [1, 200, 3, 150, 8, 42, 7]]

SCHEDULES = {
    "default": {},
    "no-overlap": {"overlap_scheduling": False},
    "swap": {"num_gpu_blocks": 12, "block_size": 4, "preemption_mode": "swap"},
    "recompute": {"num_gpu_blocks": 12, "block_size": 4, "preemption_mode": "recompute"},
}


@pytest.fixture(scope="module")
def free(model: Path) -> list[list[int]]:
    return hf_greedy(model, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("control", ["repetition", "presence-frequency", "logit-bias",
                                     "bad-words", "allowed"])  # fmt: skip
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tiny_model_greedy_with_controls_equals_transformers(
    model: Path, free: list[list[int]], control: str, schedule: str
) -> None:
    fields, per_prompt = cases(free)[control]
    expected = expected_outputs(model, PROMPTS, per_prompt)
    assert expected != free, f"{control} was meant to change the greedy output"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=3, **fields)
    with LLM(model, device="cpu", dtype="float32", **SCHEDULES[schedule]) as llm:
        done = llm.generate(PROMPTS, params)
        preempted = sum(llm.scheduler.preemptions.values())
    for completion, want in zip(done, expected, strict=True):
        assert [s.token_ids for s in completion.samples] == [want] * 3
    if "preemption_mode" in SCHEDULES[schedule]:
        assert preempted > 0, "the small pool was meant to preempt"


def test_real_model_greedy_with_penalties_equals_transformers() -> None:
    """SmolLM2-135M-Instruct in float32, its chat template's prompts: repetition and
    output penalties, and a bias, together (they touch the logits in vLLM's order:
    bias, then repetition, then presence and frequency; transformers' processors run in
    that order here)."""
    checkpoint = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    chats = [[{"role": "user", "content": q}] for q in ("List five fruits.", "Say cat.")]
    rendered = (tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)
                for c in chats)  # fmt: skip
    prompts = [list(r["input_ids"]) for r in rendered]
    free = hf_greedy(checkpoint, prompts, NEW_TOKENS)
    bias = {free[0][1]: -5.0}
    expected = [
        hf_greedy(
            checkpoint, [p], NEW_TOKENS,
            sequence_bias={(t,): b for t, b in bias.items()}, repetition_penalty=1.3,
            logits_processor=LogitsProcessorList([OutputPenalties(len(p), 0.4, 0.3)]),
        )[0]
        for p in prompts
    ]  # fmt: skip
    assert expected != free
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, logit_bias=bias,
        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
    )  # fmt: skip
    with LLM("smollm2-135m-instruct", device="cpu", dtype="float32") as llm:
        done = llm.generate(prompts, params)
    assert [c.token_ids for c in done] == expected


def test_seeded_sampling_with_controls_is_the_same_under_every_schedule(model: Path) -> None:
    """Random sampling (seeded: batch-independent draws) with penalties, a bias, min-p
    and bad words: every sample of n=3 the same whatever the schedule, overlapped or
    not, preempted by swap or by recompute (the worker's token history is the same)."""
    params = SamplingParams(
        temperature=0.9, top_p=0.95, min_p=0.05, seed=7, n=3, max_tokens=NEW_TOKENS,
        ignore_eos=True, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4,
        logit_bias={77: 4.0}, bad_words_token_ids=[[9], [13, 5]],
    )  # fmt: skip
    outputs = {}
    for name, schedule in SCHEDULES.items():
        with LLM(model, device="cpu", dtype="float32", **schedule) as llm:
            done = llm.generate(PROMPTS, params)
        outputs[name] = [[s.token_ids for s in c.samples] for c in done]
        for samples in outputs[name]:
            assert all(9 not in tokens for tokens in samples)  # a one-token bad word
            assert len({tuple(t) for t in samples}) > 1  # the samples do differ
    assert all(out == outputs["default"] for out in outputs.values()), outputs
