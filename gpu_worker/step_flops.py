"""How much arithmetic a step's forward does, so a step's time can be read against the
machine's peak: ``expeditor bench`` and ``inspect`` print achieved GFLOP/s.

Counted from the model's shapes, multiply-adds as 2 FLOPs, the model body only (what
``StepTiming.forward_s`` times; the LM head belongs to sampling):

* the matmuls: 2 x (the body's weight matrices but the embedding's: linear layers,
  routers, fused experts) per token, expert weights scaled by the share of experts a
  token runs (``num_experts_per_tok`` of them);
* attention: 2 x 2 x heads x head_dim per (query row, key it sees) per layer (QK^T and
  PV), each row seeing the keys up to its position (within a sliding window where the
  layer has one, counted as if every layer had the model's window).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn
from transformers import PretrainedConfig

__all__ = ["StepFlops"]


class StepFlops:
    """The FLOPs of one step's forward for a model (its body's shapes read once)."""

    def __init__(self, model: nn.Module, config: PretrainedConfig, world: int = 1) -> None:
        body = getattr(model, "model", model)
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
        active = getattr(config, "num_experts_per_tok", 0) or 0
        weights = 0.0  # every matrix of the body but the embedding: linear layers, routers
        for name, module in body.named_modules():
            if isinstance(module, nn.Embedding):
                continue
            share = active / experts if experts and ".experts" in f".{name}" else 1.0
            matrices = (p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
            weights += sum(matrices) * share
        self.per_token = 2.0 * weights
        """Linear-layer FLOPs per token (this rank's share of a sharded model)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        heads = config.num_attention_heads // world
        self.per_key = 4.0 * heads * head_dim * config.num_hidden_layers
        """Attention FLOPs per (query row, key) pair over all layers."""
        self.window = getattr(config, "sliding_window", None) or 0

    def step(self, starts: Sequence[int], query_start_loc: Sequence[int]) -> float:
        """FLOPs of a step whose sequences' new rows start at positions ``starts`` and
        sit where ``query_start_loc`` says in the packed batch (``StepInputs``)."""
        rows = np.diff(np.asarray(query_start_loc, dtype=np.int64))
        keys = np.asarray(starts, dtype=np.int64) + rows
        # Row i of n new rows sees keys - n + i + 1 keys: n * keys - n (n - 1) / 2 in all.
        pairs = rows * keys - rows * (rows - 1) // 2
        if self.window:  # an upper bound on what a windowed row can see
            pairs = np.minimum(pairs, rows * self.window)
        return self.per_token * float(rows.sum()) + self.per_key * float(pairs.sum())
