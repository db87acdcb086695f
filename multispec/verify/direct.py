"""Schemes that need no draft distribution: the output token is drawn from p first, then looked up.

Both are lossless for any candidates whatever their origin, because the output never depends on
them; the candidates only decide whether the output counts as an accepted draft
(arXiv 2410.18234, "deterministic drafts").
"""

import torch

from multispec.verify import sampling
from multispec.verify.batch import Selection, as_candidates, first_match
from multispec.verify.sampling import Uniforms
from multispec.verify.validation import check_token_inputs


def greedy_select(p: torch.Tensor, candidates: torch.Tensor, *, validate: bool = True) -> Selection:
    """Temperature 0: the output is argmax p (lowest token id on ties); a candidate equal to it is accepted.

    ``p`` may be any scores whose argmax is the greedy token (probabilities or one-hot rows).
    """
    candidates = as_candidates(candidates)
    if validate:
        check_token_inputs(p, candidates, None, ())
    token = p.argmax(-1).expand(candidates.shape[0])
    return Selection(token.clone(), first_match(candidates, token))


def deterministic_select(
    p: torch.Tensor,
    candidates: torch.Tensor,
    rng: Uniforms | torch.Generator | None = None,
    *,
    validate: bool = True,
) -> Selection:
    """Drafts without a distribution (copied text): draw y ~ p and accept the candidate equal to y.

    Acceptance is p summed over the distinct candidate tokens.
    """
    candidates = as_candidates(candidates)
    if validate:
        check_token_inputs(p, candidates, None, ())
    token = sampling.sample_rows(p, Uniforms.of(rng, candidates.shape[0]), fallback=p)
    return Selection(token, first_match(candidates, token))
