"""Single-draft speculative sampling (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318).

Accept the draft x ~ q with probability min(1, p(x)/q(x)); otherwise sample norm((p - q)_+).
The output is exactly p and the acceptance is sum_x min(p(x), q(x)) = 1 - TV(p, q). The canonical
decomposition ends with this same step against its induced distribution q_I.
"""

import torch

from multispec.verify import sampling
from multispec.verify.batch import Selection, as_candidates, rows_of, take
from multispec.verify.sampling import Uniforms
from multispec.verify.validation import check_token_inputs


def accept_or_resample(
    p: torch.Tensor,
    proposal: torch.Tensor,
    token: torch.Tensor,
    rng: Uniforms | torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless correction of ``token`` [N] drawn from ``proposal``: the output, and whether it was accepted.

    ``p`` and ``proposal`` are [R, V] with R = 1 or N. Returns (output [N], accepted [N] bool).
    """
    n = token.shape[0]
    rng = Uniforms.of(rng, n)
    px, qx = take(p, token), take(proposal, token)
    accepted = rng.draw(sampling.TEST, 0, p) * qx < px  # P = min(1, p(x)/q(x))
    output = token.clone()
    rejected = (~accepted).nonzero().squeeze(1)
    if rejected.numel():
        p_rej = rows_of(p, n)[rejected]
        residual = (p_rej - rows_of(proposal, n)[rejected]).clamp_min(0)  # norm((p - q)_+)
        output[rejected] = sampling.sample_rows(residual, rng.rows(rejected), fallback=p_rej)
    return output, accepted


def single_draft(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor,
    rng: Uniforms | torch.Generator | None = None,
    *,
    validate: bool = True,
) -> Selection:
    """One draft per row (candidates [N] or [N, 1]) drawn from q [R, V]."""
    candidates = as_candidates(candidates)
    if validate:
        check_token_inputs(p, candidates, q, (2,))
        if candidates.shape[1] != 1:
            raise ValueError(f"single-draft speculative sampling takes one candidate per row, got K = {candidates.shape[1]}")
    token = candidates[:, 0]
    output, accepted = accept_or_resample(p, q, token, rng)
    index = torch.where(accepted, 0, -1)
    return Selection(output, index)


def acceptance_single(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact acceptance sum_x min(p, q) for rows of p, q [..., V]."""
    return torch.minimum(p, q).sum(-1)
