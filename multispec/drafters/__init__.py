"""Drafters: components without a model that propose draft trees for the engine each step.

``DRAFTERS`` is the registry: a new drafter is one file with its class (see ``Drafter``) and one
line here.
"""

from __future__ import annotations

from multispec.drafters.base import Drafter, DraftTree, NoDrafter
from multispec.drafters.consensus import ConsensusDrafter
from multispec.drafters.hybrid import HybridDrafter
from multispec.drafters.model import ModelDrafter
from multispec.drafters.ngram import NgramDrafter
from multispec.verify.schemes import DraftLaw

__all__ = ["DRAFTERS", "ConsensusDrafter", "DraftTree", "Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "NoDrafter",
           "draft_law", "draws_by_default", "make_drafter"]

DRAFTERS: dict[str, type] = {
    "none": NoDrafter,  # plain decoding through the same step
    "consensus": ConsensusDrafter,  # the sibling samples draft for each other
    "ngram": NgramDrafter,  # prompt lookup over the sample's own text
    "model": ModelDrafter,  # a draft head over the target's features, or a draft LM, proposes candidate trees
    "hybrid": HybridDrafter,  # consensus and the draft head in one tree
}


def _registered(kind: str) -> type:
    if kind not in DRAFTERS:
        raise ValueError(f"drafter={kind!r}: must be one of {', '.join(DRAFTERS)}")
    return DRAFTERS[kind]


def draws_by_default(kind: str) -> bool:
    """Whether drafter ``kind`` draws its drafts when ``SpecConfig.sampled_drafts`` is None."""
    return bool(getattr(_registered(kind), "draws_by_default", False))


def make_drafter(kind: str, **options) -> Drafter:
    """A drafter by registered name. Options: ``vocab_size``, ``max_depth``, ``max_nodes``, and as the
    drafter uses them ``sampled``, ``aggregate``, ``max_ngram``, ``min_ngram``, ``num_drafts``,
    ``alternatives``, ``draft`` (a draft head or a ``DraftLM``), ``num_candidates``, ``temperature``, ``scheme``, ``decision_threshold``
    (see each class)."""
    return _registered(kind).create(**options)


def draft_law(kind: str, *, sampled: bool, max_depth: int, max_nodes: int, **options) -> DraftLaw | None:
    """How drafter ``kind`` draws its trees with these settings (None: it never drafts); raises
    ValueError for settings the drafter cannot honour. ``options`` (``num_candidates``,
    ``scheme``) reach the drafters that use them."""
    return _registered(kind).draft_law(sampled=sampled, max_depth=max_depth, max_nodes=max_nodes, **options)
