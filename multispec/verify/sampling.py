"""Random draws shared by the verification schemes.

Randomness comes only from the caller's ``torch.Generator``, so a fixed seed gives fixed outputs.
Every draw from a (residual) distribution goes through :func:`sample_rows`; it is the single place
where the tests plant a bias to show that their statistical checks have power.
"""

import torch


def uniform(n: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent U[0, 1) draws with the dtype and device of ``like``."""
    return torch.rand(n, generator=generator, device=like.device, dtype=like.dtype)


def sample_rows(
    weights: torch.Tensor,
    generator: torch.Generator | None,
    fallback: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one index per row of ``weights`` [N, V] with probability proportional to the row.

    Inverse-CDF sampling: one cumulative sum and one uniform per row, cheaper over a 49k
    vocabulary than Gumbel noise or ``torch.multinomial``. A row whose weights sum to zero is only
    reachable through rounding (an analytically vanishing residual); it draws from the same row of
    ``fallback`` instead (usually the target distribution itself).
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1]
    if fallback is not None:
        empty = total <= 0
        if bool(empty.any()):
            weights = torch.where(empty[:, None], fallback, weights)
            cdf = weights.cumsum(-1)
            total = cdf[:, -1]
    u = torch.rand(weights.shape[0], 1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, u * total[:, None], right=True).squeeze(1)
    # With right=True a zero-weight entry is never returned, except that u * total can round up
    # to total; those rows take their last entry of positive weight.
    overflow = index >= weights.shape[1]
    if bool(overflow.any()):
        positive = (weights[overflow] > 0).flip(-1).int().argmax(-1)
        index[overflow] = weights.shape[1] - 1 - positive
    return index
