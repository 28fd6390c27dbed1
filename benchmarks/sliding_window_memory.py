"""KV memory that expeditor's single block table keeps for sliding-window layers.

expeditor allocates one block table per sequence for all layers: a sequence of L tokens
holds ceil(L / block_size) blocks in every layer. A sliding-window layer only ever reads
the last ``window`` keys, so it needs at most ceil(window / block_size) + 1 of them
(the window can straddle one more block). This prints, for a checkpoint's config.json
or for the layer layouts of well-known published models, the share of the KV cache a
long sequence holds beyond what its layers can read: what a per-layer-group allocator
(vLLM's hybrid allocator) would give back.

    .venv/bin/python benchmarks/sliding_window_memory.py                  # published layouts
    .venv/bin/python benchmarks/sliding_window_memory.py path/config.json ...

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", type=Path, help="config.json files")
    args = parser.parse_args()
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
