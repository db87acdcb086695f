"""Exact acceptance formulas: cross-checks between independent computations and the expected ordering of schemes."""

import itertools

import pytest
import torch

from multispec.verify import (
    acceptance_canonical,
    acceptance_single,
    acceptance_specinfer,
    acceptance_spectr,
    acceptance_without_replacement,
    estimate_acceptance_without_replacement,
    optimal_acceptance,
    optimal_acceptance_lp,
)
from tests.verify.verify_stats import random_case


def _subset_formula(p: torch.Tensor, q_each: torch.Tensor) -> float:
    """1 + min over all token subsets H of p(H) - prod_i q_i(H), by brute force."""
    vocab = p.shape[0]
    best = 0.0
    for size in range(1, vocab + 1):
        for subset in itertools.combinations(range(vocab), size):
            h = list(subset)
            best = min(best, float(p[h].sum() - q_each[:, h].sum(1).prod()))
    return 1 + best


@pytest.mark.parametrize("vocab,k,partial", [(3, 1, False), (5, 2, False), (6, 2, True), (7, 3, False), (8, 3, True)])
def test_optimal_acceptance_three_ways(vocab, k, partial):
    """Sorting formula, flow LP and brute-force subset formula agree to 1e-6 for i.i.d. drafts."""
    p, q = random_case(vocab, partial, seed=vocab * 10 + k)
    by_sort = float(optimal_acceptance(p, q, k)[0, -1])
    assert by_sort == pytest.approx(optimal_acceptance_lp(p[0], q.expand(k, -1)), abs=1e-6)
    assert by_sort == pytest.approx(_subset_formula(p[0], q.expand(k, -1)), abs=1e-9)


def test_optimal_lp_with_different_drafts():
    """For independent drafts from different q_i the LP still equals the subset formula."""
    p, q1 = random_case(6, False, seed=1)
    q2 = random_case(6, True, seed=2)[1]
    q_each = torch.cat([q1, q2])
    assert optimal_acceptance_lp(p[0], q_each) == pytest.approx(_subset_formula(p[0], q_each), abs=1e-6)


def _random_cases(count: int):
    g = torch.Generator().manual_seed(2024)
    for i in range(count):
        vocab = int(torch.randint(4, 17, (), generator=g))
        k = int(torch.randint(2, 5, (), generator=g))
        yield random_case(vocab, i % 4 == 3, seed=1000 + i, concentration=(0.3, 1.0, 3.0)[i % 3]), k


@pytest.fixture(scope="module")
def table():
    """Exact acceptance of every scheme on 60 random cases (V 4-16, K 2-4, peaked to flat, some partial support)."""
    rows = []
    for (p, q), k in _random_cases(60):
        rows.append(
            {
                "optimal": float(optimal_acceptance(p, q, k)[0, -1]),
                "canonical_lp": float(acceptance_canonical(p, q, k, "lp")[0, -1]),
                "canonical_wis": float(acceptance_canonical(p, q, k, "wis")[0, -1]),
                "spectr": float(acceptance_spectr(p, q, k)[0, -1]),
                "specinfer": float(acceptance_specinfer(p, q, k)[0, -1]),
                "without_replacement": float(acceptance_without_replacement(p[0], q[0], k)[-1]),
            }
        )
    return rows


def _mean(table, scheme):
    return sum(row[scheme] for row in table) / len(table)


def test_no_scheme_beats_optimal(table):
    """The optimum bounds every lossless scheme in every single case."""
    for row in table:
        for scheme in ("canonical_lp", "canonical_wis", "spectr", "specinfer"):
            assert row[scheme] <= row["optimal"] + 1e-6, (scheme, row)


def test_ordering_on_average(table):
    """optimal >= canonical-LP >= SpecTr and canonical-LP >= SpecInfer on average; without >= with replacement."""
    assert _mean(table, "optimal") >= _mean(table, "canonical_lp") >= _mean(table, "spectr")
    assert _mean(table, "canonical_lp") >= _mean(table, "specinfer")
    assert _mean(table, "without_replacement") >= _mean(table, "specinfer")


@pytest.mark.parametrize("seed", range(5))
def test_canonical_lp_is_optimal_for_two_drafts(seed):
    """With the LP free over every token (s = V) and K = 2 the canonical decomposition reaches the optimum."""
    p, q = random_case(6, seed % 2 == 1, seed=300 + seed)
    assert float(acceptance_canonical(p, q, 2, "lp", top_s=6)[0, -1]) == pytest.approx(float(optimal_acceptance(p, q, 2)[0, -1]), abs=1e-6)


def test_one_draft_reduces_to_single_draft():
    """With K = 1 every scheme is single-draft speculative sampling."""
    p, q = random_case(9, True, seed=9)
    single = float(acceptance_single(p, q)[0])
    for value in (
        acceptance_specinfer(p, q, 1)[0, 0],
        acceptance_spectr(p, q, 1)[0, 0],
        acceptance_canonical(p, q, 1, "lp")[0, 0],
        acceptance_without_replacement(p[0], q[0], 1)[0],
        optimal_acceptance(p, q, 1)[0, 0],
    ):
        assert float(value) == pytest.approx(single, abs=1e-9)


def test_estimate_without_replacement_matches_enumeration():
    """The Rao-Blackwellised estimate lies within 4.5 standard errors of the exact enumeration (alpha about 7e-6 per K)."""
    p, q = random_case(12, False, seed=4, concentration=0.5)
    exact = acceptance_without_replacement(p[0], q[0], 4)
    mean, stderr = estimate_acceptance_without_replacement(p[0], q[0], 4, num_paths=4000, generator=torch.Generator().manual_seed(0))
    assert bool(((mean - exact).abs() <= 4.5 * stderr + 1e-12).all())


def test_enumeration_refuses_what_it_cannot_do():
    """Exact enumeration over a large vocabulary raises instead of running out of memory."""
    p, q = random_case(200, False, seed=1)
    with pytest.raises(ValueError, match="max_states"):
        acceptance_without_replacement(p[0], q[0], 4, max_states=1000)
