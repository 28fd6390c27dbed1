"""The ``lookup`` bench workload: chat requests whose answers quote their prompts.

Each request asks the model to repeat a passage, to rewrite it with one word replaced,
or to copy it and add a sentence: the answer copies long runs of the prompt, the case
where prompt lookup's proposals are accepted (speculative decoding,
``num_speculative_tokens``). The passages are this module's own; the prompts go
through the checkpoint's chat template (plain text where it has none), so the
workload needs the model: ``expeditor bench --workload lookup`` passes its
``--model``. Requests end at EOS (``max_tokens`` is a budget past the passage's
length), so the outputs are the model's; greedy targets produce the same tokens with
or without proposals, and tokens/s compare directly.
"""

from __future__ import annotations

import random
from pathlib import Path

from expeditor.bench.workloads import BenchRequest, Workload, check_count

__all__ = ["PASSAGES", "lookup"]

PASSAGES = (
    "The harbour town wakes before dawn. Fishing boats leave in a line past the "
    "lighthouse, their engines low, and the gulls follow them out to the grey water. "
    "By seven the bakery on the quay has its first loaves in the window, and the "
    "ferry to the island sounds its horn twice before it casts off.",
    "To repot a plant, water it the day before so that the roots hold together. Choose "
    "a pot one size larger with a hole in the bottom, add a layer of fresh soil, and "
    "set the plant at the same depth as before. Fill the sides, press the soil down "
    "gently, and water it until the water runs out of the hole.",
    "The committee met on Tuesday to review the budget for the coming year. It agreed "
    "to repair the roof of the library, to extend the opening hours of the swimming "
    "pool in summer, and to buy two new buses for the school route. The plan for the "
    "new car park was sent back for another study of the costs.",
    "A good cup of tea starts with fresh water. Bring it just to the boil, warm the pot "
    "with a little of it, and pour the rest over one spoon of leaves for each cup. Let "
    "it stand for four minutes, stir once, and pour through a strainer. Milk, if you "
    "take it, goes in after the tea.",
    "The train from the capital crosses the river on an old iron bridge and then climbs "
    "slowly into the hills. Farms give way to pine forest, the air grows cooler, and "
    "small stations appear where nobody gets on or off. After three hours the line ends "
    "in a valley town with one hotel and a market on Saturdays.",
    "Our office will be closed on Monday for the public holiday. Orders placed over the "
    "weekend will be sent on Tuesday morning, and the support line will open again at "
    "nine o'clock. If your question is urgent, please write to us and include your "
    "order number, and we will answer as soon as we are back.",
    "The experiment measured how quickly the seeds grew under three kinds of light. Each "
    "tray held twenty seeds in the same soil and got the same water every morning. "
    "After two weeks the plants under blue light were the shortest but had the most "
    "leaves, while those under red light were tall and thin.",
    "Every member of the club may borrow up to four books at a time for three weeks. "
    "Books can be renewed once unless another member has asked for them. Late books "
    "cost ten cents a day, and a member with more than two late books may not borrow "
    "again until they are returned.",
)
"""The passages quoted (plain prose of ordinary words, some 60-70 words each)."""

_REPLACEMENTS = (
    ("the", "a"),
    ("and", "plus"),
    ("of", "from"),
    ("to", "toward"),
)

_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    'Rewrite the following text, replacing every "{old}" with "{new}". Change nothing '
    "else:\n\n{text}",
    "Copy the following text and then add one sentence at the end:\n\n{text}",
)


def lookup(
    num_requests: int,
    *,
    seed: int = 0,
    model: str | Path | None = None,
    max_output: int = 192,
) -> Workload:
    """All at t=0; each request a task over one passage, both drawn with ``seed``;
    ``max_tokens`` = ``max_output`` (the answers end at EOS before it). ``model``: the
    checkpoint whose tokenizer and chat template make the prompts (required)."""
    check_count(num_requests)
    if model is None:
        raise ValueError("workload 'lookup' needs the model (its tokenizer makes the prompts)")
    if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
        raise ValueError(f"max_output must be an integer >= 1, got {max_output!r}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        old, new = rng.choice(_REPLACEMENTS)
        text = rng.choice(_TASKS).format(text=rng.choice(PASSAGES), old=old, new=new)
        if tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if not isinstance(prompt, list):  # a BatchEncoding in newer transformers
                prompt = prompt["input_ids"]
        else:
            prompt = tokenizer.encode(text)
        requests.append(
            BenchRequest(f"lookup-{index}", list(prompt), max_output, 0.0, ignore_eos=False)
        )
    return Workload(
        "lookup",
        requests,
        f"{num_requests} chat requests at t=0, each asking to repeat, edit or extend a "
        f"passage of its prompt; up to {max_output} output tokens (they end at EOS)",
    )
