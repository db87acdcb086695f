"""Texts that drafts are copied from, and an append-only n-gram index over them.

Each step appends a few tokens to each sample, so the index is only ever extended with the
n-grams that end at the new tokens: a step costs time in proportion to the new tokens, never to
the length of the texts. Lookups then read continuations straight from the source's token list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNKNOWN = -1.0
"""Stands for a probability that was never computed."""

Alternatives = tuple[list[int], list[float]]
"""The target's most likely tokens at one position and their probabilities, most likely first."""

Occurrence = tuple["Text", int]
"""A source and the end position of an n-gram in it: its continuation starts at that position."""


@dataclass(eq=False)
class Text:
    """A growing token sequence, with the target's probability of each token (``UNKNOWN`` where
    not computed: prompts, and tokens appended without probabilities) and, where the engine passed
    them, the target's most likely tokens at each position (None where not).

    Compared and hashed by identity, so a lookup can tell sources apart cheaply.
    """

    tokens: list[int]
    probs: list[float] = field(default_factory=list)
    alternatives: list[Alternatives | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.probs:
            self.probs = [UNKNOWN] * len(self.tokens)
        if not self.alternatives:
            self.alternatives = [None] * len(self.tokens)

    def extend(self, tokens: list[int], probs: list[float] | None,
               alternatives: list[Alternatives] | None = None) -> None:
        if probs is not None and len(probs) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(probs)} probabilities")
        if alternatives is not None and len(alternatives) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(alternatives)} sets of alternatives")
        self.tokens.extend(tokens)
        self.probs.extend(probs if probs is not None else [UNKNOWN] * len(tokens))
        self.alternatives.extend(alternatives if alternatives is not None else [None] * len(tokens))


class NgramIndex:
    """Maps every n-gram (min_n <= n <= max_n) to its most recent occurrences across sources.

    Only the last ``keep`` occurrences of an n-gram are ever read, so older ones are dropped in
    batches (amortised O(1) per append): memory and lookup cost stay bounded however often a
    frequent n-gram recurs across many samples.
    """

    def __init__(self, min_n: int, max_n: int, keep: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.keep = min_n, max_n, keep
        self._table: dict[tuple[int, ...], list[Occurrence]] = {}

    def add(self, source: Text, first_end: int) -> None:
        """Index the n-grams of ``source`` that end at positions first_end..len(source.tokens)."""
        tokens, table, keep = source.tokens, self._table, self.keep
        min_n, max_n, most = self.min_n, self.max_n, 2 * keep
        for end in range(max(first_end, min_n), len(tokens) + 1):
            window = tuple(tokens[max(0, end - max_n):end])
            occurrence = (source, end)
            for n in range(min_n, len(window) + 1):
                key = window[-n:]
                occurrences = table.get(key)
                if occurrences is None:
                    table[key] = [occurrence]
                else:
                    occurrences.append(occurrence)
                    if len(occurrences) > most:
                        del occurrences[:-keep]

    def recent(self, key: tuple[int, ...]) -> list[Occurrence]:
        """The last ``keep`` occurrences of ``key``, oldest first."""
        occurrences = self._table.get(key)
        return occurrences[-self.keep:] if occurrences else []
