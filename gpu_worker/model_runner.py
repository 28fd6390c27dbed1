"""Runs batch plans on a Hugging Face checkpoint over the paged KV cache.

One :meth:`ModelRunner.execute` per plan, in named steps: apply the plan to the
sequence state (:class:`ipc.plan_state.WorkerState`, which keeps each sequence's
tokens and block table between steps, so plans carry deltas only), swap out, swap in,
copy-on-write, prepare the packed inputs, one forward over every scheduled token, then
the LM head over each sampled sequence's last position only and the sampler (and over
the prompt positions of the requests that ask for prompt logprobs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from transformers import PretrainedConfig

from gpu_worker import attention
from gpu_worker.architectures import kv_window, layer_groups
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.decoder import load_decoder
from gpu_worker.draft_model import DraftModel, check_same_vocabulary
from gpu_worker.dtype import resolve_dtype
from gpu_worker.event_clock import EventClock
from gpu_worker.kv_cache import KVCache, KVLayout, swap_staging_blocks
from gpu_worker.kv_quant import kv_storage_dtype
from gpu_worker.lean_model import LeanDecoder
from gpu_worker.logits_shaping import History, bad_word_bans
from gpu_worker.memory_budget import MemoryProfile, describe, kv_cache_blocks
from gpu_worker.model_source import resolve_model
from gpu_worker.prompt_logprobs import prompt_logprobs
from gpu_worker.sampler import Sampler, argmax, sample_key
from gpu_worker.staging import Staging
from gpu_worker.step_flops import StepFlops
from gpu_worker.step_inputs import StepInputs, group_arrays
from gpu_worker.tensor_parallel import local_kv_heads
from gpu_worker.token_bitmask import apply_bitmask, pack_rows
from ipc.plan_state import ScheduledSeq, WorkerSeq, WorkerState, accepted_run
from ipc.schema import BatchPlan, StepResult, StepTiming, WorkerHello
from shared.checkpoint import capped_max_len
from shared.config import StepLimits
from shared.sampling import SamplingParams
from shared.swap_pool import SwapPoolSegment
from shared.worker_settings import WorkerSettings

DEFAULT_CPU_BLOCKS = 1024
"""KV blocks of a float32 worker off CUDA when the settings give no ``num_gpu_blocks``
(a CUDA worker sizes its cache from ``gpu_memory_utilization``): their memory is the
budget, so a bfloat16 worker gets twice as many."""


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """The device a worker of ``rank`` runs on. ``cuda`` (or ``auto`` with CUDA) without
    an index is the rank's own GPU: rank r on the (r mod count)-th visible device, so
    ``serve --workers N`` / a group of N ranks spreads over N GPUs, and a rank that sees
    one GPU only (systemd's CUDA_VISIBLE_DEVICES=%i) takes device 0. An index given is
    kept, and checked."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    count = torch.cuda.device_count()
    if resolved.index is None:
        return torch.device("cuda", rank % max(count, 1))
    if resolved.index >= count:
        raise ValueError(f"device {device!r}: only {count} CUDA device(s) are visible")
    return resolved


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (kernels, Triton and
    allocations without an explicit device go there); nothing for other devices."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class ModelRunner:
    def __init__(
        self,
        settings: WorkerSettings,
        *,
        device: torch.device,
        dtype: torch.dtype | None = None,
        swap_pool: SwapPoolSegment | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        """Load ``settings.server.model`` (empty: the embedded tiny model) and size the
        cache and buffers by ``settings`` (:class:`~shared.worker_settings.WorkerSettings`,
        taken whole), on ``device`` with ``dtype`` (default: the settings' ``dtype``;
        ``auto`` is bfloat16 on CUDA and on CPUs with bf16 arithmetic, float32
        elsewhere: :func:`gpu_worker.dtype.resolve_dtype`). ``group``: this rank's
        tensor-parallel group; the model is then sharded over it
        (:mod:`gpu_worker.tensor_parallel`) and the cache holds this rank's KV heads.
        ``cuda_graphs``: capture decode steps, and verify steps of
        ``num_speculative_tokens`` (:mod:`gpu_worker.cuda_graphs`), for up to
        ``max_num_seqs`` sequences of up to ``max_model_len`` tokens (capped by the
        checkpoint's limit); CUDA only, ignored elsewhere. ``num_gpu_blocks`` unset:
        sized from ``gpu_memory_utilization`` on CUDA, :data:`DEFAULT_CPU_BLOCKS` float32
        blocks' memory elsewhere.
        ``model_impl``: ``auto`` runs the checkpoint through
        :class:`~gpu_worker.lean_model.LeanDecoder` where its model type has one (on any
        device, sharded or not), else through transformers' model code; ``transformers``
        always through transformers' model code."""
        limits, model_impl = settings.scheduler, settings.server.model_impl
        model_dir = resolve_model(settings.server.model)
        self.model_dir = model_dir
        """The checkpoint directory loaded."""
        block_size = limits.block_size
        self.device = device
        self.block_size = block_size
        if dtype is None:
            dtype, why = resolve_dtype(settings.server.dtype, device)
        else:
            why = "given"
        self.dtype = dtype
        self.dtype_note = f"{str(dtype).removeprefix('torch.')} ({why})"
        """The dtype the weights and KV cache take, and why (the worker logs it)."""
        decoder = load_decoder(
            model_dir, device=device, dtype=dtype, model_impl=model_impl, group=group
        )
        self.decoder = decoder
        config = self.config = decoder.config
        world = dist.get_world_size(group) if group is not None else 1
        self.model = decoder.model
        self.group = group
        self.lean: LeanDecoder | None = decoder.lean
        """The lean forward, when this worker runs one (else transformers' forward)."""
        self.model_impl_note = decoder.impl_note
        """Which forward runs, and why (the worker logs it)."""
        self.flops = StepFlops(self.model, config, world)
        """A step's forward FLOPs (reported with its time)."""
        self.logits = decoder.logits
        """hidden rows -> logits, as the checkpoint's own head computes them."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_heads = config.num_attention_heads // world
        """This rank's query heads."""
        self.clock = EventClock(device)
        self.staging = Staging(device, self.clock)
        """The step's transfers: index arrays in, sampled tokens out."""
        self.sampler = Sampler(self.staging)
        self.prompt_logprob_rows = limits.max_num_seqs
        """LM-head rows per piece of a step's prompt logprobs (those the sampler's
        memory was profiled with)."""
        self.memory_profile: MemoryProfile | None = None
        """What the cache was sized from (CUDA without num_gpu_blocks)."""
        self.graphs: DecodeGraphs | None = None
        # A model mixing windowed and full layers lays its cache out in layer groups
        # when their windows' blocks are given back (a draft model's K/V share the
        # blocks and read the whole context: never with one).
        groups = (
            layer_groups(config)
            if limits.free_out_of_window_blocks and not settings.server.speculative_model
            else None
        )
        self.layout = KVLayout(
            num_layers=config.num_hidden_layers
            if groups is None
            else 1 + max(slot for _, slot in groups.where),
            num_kv_heads=local_kv_heads(config, world),
            head_dim=head_dim,
            block_size=block_size,
            dtype=self.dtype,
            kv_dtype=kv_storage_dtype(settings.server.kv_cache_dtype),
            groups=groups,
        )
        self.num_groups = 1 if groups is None else len(groups.windows)
        """Layer groups a block table holds side by side."""
        self.attention_backend, _ = attention.choose_backend(device, self.layout, self.num_heads)
        """The attention backend, chosen once, and why (:mod:`gpu_worker.attention`)."""
        self.draft: DraftModel | None = None
        """Speculative decoding's draft model (``speculative_model``), if any."""
        if settings.server.speculative_model:
            if world > 1:
                raise ValueError(
                    "speculative_model: a draft model runs on unsharded workers only "
                    f"(tensor_parallel_size is {world}); prompt lookup (speculative_model "
                    "empty) works at any tensor_parallel_size"
                )
            draft_dir = resolve_model(settings.server.speculative_model)
            check_same_vocabulary(model_dir, draft_dir)
            self.draft = DraftModel(
                draft_dir, device=device, dtype=dtype, block_size=block_size,
                target_vocab_size=self.vocab_size, model_impl=model_impl,
                kv_dtype=self.layout.kv_dtype,
            )  # fmt: skip
        num_gpu_blocks = limits.num_gpu_blocks
        if num_gpu_blocks is not None and groups is not None:
            # As many bytes as that many blocks of every layer, in blocks of a group's.
            num_gpu_blocks = num_gpu_blocks * config.num_hidden_layers // self.layout.num_layers
        if num_gpu_blocks is None and device.type != "cuda":
            float32_block = (
                (  # every layer's, in float32
                    self.layout.code_bytes * 4 // (self.layout.kv_dtype or self.dtype).itemsize
                )
                * config.num_hidden_layers
                // self.layout.num_layers
            )
            num_gpu_blocks = DEFAULT_CPU_BLOCKS * float32_block // self.block_bytes
        elif num_gpu_blocks is None:
            num_gpu_blocks = self._profile_num_blocks(
                limits.max_num_batched_tokens,
                limits.max_num_seqs,
                settings.server.gpu_memory_utilization,
            )
        self.kv_cache = KVCache(self.layout, num_gpu_blocks, device, swap_pool, self.staging)
        if self.draft is not None:
            self.draft.allocate(num_gpu_blocks)
        # Every attention configuration the model uses compiled now, not at the first
        # step that needs it (nothing off the Triton backend).
        cap = getattr(config, "attn_logit_softcapping", None)
        window = getattr(config, "sliding_window", None)
        self.attention_backend.warm_up([(None, cap), *([(window, cap)] if window else [])])
        capturable = self.attention_backend.capturable
        if settings.server.cuda_graphs and device.type == "cuda" and capturable:
            self.graphs = self.capture_graphs(limits)
        self.eos_token_ids: list[int] = eos_token_ids(model_dir, config)
        self.state = WorkerState(block_size, self.num_groups)

    def capture_graphs(self, limits: StepLimits) -> DecodeGraphs:
        """The forward captured for decode steps and for verify steps of
        ``limits.num_speculative_tokens`` (:mod:`gpu_worker.cuda_graphs`), on this runner's
        cache and attention backend."""
        max_len = capped_max_len(limits.max_model_len, self.model_dir)
        verify = limits.num_speculative_tokens + 1  # a verify step's rows per sequence
        graphs = DecodeGraphs(
            lambda tensors, plan: self._run_model(tensors, self.kv_cache, plan),
            lambda arrays: self._plan(arrays, self.kv_cache.num_blocks, capture=True),
            max_num_seqs=limits.max_num_seqs,
            width=-(-(max_len + verify) // self.block_size),
            device=self.device,
            staging=self.staging,
            rows=(1, verify),
            max_tokens=limits.max_num_batched_tokens,
            runs=lambda arrays: self.attention_backend.graph_runs(arrays),
            num_groups=self.num_groups,
        )
        graphs.capture()
        return graphs

    @property
    def vocab_size(self) -> int:
        """Token ids the embedding has rows for."""
        return self.decoder.vocab_size

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def block_bytes(self) -> int:
        """Device memory one KV block takes on this rank: the model's K/V, and the draft
        model's beside it."""
        draft = self.draft.bytes_per_block if self.draft is not None else 0
        return self.layout.bytes_per_block + draft

    def hello(self, rank: int = 0) -> WorkerHello:
        """What this runner tells the scheduler about itself: the worker daemon sends it,
        ``LLM`` builds its engine from it. ``kv_bytes_per_block`` is the whole group's."""
        world = dist.get_world_size(self.group) if self.group is not None else 1
        return WorkerHello(
            rank=rank,
            pid=os.getpid(),
            device=str(self.device),
            num_gpu_blocks=self.num_gpu_blocks,
            kv_bytes_per_block=self.layout.bytes_per_block * world,
            tensor_parallel_size=world,
            block_size=self.block_size,
            model=os.path.abspath(self.model_dir),
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            draft_model=os.path.abspath(self.draft.model_dir) if self.draft is not None else "",
            # A draft model's K/V share the blocks and its layers read the whole context.
            kv_window=kv_window(self.config) if self.draft is None else 0,
            kv_groups=[] if self.layout.groups is None else list(self.layout.groups.windows),
            kv_block_layers=[]
            if self.layout.groups is None
            else [self.config.num_hidden_layers, self.layout.num_layers],
        )

    def _profile_num_blocks(self, max_tokens: int, max_num_seqs: int, utilization: float) -> int:
        """Blocks that fit beside everything else the worker will hold at its busiest
        (:mod:`gpu_worker.memory_budget`)."""
        probe = KVCache(
            self.layout,
            -(-max_tokens // self.block_size) * self.num_groups,
            self.device,
            None,
            self.staging,
        )
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            hidden = self._forward(
                StepInputs(
                    token_ids=[0] * max_tokens,
                    starts=[0],
                    tables=[list(range(probe.num_blocks))],
                    query_start_loc=[0, max_tokens],
                ),
                probe,
            )
            rows = hidden[-1:].expand(max_num_seqs, -1)
            # Every row with every control: the sampler's largest temporaries.
            busiest = SamplingParams(
                temperature=1.0, top_p=0.9, min_p=0.05, seed=0, logprobs=20,
                repetition_penalty=1.1, frequency_penalty=0.5, logit_bias={0: 1.0},
                allowed_token_ids=(0, 1),
            )  # fmt: skip
            history = History(np.arange(max_tokens) % 2, np.zeros(1, dtype=np.int64))
            self.sampler.sample(
                self.logits(rows),
                [busiest] * max_num_seqs,
                [sample_key(0, i) for i in range(max_num_seqs)],
                [[0]] * max_num_seqs,
                [history] * max_num_seqs,
            )
            del hidden, rows
        peak = torch.cuda.max_memory_allocated(self.device)
        del probe
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        profile = MemoryProfile(
            total=total,
            free=free,
            torch_reserved=torch.cuda.memory_reserved(self.device),
            torch_peak=peak,
        )
        reserved = swap_staging_blocks(self.layout) * self.layout.bytes_per_block
        blocks = kv_cache_blocks(profile, utilization, reserved, self.block_bytes)
        if self.group is not None:  # every rank of a group holds the same block count
            smallest = torch.tensor([blocks], device=self.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.group)
            blocks = int(smallest.item())
        if blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache: {describe(profile, utilization, reserved)}"
            )
        self.memory_profile = profile
        return int(blocks)

    def _forward(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """Hidden states of every packed token (under inference mode): a captured graph's
        replay for a decode-only step that fits one, else an eager forward."""
        arrays = inputs.host_arrays(self.block_size, self.num_groups)
        arrays["input_ids"] = np.asarray(inputs.token_ids, dtype=np.int64)
        if self.graphs is not None and cache is self.kv_cache:
            hidden = self.graphs.run(arrays)
            if hidden is not None:
                return hidden
        plan = self._plan(arrays, cache.num_blocks)
        return self._run_model(self.staging.to_device(arrays), cache, plan)

    def _plan(self, arrays: dict[str, np.ndarray], num_blocks: int, capture: bool = False) -> Any:
        """The attention backend's plan of a step; a cache of layer groups: one per
        group, over its tables and slots."""
        plan = self.attention_backend.plan
        if self.num_groups == 1:
            return plan(arrays, num_blocks, capture=capture)
        return [
            plan(group_arrays(arrays, g), num_blocks, capture=capture)
            for g in range(self.num_groups)
        ]

    def _run_model(
        self, tensors: dict[str, torch.Tensor], cache: KVCache, plan: Any
    ) -> torch.Tensor:
        """The model over the step's device tensors (:data:`gpu_worker.cuda_graphs.INPUTS`)
        with ``plan``, the attention backend's for the step."""
        return self.decoder.run_step(tensors, cache, self.attention_backend, plan)

    @torch.inference_mode()
    def forward_only(self, inputs: StepInputs) -> torch.Tensor:
        """One forward of ``inputs`` over the KV cache, no plan state and no sampling
        (timing the model, as the CPU thread choice does)."""
        return self._forward(inputs, self.kv_cache)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        # Timed parts: swap, forward, sample (on the device's clock where there is one:
        # gpu_worker.event_clock); the rest of total (plan state, inputs) is the step's
        # preparation.
        clock = self.clock
        clock.start()
        draft = self.draft
        drafting = draft.seconds if draft is not None else 0.0
        batch = self.state.apply(plan, draft)
        proposals = self.state.proposals
        clock.mark("applied")
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        self.kv_cache.copy(plan.copies)
        clock.mark("swapped")
        if not batch:
            if plan.swap_in:
                # Nothing samples, so nothing below waits for the device: the swap-ins
                # must be done before the scheduler hears of this step and reuses the
                # pool blocks they read. (A step that samples waits for its tokens,
                # which come after the copies on the same stream.)
                self.kv_cache.fence()
            return StepResult(step=plan.step, sampled_token_ids={})
        inputs = self._prepare_inputs(batch)
        clock.mark("prepared")
        hidden = self._forward(inputs, self.kv_cache)
        clock.mark("forwarded")
        reads = self.staging.host_syncs
        sampled, logprobs = self._sample(batch, inputs, hidden, plan.token_masks)
        if proposals:
            accepted_runs(sampled, logprobs, proposals)
        prompt_lp = prompt_logprobs(
            batch, inputs.query_start_loc, hidden, self.logits, self.staging,
            self.prompt_logprob_rows,
        )  # fmt: skip
        read = self.staging.host_syncs > reads  # the device is done with the step
        if not read:
            clock.mark("read")
        self.state.append_sampled(sampled, proposals)
        clock.mark("done")
        return StepResult(
            step=plan.step,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            timing=StepTiming(
                swap_s=clock.between("applied", "swapped", read),
                forward_s=clock.between("prepared", "forwarded", read),
                sample_s=clock.between("forwarded", "read", read),
                total_s=clock.between("start", "done", False),
                draft_s=draft.seconds - drafting if draft is not None else 0.0,
                forward_flop=self.flops.step(inputs.starts, inputs.query_start_loc),
            ),
        )

    @staticmethod
    def _prepare_inputs(batch: list[ScheduledSeq]) -> StepInputs:
        inputs = StepInputs()
        for item in batch:
            seq = item.seq
            inputs.token_ids.extend(seq.token_ids[item.start : item.end])
            inputs.starts.append(item.start)
            inputs.tables.append(seq.block_ids)
            inputs.query_start_loc.append(inputs.query_start_loc[-1] + item.num_tokens)
        return inputs

    def _sample(
        self,
        batch: list[ScheduledSeq],
        inputs: StepInputs,
        hidden: torch.Tensor,
        token_masks: dict[str, bytes],
    ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, float]]] | None]:
        """Draw every due token: one row per sample, from its sequence's last position;
        a constrained sequence's rows under its mask (``token_masks``); a speculating
        sequence's at each of its last ``num_proposed + 1`` positions, each as a decode
        there would draw it (its prefix of the proposal taken as the output so far)."""
        if token_masks:
            return self._sample_rows(batch, inputs, hidden, token_masks)
        rows: list[int] = []
        owners: list[str] = []
        ends = inputs.query_start_loc
        for index, item in enumerate(batch):
            if not item.num_samples:
                continue
            seq = item.seq
            p = seq.sampling
            proposed = item.num_proposed
            if (
                item.num_samples != 1
                or p.seed is not None
                or p.logprobs is not None
                or (p.temperature != 0 and p.top_k != 1)
                or seq.num_output_tokens - proposed < p.min_tokens
                or p.shapes_logits
            ):
                return self._sample_rows(batch, inputs, hidden, token_masks)
            last = ends[index + 1] - 1
            rows.extend(range(last - proposed, last + 1))
            owners.extend([seq.seq_id] * (proposed + 1))
        if not rows:
            return {}, None
        # All greedy, one sample each, nothing masked, no logprobs: the sampler's own
        # fast path (one argmax, one transfer), without building its per-row lists.
        logits = self.logits(self._rows(hidden, rows))
        tokens: list[int] = self.staging.to_host(argmax(logits))
        sampled: dict[str, list[int]] = {}
        for seq_id, token in zip(owners, tokens, strict=True):
            sampled.setdefault(seq_id, []).append(token)
        return sampled, None

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]``; ``hidden`` itself when ``rows`` are all of its rows (distinct,
        increasing: every sequence samples from its last token, a speculating one from
        each of its tokens)."""
        if len(rows) == hidden.shape[0]:
            return hidden
        index = self.staging.to_device({"rows": np.asarray(rows, dtype=np.int64)})["rows"]
        return hidden.index_select(0, index)

    def _row_controls(self, seq: WorkerSeq, length: int) -> tuple[np.ndarray, History | None]:
        """The ids masked and the penalty history of a draw after ``seq``'s first
        ``length`` tokens (below ``min_tokens``: stop ids and EOS; bad words' last tokens)."""
        p = seq.sampling
        banned = _NO_IDS
        if length - seq.num_prompt_tokens < p.min_tokens:
            if seq.banned_ids is None:  # built once per sequence, not per step
                ids = [*p.stop_token_ids, *self.eos_token_ids]
                seq.banned_ids = np.unique(np.array(ids, dtype=np.int64))
            banned = seq.banned_ids
        if p.bad_words_token_ids:
            output = seq.token_ids[seq.num_prompt_tokens : length]
            bans = bad_word_bans(p.bad_words_token_ids, output)
            banned = np.concatenate([banned, np.array(bans, dtype=np.int64)])
        history = None
        if p.penalised:
            if seq.prompt_seen is None:  # once per sequence, not per step
                seq.prompt_seen = np.unique(seq.token_ids[: seq.num_prompt_tokens])
            output_ids = np.array(seq.token_ids[seq.num_prompt_tokens : length], dtype=np.int64)
            history = History(seq.prompt_seen, output_ids)
        return banned, history

    def _sample_rows(
        self,
        batch: list[ScheduledSeq],
        inputs: StepInputs,
        hidden: torch.Tensor,
        token_masks: dict[str, bytes],
    ) -> tuple[dict[str, list[int]], dict[str, list[dict[int, float]]] | None]:
        """:meth:`_sample` through the sampler: any parameters, seeds, masks, logprobs."""
        rows: list[int] = []
        params: list[SamplingParams] = []
        keys: list[int | None] = []
        masked: list[np.ndarray] = []
        histories: list[History | None] = []
        owners: list[str] = []
        bitmasks: list[bytes | None] = []
        for index, item in enumerate(batch):
            if not item.num_samples:
                continue
            seq = item.seq
            p = seq.sampling
            bitmask = token_masks.get(seq.seq_id)
            last = inputs.query_start_loc[index + 1] - 1
            if item.num_proposed:
                # Row j draws after the known tokens and the first j proposed ones.
                known = len(seq.token_ids) - item.num_proposed
                for j in range(item.num_proposed + 1):
                    banned, history = self._row_controls(seq, known + j)
                    rows.append(last - item.num_proposed + j)
                    params.append(p)
                    keys.append(sample_key(p.seed, seq.sample_index, known + j))
                    masked.append(banned)
                    histories.append(history)
                    owners.append(seq.seq_id)
                    bitmasks.append(None)
                continue
            banned, history = self._row_controls(seq, len(seq.token_ids))
            for sample_index in item.sample_indices:
                rows.append(last)
                params.append(p)
                keys.append(sample_key(p.seed, sample_index, len(seq.token_ids)))
                masked.append(banned)
                histories.append(history)
                owners.append(seq.seq_id)
                bitmasks.append(bitmask)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] | None = None
        if not rows:
            return sampled, logprobs
        arrays = {"rows": np.asarray(rows, dtype=np.int64)}
        if token_masks:
            words = len(next(iter(token_masks.values()))) // 4
            arrays["mask_rows"], arrays["mask_bits"] = pack_rows(bitmasks, words)
        dev = self.staging.to_device(arrays)  # one copy
        logits = self.logits(hidden.index_select(0, dev["rows"]))  # rows repeat for n > 1
        if token_masks:
            logits = apply_bitmask(logits, dev["mask_rows"], dev["mask_bits"])
        out = self.sampler.sample(logits, params, keys, masked, histories)
        for row, seq_id in enumerate(owners):
            sampled.setdefault(seq_id, []).append(out.token_ids[row])
            entry = out.logprobs[row] if out.logprobs is not None else None
            if entry is not None:
                logprobs = logprobs or {}
                logprobs.setdefault(seq_id, []).append(entry)
        return sampled, logprobs


_NO_IDS = np.empty(0, dtype=np.int64)


def accepted_runs(
    sampled: dict[str, list[int]],
    logprobs: dict[str, list[dict[int, float]]] | None,
    proposals: dict[str, list[int]],
) -> None:
    """Cut each speculating sequence's draws (one per position) and their logprobs to
    its result, in place (:func:`ipc.plan_state.accepted_run`)."""
    for seq_id, proposal in proposals.items():
        kept = accepted_run(sampled[seq_id], proposal)
        del sampled[seq_id][kept:]
        if logprobs and seq_id in logprobs:
            del logprobs[seq_id][kept:]


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
