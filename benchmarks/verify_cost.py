"""What a verify step's extra rows cost: one forward over ``--seqs`` sequences at
``--context`` keys with 1, 2, 3 and 5 rows a sequence (a decode, and verify steps of 1,
2 and 4 proposals), then the LM head and argmax over those rows; in process, through
``ModelRunner.forward_only`` over the runner's own cache (the contexts prefilled once,
random tokens), the row counts interleaved, medians of ``--repeat``.

    .venv/bin/python benchmarks/verify_cost.py [--model smollm2-135m-instruct] \
        [--seqs 8] [--context 400] [--repeat 7] [--profile]

``--profile``: torch's operator table for three forwards at 1 and 3 rows (the native
attention kernel, called through ctypes, is not an operator: it is the forward's time
the table does not account for).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from expeditor import LLM
from gpu_worker.step_inputs import StepInputs

ROWS = (1, 2, 3, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    per_seq = -(-(args.context + max(ROWS)) // 16)
    llm = LLM(
        args.model,
        device="cpu",
        max_model_len=per_seq * 16,
        max_num_seqs=args.seqs,
        num_gpu_blocks=args.seqs * per_seq,
    )
    runner = llm.runner
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(args.seqs)]
    g = torch.Generator().manual_seed(0)
    for table in tables:
        tokens = torch.randint(100, 40_000, (args.context,), generator=g).tolist()
        runner.forward_only(StepInputs(tokens, [0], [table], [0, args.context]))

    def step(rows: int) -> StepInputs:
        starts = [args.context] * args.seqs
        loc = list(range(0, rows * args.seqs + 1, rows))
        return StepInputs([123] * (rows * args.seqs), starts, tables, loc)

    times: dict[int, tuple[list[float], list[float]]] = {r: ([], []) for r in ROWS}
    for _ in range(args.repeat):
        for rows in ROWS:
            start = time.perf_counter()
            hidden = runner.forward_only(step(rows))
            mid = time.perf_counter()
            with torch.inference_mode():
                runner.logits(hidden).argmax(-1)
            times[rows][0].append(mid - start)
            times[rows][1].append(time.perf_counter() - mid)
    print(
        f"{args.model}: {args.seqs} sequences at context {args.context}, {runner.dtype}, "
        f"{torch.get_num_threads()} threads, {runner.attention_backend.name} attention"
    )
    for rows, (forward, head) in times.items():
        print(
            f"  {rows} rows a sequence ({rows * args.seqs} tokens): forward "
            f"{1e3 * statistics.median(forward):6.1f} ms, LM head and argmax "
            f"{1e3 * statistics.median(head):5.1f} ms"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for rows in (1, 3):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    runner.forward_only(step(rows))
            print(f"== three forwards at {rows} rows a sequence")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    llm.close()


if __name__ == "__main__":
    main()
