"""gpu_worker.packed_linear: bf16 weights reordered once for oneDNN give F.linear's
products (to bf16's last bit: oneDNN may sum in another order on another CPU), only
bf16 on a CPU is packed, and the lean forward over packed weights is the dense one's,
with the modules' own weights released."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.runner_steps import run_steps, step_runner
from transformers import AutoModelForCausalLM

from gpu_worker.lean_model import LeanDecoder
from gpu_worker.packed_linear import BF16_RTOL, linear, pack, why_not_packed

CPU = torch.device("cpu")
CLOSE = {"rtol": BF16_RTOL, "atol": BF16_RTOL}
"""Two units of bf16's last place: a product summed in another order."""


@pytest.mark.parametrize("shape", [(960, 576), (100, 72), (3, 8)])
def test_packed_products_are_f_linears(shape: tuple[int, int]) -> None:
    assert why_not_packed(torch.bfloat16, CPU) is None  # torch's CPU builds have oneDNN
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=g).to(torch.bfloat16)
    bias = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    packed = pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    for rows in (0, 1, 7, 64, 300):
        x = torch.randn(rows, shape[1], generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got, want = linear(x, packed, b), F.linear(x, weight, b)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), **CLOSE)
            assert torch.equal(linear(x, weight, b), want)  # a dense weight: F.linear itself
    strided = torch.randn(shape[1], 5, generator=g).to(torch.bfloat16).t()  # not contiguous
    torch.testing.assert_close(
        linear(strided, packed).float(), F.linear(strided, weight).float(), **CLOSE
    )
    with pytest.raises(AssertionError):  # the tolerance sees a product gone wrong
        torch.testing.assert_close(
            linear(x, packed, bias).float(), F.linear(x, weight, None).float(), **CLOSE
        )


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
    whose lean forward kept them dense: the same hidden states (to bf16's rounding of a
    product summed in another order; on the CPUs measured, identical) and tokens."""
    path = tiny_checkpoint(arch)
    packed = step_runner(path, "auto", dtype=torch.bfloat16)
    assert packed.lean is not None and packed.lean.unpacked is None
    ops = f", {packed.lean.ops_note}" if packed.lean.ops_note else ""  # no compiler: torch's
    assert packed.model_impl_note.endswith(f", weights reordered for oneDNN{ops})")
    assert all(w.is_mkldnn for w in packed.lean.projection_weights())
    for module in packed.model.model.layers:  # released: shapes kept, no memory
        attn, mlp = module.self_attn, module.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        projections += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        assert all(p.weight.device.type == "meta" for p in projections)
    assert packed.flops.per_token > 0

    dense = step_runner(path, "auto", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    dense.lean = dense.decoder.lean = LeanDecoder(model, model.config, pack_weights=False)
    assert dense.lean.unpacked == "not asked"
    assert not any(w.is_mkldnn for w in dense.lean.projection_weights())
    assert dense.flops.per_token == packed.flops.per_token

    packed_hidden, packed_tokens = run_steps(packed)
    dense_hidden, dense_tokens = run_steps(dense)
    for ours, theirs in zip(packed_hidden, dense_hidden, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.02, atol=0.02)
    assert packed_tokens == dense_tokens
