import pytest

from multispec.drafters import DraftTree
from multispec.verify.support import dense_rows


def _check_tree(tree: DraftTree, budget: int, max_depth: int, vocab_size: int) -> None:
    """A tree the engine can pack: within budget and depth, parents before children, and, for
    sampled drafts, q rows that are distributions giving the drawn tokens positive mass."""
    assert len(tree.tokens) == len(tree.parents) <= budget
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i
    assert max(tree.depths(), default=0) <= max_depth
    assert all(0 <= t < vocab_size for t in tree.tokens)
    if tree.q is not None:
        assert tuple(tree.q.shape) == (len(tree.tokens), vocab_size)
        q = dense_rows(tree.q)
        assert q.dtype.is_floating_point
        assert ((q.sum(1) - 1).abs() < 1e-5).all()
        assert all(q[i, t] > 0 for i, t in enumerate(tree.tokens))


@pytest.fixture
def check_tree():
    return _check_tree
