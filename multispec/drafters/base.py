"""What a drafter hands the engine each step, and the protocol every drafter follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


@dataclass
class DraftTree:
    """Draft tokens for one sample, as a tree rooted at the sample's last token.

    ``parents[i]`` is the local index of node i's parent, -1 for a child of the root; parents
    always come before their children, so one pass in order can compute depths or masks.
    ``q[i]`` is the distribution node i's token was drawn from given its parent; siblings drawn
    i.i.d. from one distribution share equal rows. ``q`` is None for deterministic drafts, which
    the verifier checks by sampling from the target and matching children.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None
    EMPTY: ClassVar[DraftTree]

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the root): the position offset the engine needs."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths


DraftTree.EMPTY = DraftTree([], [], None)


class Drafter(Protocol):
    """Proposes draft trees for samples and learns from what they actually produced."""

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        """A prompt and its sibling samples (ids unique across live groups); samples start empty."""

    def observe(self, sample_id: int, new_tokens: list[int], token_probs: list[float] | None = None) -> None:
        """Tokens appended to a sample, optionally with the target's probability of each."""

    def remove(self, sample_id: int) -> None:
        """The sample finished: it stops proposing but its text stays a source for its siblings."""

    def propose(self, sample_ids: list[int], budgets: list[int],
                generator: torch.Generator | None = None) -> list[DraftTree]:
        """One tree per sample, with at most budgets[i] nodes (0 gives DraftTree.EMPTY)."""


class NoDrafter:
    """Plain decoding through the same step loop: every draft is empty."""

    def add_group(self, group_id: int, prompt_ids: list[int], sample_ids: list[int]) -> None:
        pass

    def observe(self, sample_id: int, new_tokens: list[int], token_probs: list[float] | None = None) -> None:
        pass

    def remove(self, sample_id: int) -> None:
        pass

    def propose(self, sample_ids: list[int], budgets: list[int],
                generator: torch.Generator | None = None) -> list[DraftTree]:
        return [DraftTree.EMPTY] * len(sample_ids)
