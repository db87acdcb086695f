"""The draft budget drafts where extra tokens are cheap and not where every token costs a full step."""

from collections import deque

from multispec.engine.budget import DraftBudget


def trained(fixed: float, per_token: float, accept: float) -> DraftBudget:
    costs = deque((t, fixed + per_token * t) for t in (16, 32, 48, 64, 96))
    budget = DraftBudget(6, costs)
    budget.record_acceptance([0] + [1000] * 6, [0] + [int(1000 * accept)] * 6)
    return budget


def test_overhead_bound_forwards_get_long_drafts():
    assert trained(fixed=0.1, per_token=0.0001, accept=0.6).choose(16) == 6


def test_compute_bound_forwards_get_no_draft():
    assert trained(fixed=0.0, per_token=0.01, accept=0.6).choose(16) == 0


def test_in_between_the_length_follows_acceptance():
    low = trained(fixed=0.05, per_token=0.003, accept=0.3).choose(16)
    high = trained(fixed=0.05, per_token=0.003, accept=0.9).choose(16)
    assert low < high


def test_unidentified_cost_probes_with_one_token():
    budget = DraftBudget(6, deque([(16, 0.1)] * 3))
    assert sorted({budget.choose(16) for _ in range(4)}) == [0, 1]


def test_expected_accepted_is_the_chain_sum():
    budget = trained(0.1, 0.001, accept=0.5)
    assert abs(budget.expected_accepted(3) - (0.5 + 0.25 + 0.125)) < 0.01
