"""gpu_worker.packed_linear: bf16 weights reordered once for oneDNN give F.linear's
products bit for bit, only bf16 on a CPU is packed, and the lean forward over packed
weights is the dense one's, with the modules' own weights released."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.runner_steps import run_steps, step_runner
from transformers import AutoModelForCausalLM

from gpu_worker.lean_model import LeanDecoder
from gpu_worker.packed_linear import linear, pack, why_not_packed

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(960, 576), (100, 72), (3, 8)])
def test_packed_products_are_f_linear_bit_for_bit(shape: tuple[int, int]) -> None:
    assert why_not_packed(torch.bfloat16, CPU) is None  # torch's CPU builds have oneDNN
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=g).to(torch.bfloat16)
    bias = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    packed = pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    for rows in (0, 1, 7, 64, 300):
        x = torch.randn(rows, shape[1], generator=g).to(torch.bfloat16)
        for b in (None, bias):
            assert torch.equal(linear(x, packed, b), F.linear(x, weight, b))
            assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))  # dense: as is
    strided = torch.randn(shape[1], 5, generator=g).to(torch.bfloat16).t()  # not contiguous
    assert torch.equal(linear(strided, packed), F.linear(strided, weight))


def test_only_bf16_on_a_cpu_is_packed() -> None:
    why = why_not_packed(torch.float32, CPU)
    assert why is not None and "torch.float32 on cpu" in why
    why = why_not_packed(torch.bfloat16, torch.device("cuda"))
    assert why is not None and "on cuda" in why
    assert why_not_packed(torch.bfloat16, CPU) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, a window
def test_packed_lean_forward_is_the_dense_one(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """The same steps through a bf16 runner whose lean forward packed its weights and one
    whose lean forward kept them dense: identical hidden states and tokens."""
    path = tiny_checkpoint(arch)
    packed = step_runner(path, "auto", dtype=torch.bfloat16)
    assert packed.lean is not None and packed.lean.unpacked is None
    assert packed.model_impl_note.endswith(", weights reordered for oneDNN)")
    layer = packed.lean.layers[0]
    assert all(w.is_mkldnn for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    for module in packed.model.model.layers:  # released: shapes kept, no memory
        for linear_module in (
            module.self_attn.q_proj,
            module.self_attn.o_proj,
            module.mlp.down_proj,
        ):
            assert linear_module.weight.device.type == "meta"
    assert packed.flops.per_token > 0

    dense = step_runner(path, "auto", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    dense.lean = dense.decoder.lean = LeanDecoder(model, model.config, pack_weights=False)
    assert dense.lean.unpacked == "not asked" and not dense.lean.layers[0].qkv.is_mkldnn
    assert dense.flops.per_token == packed.flops.per_token

    packed_hidden, packed_tokens = run_steps(packed)
    dense_hidden, dense_tokens = run_steps(dense)
    for ours, theirs in zip(packed_hidden, dense_hidden, strict=True):
        assert torch.equal(ours, theirs)
    assert packed_tokens == dense_tokens
