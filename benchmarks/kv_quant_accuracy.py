"""How close a quantized KV cache keeps the real model: SmolLM2-135M-Instruct through the
in-process engine over README.md's text, once per ``kv_cache_dtype``, against the run in
the model's dtype. Prints per cache dtype the bytes per block, the blocks a CPU worker's
default budget holds, the wall time, where each prompt's greedy continuation first
parts from the unquantized one, and the prompt tokens' logprob differences (teacher
forced: every position's logprob of the prompt's own next token).

    .venv/bin/python benchmarks/kv_quant_accuracy.py [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from expeditor.llm import LLM
from shared.sampling import SamplingParams

DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    text = (Path(__file__).parents[1] / "README.md").read_text()[:6000]
    prompts = [text[i : i + 1500] for i in range(0, 6000, 1500)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, prompt_logprobs=1)
    runs = {}
    for dtype in DTYPES:
        with LLM(args.model, kv_cache_dtype=dtype) as llm:
            began = time.perf_counter()
            runs[dtype] = llm.generate(prompts, params)
            seconds = time.perf_counter() - began
            layout = llm.runner.kv_cache.layout
            print(
                f"{dtype:9} backend {llm.runner.attention_backend.name:6} "
                f"bytes/block {layout.bytes_per_block:7} blocks {llm.runner.num_gpu_blocks:5} "
                f"{seconds:5.1f} s",
                flush=True,
            )
    for dtype in DTYPES[1:]:
        parts, gaps = [], []
        for base, quant in zip(runs["auto"], runs[dtype], strict=True):
            pairs = list(zip(base.token_ids, quant.token_ids, strict=False))
            parts.append(next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs)))
            entries = zip(
                base.prompt_logprobs.entries, quant.prompt_logprobs.entries,
                base.prompt_token_ids[1:], strict=True,
            )  # fmt: skip
            gaps += [abs(a[token] - b[token]) for a, b, token in entries]
        gaps.sort()
        print(
            f"{dtype:9} greedy first parts at {parts} of {args.new_tokens}; prompt-token "
            f"|dlogprob| median {statistics.median(gaps):.4f} p99 "
            f"{gaps[int(len(gaps) * 0.99)]:.4f} max {gaps[-1]:.4f} ({len(gaps)} tokens)"
        )


if __name__ == "__main__":
    main()
