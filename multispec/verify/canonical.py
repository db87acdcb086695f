"""The canonical decomposition of multi-draft selection (Khisti et al., arXiv 2410.18234).

K i.i.d. drafts from q. Step 1 picks one of them with a selection rule; the picked token Y then
has a known law q_I. Step 2 is single-draft speculative sampling of Y against q_I: accept with
min(1, p(Y)/q_I(Y)), else draw norm((p - q_I)_+). The output is exactly p for every rule whose q_I
is computed exactly, and the acceptance is sum_y min(p(y), q_I(y)); the rule only decides how
close q_I gets to p.

The rule is a tournament (the paper's "K > 2 by a tournament"): the winner so far (law a, starting
with a = q) meets the next draft (law b = q), one survives, and the survivor's law is the next a.
A round plays one of two rules, whichever gives the larger acceptance for this (p, a, b):
- ranking: tokens ranked best first, the higher-ranked token of a pair survives ("lower rank
  wins"). The first s ranked tokens are those with the largest p - a*b (the paper's key); inside
  this block the rule is free, ``first_wins[i, j]`` being the probability that the winner's token
  top_i survives against a challenger top_j, set by a linear program maximising sum min(p, q_I)
  (rule "lp", scipy HiGHS) or by weighted importance sampling (rule "wis", w_a(i) / (w_a(i) + w_b(j))
  with importance weights w_a = p/a, w_b = p/b). Below the block, ranked tokens follow p/(a + b).
  Only ``ranked`` tokens (the largest p - a*b) are ranked, which avoids a full-vocabulary sort
  per round; unranked tokens never displace a winner.
- transfer (see :func:`_transfer_round`): only a winner in surplus (a > p) can be displaced, only
  by a challenger in deficit (a < p). It never lowers the acceptance, which ranking does once a
  is close to p (from K = 3 on with drafts close to the target).
"""

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from multispec.verify import sampling
from multispec.verify.batch import Selection, first_true, rows_of, take
from multispec.verify.sampling import Uniforms
from multispec.verify.speculative import accept_or_resample
from multispec.verify.validation import check_token_inputs

RULES = ("lp", "wis")
DEFAULT_TOP_S = 5
DEFAULT_RANKED = 64


@dataclass
class Round:
    """The selection rule of one tournament round (winner so far against the next draft)."""

    top: torch.Tensor  # [R, m] ranked token ids, best first (the first s form the free block)
    first_wins: torch.Tensor  # [R, s, s] P(winner's token top_i survives against challenger top_j)
    transfer: torch.Tensor  # [R] bool: the round plays the transfer rule instead of the ranking
    winner_law: torch.Tensor  # [R, V] law a of the winner so far
    draft_law: torch.Tensor  # [R, V] law b of the challenger
    surplus: torch.Tensor  # [R] total surplus S = sum (a - p)_+ (transfer rule)


def tournament(
    p: torch.Tensor,
    q: torch.Tensor,
    num_drafts: int,
    rule: str = "lp",
    top_s: int = DEFAULT_TOP_S,
    ranked: int | None = DEFAULT_RANKED,
) -> tuple[list[Round], list[torch.Tensor]]:
    """Rules of the num_drafts - 1 rounds and the laws q_I after 1..num_drafts drafts (p, q [R, V])."""
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; expected one of {RULES}")
    if num_drafts < 1:
        raise ValueError(f"num_drafts (K) must be at least 1, got {num_drafts}")
    if top_s < 1:
        raise ValueError(f"top_s must be at least 1, got {top_s}")
    rounds, laws = [], [q]
    for _ in range(num_drafts - 1):
        rnd, law = _play_round(p, laws[-1], q, rule, top_s, ranked)
        rounds.append(rnd)
        laws.append(law)
    return rounds, laws


def _play_round(p, a, b, rule, top_s, ranked):
    """One round: the rule for (winner ~ a, challenger ~ b) and the survivor's law."""
    vocab = p.shape[1]
    m = vocab if ranked is None else max(1, min(ranked, vocab))
    s = min(top_s, m)
    top = _ranking(p, a, b, m, s)
    a_top, b_top = a.gather(1, top), b.gather(1, top)
    # Unranked tokens never displace a winner, so an unranked y survives only as the winner and
    # only against an unranked challenger: q_I(y) = a(y) * B_unranked.
    unranked = torch.ones_like(p, dtype=torch.bool).scatter_(1, top, False)
    a_rest = (a * unranked).sum(-1, keepdim=True)
    b_rest = (b * unranked).sum(-1, keepdim=True)
    law = a * b_rest * unranked
    # Ranked tokens: "lower rank wins", every unranked token ranking below all ranked ones:
    # q_I(y) = a(y) b(y) + a(y) B_below(y) + b(y) A_below(y), X_below = mass ranked below y.
    a_below = _mass_after(a_top) + a_rest
    b_below = _mass_after(b_top) + b_rest
    law_top = a_top * b_top + a_top * b_below + b_top * a_below
    # Top-s block: pairs inside it follow first_wins instead of the ranking.
    a_s, b_s, p_s = a_top[:, :s], b_top[:, :s], p.gather(1, top[:, :s])
    pair = a_s[:, :, None] * b_s[:, None, :]
    base = a_s * b_s + a_s * b_below[:, s - 1 : s] + b_s * a_below[:, s - 1 : s]
    if rule == "lp":
        first_wins = solve_block_lp(pair, base, p_s)
    else:
        first_wins = _importance_weights(p_s, a_s, b_s)
    off = ~torch.eye(s, dtype=torch.bool, device=p.device)
    law_top[:, :s] = base + (pair * first_wins * off).sum(2) + (pair * (1 - first_wins) * off).sum(1)
    law = law.scatter(1, top, law_top)
    transfer, law_transfer = _transfer_round(p, a, b)
    use_transfer = torch.minimum(p, law_transfer).sum(-1) >= torch.minimum(p, law).sum(-1)
    return Round(top, first_wins, use_transfer, a, b, transfer), torch.where(use_transfer[:, None], law_transfer, law)


def _transfer_round(p, a, b):
    """The transfer rule and its law: only a surplus winner is displaced, only by a deficit challenger.

    With surplus s = (a - p)_+ (total S) and deficit d = (p - a)_+, the challenger y displaces the
    winner x with probability alpha(x) beta(y), alpha = s / a and beta = min(1, d / (b S)). Then
    q_I = a - s * sum_y min(b S, d) / S + min(b S, d): surplus tokens stay at or above p, deficit
    tokens stay at or below it, and the acceptance grows by sum_y min(b(y) S, d(y)) >= 0, the
    step of recursive rejection sampling (SpecInfer) against norm(d). Ranking rounds move mass
    toward the top tokens whether or not it is needed there, which costs acceptance once a is
    already close to p; each round plays whichever of the two rules accepts more.
    """
    surplus = (a - p).clamp_min(0)
    total = surplus.sum(-1)
    gain = torch.minimum(b * total[:, None], (p - a).clamp_min(0))
    loss = surplus * (gain.sum(-1) / total.clamp_min(torch.finfo(p.dtype).tiny))[:, None]
    return total, a - loss + gain


def _ranking(p, a, b, m, s):
    """The m ranked tokens [R, m], best first: the top s by p - a*b (the block), then by p / (a + b).

    The block follows the paper's key. Below it a token with a large ratio of target mass to draft
    mass should survive first (the optimal subset of arXiv 2410.18234 sorts tokens by q/p);
    on random cases this order beats p - a*b by about 1% acceptance at s = 5.
    """
    key = p - a * b
    if m == p.shape[1]:
        ranked = torch.argsort(key, dim=-1, descending=True, stable=True)
    else:
        ranked = key.topk(m, -1).indices
    below = ranked[:, s:]
    ratio = p.gather(1, below) / (a.gather(1, below) + b.gather(1, below)).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.cat([ranked[:, :s], below.gather(1, torch.argsort(ratio, dim=-1, descending=True, stable=True))], 1)


def _mass_after(x: torch.Tensor) -> torch.Tensor:
    """For each position, the sum of the entries after it along the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1) - x


def _importance_weights(p_s: torch.Tensor, a_s: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """WIS rule: the pair (top_i from a, top_j from b) keeps top_i with w_a(i) / (w_a(i) + w_b(j)).

    Self-normalised importance weights w = p / (law the token was drawn from); a pair of zero
    weights (tokens the target never emits) is split evenly.
    """
    tiny = torch.finfo(p_s.dtype).tiny
    w_a = p_s / a_s.clamp_min(tiny)
    w_b = p_s / b_s.clamp_min(tiny)
    total = w_a[:, :, None] + w_b[:, None, :]
    return torch.where(total > 0, w_a[:, :, None] / total.clamp_min(tiny), 0.5)


def solve_block_lp(pair: torch.Tensor, base: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """first_wins [R, s, s] maximising sum_i min(target_i, q_I(top_i)) inside the top-s block.

    Variables per row: w[i, j] (i != j) and t_i; maximise sum t_i subject to t_i <= target_i and
    t_i <= q_I(top_i) = base_i + sum_j pair[i, j] w[i, j] + sum_j pair[j, i] (1 - w[j, i]).
    Rows with identical inputs share one solve; all distinct rows go to HiGHS as one block-diagonal
    LP, which costs far less than one solver call per row. The solution is clipped to [0, 1]; q_I
    is always recomputed from the clipped rule, so solver tolerance cannot affect losslessness.
    """
    rows, s = base.shape
    inputs = torch.cat([pair.flatten(1), base, target], 1)
    unique, inverse = torch.unique(inputs.detach().cpu().double(), dim=0, return_inverse=True)
    unique = unique.numpy()
    blocks = unique.shape[0]
    pair_u = unique[:, : s * s].reshape(blocks, s, s)
    base_u, target_u = unique[:, s * s : s * s + s], unique[:, s * s + s :]
    n_var = s * s + s  # per block: w[i, j] row-major, then t_i
    off = ~np.eye(s, dtype=bool)
    blk, i, j = np.nonzero(np.broadcast_to(off, (blocks, s, s)))
    t_blk, t_i = np.divmod(np.arange(blocks * s), s)
    # Row (block, i): t_i - sum_j pair[i, j] w[i, j] + sum_j pair[j, i] w[j, i] <= base_i + sum_j pair[j, i]
    a_ub = coo_matrix(
        (
            np.concatenate([-pair_u[blk, i, j], pair_u[blk, j, i], np.ones(blocks * s)]),
            (
                np.concatenate([blk * s + i, blk * s + i, t_blk * s + t_i]),
                np.concatenate([blk * n_var + i * s + j, blk * n_var + j * s + i, t_blk * n_var + s * s + t_i]),
            ),
        ),
        shape=(blocks * s, blocks * n_var),
    ).tocsr()
    b_ub = (base_u + (pair_u * off).sum(1)).reshape(-1)
    upper = np.concatenate([np.broadcast_to(off.reshape(1, -1), (blocks, s * s)).astype(float), target_u], 1)
    bounds = np.stack([np.zeros(blocks * n_var), upper.reshape(-1)], 1)
    cost = np.concatenate([np.zeros((blocks, s * s)), -np.ones((blocks, s))], 1).reshape(-1)
    result = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if not result.success:
        raise RuntimeError(f"selection LP failed: {result.message}")
    w = np.clip(result.x.reshape(blocks, n_var)[:, : s * s], 0.0, 1.0).reshape(blocks, s, s)
    return torch.as_tensor(w, dtype=pair.dtype, device=pair.device)[inverse.to(pair.device)]


def canonical_select(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor,
    rng: Uniforms | torch.Generator | None = None,
    *,
    rule: str = "lp",
    top_s: int = DEFAULT_TOP_S,
    ranked: int | None = DEFAULT_RANKED,
    validate: bool = True,
) -> Selection:
    """Verify i.i.d. candidates [N, K] (drawn from q [R, V]) against p [R, V]."""
    if validate:
        check_token_inputs(p, candidates, q, (2,))
    n, k_max = candidates.shape
    rng = Uniforms.of(rng, n)
    count = (candidates >= 0).sum(1)
    rounds, laws = tournament(p, q, k_max, rule, top_s, ranked)
    winner = candidates[:, 0].clone()
    index = torch.zeros(n, dtype=torch.long, device=p.device)
    for k, rnd in enumerate(rounds, start=1):
        challenger = candidates[:, k]
        keep = _winner_survives(rnd, p, winner, challenger.clamp_min(0), rng.draw(sampling.ROUND, k, p))
        switch = (challenger >= 0) & ~keep
        winner = torch.where(switch, challenger, winner)
        index = torch.where(switch, k, index)
    law = torch.stack(laws)
    if p.shape[0] == n:
        law_rows = law[count - 1, torch.arange(n, device=p.device)]
    elif bool((count == k_max).all()):
        law_rows = law[k_max - 1]
    else:
        law_rows = law[count - 1, 0]
    output, accepted = accept_or_resample(p, law_rows, winner, rng)
    return Selection(output, torch.where(accepted, index, -1))


def _winner_survives(rnd: Round, p: torch.Tensor, winner: torch.Tensor, challenger: torch.Tensor,
                     u: torch.Tensor) -> torch.Tensor:
    """Apply one round's rule to actual tokens [N] with one uniform ``u`` per row: True where the
    winner so far survives."""
    n = winner.shape[0]
    s = rnd.first_wins.shape[1]
    rank_w, rank_c = _rank(rnd.top, winner), _rank(rnd.top, challenger)
    in_block = (rank_w < s) & (rank_c < s)
    flat = (rank_w.clamp_max(s - 1) * s + rank_c.clamp_max(s - 1))[:, None]
    keep_prob = rows_of(rnd.first_wins.flatten(1), n).gather(1, flat).squeeze(1)
    by_rank = torch.where(in_block, u < keep_prob, rank_w <= rank_c)
    # Transfer rule: displaced with probability alpha(winner) * beta(challenger).
    tiny = torch.finfo(p.dtype).tiny
    a_w, p_w = take(rnd.winner_law, winner), take(p, winner)
    a_c, b_c, p_c = take(rnd.winner_law, challenger), take(rnd.draft_law, challenger), take(p, challenger)
    alpha = (a_w - p_w).clamp_min(0) / a_w.clamp_min(tiny)
    beta = ((p_c - a_c).clamp_min(0) / (b_c * rows_of(rnd.surplus, n)).clamp_min(tiny)).clamp_max(1)
    by_transfer = u >= alpha * beta
    survives = torch.where(rows_of(rnd.transfer, n), by_transfer, by_rank)
    return survives | (winner == challenger)


def _rank(top: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Priority of each token (lower survives): its position among the ranked tokens, m if unranked."""
    position = first_true(rows_of(top, token.shape[0]) == token[:, None])
    return torch.where(position >= 0, position, top.shape[1])


def acceptance_canonical(
    p: torch.Tensor,
    q: torch.Tensor,
    num_drafts: int,
    rule: str = "lp",
    top_s: int = DEFAULT_TOP_S,
    ranked: int | None = DEFAULT_RANKED,
) -> torch.Tensor:
    """Exact acceptance sum min(p, q_I) with 1..num_drafts i.i.d. drafts: [R, num_drafts] for p, q [R, V]."""
    _, laws = tournament(p, q, num_drafts, rule, top_s, ranked)
    return torch.stack([torch.minimum(p, law).sum(-1) for law in laws], -1)
