"""Weighted trie of candidate continuations, and the two ways a draft tree is cut from it.

A node's weight is the summed weight of the votes whose continuation passes through it, each
vote's weight multiplied by the target's probability of every token on the way (where known):
an estimate of how likely the sample is to produce that path. Where a source also kept the
target's most likely tokens at a position (its *alternatives*), its vote is soft there: besides the
token the source took, each alternative becomes a child weighted by its probability, so a token
that the sources' target distributions favour can be drafted even where no source happened to
sample it, and a source that sampled an unlikely token does not pull the draft after it.
Weights never increase from a node to its children (votes only drop out, probabilities sum to at
most 1), which makes "the m heaviest nodes" a valid tree and, for deterministic drafts, the tree
with the most accepted tokens expected under that estimate.

An unknown probability (prompt text) counts as 1 in the weights. A node's ``confidence`` is the
drafter's estimate of the target's probability of its token given its parent's path: the mixture,
over the sources whose continuation reaches the parent (each with its vote), of each source's
probability of that token in its own context: the alternatives' probabilities where kept, the
probability of the token it took, 0 for a token it gives no probability, and ``UNKNOWN_CONFIDENCE``
for a token it took whose probability nobody computed. A confident source that its siblings
contradict is usually wrong, and sources that agree are usually right however many of them there
are. How well it predicts acceptance is measured by ``experiments/calibration.py``. The
longest match behind each node is kept as its ``evidence``.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import Iterator

import torch

from multispec.drafters.base import DraftTree
from multispec.drafters.index import UNKNOWN, Alternatives
from multispec.drafters.lookup import Continuation

ROOT = 0
UNKNOWN_CONFIDENCE = 0.5
"""Probability assumed for a draft token whose target probability no source knows (prompt text)."""


class Trie:
    """Flat-list trie; node 0 is the root (the sample's last token)."""

    def __init__(self, continuations: list[Continuation]):
        self.token = [-1]
        self.children: list[dict[int, int]] = [{}]
        # Per node [weight, mass, reach, evidence]: one list per node keeps building the trie cheap.
        # mass: summed vote times the source's probability of the node's token (the confidence
        # numerator); reach: summed votes of the sources whose continuation passes through the node.
        self.stats: list[list[float]] = [[0.0, 0.0, 0.0, 0]]
        self._distributions: dict[int, tuple[list[int], list[float], list[float]]] = {}
        for tokens, probs, vote, match, alternatives in continuations:
            self._insert(tokens, probs, vote, match, alternatives)

    def _new_child(self, kids: dict[int, int], token: int) -> int:
        """A new node for ``token`` under the node whose children are ``kids`` (lookups stay inline
        in ``_insert``, the hot loop; only creation goes through here)."""
        child = kids[token] = len(self.token)
        self.token.append(token)
        self.children.append({})
        self.stats.append([0.0, 0.0, 0.0, 0])
        return child

    def _insert(self, tokens: list[int], probs: list[float], vote: float, match: int,
                alternatives: list[Alternatives | None]) -> None:
        stats = self.stats
        node = ROOT
        stats[ROOT][2] += vote
        weight = vote
        known = True
        soft = len(alternatives)
        for depth, (token, prob) in enumerate(zip(tokens, probs)):
            kids = self.children[node]
            alternative = alternatives[depth] if depth < soft else None
            if alternative is not None:
                for other, p in zip(*alternative):
                    if other == token or p <= 0.0:
                        continue
                    child = kids.get(other)
                    if child is None:
                        child = self._new_child(kids, other)
                    entry = stats[child]
                    entry[0] += weight * p
                    entry[1] += vote * p
                    if match > entry[3]:
                        entry[3] = match
            if prob == UNKNOWN:
                known = False
                prob = UNKNOWN_CONFIDENCE
            elif known:
                weight *= prob
            child = kids.get(token)
            if child is None:
                child = self._new_child(kids, token)
            entry = stats[child]
            entry[0] += weight
            entry[1] += vote * prob
            entry[2] += vote
            if match > entry[3]:
                entry[3] = match
            node = child

    def confidence(self, node: int, parent: int) -> float:
        """Estimated target probability of ``node``'s token after ``parent``'s path: the vote-weighted
        mean, over the sources that reach the parent, of each one's probability of the token."""
        reach = self.stats[parent][2]
        return min(1.0, self.stats[node][1] / reach) if reach > 0 else 0.0

    def heaviest(self, budget: int) -> DraftTree:
        """The ``budget`` heaviest nodes, by best-first expansion (parents always come first)."""
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        evidence: list[int] = []
        frontier = [(-self.stats[c][0], c, -1, ROOT) for c in self.children[ROOT].values()]
        heapq.heapify(frontier)
        while frontier and len(tokens) < budget:
            _, node, parent, parent_node = heapq.heappop(frontier)
            local = len(tokens)
            tokens.append(self.token[node])
            parents.append(parent)
            confidence.append(self.confidence(node, parent_node))
            evidence.append(int(self.stats[node][3]))
            for child in self.children[node].values():
                heapq.heappush(frontier, (-self.stats[child][0], child, local, node))
        return DraftTree(tokens, parents, None, confidence, evidence)

    def distribution(self, node: int) -> tuple[list[int], list[float], list[float]]:
        """The children of ``node`` that can be drawn, their probabilities (normalised weights)
        rounded to float32, which is what q holds, and the running sum of those same values, which
        is what sampling inverts, so draws follow q exactly. Children whose probability is 0 in
        float32 are left out (q > 0 for every token that can be drawn); a node whose children all
        weigh 0 counts as a leaf."""
        cached = self._distributions.get(node)
        if cached is None:
            kids = self.children[node]
            total = sum(self.stats[c][0] for c in kids.values())
            rounded = array("f", (self.stats[c][0] / total for c in kids.values())) if total > 0 else []
            kept = [(token, prob) for token, prob in zip(kids, rounded) if prob > 0.0]
            probs = [prob for _, prob in kept]
            cached = ([token for token, _ in kept], probs, list(accumulate(probs)))
            self._distributions[node] = cached
        return cached

    def draw(self, node: int, uniform: float) -> int:
        """Child of ``node`` drawn by inverting its cumulative distribution at ``uniform`` in [0, 1)."""
        tokens, _, cumulative = self.distribution(node)
        pick = min(bisect_right(cumulative, uniform * cumulative[-1]), len(tokens) - 1)
        return self.children[node][tokens[pick]]

    def sampled(self, budget: int, num_drafts: int, uniforms: Iterator[float], vocab_size: int) -> DraftTree:
        """A fork of sampled chains: ``num_drafts`` root children drawn i.i.d. (with replacement)
        from the root's distribution, each extended by one child drawn from its own node's
        distribution per level, the budget split evenly between the chains. Row i of q is the
        distribution node i was drawn from; the root's children share one row. The number of
        drafts is capped by the size of the root's support, a fact fixed before any draw, so a
        point-mass root does not spend the budget on copies of one chain.
        """
        support = len(self.distribution(ROOT)[0])
        if support == 0:
            return DraftTree.EMPTY
        width = min(num_drafts, budget, support)
        tokens: list[int] = []
        parents: list[int] = []
        row_of: list[int] = []
        for _ in range(width):
            node, parent = ROOT, -1
            for _ in range(budget // width):
                if not self.distribution(node)[0]:
                    break
                row_of.append(node)
                node = self.draw(node, next(uniforms))
                tokens.append(self.token[node])
                parents.append(parent)
                parent = len(tokens) - 1
        return DraftTree(tokens, parents, self._dense_q(row_of, vocab_size))

    def _dense_q(self, row_of: list[int], vocab_size: int) -> torch.Tensor:
        """[m, V] float32 q with row i the distribution of node row_of[i]'s children."""
        rows, cols, values = [], [], []
        for i, node in enumerate(row_of):
            tokens, probs, _ = self.distribution(node)
            rows.extend([i] * len(tokens))
            cols.extend(tokens)
            values.extend(probs)
        q = torch.zeros(len(row_of), vocab_size, dtype=torch.float32)
        q[rows, cols] = torch.tensor(values, dtype=torch.float32)
        return q
