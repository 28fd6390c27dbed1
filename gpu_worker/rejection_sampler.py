"""Verifying speculative proposals on the worker: of each row's proposed tokens, the
prefix the target model accepts, and the token that follows it, so the output is
distributed exactly as the target model's own samples.

Each row (one speculating sequence) has ``num_draft`` proposed tokens and the target's
distributions at the ``num_draft + 1`` positions the step computed (its final
probabilities: after penalties, temperature, top-k/top-p/min-p, and a structured
output's mask). Proposal ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``
(``q``: the proposer's distribution; an n-gram proposal is certain, ``q(x) = 1``); at
the first rejection the row's next token is drawn from the residual ``max(p_j - q_j,
0)`` renormalized, and when every proposal is accepted a bonus token is drawn from
``p_{num_draft}``. This is the standard speculative sampling of Leviathan et al. and
Chen et al. (2023): the emitted tokens have the target's distribution whatever ``q``.
Greedy rows (temperature 0) accept while each proposal equals the target's argmax and
then emit the argmax: exactly the tokens greedy decoding would produce.

The randomness is given, not drawn here: ``u_accept[r, j]`` and ``u_sample[r, j]``
(uniform in [0, 1)), from each row's own seeded stream, so a seeded request repeats
exactly; a draw from a distribution is its inverse CDF at the uniform.
"""

from __future__ import annotations

import torch

from gpu_worker.sampler import argmax

__all__ = ["SpecResult", "verify_proposals"]

SpecResult = tuple[torch.Tensor, torch.Tensor]
"""(accepted ``[R]`` int64, tokens ``[R, K + 1]`` int64): row ``r`` emits
``tokens[r, : accepted[r] + 1]``, its accepted proposals then one more token."""


def verify_proposals(
    probs: torch.Tensor,
    proposals: torch.Tensor,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> SpecResult:
    """``probs`` ``[R, K + 1, V]``: the target's distributions (rows past a row's
    ``num_draft + 1`` positions are ignored); ``proposals`` ``[R, K]`` (padding past
    ``num_draft`` ignored); ``greedy`` ``[R]`` bool; ``u_accept`` ``[R, K]``,
    ``u_sample`` ``[R, K + 1]``; ``draft_probs`` ``[R, K, V]``, None for certain
    proposals (n-gram)."""
    rows, width, vocab = probs.shape
    k = width - 1
    positions = torch.arange(k, device=probs.device)
    real = positions[None, :] < num_draft[:, None]  # [R, K]: proposals that exist
    picked = proposals.clamp(0, vocab - 1)
    p = probs[:, :k].gather(2, picked[:, :, None]).squeeze(2)  # [R, K]
    q = (
        torch.ones_like(p)
        if draft_probs is None
        else draft_probs.gather(2, picked[:, :, None]).squeeze(2)
    )
    target_top = argmax(probs)  # [R, K + 1]
    sampled_ok = u_accept * q < p  # accept with probability min(1, p / q)
    greedy_ok = proposals == target_top[:, :k]
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & real
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [R]: the accepted prefix

    # the token after the accepted prefix: the residual at a rejection, else a bonus
    at = accepted  # [R]: position of that token
    target_at = probs[torch.arange(rows, device=probs.device), at]  # [R, V]
    if draft_probs is None:
        draft_at = torch.zeros_like(target_at)
        rejected = at < num_draft
        draft_at[rejected, picked[rejected, at[rejected]]] = 1.0
    else:
        padded = torch.cat([draft_probs, draft_probs.new_zeros(rows, 1, vocab)], dim=1)
        draft_at = padded[torch.arange(rows, device=probs.device), at]
        draft_at = torch.where((at < num_draft)[:, None], draft_at, torch.zeros_like(draft_at))
    residual = (target_at - draft_at).clamp_min(0.0)
    # p == q everywhere (the rejection had probability 0, kept by rounding): p itself
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, target_at, residual)
    u = u_sample.gather(1, at[:, None]).squeeze(1)
    drawn = _inverse_cdf(residual, u)
    last = torch.where(greedy, target_top.gather(1, at[:, None]).squeeze(1), drawn)

    tokens = torch.where(real, proposals, torch.zeros_like(proposals))
    tokens = torch.cat([tokens, tokens.new_zeros(rows, 1)], dim=1)
    tokens.scatter_(1, at[:, None], last[:, None])
    return accepted, tokens


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index whose cumulative share of ``weights`` first exceeds ``u``."""
    cdf = weights.double().cumsum(dim=1)
    threshold = (u.double() * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return index.clamp(max=weights.shape[1] - 1)
