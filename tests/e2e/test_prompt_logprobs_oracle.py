"""Prompt logprobs (``SamplingParams.prompt_logprobs``) end to end through the
in-process engine, against transformers' float32 log-softmax over the whole prompt:
each prompt token's logprob, its rank and the top tokens of its position, under every
schedule (chunked prefill, overlap off, swap and recompute preemption), for n=3, and
with the prompt in the prefix cache (such a request reads nothing from it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hf_reference import hf_prompt_log_softmax
from transformers import AutoTokenizer

from expeditor.llm import LLM
from gpu_worker.model_source import resolve_model
from shared.outputs import Completion
from shared.sampling import SamplingParams

TOP = 4
TOLERANCE = 1e-4
"""Absolute, on float32 logprobs of the tiny model (its logits are a few units wide)."""

PROMPTS = [[1, *range(40, 75)], [1, 5, 9, 13, 9, 5], [1, 200, 3, 150, 8, 42, 7, 7, 7, 19, 64]]

SCHEDULES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 8, "block_size": 4},
    "no-overlap": {"overlap_scheduling": False},
    "swap": {"num_gpu_blocks": 14, "block_size": 4, "preemption_mode": "swap"},
    "recompute": {"num_gpu_blocks": 14, "block_size": 4, "preemption_mode": "recompute"},
}


def check_against(done: Completion, prompt: list[int], ref: torch.Tensor, tol: float) -> None:
    """``done``'s prompt logprobs equal ``ref`` (transformers' log-softmax rows): every
    position from 1, the prompt token's logprob and rank, and the top ``TOP`` tokens."""
    plp = done.prompt_logprobs
    assert plp is not None and plp.first == 1
    assert len(plp.entries) == len(plp.ranks) == len(prompt) - 1
    for position in range(1, len(prompt)):
        row, token = ref[position - 1], prompt[position]
        entry, rank = plp.entries[position - 1], plp.ranks[position - 1]
        assert entry[token] == pytest.approx(row[token].item(), abs=tol), position
        assert rank == int((row > row[token]).sum()) + 1, position
        top = row.topk(TOP)
        assert set(top.indices.tolist()) | {token} == set(entry), position
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t].item(), abs=tol), (position, t)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[torch.Tensor]:
    return hf_prompt_log_softmax(model, PROMPTS)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_prompt_logprobs_equal_transformers_under_every_schedule(
    model: Path, reference: list[torch.Tensor], schedule: str
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, n=3, prompt_logprobs=TOP, logprobs=1
    )
    with LLM(model, device="cpu", dtype="float32", **SCHEDULES[schedule]) as llm:
        done = llm.generate(PROMPTS, params)
        preempted = sum(llm.scheduler.preemptions.values())
    for completion, prompt, ref in zip(done, PROMPTS, reference, strict=True):
        check_against(completion, prompt, ref, TOLERANCE)
        assert len({tuple(s.token_ids) for s in completion.samples}) == 1  # greedy, n=3
    if "preemption_mode" in SCHEDULES[schedule]:
        assert preempted > 0, "the small pool was meant to preempt"


def test_prompt_logprobs_skip_the_prefix_cache(model: Path, reference: list[torch.Tensor]) -> None:
    """The prompt cached by an earlier request: a request for prompt logprobs computes
    every position anyway (and reports all of them), one without still hits."""
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(model, device="cpu", dtype="float32", block_size=4) as llm:
        llm.generate([PROMPTS[0]], plain)
        hits = llm.scheduler.kv.hit_tokens
        (done,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, prompt_logprobs=0))
        assert llm.scheduler.kv.hit_tokens == hits  # nothing read from the cache
        llm.generate([PROMPTS[0]], plain)
        assert llm.scheduler.kv.hit_tokens > hits  # the cache did hold the prompt
    assert len(done.prompt_logprobs.entries) == len(PROMPTS[0]) - 1
    ref = reference[0]
    for position, entry in enumerate(done.prompt_logprobs.entries, start=1):
        token = PROMPTS[0][position]
        assert entry == {token: pytest.approx(ref[position - 1, token].item(), abs=TOLERANCE)}


def test_requests_without_prompt_logprobs_get_none(model: Path) -> None:
    with LLM(model, device="cpu", dtype="float32") as llm:
        done = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=3))
    assert all(c.prompt_logprobs is None for c in done)


def test_real_model_prompt_logprobs_equal_transformers() -> None:
    """SmolLM2-135M-Instruct in float32 on a chat prompt: the lean forward's prompt
    logprobs equal transformers' within 2e-3 (their float32 sums differ in order)."""
    checkpoint = resolve_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    chat = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    prompt = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    (ref,) = hf_prompt_log_softmax(checkpoint, [prompt])
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    with LLM("smollm2-135m-instruct", device="cpu", dtype="float32") as llm:
        (done,) = llm.generate([prompt], params)
    plp = done.prompt_logprobs
    tol = 2e-3
    assert plp is not None and len(plp.entries) == len(prompt) - 1
    for position, (entry, rank) in enumerate(zip(plp.entries, plp.ranks, strict=True), start=1):
        row, token = ref[position - 1], prompt[position]
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t].item(), abs=tol), (position, t)
        # the top two and the rank as the reference has them, up to ties within tol
        second = row.topk(2).values[-1].item()
        assert len(entry) >= 2
        assert all(row[t] >= second - tol for t in entry if t != token), position
        above, near = (int((row > row[token] + d).sum()) + 1 for d in (tol, -tol))
        assert above <= rank <= near, position
