"""Best-of-N: keep the one sample a scorer likes best.

A scorer takes the problem and one finished sample (``multispec.reasoning.runner.Completion``:
its text, extracted answer, token count and summed log-probability) and returns a number,
higher is better. Built in: the mean token log-probability (the model's own confidence, length
neutral) and, for code tasks, the fraction of the problem's tests the program passes. Any other
importable callable can be named as ``module:function``.
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Callable, Sequence

from multispec.reasoning.runner import Completion
from multispec.reasoning.tasks import Problem, Task

Scorer = Callable[[Problem, Completion], float]
SCORERS = "logprob, tests (code tasks) or MODULE:FUNCTION"


def mean_logprob(problem: Problem, sample: Completion) -> float:
    """The sample's log-probability per token (-inf for an empty sample)."""
    return sample.logprob / sample.tokens if sample.tokens else float("-inf")


def tests_passed(task: Task, problem: Problem, sample: Completion) -> float:
    """The fraction of the problem's tests the sample's program passes, run in the sandbox (bound
    to its task with ``partial``, which keeps the scorer picklable for Ray)."""
    fraction, _ = task.fraction_passed(problem, sample.answer)
    return fraction


def make_scorer(name: str, task: Task) -> Scorer:
    """The scorer ``name`` picks: "auto" (tests for code tasks, else logprob), "logprob", "tests"
    or "module:function" (imported here)."""
    if name == "auto":
        name = "tests" if task.code else "logprob"
    if name == "logprob":
        return mean_logprob
    if name == "tests":
        if not task.code:
            raise ValueError(f"scorer 'tests' needs a code task; {task.name} has no tests")
        return partial(tests_passed, task)
    module, sep, attribute = name.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"scorer {name!r}: must be {SCORERS}")
    try:
        scorer = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"scorer {name!r}: cannot import it ({error})") from None
    if not callable(scorer):
        raise ValueError(f"scorer {name!r}: is not callable")
    return scorer


def best_of_n(problem: Problem, samples: Sequence[Completion], scorer: Scorer) -> tuple[int | None, list[float]]:
    """The position in ``samples`` of the best one (ties: the first) and every sample's score;
    None when there is no sample."""
    scores = [float(scorer(problem, s)) for s in samples]
    if not scores:
        return None, scores
    return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores
