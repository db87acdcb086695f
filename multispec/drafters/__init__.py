"""Drafters: components without a model that propose draft trees for the engine each step."""

from __future__ import annotations

from multispec.drafters.base import Drafter, DraftTree, NoDrafter
from multispec.drafters.consensus import ConsensusDrafter
from multispec.drafters.ngram import NgramDrafter

__all__ = ["ConsensusDrafter", "DraftTree", "Drafter", "NgramDrafter", "NoDrafter", "make_drafter"]


def make_drafter(kind: str, *, vocab_size: int, max_depth: int, max_nodes: int, sampled: bool = False,
                 aggregate: bool = True, max_ngram: int = 4, min_ngram: int = 1,
                 num_drafts: int | None = None, alternatives: int | None = None) -> Drafter:
    """``"none"`` (plain decoding), ``"consensus"`` (siblings draft for each other) or ``"ngram"``
    (prompt lookup over the sample's own text; it ignores ``sampled``, ``aggregate`` and
    ``num_drafts``: its drafts are deterministic chains). ``alternatives``: the target's most likely
    tokens the consensus drafter keeps per position for soft votes (default ``ALTERNATIVES``; 0:
    votes only for the tokens the sources took)."""
    if kind == "none":
        return NoDrafter()
    if kind == "consensus":
        extra = {} if alternatives is None else {"alternatives": alternatives}
        return ConsensusDrafter(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, sampled=sampled,
                                aggregate=aggregate, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=num_drafts,
                                **extra)
    if kind == "ngram":
        return NgramDrafter(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, max_ngram=max_ngram,
                            min_ngram=min_ngram)
    raise ValueError(f"unknown drafter {kind!r}; expected 'none', 'consensus' or 'ngram'")
