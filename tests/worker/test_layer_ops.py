"""gpu_worker.layer_ops: the C passes for a bf16 layer's elementwise operations give
torch's results (transformers' operation sequences) bit for bit, but for the order an
RMSNorm sums its squares in; they refuse tensors they cannot read; only bf16 on a CPU
uses them; and a lean forward through them is the torch operations' forward."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.runner_steps import run_steps, step_runner
from transformers import AutoModelForCausalLM

from gpu_worker import layer_ops
from gpu_worker.kernels import native_build
from gpu_worker.layer_ops import NativeOps, Norm, TorchOps, choose_ops
from gpu_worker.lean_model import LeanDecoder

BF16 = torch.bfloat16
CPU = torch.device("cpu")
TORCH = TorchOps()


@pytest.fixture(scope="module")
def native() -> NativeOps:
    if native_build.compiler() is None:
        pytest.skip("no C compiler: the native library cannot be built here")
    ops, why = choose_ops(BF16, CPU)
    assert isinstance(ops, NativeOps), why
    return ops


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


@pytest.mark.parametrize(("rows", "width"), [(64, 576), (3, 37), (1, 16), (0, 8), (300, 64)])
def test_add_rms_norm_is_torchs(native: NativeOps, rows: int, width: int) -> None:
    norm = Norm(bf16(width, seed=1) + 1, 1e-5)
    for add in (None, bf16(rows, width, seed=2, scale=4.0)):
        x = bf16(rows, width, seed=3, scale=3.0)
        want_x, want = TORCH.add_rms_norm(x.clone(), add, norm)
        got_x, got = native.add_rms_norm(x, add, norm)
        assert got_x is x and torch.equal(x, want_x)  # the residual stream, updated in place
        assert got.dtype == BF16 and got.shape == want.shape
        # The squares summed in another order: a last-bit difference, now and then.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
        if got.numel():
            assert (got == want).float().mean() > 0.98


@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 20), (2, 128)])
def test_rotate_is_torchs_in_place(native: NativeOps, heads: int, head_dim: int) -> None:
    """On the q/k heads of a fused qkv (a view, strided by token), v left alone."""
    tokens, kv = 9, 1
    qkv = bf16(tokens, heads + kv, head_dim, seed=4, scale=2.0)
    positions = torch.arange(tokens) * 37 + 5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * inv_freq
    emb = torch.cat((angles, angles), -1)
    cos, sin = (f(emb).to(BF16)[:, None, :] for f in (torch.cos, torch.sin))
    want = TORCH.rotate(qkv[:, :heads], cos, sin)
    rotated = qkv.clone()
    got = native.rotate(rotated[:, :heads], cos, sin)
    assert got.data_ptr() == rotated.data_ptr() and torch.equal(got, want)
    assert torch.equal(rotated[:, heads:], qkv[:, heads:])


@pytest.mark.parametrize(("rows", "width"), [(64, 1536), (5, 37), (0, 16)])
def test_silu_mul_is_torchs(native: NativeOps, rows: int, width: int) -> None:
    gate_up = bf16(rows, 2 * width, seed=5, scale=6.0)
    if rows:  # the edges: overflowing exponentials, infinities, NaN
        gate_up[0, :6] = torch.tensor([100.0, -100.0, float("inf"), -float("inf"), float("nan"), 0])
    want = TORCH.silu_mul(gate_up, width)
    got = native.silu_mul(gate_up, width)
    assert got.shape == (rows, width) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(got.isnan(), want.isnan())


def test_silu_mul_is_torchs_for_every_bf16_value(native: NativeOps) -> None:
    """Each of the 65,536 bf16 bit patterns as a gate (subnormals, the exponentials'
    edges near -87 and -88.7, infinities, NaN), the same bits as torch's."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16).view(1024, 64)
    for up in (torch.ones_like(gates), bf16(1024, 64, seed=13)):
        gate_up = torch.cat([gates, up], 1)
        got, want = native.silu_mul(gate_up, 64), TORCH.silu_mul(gate_up, 64)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all()), gates[~same][:8].tolist()


def test_native_ops_refuse_what_they_cannot_read(native: NativeOps) -> None:
    norm = Norm(torch.ones(8, dtype=BF16), 1e-6)
    with pytest.raises(ValueError, match="contiguous bf16 CPU tensors"):
        native.add_rms_norm(torch.ones(4, 8), None, norm)  # float32
    with pytest.raises(ValueError, match="contiguous bf16 CPU tensors"):
        native.add_rms_norm(torch.ones(8, 4, dtype=BF16).t(), None, norm)  # strided
    with pytest.raises(ValueError, match=r"of shape \(4, 8\)"):
        native.add_rms_norm(torch.ones(4, 8, dtype=BF16), torch.ones(4, 9, dtype=BF16), norm)
    with pytest.raises(ValueError, match=r"of shape \(3, 10\)"):
        native.silu_mul(torch.ones(3, 9, dtype=BF16), 5)
    qk = torch.ones(2, 3, 8, dtype=BF16)
    with pytest.raises(ValueError, match="contiguous within a token"):
        native.rotate(qk.transpose(0, 1), *(torch.ones(3, 1, 8, dtype=BF16),) * 2)
    with pytest.raises(ValueError, match="contiguous within a token"):  # tokens overlap
        native.rotate(qk[:1].expand(4, 3, 8), *(torch.ones(4, 1, 8, dtype=BF16),) * 2)


def test_only_bf16_on_a_cpu_runs_in_c(native: NativeOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and CUDA keep torch's operations (nothing to say in the log); a bf16 CPU
    forward does too where EXPEDITOR_NATIVE_CPU=0 or the library is missing, and says
    why."""
    for dtype, device in ((torch.float32, CPU), (BF16, torch.device("cuda"))):
        ops, why = choose_ops(dtype, device)
        assert type(ops) is TorchOps and why is None
    ops, why = choose_ops(BF16, CPU, {"EXPEDITOR_NATIVE_CPU": "0"})
    assert type(ops) is TorchOps and why == "layer operations in torch (EXPEDITOR_NATIVE_CPU=0)"
    monkeypatch.setattr(layer_ops, "library", lambda: "no C compiler (set CC, or install cc/gcc)")
    ops, why = choose_ops(BF16, CPU, {})
    assert type(ops) is TorchOps and why is not None and "no C compiler" in why


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms in torch
def test_the_lean_forward_through_c_is_torchs(
    native: NativeOps, arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """The same steps (prompts, chunks, decodes) through a bf16 runner whose lean forward
    runs the C passes and one that runs torch's operations: hidden states equal to bf16's
    rounding, the same tokens."""
    path = tiny_checkpoint(arch)
    fused = step_runner(path, "auto", dtype=BF16)
    assert fused.lean is not None and isinstance(fused.lean.ops, NativeOps)
    plain = step_runner(path, "auto", dtype=BF16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=BF16).eval()
    plain.lean = plain.decoder.lean = LeanDecoder(model, model.config, native_ops=False)
    assert type(plain.lean.ops) is TorchOps
    fused_hidden, fused_tokens = run_steps(fused)
    plain_hidden, plain_tokens = run_steps(plain)
    for ours, theirs in zip(fused_hidden, plain_hidden, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.02, atol=0.02)
    assert fused_tokens == plain_tokens


@pytest.mark.parametrize("tune", [(), ("-march=native", "-mno-avx512f")])
def test_the_portable_and_avx2_builds_are_torchs(
    native: NativeOps, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tune: tuple[str, ...]
) -> None:
    """Built without ``-march=native`` (SSE vectors, no widening instructions) and without
    AVX-512 (AVX2), the passes give torch's results too."""
    cpuinfo = Path("/proc/cpuinfo")
    if tune and not {"avx2", "fma"} <= set(cpuinfo.read_text().split() if cpuinfo.exists() else ()):
        pytest.skip("the CPU has no AVX2")
    monkeypatch.setattr(native_build, "TUNE", tune)
    ops = NativeOps(ctypes.CDLL(str(native_build.build(tmp_path))))
    norm = Norm(bf16(40, seed=6) + 1, 1e-6)
    x, add = bf16(7, 40, seed=7, scale=3.0), bf16(7, 40, seed=8)
    want_x, want = TORCH.add_rms_norm(x.clone(), add, norm)
    got_x, got = ops.add_rms_norm(x, add, norm)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    gate_up = bf16(7, 2 * 37, seed=9, scale=5.0)
    assert torch.equal(ops.silu_mul(gate_up, 37), TORCH.silu_mul(gate_up, 37))
    qk = bf16(5, 3, 20, seed=10)
    cos, sin = bf16(5, 1, 20, seed=11), bf16(5, 1, 20, seed=12)
    assert torch.equal(ops.rotate(qk.clone(), cos, sin), TORCH.rotate(qk, cos, sin))
