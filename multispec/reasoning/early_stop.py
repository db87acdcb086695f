"""When to stop drawing samples for a question: rules checked each time one of its samples
finishes, on the answers of the samples finished so far (in the order they finished).

- Adaptive-Consistency's Beta rule (Aggarwal et al., 2023, arXiv 2305.11860): with v1 and v2
  votes for the two leading answers, the share p of the leader among samples that give either
  has the posterior Beta(v1 + 1, v2 + 1) under a uniform prior; stop once
  P(p > 1/2 | v1, v2) = 1 - I_{1/2}(v1 + 1, v2 + 1) reaches the threshold (I: the regularized
  incomplete beta function). Four votes for one answer and none for another give
  1 - 2^-5 = 0.969, enough for the default 0.95; three give 0.9375.
- ESC's window rule (Li et al., 2024, arXiv 2401.10480): stop once the last w finished samples
  all give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from scipy.stats import beta

from multispec.reasoning.vote import Equivalence, group_answers, majority_vote, tally

DEFAULT_THRESHOLD = 0.95
DEFAULT_WINDOW = 5
SPECS = "beta[:THRESHOLD], esc[:WINDOW] or none"


@dataclass(frozen=True)
class BetaRule:
    """Stop when the posterior probability that the leading answer is the majority reaches
    ``threshold`` (see the module's docstring)."""

    threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self):
        if not 0 < self.threshold < 1:
            raise ValueError(f"early stop beta:{self.threshold}: the threshold must lie in (0, 1)")

    @staticmethod
    @lru_cache(maxsize=4096)  # a few hundred vote pairs recur across a dataset's questions
    def confidence(leader: float, second: float) -> float:
        """P(p > 1/2) for p ~ Beta(leader + 1, second + 1)."""
        return float(beta.sf(0.5, leader + 1, second + 1))

    def should_stop(self, answers: Sequence[str | None], equivalent: Equivalence | None = None) -> bool:
        votes = sorted((v for _, v in tally(answers, equivalent=equivalent)), reverse=True) + [0, 0]
        return self.confidence(votes[0], votes[1]) >= self.threshold

    def __str__(self) -> str:
        return f"beta:{self.threshold:g}"


@dataclass(frozen=True)
class WindowRule:
    """Stop when the last ``window`` finished samples all give the same answer (one without an
    answer agrees with nothing)."""

    window: int = DEFAULT_WINDOW

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"early stop esc:{self.window}: the window must be an integer >= 1")

    def should_stop(self, answers: Sequence[str | None], equivalent: Equivalence | None = None) -> bool:
        last = answers[-self.window:]
        if len(last) < self.window or last[0] is None:
            return False
        return all(a is not None and (a == last[0] or (equivalent and equivalent(last[0], a))) for a in last[1:])

    def __str__(self) -> str:
        return f"esc:{self.window}"


StopRule = BetaRule | WindowRule


def parse_early_stop(spec: str) -> StopRule | None:
    """``beta:0.95`` / ``beta``, ``esc:5`` / ``esc``, or ``none`` (None: every sample runs)."""
    name, sep, value = spec.strip().partition(":") if isinstance(spec, str) else ("", "", "")
    if name == "none" and not sep:
        return None
    if name in ("beta", "esc"):
        rule, number = (BetaRule, float) if name == "beta" else (WindowRule, int)
        if not sep:
            return rule()
        try:
            parsed = number(value)
        except ValueError:
            pass
        else:
            return rule(parsed)
    raise ValueError(f"early stop {spec!r}: must be {SPECS} (for example beta:0.95 or esc:5)")


SCHEDULES = ("concurrent", "sequential")


@dataclass(frozen=True)
class Replay:
    """What a rule would have done to one question's samples (see ``replay``)."""

    finished: int
    """Samples that ran to their end (all of them where the rule never fired)."""
    tokens: int
    """Tokens generated up to the stop, those of the cut samples included."""
    vote: str | None
    """Majority over the finished samples, ties to the lowest sample index."""
    stopped: bool


def replay(rule: StopRule | None, answers: Sequence[str | None], lengths: Sequence[int], *,
           schedule: str = "concurrent", order: Sequence[int] | None = None,
           equivalent: Equivalence | None = None) -> Replay:
    """Run ``rule`` over one question's finished samples (their ``answers`` and token ``lengths``,
    as a fixed-n run saved them) as if it had been on.

    ``concurrent``: every sample starts at once and writes a token a step, as in the engine, so
    samples finish in order of length (ties by index) and a stop when sample j finishes leaves
    each sample i with min(lengths[i], lengths[j]) tokens; samples as long as j finish in the same
    step and vote. ``sequential``: samples run one after another in ``order`` (default: by index),
    as when they are drawn one by one; a stop after k of them costs their tokens only. The rule is
    asked at each finish, on the answers finished so far in finishing order, never once all have
    finished; the vote then runs over the finished samples in index order, as the evaluation
    does."""
    n = len(answers)
    if len(lengths) != n:
        raise ValueError(f"{n} answers but {len(lengths)} lengths")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: must be one of {', '.join(SCHEDULES)}")
    if order is None:
        order = sorted(range(n), key=lambda i: (lengths[i], i)) if schedule == "concurrent" else range(n)
    order = list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must list each of the {n} samples once")
    finished = n
    for k in range(1, n):
        if rule is not None and rule.should_stop([answers[i] for i in order[:k]], equivalent):
            finished = k
            break
    if schedule == "concurrent":
        cut = lengths[order[finished - 1]]
        done = {i for i in range(n) if lengths[i] <= cut} if finished < n else set(range(n))
        tokens = sum(min(length, cut) for length in lengths)
    else:
        done = set(order[:finished])
        tokens = sum(lengths[i] for i in done)
    kept = [answers[i] if i in done else None for i in range(n)]
    labels = group_answers(kept, equivalent)
    vote = majority_vote([None if label is None else kept[label] for label in labels])[0]
    return Replay(finished=len(done), tokens=tokens, vote=vote, stopped=finished < n)
