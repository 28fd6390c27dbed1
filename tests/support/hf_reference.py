"""The correctness oracle: transformers' own greedy ``generate()``, each prompt run
alone, for the tests that compare expeditor's outputs with it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

Oracle = Callable[..., list[list[int]]]
"""The ``hf_oracle`` fixture's type: ``(checkpoint, prompts, max_new_tokens, device="cpu")``
-> :func:`hf_greedy`'s outputs, computed once per session for each set of arguments."""


def hf_greedy(
    checkpoint: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: str = "cpu",
    **generate: Any,
) -> list[list[int]]:
    """The new tokens transformers generates greedily (float32) for each prompt;
    ``generate``: more of ``generate()``'s arguments (penalties, logits processors)."""
    steps = hf_greedy_steps(checkpoint, prompts, max_new_tokens, device, **generate)
    return [tokens for tokens, _ in steps]


def hf_greedy_steps(
    checkpoint: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **generate: Any,
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Per prompt, run alone: transformers' greedy new tokens and each step's float32
    log-softmax over the vocabulary (on the host)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device)
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            run = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
                **generate,
            )
        scores = [s[0].float().log_softmax(-1).cpu() for s in run.scores]
        outputs.append((run.sequences[0, len(prompt) :].tolist(), scores))
    return outputs


SHARED = list(range(40, 72))  # a 32-token common prefix


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    private = [[1] + [rng.randrange(3, 259) for _ in range(n)] for n in (4, 17, 40, 9, 25)]
    shared = [[1, *SHARED, *[rng.randrange(3, 259) for _ in range(n)]] for n in (3, 11)]
    return private + shared + [[1, *SHARED]] * 2  # two identical prompts


PROMPTS = _prompts()


def hf_prompt_log_softmax(
    checkpoint: Path, prompts: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Per prompt, run alone: transformers' float32 log-softmax at every position
    (``[len(prompt), vocab]``; row ``p`` is the distribution of token ``p + 1``)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    model.eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
