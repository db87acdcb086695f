"""How well the draft budget's cost fit predicts step times, and whether a robust loss does better.

The budget refits ``a + b * T + c * W + d * S`` (see ``multispec.engine.budget``) to the last 256
steps by non-negative least squares and picks each step's draft from it. This script records every
step of live runs (default model, GSM8K questions one at a time, 16 samples, T 0.7, 256 tokens;
per question the default budget, then every sample drafting one token, then fixed 4-token
drafts, so the window sees the shapes each policy makes) and replays the fit offline:

- held-out error: each step's time predicted by the fit to the 256 steps before it, for the
  budget's least squares, two robust losses (Huber by reweighting, scipy's soft-L1), least
  squares with one more term for the keys a step reads (samples times context), and least squares
  on a window that keeps the last 64 steps of every shape (tokens per sample);
- the fit's predicted cost of a step in which all 16 samples draft 1, 2 or 4 tokens against a
  plain step, window by window (``bench_ceiling.py`` measures those ratios directly).

    python benchmarks/bench_costfit.py              # 2 questions (about 5 minutes here)
    python benchmarks/bench_costfit.py --questions 4
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from scipy.optimize import least_squares, nnls

WINDOW = 256


def features(steps: np.ndarray, kv: bool = False) -> np.ndarray:
    """The budget's features (1, T, W, S); with ``kv`` also the keys read per step, samples times
    context (WORK_UNIT-scaled like W), which W (query rows times context) counts once per row."""
    columns = [np.ones(len(steps)), steps[:, 0], steps[:, 1], steps[:, 3]]
    if kv:
        columns.append(steps[:, 4] * steps[:, 5] / 1e4)
    return np.column_stack(columns)


def fit_least_squares(steps: np.ndarray) -> np.ndarray:
    return nnls(features(steps), steps[:, 2])[0]


def fit_with_kv(steps: np.ndarray) -> np.ndarray:
    return nnls(features(steps, kv=True), steps[:, 2])[0]


def fit_huber(steps: np.ndarray, rounds: int = 5) -> np.ndarray:
    """Non-negative Huber regression by iteratively reweighted least squares (scale from the MAD)."""
    x, y = features(steps), steps[:, 2]
    weights = np.ones(len(y))
    for _ in range(rounds):
        coef = nnls(x * weights[:, None], y * weights)[0]
        residual = np.abs(y - x @ coef)
        k = 1.345 * 1.4826 * np.median(residual) + 1e-12
        weights = np.sqrt(np.minimum(1.0, k / np.maximum(residual, 1e-12)))
    return coef


def fit_soft_l1(steps: np.ndarray) -> np.ndarray:
    x, y = features(steps), steps[:, 2]
    start = fit_least_squares(steps)
    return least_squares(lambda c: x @ c - y, start, bounds=(0, np.inf), loss="soft_l1",
                         f_scale=0.05 * float(np.median(y))).x


FITS = {"least squares (budget)": fit_least_squares, "Huber": fit_huber, "soft L1": fit_soft_l1,
        "least squares + keys-read term": fit_with_kv}
PER_SHAPE = 64
"""Steps of each shape the stratified window keeps."""


def stratified(steps: np.ndarray, t: int, batch: int) -> np.ndarray:
    """The last ``PER_SHAPE`` steps before ``t`` of every shape (tokens per sample, rounded up)."""
    shapes = np.ceil(steps[:t, 0] / batch)
    keep = np.concatenate([np.flatnonzero(shapes == shape)[-PER_SHAPE:] for shape in np.unique(shapes)])
    return steps[np.sort(keep)]


def record(questions: int, n: int) -> np.ndarray:
    """(tokens, work, seconds, drafted, samples, context) of every decode step of the live runs."""
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine import budget
    from multispec.reasoning import load_gsm8k

    steps: list[tuple[float, ...]] = []
    recorded, work = budget.DraftBudget.record_forward, budget.DraftBudget.work
    shape: list[tuple[int, int]] = []

    def work_seen(batch, qmax, context, drafting=None, tokens=None):  # the engine calls it just before
        shape[:] = [(batch, context)]
        return work(batch, qmax, context, drafting, tokens)

    def record_forward(self, tokens, work, seconds, speculative=False):
        steps.append((tokens, work, seconds, float(speculative), *shape[0]))
        recorded(self, tokens, work, seconds, speculative)

    budget.DraftBudget.record_forward = record_forward
    budget.DraftBudget.work = staticmethod(work_seen)
    try:
        llm = LLM()
        policies = [SpecConfig(drafter="consensus", max_draft_tokens=4, max_draft_nodes=4),
                    SpecConfig(drafter="consensus", max_draft_tokens=1, max_draft_nodes=1, adaptive=False),
                    SpecConfig(drafter="consensus", max_draft_tokens=4, max_draft_nodes=4, adaptive=False)]
        for problem in load_gsm8k(limit=questions):
            conversation = problem.chat()
            for spec in policies:
                llm.chat([conversation], SamplingParams(n=n, temperature=0.7, max_tokens=256, seed=0), spec,
                         use_tqdm=False)
    finally:
        budget.DraftBudget.record_forward = recorded
        budget.DraftBudget.work = staticmethod(work)
    return np.array(steps, dtype=np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--context", type=int, default=280, help="keys per query row in the predicted ratios")
    args = parser.parse_args()
    from multispec.engine.budget import DraftBudget

    steps = record(args.questions, args.n)
    batch = args.n
    variants = {name: (fit, False) for name, fit in FITS.items()}
    variants[f"least squares, last {PER_SHAPE} steps of each shape"] = (fit_least_squares, True)
    errors: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[tuple[int, list[float]]]] = {name: [] for name in variants}
    for t in range(64, len(steps)):
        window = steps[max(0, t - WINDOW):t]
        if len({s[0] for s in window}) < 3:
            continue
        for name, (fit, by_shape) in variants.items():
            coef = fit(stratified(steps, t, batch) if by_shape else window)
            row = features(steps[t:t + 1], kv=len(coef) == 5)[0]
            errors[name].append(abs(row @ coef - steps[t, 2]) / steps[t, 2])
            if t % 100 == 0:
                def cost(length: int) -> float:
                    keys = coef[4] * batch * args.context / 1e4 if len(coef) == 5 else 0.0
                    return float(coef[0] + coef[1] * batch * (1 + length)
                                 + coef[2] * DraftBudget.work(batch, 1 + length, args.context)
                                 + (coef[3] if length else 0.0) + keys)
                ratios[name].append((t, [cost(L) / cost(0) for L in (1, 2, 4)]))
    print(f"{len(steps)} steps ({int(steps[:, 3].sum())} with drafts); window {WINDOW}\n")
    print("| fit | median error | mean error |")
    print("|---|---|---|")
    for name, values in errors.items():
        print(f"| {name} | {statistics.median(values):.1%} | {statistics.mean(values):.1%} |")
    print(f"\npredicted step / plain, {batch} samples all drafting L tokens, context {args.context}, "
          "after step t (L = 1 / 2 / 4):")
    for name, rows in ratios.items():
        print(f"  {name}: " + "; ".join(f"t {t}: " + " / ".join(f"{r:.2f}" for r in values) for t, values in rows))


if __name__ == "__main__":
    main()
