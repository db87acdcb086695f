"""Bad inputs raise ValueError naming the problem instead of returning garbage."""

import pytest
import torch

from multispec.verify import (
    acceptance_specinfer,
    canonical_select,
    recursive_rejection,
    single_draft,
    spectr_select,
    verify_tree,
)

P = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
Q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])


@pytest.mark.parametrize(
    "p,candidates,q,message",
    [
        (torch.tensor([[0.5, 0.6, -0.1, 0.0]]), torch.tensor([[0]]), Q, "negative"),
        (torch.tensor([[0.5, 0.3, 0.1, 0.0]]), torch.tensor([[0]]), Q, "sum to 1"),
        (torch.tensor([[0.5, float("nan"), 0.2, 0.3]]), torch.tensor([[0]]), Q, "non-finite"),
        (P, torch.tensor([[0]]), torch.tensor([[0.5, 0.5, 0.5, 0.0]]), "q rows must sum"),
        (P, torch.zeros(1, 0, dtype=torch.long), Q, "K = 0"),
        (P, torch.tensor([[-1, -1]]), Q, "K = 0"),
        (P, torch.tensor([[4]]), Q, r"\[0, 4\)"),
        (P, torch.tensor([[-3]]), Q, "token ids"),
        (P, torch.tensor([[1, -1, 2]]), Q, "padding"),
        (P, torch.tensor([[0.0]]), Q, "integer"),
        (P, torch.tensor([[0], [1], [2]]), torch.full((2, 4), 0.25), "q has 2 rows"),
        (torch.full((2, 4), 0.25), torch.tensor([[0], [1], [2]]), Q, "p has 2 rows"),
        (P, torch.tensor([[0]]), torch.full((1, 5), 0.2), "vocabulary size"),
        (P, torch.tensor([[0]]), None, "q is required"),
    ],
)
def test_token_level_inputs(p, candidates, q, message):
    for select in (recursive_rejection, spectr_select, canonical_select):
        with pytest.raises(ValueError, match=message):
            select(p, candidates, q)


def test_single_draft_takes_one_candidate():
    with pytest.raises(ValueError, match="one candidate"):
        single_draft(P, torch.tensor([[0, 1]]), Q)


def test_acceptance_needs_a_draft():
    with pytest.raises(ValueError, match="K"):
        acceptance_specinfer(P, Q, 0)


def _tree(**change):
    """A valid 2-sample tree (sample 0: nodes 0, 1 chained; sample 1: one node), with fields overridden."""
    inputs = {
        "p": torch.full((5, 4), 0.25),
        "node_tokens": torch.tensor([1, 2, 3]),
        "node_parents": torch.tensor([-1, 0, -1]),
        "node_offsets": torch.tensor([0, 2, 3]),
        "q": torch.full((3, 4), 0.25),
        "scheme": "spectr",
    }
    inputs.update(change)
    return inputs


def test_valid_tree_passes():
    result = verify_tree(**_tree(), rng=torch.Generator().manual_seed(0))
    assert result.bonus_token.shape == (2,)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"p": torch.full((4, 4), 0.25)}, "B \\+ M"),
        ({"p": torch.full((5, 4), 0.3)}, "sum to 1"),
        ({"node_tokens": torch.tensor([1, 2, 4])}, "node_tokens"),
        ({"node_tokens": torch.tensor([1, 2])}, "node_parents has 3"),
        ({"node_parents": torch.tensor([-1, 1, -1])}, "earlier node"),
        ({"node_parents": torch.tensor([-1, 0, 0])}, "earlier node"),
        ({"node_offsets": torch.tensor([0, 3, 2])}, "node_offsets"),
        ({"node_offsets": torch.tensor([1, 2, 3])}, "node_offsets"),
        ({"q": None}, "needs q"),
        ({"q": torch.full((2, 4), 0.25)}, "q must be"),
        ({"q": torch.full((3, 4), -0.25)}, "negative"),
        ({"scheme": "magic"}, "scheme='magic'"),
        ({"node_tokens": torch.tensor([1.0, 2.0, 3.0])}, "integer"),
    ],
)
def test_tree_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        verify_tree(**_tree(**change))
