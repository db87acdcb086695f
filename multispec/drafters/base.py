"""What a drafter hands the engine each step, and the protocol every drafter follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Sequence

import torch

from multispec.verify.schemes import DraftLaw
from multispec.verify.support import SupportQ, select_rows


@dataclass
class DraftTree:
    """Draft tokens for one sample, as a tree rooted at the sample's last token.

    ``parents[i]`` is the local index of node i's parent, -1 for a child of the root; parents
    always come before their children, so one pass in order can compute depths or masks.
    ``q[i]`` is the distribution node i's token was drawn from given its parent; siblings drawn
    i.i.d. from one distribution share equal rows. ``q`` is None for deterministic drafts, which
    the verifier checks by sampling from the target and matching children. It is a ``[M, V]``
    tensor, or a ``multispec.verify.support.SupportQ`` (the same rows kept over a drafter's own
    vocabulary: the draft head's); ``dense_rows(tree.q)`` gives the dense form of either.

    Deterministic drafts may say how much they trust each node: ``confidence[i]`` is the
    drafter's estimate of the target's probability of node i's token given its parent's path
    (in [0, 1]) and ``evidence[i]`` the longest context match behind it. The engine calibrates
    both against what verification accepts and keeps only the nodes that pay for their place in
    the forward (see ``multispec.engine.budget``).

    A tree may mix drawn nodes with copied ones (the hybrid drafter): ``drawn[i]`` says whether
    node i was drawn from a q, and ``q`` then holds one row per drawn node, in node order. Among
    siblings the drawn nodes come first. Drawn nodes are never cut for what was drawn (only
    copied ones are): the multi-draft schemes need them exactly as sampled.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | SupportQ | None
    confidence: list[float] | None = field(default=None, compare=False)
    evidence: list[int] | None = field(default=None, compare=False)
    drawn: list[bool] | None = None
    EMPTY: ClassVar[DraftTree]

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the root): the position offset the engine needs."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def is_drawn(self) -> list[bool]:
        """Per node, whether it was drawn from a q (its row of ``q``)."""
        if self.drawn is not None:
            return self.drawn
        return [self.q is not None] * len(self.tokens)

    def q_rows(self) -> list[int]:
        """Per node, its row of ``q`` (-1: copied)."""
        rows, row = [], 0
        for drawn in self.is_drawn():
            rows.append(row if drawn else -1)
            row += drawn
        return rows

    def subtree(self, keep: list[int]) -> DraftTree:
        """The nodes ``keep`` (ascending local indexes, closed under parents), re-indexed."""
        if len(keep) == len(self.tokens):
            return self
        if not keep:
            return DraftTree.EMPTY
        new_index = {old: new for new, old in enumerate(keep)}
        q, drawn = self.q, None
        if self.drawn is not None:
            rows = self.q_rows()
            drawn = [self.drawn[i] for i in keep]
            q = None if self.q is None or not any(drawn) else select_rows(self.q, [rows[i] for i in keep
                                                                                  if rows[i] >= 0])
        elif q is not None:
            q = select_rows(q, keep)
        return DraftTree([self.tokens[i] for i in keep],
                         [-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep], q,
                         None if self.confidence is None else [self.confidence[i] for i in keep],
                         None if self.evidence is None else [self.evidence[i] for i in keep], drawn)


DraftTree.EMPTY = DraftTree([], [], None)


class Drafter(Protocol):
    """Proposes draft trees for samples and learns from what they actually produced.

    A drafter is registered by name in ``multispec.drafters.DRAFTERS``; the class builds itself
    with ``create(**options)`` (the options of ``make_drafter``, taking those it uses) and declares
    with ``draft_law(sampled=, max_depth=, max_nodes=)`` how its trees are drawn (None: it never
    drafts), which decides the verification schemes that are exact for them.

    ``alternatives``: how many of the target's most likely tokens (with their probabilities) the
    drafter wants with every observed token; the engine computes them only when it is > 0, and
    ``min_alternative``: the least probability the drafter keeps, so the engine may pass None for a
    position where the sampled token leaves less than that to every other one. ``sampled``: its
    drafts are drawn at random, from the uniforms the engine passes to ``propose``.
    """

    alternatives: int
    min_alternative: float
    sampled: bool

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        """A prompt and its sibling samples (ids unique across live groups); samples start empty."""

    def observe(self, sample_id: int, new_tokens: list[int], token_probs: list[float] | None = None,
                alternatives: list[tuple[list[int], list[float]] | None] | None = None) -> None:
        """Tokens appended to a sample, optionally with the target's probability of each and the
        target's most likely tokens and their probabilities at each token's position (None at a
        position where none can reach ``min_alternative``). A drafter may also define
        ``observe_many(sample_ids, new_tokens, token_probs, alternatives)``, the same for several
        samples in order (lists of each argument); the engine then tells it each request's samples
        of a decode step in one call."""

    def remove(self, sample_id: int) -> None:
        """The sample finished: it stops proposing but its text stays a source for its siblings.
        An id the drafter does not know (its request failed before it was added) is ignored."""

    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        """One tree per sample, with at most budgets[i] nodes (0 gives DraftTree.EMPTY). A sampled
        drafter draws sample i's tree from ``uniforms[i]`` (at least budgets[i] U[0, 1) numbers,
        keyed by the engine to the sample's position, so drafts are reproducible)."""


class NoDrafter:
    """Plain decoding through the same step loop: every draft is empty."""

    alternatives = 0
    min_alternative = 0.0
    sampled = False

    @classmethod
    def create(cls, **options) -> NoDrafter:
        return cls()

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, **_) -> DraftLaw | None:
        return None

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        pass

    def observe(self, sample_id: int, new_tokens: list[int], token_probs: list[float] | None = None,
                alternatives: list[tuple[list[int], list[float]]] | None = None) -> None:
        pass

    def remove(self, sample_id: int) -> None:
        pass

    def propose(self, sample_ids: list[int], budgets: list[int],
                uniforms: Sequence[Sequence[float]] | None = None) -> list[DraftTree]:
        return [DraftTree.EMPTY] * len(sample_ids)
