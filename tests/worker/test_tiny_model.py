"""The deterministic tiny random checkpoint (gpu_worker.tiny_model) and its CLI command."""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from expeditor.cli import app
from expeditor.cli_bench import _checkpoint
from expeditor.llm import LLM
from gpu_worker import tiny_model
from gpu_worker.tiny_model import default_model_dir, make_tiny_model
from shared import paths
from shared.sampling import SamplingParams

runner = CliRunner()

PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time"]
UNICODE_TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld, naïve café",
    "日本語のテキスト、中文\uff0c한국어",
    "emoji 🎉👩‍👩‍👧 and flags 🇫🇷",
    "combining e\u0301 and zero\u200bwidth",
    "\x00\x01\x7f control bytes",
    "literal <s> and </s> and <pad> markers",
]
CONFIG_CLASS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
}
DENSE = tuple(CONFIG_CLASS)
"""The Llama-layout archs whose exact shapes these tests pin; the others are checked in
tests/worker/test_architectures.py."""


def _offline(mp: pytest.MonkeyPatch) -> None:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    _offline(monkeypatch)


@pytest.fixture(scope="module", params=DENSE)
def built(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """(arch, directory, model, tokenizer), built and loaded once per arch."""
    arch = request.param
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp)
        path = make_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, seed=0)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        yield arch, path, model, tokenizer


def test_checkpoint_has_promised_files_and_sizes(built: Any) -> None:
    arch, path, model, tokenizer = built
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        tiny_model.MARKER_NAME,
    } <= names
    assert not any(name.startswith(".model.tmp-") for name in os.listdir(path.parent))

    config = model.config
    assert type(config).__name__ == CONFIG_CLASS[arch]
    assert config.model_type == arch
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == 2048
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer) == 259
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.tie_word_embeddings is False
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_theta"] == 1e4
    if arch in ("mistral", "qwen2"):
        assert config.sliding_window == tiny_model.SLIDING_WINDOW

    weights = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (config.vocab_size, 64)
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in weights) == (arch == "qwen3")
    assert set(weights) == set(model.state_dict())  # nothing missing or left at its init

    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert json.loads((path / tiny_model.MARKER_NAME).read_text())["arch"] == arch


def test_greedy_generation_is_not_degenerate(built: Any) -> None:
    _arch, _path, model, tokenizer = built
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, do_sample=False, max_new_tokens=20, pad_token_id=tokenizer.pad_token_id
            )
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) >= 4
        assert len(set(new)) >= 4, (prompt, new)
        assert all(token == 2 or 3 <= token < 259 for token in new)  # bytes or EOS only


def test_logits_depend_on_context_and_are_separated(built: Any) -> None:
    _arch, _path, model, _tokenizer = built
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 259, (16, 48), generator=generator)
    other = ids.clone()
    other[:, :-1] = torch.randint(3, 259, (16, 47), generator=generator)
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
        other_logits = model(other).logits[:, -1]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5
    assert (logits.argmax(-1) != other_logits.argmax(-1)).sum() >= 4  # attention matters


def test_same_seed_gives_identical_bytes(built: Any, tmp_path: Path) -> None:
    arch, path, _model, _tokenizer = built
    again = make_tiny_model(tmp_path / "again", arch=arch, seed=0)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    other = load_file(make_tiny_model(tmp_path / "other", arch=arch, seed=1) / "model.safetensors")
    weights = load_file(path / "model.safetensors")
    assert set(other) == set(weights)
    assert all(not torch.equal(other[name], weights[name]) for name in weights if "norm" in name)
    assert not torch.equal(other["lm_head.weight"], weights["lm_head.weight"])


def test_global_rng_untouched(tmp_path: Path) -> None:
    state = torch.random.get_rng_state()
    make_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_tokenizer_round_trips_and_adds_bos(built: Any, text: str) -> None:
    arch, _path, _model, tokenizer = built
    if arch == "qwen2":  # transformers forces Qwen2Tokenizer, which NFC-normalizes
        text = unicodedata.normalize("NFC", text)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text) == [1, *ids]
    if "<" not in text:
        assert ids == [3 + b for b in text.encode()]  # one token per UTF-8 byte


def test_tokenizer_json_agrees_with_auto_tokenizer(built: Any) -> None:
    _arch, path, _model, tokenizer = built
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in UNICODE_TEXTS:
        assert raw.encode(text).ids == tokenizer.encode(text)


def test_tokenizer_special_tokens(built: Any) -> None:
    _arch, _path, _model, tokenizer = built
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (
        "<pad>",
        "<s>",
        "</s>",
    )
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([1, 3 + ord("h"), 3 + ord("i"), 2], skip_special_tokens=True) == "hi"


def test_default_model_dir_creates_once_then_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPEDITOR_CACHE_DIR", str(tmp_path / "cache"))
    first = default_model_dir()
    assert first.parent == tmp_path / "cache"
    assert first.name == f"tiny-llama-s0-v{tiny_model.FORMAT_VERSION}"
    assert tiny_model.is_tiny_model(first)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert default_model_dir() == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    assert os.listdir(tmp_path / "cache") == [first.name]  # no staging leftovers
    model = AutoModelForCausalLM.from_pretrained(first)
    assert model.config.model_type == "llama"


def test_default_model_dir_race_and_incomplete_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPEDITOR_CACHE_DIR", str(tmp_path))
    target = tmp_path / f"tiny-llama-s0-v{tiny_model.FORMAT_VERSION}"
    target.mkdir()
    (target / "config.json").write_text("{}")  # half-written, no marker: not trusted
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: default_model_dir(), range(3)))
    assert results == [target] * 3
    assert tiny_model.is_tiny_model(target)
    assert os.listdir(tmp_path) == [target.name]


def test_cache_dir_fallbacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EXPEDITOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "expeditor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "expeditor"


def test_make_tiny_model_target_rules(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_tiny_model(empty, seed=1) == empty and tiny_model.is_tiny_model(empty)
    make_tiny_model(empty, arch="qwen3", seed=2)  # an earlier tiny model is replaced
    assert tiny_model.read_marker(empty) == {
        "arch": "qwen3",
        "seed": 2,
        "size": "tiny",
        "format_version": tiny_model.FORMAT_VERSION,
    }
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model(foreign)
    assert os.listdir(foreign) == ["keep.txt"]
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    assert sorted(os.listdir(tmp_path)) == ["empty", "foreign"]


def test_cli_make_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    result = runner.invoke(app, ["make-tiny-model", str(out), "--arch", "qwen2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert str(out) in result.stderr.replace("\n", "")
    assert tiny_model.read_marker(out) == {
        "arch": "qwen2",
        "seed": 3,
        "size": "tiny",
        "format_version": tiny_model.FORMAT_VERSION,
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(out).encode("a") == [1, 3 + ord("a")]


def test_cli_make_tiny_model_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a tiny model" in result.stderr
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--arch", "gpt2"])
    assert result.exit_code == 2


# The small preset: 4 layers, hidden 256, GQA 8/2 heads of 32, MLP 1024.


@pytest.fixture(scope="module", params=DENSE)
def small(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """(arch, directory, model), the small preset built and loaded once per arch."""
    arch = request.param
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp)
        path = make_tiny_model(tmp_path_factory.mktemp(arch) / "small", arch=arch, size="small")
        yield arch, path, AutoModelForCausalLM.from_pretrained(path).eval()


def test_small_preset_has_declared_shapes(small: Any) -> None:
    arch, path, model = small
    config = model.config
    assert type(config).__name__ == CONFIG_CLASS[arch]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        256,
        4,
        1024,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 32)
    assert config.vocab_size == tiny_model.VOCAB_SIZE
    assert len(AutoTokenizer.from_pretrained(path)) == 259
    weights = load_file(path / "model.safetensors")
    assert set(weights) == set(model.state_dict())
    assert weights["model.layers.3.self_attn.q_proj.weight"].shape == (256, 256)
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (64, 256)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (256, 1024)
    assert 3.9e6 < sum(t.numel() for t in weights.values()) < 4.0e6
    assert tiny_model.read_marker(path) == {
        "arch": arch,
        "seed": 0,
        "size": "small",
        "format_version": tiny_model.FORMAT_VERSION,
    }


def test_small_preset_is_deterministic(small: Any, tmp_path: Path) -> None:
    arch, path, _model = small
    again = make_tiny_model(tmp_path / "again", arch=arch, size="small")
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in path.iterdir())
    for file in path.iterdir():
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name
    other = make_tiny_model(tmp_path / "other", arch=arch, seed=1, size="small")
    assert (other / "model.safetensors").read_bytes() != (path / "model.safetensors").read_bytes()


def test_small_preset_greedy_is_not_degenerate(small: Any) -> None:
    _arch, path, model = small
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) >= 4 and len(set(new)) >= 4, (prompt, new)
        assert all(token == 2 or 3 <= token < 259 for token in new)


def test_small_preset_engine_matches_transformers(small: Any) -> None:
    _arch, path, model = small
    prompts = [[1, *(3 + b for b in text.encode())] for text in PROMPTS[:2]]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    with LLM(path, device="cpu", dtype=torch.float32, max_model_len=64, num_gpu_blocks=32) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert [c.token_ids for c in outputs] == expected


def test_default_model_dir_small_and_bench_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPEDITOR_CACHE_DIR", str(tmp_path))
    small_dir = default_model_dir(size="small")
    assert small_dir == tmp_path / f"small-llama-s0-v{tiny_model.FORMAT_VERSION}"
    assert tiny_model.read_marker(small_dir)["size"] == "small"  # type: ignore[index]
    assert _checkpoint("small") == small_dir
    assert _checkpoint(None) == _checkpoint("tiny") == default_model_dir()
    assert _checkpoint("./small") == Path("small")  # a directory, not the preset
    assert sorted(os.listdir(tmp_path)) == [small_dir.name, default_model_dir().name]
    with pytest.raises(ValueError, match="unknown size"):
        default_model_dir(size="huge")
    with pytest.raises(ValueError, match="unknown size"):
        make_tiny_model(tmp_path / "x", size="huge")


def test_cli_make_tiny_model_small(tmp_path: Path) -> None:
    out = tmp_path / "small"
    result = runner.invoke(app, ["make-tiny-model", str(out), "--size", "small", "--arch", "qwen3"])
    assert result.exit_code == 0, result.output
    assert "wrote small qwen3 model" in result.stderr
    assert tiny_model.read_marker(out) == {
        "arch": "qwen3",
        "seed": 0,
        "size": "small",
        "format_version": tiny_model.FORMAT_VERSION,
    }
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--size", "huge"])
    assert result.exit_code == 2
