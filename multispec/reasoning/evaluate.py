"""A task solved question by question under one strategy, and the results a run reports.

``EvalConfig`` checks a whole run's settings before any work; ``solve`` streams each question's
scored result as soon as its samples are in (``runner.generate``), and ``solve_rows`` is the same
for a batch of rows on a Ray replica (``multispec.distributed.map_with_llm``). Strategies:

- ``vote``: self-consistency, the majority answer of the samples that finished (ties: the answer
  of the lowest sample index; optionally weighted by each sample's mean token probability),
  with an optional early-stop rule (``multispec.reasoning.early_stop``);
- ``best-of-n``: the answer of the sample a scorer rates highest (``best_of_n``);
- ``pass@k``: every sample graded, pass@k estimated from the n (``passk``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Iterator, Sequence

from multispec.params import SamplingParams, SpecConfig
from multispec.reasoning.best_of_n import best_of_n, make_scorer
from multispec.reasoning.early_stop import WindowRule, parse_early_stop
from multispec.reasoning.passk import check_ks, pass_at_k
from multispec.reasoning.runner import MAX_SAMPLES, Completion, Generation, generate
from multispec.reasoning.tasks import Grade, Problem, Task
from multispec.reasoning.vote import group_answers, majority_vote

STRATEGIES = ("vote", "best-of-n", "pass@k")


@dataclass
class EvalConfig:
    """One run's settings, checked on construction (a ValueError naming the bad one). ``ks``: the
    k of pass@k (default 1, 5, 10 up to n); ``scorer``: Best-of-N's (see ``make_scorer``)."""

    task: Task
    sampling: SamplingParams
    spec: SpecConfig | None = None
    strategy: str = "vote"
    early_stop: str = "none"
    ks: list[int] | None = None
    scorer: str = "auto"
    weighted_vote: bool = False
    max_samples: int = MAX_SAMPLES

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: must be one of {', '.join(STRATEGIES)}")
        self.rule = parse_early_stop(self.early_stop)
        n = self.sampling.n
        if self.strategy != "vote" and (self.rule is not None or self.weighted_vote):
            raise ValueError(f"early stop and vote weights apply to --strategy vote, not {self.strategy}")
        if self.strategy == "vote" and self.task.code:
            raise ValueError(f"{self.task.spec} answers are programs graded by tests: use --strategy pass@k or "
                             f"best-of-n")
        if isinstance(self.rule, WindowRule) and self.rule.window > n:
            raise ValueError(f"early stop {self.rule}: the window exceeds n={n}, so it could never fire")
        if self.strategy == "pass@k":
            self.ks = check_ks(self.ks, n)
        elif self.ks is not None:
            raise ValueError("k applies to --strategy pass@k only")
        if self.strategy == "best-of-n":
            self.scoring = make_scorer(self.scorer, self.task)
        elif self.scorer != "auto":
            raise ValueError("a scorer applies to --strategy best-of-n only")

    def describe(self) -> dict:
        """The settings as the results file records them."""
        return {"task": self.task.spec, "strategy": self.strategy, "early_stop": str(self.rule or "none"),
                "k": self.ks, "scorer": self.scorer, "weighted_vote": self.weighted_vote,
                "sampling": asdict(self.sampling), "spec": None if self.spec is None else asdict(self.spec)}


def solve(llm, config: EvalConfig, problems: Sequence[Problem],
          positions: Sequence[int] | None = None) -> Iterator[dict]:
    """Each question's result (see ``score``) as soon as it is in, in the order questions end."""
    for generation in generate(llm, config.task, problems, config.sampling, config.spec, config.rule,
                               positions=positions, max_samples=config.max_samples):
        yield score(config, generation)


def solve_rows(llm, rows: list[dict]) -> list[dict]:
    """``map_with_llm`` worker: rows ``{"position", "problem", "config"}`` (one config for the
    batch) to results in the rows' order."""
    results = {r["position"]: r for r in solve(llm, rows[0]["config"], [row["problem"] for row in rows],
                                                [row["position"] for row in rows])}
    return [results[row["position"]] for row in rows]


def score(config: EvalConfig, generation: Generation) -> dict:
    """A question's result: its samples (text, tokens, answer, grade), the strategy's answer
    (``vote``) and whether it is ``correct``, the tokens generated and the seconds taken."""
    start = time.perf_counter()
    task, problem, samples = config.task, generation.problem, generation.samples
    grader = _Grader(task, problem)
    scores = None
    if config.strategy == "vote":
        result = _vote(config, grader, samples)
    elif config.strategy == "best-of-n":
        best, scores = best_of_n(problem, samples, config.scoring)
        answer = None if best is None else samples[best].answer
        result = {"vote": answer, "votes": None, "best": best, "correct": grader.grade(answer).correct}
    else:
        passed = sum(grader.grade(s.answer).correct for s in samples)
        result = {"vote": None, "votes": None, "correct": passed > 0, "passed": passed,
                  "pass@k": {str(k): pass_at_k(len(samples), passed, k) for k in config.ks}}
    if not task.code:  # cheap: every answer's grade, for analysis and pass@k after the fact
        for sample in samples:
            grader.grade(sample.answer)
    records = [_sample(s, grader.known(s.answer)) for s in samples]
    for record, value in zip(records, scores or []):
        record["score"] = value
    return {"id": problem.id, "position": generation.position, "reference": problem.reference} | result | {
        "samples": records, "answers": [s.answer for s in samples], "tokens": generation.tokens,
        "time": generation.seconds, "grade_time": time.perf_counter() - start,
        "finished_samples": len(generation.finish_order), "stopped_early": generation.stopped_early,
        "error": generation.error}


def _vote(config: EvalConfig, grader: _Grader, samples: list[Completion]) -> dict:
    """Majority over the finished samples; with every sample run, also whether the vote of the
    first m samples would have been correct, m = 1..n (accuracy against compute, from one run)."""
    answers = [s.answer for s in samples]
    weights = None
    if config.weighted_vote:
        weights = [math.exp(s.logprob / s.tokens) if s.tokens else 0.0 for s in samples]
    labels = group_answers(answers, config.task.equivalent)
    canonical = [None if label is None else answers[label] for label in labels]
    vote, votes = majority_vote(canonical, weights)
    result = {"vote": vote, "votes": votes, "correct": grader.grade(vote).correct}
    if config.rule is None:
        result["correct_at"] = [
            grader.grade(majority_vote(canonical[:m], None if weights is None else weights[:m])[0]).correct
            for m in range(1, len(samples) + 1)]
    return result


class _Grader:
    """A question's grades, each distinct answer graded once (grading code runs the sandbox)."""

    def __init__(self, task: Task, problem: Problem):
        self.task, self.problem = task, problem
        self.grades: dict[str | None, Grade] = {}

    def grade(self, answer: str | None) -> Grade:
        if answer not in self.grades:
            self.grades[answer] = self.task.grade(self.problem, answer)
        return self.grades[answer]

    def known(self, answer: str | None) -> Grade | None:
        return self.grades.get(answer)


def _sample(sample: Completion, grade: Grade | None) -> dict:
    """A sample as the results file keeps it; ``correct`` and ``status`` are None where it was not
    graded (cut short by the early stop, or a code sample Best-of-N did not pick)."""
    graded = grade is not None and sample.finish_reason != "abort"
    return {"index": sample.index, "text": sample.text, "tokens": sample.tokens, "logprob": sample.logprob,
            "finish_reason": sample.finish_reason, "answer": sample.answer,
            "correct": grade.correct if graded else None, "status": grade.status if graded else None}


def summarize(config: EvalConfig, results: list[dict], wall_time: float) -> dict:
    """A run's totals: accuracy (pass@k: a question counts when any sample is correct), tokens,
    wall time (grading included) and grading time, samples run to the end, early stops."""
    count = len(results)
    correct = sum(r["correct"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    summary = {"questions": count, "correct": correct, "accuracy": correct / count if count else 0.0,
               "tokens": tokens, "tokens_per_question": tokens / count if count else 0.0, "wall_time": wall_time,
               "tokens_per_second": tokens / wall_time if wall_time else 0.0,
               "grade_time": sum(r["grade_time"] for r in results),
               "finished_samples": mean(r["finished_samples"] for r in results) if count else 0.0,
               "stopped_early": sum(r["stopped_early"] for r in results),
               "errors": sum(r["error"] is not None for r in results)}
    if config.strategy == "pass@k":
        summary["pass@k"] = {str(k): mean(r["pass@k"][str(k)] for r in results) if count else 0.0
                             for k in config.ks}
    return summary


def summary_table(config: EvalConfig, summary: dict, model: str) -> str:
    """The run's figures as an aligned two-column table."""
    n = config.sampling.n
    how = {"vote": f"majority vote of n={n}" + (f", early stop {config.rule}" if config.rule else ""),
           "best-of-n": f"best of n={n} by {config.scorer}", "pass@k": f"pass@k from n={n}"}[config.strategy]
    rows = [("task", f"{config.task.spec}, {summary['questions']} questions, {model}"), ("strategy", how),
            ("accuracy", f"{summary['accuracy']:.1%} ({summary['correct']}/{summary['questions']})")]
    rows += [(f"pass@{k}", f"{value:.3f}") for k, value in summary.get("pass@k", {}).items()]
    rows += [("generated tokens", f"{summary['tokens']} ({summary['tokens_per_question']:.1f} per question)"),
             ("samples finished", f"{summary['finished_samples']:.1f} of {n} per question, "
                                  f"{summary['stopped_early']} questions stopped early"),
             ("wall time", f"{summary['wall_time']:.1f} s ({summary['tokens_per_second']:.1f} tokens/s)"),
             ("grading time", f"{summary['grade_time']:.1f} s" + (" (sandbox)" if config.task.code else ""))]
    if summary["errors"]:
        rows.append(("failed requests", str(summary["errors"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
