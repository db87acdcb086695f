"""pass@k: the chance that at least one of k samples drawn from a question's n is correct."""

from __future__ import annotations

import numpy as np

DEFAULT_KS = (1, 5, 10)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimator 1 - C(n - c, k) / C(n, k) of Chen et al. (2021, arXiv 2107.03374),
    computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the binomials (they
    overflow a float from n around 1,000). k must lie in [1, n]."""
    if not 0 <= correct <= n:
        raise ValueError(f"correct={correct}: must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: pass@k needs 1 <= k <= n (here n={n} samples)")
    if n - correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - correct + 1, n + 1)))


def check_ks(ks: list[int] | None, n: int) -> list[int]:
    """The k values to report: those given (each in [1, n]), or those of 1, 5, 10 up to n."""
    if ks is None:
        return [k for k in DEFAULT_KS if k <= n]
    if not ks:
        raise ValueError("k: give at least one value")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k={bad[0]}: pass@k needs 1 <= k <= n (here --n {n})")
    return sorted(set(ks))
