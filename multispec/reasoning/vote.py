"""Self-consistency: the majority answer among a prompt's samples."""

from __future__ import annotations

from typing import Callable, Sequence

Equivalence = Callable[[str, str], bool]


def group_answers(answers: Sequence[str | None], equivalent: Equivalence | None = None) -> list[int | None]:
    """For each answer, the position of the first answer that says the same (equal, or
    ``equivalent`` to it); None for no answer. Replacing each answer by that first one lets later
    votes over any subset compare by equality only."""
    firsts: list[int] = []
    labels: list[int | None] = []
    for i, answer in enumerate(answers):
        label = None
        if answer is not None:
            label = next((j for j in firsts if answers[j] == answer or (equivalent and equivalent(answers[j], answer))),
                         None)
            if label is None:
                firsts.append(i)
                label = i
        labels.append(label)
    return labels


def tally(answers: Sequence[str | None], weights: Sequence[float] | None = None,
          equivalent: Equivalence | None = None) -> list[tuple[str, float]]:
    """Each distinct answer with its votes (the weights of the samples giving it; 1 each when
    ``weights`` is None), in order of first appearance; answers that are ``equivalent`` count as
    one, named by the first. None (no answer) does not vote."""
    votes: dict[int, float] = {}
    for i, label in enumerate(group_answers(answers, equivalent)):
        if label is not None:
            votes[label] = votes.get(label, 0) + (1 if weights is None else weights[i])
    return [(answers[label], count) for label, count in votes.items()]


def majority_vote(answers: Sequence[str | None], weights: Sequence[float] | None = None,
                  equivalent: Equivalence | None = None) -> tuple[str | None, float]:
    """The answer with the most votes and its votes (see ``tally``); ``(None, 0)`` when no sample
    has an answer. Ties go to the answer that appears first in ``answers``: pass them in sample
    order and the winner does not depend on the order in which samples finished."""
    return max(tally(answers, weights, equivalent), key=lambda group: group[1], default=(None, 0))
