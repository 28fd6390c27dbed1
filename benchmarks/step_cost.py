"""Cost of one decode step and one prefill chunk: the in-process engine against
transformers' own forward with its KV cache, same checkpoint, batch, dtype and threads.

    .venv/bin/python benchmarks/step_cost.py [--model DIR|small] [--batches 1,16,64,256]
        [--chunk 512] [--prefill-batch 4] [--repeat 5] [--threads N] [--json]

Checkpoint: ``--model DIR`` (default: the embedded tiny model); ``--model small`` is
the tiny model's ``size="small"`` preset where this checkout has one. CPU, float32,
``torch.set_num_threads(--threads)`` for both sides (default cores - 1: what a worker
daemon keeps unless its start-up timing shows every core clearly faster, as it does for
the small preset on 2 cores; see gpu_worker/threads.py).

Decode, per batch size B: B prompts of 64..512 tokens (uniform, seeded) go through
the engine (``expeditor.llm.LLM``, greedy, ignore_eos, prefix caching off) until
every sequence has its prompt computed and is decoding. transformers gets the very
same contexts (each sequence's tokens but the last, which is the token to feed) as a
left-padded batch with an attention mask, prefilled into a ``DynamicCache`` (in
sub-batches, concatenated; not timed), as ``generate`` does. Timed, interleaved
(the order alternating each repeat) after one untimed warm-up step of each:

* engine: ``ModelRunner.execute`` of the decode-only plan (plan state, input
  packing, the forward over the paged cache, LM head over the B last positions, the
  greedy sampler); the scheduler's own work in ``LLM.step`` is not timed. The
  "forward" column is its ``StepTiming.forward_s``: the model body only.
* transformers: ``model(input_ids [B, 1], attention_mask, position_ids,
  cache=cache, logits_to_keep=1)`` with sdpa attention, then ``argmax``:
  the forward, the LM head on the last position and the greedy pick, like the engine.

Each timed step appends one token on both sides, so the contexts stay equal.

Prefill: ``--prefill-batch`` (4) fresh prompts of ``--chunk`` (512) tokens each, one
step: the engine computes them as one packed chunk of 4 x 512 tokens
(``ModelRunner.execute``, sampling each sequence's first token); transformers runs
one forward over the [4, 512] batch (equal lengths: no padding) that builds its
``DynamicCache``, LM head on the last position, argmax. New random prompts every
repeat on both sides.

Reported: the median ms of ``--repeat`` (5) runs per measurement and the ratio
engine / transformers (below 1: the engine is faster). "same argmax": the share of
sequences whose warm-up decode token is the same on both sides (a check that both
hold the same contexts). Quick check (seconds on the tiny model):

    .venv/bin/python benchmarks/step_cost.py --batches 1,16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from expeditor.llm import LLM
from gpu_worker.tiny_model import default_model_dir
from ipc.schema import BatchPlan, StepResult
from shared.sampling import SamplingParams

CONTEXT_RANGE = (64, 512)
HF_PREFILL_SUB_BATCH = 16
PAD_ID = 0


def resolve_model(model: str | None) -> Path:
    """A checkpoint directory: the tiny model, its small preset, or ``model`` itself."""
    if model is None:
        return default_model_dir()
    if model == "small" and not Path(model).exists():
        preset: Any = default_model_dir  # size= is newer than some checkouts
        try:
            return Path(preset(size="small"))
        except (TypeError, ValueError):
            raise SystemExit("--model small: no small tiny-model preset here") from None
    return Path(model)


class EngineTimer:
    """Wraps ``llm.runner.execute`` and records the last call's cost and shape."""

    def __init__(self, llm: LLM) -> None:
        self.inner = llm.runner.execute
        self.total_s = 0.0
        self.forward_s = 0.0
        self.num_seqs = 0
        self.num_tokens = 0
        llm.runner.execute = self.execute  # type: ignore[method-assign]

    def execute(self, plan: BatchPlan) -> StepResult:
        started = time.perf_counter()
        result = self.inner(plan)
        self.total_s = time.perf_counter() - started
        self.forward_s = result.timing.forward_s
        self.num_seqs = len(plan.num_scheduled_tokens)
        self.num_tokens = plan.total_tokens
        return result


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """BOS then random byte tokens (ids 3..258 in the tiny tokenizer)."""
    return [1] + [rng.randrange(3, min(259, vocab)) for _ in range(length - 1)]


def all_decoding(llm: LLM, batch: int) -> bool:
    """Every one of the batch's sequences has all but its last (sampled) token computed."""
    seqs = llm.runner.state.seqs.values()
    return len(seqs) == batch and all(s.num_computed_tokens == len(s.token_ids) - 1 for s in seqs)


def abort_all(llm: LLM) -> None:
    for request_id in list(llm.outputs.requests):
        llm.scheduler.abort(request_id)
        llm.outputs.requests.pop(request_id, None)
    llm.finished.clear()


def hf_prefill_cache(
    model: PreTrainedModel, contexts: list[list[int]]
) -> tuple[DynamicCache, torch.Tensor]:
    """The left-padded contexts' KV in one DynamicCache, and their attention mask."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(contexts), width), dtype=torch.int64)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context)
        mask[row, width - len(context) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    with torch.inference_mode():
        for lo in range(0, len(contexts), HF_PREFILL_SUB_BATCH):
            hi = lo + HF_PREFILL_SUB_BATCH
            out = model(
                input_ids=ids[lo:hi],
                attention_mask=mask[lo:hi],
                position_ids=positions[lo:hi],
                use_cache=True,
                logits_to_keep=1,
            )
            parts.append([(layer.keys, layer.values) for layer in out.cache.layers])
    layers = [
        (
            torch.cat([part[i][0] for part in parts]).clone(),
            torch.cat([part[i][1] for part in parts]).clone(),
        )
        for i in range(len(parts[0]))
    ]
    return DynamicCache(layers, config=model.config), mask


def hf_decode_step(
    model: PreTrainedModel,
    cache: DynamicCache,
    mask: torch.Tensor,
    next_tokens: torch.Tensor,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One timed token per sequence; returns (seconds, the new mask, the argmax tokens)."""
    mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)
    positions = (mask.sum(-1, keepdim=True) - 1).to(torch.int64)
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(
            input_ids=next_tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens = out.logits[:, -1].argmax(dim=-1)
        elapsed = time.perf_counter() - started
    return elapsed, mask, tokens


def bench_decode(
    llm: LLM, hf: PreTrainedModel, batch: int, repeat: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + batch)
    vocab = llm.runner.vocab_size
    timer = EngineTimer(llm)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256 + repeat)
    for index in range(batch):
        length = rng.randint(*CONTEXT_RANGE)
        llm.add_request(f"d{batch}-{index}", random_prompt(rng, length, vocab), params)
    while not all_decoding(llm, batch):
        llm.step()
    seqs = list(llm.runner.state.seqs.values())
    contexts = [s.token_ids[:-1] for s in seqs]
    cache, mask = hf_prefill_cache(hf, contexts)
    next_tokens = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64)
    context_lens = [len(c) for c in contexts]

    def engine_step() -> tuple[float, float]:
        llm.step()
        if timer.num_seqs != batch or timer.num_tokens != batch:
            raise RuntimeError(
                f"expected a decode-only step of {batch}, got {timer.num_seqs} "
                f"sequences / {timer.num_tokens} tokens"
            )
        return timer.total_s, timer.forward_s

    engine_step()  # warm-up; then check both sides pick the same greedy tokens
    _, mask, next_tokens = hf_decode_step(hf, cache, mask, next_tokens)
    engine_tokens = [s.token_ids[-1] for s in seqs]
    pairs = zip(engine_tokens, next_tokens.tolist(), strict=True)
    agreement = sum(a == b for a, b in pairs) / batch

    def hf_step() -> float:
        nonlocal mask, next_tokens
        elapsed, mask, next_tokens = hf_decode_step(hf, cache, mask, next_tokens)
        return elapsed

    engine_ms, forward_ms, hf_ms = interleave(repeat, engine_step, hf_step)
    abort_all(llm)
    llm.runner.execute = timer.inner  # type: ignore[method-assign]
    return summarize(
        "decode",
        batch,
        batch,
        engine_ms,
        forward_ms,
        hf_ms,
        mean_context=statistics.fmean(context_lens),
        greedy_agreement=agreement,
    )


def interleave(
    repeat: int,
    engine_step: Callable[[], tuple[float, float]],
    hf_step: Callable[[], float],
) -> tuple[list[float], list[float], list[float]]:
    """``repeat`` rounds of one engine step and one transformers step, taking turns at
    going first; milliseconds: the engine's totals, its forwards, transformers'."""
    engine_ms: list[float] = []
    forward_ms: list[float] = []
    hf_ms: list[float] = []
    for r in range(repeat):
        for side in ("engine", "hf") if r % 2 == 0 else ("hf", "engine"):
            if side == "engine":
                total, forward = engine_step()
                engine_ms.append(total * 1e3)
                forward_ms.append(forward * 1e3)
            else:
                hf_ms.append(hf_step() * 1e3)
    return engine_ms, forward_ms, hf_ms


def bench_prefill(
    llm: LLM, hf: PreTrainedModel, num_prompts: int, chunk: int, repeat: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed * 7 + chunk)
    vocab = llm.runner.vocab_size
    timer = EngineTimer(llm)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    counter = 0

    def engine_step() -> tuple[float, float]:
        nonlocal counter
        for _ in range(num_prompts):
            llm.add_request(f"p-{counter}", random_prompt(rng, chunk, vocab), params)
            counter += 1
        llm.step()
        if timer.num_seqs != num_prompts or timer.num_tokens != num_prompts * chunk:
            raise RuntimeError(
                f"expected one prefill step of {num_prompts} x {chunk} tokens, got "
                f"{timer.num_seqs} sequences / {timer.num_tokens} tokens"
            )
        measured = timer.total_s, timer.forward_s
        while llm.has_work():  # max_tokens=1: they finish; nothing else runs
            llm.step()
        llm.finished.clear()
        return measured

    def hf_step() -> float:
        ids = torch.tensor([random_prompt(rng, chunk, vocab) for _ in range(num_prompts)])
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            started = time.perf_counter()
            out = hf(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(dim=-1)
            return time.perf_counter() - started

    engine_step()  # warm-up
    hf_step()
    engine_ms, forward_ms, hf_ms = interleave(repeat, engine_step, hf_step)
    llm.runner.execute = timer.inner  # type: ignore[method-assign]
    return summarize(
        "prefill",
        num_prompts,
        num_prompts * chunk,
        engine_ms,
        forward_ms,
        hf_ms,
        mean_context=0.0,
        greedy_agreement=None,
    )


def summarize(
    kind: str,
    batch: int,
    tokens: int,
    engine_ms: list[float],
    forward_ms: list[float],
    hf_ms: list[float],
    *,
    mean_context: float,
    greedy_agreement: float | None,
) -> dict[str, Any]:
    engine = statistics.median(engine_ms)
    hf = statistics.median(hf_ms)
    return {
        "kind": kind,
        "batch": batch,
        "tokens": tokens,
        "mean_context": mean_context,
        "engine_ms": engine,
        "engine_forward_ms": statistics.median(forward_ms),
        "hf_ms": hf,
        "ratio": engine / hf,
        "greedy_agreement": greedy_agreement,
        "engine_ms_all": engine_ms,
        "hf_ms_all": hf_ms,
    }


def agree(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir, or 'small'")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batch sizes")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per prompt")
    parser.add_argument("--prefill-batch", type=int, default=4, help="prompts in the chunk")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1 or args.repeat < 1 or args.chunk < 2:
        parser.error("--batches, --repeat and --chunk must be positive (chunk >= 2)")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)

    block_size = 16
    longest = CONTEXT_RANGE[1] + 256 + args.repeat + 2
    blocks_per_seq = -(-max(longest, args.chunk + 1) // block_size) + 1
    num_blocks = int(max(max(batches), args.prefill_batch) * blocks_per_seq * 1.05) + 64
    with LLM(
        model_dir,
        device="cpu",
        dtype=torch.float32,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=max(max(batches), args.prefill_batch),
        max_num_batched_tokens=max(8192, args.prefill_batch * args.chunk, max(batches)),
        enable_prefix_caching=False,
    ) as llm:
        hf = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        hf.eval()
        rows = [bench_decode(llm, hf, b, args.repeat, args.seed) for b in batches]
        rows.append(bench_prefill(llm, hf, args.prefill_batch, args.chunk, args.repeat, args.seed))
    result = {
        "model": str(args.model or "tiny"),
        "model_type": hf.config.model_type,
        "parameters": sum(p.numel() for p in hf.parameters()),
        "device": "cpu",
        "dtype": "float32",
        "threads": args.threads,
        "repeat": args.repeat,
        "timed": {
            "engine": "ModelRunner.execute: plan state, input packing, forward over the "
            "paged cache, LM head on the sampled positions, greedy sampler",
            "engine_forward": "StepTiming.forward_s: the model body only (no LM head)",
            "hf": "AutoModelForCausalLM forward (sdpa, DynamicCache, logits_to_keep=1) + argmax",
        },
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model {result['model']} ({result['model_type']}, {result['parameters']:,} params), "
        f"cpu float32, {args.threads} thread(s), median of {args.repeat}\n"
        "engine = ModelRunner.execute incl. LM head + greedy sampling; "
        "hf = forward (sdpa, DynamicCache, logits_to_keep=1) + argmax"
    )
    print(
        f"{'step':8} {'batch':>5} {'tokens':>6} {'ctx':>6} {'engine ms':>10} "
        f"{'(fwd ms)':>9} {'hf ms':>9} {'ratio':>6} {'same argmax':>11}"
    )
    for row in rows:
        print(
            f"{row['kind']:8} {row['batch']:>5} {row['tokens']:>6} "
            f"{row['mean_context']:>6.0f} {row['engine_ms']:>10.2f} "
            f"{row['engine_forward_ms']:>9.2f} {row['hf_ms']:>9.2f} {row['ratio']:>6.2f} "
            f"{agree(row['greedy_agreement']):>11}"
        )


if __name__ == "__main__":
    main()
