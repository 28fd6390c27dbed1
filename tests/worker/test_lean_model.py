"""The lean forward (gpu_worker/lean_model.py): the same hidden states and greedy tokens
as transformers' model code over the same steps, for every architecture it covers; the
checkpoints it leaves to transformers, and why; its fused weights shared with the
modules; the ``model_impl`` setting."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.hf_reference import hf_greedy
from support.runner_steps import PROMPTS, STEPS, agrees_with, run_steps, step_runner
from transformers import AutoModelForCausalLM, LlamaConfig

from expeditor.llm import LLM
from gpu_worker.lean_model import LEAN_TYPES, LeanDecoder, why_not_lean
from gpu_worker.tiny_model import SLIDING_WINDOW
from shared.errors import ConfigError
from shared.server_config import ServerConfig, load_server_config

WINDOWS = {
    "llama": [0, 0],
    "mistral": [SLIDING_WINDOW] * 2,
    "qwen2": [0, SLIDING_WINDOW],  # layer 0 global (max_window_layers = 1)
    "qwen3": [0, 0],
}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], Path]:
    return tiny_checkpoint  # one per arch for the whole session (tests/conftest.py)


@pytest.mark.parametrize("arch", LEAN_TYPES)
def test_lean_forward_equals_transformers_forward(
    arch: str, checkpoint: Callable[[str], Path]
) -> None:
    path = checkpoint(arch)
    lean = step_runner(path, "auto")
    assert lean.lean is not None and lean.model_impl_note == f"lean (model type {arch!r})"
    assert [layer.attention.window for layer in lean.lean.layers] == WINDOWS[arch]  # 0: none
    plain = step_runner(path, "transformers")
    assert plain.lean is None
    lean_hidden, lean_tokens = run_steps(lean)
    plain_hidden, plain_tokens = run_steps(plain)
    assert [h.shape[0] for h in lean_hidden] == [sum(s.values()) for s in STEPS]
    for step, (ours, theirs) in enumerate(zip(lean_hidden, plain_hidden, strict=True)):
        torch.testing.assert_close(
            ours, theirs, **TOLERANCE, msg=lambda m, s=step: f"step {s}: {m}"
        )
    assert lean_tokens == plain_tokens
    assert agrees_with(lean_tokens, hf_greedy(path, list(PROMPTS.values()), 8)), lean_tokens


def test_other_architectures_keep_transformers_forward(
    checkpoint: Callable[[str], Path],
) -> None:
    runner = step_runner(checkpoint("phi3"), "auto")
    assert runner.lean is None
    assert runner.model_impl_note.startswith("transformers (model type 'phi3'")
    with LLM(
        checkpoint("llama"), device="cpu", num_gpu_blocks=16, model_impl="transformers"
    ) as llm:
        assert llm.runner.lean is None
        assert llm.runner.model_impl_note == "transformers (model_impl=transformers)"


def test_a_dynamic_rope_keeps_transformers_forward(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = tmp_path / "dynamic"
    path.mkdir()
    for file in checkpoint("llama").iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    runner = step_runner(path, "auto")
    assert runner.lean is None
    assert "rope type 'dynamic'" in runner.model_impl_note


def _meta_llama(**overrides: object) -> tuple[torch.nn.Module, LlamaConfig]:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **overrides,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config), config


def test_why_not_lean_names_the_problem() -> None:
    model, config = _meta_llama()
    assert why_not_lean(model, config) is None
    model, config = _meta_llama(hidden_act="gelu")
    assert why_not_lean(model, config) == "hidden_act 'gelu'"
    with pytest.raises(ValueError, match="no lean forward for this checkpoint: hidden_act"):
        LeanDecoder(model, config)
    silu = SimpleNamespace(model_type="llama", hidden_act="silu")
    for rope_type in ("dynamic", "longrope"):
        rotary = SimpleNamespace(rope_type=rope_type)
        stub = SimpleNamespace(model=SimpleNamespace(rotary_emb=rotary))
        reason = why_not_lean(stub, silu)  # type: ignore[arg-type]
        assert reason is not None and f"rope type {rope_type!r}" in reason
    no_rotary = SimpleNamespace(model=SimpleNamespace())
    assert "rope type 'unknown'" in str(why_not_lean(no_rotary, silu))  # type: ignore[arg-type]
    other = SimpleNamespace(model_type="phi3", hidden_act="silu")
    assert "model type 'phi3'" in str(why_not_lean(model, other))  # type: ignore[arg-type]


def _inside(view: torch.Tensor, whole: torch.Tensor) -> bool:
    start = whole.data_ptr()
    end = start + whole.numel() * whole.element_size()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= end


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_weights_are_the_modules_weights(
    arch: str, checkpoint: Callable[[str], Path]
) -> None:
    path = checkpoint(arch)
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decoder = LeanDecoder(fused, fused.config)
    for module, layer in zip(fused.model.layers, decoder.layers, strict=True):
        attn, mlp = module.self_attn, module.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert _inside(linear.weight, layer.qkv)
            if linear.bias is not None:
                assert layer.qkv_bias is not None and _inside(linear.bias, layer.qkv_bias)
        for linear in (mlp.gate_proj, mlp.up_proj):
            assert _inside(linear.weight, layer.gate_up)
        assert (layer.qkv_bias is not None) == (arch == "qwen2")
    ids = torch.tensor([PROMPTS["a"]])
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, fresh(ids).logits)
    # The modules read the fused tensor itself: a change to it shows in their output.
    decoder.layers[0].qkv.mul_(0.5)
    with torch.inference_mode():
        assert not torch.allclose(fused(ids).logits, fresh(ids).logits)


def test_a_bad_model_impl_is_refused(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(
        ValueError, match="model_impl: must be one of 'auto', 'transformers', got 'lean'"
    ):
        step_runner(checkpoint("llama"), "lean")
    with pytest.raises(ConfigError, match="model_impl: must be one of") as info:
        ServerConfig(model_impl="lean")  # type: ignore[arg-type]
    assert info.value.field == "model_impl"
    with pytest.raises(ConfigError, match=r"got 'lean' \(from flag --model-impl\)"):
        load_server_config(env={}, overrides={"model_impl": "lean"})
    with pytest.raises(ConfigError, match="model_impl"):
        load_server_config(env={"EXPEDITOR_MODEL_IMPL": "vllm"})
    assert ServerConfig().model_impl == "auto"
    chosen = load_server_config(env={"EXPEDITOR_MODEL_IMPL": "transformers"})
    assert chosen.model_impl == "transformers"
