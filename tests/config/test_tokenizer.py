"""The one tokenizer loader (shared/tokenizer.py) gives the ids transformers'
AutoTokenizer gives for the same checkpoint, special tokens included, whatever its
tokenizer_config.json says about BOS and EOS (with a tokenizer.json, transformers goes
by its post-processor); and LLM, the scheduler daemon and the gateway, which all load
it, give the same ids for the same prompt."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from expeditor.gateway.model import ServedModel
from expeditor.llm import LLM
from gpu_worker.tiny_model import ARCHS, BOS_ID, EOS_ID
from ipc.client import AsyncClient
from scheduler_svc.launch import running_server
from shared.tokenizer import encode_ids, load_tokenizer

TEXTS = [
    "Hello, world",
    "héllo wörld ✓ 日本語 🎉",
    "<s>already a BOS</s> and an EOS in the text",
    "  leading spaces, trailing\n",
    "",
]


def _variant(source: Path, target: Path, **changes: Any) -> Path:
    """A copy of the checkpoint ``source`` with its tokenizer_config.json changed (a
    value None removes the key)."""
    shutil.copytree(source, target)
    path = target / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return target


def _agree(model: Path) -> list[list[int]]:
    """Each text's ids from load_tokenizer through encode_ids, checked against
    AutoTokenizer's."""
    ours = load_tokenizer(model)
    reference = AutoTokenizer.from_pretrained(model)
    got = []
    for text in TEXTS:
        ids = encode_ids(ours, text)
        assert ids == reference(text)["input_ids"], (model.name, text)
        plain = encode_ids(ours, text, add_special_tokens=False)
        assert plain == reference(text, add_special_tokens=False)["input_ids"], (model.name, text)
        got.append(ids)
    return got


class _OldTokenizer:
    """A tokenizer of the tokenizers releases before ``encode_batch_fast``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.encode_batch = tokenizer.encode_batch


def test_encode_ids_is_the_tokenizers_encode(model: Path) -> None:
    """The ids of ``Tokenizer.encode``, with or without special tokens, for short and
    long texts, and through ``encode_batch`` where ``encode_batch_fast`` is missing."""
    tokenizer = load_tokenizer(model)
    old = _OldTokenizer(tokenizer)
    for text in [*TEXTS, "a long text, " * 5000]:
        for special in (True, False):
            want = tokenizer.encode(text, add_special_tokens=special).ids
            assert encode_ids(tokenizer, text, add_special_tokens=special) == want
            assert encode_ids(old, text, add_special_tokens=special) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tiny_checkpoints_tokenize_as_transformers_does(
    arch: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    for ids in _agree(tiny_checkpoint(arch)):
        assert ids[0] == BOS_ID


@pytest.mark.parametrize(
    "changes",
    [
        {"add_eos_token": True},
        {"add_bos_token": False},
        {"add_bos_token": False, "add_eos_token": True},
        {"add_bos_token": None, "add_eos_token": None},
    ],
)
def test_bos_and_eos_are_tokenizer_json_s_as_for_transformers(
    model: Path, tmp_path: Path, changes: dict[str, Any]
) -> None:
    """tokenizer.json's post-processor prepends the BOS; the flags of
    tokenizer_config.json change nothing, for transformers as for the loader."""
    for text, ids in zip(TEXTS, _agree(_variant(model, tmp_path / "m", **changes)), strict=True):
        body = load_tokenizer(model).encode(text, add_special_tokens=False).ids
        assert ids == [BOS_ID, *body]


def test_a_checkpoint_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_llm_the_daemon_and_the_gateway_give_the_same_ids(model: Path, tmp_path: Path) -> None:
    """The same prompts in process, sent to the server as text, and tokenized by the
    gateway (for /tokenize and chat) from the checkpoint the server reports; with a
    tokenizer_config.json whose flags disagree with tokenizer.json (which wins)."""
    checkpoint = _variant(model, tmp_path / "eos", add_eos_token=True)
    with LLM(checkpoint, device="cpu", num_gpu_blocks=32) as llm:
        in_process = [llm.encode(text) for text in TEXTS]

    async def served(address: str) -> tuple[list[list[int]], list[list[int]]]:
        async with AsyncClient(address, timeout=60) as client:
            done = await asyncio.gather(
                *(client.generate(text, max_tokens=1, temperature=0.0) for text in TEXTS)
            )
            gateway = ServedModel.from_inspect(await client.inspect(), "", "")
        by_gateway = [gateway.encode(text, add_special_tokens=True) for text in TEXTS]
        return [c.prompt_token_ids for c in done], by_gateway

    with running_server(checkpoint, "--num-gpu-blocks", "32") as (address, _):
        by_daemon, by_gateway = asyncio.run(served(address))
    reference = AutoTokenizer.from_pretrained(checkpoint)
    expected = [reference(text)["input_ids"] for text in TEXTS]
    assert all(
        ids[0] == BOS_ID and ids.count(EOS_ID) == ("</s>" in text)
        for ids, text in zip(expected, TEXTS, strict=True)
    )
    assert in_process == by_daemon == by_gateway == expected
