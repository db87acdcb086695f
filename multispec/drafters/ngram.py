"""Prompt lookup decoding: the usual baseline, drafting from a sample's own prompt and text only."""

from __future__ import annotations

from multispec.drafters.suffix import SuffixDrafter
from multispec.verify.schemes import COPIED, DraftLaw


class NgramDrafter(SuffixDrafter):
    """Copies what followed the longest (then most recent) earlier occurrence of the sample's last
    tokens in its own text or its prompt: one deterministic chain, nothing from siblings."""

    share_siblings = False

    def __init__(self, *, vocab_size: int, max_depth: int, max_nodes: int, max_ngram: int = 4,
                 min_ngram: int = 1, max_matches: int = 32):
        super().__init__(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, sampled=False,
                         aggregate=False, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=None,
                         max_matches=max_matches, max_votes=1)

    @classmethod
    def create(cls, *, vocab_size: int, max_depth: int, max_nodes: int, max_ngram: int = 4, min_ngram: int = 1,
               **_) -> NgramDrafter:
        """Takes the lookup options; sampling and voting options do not apply to copied text."""
        return cls(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, max_ngram=max_ngram,
                   min_ngram=min_ngram)

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, **_) -> DraftLaw:
        """One copied chain; it has nothing to sample from."""
        if sampled:
            raise ValueError("drafter='ngram' copies text and has no distribution to sample drafts from: "
                             "sampled_drafts=True needs drafter='consensus'")
        return DraftLaw(COPIED, 1)
