"""The prefix cache's host tier through the real model runner: conversations whose
histories no longer fit the device pool come back from the CPU pool, and every answer
is still transformers' greedy one."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from expeditor.llm import LLM
from scheduler_svc.core.introspection import check_invariants
from shared.sampling import SamplingParams

NEW_TOKENS = 6


def conversations(seed: int) -> list[list[list[int]]]:
    """4 conversations of 3 turns: each turn's prompt is the last one, an answer of the
    workload's own and a new message (what a chat client re-sends)."""
    rng = random.Random(seed)
    chats = []
    for _ in range(4):
        history = [rng.randrange(3, 200) for _ in range(20)]
        turns = []
        for _ in range(3):
            history = history + [rng.randrange(3, 200) for _ in range(10)]
            turns.append(list(history))
        chats.append(turns)
    return chats


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("tier", [0, 48])
def test_turns_that_return_from_the_host_tier_match_transformers(
    tiny_checkpoint: Callable[[str], Path], hf_oracle, arch: str, tier: int
) -> None:
    checkpoint = tiny_checkpoint(arch)
    chats = conversations(3)
    rounds = [[chat[turn] for chat in chats] for turn in range(3)]  # turn by turn
    expected = [hf_oracle(checkpoint, prompts, NEW_TOKENS) for prompts in rounds]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        checkpoint,
        device="cpu",
        dtype=torch.float32,
        max_model_len=128,
        block_size=4,
        num_gpu_blocks=40,  # one turn of the 4 conversations fills most of it
        num_cpu_blocks=64,
        prefix_cache_cpu_blocks=tier,
        enable_prefix_caching=True,
        max_num_seqs=2,
    ) as llm:
        for prompts, want in zip(rounds, expected, strict=True):
            done = llm.generate(prompts, greedy)
            assert [c.token_ids for c in done] == want
        assert check_invariants(llm.scheduler) == []
        kv = llm.scheduler.kv
        if tier:
            assert kv.host is not None and kv.host.hit_tokens >= 64  # 16 blocks came back
        else:
            assert kv.host is None
