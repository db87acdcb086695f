"""Recursive rejection sampling over K drafts (SpecInfer, arXiv 2305.09781; without replacement: MCSD,
arXiv 2401.06706).

With replacement (SpecInfer): drafts X_1..X_K are independent, X_i ~ q_i. Each in turn is accepted
with probability min(1, p_i(X_i)/q_i(X_i)); on rejection the target becomes p_{i+1} = norm((p_i - q_i)_+);
when all are rejected the output is drawn from p_{K+1}. Lossless because, given a rejection,
p_{i+1} does not depend on which token was rejected.

Without replacement (recursive speculative decoding / MCSD): X_1 ~ q and each next draft is drawn
from q with the earlier drafts removed and renormalised, q_{i+1} = norm(q_i with q_i(X_i) = 0). The
same recursion holds with q_i in place of a fixed q; a rejected X_i has p_i(X_i) < q_i(X_i), so
p_{i+1}(X_i) = 0 and removing it from q costs nothing.

Copied candidates after the drawn ones (the hybrid drafter's sibling text next to the head's
candidates): a candidate copied from elsewhere was "drawn" from a point mass, so the recursion
treats it as a draft with q = delta: accepted with probability p_i(x), and on rejection the target
loses x. A run of such candidates at the end, after every drawn one is rejected, is therefore
exactly the deterministic rule on the residual: draw y ~ p_{K+1} and accept the copied candidate
equal to y (one draw for all of them). Exact because each candidate's law given the ones before it
is known (the copied ones may depend on what was drawn before them, never on the target's draws).
"""

import torch

from multispec.verify import sampling
from multispec.verify.batch import Selection, normalise, rows_of, take
from multispec.verify.sampling import Uniforms
from multispec.verify.validation import check_token_inputs


def recursive_rejection(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor,
    rng: Uniforms | torch.Generator | None = None,
    *,
    without_replacement: bool = False,
    copied: torch.Tensor | None = None,
    validate: bool = True,
) -> Selection:
    """Verify candidates [N, K] against p [R, V].

    With replacement, q is [R, V] (i.i.d. drafts) or [R, K, V] (draft i from q[:, i]). Without
    replacement, q [R, V] is the distribution the first draft was drawn from; later drafts were
    drawn from it with the earlier drafts removed.

    ``copied`` [N, K] bool marks candidates that carry no q (copied text); in each row they must
    follow every drawn candidate, and they are verified after those by the deterministic rule on
    the residual (see the module docstring). A row may hold copied candidates only (its q row is
    then not read).
    """
    if validate:
        check_token_inputs(p, candidates, q, (2,) if without_replacement else (2, 3))
        if copied is not None:
            check_copied_after_drawn(candidates, copied)
    n, k_max = candidates.shape
    rng = Uniforms.of(rng, n)
    p_cur = rows_of(p, n)
    q_cur = rows_of(q, n)
    output = torch.full((n,), -1, dtype=torch.long, device=p.device)
    index = torch.full((n,), -1, dtype=torch.long, device=p.device)
    undecided = torch.ones(n, dtype=torch.bool, device=p.device)
    owned_p = owned_q = False  # p_cur / q_cur still the caller's rows (or one shared row)
    for k in range(k_max):
        token = candidates[:, k]
        live = undecided & (token >= 0)
        if copied is not None:
            live &= ~copied[:, k]
        if not bool(live.any()):
            break  # drawn candidates come first: only copied ones (or none) are left
        q_k = q_cur[:, k] if q_cur.dim() == 3 else q_cur
        safe = token.clamp_min(0)
        px, qx = take(p_cur, safe), take(q_k, safe)
        accepted = live & (rng.draw(sampling.TEST, k, p) * qx < px)  # P = min(1, p_k(x)/q_k(x))
        output = torch.where(accepted, token, output)
        index = torch.where(accepted, k, index)
        undecided &= ~accepted
        # Residuals of the rejected rows only: a row that accepted is decided, and a row with no
        # live candidate keeps its distribution. Each residual is a few passes over a vocabulary
        # row, so the rows that need none are not touched.
        rejected = (live & ~accepted).nonzero().squeeze(1)
        if rejected.numel() == 0:
            continue
        p_rej, q_rej = p_cur[rejected], q_k[rejected]
        if not owned_p:
            p_cur, owned_p = p_cur.clone(memory_format=torch.contiguous_format), True
        p_cur[rejected] = normalise((p_rej - q_rej).clamp_min(0), p_rej)
        if without_replacement and k + 1 < k_max:  # the next candidate's q: this one's token removed
            removed = q_rej.scatter(1, safe[rejected, None], 0.0)
            if not owned_q:
                q_cur, owned_q = q_cur.clone(memory_format=torch.contiguous_format), True
            q_cur[rejected] = normalise(removed, q_rej)
    rest = undecided.nonzero().squeeze(1)
    if rest.numel():
        p_rest = p_cur[rest]
        output[rest] = sampling.sample_rows(p_rest, rng.rows(rest), fallback=p_rest)
        if copied is not None:
            copies = candidates[rest]
            match = copied[rest] & (copies >= 0) & (copies == output[rest][:, None])
            index[rest] = torch.where(match.any(1), match.float().argmax(1), -1)
    return Selection(output, index)


def check_copied_after_drawn(candidates: torch.Tensor, copied: torch.Tensor) -> None:
    """Raise ValueError unless ``copied`` has the candidates' shape and no drawn candidate follows
    a copied one in its row."""
    if copied.shape != candidates.shape or copied.dtype != torch.bool:
        raise ValueError(f"copied must be a bool tensor shaped like candidates {tuple(candidates.shape)}, got "
                         f"{copied.dtype} {tuple(copied.shape)}")
    drawn = ~copied & (candidates >= 0)
    seen_copy = (copied & (candidates >= 0)).long().cummax(1).values.bool()
    if bool((drawn & seen_copy).any()):
        raise ValueError("copied candidates must follow every candidate drawn from q in their row")


def acceptance_specinfer(p: torch.Tensor, q: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """Exact acceptance with 1..num_drafts independent drafts: [..., num_drafts].

    p [..., V]; q [..., V] (i.i.d. drafts) or [..., num_drafts, V] (draft i from q[..., i, :]).
    Step i accepts with a_i = sum min(p_i, q_i) given it is reached, and the residual chain is
    deterministic, so P(accept within k drafts) = 1 - prod_{i<=k} (1 - a_i).
    """
    _check_num_drafts(num_drafts)
    p_cur = p
    miss = torch.ones(p.shape[:-1], dtype=p.dtype, device=p.device)
    curve = []
    for i in range(num_drafts):
        q_i = q[..., i, :] if q.dim() == p.dim() + 1 else q
        miss = miss * (1 - torch.minimum(p_cur, q_i).sum(-1))
        curve.append(1 - miss)
        p_cur = normalise((p_cur - q_i).clamp_min(0), p_cur)
    return torch.stack(curve, -1)


def acceptance_without_replacement(p: torch.Tensor, q: torch.Tensor, num_drafts: int, max_states: int = 1 << 20) -> torch.Tensor:
    """Exact acceptance with 1..num_drafts drafts drawn without replacement: [num_drafts].

    p, q are single rows [V]. No closed form exists because q_{i+1} depends on the rejected token,
    so this enumerates every sequence of rejected tokens (only tokens with q_i > p_i can be
    rejected) with its probability; raise when more than ``max_states`` sequences would be needed
    and use :func:`estimate_acceptance_without_replacement` instead.
    """
    _check_num_drafts(num_drafts)
    p_s, q_s = p[None], q[None]
    reach = torch.ones(1, dtype=p.dtype, device=p.device)
    total = torch.zeros((), dtype=p.dtype, device=p.device)
    curve = []
    for i in range(num_drafts):
        total = total + (reach * torch.minimum(p_s, q_s).sum(-1)).sum()
        curve.append(total)
        if i + 1 == num_drafts:
            break
        # Rejecting token x: drawn with q_i(x), rejected with 1 - p_i(x)/q_i(x): mass (q_i - p_i)_+(x).
        branch = reach[:, None] * (q_s - p_s).clamp_min(0)
        state, token = branch.nonzero(as_tuple=True)
        if state.numel() > max_states:
            raise ValueError(f"exact enumeration needs {state.numel()} states (> max_states={max_states})")
        p_next = normalise((p_s - q_s).clamp_min(0), p_s)[state]
        q_next = q_s[state].scatter(1, token[:, None], 0.0)
        p_s, q_s, reach = p_next, normalise(q_next, q_next), branch[state, token]
    return torch.stack(curve)


def estimate_acceptance_without_replacement(
    p: torch.Tensor,
    q: torch.Tensor,
    num_drafts: int,
    num_paths: int = 256,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased estimate (and its standard error) of the acceptance with 1..num_drafts drafts without replacement.

    For vocabularies where enumeration is impossible. Rao-Blackwellised: along each simulated chain
    of rejections the acceptance probability of every step is added exactly, and only which token
    was rejected is sampled (from (q_i - p_i)_+), so the variance is far below that of simulating
    accept/reject. p, q are single rows [V]; returns ([num_drafts], [num_drafts]).
    """
    _check_num_drafts(num_drafts)
    p_s = p.expand(num_paths, -1)
    q_s = q.expand(num_paths, -1)
    reach = torch.ones(num_paths, dtype=p.dtype, device=p.device)
    total = torch.zeros(num_paths, dtype=p.dtype, device=p.device)
    curve = []
    for i in range(num_drafts):
        a = torch.minimum(p_s, q_s).sum(-1)
        total = total + reach * a
        curve.append(total)
        if i + 1 == num_drafts:
            break
        rejection = (q_s - p_s).clamp_min(0)
        token = sampling.sample_rows(rejection, generator, fallback=q_s)
        reach = reach * (1 - a)
        p_s = normalise((p_s - q_s).clamp_min(0), p_s)
        removed = q_s.scatter(1, token[:, None], 0.0)
        q_s = normalise(removed, q_s)
    paths = torch.stack(curve, -1)
    return paths.mean(0), paths.std(0) / num_paths**0.5


def _check_num_drafts(num_drafts: int) -> None:
    if num_drafts < 1:
        raise ValueError(f"num_drafts (K) must be at least 1, got {num_drafts}")
