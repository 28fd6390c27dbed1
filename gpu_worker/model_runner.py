"""Runs batch plans on a Hugging Face checkpoint over the paged KV cache.

One :meth:`ModelRunner.execute` per plan: forget freed sequences, swap out, swap in,
copy-on-write, then one packed forward over every scheduled token, the LM head over
each sampled sequence's last position only, and the sampler. The runner keeps each
sequence's tokens and block table between steps, so plans carry deltas only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.utils import logging as hf_logging

from gpu_worker import attention
from gpu_worker.kv_cache import KVCache, KVLayout
from gpu_worker.sampler import Sampler, make_generator
from ipc.schema import BatchPlan, StepResult, StepTiming
from shared.sampling import SamplingParams
from shared.swap_pool import SwapPoolSegment

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class WorkerStateError(RuntimeError):
    """A plan that contradicts the runner's state (a scheduler/worker protocol bug)."""


@dataclass(slots=True)
class _RunnerSeq:
    request_id: str
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams


def _seed_for(seed: int, position: int) -> int:
    """Seed of the draw at ``position``: stateless, so a seeded sequence's tokens do
    not depend on batching, preemption or worker restarts."""
    return (seed * 1_000_003 + position) % (1 << 63)


def check_supported(config: PretrainedConfig) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; expeditor runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError("sliding-window attention layers are not supported")
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        raise ValueError("Mistral sliding-window attention is not supported")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: torch.device,
        block_size: int,
        max_num_batched_tokens: int,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        dtype: torch.dtype | None = None,
        swap_pool: SwapPoolSegment | None = None,
    ) -> None:
        self.device = device
        self.block_size = block_size
        config = AutoConfig.from_pretrained(model_dir)
        check_supported(config)
        self.config = config
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        impl = attention.register()
        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation=impl
        ).to(device)
        self.model.eval()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.layout = KVLayout(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )
        if num_gpu_blocks is None:
            if device.type != "cuda":
                raise ValueError("num_gpu_blocks must be given when the device is not CUDA")
            num_gpu_blocks = self._profile_num_blocks(
                max_num_batched_tokens, gpu_memory_utilization
            )
        self.kv_cache = KVCache(self.layout, num_gpu_blocks, device, swap_pool)
        self.sampler = Sampler()
        self.eos_token_ids: list[int] = eos_token_ids(model_dir, config)
        self.seqs: dict[str, _RunnerSeq] = {}

    @property
    def vocab_size(self) -> int:
        """Token ids the embedding has rows for."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def _profile_num_blocks(self, max_tokens: int, utilization: float) -> int:
        """Blocks that fit beside the weights and a forward at the full token budget."""
        probe = KVCache(self.layout, -(-max_tokens // self.block_size), self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        positions = list(range(max_tokens))
        self._forward(
            [0] * max_tokens,
            positions,
            [positions],
            probe,
            [list(range(probe.num_blocks))],
            [0, max_tokens],
        )
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * utilization) - peak
        blocks = budget // self.layout.bytes_per_block
        if blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache: peak use {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}"
            )
        return int(blocks)

    def _forward(
        self,
        token_ids: list[int],
        positions: list[int],
        slot_positions: list[list[int]],
        cache: KVCache,
        tables: list[list[int]],
        query_start_loc: list[int],
    ) -> torch.Tensor:
        """Hidden states of every packed token."""
        device = self.device
        bs = self.block_size
        slots = [
            table[p // bs] * bs + p % bs
            for table, seq_positions in zip(tables, slot_positions, strict=True)
            for p in seq_positions
        ]
        width = max(len(t) for t in tables)
        meta = attention.StepMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
            ),
            seq_lens=torch.tensor(
                [p[-1] + 1 for p in slot_positions], dtype=torch.int32, device=device
            ),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            layer_caches=cache.layer_caches,
        )
        with torch.inference_mode():
            out = self.model.model(
                input_ids=torch.tensor([token_ids], dtype=torch.int64, device=device),
                position_ids=torch.tensor([positions], dtype=torch.int64, device=device),
                use_cache=False,
                expeditor_meta=meta,
            )
        return out.last_hidden_state[0]

    def _seq(self, seq_id: str) -> _RunnerSeq:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise WorkerStateError(f"plan names unknown sequence {seq_id!r}")
        return seq

    def execute(self, plan: BatchPlan) -> StepResult:
        started = time.perf_counter()
        for seq_id in plan.freed_seq_ids:
            self.seqs.pop(seq_id, None)
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        self.kv_cache.copy(plan.copies)
        swapped = time.perf_counter()
        for new in plan.new_seqs:
            # Full data replaces any state held for that id: after another rank was lost,
            # the scheduler resends every sequence and this rank's old state is stale.
            self.seqs[new.seq_id] = _RunnerSeq(
                request_id=new.request_id,
                sample_index=new.sample_index,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                num_computed_tokens=new.num_computed_tokens,
                block_ids=list(new.block_ids),
                params=new.sampling,
            )
        for update in plan.block_updates:
            seq = self._seq(update.seq_id)
            seq.block_ids.extend(update.appended)
            for index, block in update.replaced:
                seq.block_ids[index] = block
        if not plan.num_scheduled_tokens:
            return StepResult(step=plan.step, sampled_token_ids={})

        batch = [(self._seq(sid), n) for sid, n in plan.num_scheduled_tokens.items()]
        token_ids: list[int] = []
        positions: list[list[int]] = []
        query_start_loc = [0]
        for seq, n in batch:
            start = seq.num_computed_tokens
            if n < 1 or start + n > len(seq.token_ids):
                raise WorkerStateError(
                    f"{seq.request_id}: {n} tokens scheduled at {start} of {len(seq.token_ids)}"
                )
            token_ids.extend(seq.token_ids[start : start + n])
            positions.append(list(range(start, start + n)))
            query_start_loc.append(query_start_loc[-1] + n)
        hidden = self._forward(
            token_ids,
            [p for seq_positions in positions for p in seq_positions],
            positions,
            self.kv_cache,
            [seq.block_ids for seq, _ in batch],
            query_start_loc,
        )
        forwarded = time.perf_counter()

        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        masked: list[list[int]] = []
        owners: list[str] = []
        for index, ((seq, n), seq_id) in enumerate(
            zip(batch, plan.num_scheduled_tokens, strict=True)
        ):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < len(seq.token_ids):
                continue
            num_output = len(seq.token_ids) - seq.num_prompt_tokens
            p = seq.params
            banned: list[int] = []
            if num_output < p.min_tokens:
                banned = list(p.stop_token_ids)
                banned.extend(self.eos_token_ids)
            samples = [seq.sample_index, *range(1, plan.num_samples.get(seq_id, 1))]
            for sample_index in samples:
                rows.append(query_start_loc[index + 1] - 1)
                params.append(p)
                generators.append(
                    None
                    if p.seed is None
                    else make_generator(
                        _seed_for(p.seed, len(seq.token_ids)), sample_index, self.device
                    )
                )
                masked.append(banned)
                owners.append(seq_id)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] | None = None
        if rows:
            with torch.inference_mode():
                logits = self.model.lm_head(hidden[torch.tensor(rows, device=self.device)])
            out = self.sampler.sample(logits, params, generators, masked)
            for row, seq_id in enumerate(owners):
                sampled.setdefault(seq_id, []).append(out.token_ids[row])
                entry = out.logprobs[row] if out.logprobs is not None else None
                if entry is not None:
                    logprobs = logprobs or {}
                    logprobs.setdefault(seq_id, []).append(entry)
            for seq_id, tokens in sampled.items():
                self.seqs[seq_id].token_ids.append(tokens[0])
        done = time.perf_counter()
        return StepResult(
            step=plan.step,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            timing=StepTiming(
                swap_s=swapped - started,
                forward_s=forwarded - swapped,
                sample_s=done - forwarded,
                total_s=done - started,
            ),
        )


def eos_token_ids(model_dir: str | Path, config: PretrainedConfig) -> list[int]:
    """Every id that ends generation: the model config's and the generation config's
    ``eos_token_id`` (each an int or a list; Llama 3 lists several)."""
    found: list[int] = []
    values: list[object] = [config.eos_token_id]
    try:
        generation = json.loads((Path(model_dir) / "generation_config.json").read_text())
        values.append(generation.get("eos_token_id"))
    except (OSError, ValueError):
        pass
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return found
