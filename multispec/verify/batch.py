"""Small helpers for batches of candidate sets.

Token-level schemes take ``candidates`` [N, K] (long): row n holds the draft tokens at one tree node,
in the order they were drafted, padded with -1 at the end when the node has fewer than K. Target
and draft rows ([R, V]) either match the candidates row for row (R = N) or are one row shared by
all candidate rows (R = 1), which lets a test run 200,000 independent copies of one case without
copying the distributions.
"""

from typing import NamedTuple

import torch


class Selection(NamedTuple):
    """What a token-level scheme returns for each row."""

    token: torch.Tensor  # [N] long: the output token, distributed exactly as p
    index: torch.Tensor  # [N] long: which candidate was accepted (its column), -1 if none


def as_candidates(candidates: torch.Tensor) -> torch.Tensor:
    """Accept a single draft per row given as [N] by viewing it as [N, 1]."""
    return candidates[:, None] if candidates.dim() == 1 else candidates


def rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """View a per-row tensor with 1 or n rows as n rows (no copy)."""
    return t if t.shape[0] == n else t.expand(n, *t.shape[1:])


def take(t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``t[row, tokens[row]]`` for a [R, V] tensor (R = 1 or N) and tokens [N] >= 0."""
    return rows_of(t, tokens.shape[0]).gather(1, tokens[:, None]).squeeze(1)


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """Column of the first True in each row of ``mask`` [N, K], -1 when there is none."""
    if mask.shape[1] == 0:
        return torch.full(mask.shape[:1], -1, dtype=torch.long, device=mask.device)
    first = mask.int().argmax(1)  # argmax returns the first maximum
    return torch.where(mask.any(1), first, -1)


def first_match(candidates: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Column of the first candidate equal to ``token`` in each row, -1 when none is."""
    return first_true(candidates == token[:, None])


def normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of ``weights`` scaled to sum to one; a row summing to zero is replaced by ``fallback``.

    A residual such as norm((p - q)_+) vanishes only when the previous step accepted with
    certainty, so the fallback row is never sampled from except through rounding.
    """
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), fallback)
