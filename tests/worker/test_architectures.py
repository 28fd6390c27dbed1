"""The architectures beyond the Llama layout: their tiny checkpoints, the refusals for
what stays unsupported, the model heads' logit post-processing, and greedy output
through `expeditor serve` equal to transformers (the in-process oracle for every arch
is tests/e2e/test_oracle.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from support.hf_reference import hf_greedy
from support.serve import generate_all
from transformers import AutoConfig, AutoModelForCausalLM

from expeditor.llm import LLM
from gpu_worker import tiny_model
from gpu_worker.architectures import (
    SUPPORTED,
    check_supported,
    kv_window,
    layer_groups,
    layer_windows,
)
from gpu_worker.lean_model import LeanDecoder
from gpu_worker.model_runner import ModelRunner
from gpu_worker.tiny_model import ARCHS, make_tiny_model
from scheduler_svc.launch import running_server
from shared.sampling import SamplingParams
from shared.worker_settings import WorkerSettings

NEW_ARCHS = ("gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "olmo2", "granite")
WINDOWED = {"mistral": [1, 1], "qwen2": [0, 1], "gemma2": [1, 0], "gemma3": [1, 0]}
"""Arch -> per layer: 1 where the tiny checkpoint's layer has a sliding window."""
MAX_TOKENS = 10
PROMPTS = [
    [1, *range(40, 90)],  # 51 tokens + 10 generated: well past the 22-token window
    [1, 72, 101, 108, 108, 111],
    [1, *range(200, 230)],
]


@pytest.fixture(scope="module", params=NEW_ARCHS)
def built(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]):
    arch = request.param
    path = tiny_checkpoint(arch)
    return arch, path, AutoModelForCausalLM.from_pretrained(path).eval()


def test_every_arch_is_supported_and_its_checkpoint_complete(built, tmp_path: Path) -> None:
    arch, path, model = built
    config = model.config
    assert config.model_type == ("gemma3_text" if arch == "gemma3" else arch)
    assert config.model_type in SUPPORTED
    check_supported(config)
    weights = load_file(path / "model.safetensors")
    assert set(weights) == set(model.state_dict())  # nothing left at its init
    assert all(t.dtype == torch.float32 for t in weights.values())
    again = make_tiny_model(tmp_path / "again", arch=arch)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert json.loads((path / tiny_model.MARKER_NAME).read_text())["arch"] == arch
    if arch == "gemma2":
        assert config.attn_logit_softcapping == tiny_model.ATTN_SOFTCAP
        assert config.final_logit_softcapping == tiny_model.FINAL_SOFTCAP
    if arch in ("mixtral", "qwen3_moe"):
        assert any(len(t.shape) == 3 for t in weights.values())  # stacked experts


def test_greedy_generation_is_not_degenerate(built) -> None:
    _arch, _path, model = built
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)
        new = out[0, len(prompt) :].tolist()
        assert len(set(new)) >= 4, (prompt, new)
        assert all(token == 2 or 3 <= token < 259 for token in new)


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_windows_are_on_where_declared_and_change_the_output(
    arch: str, tmp_path: Path
) -> None:
    path = make_tiny_model(tmp_path / arch, arch=arch)
    config = AutoConfig.from_pretrained(path)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * 2
    assert [int(t == "sliding_attention") for t in layer_types] == WINDOWED[arch]
    assert config.sliding_window == tiny_model.SLIDING_WINDOW
    # The window matters for these prompts: without it transformers answers otherwise.
    windowed = hf_greedy(path, PROMPTS[:1], 20)
    config.sliding_window = 4096  # wider than any context here: no window in effect
    config.save_pretrained(path)
    assert hf_greedy(path, PROMPTS[:1], 20) != windowed


@pytest.mark.parametrize("arch", [*sorted(WINDOWED), "llama", "phi3"])
def test_layer_windows_are_the_ones_the_layers_apply(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """What the worker tells the scheduler it may release behind (``kv_window``) follows
    from the windows the model's layers attend with: transformers' own modules say so
    per layer where they keep one, the lean forward's layers too."""
    path = tiny_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    windows = layer_windows(model.config)
    expected = [w * tiny_model.SLIDING_WINDOW for w in WINDOWED.get(arch, [0, 0])]
    assert windows == expected
    for layer, window in zip(model.model.layers, windows, strict=True):
        if hasattr(layer.self_attn, "sliding_window"):
            assert (layer.self_attn.sliding_window or 0) == window
    if arch in ("mistral", "qwen2", "llama"):
        lean = LeanDecoder(model, model.config)
        assert [layer.attention.window for layer in lean.layers] == windows
    assert kv_window(model.config) == (tiny_model.SLIDING_WINDOW if arch == "mistral" else 0)
    # A model mixing windowed and full layers: a layer group of each kind.
    groups = layer_groups(model.config)
    mixed = 0 < sum(w > 0 for w in windows) < len(windows)
    if mixed:
        assert groups is not None
        assert groups.windows == (0, tiny_model.SLIDING_WINDOW)
        assert [groups.windows[g] for g in groups.layer_groups] == windows
    else:
        assert groups is None
    with LLM(path, device="cpu", dtype=torch.float32) as llm:
        assert llm.scheduler.kv.window == (
            tiny_model.SLIDING_WINDOW if mixed else kv_window(model.config)
        )
        assert llm.scheduler.kv.num_groups == (2 if mixed else 1)
        assert llm.runner.hello().kv_groups == (list(groups.windows) if groups else [])


@pytest.mark.parametrize("arch", ["llama", "olmo2", "granite"])
def test_a_stray_sliding_window_in_a_full_attention_config_releases_nothing(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """These models' modules attend over the whole context whatever config.json says."""
    config = AutoConfig.from_pretrained(tiny_checkpoint(arch))
    config.sliding_window = 4
    assert layer_windows(config) == [0] * config.num_hidden_layers
    assert kv_window(config) == 0


def _write_config(directory: Path, config: transformers.PretrainedConfig) -> Path:
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (transformers.T5Config(), "encoder-decoder"),
        (transformers.Gemma3Config(), "multimodal"),
        (transformers.GPT2Config(), "'gpt2' is not supported"),
        (
            transformers.Gemma3TextConfig(layer_types=["chunked_attention", "full_attention"],
                                          num_hidden_layers=2),
            "chunked_attention",
        ),
    ],
)  # fmt: skip
def test_unsupported_checkpoints_are_refused_before_loading_weights(
    config: transformers.PretrainedConfig, words: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=words):
        check_supported(config)
    # A directory with no weights at all: the refusal comes first, not a missing file.
    directory = _write_config(tmp_path / "ckpt", config)
    with pytest.raises(ValueError, match=words):
        settings = WorkerSettings.of(
            model=str(directory), block_size=16, max_num_batched_tokens=64, num_gpu_blocks=8
        )
        ModelRunner(settings, device=torch.device("cpu"))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "granite"])
def test_logprobs_follow_the_models_own_head(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Final-logit soft-capping (Gemma) and logit scaling (Granite) happen after the
    LM head: the engine's logprobs must be transformers' log-softmax of its logits."""
    path = tiny_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    with LLM(path, device="cpu", dtype=torch.float32, num_gpu_blocks=32) as llm:
        (completion,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                               logprobs=5))  # fmt: skip
    (entry,) = completion.samples[0].logprobs
    assert len(entry) >= 5
    for token, logprob in entry.items():
        assert logprob == pytest.approx(float(want[token]), abs=1e-4), token


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_serve_greedy_equals_transformers(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(arch)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)

    # Small blocks and token budget: chunked prefill across window boundaries.
    flags = ("--block-size", "8", "--max-num-batched-tokens", "24", "--num-gpu-blocks", "64")
    with running_server(path, *flags) as (address, _):
        assert asyncio.run(generate_all(address, PROMPTS, MAX_TOKENS, timeout=120)) == expected


def test_make_tiny_model_offers_every_arch(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from expeditor.cli import app

    result = CliRunner().invoke(app, ["make-tiny-model", "--help"])
    for arch in ARCHS:
        assert arch in result.output
    made = CliRunner().invoke(app, ["make-tiny-model", str(tmp_path / "g"), "--arch", "gemma2"])
    assert made.exit_code == 0, made.output
    assert AutoConfig.from_pretrained(tmp_path / "g").model_type == "gemma2"
