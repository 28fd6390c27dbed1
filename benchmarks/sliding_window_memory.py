"""KV memory that one block table of whole blocks keeps for sliding-window layers.

With one block table per sequence for all layers (``free_out_of_window_blocks`` off), a
sequence of L tokens holds ceil(L / block_size) blocks in every layer. A sliding-window
layer only ever reads the last ``window`` keys, so it needs at most
ceil(window / block_size) + 1 of them (the window can straddle one more block). This
prints, for a checkpoint's config.json or for the layer layouts of well-known published
models, the share of the KV cache a long sequence holds beyond what its layers can
read: what giving back windowed blocks (every layer windowed) or layer groups (windowed
and full layers mixed, ``scheduler_svc/core/kv_groups.py``) recovers.

    .venv/bin/python benchmarks/sliding_window_memory.py                  # published layouts
    .venv/bin/python benchmarks/sliding_window_memory.py path/config.json ...
    .venv/bin/python benchmarks/sliding_window_memory.py --measure CHECKPOINT

``--measure`` runs a windowed checkpoint (e.g. ``expeditor make-tiny-model DIR --arch
mistral``, or ``--arch gemma2`` for one that mixes windowed and full layers, whose
cache is then laid out in layer groups) in process, with ``free_out_of_window_blocks``
off and on, on requests whose contexts reach ``--context-multiple`` times its window
through a fixed pool: what each sequence holds and what its layers read, counted from
the scheduler at every step (in blocks of every layer), and how many sequences ran at
once.

The published layouts are the layer counts, layer patterns and windows from each
model's config.json on the Hugging Face hub (facts; nothing is downloaded here).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

BLOCK_SIZE = 16
CONTEXTS = (4096, 8192, 32768, 131072)

PUBLISHED: dict[str, tuple[int, int, int]] = {
    # name: (layers, sliding layers, window)
    "Mistral-7B-v0.1 (every layer, 4096)": (32, 32, 4096),
    "gemma-2-9b (every other layer, 4096)": (42, 21, 4096),
    "gemma-3-27b (5 of 6 layers, 1024)": (62, 52, 1024),
    "gemma-3-4b (5 of 6 layers, 1024)": (34, 29, 1024),
}


def layout(config: dict[str, object]) -> tuple[int, int, int]:
    """(layers, sliding layers, window) of a transformers config.json."""
    layers = int(config["num_hidden_layers"])  # type: ignore[arg-type]
    window = config.get("sliding_window")
    if not window:
        return layers, 0, 0
    types = config.get("layer_types")
    if isinstance(types, list):
        sliding = sum(t == "sliding_attention" for t in types)
    elif config.get("model_type") == "qwen2":
        sliding = (
            0
            if not config.get("use_sliding_window")
            else layers
            - int(
                config.get("max_window_layers", layers)  # type: ignore[arg-type]
            )
        )
    else:
        sliding = layers  # mistral-style: every layer
    return layers, sliding, int(window)  # type: ignore[arg-type]


def held_share(layers: int, sliding: int, window: int, context: int) -> float:
    """Share of the blocks held for a ``context``-token sequence that no layer reads."""
    full_blocks = math.ceil(context / BLOCK_SIZE)
    needed_sliding = min(full_blocks, math.ceil(window / BLOCK_SIZE) + 1) if window else 0
    held = layers * full_blocks
    needed = (layers - sliding) * full_blocks + sliding * needed_sliding
    return (held - needed) / held


def read_blocks(computed: int, window: int) -> int:
    """Blocks holding the keys the next query (at position ``computed``) reads."""
    return computed // BLOCK_SIZE - max(0, computed - window + 1) // BLOCK_SIZE + 1


def measure(checkpoint: Path, multiple: float, num_requests: int, num_blocks: int) -> None:
    import random

    import torch

    from expeditor.llm import LLM
    from shared.sampling import SamplingParams

    config = json.loads((checkpoint / "config.json").read_text())
    layers, sliding, window = layout(config)
    context = round(multiple * window)
    output = 16
    rng = random.Random(0)
    prompts = [
        [1, *(rng.randrange(3, 259) for _ in range(context - output - 1))]
        for _ in range(num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    print(
        f"{checkpoint.name}: {layers} layers, {sliding} windowed ({window} keys); "
        f"{num_requests} requests reaching {context} tokens ({multiple:g} x window) through "
        f"{num_blocks} blocks of {BLOCK_SIZE}"
    )
    answers = {}
    for free in (False, True):
        llm = LLM(
            checkpoint, device="cpu", dtype=torch.float32, block_size=BLOCK_SIZE,
            num_gpu_blocks=num_blocks, max_num_seqs=num_requests,
            free_out_of_window_blocks=free, enable_prefix_caching=False,
        )  # fmt: skip
        assert window and llm.scheduler.kv.window == (window if free else 0)
        per_block = llm.runner.layout.num_layers / layers  # a block's share of the layers
        held = read = peak = 0
        final: list[tuple[int, int]] = []  # (held, read) of a sequence at its last step
        inner = llm.runner.execute

        def execute(plan, llm=llm, inner=inner, final=final, per_block=per_block):  # type: ignore[no-untyped-def]
            nonlocal held, read, peak
            running = llm.scheduler.running
            peak = max(peak, len(running))
            for seq in running:
                # After planning: the step's tokens count, its last query is at c - 1.
                # In blocks of every layer: the full layers read every block so far.
                last = seq.num_computed_tokens - 1
                reads = (
                    sliding * read_blocks(last, window)
                    + (layers - sliding) * (last // BLOCK_SIZE + 1)
                ) / layers
                holds = seq.num_device_blocks * per_block
                held += holds
                read += reads
                if seq.num_computed_tokens == context - 1:  # the last step it computes
                    final.append((holds, reads))
            return inner(plan)

        llm.runner.execute = execute  # type: ignore[method-assign]
        with llm:
            answers[free] = [c.token_ids for c in llm.generate(prompts, params)]
        last_held = sum(h for h, _ in final) / max(1, len(final))
        last_read = sum(r for _, r in final) / max(1, len(final))
        print(
            f"  free_out_of_window_blocks={str(free).lower():<5}  at most {peak:>3} "
            f"sequences at once; held but unread: {100 * (1 - read / held):5.1f}% over the "
            f"run, {100 * (1 - last_read / last_held):5.1f}% at the {context}-token context "
            f"({last_held:.1f} blocks held, {last_read:.1f} read)"
        )
    print(
        f"  layout arithmetic at {context} tokens: "
        f"{100 * held_share(layers, sliding, window, context):.1f}% held but unread "
        "(it counts ceil(window / block) + 1 blocks read, the most a window can straddle)"
    )
    print(f"  same tokens with and without: {answers[False] == answers[True]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", type=Path, help="config.json files")
    parser.add_argument("--measure", type=Path, help="a windowed checkpoint to run")
    parser.add_argument("--context-multiple", type=float, default=8.0)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-gpu-blocks", type=int, default=88)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.context_multiple, args.num_requests, args.num_gpu_blocks)
        return
    rows = dict(PUBLISHED)
    for path in args.configs:
        rows[str(path)] = layout(json.loads(path.read_text()))
    header = "".join(f"{c // 1024:>7}k" for c in CONTEXTS)
    print(f"KV blocks held but never read, block size {BLOCK_SIZE}, by context length")
    print(f"{'model':<44}{header}")
    for name, (layers, sliding, window) in rows.items():
        shares = "".join(f"{100 * held_share(layers, sliding, window, c):>7.1f}%" for c in CONTEXTS)
        print(f"{name:<44}{shares}")


if __name__ == "__main__":
    main()
