from multispec.drafters import DraftTree, make_drafter


def ngram(**options):
    return make_drafter("ngram", **{"vocab_size": 100, "max_depth": 4, "max_nodes": 8, **options})


def test_copies_after_the_longest_match():
    drafter = ngram()
    drafter.add_group(0, [50], [0])
    # the last token 3 last occurred before 9, but the last two tokens [2, 3] before 7
    drafter.observe(0, [2, 3, 7, 6, 3, 9, 5, 2, 3])
    assert drafter.propose([0], [8])[0] == DraftTree([7, 6, 3, 9], [-1, 0, 1, 2], None)


def test_uses_the_prompt_and_never_siblings():
    drafter = ngram()
    drafter.add_group(0, [1, 2, 3, 4], [0, 1])
    drafter.observe(1, [5, 6, 7, 8])
    drafter.observe(0, [2])
    assert drafter.propose([0], [8])[0].tokens == [3, 4]
    drafter.observe(0, [9, 5])
    assert drafter.propose([0], [8])[0] == DraftTree.EMPTY


def test_chain_respects_budget_and_depth():
    drafter = ngram(max_depth=3, max_nodes=2)
    drafter.add_group(0, [1, 2, 3, 4, 5, 6, 1], [0])
    assert drafter.propose([0], [8])[0].tokens == [2, 3]
    assert drafter.propose([0], [1])[0].tokens == [2]
    assert drafter.propose([0], [0])[0] == DraftTree.EMPTY


def test_ignores_sampling_options():
    drafter = make_drafter("ngram", vocab_size=100, max_depth=4, max_nodes=8, sampled=True, aggregate=True)
    drafter.add_group(0, [1, 2, 3, 1], [0])
    assert drafter.propose([0], [8])[0] == DraftTree([2, 3, 1], [-1, 0, 1], None)
