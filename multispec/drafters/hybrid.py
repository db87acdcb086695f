"""Hybrid drafting: sibling consensus and the draft head in one tree per sample.

Consensus drafts well where the samples agree and the head where they diverge, so each step
merges the consensus tree (copied sibling text, weighted by votes) with the head's candidates and
their chains: shared prefixes become one branch, every node keeps the higher confidence of its
sources. Two ways to verify the merged tree, both exact:

- drawn (the default): the head draws its candidates from its q without replacement, as
  ``drafter="model"`` does, and the sibling text is added as copied nodes after them (the
  ``MIXED`` law): at each node, recursive rejection over the drawn children, then the
  deterministic rule on what is left over the copied ones. Where the target is flat (temperature
  1.0), rejection sampling of drawn candidates accepts more than matching the head's top ones. The
  head's nodes are never cut for what was drawn: the budget ranks and cuts only the copied nodes
  around them, and the head's tree is sized before it draws, from the sibling text alone (a
  sibling node takes the place of a head level it is likelier than, ``_head_depth``).
- copied (``sampled_drafts=False``): the head's top candidates and argmax chains
  (``ModelDrafter(copied=True)``) carry no q, so the deterministic scheme verifies the tree (draw
  from the target, walk the matching child), which is exact for any tree; the adaptive draft
  budget then ranks every node of the batch together by its calibrated chance of acceptance and
  keeps the best, as it does for consensus (head nodes carry evidence 0, no context match, so the
  budget calibrates their confidence apart from the sibling matches'). A seeded run then repeats
  the seeded plain run token for token.

With one request of 4 samples in flight (4 GSM8K questions one at a time, 6 interleaved rounds on a
2-core AMD EPYC) the drawn hybrid gave 1.31x plain at T 0.7 and 1.16x at 1.0 (tau 1.83, 1.53), the
copied one 1.29x and 0.97x (tau 1.63, 1.09).
"""

from __future__ import annotations

from typing import Sequence

from multispec.drafters.base import DraftTree
from multispec.drafters.consensus import ConsensusDrafter
from multispec.drafters.model import ModelDrafter
from multispec.verify.schemes import COPIED, MIXED, DraftLaw


class HybridDrafter:
    wants_features = True
    draws_by_default = True
    """``SpecConfig(sampled_drafts=None)`` draws the head's candidates (see the module docstring)."""
    scored = True
    """Its trees carry confidences for every node: the adaptive budget ranks them (``select``)
    even when the head's nodes are drawn (they are then kept whole)."""

    def __init__(self, consensus: ConsensusDrafter, model: ModelDrafter, max_nodes: int, drawn: bool = False):
        self.consensus = consensus
        self.model = model
        self.max_nodes = max_nodes
        self.sampled = drawn
        """The head draws its candidates (from the uniforms the engine passes); see the module docstring."""
        self.alternatives = consensus.alternatives
        self.min_alternative = consensus.min_alternative
        self.use_model = True
        """Whether ``propose`` runs the head: the adaptive budget turns it off while the head's own
        nodes do not repay its forwards (``DraftBudget.wants_model``), and the sibling drafts then
        go on alone."""
        self.model_depth: int | None = None
        """How deep the head's chains may go this step (None: as deep as the sibling text leaves
        room for); the adaptive budget sets it from the head's own acceptance and price per depth."""

    @classmethod
    def create(cls, *, max_depth: int, max_nodes: int, num_candidates: int = 1, **options) -> HybridDrafter:
        consensus = ConsensusDrafter.create(max_depth=max_depth, max_nodes=max_nodes,
                                            **{k: v for k, v in options.items() if k != "sampled"})
        drawn = bool(options.get("sampled"))
        model = ModelDrafter.create(max_depth=max_depth, max_nodes=max_nodes, num_candidates=num_candidates,
                                    **{k: v for k, v in options.items() if k != "scheme" or drawn})
        model.copied = not drawn
        return cls(consensus, model, max_nodes, drawn)

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, **_) -> DraftLaw:
        """Copied drafts (any tree), or with ``sampled`` the head's candidates drawn without
        replacement and the sibling text copied after them."""
        return DraftLaw(MIXED if sampled else COPIED, max(1, max_nodes))

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
        width = max(1, self.model.width)
        deepest = self.model.max_depth if self.model_depth is None else min(self.model_depth, self.model.max_depth)
        if not self.sampled:
            head = self.model.propose(sample_ids, [min(b, width * deepest) for b in budgets])
            return [merge(a, b, budget) for a, b, budget in zip(sibling, head, budgets)]
        # Drawn head nodes stay whole, so the head's share is fixed before it draws.
        shares = [width * _head_depth(a, b, width, deepest) for a, b in zip(sibling, budgets)]
        head = self.model.propose(sample_ids, shares, uniforms)
        return [merge(a, b, budget) for a, b, budget in zip(sibling, head, budgets)]


def merge(a: DraftTree, b: DraftTree, budget: int) -> DraftTree:
    """One tree holding both (a node per distinct path, with the higher confidence and evidence of
    its sources), cut to the ``budget`` nodes of highest path confidence (closed under parents).

    Where ``b`` is drawn (carries q), its nodes come first and are all kept (``budget`` must leave
    room for them), each with its q row; ``a``'s nodes are copied, follow the drawn ones among
    their siblings, and fill what is left of the budget."""
    if not b.tokens:
        return a
    if not a.tokens and b.q is None:
        return b.subtree(_best(b, budget))
    drawn_b = b.q is not None
    tokens, parents, confidence, evidence, drawn = [], [], [], [], []
    where: dict[tuple[int, int], int] = {}
    for tree in ((b, a) if drawn_b else (a, b)):
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
                drawn.append(drawn_b and tree is b)
            else:
                confidence[node] = max(confidence[node], conf)
                evidence[node] = max(evidence[node], evid)
            local.append(node)
    merged = DraftTree(tokens, parents, b.q if drawn_b else None, confidence, evidence, drawn if drawn_b else None)
    return merged.subtree(_best(merged, budget))


HEAD_ACCEPTANCE = 0.5
"""What a drawn head node is worth per depth when the hybrid sizes the head's tree: its chance of
acceptance given its parent's. The shipped head's drawn candidates are accepted about half the
time at each depth at temperature 0.7-1.0 (tau 2.2-2.5 five deep with two candidates)."""


def _head_depth(sibling: DraftTree, budget: int, width: int, max_depth: int) -> int:
    """How deep the head drafts beside ``sibling`` within ``budget`` nodes: the budget goes to
    whichever is likelier, a sibling node (its path confidence) or the head's next level (``width``
    nodes, ``HEAD_ACCEPTANCE`` to the power of its depth), as if ranked together. Decided before
    the head draws, from the sibling text alone."""
    chances = sorted(_path_chances(sibling), reverse=True)
    depth, used, taken = 0, 0, 0
    while depth < max_depth:
        level = HEAD_ACCEPTANCE ** (depth + 1)
        while taken < len(chances) and chances[taken] > level and used < budget:
            taken, used = taken + 1, used + 1
        if used + width > budget:
            break
        depth, used = depth + 1, used + width
    return depth


def _path_chances(tree: DraftTree) -> list[float]:
    """Each node's product of confidences from the root (0 without confidences)."""
    chance: list[float] = []
    for i, parent in enumerate(tree.parents):
        conf = min(1.0, tree.confidence[i]) if tree.confidence is not None else 0.0
        chance.append(conf if parent < 0 else conf * chance[parent])
    return chance


def _best(tree: DraftTree, budget: int) -> list[int]:
    """The ``budget`` nodes with the highest product of confidences from the root, ascending; a
    child never beats its parent (confidences are at most 1, ties go to the shallower node), so
    the set is closed under parents. Drawn nodes are all kept, first (they are closed under
    parents: a drawn node's parent is drawn or the root)."""
    if len(tree.tokens) <= budget:
        return list(range(len(tree.tokens)))
    chance = _path_chances(tree)
    depths = tree.depths()
    drawn = tree.is_drawn()
    order = sorted(range(len(chance)), key=lambda i: (not drawn[i], -chance[i], depths[i], i))
    return sorted(order[:max(budget, sum(drawn))])
