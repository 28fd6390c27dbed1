"""The in-process engine: scheduler core and one model runner, no sockets.

For tests, benchmarks and offline batch jobs::

    from gpu_worker.engine import LLM
    from shared import SamplingParams

    with LLM(num_gpu_blocks=256, max_num_batched_tokens=64) as llm:
        out = llm.generate(["Hello", [1, 72, 105]], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import AutoTokenizer

from gpu_worker.model_runner import ModelRunner, resolve_device
from gpu_worker.tiny_model import default_model_dir
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.request import FinishReason, RejectedError, Request, SeqStatus
from scheduler_svc.request import Sequence as Sequence_
from scheduler_svc.scheduler import Scheduler, UpdateOutcome
from shared.config import SchedulerConfig
from shared.errors import ConfigError
from shared.outputs import Completion, CompletionSample
from shared.sampling import SamplingParams
from shared.swap_pool import SwapPoolSegment

DEFAULT_CPU_BLOCKS = 1024
"""Device blocks on a machine without CUDA when num_gpu_blocks is not given."""

Prompt = str | list[int]


class LLM:
    """``LLM(model=DIR, **scheduler_config)``; config keywords are SchedulerConfig fields."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: torch.dtype | None = None,
        gpu_memory_utilization: float = 0.9,
        **scheduler_config: Any,
    ) -> None:
        self.model_dir = Path(model) if model is not None else default_model_dir()
        try:
            config = SchedulerConfig(**scheduler_config)
        except TypeError as exc:
            raise ConfigError(f"unknown engine keyword: {exc}") from None
        self.device = resolve_device(device)
        if config.num_gpu_blocks is None and self.device.type != "cuda":
            config = msgspec.structs.replace(config, num_gpu_blocks=DEFAULT_CPU_BLOCKS)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.runner = ModelRunner(
            self.model_dir,
            device=self.device,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_gpu_blocks=config.num_gpu_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
        )
        self.swap_pool: SwapPoolSegment | None = None
        if config.num_cpu_blocks:
            self.swap_pool = SwapPoolSegment.create(
                config.num_cpu_blocks, self.runner.layout.bytes_per_block
            )
            self.runner.kv_cache.attach_swap_pool(self.swap_pool)
        max_len = min(config.max_model_len, self.runner.config.max_position_embeddings)
        self.config = msgspec.structs.replace(
            config, num_gpu_blocks=self.runner.num_gpu_blocks, max_model_len=max_len
        )
        self.scheduler = Scheduler(
            self.config,
            eos_token_ids=self.runner.eos_token_ids,
            kv_bytes_per_block=self.runner.layout.bytes_per_block,
            vocab_size=self.runner.vocab_size,
        )
        self._next_id = 0
        self._logprobs: dict[str, list[dict[int, float]]] = {}

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion; raises RejectedError for one that never fits."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of prompts, not one string")
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} params for {len(prompts)} prompts")
        requests: list[Request] = []
        for index, prompt in enumerate(prompts):
            request_id = f"req-{self._next_id}"
            self._next_id += 1
            try:
                requests.append(
                    self.scheduler.add_request(
                        request_id,
                        self.encode(prompt),
                        per_prompt[index],
                        priority=priorities[index] if priorities else 0,
                    )
                )
            except RejectedError as exc:
                for request in requests:
                    self.scheduler.abort(request.request_id)
                raise RejectedError(exc.code, f"prompt {index}: {exc.message}") from None
        # Stop strings need text: each sequence that has some gets an incremental
        # detokenizer, fed one token a step (the daemon's output path does the same).
        stop_detoks: dict[str, IncrementalDetokenizer] = {}
        self._logprobs = {}
        while self.scheduler.has_work():
            outcome = self.step()
            for seq_id, entry in outcome.logprobs.items():
                self._logprobs.setdefault(seq_id, []).append(entry)
            for seq in outcome.advanced:
                stops = seq.request.params.stop
                if stops:
                    detok = stop_detoks.get(seq.seq_id)
                    if detok is None:
                        detok = stop_detoks[seq.seq_id] = IncrementalDetokenizer(
                            self.tokenizer.backend_tokenizer, stops
                        )
                    if not detok.stopped:
                        detok.add(seq.token_ids[-1])
                        if detok.stopped:
                            self._stop(seq)
        stop_texts = {sid: d.text for sid, d in stop_detoks.items() if d.stopped}
        return [self._completion(request, stop_texts) for request in requests]

    def step(self) -> UpdateOutcome:
        """One step: schedule, run it on the model, apply the sampled tokens."""
        return self.scheduler.update(self.runner.execute(self.scheduler.schedule()))

    def _stop(self, seq: Sequence_) -> None:
        """A stop string ended ``seq`` (possibly the step that also ended it otherwise)."""
        if seq.status is SeqStatus.FINISHED:
            seq.finish_reason = FinishReason.STOP
        else:
            self.scheduler.finish_seq(seq.seq_id, FinishReason.STOP)

    def _completion(self, request: Request, stop_texts: dict[str, str]) -> Completion:
        samples = []
        for seq in sorted(request.seqs, key=lambda s: s.sample_index):
            output = seq.output_token_ids
            text = stop_texts.get(seq.seq_id)
            if text is None:
                text = str(self.tokenizer.decode(output, skip_special_tokens=True))
            samples.append(
                CompletionSample(
                    index=seq.sample_index,
                    token_ids=output,
                    text=text,
                    finish_reason=str(seq.finish_reason),
                    logprobs=self._logprobs.get(seq.seq_id),
                )
            )
        return Completion(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            samples=samples,
        )

    def close(self) -> None:
        self.runner.kv_cache.detach_swap_pool()
        if self.swap_pool is not None:
            self.swap_pool.close()
            self.swap_pool = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
