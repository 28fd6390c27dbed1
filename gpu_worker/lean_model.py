"""The forward of the Llama family: the same function as transformers' model code, in a
fraction of the operations, on every device and at every tensor-parallel degree.

Like vLLM and mini-sglang, the worker picks a model implementation by model type, never
by device: checkpoints of :data:`LEAN_TYPES` run :class:`LeanDecoder` on CPU and CUDA,
alone or sharded over a tensor-parallel group; the rest run transformers' modules (the
fallback, like vLLM's Transformers backend), and ``model_impl = "transformers"`` forces
those for any checkpoint. :func:`why_not_lean` says why a checkpoint is left to them.

A small model's step is mostly per-operation overhead (on a CPU, and on CUDA whenever a
step is not captured in a graph): transformers' decoder layer is some sixty tensor
operations and a dozen module calls, each a few microseconds whatever the batch.
:class:`LeanDecoder` computes the same layers with about twenty:

* q, k and v come from one matmul over the three weights side by side, and so do the
  MLP's gate and up projections (the module's own weights become views of the fused
  ones, so nothing is held twice and transformers' forward still reads them); in
  bfloat16 on a CPU every projection's weight is then reordered once for oneDNN
  (:mod:`gpu_worker.packed_linear`: F.linear's products, without a reorder per call)
  and the modules' own weights are released (left on the meta device, their shapes
  kept): transformers' forward cannot run that model, and is not run;
* the rotary embedding's cos/sin are computed once per step, and q and k rotate
  together as one [tokens, heads + kv_heads, head_dim] view;
* the elementwise operations (residual add with RMSNorm, rotary, SiLU-gated product)
  are :mod:`gpu_worker.layer_ops`': transformers' own sequences in torch, or in bfloat16
  on a CPU one pass each in C;
* no modules, masks or output objects: plain functions over the weights, and no host
  reads, so a decode step's forward is captured whole in a CUDA graph
  (:mod:`gpu_worker.cuda_graphs` captures whatever forward the runner runs).

Each operation is the one transformers runs (RMSNorm in float32 as
``pow -> mean -> rsqrt``, ``q * cos + rotate_half(q) * sin``, SiLU-gated MLP,
residual adds; the C passes round where those round), so the outputs agree up to float
rounding of the fused matmuls; the oracle tests compare its greedy tokens with
transformers'.

Tensor parallelism: :func:`gpu_worker.tensor_parallel.shard_model` has already left
each module holding the rank's shard (q/k/v and gate/up column-parallel, o and down
row-parallel, a row-parallel bias moved to ``tp_bias``), and the decoder reads its
head counts and MLP width from those weights. The fused weights are then the rank's
heads and MLP slice; after the o and the down projections it sums the partial outputs
over the group (``all_reduce``) and adds a row-parallel bias once, after the sum, as
the modules' hooks do for transformers' forward (which the lean forward does not call).
Every rank ends each layer with the same full hidden states.

Which checkpoints: model types :data:`LEAN_TYPES` (Llama; Mistral's window on every
layer; Qwen2's q/k/v biases and windowed layers; Qwen3's per-head q/k norms), SiLU MLPs,
a rotary embedding whose frequencies do not depend on the sequence (not ``dynamic`` or
``longrope``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from transformers import PretrainedConfig

from gpu_worker.attention import StepMetadata, attend
from gpu_worker.kernels.attention_args import AttentionParams, layer_params
from gpu_worker.layer_ops import Norm, TorchOps, choose_ops, rms_norm
from gpu_worker.packed_linear import linear, pack, why_not_packed

__all__ = ["LEAN_TYPES", "PROJECTIONS", "LeanDecoder", "why_not_lean"]

LEAN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose layers :class:`LeanDecoder` computes."""
PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""A layer's projection weights (fields of its ``_Layer``): what is reordered for oneDNN."""


@dataclass(slots=True)
class _Layer:
    input_norm: Norm
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: Norm | None
    k_norm: Norm | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: Norm
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    attention: AttentionParams
    """Its scale and window (no soft-capping in these models)."""


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` side by side; each linear's own parameters
    become views of it."""
    weight = torch.cat([module.weight.detach() for module in linears])
    biases = [module.bias for module in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach() if b is not None else weight.new_zeros(module.out_features)
                for b, module in zip(biases, linears, strict=True)
            ]
        )
    row = 0
    for module in linears:
        rows = module.out_features
        module.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if module.bias is not None and bias is not None:
            module.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


def _norm(module: nn.Module) -> Norm:
    return Norm(module.weight.detach(), float(module.variance_epsilon))


def _bias(module: nn.Module) -> torch.Tensor | None:
    """A projection's bias: a row-parallel one is ``tp_bias`` once sharded."""
    bias = getattr(module, "tp_bias", None)
    if bias is None:
        bias = module.bias
    return None if bias is None else bias.detach()


def why_not_lean(model: nn.Module, config: PretrainedConfig) -> str | None:
    """Why :class:`LeanDecoder` cannot compute ``model`` (None: it can)."""
    if config.model_type not in LEAN_TYPES:
        return f"model type {config.model_type!r} (lean: {', '.join(LEAN_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    rope_type = str(getattr(rotary, "rope_type", ""))
    if rotary is None or "dynamic" in rope_type or rope_type == "longrope":
        return f"rope type {rope_type or 'unknown'!r} (its frequencies follow the length)"
    return None


class LeanDecoder:
    """``decoder(input_ids [T], positions [T], meta) -> hidden [T, hidden]``: the base
    model's forward (embedding, layers, final norm) over a packed step. ``group``: the
    tensor-parallel group ``model`` is sharded over (None: one rank, unsharded)."""

    def __init__(
        self,
        model: nn.Module,
        config: PretrainedConfig,
        group: ProcessGroup | None = None,
        *,
        pack_weights: bool = True,
        native_ops: bool = True,
    ) -> None:
        reason = why_not_lean(model, config)
        if reason is not None:
            raise ValueError(f"no lean forward for this checkpoint: {reason}")
        base = model.model  # type: ignore[attr-defined]
        world = dist.get_world_size(group) if group is not None else 1
        self.group: ProcessGroup | None = group if world > 1 else None
        """Where the row-parallel projections' partial sums are all-reduced."""
        self.embed: torch.Tensor = base.embed_tokens.weight.detach()
        self.head_dim: int = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        # This rank's heads and MLP width, from its (sharded) weights.
        attn, mlp = base.layers[0].self_attn, base.layers[0].mlp
        self.num_heads: int = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads: int = attn.k_proj.out_features // self.head_dim
        self.intermediate: int = mlp.gate_proj.out_features
        full = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
        local = (self.num_heads, self.num_kv_heads, self.intermediate)
        if tuple(n * world for n in local) != full:
            raise ValueError(
                f"heads, KV heads and MLP width {local} on each of {world} rank(s) do not "
                f"make the checkpoint's {full}: shard the model over the group first"
            )
        rotary = base.rotary_emb
        self.inv_freq: torch.Tensor = rotary.inv_freq.detach().float()
        self.rope_scaling = float(rotary.attention_scaling)
        self.norm = _norm(base.norm)
        self.layers = [self._layer(layer, config) for layer in base.layers]
        self.unpacked: str | None = (
            why_not_packed(self.embed.dtype, self.embed.device) if pack_weights else "not asked"
        )
        """Why the projections' weights stay dense (None: reordered for oneDNN)."""
        self.ops, self.ops_note = (
            choose_ops(self.embed.dtype, self.embed.device) if native_ops else (TorchOps(), None)
        )
        """The elementwise operations (:mod:`gpu_worker.layer_ops`), and what the log
        says of them (None: nothing)."""
        if self.unpacked is None:
            for lean, layer in zip(self.layers, base.layers, strict=True):
                self._pack(lean, layer)

    @staticmethod
    def _pack(lean: _Layer, layer: nn.Module) -> None:
        """Reorder a layer's projection weights for oneDNN and release the modules' own
        (one layer at a time: at most one layer's weights are held twice)."""
        for name in PROJECTIONS:
            setattr(lean, name, pack(getattr(lean, name)))
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *mlp.children()):
            if isinstance(module, nn.Linear):
                meta = torch.empty_like(module.weight, device="meta")
                module.weight = nn.Parameter(meta, requires_grad=False)

    def projection_weights(self) -> list[torch.Tensor]:
        """Every layer's :data:`PROJECTIONS` weights (dense, or reordered for oneDNN)."""
        return [getattr(layer, name) for layer in self.layers for name in PROJECTIONS]

    @staticmethod
    def _layer(layer: nn.Module, config: PretrainedConfig) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        # Qwen2/3 say per layer (None on full-attention layers); Mistral in its config.
        window = (
            attn.sliding_window
            if hasattr(attn, "sliding_window")
            else getattr(config, "sliding_window", None)
        )
        return _Layer(
            input_norm=_norm(layer.input_layernorm),
            qkv=qkv,
            qkv_bias=qkv_bias,
            q_norm=_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
            k_norm=_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
            o=attn.o_proj.weight.detach(),
            o_bias=_bias(attn.o_proj),
            post_norm=_norm(layer.post_attention_layernorm),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=mlp.down_proj.weight.detach(),
            down_bias=_bias(mlp.down_proj),
            attention=layer_params(float(attn.scaling), window or None, None),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, head_dim] of the positions, as transformers computes them."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def _row_parallel(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """A row-parallel projection: the rank's partial product, summed over the group,
        then the bias (once); a plain linear on one rank."""
        if self.group is None:
            return linear(x, weight, bias)
        out = linear(x, weight)
        dist.all_reduce(out, group=self.group)
        return out if bias is None else out + bias

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rotated = heads + kv_heads
        cos, sin = self.rotary(positions, x.dtype)
        ops, residual = self.ops, None
        for index, layer in enumerate(self.layers):
            x, h = ops.add_rms_norm(x, residual, layer.input_norm)
            qkv = linear(h, layer.qkv, layer.qkv_bias).view(tokens, rotated + kv_heads, head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat(
                    (
                        rms_norm(qkv[:, :heads], layer.q_norm),
                        rms_norm(qkv[:, heads:rotated], layer.k_norm),
                    ),
                    dim=1,
                )
            else:
                qk = qkv[:, :rotated]
            qk = ops.rotate(qk, cos, sin)
            out = attend(
                meta, index, qk[:, :heads], qk[:, heads:], qkv[:, rotated:], layer.attention
            )
            o = self._row_parallel(out.reshape(tokens, heads * head_dim), layer.o, layer.o_bias)
            x, h = ops.add_rms_norm(x, o, layer.post_norm)
            gate_up = linear(h, layer.gate_up, layer.gate_up_bias)
            h = ops.silu_mul(gate_up, self.intermediate)
            residual = self._row_parallel(h, layer.down, layer.down_bias)
        return ops.add_rms_norm(x, residual, self.norm)[1]
