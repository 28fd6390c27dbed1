"""The in-process engine: text prompts, sampling, stop strings, logprobs, rejection."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from expeditor.llm import LLM
from gpu_worker.tiny_model import BOS_ID
from scheduler_svc.core.request import RejectedError
from shared.sampling import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(model: Path) -> Path:
    return model  # the session's tiny llama (tests/conftest.py)


@pytest.fixture
def make_llm(checkpoint: Path) -> Iterator:
    made: list[LLM] = []

    def make(**config: object) -> LLM:
        device = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")
        # float32 on every device: on CUDA the engine would default to bf16, where a
        # seeded draw may differ with the batch's shape, which these tests forbid.
        llm = LLM(checkpoint, device=device, dtype=torch.float32, max_model_len=256, **config)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


def test_text_prompts_round_trip(make_llm, checkpoint: Path) -> None:
    llm = make_llm(num_gpu_blocks=64)
    out = llm.generate(["Hello, world", "héllo ✓"], SamplingParams(temperature=0.0, max_tokens=6))
    reference = AutoTokenizer.from_pretrained(checkpoint)
    for completion, prompt in zip(out, ["Hello, world", "héllo ✓"], strict=True):
        assert completion.prompt_token_ids[0] == BOS_ID
        assert completion.prompt_token_ids == reference(prompt)["input_ids"]
        assert llm.tokenizer.decode(completion.prompt_token_ids, skip_special_tokens=True) == prompt
        assert len(completion.token_ids) <= 6
        expected_text = llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == expected_text
    # Special tokens written in the text are special tokens, as transformers reads them.
    specials = "<s>inline</s> specials"
    ids = llm.encode(specials)
    assert ids == reference(specials)["input_ids"]
    assert ids[:2] == [BOS_ID, BOS_ID] and ids.count(2) == 1  # <s> and </s> are one id each


def test_seeded_request_is_batch_independent(make_llm) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    prompt = [1, 72, 101, 108, 108, 111]
    alone = make_llm(num_gpu_blocks=64).generate([prompt], params)[0].token_ids

    rng = random.Random(0)
    others = [[1] + [rng.randrange(3, 259) for _ in range(rng.randint(3, 40))] for _ in range(7)]
    noisy = SamplingParams(temperature=1.0, max_tokens=20)
    # A small pool and token budget: the seeded request is chunked and preempted.
    busy = make_llm(num_gpu_blocks=24, block_size=4, max_num_batched_tokens=16, watermark=0.0)
    out = busy.generate([*others[:3], prompt, *others[3:]], [noisy] * 3 + [params] + [noisy] * 4)
    assert busy.scheduler.preemptions["recompute"] + busy.scheduler.preemptions["swap"] > 0
    assert out[3].token_ids == alone
    again = make_llm(num_gpu_blocks=64).generate([prompt], params)[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=16)
    assert make_llm(num_gpu_blocks=64).generate([prompt], other_seed)[0].token_ids != alone


def test_seeded_samples_differ_from_each_other(make_llm) -> None:
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12)
    completion = make_llm(num_gpu_blocks=64).generate([[1, 65, 66, 67]], params)[0]
    streams = [tuple(s.token_ids) for s in completion.samples]
    assert len(set(streams)) == 3


def test_stop_string_ends_generation_at_its_first_occurrence(make_llm) -> None:
    llm = make_llm(num_gpu_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    full = llm.generate(["The stop test"], greedy)[0]
    assert len(full.text) >= 6
    stop = full.text[3:5]
    cut = full.text.find(stop)
    stopped = llm.generate(
        ["The stop test"], SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)
    # A stop string ends the sample after the next step was planned: generate() still
    # applies that step, so nothing is left in flight or on the runner.
    assert not llm.scheduler.inflight and not llm.engine.futures()
    assert llm.runner.state.seqs == {}


def test_logprobs_are_returned_per_token(make_llm) -> None:
    llm = make_llm(num_gpu_blocks=64)
    out = llm.generate([[1, 70, 71]], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0]
    assert out.samples[0].logprobs is not None and len(out.samples[0].logprobs) == 5
    for token, entry in zip(out.token_ids, out.samples[0].logprobs, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert entry[token] == max(entry.values())  # greedy picks the most likely
        assert all(v <= 0.0 for v in entry.values())
    plain = llm.generate([[1, 70, 71]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert plain.samples[0].logprobs is None


def test_min_tokens_and_ignore_eos(make_llm) -> None:
    llm = make_llm(num_gpu_blocks=64)
    eos = llm.runner.eos_token_ids
    # Make EOS the first choice: a stop token list holding the greedy first token.
    first = llm.generate([[1, 80, 81]], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids[
        0
    ]
    stop_now = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,))
    assert llm.generate([[1, 80, 81]], stop_now)[0].token_ids == [first]
    delayed = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,), min_tokens=3)
    out = llm.generate([[1, 80, 81]], delayed)[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]
    assert eos == [2]


def test_rejection_names_the_prompt(make_llm) -> None:
    llm = make_llm(num_gpu_blocks=64)
    with pytest.raises(RejectedError, match=r"prompt 1: .*max_model_len"):
        llm.generate([[1, 2, 3], [1] * 300], SamplingParams(max_tokens=4))
    assert not llm.has_work()
    with pytest.raises(TypeError):
        llm.generate("not a list")  # type: ignore[arg-type]


def test_every_eos_id_of_the_generation_config_ends_generation(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Models such as Llama 3 list several EOS ids in generation_config.json."""
    import json
    import shutil

    model = tmp_path / "multi-eos"
    shutil.copytree(checkpoint, model)
    prompt = [1, 90, 91, 92]
    with LLM(model, device="cpu", num_gpu_blocks=64) as llm:
        tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids
    assert 2 not in tokens[:3]
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, tokens[2]]
    (model / "generation_config.json").write_text(json.dumps(generation))
    with LLM(model, device="cpu", num_gpu_blocks=64) as llm:
        assert llm.runner.eos_token_ids == [2, tokens[2]]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert out.token_ids == tokens[:3] and out.finish_reason == "stop"
        kept = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        )
        assert kept[0].token_ids == tokens


def top_tokens(entry: dict[int, float], k: int) -> list[int]:
    """The ``k`` most likely tokens of a logprobs entry, best first."""
    return sorted(entry, key=entry.__getitem__, reverse=True)[:k]


def test_logprobs_of_forked_samples_belong_to_each_sample(make_llm) -> None:
    llm = make_llm(num_gpu_blocks=64)
    # A high temperature spreads the draws, so the samples' first tokens differ; the
    # logprobs are the model's (before temperature) whatever it is.
    params = SamplingParams(temperature=5.0, seed=3, n=3, max_tokens=5, logprobs=2)
    completion = llm.generate([[1, 70, 71, 72]], params)[0]
    assert len({s.token_ids[0] for s in completion.samples}) > 1
    fork_top: set[tuple[int, float]] = set()
    for sample in completion.samples:
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
            # The 2 most likely tokens, plus the sample's own token when it is not one.
            assert token in entry and set(entry) - set(top_tokens(entry, 2)) <= {token}, entry
        # Every first token was drawn from one row, the fork step's: the same top 2.
        first = sample.logprobs[0]
        fork_top |= {(t, first[t]) for t in top_tokens(first, 2)}
    assert len(fork_top) == 2
