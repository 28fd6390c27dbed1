"""Tensor-parallel sharding (gpu_worker.tensor_parallel) on CPU with the gloo backend.

One spawn of 2 processes shards every architecture of TP_ARCHS (plus a llama with biases
on every projection) and saves its logits, greedy continuation, parameter shapes and
bytes; the parent compares them with the unsharded model's. Another runs a ModelRunner
in the group on each rank for every lean model type (and the biased llama): the lean
forward is the one that runs, on both ranks, on the CPU path and on the Triton path (the
kernels under the interpreter), and its hidden states and greedy tokens equal the
unsharded model's and transformers' forward's over the same shards.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.hf_reference import hf_greedy
from support.runner_steps import PROMPTS, agrees_with, run_steps, step_runner
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3MoeConfig,
)

from gpu_worker.layer_ops import choose_ops
from gpu_worker.lean_model import LEAN_TYPES
from gpu_worker.tensor_parallel import TP_ARCHS, check_tp_supported, local_kv_heads, shard_model
from scheduler_svc.launch import free_port

WORLD = 2
BIASED = "llama_bias"  # llama with a bias on every projection, o_proj/down_proj included
CASES = (*TP_ARCHS, BIASED)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
SEQ = 30  # longer than the tiny models' sliding window (22)
GEN_PROMPT, GEN_TOKENS = 6, 8


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 259, (2, SEQ), generator=g)
    positions = torch.stack([torch.arange(SEQ), torch.arange(SEQ) + 7])
    return ids, positions


def _run(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids, positions = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        prompt = ids[:1, :GEN_PROMPT]
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=GEN_TOKENS,
            min_new_tokens=GEN_TOKENS,
        )
    return {"logits": logits, "tokens": tokens}


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _join(rank: int, port: int) -> None:
    """This process as ``rank`` of a :data:`WORLD`-rank gloo group on ``port``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )


def _worker(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    _join(rank, port)
    try:
        for name, path in paths.items():
            model = _load(Path(path))
            shard_model(model, model.config, rank, WORLD)
            params = dict(model.named_parameters())
            result: dict[str, Any] = _run(model)
            result["shapes"] = {n: tuple(p.shape) for n, p in params.items()}
            result["bytes"] = sum(p.numel() * p.element_size() for p in params.values())
            # Each parameter owns its storage: the full tensors are not kept alive.
            result["storage_bytes"] = sum(p.untyped_storage().nbytes() for p in params.values())
            try:
                shard_model(model, model.config, rank, WORLD)
                result["reshard_error"] = None
            except RuntimeError as exc:
                result["reshard_error"] = str(exc)
            torch.save(result, Path(out) / f"{name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _make_biased(path: Path, base: Path) -> None:
    """The tiny llama with random biases on q/k/v/o and gate/up/down."""
    config = AutoConfig.from_pretrained(base)
    config.attention_bias = True
    config.mlp_bias = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = model.load_state_dict(_load(base).state_dict(), strict=False)
    assert missing and all(n.endswith(".bias") for n in missing)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in missing:
            param = model.get_parameter(name)
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    model.save_pretrained(path)


def _on_ranks(
    worker: Callable[..., None], paths: dict[str, Path], out: Path, names: Iterable[str]
) -> dict[str, list[Any]]:
    """``worker(rank, port, paths, out)`` on :data:`WORLD` processes; what each rank saved
    for each name (``out/{name}-{rank}.pt``)."""
    mp.spawn(
        worker,
        args=(free_port(), {n: str(p) for n, p in paths.items()}, str(out)),
        nprocs=WORLD,
        join=True,
    )
    return {
        name: [torch.load(out / f"{name}-{r}.pt", weights_only=False) for r in range(WORLD)]
        for name in names
    }


@pytest.fixture(scope="module")
def sharded(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[[str], Path]
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")
    paths: dict[str, Path] = {}
    for model_type in TP_ARCHS:
        arch = "gemma3" if model_type == "gemma3_text" else model_type
        paths[model_type] = tiny_checkpoint(arch)
    paths[BIASED] = root / BIASED
    _make_biased(paths[BIASED], paths["llama"])
    out = root / "out"
    out.mkdir()
    return {"paths": paths, "results": _on_ranks(_worker, paths, out, CASES)}


def _expected_bytes(model: torch.nn.Module) -> int:
    """Per-rank bytes: column-parallel weights/biases and row-parallel weights halved,
    everything else (embedding, norms, lm_head, row-parallel biases) replicated."""
    total = 0
    for name, p in model.named_parameters():
        module, kind = name.split(".")[-2:]
        split = module in COLUMN or (module in ROW and kind == "weight")
        total += p.numel() * p.element_size() // (WORLD if split else 1)
    return total


@pytest.mark.parametrize("name", CASES)
def test_sharded_matches_unsharded(sharded: dict[str, Any], name: str) -> None:
    reference_model = _load(sharded["paths"][name])
    reference = _run(reference_model)
    ranks = sharded["results"][name]
    for result in ranks:
        diff = (result["logits"] - reference["logits"]).abs().max().item()
        assert torch.allclose(result["logits"], reference["logits"], rtol=1e-5, atol=1e-4), diff
        assert torch.equal(result["tokens"], reference["tokens"])
        assert result["tokens"].shape[1] == GEN_PROMPT + GEN_TOKENS
    # Every rank computes the same logits bit for bit, so every rank samples alike.
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])


@pytest.mark.parametrize("name", CASES)
def test_shards_hold_half_the_projections(sharded: dict[str, Any], name: str) -> None:
    model = _load(sharded["paths"][name])
    config = model.config
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    proj_bytes = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.split(".")[-2] in (*COLUMN, *ROW)
    )
    expected = _expected_bytes(model)
    for result in sharded["results"][name]:
        shapes = result["shapes"]
        assert result["bytes"] == expected == result["storage_bytes"]
        # Projections are the bulk even of the tiny models; a no-op sharding fails here.
        assert result["bytes"] <= full_bytes - proj_bytes // 2 + proj_bytes // 16
        layer = "model.layers.0"
        q = shapes[f"{layer}.self_attn.q_proj.weight"]
        assert q == (config.num_attention_heads * config.head_dim // WORLD, config.hidden_size)
        assert shapes[f"{layer}.self_attn.k_proj.weight"] == (
            config.num_key_value_heads * config.head_dim // WORLD,
            config.hidden_size,
        )
        assert shapes[f"{layer}.self_attn.o_proj.weight"] == (
            config.hidden_size,
            config.num_attention_heads * config.head_dim // WORLD,
        )
        inter = config.intermediate_size // WORLD
        assert shapes[f"{layer}.mlp.up_proj.weight"] == (inter, config.hidden_size)
        assert shapes[f"{layer}.mlp.down_proj.weight"] == (config.hidden_size, inter)
        replicated = [n for n in full if n.split(".")[-2] not in (*COLUMN, *ROW)]
        assert replicated and all(shapes[n] == full[n] for n in replicated)
        assert "already sharded" in result["reshard_error"]
    if name == BIASED:
        shapes = sharded["results"][name][0]["shapes"]
        assert "model.layers.0.self_attn.o_proj.bias" not in shapes
        assert shapes["model.layers.0.self_attn.o_proj.tp_bias"] == (config.hidden_size,)
        assert shapes["model.layers.0.self_attn.q_proj.bias"] == (
            config.num_attention_heads * config.head_dim // WORLD,
        )


LEAN_CASES = (*LEAN_TYPES, BIASED)
TRITON = "llama_triton"  # the llama again, on the Triton path (EXPEDITOR_FORCE_TRITON=1)
IMPLS = ("auto", "transformers")


def _runner_worker(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    """Each case through a runner of each model_impl in the group: which forward ran,
    the steps' hidden states and greedy tokens."""
    torch.set_num_threads(1)
    _join(rank, port)
    try:
        for name, path in paths.items():
            if name == TRITON:
                os.environ["EXPEDITOR_FORCE_TRITON"] = "1"
            result: dict[str, Any] = {}
            for impl in IMPLS:
                runner = step_runner(Path(path), impl, dist.group.WORLD)
                hidden, tokens = run_steps(runner)
                result[impl] = {
                    "lean": runner.lean is not None,
                    "heads": None if runner.lean is None else runner.lean.num_heads,
                    "note": runner.model_impl_note,
                    "hidden": hidden,
                    "tokens": tokens,
                }
            if name == BIASED:  # in bf16 too: the projections reordered for oneDNN
                runner = step_runner(Path(path), "auto", dist.group.WORLD, dtype=torch.bfloat16)
                hidden, tokens = run_steps(runner)
                result["bf16"] = {
                    "note": runner.model_impl_note,
                    "unpacked": None if runner.lean is None else runner.lean.unpacked,
                    "hidden": hidden,
                    "tokens": tokens,
                }
            torch.save(result, Path(out) / f"{name}-{rank}.pt")
            os.environ.pop("EXPEDITOR_FORCE_TRITON", None)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runners(sharded: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    paths = {name: sharded["paths"][name] for name in LEAN_CASES}
    paths[TRITON] = paths["llama"]
    out = tmp_path_factory.mktemp("tp-runners")
    return {"paths": paths, "results": _on_ranks(_runner_worker, paths, out, paths)}


@pytest.mark.parametrize("name", [*LEAN_CASES, TRITON])
def test_the_lean_forward_runs_on_every_rank_and_is_exact(
    runners: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = runners["paths"][name]
    if name == TRITON:
        monkeypatch.setenv("EXPEDITOR_FORCE_TRITON", "1")
    alone = step_runner(path, "transformers", None)  # unsharded, transformers' forward
    reference, reference_tokens = run_steps(alone)
    heads = alone.config.num_attention_heads // WORLD
    model_type = alone.config.model_type
    ranks = runners["results"][name]
    for result in ranks:
        lean, plain = result["auto"], result["transformers"]
        assert lean["lean"] and lean["heads"] == heads
        assert lean["note"] == f"lean (model type {model_type!r}, sharded over {WORLD} ranks)"
        assert not plain["lean"] and plain["note"] == "transformers (model_impl=transformers)"
        for impl in (lean, plain):
            for step, (ours, theirs) in enumerate(zip(impl["hidden"], reference, strict=True)):
                torch.testing.assert_close(
                    ours, theirs, rtol=1e-5, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}"
                )
            assert impl["tokens"] == reference_tokens
    # Both ranks end every step with the same hidden states, bit for bit.
    for ours, theirs in zip(ranks[0]["auto"]["hidden"], ranks[1]["auto"]["hidden"], strict=True):
        assert torch.equal(ours, theirs)
    expected = hf_greedy(path, list(PROMPTS.values()), 8)
    assert agrees_with(ranks[0]["auto"]["tokens"], expected), ranks[0]["auto"]["tokens"]


def test_reordered_bf16_weights_shard_over_the_group(runners: dict[str, Any]) -> None:
    """The biased llama in bf16 at TP=2: every rank's lean forward reorders its shards
    for oneDNN, the ranks end every step with the same hidden states, and those are the
    unsharded bf16 forward's to bf16's rounding of the partial sums (the same tokens)."""
    ranks = [result["bf16"] for result in runners["results"][BIASED]]
    ops = choose_ops(torch.bfloat16, torch.device("cpu"))[1]  # no compiler: torch's
    for rank in ranks:
        assert rank["unpacked"] is None
        assert rank["note"].endswith(
            f"sharded over {WORLD} ranks, weights reordered for oneDNN, {ops})"
        )
    for ours, theirs in zip(ranks[0]["hidden"], ranks[1]["hidden"], strict=True):
        assert torch.equal(ours, theirs)
    alone = step_runner(runners["paths"][BIASED], "auto", None, dtype=torch.bfloat16)
    assert alone.lean is not None and alone.lean.unpacked is None
    reference, reference_tokens = run_steps(alone)
    for ours, theirs in zip(ranks[0]["hidden"], reference, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.05, atol=0.1)
    assert ranks[0]["tokens"] == reference_tokens


def _llama(**overrides: int) -> LlamaConfig:
    sizes = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "vocab_size": 32,
    }
    return LlamaConfig(**{**sizes, **overrides})


@pytest.mark.parametrize(
    ("config", "world", "reason"),
    [
        (Phi3Config(num_attention_heads=4, num_key_value_heads=2), 2, "fused qkv_proj"),
        (MixtralConfig(num_attention_heads=4, num_key_value_heads=2), 2, "mixture-of-experts"),
        (Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2), 2, "mixture-of-experts"),
        (Olmo2Config(num_attention_heads=4, num_key_value_heads=2), 2, "over all heads"),
        (_llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2, "kv"),
        (_llama(), 4, "num_key_value_heads = 2"),
        (_llama(num_key_value_heads=4), 8, "num_attention_heads = 4"),
        (_llama(intermediate_size=130, num_key_value_heads=4), 4, "intermediate_size = 130"),
    ],
)
def test_refusals(config: Any, world: int, reason: str) -> None:
    if reason == "kv":
        reason = "num_key_value_heads = 3 of 'llama' is not divisible by the tensor-parallel"
    with pytest.raises(ValueError, match=reason) as excinfo:
        check_tp_supported(config, world)
    assert config.model_type in str(excinfo.value)
    with pytest.raises(ValueError, match=reason):
        local_kv_heads(config, world)


def test_world_size_one_and_local_kv_heads() -> None:
    check_tp_supported(Phi3Config(), 1)  # nothing to shard, nothing to refuse
    with pytest.raises(ValueError, match=">= 1"):
        check_tp_supported(_llama(), 0)
    assert local_kv_heads(_llama(), 1) == 2
    assert local_kv_heads(_llama(), 2) == 1
    assert local_kv_heads(_llama(num_key_value_heads=4), 4) == 1
    model = AutoModelForCausalLM.from_config(_llama())
    before = dict(model.named_parameters())
    shard_model(model, model.config, 0, 1)
    assert dict(model.named_parameters()) == before
    assert not any(m._forward_hooks for m in model.modules())


def test_shard_needs_initialized_distributed() -> None:
    assert not dist.is_initialized()
    model = AutoModelForCausalLM.from_config(_llama())
    q = model.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
        shard_model(model, model.config, 0, 2)
    assert model.model.layers[0].self_attn.q_proj.weight is q  # untouched
    with pytest.raises(ValueError, match="rank 2"):
        shard_model(model, model.config, 2, 2)
