"""What structured output costs: the same requests on the real SmolLM2 checkpoint, each
asking for a JSON object of a schema drawn from the seeded family
(expeditor/bench/schema_family.py), constrained to it and unconstrained, through the
in-process engine, interleaved rounds, medians of output tokens per second. Each
unconstrained request generates as many tokens as its constrained run did (ignoring
EOS), so both runs do the same work but for the masks.

Constrained requests run with overlapped scheduling one step behind (their next mask
needs the token in flight); ``--overlap off`` measures the two runs without overlap.

    .venv/bin/python benchmarks/structured_cost.py [--requests 64] [--max-tokens 96] \
        [--rounds 3] [--overlap on|off] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from expeditor.llm import LLM
from gpu_worker.model_source import resolve_model
from shared.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.schemas import schemas

NAME = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overlap", choices=["on", "off"], default="on")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(NAME))
    family = schemas(seed=7, count=args.requests)
    prompts = []
    for schema in family:
        messages = [{"role": "user", "content": f"A JSON object for: {json.dumps(schema)}"}]
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True
        )
        prompts.append(list(rendered["input_ids"]))
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                       structured_outputs={"json": schema})
        for schema in family
    ]  # fmt: skip
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    tokens: dict[str, int] = {}
    with LLM(NAME, device="cpu", max_num_seqs=64,
             overlap_scheduling=args.overlap == "on") as llm:  # fmt: skip
        # The constrained outputs' lengths: the unconstrained run generates as many
        # tokens per request (ignore_eos), so both do the same work but for the masks.
        lengths = [len(c.token_ids) for c in llm.generate(prompts, constrained)]
        kinds = {
            "unconstrained": [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
            ],
            "constrained": constrained,
        }
        for _ in range(args.rounds):
            for kind, params in kinds.items():
                start = time.perf_counter()
                done = llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
                tokens[kind] = sum(len(c.token_ids) for c in done)
                rates[kind].append(tokens[kind] / elapsed)
    medians = {kind: statistics.median(values) for kind, values in rates.items()}
    result = {
        "requests": args.requests,
        "overlap": args.overlap,
        "output_tokens": tokens,
        "tok_per_s": {k: [round(v, 1) for v in values] for k, values in rates.items()},
        "median_tok_per_s": {k: round(v, 1) for k, v in medians.items()},
        "ratio": round(medians["constrained"] / medians["unconstrained"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    for kind in rates:
        print(f"{kind:>14}: {medians[kind]:7.1f} out tok/s (runs {rates[kind]}), "
              f"{tokens[kind]} tokens")  # fmt: skip
    print(f"constrained / unconstrained: {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
