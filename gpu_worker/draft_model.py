"""The draft model of speculative decoding: a second, smaller checkpoint with the target
model's tokenizer, run by the worker to propose each speculating decode's tokens
(``speculative_model``; :class:`ipc.plan_state.Drafter`).

**Its K/V shares the target's blocks.** The draft has a cache of its own with the
target's block count and block size, read and written through the target's block
tables: block ``b`` of a sequence holds the target's K/V and the draft's for the same
positions. So the scheduler's budget (``num_gpu_blocks``, sized from what a block of
both costs) covers the draft too, lookahead blocks hold the drafted positions, and
nothing in the scheduler knows the draft is there beyond ``BatchPlan.draft_lengths``.

**What the draft's cache holds is tracked here**, per block: the context its last
writer fed the draft (its tokens, then the drafted ones), at which positions, and how
far into the block it wrote. A sequence's draft K/V is good up to the first position
where that context and the sequence's tokens part, block by block from its first: so
a rejected proposal's positions, a block copied on write or swapped in (the copy moves
the target's K/V only), a block reused by another sequence meanwhile, and a recomputed
sequence are computed again, while a prefix another sequence drafted is reused as it
is. A draft step first catches each sequence up from there to its last known token in
one chunk (like a prefill: the whole prompt the first time), takes the argmax at its
last position, then runs ``k - 1`` one-token steps over every drafting sequence at
once. Draft K/V is never swapped.

**Exactness does not rest on it.** A draft token is the draft's argmax, a function of
the context: a certain proposal, verified by the target's own draws (the accepted run
of :func:`ipc.plan_state.accepted_run`), which is speculative sampling's rule for a
proposal with ``q(x) = 1``. A stale or wrong draft costs acceptance, never output.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from gpu_worker import attention
from gpu_worker.decoder import Decoder, load_decoder
from gpu_worker.kv_cache import KVCache, KVLayout
from gpu_worker.sampler import argmax
from gpu_worker.staging import Staging
from gpu_worker.step_inputs import StepInputs
from ipc.plan_state import WorkerSeq

__all__ = ["DraftModel", "check_same_vocabulary"]


def check_same_vocabulary(target_dir: str | Path, draft_dir: str | Path) -> None:
    """Raise ValueError unless both checkpoints' tokenizers map every token to the same
    id (a draft token must mean the same text to the target)."""
    target = AutoTokenizer.from_pretrained(target_dir).get_vocab()
    draft = AutoTokenizer.from_pretrained(draft_dir).get_vocab()
    if target != draft:
        differ = sum(draft.get(token) != index for token, index in target.items())
        raise ValueError(
            f"speculative_model {str(draft_dir)!r}: its tokenizer is not the model's "
            f"({len(draft)} tokens against {len(target)}, {differ} of the model's map "
            "elsewhere); a draft model must share the model's vocabulary"
        )


class DraftModel:
    """The draft checkpoint, its cache and what it computed (:class:`Drafter`)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        target_vocab_size: int,
        model_impl: str,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.device = device
        self.block_size = block_size
        self.decoder: Decoder = load_decoder(
            model_dir, device=device, dtype=dtype, model_impl=model_impl
        )
        config = self.decoder.config
        self.config = config
        self.vocab_size = min(self.decoder.vocab_size, target_vocab_size)
        """Ids it may propose: rows of both embeddings."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.layout = KVLayout(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            kv_dtype=kv_dtype,
        )
        self.backend, _ = attention.choose_backend(device, self.layout, config.num_attention_heads)
        self.staging = Staging(device)
        """Its own transfers (the target's are timed on the step's clock)."""
        self.cache: KVCache | None = None
        self._written: list[tuple[list[int], int, int] | None] = []
        """Per block: the context its last writer fed the draft, the position of the
        block's first slot in it, and the position it wrote up to (None: never
        written)."""
        self.seconds = 0.0
        """Time spent drafting, since the start."""

    @property
    def bytes_per_block(self) -> int:
        """What its K/V adds to each block."""
        return self.layout.bytes_per_block

    def allocate(self, num_blocks: int) -> None:
        """Its cache, for the target's ``num_blocks``; its attention compiled now."""
        self.cache = KVCache(self.layout, num_blocks, self.device, None, self.staging)
        self._written = [None] * num_blocks
        cap = getattr(self.config, "attn_logit_softcapping", None)
        window = getattr(self.config, "sliding_window", None)
        self.backend.warm_up([(None, cap), *([(window, cap)] if window else [])])

    @torch.inference_mode()
    def draft(self, seqs: list[tuple[WorkerSeq, int]]) -> dict[str, list[int]]:
        """``k`` argmax tokens of the draft after each sequence's known tokens."""
        began = time.perf_counter()
        catch_up = StepInputs()
        for seq, _ in seqs:
            start = self._computed(seq)
            catch_up.token_ids.extend(seq.token_ids[start:])
            catch_up.starts.append(start)
            catch_up.tables.append(seq.block_ids)
            catch_up.query_start_loc.append(
                catch_up.query_start_loc[-1] + len(seq.token_ids) - start
            )
        ends = catch_up.query_start_loc[1:]
        tokens = self._argmax(self._forward(catch_up), [end - 1 for end in ends])
        drafts = {seq.seq_id: [token] for (seq, _), token in zip(seqs, tokens, strict=True)}
        for offset in range(1, max(k for _, k in seqs)):
            step = StepInputs()
            going = [(seq, k) for seq, k in seqs if k > offset]
            for seq, _ in going:
                step.token_ids.append(drafts[seq.seq_id][-1])
                step.starts.append(len(seq.token_ids) - 1 + offset)
                step.tables.append(seq.block_ids)
                step.query_start_loc.append(step.query_start_loc[-1] + 1)
            tokens = self._argmax(self._forward(step), list(range(len(going))))
            for (seq, _), token in zip(going, tokens, strict=True):
                drafts[seq.seq_id].append(token)
        bs = self.block_size
        written = self._written
        for (seq, k), start in zip(seqs, catch_up.starts, strict=True):
            fed = seq.token_ids + drafts[seq.seq_id][: k - 1]  # the known, then k - 1
            for index in range(start // bs, -(-len(fed) // bs)):
                upto = min((index + 1) * bs, len(fed))
                written[seq.block_ids[index]] = (fed, index * bs, upto)
        self.seconds += time.perf_counter() - began
        return drafts

    def _computed(self, seq: WorkerSeq) -> int:
        """Its first tokens whose draft K/V is good: block by block, while the block's
        writer fed the draft this sequence's tokens (and at most all but its last known
        one, the first this step computes)."""
        tokens = seq.token_ids
        limit = min(len(tokens) - 1, seq.num_computed_tokens)
        bs = self.block_size
        agreed: dict[int, int] = {}  # writer context -> positions it shares with tokens
        good = 0
        for index, block in enumerate(seq.block_ids):
            low = index * bs
            entry = self._written[block]
            if low >= limit or entry is None:
                break
            fed, base, upto = entry
            if base != low:  # written at other positions, for another sequence
                break
            high = min(low + bs, limit, upto)
            shared = agreed.get(id(fed))
            if shared is None or shared < high:
                shared = agreed[id(fed)] = _common_prefix(fed, tokens, high)
            good = max(min(high, shared), low)
            if good < low + bs:
                break
        return good

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        cache = self.cache
        assert cache is not None, "allocate() first"
        arrays = inputs.host_arrays(self.block_size)
        arrays["input_ids"] = np.asarray(inputs.token_ids, dtype=np.int64)
        plan = self.backend.plan(arrays, cache.num_blocks)
        tensors = self.staging.to_device(arrays)
        return self.decoder.run_step(tensors, cache, self.backend, plan)

    def _argmax(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        if len(rows) != hidden.shape[0]:
            index = self.staging.to_device({"rows": np.asarray(rows, dtype=np.int64)})["rows"]
            hidden = hidden.index_select(0, index)
        logits = self.decoder.logits(hidden)[:, : self.vocab_size]
        return self.staging.to_host(argmax(logits))


def _common_prefix(a: list[int], b: list[int], n: int) -> int:
    """How many of the first ``n`` entries of ``a`` and ``b`` agree, from the start."""
    if a[:n] == b[:n]:
        return n
    n = min(n, len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n
