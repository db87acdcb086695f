import pytest

from multispec.drafters import DraftTree


def _check_tree(tree: DraftTree, budget: int, max_depth: int, vocab_size: int) -> None:
    """A tree the engine can pack: within budget and depth, parents before children, and, for
    sampled drafts, q rows that are distributions giving the drawn tokens positive mass."""
    assert len(tree.tokens) == len(tree.parents) <= budget
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i
    assert max(tree.depths(), default=0) <= max_depth
    assert all(0 <= t < vocab_size for t in tree.tokens)
    if tree.q is not None:
        assert tree.q.shape == (len(tree.tokens), vocab_size)
        assert tree.q.dtype.is_floating_point
        assert ((tree.q.sum(1) - 1).abs() < 1e-5).all()
        assert all(tree.q[i, t] > 0 for i, t in enumerate(tree.tokens))


@pytest.fixture
def check_tree():
    return _check_tree
