import pytest

from multispec.drafters import ConsensusDrafter, DraftTree, NgramDrafter, NoDrafter, make_drafter


def test_empty_tree():
    assert len(DraftTree.EMPTY) == 0
    assert DraftTree.EMPTY.q is None


def test_depths_follow_parents():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1], None)
    assert tree.depths() == [1, 2, 1, 3]


def test_factory_kinds():
    options = dict(vocab_size=10, max_depth=3, max_nodes=4)
    assert isinstance(make_drafter("none", **options), NoDrafter)
    assert isinstance(make_drafter("consensus", **options), ConsensusDrafter)
    assert isinstance(make_drafter("ngram", **options), NgramDrafter)
    with pytest.raises(ValueError):
        make_drafter("oracle", **options)
    with pytest.raises(ValueError):
        make_drafter("consensus", min_ngram=3, max_ngram=2, **options)


def test_none_drafter_always_empty():
    drafter = make_drafter("none", vocab_size=10, max_depth=3, max_nodes=4)
    drafter.add_group(0, [1, 2], [0, 1])
    drafter.observe(0, [1, 2])
    drafter.remove(0)
    assert drafter.propose([1], [4]) == [DraftTree.EMPTY]
