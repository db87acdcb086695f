"""Lossless verification of draft tokens: token-level multi-draft schemes and tree traversal.

Pure tensor functions, no engine state. The engine calls :func:`verify_tree` once per step; the
registry in ``schemes`` says which drafts each scheme is exact for; the token-level schemes and
their exact acceptance probabilities serve tests and analysis.
"""

from multispec.verify.batch import Selection
from multispec.verify.canonical import acceptance_canonical, canonical_select, tournament
from multispec.verify.direct import deterministic_select, greedy_select
from multispec.verify.optimal import optimal_acceptance, optimal_acceptance_lp
from multispec.verify.recursive import (
    acceptance_specinfer,
    acceptance_without_replacement,
    estimate_acceptance_without_replacement,
    recursive_rejection,
)
from multispec.verify.speculative import acceptance_single, single_draft
from multispec.verify.spectr import acceptance_spectr, spectr_rho, spectr_select
from multispec.verify.sampling import PositionKeys, Uniforms
from multispec.verify.schemes import SCHEMES, DraftLaw, Scheme, check_drafts
from multispec.verify.tree import TreeVerifyResult, verify_tree

__all__ = [
    "SCHEMES",
    "DraftLaw",
    "PositionKeys",
    "Scheme",
    "Selection",
    "TreeVerifyResult",
    "acceptance_canonical",
    "acceptance_single",
    "acceptance_specinfer",
    "acceptance_spectr",
    "acceptance_without_replacement",
    "canonical_select",
    "check_drafts",
    "deterministic_select",
    "estimate_acceptance_without_replacement",
    "greedy_select",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "recursive_rejection",
    "single_draft",
    "spectr_rho",
    "spectr_select",
    "tournament",
    "Uniforms",
    "verify_tree",
]
