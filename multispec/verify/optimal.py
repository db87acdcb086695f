"""The optimal acceptance of any lossless multi-draft selection (arXiv 2410.18234).

A reference for analysis and tests, not a scheme to run. The optimum is the value of a linear
program over couplings of the output with the drafts; equivalently
    P*(acc) = 1 + min over token subsets H of [ p(H) - P(all K drafts lie in H) ].
"""

import itertools

import numpy as np
import torch
from scipy.optimize import linprog
from scipy.sparse import coo_matrix


def optimal_acceptance(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """Optimal acceptance with 1..num_drafts i.i.d. drafts from q: [..., num_drafts], exact, O(V log V).

    For i.i.d. drafts P(all in H) = q(H)^K. Moving a token into H changes the objective by
    p(x) - [(Q + q(x))^K - Q^K], so a minimiser holds every token whose ratio q/p exceeds that of
    any token outside it: H is a prefix of the tokens sorted by q/p descending (ties change the
    objective concavely, so a prefix attains it too). Scan all prefixes, the empty one included.
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts (K) must be at least 1, got {num_drafts}")
    ratio = torch.where(p > 0, q / p.clamp_min(torch.finfo(p.dtype).tiny), torch.where(q > 0, torch.inf, 0.0))
    order = ratio.argsort(-1, descending=True)
    p_cum = p.gather(-1, order).cumsum(-1)
    q_cum = q.gather(-1, order).cumsum(-1)
    curve = [1 + (p_cum - q_cum**k).amin(-1).clamp_max(0) for k in range(1, num_drafts + 1)]
    return torch.stack(curve, -1)


def optimal_acceptance_lp(p: torch.Tensor, q: torch.Tensor, max_tuples: int = 1 << 20) -> float:
    """Optimal acceptance by linear program for small vocabularies: p [V], q [K, V] (draft i ~ q[i], independent).

    The drafts matter only through the set S of distinct tokens they hold, so the program is a
    flow from each set S (supply P(S)) to its members y (demand p(y)); its value is the acceptance.
    Drafts may come from different distributions here, unlike :func:`optimal_acceptance`.
    """
    num_drafts, vocab = q.shape
    if num_drafts < 1:
        raise ValueError("q needs at least one draft row (K >= 1)")
    if vocab**num_drafts > max_tuples:
        raise ValueError(f"V^K = {vocab}^{num_drafts} draft tuples is too many for the exact LP (max_tuples={max_tuples})")
    p_np, q_np = p.double().cpu().numpy(), q.double().cpu().numpy()
    tuples = np.array(list(itertools.product(range(vocab), repeat=num_drafts)))
    prob = np.prod(q_np[np.arange(num_drafts), tuples], axis=1)
    members = np.zeros((len(tuples), vocab), dtype=bool)
    members[np.arange(len(tuples))[:, None], tuples] = True
    sets, inverse = np.unique(members, axis=0, return_inverse=True)
    supply = np.bincount(inverse.reshape(-1), weights=prob, minlength=len(sets))
    edge_set, edge_token = np.nonzero(sets)
    n_edges = len(edge_set)
    # Flow f(S, y) on each edge: sum_y f(S, y) <= P(S), sum_S f(S, y) <= p(y); maximise the total.
    a_ub = coo_matrix(
        (np.ones(2 * n_edges), (np.concatenate([edge_set, len(sets) + edge_token]), np.tile(np.arange(n_edges), 2))),
        shape=(len(sets) + vocab, n_edges),
    ).tocsr()
    result = linprog(-np.ones(n_edges), A_ub=a_ub, b_ub=np.concatenate([supply, p_np]), bounds=(0, None), method="highs")
    if not result.success:
        raise RuntimeError(f"optimal-acceptance LP failed: {result.message}")
    return float(-result.fun)
