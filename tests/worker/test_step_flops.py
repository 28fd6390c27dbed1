"""A step's forward FLOPs from the model's shapes (gpu_worker/step_flops.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gpu_worker.step_flops import StepFlops
from ipc.schema import StepTiming
from scheduler_svc.step_times import StepTimer


def test_linear_and_attention_flops_of_a_step(model: Path) -> None:
    config = AutoConfig.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    flops = StepFlops(hf, config)
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * config.intermediate_size
    assert flops.per_token == 2.0 * per_layer * layers  # the LM head is not the body's
    assert flops.per_key == 4.0 * heads * d * layers
    # A decode at position 9 (10 keys) and a 4-token prompt (1 + 2 + 3 + 4 keys).
    assert flops.step([9, 0], [0, 1, 5]) == 5 * flops.per_token + 20 * flops.per_key


def test_experts_count_by_the_share_a_token_runs(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("mixtral")
    config = AutoConfig.from_pretrained(path)
    body = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model
    matrices = {n: p.numel() for n, p in body.named_parameters() if p.dim() >= 2}
    experts = sum(v for n, v in matrices.items() if ".experts." in n)
    dense = sum(v for n, v in matrices.items() if ".experts." not in n and "embed" not in n)
    share = config.num_experts_per_tok / config.num_local_experts
    assert experts and share < 1
    assert StepFlops(body, config).per_token == 2.0 * (dense + experts * share)


def test_step_timer_reports_achieved_gflops() -> None:
    timer = StepTimer()
    for _ in range(3):
        timer.add_step(0.0, 0.5, StepTiming(forward_s=0.25, total_s=0.5, forward_flop=5e9))
    assert timer.total().forward_gflops == 20.0 and timer.recent().forward_gflops == 20.0
    assert StepTimer().total().forward_gflops == 0.0
