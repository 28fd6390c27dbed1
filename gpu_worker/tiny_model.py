"""Deterministic tiny random-weight checkpoints: expeditor's embedded default model.

``make_tiny_model(path, arch=..., seed=..., size=...)`` writes an ordinary Hugging Face checkpoint
directory (``config.json``, ``model.safetensors`` in float32, ``generation_config.json``,
``tokenizer.json`` + ``tokenizer_config.json``) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load offline, so everything in expeditor runs with no download.

Sizes (:data:`PRESETS`): ``tiny``, the default (2 layers, hidden 64, 4 heads / 2 KV heads of
16, MLP 128; 115k parameters, a forward step costs next to nothing, so benchmarks on it
measure overheads) and ``small`` (4 layers, hidden 256, 8 heads / 2 KV heads of 32, MLP 1024;
3.97M parameters, 16 MB, a forward step with some weight to it). Tokenizer, vocabulary and
init rules are shared.

Tokenizer: byte-level, one token per UTF-8 byte (GPT-2 byte-to-unicode alphabet, no merges),
so any text round-trips exactly. Ids: ``<pad>`` 0, ``<s>`` 1 (BOS, prepended when encoding
with special tokens), ``</s>`` 2 (EOS), byte ``b`` is id ``3 + b``; the model's vocab_size
is 320 (ids 259..319 are unused padding). One exception: transformers 5 always loads a
``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, which NFC-normalizes its input, so for
``qwen2`` (only) text round-trips up to NFC normalization; tokenizer.json says so too, so every
reader of that checkpoint tokenizes alike. A minimal chat template ("role: content" lines) is
included for chat endpoints.

Weights (all float32, drawn from a private ``torch.Generator`` seeded with ``seed`` in
sorted parameter-name order, so the same (arch, seed, size) gives byte-identical safetensors and the
global torch RNG is untouched; llama and mistral have the same parameters, so they get the
same weights and, with no sliding window, compute the same function):

* ``embed_tokens``: N(0, 1), so the residual stream starts at unit scale;
* every projection (q/k/v/o, gate/up/down): N(0, 1/sqrt(fan_in)) (LeCun-normal, gain 1.0),
  which keeps activations at unit scale, so attention is neither uniform nor one-hot and the
  output really depends on the context (a paged-attention or KV-cache bug changes tokens);
* norm weights (RMSNorm, Qwen3 q/k norms): 1 + N(0, 0.1), so a weight that is not loaded
  shows; Qwen2 q/k/v biases: N(0, 0.1);
* ``lm_head``: N(0, 8/sqrt(hidden_size)): after the final RMSNorm the logits have a standard
  deviation of about 7-8, so the median top-1 / top-2 gap is about 2 logits; the rows of
  ``<pad>``, ``<s>`` and the unused ids are zero (logit 0, below the best byte logit), so
  greedy decoding only emits bytes and ``</s>``; ``small`` scales the ``</s>`` row by 0.8
  (``Preset.eos_logit_scale``, see below).

How the scales were chosen (llama, qwen2, qwen3; seeds 0-3; 8 prompts): greedy decoding of
20 tokens gives >= 4 distinct tokens in 95 of 96 runs (median 18 distinct; at seed 0 every
arch gives 18-37 distinct tokens in 40 for every prompt, and a transient 2-cycle escapes
because the context matters); replacing all but the last token of a 48-token context changes
the argmax ~58% of the time; about 16% of positions have a top-1 / top-2 gap below 0.5; a
relative 1e-3 perturbation of every weight leaves 58 of 72 40-token greedy continuations
unchanged. Projection gain 1.5 is more context-sensitive (94%) but less robust (47 of 72);
gain 0.5 is nearly context-blind (~10%) and cycles sooner.

The same rules at the ``small`` sizes (llama, qwen2, qwen3; seeds 0-2; 8 prompts): replacing
the context changes the argmax 67-91% of the time, the median top-1 / top-2 gap is 1.5-2.9
logits, and greedy decoding of 20 tokens gives >= 4 distinct tokens in 70 of 72 runs
(median 15; the other two repeat one byte). Being more context-sensitive it wanders more,
and with the ``</s>`` row at full scale 16 of 96 40-token continuations (seeds 0-3) ended
early, one after 2 tokens (llama seed 0, "Hello, world!"); at 0.8 it is 5 of 96, none before
7 tokens (``tiny``: 4 of 96).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.paths import cache_dir

ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "olmo2",
    "granite",
)
"""``--arch`` names; ``gemma3`` is Gemma 3's text model (model_type ``gemma3_text``)."""

#: Bumped whenever the generated files change, so cached default models are rebuilt.
FORMAT_VERSION = 2
#: Written last inside a finished checkpoint; its presence means the directory is complete.
MARKER_NAME = ".expeditor-tiny-model.json"

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
BYTE_OFFSET = NUM_SPECIAL
VOCAB_SIZE = 320  # multiple of 64 holding 3 specials + 256 bytes


@dataclass(frozen=True)
class Preset:
    """The sizes of one checkpoint preset (vocabulary, tokenizer and init rules are shared)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eos_logit_scale: float = 1.0  # the ``</s>`` row of lm_head is scaled by this


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "small": Preset(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=1024,
        eos_logit_scale=0.8,
    ),
}
SIZES = tuple(PRESETS)
DEFAULT_SIZE = "tiny"

MAX_POSITIONS = 2048
ROPE_THETA = 10000.0
SLIDING_WINDOW = 22
"""Keys a sliding-window layer sees (mistral, qwen2, gemma2, gemma3): short, and not a
multiple of any block size the tests use, so that tests exceed it and it ends inside
blocks."""
ATTN_SOFTCAP = 5.0
"""Gemma 2's attention-logit soft-capping; low enough to change scores of unit-scale
activations (the real checkpoints' 50 would barely touch them)."""
FINAL_SOFTCAP = 20.0
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2

EMBED_STD = 1.0
PROJ_GAIN = 1.0  # projection std = PROJ_GAIN / sqrt(fan_in)
NORM_JITTER = 0.1
BIAS_STD = 0.1
LOGIT_STD = 8.0  # lm_head std = LOGIT_STD / sqrt(hidden_size)

DEFAULT_ARCH = "llama"
GEMMA_ARCHS = ("gemma2", "gemma3")
DEFAULT_SEED = 0

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _build_tokenizer(arch: str = DEFAULT_ARCH) -> Any:
    """The byte-level ``tokenizers.Tokenizer`` (no merges: one token per UTF-8 byte).

    For ``qwen2`` the text is NFC-normalized first: transformers 5 always loads a ``qwen2``
    checkpoint's tokenizer as ``Qwen2Tokenizer``, which rebuilds the pipeline with an NFC
    normalizer (ignoring the one in tokenizer.json), so tokenizer.json says the same to keep
    every reader of the checkpoint consistent.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    for byte, char in _bytes_to_unicode().items():
        vocab[char] = BYTE_OFFSET + byte
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


def _config(arch: str, size: str) -> Any:
    """The transformers config object of ``arch`` with the sizes of the preset ``size``."""
    import transformers

    preset = PRESETS[size]
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    config: transformers.PretrainedConfig
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        # Layers from max_window_layers on slide: layer 0 global, the rest windowed.
        config = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1
        )
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    elif arch == "gemma2":
        config = transformers.Gemma2Config(
            **common,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=preset.head_dim,
            attn_logit_softcapping=ATTN_SOFTCAP,
            final_logit_softcapping=FINAL_SOFTCAP,
        )
    elif arch == "gemma3":
        layers = ["sliding_attention", "full_attention"] * (preset.num_layers // 2)
        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=preset.head_dim,
            layer_types=layers,
            final_logit_softcapping=FINAL_SOFTCAP,
        )
    elif arch == "phi3":
        config = transformers.Phi3Config(**common)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_local_experts=NUM_EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN
        )
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            moe_intermediate_size=preset.intermediate_size,
        )
    elif arch == "olmo2":
        config = transformers.Olmo2Config(**common)
    elif arch == "granite":
        config = transformers.GraniteConfig(
            **common,
            embedding_multiplier=2.0,
            attention_multiplier=1.5 / preset.head_dim**0.5,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForCausalLM"]
    config.dtype = "float32"
    return config


def _init_tensor(
    name: str, shape: tuple[int, ...], generator: Any, preset: Preset, arch: str = DEFAULT_ARCH
) -> Any:
    """One parameter, drawn from ``generator`` by the rules in the module docstring."""
    import torch

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    gemma = arch in GEMMA_ARCHS
    if name.endswith("embed_tokens.weight"):
        # Gemma multiplies embeddings by sqrt(hidden_size): keep the stream at unit scale.
        return normal(EMBED_STD / shape[1] ** 0.5 if gemma else EMBED_STD)
    if name.endswith("lm_head.weight"):
        weight = normal(LOGIT_STD / shape[1] ** 0.5)
        weight[PAD_ID] = 0.0
        weight[BOS_ID] = 0.0
        weight[EOS_ID] *= preset.eos_logit_scale
        weight[BYTE_OFFSET + 256 :] = 0.0
        return weight
    if name.endswith("norm.weight"):
        # Gemma's RMSNorm scales by (1 + weight).
        return normal(NORM_JITTER) if gemma else 1.0 + normal(NORM_JITTER)
    if name.endswith(".bias"):
        return normal(BIAS_STD)
    if name.endswith(".weight") and len(shape) == 2:
        return normal(PROJ_GAIN / shape[1] ** 0.5)
    if len(shape) == 3:  # stacked experts, [experts, out, in]
        return normal(PROJ_GAIN / shape[2] ** 0.5)
    raise ValueError(f"no init rule for parameter {name} {shape}")


def _state_dict(config: Any, seed: int, preset: Preset) -> dict[str, Any]:
    """Seeded random weights for every parameter of the model ``config`` describes."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    arch = next((a for a in ARCHS if _config_arch(config) == a), DEFAULT_ARCH)
    return {
        name: _init_tensor(name, shapes[name], generator, preset, arch) for name in sorted(shapes)
    }


def _config_arch(config: Any) -> str:
    return "gemma3" if config.model_type == "gemma3_text" else config.model_type


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_checkpoint(directory: Path, arch: str, seed: int, size: str) -> None:
    """Write every file of the checkpoint into the (empty) ``directory``, marker last."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config = _config(arch, size)
    config.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(directory)
    save_file(
        _state_dict(config, seed, PRESETS[size]),
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    _build_tokenizer(arch).save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    for file in directory.iterdir():
        file.chmod(0o644)  # safetensors creates its file 0600
        _fsync(file)
    _write_json(
        directory / MARKER_NAME,
        {"arch": arch, "seed": seed, "size": size, "format_version": FORMAT_VERSION},
    )
    _fsync(directory / MARKER_NAME)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of a complete tiny model at ``path`` ({arch, seed, size, ...}), or None."""
    try:
        data = json.loads((Path(path) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_tiny_model(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint written by :func:`make_tiny_model`."""
    return read_marker(path) is not None


def _is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and next(path.iterdir(), None) is None
    except OSError:
        return False


def _staging_dir(target: Path) -> Path:
    """A fresh directory next to ``target`` (same filesystem, so the final rename is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staging.chmod(0o755)
    return staging


def _move_aside(target: Path) -> None:
    """Rename ``target`` out of the way and delete it (no error if it is already gone)."""
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.replace(target, trash / target.name)
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = DEFAULT_ARCH,
    seed: int = DEFAULT_SEED,
    size: str = DEFAULT_SIZE,
) -> Path:
    """Write the ``arch`` checkpoint of the preset ``size`` seeded by ``seed`` to ``path``.

    The files are built in a temporary directory next to ``path`` and renamed into place, so
    a half-written model is never visible. ``path`` may be absent, an empty directory or an
    earlier tiny model (replaced); anything else raises FileExistsError. Returns the absolute
    path.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    _check_size(size)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    target = Path(path).absolute()
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        if not _is_empty_dir(target) and not is_tiny_model(target):
            raise FileExistsError(f"{target} is a non-empty directory that is not a tiny model")
    staging = _staging_dir(target)
    try:
        _write_checkpoint(staging, arch, seed, size)
        if is_tiny_model(target):
            _move_aside(target)
        os.replace(staging, target)  # rename(2): atomic, and replaces an empty directory
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a no-op once renamed
    return target


def _check_size(size: str) -> None:
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")


def default_model_dir(size: str = DEFAULT_SIZE) -> Path:
    """The embedded model of the preset ``size`` (llama, seed 0), built on first use and cached.

    Lives in :func:`cache_dir` as ``{size}-llama-s0-v{FORMAT_VERSION}`` (the default:
    ``tiny-llama-s0-v1``) and is reused when a complete copy (marker present) is there.
    Processes racing to create it each build a staging copy; the first rename wins and the
    others use the winner's.
    """
    _check_size(size)
    target = cache_dir() / f"{size}-{DEFAULT_ARCH}-s{DEFAULT_SEED}-v{FORMAT_VERSION}"
    if is_tiny_model(target):
        return target
    staging = _staging_dir(target)
    try:
        _write_checkpoint(staging, DEFAULT_ARCH, DEFAULT_SEED, size)
        try:
            os.replace(staging, target)
        except OSError:
            if is_tiny_model(target):  # another process won the race
                return target
            # Something incomplete that is not ours (we only ever rename finished copies):
            # set it aside and try once more.
            _move_aside(target)
            try:
                os.replace(staging, target)
            except OSError:
                if not is_tiny_model(target):
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
