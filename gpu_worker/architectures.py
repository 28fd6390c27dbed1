"""The checkpoint architectures expeditor runs, and what it needs to know of each.

transformers' own model code runs the forward (expeditor plugs its paged attention into
the attention interface, :mod:`gpu_worker.attention`), so an architecture is supported
when everything it passes through that interface is implemented: scaling, a per-layer
sliding window (``layer_types`` / ``sliding_window``), attention-logit soft-capping.
What the forward's head does after the hidden states (final-logit soft-capping, logit
scaling) is applied here, because the runner computes logits only for the rows it
samples. Anything else is refused with the reason before a weight is loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from gpu_worker.kv_cache import LayerGroups

__all__ = ["SUPPORTED", "check_supported", "logits_fn"]

SUPPORTED: dict[str, str] = {
    "llama": "the baseline: RoPE, GQA, SwiGLU",
    "mistral": "Llama's layout with a sliding window on every layer",
    "qwen2": "q/k/v biases; a sliding window on the layers from max_window_layers on",
    "qwen3": "per-head q/k RMSNorm",
    "gemma2": "alternating sliding-window and global layers, attention-logit and "
    "final-logit soft-capping, query_pre_attn_scalar scaling, sandwich norms",
    "gemma3_text": "Gemma 3's text model: sliding and global layers by layer_types, "
    "local and global RoPE bases, q/k norms",
    "phi3": "fused qkv and gate_up projections",
    "mixtral": "mixture of experts (top-k routing)",
    "qwen3_moe": "mixture of experts with q/k norms",
    "olmo2": "post-norms and q/k norms over the whole projection",
    "granite": "embedding, attention, residual and logit multipliers",
}
"""model_type -> what it exercises (docs/architecture.md lists the same)."""

ATTENTION_TYPES = ("full_attention", "sliding_attention")

WINDOWED_TYPES = frozenset(
    {"mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"}
)
"""Model types whose attention modules pass ``config.sliding_window`` on (per
``layer_types`` where they read it); the others (llama, olmo2, granite) attend over the
whole context whatever their config.json says."""


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``ValueError`` naming the reason when ``config`` is not something expeditor
    runs (before any weight is loaded)."""
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model type {model_type!r} is an encoder-decoder model; expeditor serves "
            "decoder-only language models"
        )
    if model_type not in SUPPORTED:
        hint = ""
        if (
            getattr(config, "text_config", None) is not None
            or getattr(config, "vision_config", None) is not None
        ):
            hint = (
                " (a multimodal checkpoint: expeditor takes no image or audio input; a "
                "text-only checkpoint of the same family may be supported)"
            )
        raise ValueError(
            f"model type {model_type!r} is not supported{hint}; expeditor runs "
            f"{', '.join(SUPPORTED)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    unknown = sorted(set(layer_types) - set(ATTENTION_TYPES))
    if unknown:
        raise ValueError(
            f"attention layer type(s) {', '.join(unknown)} of {model_type!r} are not "
            f"implemented by expeditor's kernels ({', '.join(ATTENTION_TYPES)} are)"
        )


def layer_windows(config: PretrainedConfig) -> list[int]:
    """Per layer, the keys its attention reads back from a query's position: the
    sliding window of a windowed layer (``layer_types`` says which, else every layer
    of a config with ``sliding_window``, for :data:`WINDOWED_TYPES` only), 0 for a
    layer that reads the whole context."""
    layers = int(config.num_hidden_layers)
    if config.model_type not in WINDOWED_TYPES:
        return [0] * layers
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None) if window else None
    if types:
        return [window if kind == "sliding_attention" else 0 for kind in types]
    return [window] * layers


def kv_window(config: PretrainedConfig) -> int:
    """Keys any layer reads at most back from a query's position when every layer is
    windowed (the largest window), else 0: what the scheduler may release behind."""
    windows = layer_windows(config)
    return max(windows) if windows and min(windows) > 0 else 0


def layer_groups(config: PretrainedConfig) -> LayerGroups | None:
    """The cache's layer groups for a model that mixes windowed and full-attention
    layers (None for one that does not): the full layers in groups, then the windowed
    ones, each group as many layers as the fewer kind has (the last of a kind padded
    with unused slots), so every block holds the same bytes. A windowed group's window
    is the largest of the model's."""
    windows = layer_windows(config)
    full = [layer for layer, window in enumerate(windows) if not window]
    windowed = [layer for layer, window in enumerate(windows) if window]
    if not full or not windowed:
        return None
    size = min(len(full), len(windowed))
    groups: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(windows)
    for members, window in ((full, 0), (windowed, max(windows))):
        for start in range(0, len(members), size):
            for slot, layer in enumerate(members[start : start + size]):
                where[layer] = (len(groups), slot)
            groups.append(window)
    return LayerGroups(tuple(groups), tuple(where))


def logits_fn(
    model: torch.nn.Module, config: PretrainedConfig
) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden rows -> logits, as the model's own causal-LM head computes them."""
    head = model.get_output_embeddings()
    cap = getattr(config, "final_logit_softcapping", None)
    scaling = getattr(config, "logits_scaling", None)  # Granite divides by it
    if cap:

        def capped(hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(head(hidden) / cap) * cap

        return capped
    if scaling and scaling != 1.0:

        def scaled(hidden: torch.Tensor) -> torch.Tensor:
            return head(hidden) / scaling

        return scaled
    return head
