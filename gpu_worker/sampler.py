"""Token sampling for one decode step: greedy, temperature, min-p, top-k, top-p, seeds,
logprobs.

:meth:`Sampler.sample` picks exactly one token per row of a ``[R, V]`` logits tensor
(the caller expands a request with ``n > 1`` into ``n`` rows, each with its own
sample index, hence its own key in step 7). For every row ``r`` it applies, in this order:

1. **Masking.** ``masked_token_ids[r]`` (ids ``>= V`` are ignored) get logit ``-inf``.
   The caller passes EOS and the stop token ids while a request is below
   ``min_tokens``, and the last tokens of bad words. At least one token of every row
   should stay unmasked: a row left with none (or whose logits overflow float32, so
   that the token it would draw has no finite logit) gets the token id
   :data:`ipc.schema.NO_TOKEN` instead, for the scheduler to fail its request with the reason.
2. **Float32.** Everything below is computed in float32, whatever the logits dtype.
   Then the shaping of :mod:`gpu_worker.logits_shaping`: allowed tokens, logit bias,
   presence, frequency and repetition penalties (over ``histories[r]``).
3. **Greedy rows** (``temperature == 0`` or ``top_k == 1``) take the argmax of the
   masked logits (the lowest id among ties). Nothing else applies to them.
4. **Temperature.** ``x = (logits - max(logits)) / temperature`` (subtracting the row
   max does not change the distribution; it keeps tiny temperatures from overflowing).
   **Min-p** (``min_p > 0``): tokens whose probability is below ``min_p`` times the most
   likely one's get ``-inf`` (vLLM's order: before top-k and top-p).
5. **Top-k** (``top_k > 0``): only the ``top_k`` largest ``x`` stay; ties at the
   boundary are broken towards the lower token id (a stable descending sort).
6. **Top-p** (``top_p < 1``): over ``softmax(x)`` of the tokens kept by top-k, in the
   same order, keep the smallest prefix whose probability mass is ``>= top_p`` (so the
   most likely token always stays).
7. **Sampling** from ``softmax(x)`` over the kept tokens by an exponential race:
   ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token, which draws token ``i`` with
   probability ``p_i / sum(p)``. Rows without a key draw ``q`` from torch's default RNG
   for the logits' device, all in one batch. A row with a key (:func:`sample_key`: a
   64-bit hash of the request's seed, the sample's index and the token's position)
   takes ``q = -log(u)`` with ``u`` a counter-based hash of ``(key, token id)``
   computed on the device for all keyed rows at once: its token depends only on its
   own logits, parameters and key, never on the other rows of the batch, and no
   generator object is made per row.

**Logprobs** (rows whose ``SamplingParams.logprobs`` is not ``None``) are values of
``log_softmax`` over the vocabulary of the float32 logits *after steps 1 and 2 (masking,
bias, penalties) and before temperature, min-p, top-k and top-p* -- the distribution
the model gives over the tokens the request may emit, as its parameters shape it.
vLLM's default ("raw" logprobs) takes them before all of that (its "processed_logits"
mode after). Each such row's dict maps the sampled
token and the ``logprobs`` most likely tokens to their logprob (so it has
``logprobs + 1`` entries, or ``logprobs`` when the sampled token is among the most
likely); masked tokens appear only with logprob ``-inf``, and only when fewer than
``logprobs`` tokens are unmasked. Rows that did not ask get ``None``.

The whole batch costs one device-to-host transfer (the token ids, with the logprobs
when any row asks, in the same tensor), made through the worker's
:class:`~gpu_worker.staging.Staging`, which also sends the rows' parameters to the
device in one non-blocking copy. Top-k without top-p needs no sort: each row keeps the
values above its k-th largest and, among those equal to it, the lowest ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.logits_shaping import History, shape_logits, shaping_arrays
from gpu_worker.staging import Staging
from ipc.schema import NO_TOKEN
from shared.sampling import SamplingParams

__all__ = ["SampleOutput", "Sampler", "argmax", "sample_key"]

_TINY = torch.finfo(torch.float32).tiny
_M32 = 0xFFFFFFFF


def argmax(x: Tensor) -> Tensor:
    """Each row's argmax over the last dimension (the lowest index among ties), in ``x``'s
    own dtype: widening bfloat16 or float16 to float32 keeps the order, so the tokens are
    those of ``x.float().argmax(-1)``. Through ``max``, whose reduction torch vectorises
    on CPUs (its ``argmax`` is several times slower there: about 1 against 5 ms over 64
    rows of a 49,152-token vocabulary in bf16, conversion included)."""
    return x.max(dim=-1).indices


def sample_key(seed: int | None, sample_index: int, position: int = 0) -> int | None:
    """The key of the draw at ``position`` (the sequence's length before the token) of
    sample ``sample_index`` (0-based, ``< n``) of a request with ``seed``; ``None`` for
    an unseeded request (it samples from torch's default RNG).

    A 63-bit hash of all three: the ``n`` samples of a request and the positions of a
    sample draw from different streams, and the same triple replays the same draw, so
    a seeded sequence's tokens depend neither on batching, preemption nor restarts.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(
        f"expeditor-sampler:{seed}:{sample_index}:{position}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer hash (int64 tensors holding values < 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def keyed_exponentials(keys: Tensor, vocab: int) -> Tensor:
    """``[len(keys), vocab]`` float32 Exp(1) draws, a pure function of (key, token id):
    ``-log(u)`` with ``u`` in (0, 1) from 23 bits of a two-round keyed hash: ``(k + 0.5)
    / 2**23`` for ``k < 2**23`` is exact in float32, so ``u`` is never 0 or 1 (with 24
    bits the largest would round up to 1, giving q = 0: a draw won by that token
    whatever its probability)."""
    lo = (keys & _M32)[:, None]
    hi = ((keys >> 32) & _M32)[:, None]
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    bits = _mix32((_mix32(ids ^ lo) + hi) & _M32)
    return -torch.log(open_unit(bits))


def open_unit(bits: Tensor) -> Tensor:
    """32-bit hash values (int64 tensors) -> float32 uniforms strictly inside (0, 1)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


class SampleOutput(msgspec.Struct):
    """The tokens picked for one batch of rows, in row order."""

    token_ids: list[int]
    """One sampled token id per row."""
    logprobs: list[dict[int, float] | None]
    """Per row: token id -> logprob for the sampled token and the top ``logprobs``
    tokens, or ``None`` for a row that did not ask for logprobs."""


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for the exact
    semantics. Stateless apart from its transfers: one instance can serve every step.
    ``staging``: the worker's transfers (one is made per call otherwise)."""

    def __init__(self, staging: Staging | None = None) -> None:
        self._staging = staging

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        keys: Sequence[int | None],
        masked_token_ids: Sequence[Sequence[int] | np.ndarray],
        histories: Sequence[History | None] | None = None,
    ) -> SampleOutput:
        """Sample one token for each row of ``logits`` (``[R, V]``, any float dtype).

        ``params[r]``, ``keys[r]`` (:func:`sample_key`; ``None`` = default RNG),
        ``masked_token_ids[r]`` (ids forbidden in row ``r``: below ``min_tokens``, bad
        words) and ``histories[r]`` (its tokens, for penalties) describe row ``r``. The
        caller's tensor is never modified.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
        num_rows, vocab = logits.shape
        if not len(params) == len(keys) == len(masked_token_ids) == num_rows:
            raise ValueError(
                f"{num_rows} logits rows but {len(params)} params, {len(keys)} "
                f"keys and {len(masked_token_ids)} masked-token lists"
            )
        if num_rows == 0:
            return SampleOutput(token_ids=[], logprobs=[])
        staging = self._staging_for(logits.device)
        greedy = [p.temperature == 0 or p.top_k == 1 for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        shaped = any(p.shapes_logits for p in params)
        if (
            all(greedy)
            and not want_logprobs
            and not shaped
            and not any(len(m) for m in masked_token_ids)
        ):
            # All greedy, nothing masked, no logprobs: one argmax, one transfer.
            return SampleOutput(
                token_ids=staging.to_host(argmax(logits)),
                logprobs=[None] * num_rows,
            )

        host = _host_arrays(params, keys, masked_token_ids, greedy, vocab)
        if shaped:
            host.update(shaping_arrays(params, histories or [None] * num_rows, vocab))
        dev = staging.to_device(host)
        logits = logits.float()
        if "mask_rows" in dev:
            minus_inf = torch.full((), -torch.inf, device=logits.device)
            logits = logits.index_put((dev["mask_rows"], dev["mask_cols"]), minus_inf)
        if shaped:
            logits = shape_logits(logits, dev)
        random_rows = host["random_rows"]
        if random_rows.size == num_rows:
            tokens, drawn = self._sample_random(logits, host, dev)
        else:
            tokens = argmax(logits)
            # A greedy row with nothing to draw picks a -inf (all masked) or an
            # overflowed logit.
            drawn = logits.gather(-1, tokens[:, None])[:, 0].isfinite()
            if random_rows.size:
                rows = dev["random_rows"]
                chosen, chosen_drawn = self._sample_random(logits.index_select(0, rows), host, dev)
                tokens = tokens.index_copy(0, rows, chosen)
                drawn = drawn.index_copy(0, rows, chosen_drawn)
        tokens = torch.where(drawn, tokens, NO_TOKEN)  # in the same transfer
        if not want_logprobs:
            return SampleOutput(token_ids=staging.to_host(tokens), logprobs=[None] * num_rows)
        return _with_logprobs(logits, tokens, params, staging)

    def _staging_for(self, device: torch.device) -> Staging:
        if self._staging is not None and self._staging.device == device:
            return self._staging
        return Staging(device)

    @staticmethod
    def _sample_random(
        logits: Tensor, host: dict[str, np.ndarray], dev: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Steps 4-7 of the module docstring for float32 ``logits`` of non-greedy rows
        (the parameters in ``dev`` are those rows'): their tokens, and whether each had
        one to draw (a row with every token masked, or an overflowed logit, has NaN
        probabilities: its pick has none above 0)."""
        num_rows, vocab = logits.shape
        x = (logits - logits.amax(dim=-1, keepdim=True)) / dev["temperature"][:, None]
        if bool((host["min_p"] > 0).any()):
            # Less likely than min_p times the most likely token (max(x) = 0: its
            # probability is 1 / sum(exp(x)), so the test needs no softmax).
            x = x.masked_fill(x.exp() < dev["min_p"][:, None], -torch.inf)
        top_k, top_p = host["top_k"], host["top_p"]
        use_top_k = bool(((top_k > 0) & (top_k < vocab)).any())
        use_top_p = bool((top_p < 1).any())
        if use_top_p:
            # Rows without top-k/top-p go through the sort and the scatter back
            # unchanged (a permutation and its inverse), so a row's probabilities do
            # not depend on whether another row of the batch needed the sort.
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
            if use_top_k:
                rank = torch.arange(vocab, device=x.device)
                sorted_x = sorted_x.masked_fill(rank[None, :] >= dev["top_k"][:, None], -torch.inf)
            sorted_probs = sorted_x.softmax(dim=-1)
            mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
            cut = (mass_before >= dev["top_p"][:, None]) & (dev["top_p"] < 1)[:, None]
            sorted_x = sorted_x.masked_fill(cut, -torch.inf)
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
        elif use_top_k:
            x = _top_k_without_sort(x, dev["top_k"], int(top_k.max()))
        probs = x.softmax(dim=-1)

        # Exponential race: argmax(p / q), q ~ Exp(1). Unkeyed rows share one draw
        # from the default RNG; keyed rows take theirs from their keys.
        keyed = host["keyed"]
        if keyed.size == num_rows:
            q = keyed_exponentials(dev["keys"], vocab)
        else:
            q = torch.empty_like(probs).exponential_()
            if keyed.size:
                q.index_copy_(0, dev["keyed"], keyed_exponentials(dev["keys"], vocab))
        # A q of exactly 0 would turn a zero probability into 0/0 = NaN, which argmax
        # would pick; clamping keeps every excluded token at exactly 0.
        tokens = argmax(probs / q.clamp_min_(_TINY))
        return tokens, probs.gather(-1, tokens[:, None])[:, 0] > 0


def _top_k_without_sort(x: Tensor, top_k: Tensor, widest: int) -> Tensor:
    """``x`` with all but each row's ``top_k`` largest at -inf (0 or >= vocab: all
    kept); ties at the k-th value keep the lowest ids, as a stable descending sort
    would. One ``topk`` of the widest k instead of a sort of the vocabulary."""
    vocab = x.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    widest = min(max(widest, 1), vocab)
    values = x.topk(widest, dim=-1).values  # descending
    kth = values.gather(-1, (k.clamp_max(widest) - 1)[:, None])
    above = x > kth
    ties = x == kth
    room = k[:, None] - above.sum(dim=-1, keepdim=True)
    keep = above | (ties & (ties.cumsum(dim=-1) <= room))
    keep |= (k == vocab)[:, None]
    return x.masked_fill(~keep, -torch.inf)


def _host_arrays(
    params: Sequence[SamplingParams],
    keys: Sequence[int | None],
    masked_token_ids: Sequence[Sequence[int] | np.ndarray],
    greedy: list[bool],
    vocab: int,
) -> dict[str, np.ndarray]:
    """The rows' parameters as arrays (those of the non-greedy rows, in their order),
    sent to the device together."""
    random_rows = [r for r, g in enumerate(greedy) if not g]
    chosen = [params[r] for r in random_rows]
    keyed = [i for i, r in enumerate(random_rows) if keys[r] is not None]
    arrays = {
        "random_rows": np.array(random_rows, dtype=np.int64),
        "temperature": np.array(
            [max(p.temperature, float(_TINY)) for p in chosen], dtype=np.float32
        ),
        "top_k": np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in chosen]),
        "top_p": np.array([max(p.top_p, float(_TINY)) for p in chosen], dtype=np.float32),
        "min_p": np.array([p.min_p for p in chosen], dtype=np.float32),
        "keyed": np.array(keyed, dtype=np.int64),
        "keys": np.array([keys[random_rows[i]] for i in keyed], dtype=np.int64),
    }
    arrays["top_k"] = arrays["top_k"].astype(np.int64)
    masks = [np.asarray(ids, dtype=np.int64) for ids in masked_token_ids]
    sizes = [mask.size for mask in masks]
    if any(sizes):
        cols = np.concatenate(masks)
        rows = np.repeat(np.arange(len(masks), dtype=np.int64), sizes)
        inside = (cols >= 0) & (cols < vocab)
        arrays["mask_rows"] = rows[inside]
        arrays["mask_cols"] = cols[inside]
    return arrays


def _with_logprobs(
    logits: Tensor, tokens: Tensor, params: Sequence[SamplingParams], staging: Staging
) -> SampleOutput:
    """The tokens and, per row that asked, its sampled token and top-``logprobs`` tokens
    -> log_softmax(masked logits); all in one transfer (float64 holds the ids exactly)."""
    num_rows, vocab = logits.shape
    log_probs = logits.log_softmax(dim=-1)
    chosen_lp = log_probs.gather(-1, tokens.clamp_min(0)[:, None])[:, 0]  # NO_TOKEN: any
    width = min(max(p.logprobs or 0 for p in params), vocab)
    parts = [tokens.double(), chosen_lp.double()]
    if width > 0:
        values, ids = log_probs.topk(width, dim=-1)
        parts += [values.double().flatten(), ids.double().flatten()]
    flat = staging.to_host(torch.cat(parts))
    token_ids = [int(t) for t in flat[:num_rows]]
    chosen = flat[num_rows : 2 * num_rows]
    top_lp = flat[2 * num_rows : 2 * num_rows + num_rows * width]
    top_ids = flat[2 * num_rows + num_rows * width :]
    out: list[dict[int, float] | None] = [None] * num_rows
    for r, p in enumerate(params):
        if p.logprobs is None:
            continue
        entry = {token_ids[r]: chosen[r]}
        for i in range(r * width, r * width + min(p.logprobs, width)):
            entry.setdefault(int(top_ids[i]), top_lp[i])
        out[r] = entry
    return SampleOutput(token_ids=token_ids, logprobs=out)
