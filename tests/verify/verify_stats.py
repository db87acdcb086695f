"""Shared statistics and case generators for the verification tests."""

import numpy as np
import torch
from scipy.stats import chi2, ncx2

ALPHA = 1e-4  # per-test false-alarm rate of every distribution test
DRAWS = 200_000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts against probabilities.

    Outcomes the target never emits must never be observed (checked exactly, before any statistics);
    outcomes with expected count below 5 are pooled into one bin so the chi-square law holds.
    """
    counts, probs = counts.double().cpu(), probs.double().cpu()
    impossible = probs <= 0
    assert int(counts[impossible].sum()) == 0, "an outcome of target probability 0 was emitted"
    n = counts.sum()
    expected = probs[~impossible] * n
    observed = counts[~impossible]
    small = expected < 5
    if bool(small.any()):
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(expected) - 1))


def power_lower_bound(probs: torch.Tensor, j: int, rejection: float, bias: float, draws: int = DRAWS) -> float:
    """Power at ALPHA of the chi-square test against a residual that moves ``bias`` of its mass onto token j.

    A draw falls back to the residual with probability ``rejection``, so the output moves by
    delta = bias * rejection * (e_j - r), r the output law given rejection. Then
    delta_j >= bias * (rejection - p_j) because rejection * r_j <= p_j, and the noncentrality
    draws * sum_i delta_i^2 / p_i is at least draws * delta_j^2 / p_j.
    """
    probs = probs.double().flatten()
    df = int((probs > 0).sum()) - 1
    p_j = float(probs[j])
    shift = bias * max(0.0, rejection - p_j)
    return float(ncx2.sf(chi2.isf(ALPHA, df), df, draws * shift**2 / p_j))


def dirichlet(size: int, concentration: float, generator: torch.Generator) -> torch.Tensor:
    """A random distribution over ``size`` outcomes (float64, one row)."""
    gamma = torch.distributions.Gamma(torch.full((size,), concentration, dtype=torch.float64), 1.0)
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (), generator=generator)))
        x = gamma.sample()
    return (x / x.sum())[None]


def random_case(vocab: int, partial_support: bool, seed: int, concentration: float = 1.0):
    """Target p and draft q [1, V]; with ``partial_support`` each lacks some tokens the other has."""
    g = torch.Generator().manual_seed(seed)
    p = dirichlet(vocab, concentration, g)
    q = dirichlet(vocab, concentration, g)
    if partial_support:
        cut = max(1, vocab // 4)
        p[0, :cut] = 0  # tokens only the draft proposes
        q[0, cut : 2 * cut] = 0  # tokens only the target emits
        p, q = p / p.sum(), q / q.sum()
    return p, q


def iid_drafts(q: torch.Tensor, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[n, k] drafts drawn i.i.d. from the row q [1, V]."""
    return torch.multinomial(q[0], n * k, replacement=True, generator=generator).view(n, k)


def drafts_without_replacement(q: torch.Tensor, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[n, k] drafts drawn one after another without replacement from q [1, V] (Gumbel-top-k)."""
    u = torch.rand(n, q.shape[1], generator=generator, dtype=torch.float64).clamp_min(1e-300)
    keys = q.log() - (-u.log()).log()
    return keys.topk(k, -1).indices


def np_counts(tokens: torch.Tensor, size: int) -> torch.Tensor:
    """Histogram of token ids."""
    return torch.as_tensor(np.bincount(tokens.cpu().numpy(), minlength=size))
