"""Tensor-parallel sharding of a loaded Hugging Face causal LM, in place (Megatron-style).

With tensor parallelism of degree N (the world size) every rank holds 1/N of each layer's
attention heads, KV heads and MLP width. Two forwards run over the shards: the lean
forward (:class:`gpu_worker.lean_model.LeanDecoder`, the one for the model types it
covers) reads the sharded weights and does the all-reduces below itself; for the other
types (or ``model_impl = "transformers"``) every rank runs transformers' own model code
unchanged, the all-reduces coming from the hooks this module registers:

* ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel, split by heads: rank r keeps the
  query heads ``[r*H/N, (r+1)*H/N)`` and the KV heads ``[r*K/N, (r+1)*K/N)`` (rows of the
  weight, and of the bias where there is one, e.g. qwen2's). Query head h uses KV head
  ``h // (H/K)`` (GQA), so a rank's query heads use exactly its own KV heads, and the ratio
  ``num_key_value_groups`` that the attention functions read is unchanged.
* ``o_proj`` is row-parallel: rank r keeps the input columns of its heads, so its output is
  a partial sum, and a forward hook all-reduces (sums) it over the group. A bias, if any,
  is taken off the ``Linear`` (kept as ``tp_bias``) and added once after the all-reduce
  (not N times).
* The MLP's ``gate_proj`` / ``up_proj`` are column-parallel (a slice of the intermediate
  dimension; the activation is elementwise, so it needs no communication) and
  ``down_proj`` is row-parallel plus the same all-reduce hook. That is two all-reduces per
  layer, the minimum for this layout.
* Everything else is replicated: the embedding, every norm (including the per-head q/k
  norms of qwen3 and gemma3, whose weight acts on head_dim and is the same for every
  head), rotary embeddings and ``lm_head``.

Attention reads the number of heads from the tensors: transformers' attention modules
reshape the projections with ``view(*input_shape, -1, head_dim)``, and expeditor's
attention (:mod:`gpu_worker.attention`) infers the heads from the query and the KV heads
from its per-layer cache, which the worker sizes with :func:`local_kv_heads`. Sliding
windows and attention-logit soft-capping (gemma2/gemma3) act per head and are unaffected.
In transformers 5.24 none of the supported attention/MLP forwards reads a head count or a
width from the module; the attributes that describe them (``num_heads``,
``num_key_value_heads``, ``intermediate_size``, where a module has them) are set to the
local values anyway, so that any code reading them sees the shard.

Why ``lm_head`` (and the embedding) stay replicated: every rank computes the full logits
from the same (all-reduced) hidden states, so every rank samples the same tokens with no
extra communication, and the sampler runs unchanged. The cost is memory: embedding and
head are a few percent of a large model's weights (Llama-3-8B: 2 x 525M of 8.0B
parameters; 70B: 2 x 1.05B of 70.6B), against the projections that are sharded. A
vocab-parallel head would save that memory but need an all-gather of the logits (or a
distributed argmax / softmax) at every step; a vocab-parallel embedding would need one
more all-reduce per step.

Supported model types (:data:`TP_ARCHS`) are those with separate q/k/v and gate/up/down
projections. Refused: phi3 (fused ``qkv_proj`` / ``gate_up_proj``, whose split would have
to interleave the parts), the mixtures of experts mixtral and qwen3_moe (experts would be
sharded differently), and olmo2 (its q/k RMSNorm normalizes over all heads at once, so a
rank's partial heads would be normalized by the wrong statistics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

__all__ = [
    "TP_ARCHS",
    "check_tp_supported",
    "local_kv_heads",
    "shard_model",
]

TP_ARCHS: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "granite",
)
"""model_types :func:`shard_model` can shard (separate q/k/v and gate/up/down projections,
per-head or no q/k norms)."""

_REFUSED: dict[str, str] = {
    "phi3": "its attention and MLP use fused qkv_proj / gate_up_proj projections",
    "mixtral": "it is a mixture-of-experts model (expert sharding is not implemented)",
    "qwen3_moe": "it is a mixture-of-experts model (expert sharding is not implemented)",
    "olmo2": "its q/k RMSNorm normalizes over all heads at once, not per head",
}

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _kv_heads(config: PretrainedConfig) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return int(kv) if kv else int(config.num_attention_heads)


def _head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def check_tp_supported(config: PretrainedConfig, world_size: int) -> None:
    """Raise ``ValueError`` naming the reason when ``config``'s model cannot be sharded
    over ``world_size`` ranks. A world size of 1 shards nothing and accepts any model."""
    if world_size < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    model_type = config.model_type
    if model_type not in TP_ARCHS:
        reason = _REFUSED.get(model_type, "its layout is not one tensor parallelism knows")
        raise ValueError(
            f"model type {model_type!r} cannot be sharded for tensor parallelism: {reason}; "
            f"tensor parallelism supports {', '.join(TP_ARCHS)}"
        )
    sizes = {
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": _kv_heads(config),
        "intermediate_size": int(config.intermediate_size),
    }
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(
                f"{name} = {size} of {model_type!r} is not divisible by the "
                f"tensor-parallel world size {world_size}"
            )


def local_kv_heads(config: PretrainedConfig, world_size: int) -> int:
    """The KV heads each rank holds (and caches) at tensor-parallel degree ``world_size``."""
    check_tp_supported(config, world_size)
    return _kv_heads(config) // world_size


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage. ``.contiguous()`` is not enough: a slice of
    rows is contiguous already, and the view would keep the whole tensor's storage alive."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _column_shard(linear: nn.Linear, rank: int, world_size: int) -> None:
    """Keep output rows ``[rank*out/N, (rank+1)*out/N)`` of the weight and of the bias."""
    rows = linear.out_features // world_size
    part = slice(rank * rows, (rank + 1) * rows)
    linear.weight = nn.Parameter(
        _own(linear.weight.data[part]), requires_grad=linear.weight.requires_grad
    )
    if linear.bias is not None:
        linear.bias = nn.Parameter(
            _own(linear.bias.data[part]), requires_grad=linear.bias.requires_grad
        )
    linear.out_features = rows


def _row_shard(
    linear: nn.Linear, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> None:
    """Keep input columns ``[rank*in/N, (rank+1)*in/N)`` and sum the partial outputs over
    ``group`` in a forward hook; a bias moves to ``tp_bias`` and is added after the sum."""
    cols = linear.in_features // world_size
    linear.weight = nn.Parameter(
        _own(linear.weight.data[:, rank * cols : (rank + 1) * cols]),
        requires_grad=linear.weight.requires_grad,
    )
    linear.in_features = cols
    bias = linear.bias
    if bias is not None:
        linear.register_parameter("bias", None)
        linear.tp_bias = bias  # registered as a parameter of the module, under a new name

    def all_reduce(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        tp_bias = getattr(module, "tp_bias", None)
        return output if tp_bias is None else output + tp_bias

    linear.register_forward_hook(all_reduce)


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    found = [getattr(module, name, None) for name in names]
    if all(isinstance(m, nn.Linear) for m in found):
        return found  # type: ignore[return-value]
    return None


def _set_if_present(module: nn.Module, name: str, value: int) -> None:
    if isinstance(getattr(module, name, None), int):
        setattr(module, name, value)


def shard_model(
    model: nn.Module,
    config: PretrainedConfig,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Shard ``model`` in place for ``rank`` of ``world_size`` (see the module docstring).

    The projection weights are replaced by new contiguous parameters holding the local
    slices, so the full tensors are freed once nothing else references them; the
    row-parallel projections get an all-reduce (sum over ``group``, the default group when
    None) as a forward hook. torch.distributed must be initialized with ``group``'s size
    equal to ``world_size`` and this process's rank in it equal to ``rank``. World size 1:
    nothing happens.
    """
    check_tp_supported(config, world_size)
    if world_size == 1:
        return
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the tensor-parallel world of {world_size}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tensor-parallel sharding needs an initialized torch.distributed")
    if dist.get_world_size(group) != world_size or dist.get_rank(group) != rank:
        raise ValueError(
            f"rank {rank} of {world_size} does not match the process group's rank "
            f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
        )
    heads, kv_heads = int(config.num_attention_heads), _kv_heads(config)
    head_dim, inter = _head_dim(config), int(config.intermediate_size)
    expected = {
        "q_proj": ("out_features", heads * head_dim),
        "k_proj": ("out_features", kv_heads * head_dim),
        "v_proj": ("out_features", kv_heads * head_dim),
        "o_proj": ("in_features", heads * head_dim),
        "gate_proj": ("out_features", inter),
        "up_proj": ("out_features", inter),
        "down_proj": ("in_features", inter),
    }
    attentions: list[nn.Module] = []
    mlps: list[nn.Module] = []
    for module in model.modules():
        if _linears(module, _ATTENTION) is not None:
            attentions.append(module)
        elif _linears(module, _MLP) is not None:
            mlps.append(module)
    layers = int(config.num_hidden_layers)
    if len(attentions) != layers or len(mlps) != layers:
        raise RuntimeError(
            f"found {len(attentions)} attention and {len(mlps)} MLP modules with separate "
            f"projections in {type(model).__name__}, expected {layers} of each"
        )
    # Check every shape before changing anything: a model sharded already (or laid out
    # differently) is refused whole rather than left half-sharded.
    for modules, names in ((attentions, _ATTENTION), (mlps, _MLP)):
        for module in modules:
            for name in names:
                attr, size = expected[name]
                actual = getattr(getattr(module, name), attr)
                if actual != size:
                    raise RuntimeError(
                        f"{name}.{attr} is {actual}, expected {size} from the config "
                        "(already sharded, or a layout this module does not know)"
                    )
    for attn in attentions:
        for name in ("q_proj", "k_proj", "v_proj"):
            _column_shard(getattr(attn, name), rank, world_size)
        _row_shard(attn.o_proj, rank, world_size, group)  # type: ignore[arg-type]
        _set_if_present(attn, "num_heads", heads // world_size)
        _set_if_present(attn, "num_attention_heads", heads // world_size)
        _set_if_present(attn, "num_key_value_heads", kv_heads // world_size)
    for mlp in mlps:
        _column_shard(mlp.gate_proj, rank, world_size)  # type: ignore[arg-type]
        _column_shard(mlp.up_proj, rank, world_size)  # type: ignore[arg-type]
        _row_shard(mlp.down_proj, rank, world_size, group)  # type: ignore[arg-type]
        _set_if_present(mlp, "intermediate_size", inter // world_size)
