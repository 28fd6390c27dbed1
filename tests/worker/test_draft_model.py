"""The draft model on the worker: its K/V counted in each block, its time reported, and
the set-ups that cannot work refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from expeditor.llm import LLM
from gpu_worker.draft_model import check_same_vocabulary
from ipc.schema import BatchPlan, StepResult
from shared.errors import ConfigError
from shared.sampling import SamplingParams


def test_a_block_holds_both_models_kv_and_the_default_cache_shrinks_by_it(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    target, draft = tiny_checkpoint("qwen3"), tiny_checkpoint("llama")
    with LLM(target, device="cpu", dtype=torch.float32) as plain:
        blocks, block = plain.runner.num_gpu_blocks, plain.runner.block_bytes
    with LLM(
        target,
        device="cpu",
        dtype=torch.float32,
        num_speculative_tokens=2,
        speculative_model=str(draft),
    ) as llm:
        runner = llm.runner
        assert runner.draft is not None
        assert runner.block_bytes == block + runner.draft.bytes_per_block
        assert runner.num_gpu_blocks == blocks * block // runner.block_bytes
        assert runner.draft.cache is not None
        assert runner.draft.cache.num_blocks == runner.num_gpu_blocks
        assert runner.hello().draft_model == str(draft)
        assert llm.scheduler.drafting
        timings: list[float] = []
        inner = runner.execute

        def execute(plan: BatchPlan) -> StepResult:
            result = inner(plan)
            if plan.draft_lengths:
                timings.append(result.timing.draft_s)
            return result

        runner.execute = execute  # type: ignore[method-assign]
        llm.generate([[5, 6, 7] * 5], SamplingParams(temperature=0.0, max_tokens=8))
        assert timings and all(seconds > 0 for seconds in timings)


def test_a_draft_model_without_speculative_tokens_is_refused_by_name(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    model = tiny_checkpoint("llama")
    with pytest.raises(ConfigError, match="num_speculative_tokens is 0") as info:
        LLM(model, device="cpu", speculative_model=str(model))
    assert info.value.field == "num_speculative_tokens"


def test_a_draft_with_another_vocabulary_is_refused(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_checkpoint("llama")
    check_same_vocabulary(model, tiny_checkpoint("qwen3"))  # one tokenizer, other weights
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (other / name).write_bytes((model / name).read_bytes())
    text = (model / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(text.replace('"<pad>"', '"<blank>"', 1))
    with pytest.raises(ValueError, match="its tokenizer is not the model's"):
        check_same_vocabulary(model, other)
