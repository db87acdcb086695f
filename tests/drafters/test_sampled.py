"""Sampled drafts must follow the q they report: the verifier's losslessness rests on it."""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from multispec.drafters import make_drafter

V = 20
ROOT_Q = {5: 0.5, 6: 0.3, 7: 0.2}
AFTER_5_Q = {8: 0.6, 9: 0.4}


def drafter_with_known_distribution(**options):
    """Sample 0 ends in [1, 2, 3]; ten siblings continue it so that the aggregated distribution
    is ROOT_Q at the root and AFTER_5_Q after token 5."""
    drafter = make_drafter("consensus", vocab_size=V, max_depth=2, max_nodes=8, sampled=True, **options)
    continuations = [[5, 8]] * 3 + [[5, 9]] * 2 + [[6, 10]] * 3 + [[7, 11]] * 2
    drafter.add_group(0, [0], list(range(11)))
    drafter.observe(0, [1, 2, 3])
    for sample, continuation in enumerate(continuations, start=1):
        drafter.observe(sample, [1, 2, 3] + continuation)
    return drafter


def uniforms(generator: torch.Generator, count: int) -> list[list[float]]:
    """One sample's uniforms for ``propose``, drawn from ``generator``."""
    return [torch.rand(count, generator=generator, dtype=torch.float64).tolist()]


def assert_follows(counts: Counter, q: dict[int, float]):
    assert set(counts) <= set(q)
    total = sum(counts.values())
    tokens = sorted(q)
    _, p_value = chisquare([counts[t] for t in tokens], [q[t] * total for t in tokens])
    assert p_value > 1e-3


def test_q_rows_are_the_aggregated_distributions(check_tree):
    tree = drafter_with_known_distribution().propose([0], [2], uniforms(torch.Generator().manual_seed(0), 2))[0]
    check_tree(tree, 2, 2, V)
    assert tree.parents == [-1, 0]
    assert tree.q[0].tolist() == pytest.approx([ROOT_Q.get(t, 0.0) for t in range(V)])
    if tree.tokens[0] == 5:
        assert tree.q[1].tolist() == pytest.approx([AFTER_5_Q.get(t, 0.0) for t in range(V)])


def test_chain_draws_match_q():
    drafter = drafter_with_known_distribution()
    generator = torch.Generator().manual_seed(1)
    first, second_after_5 = Counter(), Counter()
    for _ in range(3000):
        tree = drafter.propose([0], [2], uniforms(generator, 2))[0]
        first[tree.tokens[0]] += 1
        if tree.tokens[0] == 5:
            second_after_5[tree.tokens[1]] += 1
    assert_follows(first, ROOT_Q)
    assert_follows(second_after_5, AFTER_5_Q)


def test_root_drafts_are_iid_and_share_a_row(check_tree):
    drafter = drafter_with_known_distribution(num_drafts=3)
    generator = torch.Generator().manual_seed(2)
    first, pairs = Counter(), Counter()
    for _ in range(1500):
        tree = drafter.propose([0], [6], uniforms(generator, 6))[0]
        check_tree(tree, 6, 2, V)
        roots = [i for i, parent in enumerate(tree.parents) if parent == -1]
        assert len(roots) == 3
        assert all(torch.equal(tree.q[roots[0]], tree.q[i]) for i in roots)
        first.update(tree.tokens[i] for i in roots)
        pairs[tree.tokens[roots[0]] == tree.tokens[roots[1]]] += 1
    assert_follows(first, ROOT_Q)
    same = sum(p * p for p in ROOT_Q.values())
    assert_follows(pairs, {True: same, False: 1 - same})


def test_draws_are_a_function_of_the_uniforms():
    """The engine keys each sample's uniforms to its position, so the same uniforms must give the
    same tree, and a sampled drafter refuses to draw without them."""
    def draw(seed):
        drafter = drafter_with_known_distribution(num_drafts=2)
        generator = torch.Generator().manual_seed(seed)
        return [drafter.propose([0], [4], uniforms(generator, 4))[0].tokens for _ in range(20)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    with pytest.raises(ValueError, match="uniforms"):
        drafter_with_known_distribution().propose([0], [4])


def test_point_mass_root_spends_budget_on_one_chain():
    drafter = make_drafter("consensus", vocab_size=V, max_depth=3, max_nodes=6, sampled=True, num_drafts=2)
    drafter.add_group(0, [0], [0, 1])
    drafter.observe(0, [1, 2])
    drafter.observe(1, [1, 2, 4, 5, 6])
    tree = drafter.propose([0], [6], uniforms(torch.Generator().manual_seed(0), 6))[0]
    assert tree.tokens == [4, 5, 6]
    assert tree.parents == [-1, 0, 1]
