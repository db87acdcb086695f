import random

import pytest

from multispec.drafters import DraftTree, make_drafter

V = 200


def consensus(**options):
    options = {"vocab_size": V, "max_depth": 4, "max_nodes": 8, **options}
    return make_drafter("consensus", **options)


def group(drafter, texts, prompt=(100, 101)):
    """One group whose sample i has observed texts[i], in order."""
    drafter.add_group(0, list(prompt), list(range(len(texts))))
    for sample, text in enumerate(texts):
        drafter.observe(sample, text)
    return drafter


def propose(drafter, sample, budget=8):
    return drafter.propose([sample], [budget])[0]


@pytest.mark.parametrize("aggregate", [True, False])
def test_longest_match_first(aggregate):
    # sibling 1 shares the last 4 tokens, sibling 2 (more recent) only the last one
    drafter = group(consensus(aggregate=aggregate), [[1, 2, 3, 4], [1, 2, 3, 4, 10, 11, 12], [9, 4, 20, 21]])
    tree = propose(drafter, 0, budget=3)
    assert tree.tokens == [10, 11, 12]
    assert tree.parents == [-1, 0, 1]


def test_aggregation_follows_the_majority():
    # two siblings continue [1, 2, 3] with [5, 6], the most recent one with [7, 8]
    texts = [[1, 2, 3], [1, 2, 3, 5, 6], [1, 2, 3, 5, 6], [1, 2, 3, 7, 8]]
    assert propose(group(consensus(), texts), 0, budget=2).tokens == [5, 6]
    assert propose(group(consensus(aggregate=False), texts), 0, budget=2).tokens == [7, 8]


def test_tree_holds_the_heaviest_branches():
    texts = [[1, 2, 3], [1, 2, 3, 5, 6], [1, 2, 3, 5, 6], [1, 2, 3, 7, 8]]
    tree = propose(group(consensus(), texts), 0, budget=4)
    assert tree.tokens == [5, 6, 7, 8]
    assert tree.parents == [-1, 0, -1, 2]
    assert tree.q is None


def test_target_probabilities_weigh_votes():
    drafter = consensus()
    drafter.add_group(0, [100], [0, 1, 2, 3])
    drafter.observe(0, [1, 2, 3])
    for sample in (1, 2):
        drafter.observe(sample, [1, 2, 3, 5], [1.0, 1.0, 1.0, 0.1])
    drafter.observe(3, [1, 2, 3, 7], [1.0, 1.0, 1.0, 0.9])
    assert propose(drafter, 0, budget=1).tokens == [7]


def test_prompt_and_own_text_are_sources():
    prompt_source = group(consensus(), [[2, 3]], prompt=(1, 2, 3, 4, 5))
    assert propose(prompt_source, 0).tokens == [4, 5]
    own_text = group(consensus(), [[1, 2, 3, 9, 8, 1, 2, 3]], prompt=(50,))
    assert propose(own_text, 0, budget=3).tokens == [9, 8, 1]


def test_own_suffix_does_not_match_itself():
    assert propose(group(consensus(), [[1, 2, 3]], prompt=(50,)), 0) == DraftTree.EMPTY


def test_siblings_continue_the_prompt():
    drafter = group(consensus(), [[], [7, 8, 9]])
    assert propose(drafter, 0).tokens == [7, 8, 9]


def test_removed_samples_stay_sources_but_never_propose():
    drafter = group(consensus(), [[1, 2], [1, 2, 3, 4]])
    drafter.remove(1)
    assert propose(drafter, 0).tokens == [3, 4]
    with pytest.raises(KeyError):
        propose(drafter, 1)


def test_groups_do_not_share_text():
    drafter = consensus()
    drafter.add_group(0, [100], [0])
    drafter.add_group(1, [100], [1])
    drafter.observe(0, [1, 2])
    drafter.observe(1, [1, 2, 3, 4])
    assert propose(drafter, 0) == DraftTree.EMPTY


def test_group_id_can_be_reused_after_its_samples_finish():
    drafter = group(consensus(), [[1, 2, 3]])
    drafter.remove(0)
    drafter.add_group(0, [100], [5])
    drafter.observe(5, [1, 2])
    assert propose(drafter, 5) == DraftTree.EMPTY


def test_zero_budget_is_empty():
    drafter = group(consensus(), [[1, 2], [1, 2, 3, 4]])
    assert drafter.propose([0, 0], [0, 3]) == [DraftTree.EMPTY, DraftTree(tokens=[3, 4], parents=[-1, 0], q=None)]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("aggregate", [False, True])
def test_random_texts_give_valid_trees(check_tree, sampled, aggregate):
    rng = random.Random(0)
    max_depth, max_nodes = 3, 5
    drafter = consensus(max_depth=max_depth, max_nodes=max_nodes, sampled=sampled, aggregate=aggregate)
    samples = list(range(8))
    drafter.add_group(0, [rng.randrange(6) for _ in range(20)], samples)
    for _ in range(40):
        budgets = [rng.randrange(9) for _ in samples]
        uniforms = [[rng.random() for _ in range(b)] for b in budgets] if sampled else None
        trees = drafter.propose(samples, budgets, uniforms)
        for sample, budget, tree in zip(samples, budgets, trees):
            check_tree(tree, min(budget, max_nodes), max_depth, V)
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            probs = [rng.random() for _ in new] if rng.random() < 0.5 else None
            alternatives = None
            if probs is not None and rng.random() < 0.5:
                alternatives = []
                for token, p in zip(new, probs):
                    others = rng.sample(range(6), 3)
                    weights = sorted((rng.random() * (1 - p) / 3 for _ in others), reverse=True)
                    alternatives.append(([token] + others, [p] + weights))
            drafter.observe(sample, new, probs, alternatives)


def test_confidence_is_agreement_times_the_sources_probability():
    """Two siblings continue [9, 4] with 5 (target probability 0.9 each), one with 7 (0.6): the
    drafter's confidence in 5 is 2/3 of the votes times 0.9, in 7 it is 1/3 times 0.6; a child's
    confidence is relative to its parent's path. Prompt text, whose probabilities nobody computed,
    counts as 1/2."""
    drafter = consensus(max_nodes=8)
    drafter.add_group(0, [1, 2, 3], [0, 1, 2, 3])
    for sample, tail, probs in ((1, [5, 6], [0.9, 0.5]), (2, [5, 6], [0.9, 0.5]), (3, [7], [0.6])):
        drafter.observe(sample, [9, 4] + tail, [0.5, 0.8] + probs)
    drafter.observe(0, [9, 4], [0.5, 0.8])
    tree = propose(drafter, 0, budget=3)
    assert tree.tokens == [5, 6, 7] and tree.parents == [-1, 0, -1]  # by weight: 1.8, 0.9, 0.6
    assert tree.confidence == pytest.approx([2 / 3 * 0.9, 0.5, 1 / 3 * 0.6])
    assert tree.evidence == [4, 4, 4]

    prompt_only = consensus()
    prompt_only.add_group(0, [1, 2, 3, 1, 2], [0])
    tree = propose(prompt_only, 0, budget=1)  # "1 2" is followed by 3 in the prompt
    assert tree.tokens == [3] and tree.confidence == [0.5] and tree.evidence == [2]


def test_subtree_reindexes_parents_and_keeps_scores():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1], None, [0.9, 0.8, 0.7, 0.6], [4, 3, 2, 1])
    sub = tree.subtree([0, 1, 3])
    assert sub.tokens == [5, 6, 8] and sub.parents == [-1, 0, 1]
    assert sub.confidence == [0.9, 0.8, 0.6] and sub.evidence == [4, 3, 1]
    assert tree.subtree([]) == DraftTree.EMPTY and tree.subtree([0, 1, 2, 3]) is tree


def test_soft_votes_draft_what_the_sources_distributions_favour():
    """One sibling sampled 5 although the target gave it 0.1 and gave 7 0.8: with its alternatives
    kept the draft is 7 (nobody sampled it), without them 5; the first match copies 5 as it is."""
    def drafter(**options):
        d = consensus(**options)
        d.add_group(0, [100], [0, 1])
        d.observe(0, [1, 2, 3])
        d.observe(1, [1, 2, 3, 5, 6], [0.9, 0.9, 0.9, 0.1, 0.9],
                  [([1], [0.9]), ([2], [0.9]), ([3], [0.9]), ([7, 5, 8], [0.8, 0.1, 0.05]), ([6], [0.9])])
        return d

    assert propose(drafter(), 0, budget=1).tokens == [7]
    assert propose(drafter(alternatives=0), 0, budget=1).tokens == [5]
    assert propose(drafter(aggregate=False), 0, budget=1).tokens == [5]
    tree = propose(drafter(), 0, budget=3)  # by weight: 7 (0.8), 5 (0.1), 5 -> 6 (0.09), not 8 (0.05)
    assert tree.tokens == [7, 5, 6] and tree.parents == [-1, -1, 1]


def test_confidence_mixes_the_sources_distributions():
    """Source 1 took 5 (p 0.6; 7 had 0.3), source 2 took 7 (p 0.5; 5 had 0.4): the confidence in
    a token is the mean of the two sources' probabilities of it, 0.5 for 5 and 0.4 for 7."""
    drafter = consensus(max_nodes=8)
    drafter.add_group(0, [100], [0, 1, 2])
    drafter.observe(0, [9, 4], [0.5, 0.5])
    drafter.observe(1, [9, 4, 5], [0.5, 0.5, 0.6], [None, None, ([5, 7], [0.6, 0.3])])
    drafter.observe(2, [9, 4, 7], [0.5, 0.5, 0.5], [None, None, ([7, 5], [0.5, 0.4])])
    tree = propose(drafter, 0, budget=2)
    assert sorted(zip(tree.tokens, tree.confidence)) == [(5, pytest.approx(0.5)), (7, pytest.approx(0.4))]


def test_alternatives_are_checked_against_the_tokens():
    drafter = group(consensus(), [[1]])
    with pytest.raises(ValueError, match="alternatives"):
        drafter.observe(0, [2, 3], [0.5, 0.5], [([2], [0.5])])


def test_ngram_keeps_no_alternatives():
    drafter = make_drafter("ngram", vocab_size=V, max_depth=4, max_nodes=8)
    drafter.add_group(0, [100], [0])
    drafter.observe(0, [1, 2, 5, 1, 2], [0.5] * 5, [([t, 9], [0.5, 0.4]) for t in (1, 2, 5, 1, 2)])
    assert propose(drafter, 0).tokens == [5, 1, 2]
