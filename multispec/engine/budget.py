"""How many draft tokens a step should carry: the one that maximises expected tokens per second.

Drafting is free, verifying is not: every draft token is one more token in the target forward.
Where a forward is overhead- or memory-bound (small batches, GPUs) extra tokens cost almost
nothing and long drafts pay; where it is compute-bound (large batches on a CPU) each token costs
as much as a sample's plain step and drafts only pay when they are nearly always accepted. So the
engine measures both sides as it runs instead of assuming either:

- the cost of a forward as a function of its token count, a least-squares line ``a + b * T`` over
  recent steps, refit every step;
- the chance that a draft token at depth d is accepted given its parent was, per depth.

Each step it picks the per-sample draft length L in [0, max] that maximises
``(B + B * E[accepted | L]) / cost(B * (1 + L))``. The cost samples belong to the engine and
outlive a call (they describe the machine and the model, plain steps included); while the line
is not identified yet (all steps had one size) it alternates between no draft and a one-token
draft, the cheapest probe.
"""

from __future__ import annotations

from collections import deque


class DraftBudget:
    def __init__(self, max_depth: int, samples: deque[tuple[int, float]] | None = None):
        self.max_depth = max_depth
        self.samples = samples if samples is not None else deque(maxlen=256)
        # Pseudo-counts: a prior of 50% acceptance per depth, worth two observations.
        self.tried = [2.0] * (max_depth + 1)
        self.kept = [1.0] * (max_depth + 1)
        self.steps = 0

    def record_forward(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))

    def record_acceptance(self, drafted_by_depth: list[int], accepted_by_depth: list[int]) -> None:
        """Counts of draft tokens offered at each depth (parent accepted) and accepted there."""
        for depth in range(1, min(len(drafted_by_depth), self.max_depth + 1)):
            self.tried[depth] += drafted_by_depth[depth]
            self.kept[depth] += accepted_by_depth[depth]

    def expected_accepted(self, length: int) -> float:
        total, chain = 0.0, 1.0
        for depth in range(1, length + 1):
            chain *= self.kept[depth] / self.tried[depth]
            total += chain
        return total

    def cost_line(self) -> tuple[float, float] | None:
        if len({t for t, _ in self.samples}) < 2:
            return None
        n = len(self.samples)
        mean_t = sum(t for t, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        var = sum((t - mean_t) ** 2 for t, _ in self.samples)
        slope = sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / var
        slope = max(slope, 0.0)
        return max(mean_s - slope * mean_t, 1e-6), slope

    def choose(self, batch: int) -> int:
        """Draft tokens per sample for a step of ``batch`` samples."""
        self.steps += 1
        if self.max_depth == 0:
            return 0
        line = self.cost_line()
        if line is None:
            return 1 if self.steps % 2 else 0
        fixed, per_token = line
        best, best_rate = 0, 0.0
        for length in range(self.max_depth + 1):
            gained = batch * (1.0 + self.expected_accepted(length))
            rate = gained / (fixed + per_token * batch * (1 + length))
            if rate > best_rate * 1.02:  # prefer the shorter draft unless the longer one clearly wins
                best, best_rate = length, rate
        return best
