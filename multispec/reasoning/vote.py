"""Self-consistency: the majority answer among a prompt's samples."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable


def majority_vote(completions: Iterable[str], extract: Callable[[str], str | None]) -> tuple[str | None, int]:
    """The most frequent extracted answer and its count; ties go to the answer seen first.

    Completions without an answer do not vote. ``(None, 0)`` when none has one.
    """
    answers = [a for a in (extract(c) for c in completions) if a is not None]
    if not answers:
        return None, 0
    counts = Counter(answers)
    best = max(counts.values())
    winner = next(a for a in answers if counts[a] == best)
    return winner, best
