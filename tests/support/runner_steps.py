"""A fixed schedule of steps through ``ModelRunner.execute``: prefill of prompts of
different lengths, decodes, an unchanged decode batch, a prompt prefilled in two chunks
beside decodes. The tests of the model implementations run it through each forward and
compare the hidden states and greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ipc.schema import BatchPlan, NewSeq
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    import torch.distributed as dist

    from gpu_worker.model_runner import ModelRunner

BLOCK = 8
SEQ_BLOCKS = 8  # each sequence's own 64 slots: no block updates needed
PROMPTS = {
    "a": [1, *range(40, 70)],  # 31 tokens: past the 22-token window, ending inside a block
    "b": [1, 72, 101, 108, 108, 111],
    "c": [1, *range(120, 147)],  # 28 tokens, prefilled in two chunks beside decodes
}
STEPS: list[dict[str, int]] = [
    {"a": 31, "b": 6},  # prefill of two prompts of different lengths
    {"a": 1, "b": 1},
    {"a": 1, "b": 1},  # an unchanged decode batch
    {"a": 1, "b": 1, "c": 16},  # c's first chunk (nothing sampled) beside decodes
    {"a": 1, "b": 1, "c": 12},  # c's last chunk: it samples too
    {"a": 1, "b": 1, "c": 1},
    {"a": 1, "b": 1, "c": 1},
    {"a": 1, "b": 1, "c": 1},
]
NUM_GPU_BLOCKS = SEQ_BLOCKS * len(PROMPTS)
"""The cache a runner of these steps needs (blocks of every layer: a runner of layer
groups makes as many bytes of its smaller blocks)."""
SAMPLED = {"a": 8, "b": 8, "c": 4}
"""How many tokens each sequence samples over :data:`STEPS`."""


def run_steps(runner: ModelRunner) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """:data:`STEPS` through ``runner.execute``: each step's hidden states, and each
    sequence's sampled (greedy) tokens."""
    hidden: list[torch.Tensor] = []
    forward = runner._forward

    def record(*args: object, **kwargs: object) -> torch.Tensor:
        out = forward(*args, **kwargs)  # type: ignore[arg-type]
        hidden.append(out.clone())
        return out

    runner._forward = record  # type: ignore[method-assign]
    sampled: dict[str, list[int]] = {seq_id: [] for seq_id in PROMPTS}
    greedy = SamplingParams(temperature=0.0, max_tokens=len(STEPS))
    own = SEQ_BLOCKS * runner.num_groups  # a table of layer groups: every group's blocks
    try:
        for step, scheduled in enumerate(STEPS):
            new = [
                NewSeq(
                    seq_id=seq_id,
                    request_id=seq_id,
                    sample_index=0,
                    token_ids=PROMPTS[seq_id],
                    num_prompt_tokens=len(PROMPTS[seq_id]),
                    num_computed_tokens=0,
                    block_ids=list(range(index * own, (index + 1) * own)),
                    sampling=greedy,
                )
                for index, seq_id in enumerate(PROMPTS)
                if seq_id in scheduled and seq_id not in runner.state.seqs
            ]
            plan = BatchPlan(step=step, num_scheduled_tokens=scheduled, new_seqs=new)
            for seq_id, tokens in runner.execute(plan).sampled_token_ids.items():
                sampled[seq_id].extend(tokens)
    finally:
        del runner._forward  # the class's method again
    return hidden, sampled


def agrees_with(sampled: dict[str, list[int]], expected: list[list[int]]) -> bool:
    """Each sequence sampled its :data:`SAMPLED` tokens, and they are transformers'
    continuation of its prompt (``expected``, in :data:`PROMPTS`' order) as far as both
    go (transformers stops at an end-of-sequence token; ``execute`` does not)."""
    return [len(tokens) for tokens in sampled.values()] == list(SAMPLED.values()) and all(
        got[: len(want)] == want[: len(got)]
        for got, want in zip(sampled.values(), expected, strict=True)
    )


def step_runner(
    path: Path,
    model_impl: str,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    **fields: object,
) -> ModelRunner:
    """A CPU runner of ``path`` (float32 unless ``dtype`` says) sized for :data:`STEPS`
    (``fields``: more settings, e.g. ``max_num_seqs``)."""
    from gpu_worker.model_runner import ModelRunner
    from shared.worker_settings import WorkerSettings

    settings = WorkerSettings.of(
        model=str(path),
        block_size=BLOCK,
        max_num_batched_tokens=256,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        model_impl=model_impl,
        **fields,
    )
    return ModelRunner(settings, device=torch.device("cpu"), dtype=dtype, group=group)
