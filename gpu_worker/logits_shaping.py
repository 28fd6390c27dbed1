"""What a request's parameters do to its logits before a token is picked: allowed
tokens, bad words, logit bias and the presence, frequency and repetition penalties,
with vLLM's definitions, for a whole batch of rows in one pass.

In order, for each row ``r`` of float32 ``logits`` ``[R, V]`` (ids ``>= V`` are
ignored; the scheduler refuses them at admission):

1. **Allowed tokens** (``allowed_token_ids``): every other token gets ``-inf``.
2. **Bad words** (``bad_words_token_ids``): the host works out which last tokens to
   ban (:func:`bad_word_bans`: a one-token word always, a longer one where the output
   so far ends in the rest of it) and they join the row's masked ids.
3. **Logit bias**: ``logits[r, id] += bias``.
4. **Penalties**, over the row's history (:class:`History`): with ``seen`` the tokens
   of the prompt or the output so far and ``count`` each token's occurrences in the
   output, ``logit / repetition_penalty`` where ``seen`` and the logit is positive,
   ``logit * repetition_penalty`` where ``seen`` and it is not; then ``logit -=
   frequency_penalty * count + presence_penalty * (count > 0)``.

Rows without any of these are left as they are (and a batch without them costs
nothing). The host sends each kind's (row, token) pairs to the device in the sampler's
one non-blocking copy; nothing is read back. The penalties touch only the tokens a row
has seen (one entry per distinct token of its prompt and output, with its count in
the output), so their cost grows with the histories, not with the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from shared.sampling import SamplingParams

__all__ = ["History", "bad_word_bans", "shape_logits", "shaping_arrays"]


@dataclass(frozen=True, slots=True)
class History:
    """The tokens a row's penalties read: its sequence's prompt and output so far."""

    prompt: np.ndarray
    """The prompt's token ids (repeats allowed; the worker passes its distinct ids, kept
    with the sequence: only whether a token is there counts)."""
    output: np.ndarray


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last tokens of ``words`` that would complete one after ``output``."""
    bans = []
    for word in words:
        head = list(word[:-1])
        if not head or list(output[-len(head) :]) == head:  # a shorter output: no match
            bans.append(word[-1])
    return bans


def shaping_arrays(
    params: Sequence[SamplingParams], histories: Sequence[History | None], vocab: int
) -> dict[str, np.ndarray]:
    """The host half of steps 1, 3 and 4: each kind's rows and (row, token) pairs."""
    arrays: dict[str, np.ndarray] = {}
    allowed = [(r, p.allowed_token_ids) for r, p in enumerate(params) if p.allowed_token_ids]
    if allowed:
        arrays["allowed_rows"] = np.array([r for r, _ in allowed], dtype=np.int64)
        arrays.update(_pairs("allowed", [ids for _, ids in allowed], vocab))
    biased = [(r, p.logit_bias) for r, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = np.repeat([r for r, _ in biased], [len(b) for _, b in biased])
        flat = [pair for _, bias in biased for pair in bias]
        ids = np.array([t for t, _ in flat], dtype=np.int64)
        inside = ids < vocab
        arrays["bias_rows"] = rows.astype(np.int64)[inside]
        arrays["bias_ids"] = ids[inside]
        arrays["bias_values"] = np.array([b for _, b in flat], dtype=np.float32)[inside]
    penalised = [r for r, p in enumerate(params) if p.penalised]
    if penalised:
        missing = [r for r in penalised if histories[r] is None]
        if missing:
            raise ValueError(f"rows {missing} have penalties but no history")
        # Only the tokens a row has seen change: one (row, token) entry each, with the
        # token's count in the output, and the row's three penalties.
        at, ids, counts = [], [], []
        for r in penalised:
            held: History = histories[r]  # type: ignore[assignment]
            out_ids, out_counts = np.unique(held.output, return_counts=True)
            seen = np.union1d(held.prompt, out_ids)
            in_output = np.zeros(len(seen), dtype=np.int64)
            in_output[np.searchsorted(seen, out_ids)] = out_counts
            inside = seen < vocab
            at.append(np.full(int(inside.sum()), r, dtype=np.int64))
            ids.append(seen[inside].astype(np.int64))
            counts.append(in_output[inside].astype(np.float32))
        arrays["penalty_rows"] = np.concatenate(at)
        arrays["penalty_ids"] = np.concatenate(ids)
        arrays["penalty_counts"] = np.concatenate(counts)
        per_row = np.zeros((3, len(params)), dtype=np.float32)  # read for penalised rows only
        for r in penalised:
            p = params[r]
            per_row[:, r] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        arrays["penalties"] = per_row
    return arrays


def _pairs(
    name: str, lists: Sequence[Sequence[int] | np.ndarray], vocab: int
) -> dict[str, np.ndarray]:
    """``{name}_at``, ``{name}_ids``: the position (in ``lists``, not empty) and id of
    each entry."""
    ids = [np.asarray(x, dtype=np.int64) for x in lists]
    at = np.repeat(np.arange(len(ids), dtype=np.int64), [x.size for x in ids])
    flat = np.concatenate(ids)
    inside = flat < vocab
    return {f"{name}_at": at[inside], f"{name}_ids": flat[inside]}


def shape_logits(logits: Tensor, dev: dict[str, Tensor]) -> Tensor:
    """Steps 1, 3 and 4 on float32 ``logits`` (a new tensor where anything applies)."""
    if "allowed_rows" in dev:
        rows, at, ids = dev["allowed_rows"], dev["allowed_at"], dev["allowed_ids"]
        kept = logits.index_select(0, rows)
        shaped = torch.full_like(kept, -torch.inf).index_put((at, ids), kept[at, ids])
        logits = logits.index_copy(0, rows, shaped)
    if "bias_rows" in dev:
        logits = logits.index_put(
            (dev["bias_rows"], dev["bias_ids"]), dev["bias_values"], accumulate=True
        )
    if "penalty_rows" in dev:
        rows, ids, counts = dev["penalty_rows"], dev["penalty_ids"], dev["penalty_counts"]
        rep, freq, presence = dev["penalties"][:, rows]
        x = logits[rows, ids]
        x = torch.where(x > 0, x / rep, x * rep)
        x = x - freq * counts - presence * (counts > 0)
        logits = logits.index_put((rows, ids), x)
    return logits
