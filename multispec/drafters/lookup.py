"""Suffix lookup: which continuations do the sources offer for a sample's last tokens?"""

from __future__ import annotations

from multispec.drafters.index import Alternatives, NgramIndex, Text

Continuation = tuple[list[int], list[float], float, int, list[Alternatives | None]]
"""Tokens that followed a match, the target's probabilities of those tokens, the vote weight, the
length of the match, and the target's most likely tokens at the first ``ALTERNATIVE_DEPTH`` of
those positions (None where not kept)."""

ALTERNATIVE_DEPTH = 2
"""Positions of a continuation whose alternatives vote. Deeper ones hang under paths already
discounted by every probability on the way and almost never make a draft: on the default model's
GSM8K samples (``benchmarks/bench_replay.py``, 8 x 16, T 0.7) they add 0.0-0.4% to tau and cost
half the drafter's time."""

LENGTH_DECAY = 0.25
"""Weight ratio of an (n-1)-gram match to an n-gram match: a longer shared context is stronger
evidence that the source continues the same way, so shorter matches only back the longer ones
up (and decide where no long match exists) instead of outvoting them."""


def find_continuations(text: Text, indexes: list[NgramIndex], depth: int, first_only: bool,
                       max_votes: int) -> list[Continuation]:
    """Continuations of ``text``'s suffix in the sources, longest match first.

    Every source votes once, with its longest match (ties: its most recent one), weighted
    ``LENGTH_DECAY ** (max_n - n)`` for an n-token match. A match with nothing after it (the
    sample's own suffix matching itself, or a source that ends there) is skipped, so the sample's
    own earlier text is a source like any other. At most ``max_votes`` are taken, the first found
    (longest matches, most recent sources), which bounds the cost with many siblings.
    ``first_only`` returns just the first match found (the longest, most recent one): the
    no-voting ablation and plain prompt lookup. All ``indexes`` cover the same n-gram lengths;
    earlier ones are searched first.
    """
    tokens = text.tokens
    min_n, max_n = indexes[0].min_n, indexes[0].max_n
    votes: list[Continuation] = []
    voted: set[Text] = set()
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        key = tuple(tokens[-n:])
        weight = LENGTH_DECAY ** (max_n - n)
        for index in indexes:
            for source, end in reversed(index.recent(key)):
                if source in voted or end >= len(source.tokens):
                    continue
                stop = end + depth
                votes.append((source.tokens[end:stop], source.probs[end:stop], weight, n,
                              source.alternatives[end:min(stop, end + ALTERNATIVE_DEPTH)]))
                if first_only or len(votes) == max_votes:
                    return votes
                voted.add(source)
    return votes
