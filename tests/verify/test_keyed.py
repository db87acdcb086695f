"""The keyed random numbers behave as independent uniforms, and the same key gives the same number.

Losslessness rests on the verifier's uniforms being independent U[0, 1) draws. The engine keys
them by (seed, sample index, output position, purpose, k), so these tests draw 200,000 of them
along each of those axes with the others fixed, as the engine does, and test uniformity (KS) and
independence of neighbours (chi-square of pairs on a 16 x 16 grid), at alpha = 1e-4 each. Power:
a marginal that moves 1% of its mass shifts the KS statistic by 0.01, twice its critical value
here (0.005); neighbours correlated by 0.03 (simulated through a Gaussian copula) were rejected by
the pair test in 5 runs of 5, each with p below 1e-6.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from multispec.verify.sampling import DRAFT, ROUND, TEST, TOKEN, PositionKeys, Uniforms, derive, keyed_uniforms, sample_key

N = 200_000
ALPHA = 1e-4


def axis_draws(axis: str) -> np.ndarray:
    """N + 1 uniforms (float64) that differ only along ``axis``, the others fixed."""
    steps = np.arange(N + 1)
    if axis == "seed":
        keys = derive(derive(steps, 3), 17, TOKEN, 0)
    elif axis == "sample":
        keys = derive(derive(5, steps), 17, TOKEN, 0)
    elif axis == "position":
        keys = derive(sample_key(5, 3), steps, TOKEN, 0)
    elif axis == "k":
        keys = derive(sample_key(5, 3), 17, TEST, steps)
    else:  # purposes at many positions: TOKEN against each other purpose at the same position
        position = derive(sample_key(5, 3), steps)
        keys = np.stack([derive(position, purpose, 0) for purpose in (TOKEN, TEST, ROUND, DRAFT)], 1).reshape(-1)
    return keyed_uniforms(keys).numpy()


@pytest.mark.parametrize("axis", ["seed", "sample", "position", "k", "purpose"])
def test_keyed_uniforms_are_uniform_and_independent_along_every_axis(axis):
    u = axis_draws(axis)
    assert kstest(u, "uniform").pvalue > ALPHA
    assert 0.0 <= u.min() and u.max() < 1.0
    pairs = (u[:-1] * 16).astype(int) * 16 + (u[1:] * 16).astype(int)
    counts = np.bincount(pairs, minlength=256)
    assert chisquare(counts).pvalue > ALPHA


def test_same_key_same_number_float32_never_one():
    keys = derive(sample_key(1, 2), np.arange(1000))
    a = Uniforms(1000, keys=keys).draw(TEST, 3, torch.zeros(1))
    b = Uniforms(1000, keys=keys).draw(TEST, 3, torch.zeros(1))
    c = Uniforms(1000, keys=keys).draw(TEST, 4, torch.zeros(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and float(a.max()) < 1.0
    ones = keyed_uniforms(np.array([2**64 - 1], dtype=np.uint64), torch.float32)
    assert float(ones[0]) < 1.0


def test_rows_keep_their_numbers():
    """A subset of rows draws exactly what those rows draw in the full set (the tree walk relies on it)."""
    keys = PositionKeys(np.arange(10, dtype=np.uint64), np.arange(10))
    full = keys.at(torch.arange(10), 2).draw(TOKEN, 0, torch.zeros(1, dtype=torch.float64))
    some = keys.at(torch.arange(10), 2).rows(torch.tensor([7, 2])).draw(TOKEN, 0, torch.zeros(1, dtype=torch.float64))
    assert some.tolist() == full[[7, 2]].tolist()


def test_seeds_are_64_bit_words():
    assert sample_key(-1, 0) == sample_key(2**64 - 1, 0)
    assert sample_key(0, 0) != sample_key(0, 1) != sample_key(1, 0)


def test_uniforms_for_the_wrong_number_of_rows_are_refused():
    with pytest.raises(ValueError, match="rows"):
        Uniforms.of(Uniforms(3, keys=np.arange(3, dtype=np.uint64)), 4)
