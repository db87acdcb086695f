"""Accuracy against compute for vote runs: generated tokens per question, and wall time."""

from __future__ import annotations

from itertools import accumulate
from statistics import mean
from typing import Sequence


def plot_runs(runs: Sequence[tuple[str, dict]], path: str) -> None:
    """Draw ``(label, results)`` pairs (results as ``multispec eval --output`` writes them) into a
    PNG: accuracy against generated tokens per question (left) and against wall time (right). A
    fixed-n run is a curve over the votes of its first m = 1..n samples, whose tokens it counts
    (its wall time is known only for all n); an early-stopped run is one point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, results in runs:
        questions, summary = results["questions"], results["summary"]
        if all("correct_at" in q for q in questions):
            n = min(len(q["correct_at"]) for q in questions)
            tokens = [list(accumulate(s["tokens"] for s in q["samples"])) for q in questions]
            line, = by_tokens.plot([mean(t[m] for t in tokens) for m in range(n)],
                                   [mean(q["correct_at"][m] for q in questions) for m in range(n)],
                                   marker=".", label=f"{label} (first m = 1..{n} samples)")
            color = line.get_color()
        else:
            point, = by_tokens.plot([summary["tokens_per_question"]], [summary["accuracy"]], "o", label=label)
            color = point.get_color()
        by_time.plot([summary["wall_time"]], [summary["accuracy"]], "o", color=color, label=label)
    by_tokens.set(xlabel="generated tokens per question", ylabel="accuracy")
    by_time.set(xlabel="wall time (s)", ylabel="accuracy")
    for axes in (by_tokens, by_time):
        axes.grid(alpha=0.3)
        axes.set_ylim(-0.03, 1.03)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
