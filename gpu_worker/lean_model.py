"""A lean forward for the Llama family on the CPU path: the same function as
transformers' model code, in a fraction of the operations.

On a CPU a small model's step is mostly per-operation overhead: transformers' decoder
layer is some sixty tensor operations and a dozen module calls, each a few microseconds
whatever the batch. :class:`LeanDecoder` computes the same layers with about twenty:

* q, k and v come from one matmul over the three weights side by side, and so do the
  MLP's gate and up projections (the module's own weights become views of the fused
  ones, so nothing is held twice and transformers' forward still reads them);
* the rotary embedding's cos/sin are computed once per step, and q and k rotate
  together as one [tokens, heads + kv_heads, head_dim] view;
* no modules, masks or output objects: plain functions over the weights.

Each operation is the one transformers runs (RMSNorm in float32 as
``pow -> mean -> rsqrt``, ``q * cos + rotate_half(q) * sin``, SiLU-gated MLP,
residual adds), so the outputs agree up to float rounding of the fused matmuls; the
oracle tests compare its greedy tokens with transformers'.

Which checkpoints (:func:`why_not_lean` says why not, and the runner then keeps
transformers' forward): model types :data:`LEAN_TYPES` (Llama; Mistral's window on every
layer; Qwen2's q/k/v biases and windowed layers; Qwen3's per-head q/k norms), SiLU MLPs,
a rotary embedding whose frequencies do not depend on the sequence (not ``dynamic`` or
``longrope``), one rank (tensor parallelism shards transformers' modules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from gpu_worker.attention import StepMetadata, attend

__all__ = ["LEAN_TYPES", "LeanDecoder", "why_not_lean"]

LEAN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose layers :class:`LeanDecoder` computes."""


@dataclass(slots=True)
class _Norm:
    weight: torch.Tensor
    eps: float


@dataclass(slots=True)
class _Layer:
    input_norm: _Norm
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: _Norm | None
    k_norm: _Norm | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: _Norm
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    scaling: float
    window: int | None


def _rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    """transformers' RMSNorm, operation for operation (in float32, back to x's dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x.to(dtype)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` side by side; each linear's own parameters
    become views of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach() if b is not None else weight.new_zeros(linear.out_features)
                for b, linear in zip(biases, linears, strict=True)
            ]
        )
    row = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if linear.bias is not None and bias is not None:
            linear.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


def _norm(module: nn.Module) -> _Norm:
    return _Norm(module.weight.detach(), float(module.variance_epsilon))


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
    model's forward (embedding, layers, final norm) over a packed step."""

    def __init__(self, model: nn.Module, config: PretrainedConfig) -> None:
        reason = why_not_lean(model, config)
        if reason is not None:
            raise ValueError(f"no lean forward for this checkpoint: {reason}")
        base = model.model  # type: ignore[attr-defined]
        self.embed: torch.Tensor = base.embed_tokens.weight.detach()
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.intermediate: int = config.intermediate_size
        rotary = base.rotary_emb
        self.inv_freq: torch.Tensor = rotary.inv_freq.detach().float()
        self.rope_scaling = float(rotary.attention_scaling)
        self.norm = _norm(base.norm)
        self.layers = [self._layer(layer, config) for layer in base.layers]

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
            o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            post_norm=_norm(layer.post_attention_layernorm),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=mlp.down_proj.weight.detach(),
            down_bias=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
            scaling=float(attn.scaling),
            window=window or None,
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, head_dim] of the positions, as transformers computes them."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        rotated = heads + kv_heads
        half = head_dim // 2
        cos, sin = self.rotary(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(tokens, rotated + kv_heads, head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat(
                    (
                        _rms_norm(qkv[:, :heads], layer.q_norm),
                        _rms_norm(qkv[:, heads:rotated], layer.k_norm),
                    ),
                    dim=1,
                )
            else:
                qk = qkv[:, :rotated]
            turned = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + turned * sin
            out = attend(
                meta,
                index,
                qk[:, :heads],
                qk[:, heads:],
                qkv[:, rotated:],
                layer.scaling,
                layer.window,
            )
            x = x + F.linear(out.reshape(tokens, heads * head_dim), layer.o, layer.o_bias)
            h = _rms_norm(x, layer.post_norm)
            gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)
            h = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
            x = x + F.linear(h, layer.down, layer.down_bias)
        return _rms_norm(x, self.norm)
