"""Token sampling for one decode step: greedy, temperature, top-k, top-p, seeds, logprobs.

:meth:`Sampler.sample` picks exactly one token per row of a ``[R, V]`` logits tensor
(the caller expands a request with ``n > 1`` into ``n`` rows, each with its own
generator). For every row ``r`` it applies, in this order:

1. **Masking.** ``masked_token_ids[r]`` (ids ``>= V`` are ignored) get logit ``-inf``.
   The caller passes EOS and the stop token ids while a request is below
   ``min_tokens``. At least one token of every row must stay unmasked.
2. **Float32.** Everything below is computed in float32, whatever the logits dtype.
3. **Greedy rows** (``temperature == 0`` or ``top_k == 1``) take the argmax of the
   masked logits (the lowest id among ties). Nothing else applies to them.
4. **Temperature.** ``x = (logits - max(logits)) / temperature`` (subtracting the row
   max does not change the distribution; it keeps tiny temperatures from overflowing).
5. **Top-k** (``top_k > 0``): only the ``top_k`` largest ``x`` stay; ties at the
   boundary are broken towards the lower token id (a stable descending sort).
6. **Top-p** (``top_p < 1``): over ``softmax(x)`` of the tokens kept by top-k, in the
   same order, keep the smallest prefix whose probability mass is ``>= top_p`` (so the
   most likely token always stays).
7. **Sampling** from ``softmax(x)`` over the kept tokens by an exponential race:
   ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which draws token ``i`` with
   probability ``p_i / sum(p)``. Rows without a generator draw ``q`` from torch's
   default RNG for the logits' device, all in one batch; a row with a generator draws
   its ``q`` from that generator alone, so its token depends only on its own logits,
   parameters and generator state, never on the other rows of the batch. The
   generator, not ``SamplingParams.seed``, decides: build it with
   :func:`make_generator` on the logits' device.

**Logprobs** (rows whose ``SamplingParams.logprobs`` is not ``None``) are values of
``log_softmax`` over the vocabulary of the float32 logits *after step 1 (masking) and
before temperature, top-k and top-p* -- the distribution the model gives over the
tokens the request may emit. vLLM's default ("raw" logprobs) is the same except that
it takes them before its min-tokens masking too. Each such row's dict maps the sampled
token and the ``logprobs`` most likely tokens to their logprob (so it has
``logprobs + 1`` entries, or ``logprobs`` when the sampled token is among the most
likely); masked tokens appear only with logprob ``-inf``, and only when fewer than
``logprobs`` tokens are unmasked. Rows that did not ask get ``None``.

The whole batch costs one device-to-host transfer of the token ids (plus one for the
logprobs when any row asks); per-row work is limited to one ``exponential_`` call per
seeded row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.sampling import SamplingParams

__all__ = ["SampleOutput", "Sampler", "make_generator"]

_TINY = torch.finfo(torch.float32).tiny


def make_generator(
    seed: int | None, sample_index: int, device: torch.device
) -> torch.Generator | None:
    """The RNG for sample ``sample_index`` (0-based, ``< n``) of a request with ``seed``.

    ``None`` for an unseeded request (it then samples from torch's default RNG). A
    seeded request gets a generator on ``device`` seeded with a 64-bit hash of
    ``(seed, sample_index)``: the ``n`` samples of one request use different streams,
    and rebuilding the generator replays the same stream.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(
        f"expeditor-sampler:{seed}:{sample_index}".encode(), digest_size=8
    ).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little"))
    return generator


class SampleOutput(msgspec.Struct):
    """The tokens picked for one batch of rows, in row order."""

    token_ids: list[int]
    """One sampled token id per row."""
    logprobs: list[dict[int, float] | None]
    """Per row: token id -> logprob for the sampled token and the top ``logprobs``
    tokens, or ``None`` for a row that did not ask for logprobs."""


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for the exact
    semantics. Stateless: one instance can serve every step."""

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        masked_token_ids: Sequence[Sequence[int]],
    ) -> SampleOutput:
        """Sample one token for each row of ``logits`` (``[R, V]``, any float dtype).

        ``params[r]``, ``generators[r]`` (``None`` = default RNG; otherwise on the
        logits' device) and ``masked_token_ids[r]`` (ids forbidden in row ``r``)
        describe row ``r``. The caller's tensor is never modified.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if not len(params) == len(generators) == len(masked_token_ids) == num_rows:
            raise ValueError(
                f"{num_rows} logits rows but {len(params)} params, {len(generators)} "
                f"generators and {len(masked_token_ids)} masked-token lists"
            )
        if num_rows == 0:
            return SampleOutput(token_ids=[], logprobs=[])
        device = logits.device

        if not any(masked_token_ids) and all(
            (p.temperature == 0 or p.top_k == 1) and p.logprobs is None for p in params
        ):
            # All greedy, nothing masked, no logprobs: one argmax, one transfer.
            token_ids: list[int] = logits.float().argmax(dim=-1).tolist()
            return SampleOutput(token_ids=token_ids, logprobs=[None] * num_rows)

        logits = _masked_float32(logits, masked_token_ids)

        greedy = [p.temperature == 0 or p.top_k == 1 for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        elif not any(greedy):
            tokens = self._sample_random(logits, params, generators)
        else:
            greedy_index = _index([r for r in range(num_rows) if greedy[r]], device)
            random_rows = [r for r in range(num_rows) if not greedy[r]]
            random_index = _index(random_rows, device)
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)
            tokens[greedy_index] = logits[greedy_index].argmax(dim=-1)
            tokens[random_index] = self._sample_random(
                logits[random_index],
                [params[r] for r in random_rows],
                [generators[r] for r in random_rows],
            )

        token_ids = tokens.tolist()
        return SampleOutput(
            token_ids=token_ids, logprobs=_logprobs(logits, tokens, token_ids, params)
        )

    @staticmethod
    def _sample_random(
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """Steps 4-7 of the module docstring for float32 ``logits`` of non-greedy rows."""
        num_rows, vocab = logits.shape
        device = logits.device
        temperature = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=device
        )
        x = (logits - logits.amax(dim=-1, keepdim=True)) / temperature.clamp_min(_TINY)[:, None]

        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1 for p in params)
        if use_top_k or use_top_p:
            # Rows without top-k/top-p go through the sort and the scatter back
            # unchanged (a permutation and its inverse), so a row's probabilities do
            # not depend on whether another row of the batch needed the sort.
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
            if use_top_k:
                top_k = torch.tensor(
                    [p.top_k if p.top_k > 0 else vocab for p in params], device=device
                )
                rank = torch.arange(vocab, device=device)
                sorted_x = sorted_x.masked_fill(rank[None, :] >= top_k[:, None], -torch.inf)
            if use_top_p:
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
                sorted_probs = sorted_x.softmax(dim=-1)
                mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
                cut = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
                sorted_x = sorted_x.masked_fill(cut, -torch.inf)
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
        probs = x.softmax(dim=-1)

        # Exponential race: argmax(p / q), q ~ Exp(1). Unseeded rows share one draw
        # from the default RNG; each seeded row overwrites its q from its own generator.
        q = torch.empty_like(probs)
        seeded = [(r, g) for r, g in enumerate(generators) if g is not None]
        if len(seeded) < num_rows:
            q.exponential_()
        for r, generator in seeded:
            q[r].exponential_(generator=generator)
        # A q of exactly 0 would turn a zero probability into 0/0 = NaN, which argmax
        # would pick; clamping keeps every excluded token at exactly 0.
        return (probs / q.clamp_min_(_TINY)).argmax(dim=-1)


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _masked_float32(logits: Tensor, masked_token_ids: Sequence[Sequence[int]]) -> Tensor:
    """Float32 logits with every masked token at -inf (a copy when anything is masked)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, ids in enumerate(masked_token_ids):
        for token in ids:
            if 0 <= token < vocab:
                rows.append(row)
                cols.append(token)
    logits = logits.float()
    if not rows:
        return logits
    device = logits.device
    return logits.index_put(
        (_index(rows, device), _index(cols, device)),
        torch.tensor(-torch.inf, device=device),
    )


def _logprobs(
    logits: Tensor, tokens: Tensor, token_ids: list[int], params: Sequence[SamplingParams]
) -> list[dict[int, float] | None]:
    """Per row: sampled token and top-``logprobs`` tokens -> log_softmax(masked logits)."""
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    out: list[dict[int, float] | None] = [None] * len(params)
    if not rows:
        return out
    device = logits.device
    if len(rows) == len(params):
        log_probs = logits.log_softmax(dim=-1)
        chosen = tokens
    else:
        index = _index(rows, device)
        log_probs = logits[index].log_softmax(dim=-1)
        chosen = tokens[index]
    chosen_lp: list[float] = log_probs.gather(-1, chosen[:, None])[:, 0].tolist()
    width = min(max(params[r].logprobs or 0 for r in rows), log_probs.shape[1])
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if width > 0:
        values, ids = log_probs.topk(width, dim=-1)
        top_lp, top_ids = values.tolist(), ids.tolist()
    for i, r in enumerate(rows):
        entry = {token_ids[r]: chosen_lp[i]}
        k = params[r].logprobs or 0
        for token, value in zip(top_ids[i][:k], top_lp[i][:k], strict=True):
            entry.setdefault(token, value)
        out[r] = entry
    return out
