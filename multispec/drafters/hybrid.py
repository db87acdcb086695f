"""Hybrid drafting: sibling consensus and the draft head in one tree per sample.

Consensus drafts well where the samples agree and the head where they diverge, so each step
merges the consensus tree (copied sibling text, weighted by votes) with the head's top
candidates and their argmax chains (see ``ModelDrafter(copied=True)``): shared prefixes become
one branch, every node keeps the higher confidence of its sources. The drafts carry no q, so the
deterministic scheme verifies them (draw from the target, walk the matching child), which is
exact for any tree; that is also what lets the adaptive draft budget rank every node of the
batch together by its calibrated chance of acceptance and keep the best, as it does for
consensus. Head nodes carry evidence 0 (no context match), so the budget calibrates their
confidence apart from the sibling matches'.
"""

from __future__ import annotations

from typing import Sequence

from multispec.drafters.base import DraftTree
from multispec.drafters.consensus import ConsensusDrafter
from multispec.drafters.model import ModelDrafter
from multispec.verify.schemes import COPIED, DraftLaw


class HybridDrafter:
    sampled = False
    wants_features = True

    def __init__(self, consensus: ConsensusDrafter, model: ModelDrafter, max_nodes: int):
        self.consensus = consensus
        self.model = model
        self.max_nodes = max_nodes
        self.alternatives = consensus.alternatives
        self.min_alternative = consensus.min_alternative
        self.use_model = True
        """Whether ``propose`` runs the head: the adaptive budget turns it off while the head's own
        nodes do not repay its forwards (``DraftBudget.wants_model``), and the sibling drafts then
        go on alone."""

    @classmethod
    def create(cls, *, max_depth: int, max_nodes: int, num_candidates: int = 1, **options) -> HybridDrafter:
        consensus = ConsensusDrafter.create(max_depth=max_depth, max_nodes=max_nodes,
                                            **{k: v for k, v in options.items() if k != "sampled"})
        model = ModelDrafter.create(max_depth=max_depth, max_nodes=max_nodes, num_candidates=num_candidates,
                                    **{k: v for k, v in options.items() if k != "scheme"})
        model.copied = True
        return cls(consensus, model, max_nodes)

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, **_) -> DraftLaw:
        if sampled:
            raise ValueError("sampled_drafts=True does not apply to drafter='hybrid': its drafts are copied "
                             "(sibling text and the head's top candidates) and verified deterministically")
        return DraftLaw(COPIED, max(1, max_nodes))

    @property
    def model_time(self) -> float:
        return self.model.model_time

    @property
    def model_forwards(self) -> int:
        return self.model.model_forwards

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        self.consensus.add_group(group_id, prompt_ids, sample_ids)
        self.model.add_group(group_id, prompt_ids, sample_ids)

    def observe(self, sample_id: int, new_tokens: list[int], token_probs=None, alternatives=None) -> None:
        self.consensus.observe(sample_id, new_tokens, token_probs, alternatives)
        self.model.observe(sample_id, new_tokens)

    def observe_features(self, sample_ids, features) -> None:
        self.model.observe_features(sample_ids, features)

    def remove(self, sample_id: int) -> None:
        self.consensus.remove(sample_id)
        self.model.remove(sample_id)

    def limit(self, chances: Sequence[float], floor: float) -> None:
        """The draft budget's measured acceptance per confidence bin of nodes without a sibling
        match (the head's), and the calibrated chance below which a head node is not extended:
        its children could not be kept. 0: full depth. A causal LM draft (``CheckpointDrafter``)
        keeps drafting its chains whole."""
        self.model.limit(chances, floor)

    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        budgets = [max(0, min(b, self.max_nodes)) for b in budgets]
        sibling = self.consensus.propose(sample_ids, budgets)
        if not self.use_model:
            return sibling
        head = self.model.propose(sample_ids, budgets)
        return [merge(a, b, budget) for a, b, budget in zip(sibling, head, budgets)]


def merge(a: DraftTree, b: DraftTree, budget: int) -> DraftTree:
    """One tree holding both (a node per distinct path, with the higher confidence and evidence of
    its sources), cut to the ``budget`` nodes of highest path confidence (closed under parents)."""
    if not b.tokens:
        return a
    if not a.tokens:
        return b.subtree(_best(b, budget))
    tokens, parents, confidence, evidence = [], [], [], []
    where: dict[tuple[int, int], int] = {}
    for tree in (a, b):
        local: list[int] = []
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            key = (-1 if parent < 0 else local[parent], token)
            node = where.get(key)
            conf = tree.confidence[i] if tree.confidence is not None else 0.0
            evid = tree.evidence[i] if tree.evidence is not None else 0
            if node is None:
                node = where[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
                confidence.append(conf)
                evidence.append(evid)
            else:
                confidence[node] = max(confidence[node], conf)
                evidence[node] = max(evidence[node], evid)
            local.append(node)
    merged = DraftTree(tokens, parents, None, confidence, evidence)
    return merged.subtree(_best(merged, budget))


def _best(tree: DraftTree, budget: int) -> list[int]:
    """The ``budget`` nodes with the highest product of confidences from the root, ascending; a
    child never beats its parent (confidences are at most 1, ties go to the shallower node), so
    the set is closed under parents."""
    if len(tree.tokens) <= budget:
        return list(range(len(tree.tokens)))
    chance: list[float] = []
    for i, parent in enumerate(tree.parents):
        conf = min(1.0, tree.confidence[i]) if tree.confidence is not None else 0.0
        chance.append(conf if parent < 0 else conf * chance[parent])
    depths = tree.depths()
    order = sorted(range(len(chance)), key=lambda i: (-chance[i], depths[i], i))
    return sorted(order[:budget])
