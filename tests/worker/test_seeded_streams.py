"""Seeded sampling through the in-process engine over many steps: a seed fixes the
whole stream, and every position of it is a fresh draw.

The model is the tiny llama with its LM head zeroed: every position's logits are all
zero, so every step samples from one uniform distribution over the vocabulary
whatever the context. A stream of such draws must look like independent uniform
draws; one that reused a draw from step to step would repeat a token.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expeditor.llm import LLM
from gpu_worker.tiny_model import make_tiny_model
from shared.sampling import SamplingParams

STEPS = 64
PROMPT = [1, 72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("flat") / "llama", arch="llama")
    weights_file = path / "model.safetensors"
    with safe_open(str(weights_file), framework="pt") as f:
        metadata = f.metadata()
        weights = {name: f.get_tensor(name) for name in f.keys()}
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(weights_file), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def llm(flat_model: Path) -> Iterator[LLM]:
    device = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")
    with LLM(
        flat_model, device=device, dtype=torch.float32, max_model_len=256, num_gpu_blocks=64
    ) as engine:
        yield engine


def seeded(seed: int, *, n: int = 1, max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)


def test_the_model_is_flat(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=3, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0].samples[0]
    assert out.logprobs is not None
    uniform = -math.log(llm.runner.model.config.vocab_size)
    for entry in out.logprobs:
        assert len(entry) == 3 and all(v == pytest.approx(uniform) for v in entry.values())


@pytest.mark.parametrize("seed", [1, 1234])
def test_a_seeded_stream_draws_afresh_at_every_position(llm: LLM, seed: int) -> None:
    tokens = llm.generate([PROMPT], seeded(seed))[0].token_ids
    assert len(tokens) == STEPS
    counts = Counter(tokens)
    # 64 uniform draws over 320 tokens: about 58 distinct, a token rarely thrice.
    assert len(counts) >= 40 and max(counts.values()) <= 5, counts.most_common(3)


def test_the_samples_of_a_seeded_request_draw_afresh_and_apart(llm: LLM) -> None:
    completion = llm.generate([PROMPT], seeded(7, n=3, max_tokens=32))[0]
    streams = [s.token_ids for s in completion.samples]
    for tokens in streams:
        assert len(Counter(tokens)) >= 20, tokens
    # Position by position, the three samples rarely agree.
    agree = sum(len(set(column)) < 3 for column in zip(*streams, strict=True))
    assert agree <= 4, streams


def test_a_seed_replays_its_stream_whatever_else_runs(llm: LLM) -> None:
    alone = llm.generate([PROMPT], seeded(99))[0].token_ids
    others = [[1, *range(40 + i, 50 + 2 * i)] for i in range(5)]
    busy = llm.generate(
        [*others[:2], PROMPT, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 2
        + [seeded(99)]
        + [SamplingParams(temperature=1.0, max_tokens=20)] * 3,
    )
    assert busy[2].token_ids == alone
    assert llm.generate([PROMPT], seeded(100))[0].token_ids != alone
