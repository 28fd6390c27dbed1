"""A checkpoint loaded for the worker's forward: the model, the forward that runs it
(expeditor's lean one where its model type has one, else transformers' model code, both
over the paged KV cache through :mod:`gpu_worker.attention`) and its LM head.

The model runner loads its target model this way, and the draft model of speculative
decoding (:mod:`gpu_worker.draft_model`) its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.utils import logging as hf_logging

from gpu_worker import attention
from gpu_worker.architectures import check_supported, logits_fn
from gpu_worker.kernels.attention_args import layer_params
from gpu_worker.lean_model import LeanDecoder, why_not_lean
from gpu_worker.tensor_parallel import check_tp_supported, shard_model
from shared.memory import malloc_trim

if TYPE_CHECKING:
    from gpu_worker.kv_cache import KVCache

__all__ = ["ATTN_IMPLEMENTATION", "Decoder", "expeditor_attention", "load_decoder"]

ATTN_IMPLEMENTATION = "expeditor_paged"
"""What transformers' modules run for attention (:func:`expeditor_attention`)."""


@dataclass(slots=True)
class Decoder:
    """A loaded checkpoint and how it runs."""

    model: Any
    """transformers' model (its forward when :attr:`lean` is None; its embeddings and LM
    head; its projection weights, unless the lean forward reordered and released them)."""
    config: PretrainedConfig
    lean: LeanDecoder | None
    """The lean forward, when it runs one."""
    impl_note: str
    """Which forward runs, and why (the worker logs it)."""
    logits: Any
    """hidden rows -> logits, as the checkpoint's own head computes them."""

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: attention.StepMetadata
    ) -> torch.Tensor:
        """Hidden states of the packed tokens ``input_ids`` at ``positions``."""
        if self.lean is not None:
            return self.lean(input_ids, positions, meta)
        out = self.model.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            expeditor_meta=meta,
        )
        return out.last_hidden_state[0]

    def run_step(
        self,
        tensors: dict[str, torch.Tensor],
        cache: KVCache,
        backend: attention.AttentionBackend,
        plan: Any,
    ) -> torch.Tensor:
        """Hidden states of a step from its device tensors (``input_ids``, ``positions``
        and the attention arrays), over ``cache`` with ``backend``'s ``plan`` (a cache of
        layer groups: a plan per group, over ``group_tables`` and ``group_slots``)."""
        groups = cache.layout.groups

        def metadata(
            tables: torch.Tensor, slots: torch.Tensor, plan: Any
        ) -> attention.StepMetadata:
            return attention.StepMetadata(
                slot_mapping=slots,
                block_tables=tables,
                seq_lens=tensors["seq_lens"],
                query_start_loc=tensors["query_start_loc"],
                layer_caches=cache.layer_caches,
                layer_scales=cache.layer_scales,
                backend=backend,
                plan=plan,
            )

        if groups is None:
            meta = metadata(tensors["block_tables"], tensors["slot_mapping"], plan)
        else:
            tables, slots = tensors["group_tables"], tensors["group_slots"]
            metas = [metadata(tables[g], slots[g], plan[g]) for g in range(len(plan))]
            meta = metadata(tables[0], slots[0], plan[0])
            meta.groups, meta.layer_groups = metas, groups.layer_groups
        return self.run(tensors["input_ids"], tensors["positions"], meta)

    @property
    def vocab_size(self) -> int:
        """Token ids the embedding has rows for."""
        return int(self.model.get_input_embeddings().num_embeddings)


def load_decoder(
    model_dir: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    model_impl: str,
    group: ProcessGroup | None = None,
) -> Decoder:
    """Load ``model_dir`` on ``device`` in ``dtype``, sharded over ``group`` (tensor
    parallelism) when given. ``model_impl``: ``auto`` runs the lean forward where the
    model type has one, ``transformers`` always transformers' model code."""
    config = AutoConfig.from_pretrained(model_dir)
    check_supported(config)
    world = dist.get_world_size(group) if group is not None else 1
    if world > 1:
        check_tp_supported(config, world)
    AttentionInterface.register(ATTN_IMPLEMENTATION, expeditor_attention)  # idempotent
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    ).to(device)
    model.eval()
    if world > 1:
        shard_model(model, config, dist.get_rank(group), world, group)
    lean = None
    note = "transformers (model_impl=transformers)"
    if model_impl == "auto":  # by model type, on every device and TP degree
        reason = why_not_lean(model, config)
        if reason is None:
            lean = LeanDecoder(model, config, group)
            sharded = f", sharded over {world} ranks" if world > 1 else ""
            packed = ", weights reordered for oneDNN" if lean.unpacked is None else ""
            packed += f", {lean.ops_note}" if lean.ops_note else ""
            note = f"lean (model type {config.model_type!r}{sharded}{packed})"
        else:
            note = f"transformers ({reason})"
    if torch.device(device).type == "cpu":
        # The pages loading freed (the checkpoint's tensors as read, the weights fused or
        # reordered since), which glibc's heap keeps otherwise: SmolLM2's bf16 worker
        # then holds 133 MiB less, 201 MiB less with its weights reordered.
        malloc_trim()
    return Decoder(model, config, lean, note, logits_fn(model, config))


def expeditor_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over :func:`gpu_worker.attention.attend`: query
    [1, heads, tokens, head_dim], key/value [1, kv_heads, tokens, head_dim]."""
    meta: attention.StepMetadata | None = kwargs.get("expeditor_meta")
    if meta is None:
        raise RuntimeError("expeditor attention called without expeditor_meta")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    layer: int = module.layer_idx  # type: ignore[assignment]
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    out = attention.attend(meta, layer, q, k, v, layer_params(scaling, window, softcap))
    return out.unsqueeze(0), None
