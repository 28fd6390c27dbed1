"""Prompt logprobs: for each sequence whose request asks for them, the logprob of every
prompt token its step computes, with the top ``k`` tokens of that position and the
token's rank, from the raw logits of the position before (float32 log-softmax; no
penalties, bias or temperature, like vLLM's).

A step computing positions ``start..end-1`` of a sequence gives the logprobs of prompt
positions ``start+1..end`` (the hidden state at ``p`` predicts token ``p+1``), up to the
prompt's last token: what follows it is the first output token, the sampler's. So a
chunked prefill reports its positions chunk by chunk, and a recomputed one reports
them again (the scheduler keeps the first report of each position).

The LM head runs over those rows in pieces of at most ``piece_rows`` rows (the
sampler's ``max_num_seqs``, the rows the cache's memory budget was profiled with), one
device-to-host transfer per piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.staging import Staging
from ipc.plan_state import ScheduledSeq
from shared.outputs import PromptLogprobs

__all__ = ["prompt_logprobs"]


@dataclass(slots=True, frozen=True)
class _Span:
    """One sequence's positions in the step: ``count`` of them from ``first``."""

    seq_id: str
    first: int
    count: int
    width: int
    """Top tokens it asked for."""


def _spans(
    batch: Sequence[ScheduledSeq], query_start_loc: Sequence[int]
) -> tuple[list[int], list[int], list[_Span]]:
    """The hidden rows to read, the prompt token each predicts, and who asked."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[_Span] = []
    for index, item in enumerate(batch):
        seq = item.seq
        width = seq.sampling.prompt_logprobs
        if width is None:
            continue
        first = item.start + 1
        last = min(item.end, seq.num_prompt_tokens - 1)
        if last < first:
            continue
        row = query_start_loc[index] - item.start  # the hidden row of position 0
        rows.extend(range(row + first - 1, row + last))
        targets.extend(seq.token_ids[first : last + 1])
        spans.append(_Span(seq.seq_id, first, last - first + 1, width))
    return rows, targets, spans


def prompt_logprobs(
    batch: Sequence[ScheduledSeq],
    query_start_loc: Sequence[int],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    staging: Staging,
    piece_rows: int,
) -> dict[str, PromptLogprobs] | None:
    """Sequence id -> the prompt logprobs of this step's positions, for those of
    ``batch`` that asked and computed prompt positions past the first; ``None`` if none.

    ``hidden`` holds the step's packed hidden states (sequence ``i`` at rows
    ``query_start_loc[i]..query_start_loc[i+1]-1``); ``logits_of`` is the LM head."""
    rows, targets, spans = _spans(batch, query_start_loc)
    if not spans:
        return None
    width = max(span.width for span in spans)
    chosen: list[float] = []
    ranks: list[float] = []
    top_values: list[float] = []
    top_ids: list[float] = []
    for lo in range(0, len(rows), piece_rows):
        piece, width = _piece(
            hidden, rows[lo : lo + piece_rows], targets[lo : lo + piece_rows], width, logits_of,
            staging,
        )  # fmt: skip
        count = min(piece_rows, len(rows) - lo)
        chosen += piece[:count]
        ranks += piece[count : 2 * count]
        top_values += piece[2 * count : 2 * count + count * width]
        top_ids += piece[2 * count + count * width :]
    out: dict[str, PromptLogprobs] = {}
    at = 0
    for span in spans:
        entries: list[dict[int, float]] = []
        for r in range(at, at + span.count):
            entry = {targets[r]: chosen[r]}
            for i in range(r * width, r * width + min(span.width, width)):
                entry.setdefault(int(top_ids[i]), top_values[i])
            entries.append(entry)
        out[span.seq_id] = PromptLogprobs(
            first=span.first,
            entries=entries,
            ranks=[int(rank) for rank in ranks[at : at + span.count]],
        )
        at += span.count
    return out


def _piece(
    hidden: torch.Tensor,
    rows: list[int],
    targets: list[int],
    width: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    staging: Staging,
) -> tuple[list[float], int]:
    """For ``rows`` of ``hidden``: the target's logprob, its rank, then the top
    ``width`` logprobs and their ids, row after row, in one transfer (float64 holds the
    ids and ranks exactly); and ``width``, capped at the vocabulary."""
    dev = staging.to_device(
        {"rows": np.asarray(rows, dtype=np.int64), "targets": np.asarray(targets, dtype=np.int64)}
    )
    log_probs = logits_of(hidden.index_select(0, dev["rows"])).float().log_softmax(dim=-1)
    chosen = log_probs.gather(-1, dev["targets"][:, None])
    rank = (log_probs > chosen).sum(dim=-1) + 1
    parts = [chosen[:, 0].double(), rank.double()]
    width = min(width, log_probs.shape[-1])
    if width:
        values, ids = log_probs.topk(width, dim=-1)
        parts += [values.double().flatten(), ids.double().flatten()]
    return staging.to_host(torch.cat(parts)), width
