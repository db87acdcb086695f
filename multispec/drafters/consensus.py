"""Consensus drafting: the sibling samples of a prompt draft for each other.

Samples of one prompt agree on much of their text, so the continuations that follow a sample's
last tokens in its siblings (and in the prompt, and in its own earlier text) are likely to be
what it writes next. Each source votes with its longest match; the votes are merged into a
weighted trie (see ``trie``) and the draft is cut from it.
"""

from __future__ import annotations

from multispec.drafters.suffix import SuffixDrafter
from multispec.verify.schemes import COPIED, IID, DraftLaw

ALTERNATIVES = 4
"""The target's most likely tokens kept per position for soft votes. Replayed on the default
model's GSM8K samples (8 x 16, T 0.7; ``benchmarks/bench_replay.py``), tau rises with 1, 2, 4 of
them and hardly past 4."""


class ConsensusDrafter(SuffixDrafter):
    """Drafts from the group's shared n-gram index.

    ``aggregate=True``: every source (each sibling, finished or not, the sample itself, the prompt)
    votes once with its longest match, weighted by match length and by the target's probabilities
    of the continuation's tokens; with ``alternatives`` > 0 a vote is soft where the source kept
    the target's most likely tokens (each of them backed by its probability, see ``trie``). The
    draft is the ``budget`` heaviest trie nodes (a chain where the votes agree, branches where they
    split), at most ``max_depth`` deep.
    ``aggregate=False``: the first match wins (longest, most recent, siblings before the prompt), its
    tokens copied as they are (no alternatives); the ablation that measures what voting gains.
    ``sampled=True``: tokens are drawn from the trie's normalised child weights instead of taken
    by weight: ``num_drafts`` root children drawn i.i.d. with replacement (default
    ``budget // max_depth``), each extended as a sampled chain; q holds, per node, the
    distribution it was drawn from, for the multi-draft verification schemes.
    """

    share_siblings = True

    def __init__(self, *, vocab_size: int, max_depth: int, max_nodes: int, sampled: bool = False,
                 aggregate: bool = True, max_ngram: int = 4, min_ngram: int = 1, num_drafts: int | None = None,
                 max_matches: int = 32, max_votes: int = 16, alternatives: int = ALTERNATIVES):
        super().__init__(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, sampled=sampled,
                         aggregate=aggregate, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=num_drafts,
                         max_matches=max_matches, max_votes=max_votes, alternatives=alternatives if aggregate else 0)

    @classmethod
    def create(cls, *, vocab_size: int, max_depth: int, max_nodes: int, sampled: bool = False, aggregate: bool = True,
               max_ngram: int = 4, min_ngram: int = 1, num_drafts: int | None = None, alternatives: int | None = None,
               **_) -> ConsensusDrafter:
        extra = {} if alternatives is None else {"alternatives": alternatives}
        return cls(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, sampled=sampled,
                   aggregate=aggregate, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=num_drafts, **extra)

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, num_drafts: int | None = None, **_) -> DraftLaw:
        """Copied trees of up to ``max_nodes`` children a node; sampled: root children i.i.d. with
        replacement from one distribution (``num_drafts`` of them, default ``max_nodes //
        max_depth``), each extended as a chain."""
        if not sampled:
            return DraftLaw(COPIED, max(1, max_nodes))
        return DraftLaw(IID, max(1, num_drafts or max_nodes // max(1, max_depth)))
