"""Prompt lookup decoding: the usual baseline, drafting from a sample's own prompt and text only."""

from __future__ import annotations

from multispec.drafters.suffix import SuffixDrafter


class NgramDrafter(SuffixDrafter):
    """Copies what followed the longest (then most recent) earlier occurrence of the sample's last
    tokens in its own text or its prompt: one deterministic chain, nothing from siblings."""

    share_siblings = False

    def __init__(self, *, vocab_size: int, max_depth: int, max_nodes: int, max_ngram: int = 4,
                 min_ngram: int = 1, max_matches: int = 32):
        super().__init__(vocab_size=vocab_size, max_depth=max_depth, max_nodes=max_nodes, sampled=False,
                         aggregate=False, max_ngram=max_ngram, min_ngram=min_ngram, num_drafts=None,
                         max_matches=max_matches, max_votes=1)
