"""The quantized KV cache through the engine on the tiny architectures: a schedule never
changes what a quantized cache answers (every read decodes the same codes: chunked
prefill, prefix hits, swap, recompute and the host tier give the default schedule's
tokens), and its logprobs stay near those of the model's dtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.hf_reference import PROMPTS
from support.schedules import SCENARIOS

from expeditor.llm import LLM
from scheduler_svc.core.introspection import check_invariants
from shared.sampling import SamplingParams

NEW_TOKENS = 10
TINY_LOGPROB = 0.25
"""How far an int8 cache's prompt logprobs may be from float32's on the tiny random
models (measured: at most 0.11)."""


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run(checkpoint: Path, kv_cache_dtype: str, **config: object) -> tuple[list, LLM]:
    prompts = [*PROMPTS, PROMPTS[0] + PROMPTS[1]]  # a shared prefix for the prefix cache
    llm = LLM(
        checkpoint, device="cpu", dtype=torch.float32, max_model_len=128,
        kv_cache_dtype=kv_cache_dtype, **config,
    )  # fmt: skip
    return llm.generate(prompts, GREEDY), llm


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_every_schedule_answers_as_the_default_one(
    tiny_checkpoint: Callable[[str], Path], arch: str, kv_cache_dtype: str
) -> None:
    checkpoint = tiny_checkpoint(arch)
    want, llm = run(checkpoint, kv_cache_dtype)
    # int8 through the native kernel (its block tiles dequantized), fp8 through torch.
    expected = "native" if kv_cache_dtype == "int8" else "torch"
    assert llm.runner.attention_backend.name == expected
    llm.close()
    for name, config in SCENARIOS.items():
        done, llm = run(checkpoint, kv_cache_dtype, **config)
        with llm:
            assert [c.token_ids for c in done] == [c.token_ids for c in want], name
            assert check_invariants(llm.scheduler) == []
            if name in llm.scheduler.preemptions:  # swap, recompute
                assert llm.scheduler.preemptions[name] > 0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_int8_prompt_logprobs_are_close_to_float32(
    tiny_checkpoint: Callable[[str], Path], arch: str
) -> None:
    checkpoint = tiny_checkpoint(arch)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got = {}
    for dtype in ("auto", "int8"):
        with LLM(checkpoint, device="cpu", dtype=torch.float32, kv_cache_dtype=dtype) as llm:
            got[dtype] = llm.generate(PROMPTS, params)
    gaps = [
        abs(a[tok] - b[tok])
        for x, y in zip(got["auto"], got["int8"], strict=True)
        for a, b, tok in zip(
            x.prompt_logprobs.entries, y.prompt_logprobs.entries, x.prompt_token_ids[1:],
            strict=True,
        )
    ]  # fmt: skip
    assert len(gaps) > 20 and 0 < max(gaps) < TINY_LOGPROB


def test_quantized_blocks_come_back_from_the_host_tier_as_they_left(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """A second round of the same prompts through a pool too small to keep the first's
    prefixes: the int8 blocks return from the host tier, and the answers are the
    first round's."""
    checkpoint = tiny_checkpoint("llama")
    config = {
        "block_size": 4,
        "num_gpu_blocks": 24,
        "num_cpu_blocks": 64,
        "prefix_cache_cpu_blocks": 48,
        "enable_prefix_caching": True,
        "max_num_seqs": 2,
    }
    first, llm = run(checkpoint, "int8", **config)
    with llm:
        again = llm.generate([*PROMPTS, PROMPTS[0] + PROMPTS[1]], GREEDY)
        assert [c.token_ids for c in again] == [c.token_ids for c in first]
        host = llm.scheduler.kv.host
        assert host is not None and host.hit_tokens >= 16
        assert check_invariants(llm.scheduler) == []
