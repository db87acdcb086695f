"""One decode step's data path: pack every sample's root and draft tree, verify them all at once,
commit what was accepted.

No padding anywhere but the attention masks: the forward sees exactly each sample's root plus its
draft nodes, and each sample's cache advances by its own accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from multispec.drafters import DraftTree
from multispec.engine.attention import StepLayout
from multispec.engine.cache import KVCache
from multispec.engine.rules import ruled, ruled_now, step_rows
from multispec.engine.request import Request, Sample
from multispec.engine.sampler import target_probs_and_lse
from multispec.verify import PositionKeys, verify_tree
from multispec.verify.sampling import TOKEN, derive, keyed_uniforms, sample_rows
from multispec.verify.tree import layout_of_trees, row_keys, walk_drawn
from multispec.verify.support import SupportQ, concat_rows


@dataclass
class Step:
    """The packed inputs of one decode step, with what verification and commit need back."""

    samples: list[Sample]
    trees: list[DraftTree]
    token_ids: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    row_offsets: list[int]
    logsumexp: torch.Tensor | None = None
    """[rows] logsumexp of each row's raw logits, where verification's compiled softmax computed
    it (commit reads log-probabilities as logit - logsumexp); None: commit takes a log-softmax."""
    dead_rows: list[int] = field(default_factory=list)
    """Rows the requests' rules left no token (``multispec.engine.rules.Rows.dead``)."""


@dataclass
class Verified:
    """One sample's outcome: the accepted path (local node indices), the bonus token, the target's
    probability of each token it appends (path, then bonus) and, where the drafter asked, the
    target's most likely tokens at each of those positions."""

    path: list[int]
    bonus: int
    token_probs: list[float]
    alternatives: list | None


def pack(samples: list[Sample], trees: list[DraftTree], device: torch.device) -> Step:
    """Concatenate every sample's root and draft nodes, with the tree masks attention needs."""
    counts = [1 + len(t.tokens) for t in trees]
    qmax = max(counts)
    tree_mask = torch.zeros(len(samples), qmax, qmax, dtype=torch.bool)
    tokens, positions, offsets = [], [], []
    offset = 0
    for b, (sample, tree) in enumerate(zip(samples, trees)):
        base = sample.request.prompt_len + sample.cached
        depth = [0]
        tree_mask[b, 0, 0] = True
        for j, parent in enumerate(tree.parents):
            depth.append(depth[parent + 1] + 1)
            tree_mask[b, j + 1] = tree_mask[b, parent + 1]
            tree_mask[b, j + 1, j + 1] = True
        tokens.append(sample.root)
        tokens.extend(tree.tokens)
        positions.extend(base + d for d in depth)
        offsets.append(offset)
        offset += counts[b]
    layout = StepLayout(
        counts=torch.tensor(counts),
        written=torch.tensor([s.cached for s in samples]),
        prompt_slot=torch.tensor([s.request.prompt_slot for s in samples]),
        prompt_len=torch.tensor([s.request.prompt_len for s in samples]),
        tree_mask=tree_mask,
    )
    return Step(samples, trees, torch.tensor(tokens, device=device), torch.tensor(positions, device=device), layout,
                offsets)


def position_keys(samples: list[Sample]) -> PositionKeys:
    """Each sample's key and the output position its next token takes."""
    return PositionKeys(np.array([s.key for s in samples], dtype=np.uint64),
                        np.array([len(s.output_ids) for s in samples], dtype=np.int64))


def sampling_rows(requests: list[Request], device: torch.device,
                  repeats: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k, top-p and min-p of the given rows' requests; ``repeats``: each
    request's row taken that many times in a row (a sample's root and draft rows)."""
    if repeats is not None and any(count != 1 for count in repeats):
        requests = [r for r, count in zip(requests, repeats) for _ in range(count)]
    return (torch.tensor([r.params.temperature for r in requests], dtype=torch.float32, device=device),
            torch.tensor([r.params.top_k for r in requests], dtype=torch.long, device=device),
            torch.tensor([r.params.top_p for r in requests], dtype=torch.float32, device=device),
            torch.tensor([r.params.min_p for r in requests], dtype=torch.float32, device=device))


def truncates(params) -> bool:
    """Whether a request's law drops tokens besides its temperature (top-k, top-p or min-p): a step
    with such rows skips the fused draws (``softmax_draw``) for the truncating softmax."""
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def verify(step: Step, logits: torch.Tensor, alternatives: tuple[int, float]) -> list[Verified]:
    """Verify every sample of the step: one batched call per verification scheme in the step (one
    when the requests share their speculation settings).

    Each sample's random numbers are keyed by its own seed, index and output positions, so sharing
    a call with other requests changes nothing for any of them. Greedy requests' rows are one-hot,
    which every scheme follows exactly, so they join whichever call there is."""
    samples, trees = step.samples, step.trees
    device = logits.device
    counts = [1 + len(t.tokens) for t in trees]
    requests = [s.request for s in samples]
    # What the softmax must do besides temperature, known from the requests: no per-row checks
    # on the parameter tensors.
    truncated = any(truncates(r.params) for r in requests)
    # The rules on the logits (allowed tokens, min_tokens, logit bias, penalties), where some row
    # has one: the law is drawn from the ruled logits, the log-probabilities reported are the raw
    # logits' (their log-normalisers from one more pass of the compiled softmax, where it runs).
    rows = step_rows(samples, trees) if any(ruled_now(s.request, len(s.output_ids)) for s in samples) else None
    scored = logits if rows is None else ruled(logits, rows)
    step.dead_rows = [] if rows is None else rows.dead
    drawn = None
    if alternatives[0] <= 0 and not truncated and not any(tree.tokens for tree in trees):
        drawn = _draw_plain(step, scored, requests)
    if drawn is None and not truncated and all(r.scheme == "deterministic" for r in requests):
        drawn = _draw_copied(step, scored, requests, counts, alternatives)
    if drawn is not None:
        if scored is not logits:
            step.logsumexp = raw_logsumexp(logits)
        return drawn
    probs, step.logsumexp, greedy_tokens = target_probs_and_lse(scored, *sampling_rows(requests, device, counts),
                                                                truncated=truncated)
    if scored is not logits:
        step.logsumexp = raw_logsumexp(logits)
    groups: dict[str, list[int]] = {}
    for b, sample in enumerate(samples):
        groups.setdefault(sample.request.scheme, []).append(b)
    if len(groups) > 1 and "greedy" in groups:
        greedy = groups.pop("greedy")
        groups[next(iter(groups))] += greedy
    paths: list[list[int]] = [[]] * len(samples)
    bonus: list[int] = [0] * len(samples)
    if not any(tree.tokens for tree in trees):
        # No drafts in the step: every scheme's walk stops at the root with the token it draws
        # there, argmax for greedy, else p sampled with the sample's key at its position (what
        # ``verify_tree`` does at depth 0), so the tree machinery is skipped.
        if list(groups) == ["greedy"]:
            bonus = (greedy_tokens if greedy_tokens is not None else probs.argmax(-1)).tolist()
        else:
            keys = position_keys(samples)
            bonus = sample_rows(probs, keys.at(torch.arange(len(samples)), 0), fallback=probs).tolist()
        groups = {}
    for scheme, members in groups.items():
        members.sort()
        if len(members) == len(samples):
            member_probs = probs
        else:
            member_probs = probs[torch.tensor([step.row_offsets[b] + i for b in members for i in range(counts[b])],
                                              device=device)]
        chosen = [trees[b] for b in members]
        node_tokens = torch.tensor([t for tree in chosen for t in tree.tokens], dtype=torch.long, device=device)
        node_parents = torch.tensor([p for tree in chosen for p in tree.parents], dtype=torch.long, device=device)
        node_offsets = torch.tensor(np.cumsum([0] + [len(tree.tokens) for tree in chosen]), dtype=torch.long,
                                    device=device)
        q, q_index = packed_q(chosen, device)
        # The engine builds these tensors itself, so the input checks are skipped here.
        # Every row greedy (one scheme for the step): the softmax gave each row's token already.
        argmax = greedy_tokens if scheme == "greedy" and len(members) == len(samples) else None
        out = verify_tree(member_probs, node_tokens, node_parents, node_offsets, q=q, scheme=scheme,
                          rng=position_keys([samples[b] for b in members]), validate=False, q_index=q_index,
                          layout=layout_of_trees([tree.parents for tree in chosen], device), p_argmax=argmax)
        for k, b in enumerate(members):
            paths[b] = out.accepted_nodes[k]
        for b, token in zip(members, out.bonus_token.tolist()):
            bonus[b] = token
    # The target's probability of every token each sample appends (accepted nodes, then the
    # bonus at the last of them), for the drafter: one gather for the step.
    flat_rows, flat_tokens = [], []
    for b, tree in enumerate(trees):
        tokens, local = appended(tree, paths[b], bonus[b])
        flat_rows += [step.row_offsets[b] + r for r in local]
        flat_tokens += tokens
    token_probs = probs[torch.tensor(flat_rows, device=device), torch.tensor(flat_tokens, device=device)].tolist()
    top = most_likely(probs, flat_rows, token_probs, *alternatives)
    results, start = [], 0
    for b in range(len(samples)):
        end = start + 1 + len(paths[b])
        results.append(Verified(paths[b], bonus[b], token_probs[start:end], None if top is None else top[start:end]))
        start = end
    return results


def stuck(step: Step, results: list[Verified]) -> list[tuple[int, int]]:
    """The samples whose verification reached a row their rules left no token (its root, or the
    row of a node it accepted), each with the output position that row was to give a token: plain
    decoding could not go on there either, so their requests fail (``LLMEngine``) instead of taking
    a token from nothing."""
    if not step.dead_rows:
        return []
    dead = set(step.dead_rows)
    out = []
    for b, result in enumerate(results):
        reached = [0, *(1 + j for j in result.path)]  # rows in path order: depth 0, 1, ...
        depth = next((d for d, row in enumerate(reached) if step.row_offsets[b] + row in dead), None)
        if depth is not None:
            out.append((b, len(step.samples[b].output_ids) + depth))
    return out


def raw_logsumexp(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's logsumexp of the raw logits, from the compiled softmax's one pass over them
    (``softmax_draw``, nothing of [rows, vocabulary] written), for commit's log-probabilities
    where the law was drawn from ruled logits; None where the kernel does not run (commit then
    takes a log-softmax of the rows it appends)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from multispec import kernels

    op = kernels.softmax_draw()
    if op is None:
        return None
    rows = logits.shape[0]
    ones = torch.ones(rows, dtype=torch.float32, device=logits.device)
    return op(logits.contiguous(), ones, torch.zeros(rows, dtype=torch.float64, device=logits.device))[1]


def _draw_plain(step: Step, logits: torch.Tensor, requests: list[Request]) -> list[Verified] | None:
    """A step without drafts whose probabilities nobody reads but each drawn token's (no drafter
    asks for alternatives, no truncation; ``logits`` ruled where a rule applies): each sample's
    token drawn in the compiled softmax's own pass (``softmax_draw``), with its key at its
    position, exactly as the general path draws it (``softmax_rows`` then ``sample_rows``: the
    same code, bit for bit) without the [rows, vocabulary] probabilities written and read back.
    None where the kernel does not run here."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from multispec import kernels

    op = kernels.softmax_draw()
    if op is None:
        return None
    temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32, device=logits.device)
    keys = position_keys(step.samples).at(torch.arange(len(requests)), 0)
    u = keys.draw(TOKEN, 0, logits.new_empty(0, dtype=torch.float64))
    index, step.logsumexp, _, prob, *_ = op(logits.contiguous(), temperature, u)
    # A row whose probabilities sum to zero draws index 0, as sample_rows with the row as its own
    # fallback does.
    return [Verified([], token, [p], None) for token, p in zip(index.tolist(), prob.tolist())]


def _draw_copied(step: Step, logits: torch.Tensor, requests: list[Request], counts: list[int],
                 alternatives: tuple[int, float]) -> list[Verified] | None:
    """A step whose samples all verify copied drafts (the deterministic scheme, no top-k or
    top-p): the walk draws from p at every row it reaches and reads nothing else of p but the
    drawn token's probability and, for the drafter, the likeliest tokens at the rows it appends
    at. Each row's draw is keyed by its sample and depth alone, so every row is drawn inside the
    compiled softmax's own pass (``softmax_draw``, with each row's ranking on the same buffer),
    then the walk follows the drawn tokens in lists (``walk_drawn``): the same tokens, log-
    normalisers, probabilities and alternatives as the general path (``softmax_rows``, the walk's
    ``sample_rows`` calls and ``most_likely``), bit for bit, without the [rows, vocabulary]
    probabilities written and read back or a call a depth. None where the kernel does not run here."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from multispec import kernels

    op = kernels.softmax_draw()
    if op is None:
        return None
    samples, trees = step.samples, step.trees
    layout = layout_of_trees([tree.parents for tree in trees])
    children = layout.children.tolist()
    keys = row_keys(logits.shape[0], layout, position_keys(samples), children)
    u = keyed_uniforms(derive(keys, TOKEN, 0)).to(logits.device)
    k = min(alternatives[0], logits.shape[-1]) if alternatives[0] > 0 else 0
    index, step.logsumexp, _, prob, _, top_values, top_tokens = op(
        logits.contiguous(), sampling_rows(requests, logits.device, counts)[0], u, k)
    drawn, prob = index.tolist(), prob.tolist()
    tokens = [t for tree in trees for t in tree.tokens]
    paths, bonus, visited = walk_drawn(tokens, layout, children, drawn)
    first = layout.first_node.tolist()
    if k:
        top_values, top_tokens = top_values.tolist(), top_tokens.tolist()
    results = []
    for b, rows in enumerate(visited):
        token_probs = [prob[row] for row in rows]
        top = None
        if k:
            top = [(top_tokens[row], top_values[row]) if 1.0 - p >= alternatives[1] else None
                   for row, p in zip(rows, token_probs)]
        results.append(Verified([c - first[b] for c in paths[b]], bonus[b], token_probs, top))
    return results


def packed_q(trees: list[DraftTree], device) -> tuple[torch.Tensor | SupportQ | None, torch.Tensor | None]:
    """The q rows of a verification call's trees (a ``SupportQ`` where the drafter kept them over
    its own vocabulary) and, where some nodes carry none (copied nodes beside drawn ones, or a tree
    of copied drafts among drawn ones), each node's row (-1: none). (q, None) when every node
    carries one; (None, all -1) when none does (a step in which a hybrid's head drew nothing: the
    schemes that read q then verify every node as copied)."""
    drafted = [tree for tree in trees if tree.tokens]
    rows = [tree.q for tree in drafted if tree.q is not None]
    if not rows:
        return None, torch.full((sum(len(tree.tokens) for tree in drafted),), -1, dtype=torch.long, device=device)
    q = concat_rows(rows).to(device)
    if len(rows) == len(drafted) and all(tree.drawn is None for tree in drafted):
        return q, None
    index, base = [], 0
    for tree in drafted:
        index += [r + base if r >= 0 else -1 for r in tree.q_rows()]
        base += 0 if tree.q is None else tree.q.shape[0]
    return q, torch.tensor(index, dtype=torch.long, device=device)


def commit(step: Step, logits: torch.Tensor, results: list[Verified], cache: KVCache) -> list[int]:
    """Append each sample's accepted tokens and bonus (up to its stop), move accepted tree nodes
    into place in its cache slot; returns the number of tokens each sample kept."""
    device = logits.device
    # Log-probabilities of every appended token in one gather over the packed rows.
    taken = [appended(tree, r.path, r.bonus) for tree, r in zip(step.trees, results)]
    flat_rows = torch.tensor([step.row_offsets[b] + r for b, (_, rows) in enumerate(taken) for r in rows],
                             device=device)
    flat_tokens = torch.tensor([t for tokens, _ in taken for t in tokens], device=device)
    if step.logsumexp is not None:  # the compiled softmax's log-normalisers: a gather, no pass over rows
        lse = step.logsumexp[flat_rows]
        token_logprobs = (logits[flat_rows, flat_tokens].float() - lse).tolist()

        def logprob_rows(start: int, end: int) -> torch.Tensor:
            return logits.index_select(0, flat_rows[start:end]).float() - lse[start:end, None]
    else:
        # Log-softmax of the appended rows only (every row, in order, where as many are appended as
        # the step has): one fused pass, where torch.logsumexp over all rows took 3x as long over a
        # 49k vocabulary (6.4 against 2.6 ms at 128 rows).
        appended_rows = logits if len(flat_rows) == logits.shape[0] else logits.index_select(0, flat_rows)
        logprobs = torch.log_softmax(appended_rows.float(), -1)
        token_logprobs = logprobs.gather(1, flat_tokens[:, None]).squeeze(1).tolist()

        def logprob_rows(start: int, end: int) -> torch.Tensor:
            return logprobs[start:end]
    move_slots, move_src, move_dst = [], [], []
    kept = []
    offset = 0
    for b, sample in enumerate(step.samples):
        path = results[b].path
        tokens, _ = taken[b]
        for k, j in enumerate(path):
            if j != k:
                move_slots.append(b)
                move_src.append(sample.cached + 1 + j)
                move_dst.append(sample.cached + 1 + k)
        sample.cached += 1 + len(path)
        rows = None
        if sample.request.params.logprobs:
            rows = logprob_rows(offset, offset + len(tokens))
        kept.append(sample.append(tokens, token_logprobs[offset: offset + len(tokens)], rows))
        offset += len(tokens)
    if move_slots:  # none where no sample accepted a node out of place (plain steps, chains)
        cache.keep_paths(*(torch.tensor(index, dtype=torch.long, device=device)
                           for index in (move_slots, move_src, move_dst)))
    return kept


def appended(tree: DraftTree, path: list[int], bonus: int) -> tuple[list[int], list[int]]:
    """The tokens a sample appends (its accepted nodes, then the bonus) and, for each, the row of
    the sample's forward rows (0 = its last token, 1 + j = node j) whose distribution it follows."""
    return [tree.tokens[j] for j in path] + [bonus], [0] + [1 + j for j in path]


def most_likely(probs: torch.Tensor, rows: list[int], token_probs: list[float], k: int,
                floor: float) -> list[tuple[list[int], list[float]] | None] | None:
    """For each of ``rows`` (whose sampled token has probability ``token_probs[i]``), the ``k``
    most likely tokens and their probabilities; None for all if k is 0, and None for a row where
    the sampled token leaves less than ``floor`` to every other token (nothing the drafter keeps).

    A full-vocabulary top-k costs a few percent of a step, so it runs only on the rows that can
    have an alternative, once per distinct row (a prefill's n samples share one). On a CPU the
    compiled ``top_rows`` ranks them (ties to the lower index) in one pass over each row, a tenth
    of torch's top-k (about 40 us a row of 49k here: 0.5 ms of a 4-sample drafted step, 2.8 ms of
    a 64-sample one); elsewhere torch's, on ``probs`` in place when that is all of them."""
    if k <= 0:
        return None
    out: list[tuple[list[int], list[float]] | None] = [None] * len(rows)
    wanted = [i for i, p in enumerate(token_probs) if 1.0 - p >= floor]
    if not wanted:
        return out
    distinct = sorted({rows[i] for i in wanted})
    k = min(k, probs.shape[-1])
    op = _top_rows(probs)
    if op is not None:
        values, tokens = op(probs, torch.tensor(distinct, dtype=torch.long), k)
    elif distinct == list(range(probs.shape[0])):
        values, tokens = probs.topk(k, dim=-1)
    else:
        chosen = torch.tensor(distinct, device=probs.device)
        values, tokens = probs.index_select(0, chosen).topk(k, dim=-1)
    where = {row: j for j, row in enumerate(distinct)}
    tokens, values = tokens.tolist(), values.tolist()
    for i in wanted:
        j = where[rows[i]]
        out[i] = (tokens[j], values[j])
    return out


def _top_rows(probs: torch.Tensor):
    """The compiled top-k of some rows where it runs (float32 contiguous probabilities on a CPU), else None."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or not probs.is_contiguous():
        return None
    from multispec import kernels

    return kernels.top_rows()
