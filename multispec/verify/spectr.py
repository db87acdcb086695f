"""SpecTr K-SEQ (Sun et al., arXiv 2310.15141).

K i.i.d. drafts from q. With beta(rho) = sum_x min(p(x)/rho, q(x)), each draft passes the test
rho * U_i <= p(X_i)/q(X_i) with probability beta(rho), so some draft passes with probability
p_acc(rho) = 1 - (1 - beta(rho))^K, and the first passing draft is distributed as
min(p/rho, q)/beta. When none passes, the output is drawn from norm((p - gamma * min(p/rho, q))_+)
with gamma = p_acc/beta. The output is exactly p whenever p_acc(rho) <= rho * beta(rho) (then the
residual is non-negative with mass 1 - p_acc); acceptance is largest at the root rho* in [1, K] of
p_acc(rho) = rho * beta(rho).
"""

import torch

from multispec.verify import sampling
from multispec.verify.batch import Selection, first_true, rows_of
from multispec.verify.sampling import Uniforms
from multispec.verify.validation import check_token_inputs

BISECTION_STEPS = 30


def spectr_rho(p: torch.Tensor, q: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """rho* per row by bisection on [1, K] (p, q [R, V]; num_drafts [R] or scalar, >= 1).

    f(rho) = p_acc(rho) - rho * beta(rho) is decreasing, f(1) >= 0 and f(K) <= 0 (union bound).
    The upper end of the bracket always satisfies f <= 0, so returning it keeps the scheme exactly
    lossless whatever the bisection precision; 30 halvings lose under 1e-8 of acceptance.
    """
    k = torch.as_tensor(num_drafts, dtype=p.dtype, device=p.device).expand(p.shape[0])
    lo = torch.ones_like(k)
    hi = k.clone()
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        beta = torch.minimum(p / mid[:, None], q).sum(-1)
        above = 1 - (1 - beta) ** k > mid * beta
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return hi


def spectr_select(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor,
    rng: Uniforms | torch.Generator | None = None,
    *,
    validate: bool = True,
) -> Selection:
    """Verify i.i.d. candidates [N, K] (drawn from q [R, V]) against p [R, V]."""
    if validate:
        check_token_inputs(p, candidates, q, (2,))
    n, k_max = candidates.shape
    rng = Uniforms.of(rng, n)
    valid = candidates >= 0
    count = valid.sum(1)
    if p.shape[0] == 1 and bool((count != k_max).any()):
        p, q = p.expand(n, -1), q.expand(n, -1)  # rows with different K need their own rho
    k = count if p.shape[0] == n else torch.full((1,), k_max, device=p.device)
    rho = spectr_rho(p, q, k)
    safe = candidates.clamp_min(0)
    px = rows_of(p, n).gather(1, safe)
    qx = rows_of(q, n).gather(1, safe)
    u = torch.stack([rng.draw(sampling.TEST, k, p) for k in range(k_max)], 1)
    passed = valid & (rows_of(rho, n)[:, None] * u * qx < px)  # P = min(1, p(x) / (rho q(x)))
    index = first_true(passed)
    output = candidates.gather(1, index.clamp_min(0)[:, None]).squeeze(1)
    rejected = (index < 0).nonzero().squeeze(1)
    if rejected.numel():
        output[rejected] = sampling.sample_rows(_residual(p, q, rho, k, rejected, n), rng.rows(rejected),
                                                fallback=rows_of(p, n)[rejected])
    return Selection(output, index)


def _residual(p, q, rho, k, rows, n):
    """Unnormalised p - gamma * min(p/rho, q) for the given rows, gamma = p_acc / beta."""
    p_r, q_r = rows_of(p, n)[rows], rows_of(q, n)[rows]
    rho_r, k_r = rows_of(rho, n)[rows], rows_of(k.to(p.dtype), n)[rows]
    part = torch.minimum(p_r / rho_r[:, None], q_r)
    beta = part.sum(-1)
    p_acc = 1 - (1 - beta) ** k_r
    gamma = torch.where(beta > 0, p_acc / beta.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
    return (p_r - gamma[:, None] * part).clamp_min(0)


def acceptance_spectr(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """Exact acceptance 1 - (1 - beta(rho*))^K with 1..num_drafts i.i.d. drafts: [R, num_drafts] for p, q [R, V]."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts (K) must be at least 1, got {num_drafts}")
    curve = []
    for k in range(1, num_drafts + 1):
        rho = spectr_rho(p, q, torch.tensor(float(k)))
        beta = torch.minimum(p / rho[:, None], q).sum(-1)
        curve.append(1 - (1 - beta) ** k)
    return torch.stack(curve, -1)
