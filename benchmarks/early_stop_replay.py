"""What early stopping can save on a model's own answers: a fixed-n run replayed under stop rules.

Self-consistency stops a question early only when its samples agree, so the saving is a property
of the model's answers before it is one of the engine. This script takes the results file of a
fixed-n vote run (`multispec eval --early-stop none --output FILE`, or the "fixed n" files that
`benchmarks/eval_reasoning.py` writes) and replays each question's samples under each rule
(`multispec.reasoning.early_stop.replay`): which vote the rule would have kept, how many samples
and tokens it would have cost.

- concurrent: all n samples start together and write a token a step, as in the engine; samples
  finish shortest first, and a stop cuts the longer ones where they are. This is what an
  early-stopped run of the same seeded samples does (in float32 exactly; in bfloat16 samples can
  part at rounding ties when batch shapes differ).
- sequential: samples drawn one after another (as the papers measure), in ``--orders`` random
  orders per question; tokens are those of the samples drawn.

Then the same rules on synthetic questions whose top answer has share p (``--n`` samples of equal
length, sequential): the agreement and token saving a model needs for the goal of keeping the
fixed-n vote on 97% of questions with 2.5x fewer tokens, next to how many of this model's
questions reach that share.

    python benchmarks/early_stop_replay.py --results fixed.json [--rules beta:0.95,esc:5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from multispec.reasoning.early_stop import parse_early_stop, replay  # noqa: E402
from multispec.reasoning.tasks import make_task  # noqa: E402
from multispec.reasoning.vote import group_answers, majority_vote  # noqa: E402

GOAL_AGREEMENT, GOAL_SAVING = 0.97, 2.5


def load(path: Path) -> tuple[list[dict], object]:
    """The questions of a fixed-n vote run and the task's answer equivalence."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"early_stop_replay: cannot read {path}: {error}") from None
    config = document.get("config", {})
    if config.get("strategy", "vote") != "vote" or config.get("early_stop", "none") not in ("none", None):
        raise SystemExit(f"early_stop_replay: {path} is not a fixed-n vote run (strategy "
                         f"{config.get('strategy')!r}, early stop {config.get('early_stop')!r})")
    questions = [q for q in document["questions"] if q.get("error") is None]
    # The task's own equivalence groups the votes, as in the run (math:FILE: math-verify; no file
    # is read); a jsonl:FILE task needs its regex to be built and compares answers as strings.
    try:
        equivalent = make_task(config.get("task", "gsm8k")).equivalent
    except ValueError:
        equivalent = None
    return questions, equivalent


def full_vote(answers: list[str | None], equivalent) -> str | None:
    labels = group_answers(answers, equivalent)
    return majority_vote([None if label is None else answers[label] for label in labels])[0]


def replay_run(questions: list[dict], rule, orders: int, seed: int, equivalent) -> dict:
    rng = np.random.default_rng(seed)
    fixed_tokens = sum(sum(s["tokens"] for s in q["samples"]) for q in questions)
    out = {}
    for schedule in ("concurrent", "sequential"):
        kept = finished = tokens = stopped = total = 0
        for q in questions:
            answers = [s["answer"] for s in q["samples"]]
            lengths = [s["tokens"] for s in q["samples"]]
            vote = full_vote(answers, equivalent)
            for _ in range(1 if schedule == "concurrent" else orders):
                order = None if schedule == "concurrent" else rng.permutation(len(answers)).tolist()
                r = replay(rule, answers, lengths, schedule=schedule, order=order, equivalent=equivalent)
                kept += r.vote == vote
                finished += r.finished
                tokens += r.tokens
                stopped += r.stopped
                total += 1
        runs = 1 if schedule == "concurrent" else orders
        out[schedule] = {"agreement": kept / total, "samples": finished / total, "stopped": stopped / total,
                         "saving": fixed_tokens * runs / tokens}
    return out


def synthetic(rule, n: int, share: float, rivals: str, draws: int, rng) -> tuple[float, float]:
    """Agreement with the n-sample vote and token saving (equal lengths, sequential) on questions
    whose answer "A" has probability ``share``; the rest is one rival answer ("one rival", a close
    race near 0.5) or a new answer every time ("spread")."""
    kept = finished = 0
    for _ in range(draws):
        top = rng.random(n) < share
        if rivals == "one rival":
            answers = ["A" if t else "B" for t in top]
        else:
            answers = ["A" if t else f"x{i}" for i, t in enumerate(top)]
        r = replay(rule, answers, [1] * n, schedule="sequential")
        kept += r.vote == full_vote(answers, None)
        finished += r.finished
    return kept / draws, n * draws / finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, type=Path, help="results JSON of a fixed-n vote run")
    parser.add_argument("--rules", default="beta:0.95,esc:5")
    parser.add_argument("--orders", type=int, default=200, help="random orders per question (sequential)")
    parser.add_argument("--draws", type=int, default=2000, help="synthetic questions per share")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        rules = [parse_early_stop(spec) for spec in args.rules.split(",")]
    except ValueError as error:
        raise SystemExit(f"early_stop_replay: {error}") from None
    questions, equivalent = load(args.results)
    n = len(questions[0]["samples"])

    print(f"{args.results}: {len(questions)} questions x {n} samples, "
          f"{sum(sum(s['tokens'] for s in q['samples']) for q in questions)} tokens\n")
    print("| rule | schedule | vote kept | samples finished | stopped early | fewer tokens |")
    print("|---|---|---|---|---|---|")
    for rule in rules:
        result = replay_run(questions, rule, args.orders, args.seed, equivalent)
        for schedule, r in result.items():
            print(f"| {rule} | {schedule} | {r['agreement']:.1%} | {r['samples']:.1f} | {r['stopped']:.1%} | "
                  f"{r['saving']:.2f}x |")

    shares = []
    for q in questions:
        answers = [s["answer"] for s in q["samples"]]
        labels = group_answers(answers, equivalent)
        counts = [labels.count(label) for label in set(labels) if label is not None]
        shares.append(max(counts, default=0) / n)
    print(f"\nThis model's questions: the top answer's share of the {n} samples, median "
          f"{statistics.median(shares):.2f}, quartiles {np.quantile(shares, 0.25):.2f} / "
          f"{np.quantile(shares, 0.75):.2f}, max {max(shares):.2f}\n")

    rng = np.random.default_rng(args.seed)
    grid = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    print(f"Synthetic questions, {n} samples, top answer with share p (sequential, {args.draws} per cell): "
          "vote kept / fewer tokens; the share of this model's questions at p or above")
    print("| rule | rivals | " + " | ".join(f"p {p}" for p in grid) + " |")
    print("|---|---|" + "---|" * len(grid))
    for rule in rules:
        for rivals in ("one rival", "spread"):
            cells = []
            for p in grid:
                kept, saving = synthetic(rule, n, p, rivals, args.draws, rng)
                mark = " *" if kept >= GOAL_AGREEMENT and saving >= GOAL_SAVING else ""
                cells.append(f"{kept:.0%} / {saving:.2f}x{mark}")
            print(f"| {rule} | {rivals} | " + " | ".join(cells) + " |")
    print("| this model | questions at p or above | "
          + " | ".join(f"{np.mean([s >= p for s in shares]):.0%}" for p in grid) + " |")
    print(f"\n*: meets the goal ({GOAL_AGREEMENT:.0%} of votes kept with {GOAL_SAVING}x fewer tokens) on such questions.")


if __name__ == "__main__":
    main()
