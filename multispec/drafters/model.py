"""Draft-model drafting: a feature-level draft head proposes several candidates per sample.

Each step, for every sample: the head reads the target's hidden state at the last verified
position and the token the target sampled there (the root of the tree, always the target's own
token), and gives the next token's distribution q. ``num_candidates`` children are drawn from q
without replacement (or i.i.d. for the schemes that need that), each then extended as a chain, one
token a depth, the head fed its own predicted state. With a decision model, a chain stops where
the predicted chance that its next token is accepted falls below the threshold; the tree is at
most ``max_depth`` deep and ``max_nodes`` large. Every node carries the q it was drawn from, and
the tree is verified with the exact multi-draft schemes (recursive rejection without replacement
by default).

At temperature 0 the candidates are the top ones of q and the chains follow its argmax; greedy
verification checks them. ``copied=True`` drafts that way at any temperature, each node with its
q probability as the drafter's confidence and no q: drafts for the deterministic scheme, which is
exact for any tree (the hybrid drafter's use).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import torch

from multispec.drafters.base import DraftTree
from multispec.models.draft_head import DraftHead, PathAttention, decision_stats
from multispec.models.draft_lm import DraftLM
from multispec.verify.schemes import IID, WITHOUT_REPLACEMENT, DraftLaw
from multispec.verify.support import SupportQ

IID_SCHEMES = frozenset({"specinfer", "spectr", "canonical_lp", "canonical_wis"})
"""Schemes exact only for siblings drawn i.i.d. (SpecInfer also takes independent draws): with
one of them the drafter draws its candidates with replacement."""


def candidates_with_replacement(scheme: str) -> bool:
    return scheme in IID_SCHEMES


class ModelDrafter:
    """Drafts with a ``DraftHead`` over the target's features (see the module docstring)."""

    alternatives = 0
    min_alternative = 0.0
    sampled = True
    wants_features = True
    _edges: torch.Tensor | None = None
    """``CONFIDENCE_EDGES`` as a tensor, made by the first ``limit``."""
    _columns: torch.Tensor | None = None
    """Each target token's column of q (-1: not drafted), built by the first sampled tree."""
    chances: torch.Tensor | None = None
    floor = 0.0

    def __init__(self, *, head: DraftHead, max_depth: int, max_nodes: int, num_candidates: int = 1,
                 temperature: float = 1.0, replacement: bool = False, threshold: float = 0.0, copied: bool = False):
        self.head = head
        self._drafting(max_depth, max_nodes, num_candidates, temperature, replacement, threshold, copied)
        self.vocab_size = head.config.target_vocab_size
        self.vocab_ids = head.vocab_ids
        """The target's token id of each column of q (the head drafts from its own short list)."""
        self.device = head.vocab_ids.device
        self.context = head.config.context
        self.features: dict[int, deque] = {}
        """Per sample, the target's features at its newest positions (up to the head's context)."""
        self.tokens: dict[int, deque] = {}
        """Per sample, its newest tokens: the one written after each feature above."""
        self.model_time = 0.0
        """Seconds spent in the head's forwards and draws (``RunStats.time_draft_model``)."""
        self.chances = None
        """Under a hybrid's draft budget: its measured acceptance per confidence bin (see
        ``limit``); a chain stops where the product along its path falls below ``floor``."""
        self.floor = 0.0
        self.model_forwards = 0

    def _drafting(self, max_depth: int, max_nodes: int, num_candidates: int, temperature: float, replacement: bool,
                  threshold: float, copied: bool) -> None:
        """The settings every model drafter drafts by (this one's and ``CheckpointDrafter``'s)."""
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.width = num_candidates
        self.temperature = temperature
        self.replacement = replacement
        self.threshold = threshold
        self.copied = copied

    @classmethod
    def create(cls, *, draft=None, head: DraftHead | None = None, max_depth: int, max_nodes: int,
               num_candidates: int = 1, temperature: float = 1.0, scheme: str = "auto",
               decision_threshold: float | None = None, **_) -> ModelDrafter:
        """``draft``: a ``DraftHead`` (attached to the target), or a ``DraftLM`` (a causal LM
        checkpoint, drafted by ``CheckpointDrafter``); ``head`` is the same for a head."""
        draft = draft if draft is not None else head
        if draft is None:
            raise ValueError("drafter='model' needs a draft model: give SpecConfig(draft_model=...) a draft head file "
                             "or a causal LM checkpoint, or use a target that has a head paired in the registry")
        if isinstance(draft, DraftLM):
            from multispec.drafters.checkpoint import CheckpointDrafter

            return CheckpointDrafter(draft=draft, max_depth=max_depth, max_nodes=max_nodes,
                                     num_candidates=num_candidates, temperature=temperature,
                                     replacement=candidates_with_replacement(scheme),
                                     threshold=decision_threshold or 0.0)
        head = draft
        threshold = head.config.threshold if decision_threshold is None else decision_threshold
        return cls(head=head, max_depth=max_depth, max_nodes=max_nodes, num_candidates=num_candidates,
                   temperature=temperature, replacement=candidates_with_replacement(scheme), threshold=threshold)

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, num_candidates: int = 1, scheme: str = "auto",
                  **_) -> DraftLaw:
        """Up to ``num_candidates`` children of the root, drawn without replacement from q (i.i.d.
        where ``scheme`` needs that); every other node has one child."""
        law = IID if candidates_with_replacement(scheme) else WITHOUT_REPLACEMENT
        return DraftLaw(law, max(1, min(num_candidates, max_nodes)))

    # ------------------------------------------------------------------ state
    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        pass

    def observe(self, sample_id: int, new_tokens: list[int], token_probs=None, alternatives=None) -> None:
        if new_tokens:
            self.tokens.setdefault(sample_id, deque(maxlen=self.context)).extend(int(t) for t in new_tokens)

    def observe_features(self, sample_ids: list[int], features: Sequence[Sequence[torch.Tensor]]) -> None:
        """Per sample, the target's final hidden states at the positions its ``k`` newest tokens
        were drawn from, in order (the last: the row its newest token was drawn from): ``k`` rows
        of ``[H]``, as a ``[k, H]`` tensor or a sequence of ``[H]`` tensors."""
        for sample_id, rows in zip(sample_ids, features):
            self.features.setdefault(sample_id, deque(maxlen=self.context)).extend(rows[-self.context:])

    def remove(self, sample_id: int) -> None:
        self.features.pop(sample_id, None)
        self.tokens.pop(sample_id, None)

    def limit(self, chances: Sequence[float], floor: float) -> None:
        """A node whose calibrated chance, the product of ``chances`` (per bin of
        ``CONFIDENCE_EDGES``) over its path's confidences, is below ``floor`` is not extended
        (the hybrid's lanes set it from the budget's last cut). Exact for drawn drafts too: it
        decides whether a node gets children from the node and its ancestors only, so every child
        that is drawn is still drawn from its q; no drawn node is removed for what it is."""
        from multispec.engine.budget import CONFIDENCE_EDGES

        self.chances = torch.tensor(list(chances), dtype=torch.float32, device=self.device)
        self.floor = float(floor)
        if self._edges is None:
            self._edges = torch.tensor(CONFIDENCE_EDGES, dtype=torch.float32, device=self.device)

    def _chance(self, confidence: torch.Tensor) -> torch.Tensor:
        return self.chances[torch.bucketize(confidence.float(), self._edges, right=True)]

    # ------------------------------------------------------------------ drafting
    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        trees = [DraftTree.EMPTY] * len(sample_ids)
        live = [i for i, (s, b) in enumerate(zip(sample_ids, budgets)) if b > 0 and s in self.features
                and s in self.tokens]
        if not live:
            return trees
        start = time.perf_counter()
        with torch.inference_mode():
            built = self._draft([sample_ids[i] for i in live], [budgets[i] for i in live],
                                None if uniforms is None else [uniforms[i] for i in live])
        for i, tree in zip(live, built):
            trees[i] = tree
        self.model_time += time.perf_counter() - start
        return trees

    def _draft(self, sample_ids: list[int], budgets: list[int], uniforms) -> list[DraftTree]:
        device = self.device
        greedy = self.copied or self.temperature == 0 or uniforms is None
        count = len(sample_ids)
        width = [max(1, min(self.width, b, self.max_nodes)) for b in budgets]
        depth = [max(1, min(self.max_depth, min(b, self.max_nodes) // w)) for b, w in zip(budgets, width)]
        u = None if greedy else torch.tensor([list(x[: self.width * self.max_depth]) + [0.5] * max(
            0, self.width * self.max_depth - len(x)) for x in uniforms], dtype=torch.float32, device=device)

        probs = self._root_probs(sample_ids)
        self.model_forwards += 1

        # Depth 1: W candidates per sample from the root's q.
        wmax = max(width)
        picked = self._draw_children(probs, wmax, None if u is None else u[:, :wmax])
        node_prob = probs.gather(1, picked)
        if wmax == 1:
            node_sample, node_pick, node_prob = torch.arange(count, device=device), picked[:, 0], node_prob[:, 0]
            chain = torch.zeros(count, dtype=torch.long, device=device)
        else:
            valid = torch.arange(wmax, device=device)[None, :] < torch.tensor(width, device=device)[:, None]
            node_sample = torch.arange(count, device=device)[:, None].expand(count, wmax)[valid]
            node_pick, node_prob = picked[valid], node_prob[valid]
            chain = torch.nonzero(valid)[:, 1]  # which candidate chain each node belongs to
        # Per level (the nodes of one depth, flattened): each node's sample, token index (of K),
        # probability under its q, its q's row in ``sources`` (the root's q rows, then each
        # depth's child rows, one after another) and its parent's index in the level before.
        sources = [probs]
        levels = [(node_sample, node_pick, node_prob, node_sample, None)]
        depth_of = torch.tensor(depth, device=device)
        pruned = self.floor > 0 and self.chances is not None
        chance = self._chance(node_prob) if pruned else None
        # The row of the previous forward (of the root, then of each depth) each frontier node continues.
        parent_rows = node_sample
        offset = count
        d = 1
        while True:
            growing = depth_of[node_sample] > d
            if pruned:
                growing &= chance >= self.floor
            grow = torch.nonzero(growing)[:, 0]
            if grow.numel() == 0:
                break
            # The draft's state at each growing node gives its child's distribution.
            child_probs = self._child_probs(parent_rows[grow], node_sample[grow], node_pick[grow], d)
            self.model_forwards += 1
            if self.threshold > 0:
                score = self._decide(d, node_prob[grow], child_probs)
                keep = torch.nonzero(score >= self.threshold)[:, 0]
                if keep.numel() == 0:
                    break
                rows, kept = grow[keep], child_probs[keep]
            else:
                keep = torch.arange(grow.numel(), device=device)
                rows, kept = grow, child_probs
            column = self.width * d + chain[rows]
            draw = None if u is None else u[node_sample[rows], column][:, None]
            child = self._draw_children(kept, 1, draw)[:, 0]
            node_sample, chain, node_pick = node_sample[rows], chain[rows], child
            node_prob = kept.gather(1, child[:, None])[:, 0]
            levels.append((node_sample, child, node_prob, offset + keep, rows))
            sources.append(child_probs)
            offset += child_probs.shape[0]
            if pruned:
                chance = chance[rows] * self._chance(node_prob)
            parent_rows = keep
            d += 1
        return self._trees(count, levels, sources, greedy)

    def _decide(self, depth: int, node_prob: torch.Tensor, child_probs: torch.Tensor) -> torch.Tensor:
        """Predicted chance that each growing node's child is accepted given the node is: the
        head's decision model. It reads only the drafts' own q, so stopping on it never changes
        the law of what was drafted."""
        return self.head.decide(decision_stats(torch.full((node_prob.numel(),), depth, device=node_prob.device),
                                               node_prob, child_probs))

    def _root_probs(self, sample_ids: list[int]) -> torch.Tensor:
        """q of each sample's first draft token ``[count, K]``: the head's step over the sample's
        window (the target's features at its newest positions and the token written after each,
        the root last). Starts the paths the next depths extend."""
        head = self.head
        width = min(min(len(self.features[s]), len(self.tokens[s])) for s in sample_ids)
        longest = max(min(len(self.features[s]), len(self.tokens[s])) for s in sample_ids)
        if longest == 1:
            features = torch.stack([self.features[s][-1] for s in sample_ids])[:, None]
            tokens = [[self.tokens[s][-1]] for s in sample_ids]
            mask = None
        else:
            # Windows right-aligned at the root; shorter ones (a sample's first tokens) padded on the left.
            rows, tokens, valid = [], [], []
            for s in sample_ids:
                have = min(len(self.features[s]), len(self.tokens[s]))
                feats = list(self.features[s])[-have:]
                pad = longest - have
                rows.append(torch.stack([feats[0]] * pad + feats) if pad else torch.stack(feats))
                tokens.append([0] * pad + list(self.tokens[s])[-have:])
                valid.append([False] * pad + [True] * have)
            features = torch.stack(rows)
            mask = None if width == longest else torch.tensor(valid, device=self.device)
        features = features.to(self.device)
        tokens = torch.tensor(tokens, device=self.device)
        self._states, self._attention = head.start(features, tokens, mask)
        return self._probs(head.logits(self._states))

    def _child_probs(self, rows: torch.Tensor, samples: torch.Tensor, picks: torch.Tensor, depth: int) -> torch.Tensor:
        """q of the children of nodes at ``depth`` ``[N, K]``: node i continues row ``rows[i]`` of
        the previous call, belongs to sample ``samples[i]`` (of this call's samples) and is the
        token ``vocab_ids[picks[i]]``."""
        head = self.head
        self._attention = self._attention.children(rows)
        self._states = head.step(self._states[rows], head.vocab_ids[picks], depth, self._attention)
        return self._probs(head.logits(self._states))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return torch.softmax(logits, -1)
        return torch.softmax(logits.div_(self.temperature), -1)  # the head's fresh logits, scaled in place

    def _draw_children(self, probs: torch.Tensor, k: int, u: torch.Tensor | None) -> torch.Tensor:
        """``k`` draws per row of ``probs [N, K]`` (indexes into the head's vocabulary): one after
        another without replacement (or with it, for i.i.d. schemes) by inverting each remaining
        CDF at the row's uniform; the top k where there are no uniforms (temperature 0)."""
        if u is None:
            return probs.topk(k, dim=-1).indices
        remaining = probs
        out = []
        for j in range(k):
            cdf = remaining.cumsum(-1)
            target = (u[:, j] * cdf[:, -1]).unsqueeze(-1)
            index = torch.searchsorted(cdf, target).clamp_max(probs.shape[-1] - 1)
            # A uniform at the very top may land past the last token with mass: step back to it.
            found = remaining.gather(1, index) > 0
            if not bool(found.all()):
                index = torch.where(found, index, remaining.argmax(-1, keepdim=True))
            out.append(index)
            if j + 1 < k and not self.replacement:
                remaining = remaining.clone() if remaining is probs else remaining
                remaining.scatter_(1, index, 0.0)
        return out[0] if k == 1 else torch.cat(out, 1)

    def _trees(self, count: int, levels, sources: list[torch.Tensor], greedy: bool) -> list[DraftTree]:
        """Assemble per-sample trees (depth by depth, so parents come first). Each tree's q rows
        are gathered once, in node order, into one tensor over the head's vocabulary (a
        ``SupportQ``: no row of the target's full vocabulary is written here)."""
        vocab_ids = self.vocab_ids
        samples, tokens, parents = [], [], []
        level_local = []  # per level: each node's local index within its sample's tree
        counts = [0] * count
        for sample, pick, _, _, parent_of in levels:
            sample_list = sample.tolist()
            local = []
            for s in sample_list:
                local.append(counts[s])
                counts[s] += 1
            if parent_of is None:
                parents.extend([-1] * len(sample_list))
            else:
                previous = level_local[-1]
                parents.extend(previous[r] for r in parent_of.tolist())
            level_local.append(local)
            samples.extend(sample_list)
            tokens.extend(vocab_ids[pick].tolist())
        per_sample_nodes: list[list[int]] = [[] for _ in range(count)]
        for n, s in enumerate(samples):
            per_sample_nodes[s].append(n)
        # Each node's q probability, the drafter's confidence in it (the hybrid's budget ranks by it).
        confidence = torch.cat([prob for _, _, prob, _, _ in levels]).tolist()
        if not greedy:
            source = torch.cat([row for _, _, _, row, _ in levels])
            order = torch.tensor([n for nodes in per_sample_nodes for n in nodes], device=source.device)
            q_all = sources[0] if len(sources) == 1 else torch.cat(sources)
            q_split = q_all[source[order]].split([len(n) for n in per_sample_nodes])
            if self._columns is None:
                self._columns = SupportQ.columns(vocab_ids, self.vocab_size)
            columns = self._columns
        trees = []
        for s, nodes in enumerate(per_sample_nodes):
            q = None if greedy else SupportQ(q_split[s], vocab_ids, self.vocab_size, columns)
            trees.append(DraftTree([tokens[n] for n in nodes], [parents[n] for n in nodes], q,
                                   [confidence[n] for n in nodes], [0] * len(nodes)))
        return trees
