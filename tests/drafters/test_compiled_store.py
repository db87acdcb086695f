"""The compiled suffix store drafts exactly what the Python path drafts.

Both paths are driven through the same random histories (groups of samples appending tokens with
known, unknown and missing probabilities and with soft alternatives, proposals at random budgets,
samples retired while their siblings go on) and every proposed tree must be equal node for node:
tokens, parents, and the confidence and evidence the budget ranks nodes by, compared as exact
floats. Small vocabularies make the texts repeat, so the index's trimming of old occurrences, ties
between equally heavy nodes and long matches are all exercised.
"""

import random

import pytest

from multispec import kernels
from multispec.drafters import make_drafter
from multispec.drafters.index import UNKNOWN

pytestmark = pytest.mark.skipif(kernels.suffix_store() is None, reason="the compiled suffix store cannot be built here")


def pair(monkeypatch, kind, **options):
    compiled = make_drafter(kind, **options)
    monkeypatch.setenv("MULTISPEC_KERNELS", "0")
    python = make_drafter(kind, **options)
    monkeypatch.delenv("MULTISPEC_KERNELS")
    assert compiled.compiled and not python.compiled
    return compiled, python


def history(rng, vocab, groups, steps):
    """Calls (name, args) of a random drafting history."""
    calls, live, next_id = [], [], 0
    for group in range(groups):
        ids = list(range(next_id, next_id + rng.randint(1, 6)))
        next_id += len(ids)
        calls.append(("add_group", (group, [rng.randrange(vocab) for _ in range(rng.randint(0, 12))], ids)))
        live += ids
    for _ in range(steps):
        ids = rng.sample(live, rng.randint(1, len(live)))
        calls.append(("propose", (ids, [rng.randint(0, 12) for _ in ids])))
        tokens, probs, alternatives = [], [], []
        for _ in ids:
            count = rng.randint(1, 4)
            tokens.append([rng.randrange(vocab) for _ in range(count)])
            kind = rng.random()
            probs.append(None if kind < 0.15 else
                         [UNKNOWN if rng.random() < 0.1 else rng.choice([1.0, rng.random()]) for _ in range(count)])
            width = min(5, vocab)
            if rng.random() < 0.2:
                alternatives.append(None)
            else:
                alternatives.append([None if rng.random() < 0.3 else
                                     (rng.sample(range(vocab), width), sorted((rng.random() ** 2 for _ in range(width)), reverse=True))
                                     for _ in range(count)])
        if rng.random() < 0.5:
            calls.append(("observe_many", (ids, tokens, probs, alternatives)))
        else:
            calls += [("observe", each) for each in zip(ids, tokens, probs, alternatives)]
        if rng.random() < 0.1 and len(live) > 1:
            gone = live.pop(rng.randrange(len(live)))
            calls.append(("remove", (gone,)))
    calls.append(("propose", (live, [12] * len(live))))
    return calls


@pytest.mark.parametrize("kind, options", [
    ("consensus", {}),
    ("consensus", {"max_ngram": 3, "min_ngram": 2}),
    ("consensus", {"aggregate": False}),
    ("consensus", {"alternatives": 2}),
    ("consensus", {"alternatives": 0}),
    ("ngram", {}),
])
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_store_proposes_the_python_trees(monkeypatch, kind, options, seed):
    rng = random.Random(seed)
    compiled, python = pair(monkeypatch, kind, vocab_size=12, max_depth=rng.choice([2, 4, 6]), max_nodes=10, **options)
    proposals = 0
    for name, args in history(rng, vocab=rng.choice([4, 8, 12]), groups=rng.randint(1, 3), steps=60):
        got, want = getattr(compiled, name)(*args), getattr(python, name)(*args)
        if name != "propose":
            continue
        for a, b in zip(got, want, strict=True):
            assert (a.tokens, a.parents, a.q) == (b.tokens, b.parents, b.q)
            assert a.confidence == b.confidence and a.evidence == b.evidence
            proposals += bool(b.tokens)
    assert proposals > 20  # the histories draft, not just return empty trees


def test_the_compiled_store_keeps_the_python_errors(monkeypatch):
    for drafter in pair(monkeypatch, "consensus", vocab_size=12, max_depth=4, max_nodes=8):
        drafter.add_group(0, [1, 2], [0, 1])
        with pytest.raises(ValueError, match=r"sample ids already live: \[1\]"):
            drafter.add_group(1, [1], [1, 2])
        with pytest.raises(ValueError, match="2 tokens but 1 probabilities"):
            drafter.observe(0, [3, 4], [0.5])
        with pytest.raises(ValueError, match="1 tokens but 2 sets of alternatives"):
            drafter.observe(0, [3], [0.5], [None, None])
        with pytest.raises(KeyError):
            drafter.observe(7, [3])
        with pytest.raises(KeyError):
            drafter.propose([7], [4])
        drafter.remove(7)  # unknown ids are ignored, as for the Python path
        drafter.remove(1)
        drafter.add_group(1, [5], [1])  # a retired sample's id may be used again


def test_a_store_that_cannot_be_built_leaves_the_python_path_with_one_warning(monkeypatch):
    def broken():
        raise RuntimeError("no compiler\nninja: error: something")

    monkeypatch.setattr(kernels, "_load_store", broken)
    monkeypatch.setattr(kernels, "_state", {k: v for k, v in kernels._state.items() if k != "store built"})
    monkeypatch.setattr(kernels, "_handles", {k: v for k, v in kernels._handles.items() if k != "suffix_store"})
    with pytest.warns(RuntimeWarning, match="suffix store could not be built.*ninja: error: something"):
        drafter = make_drafter("consensus", vocab_size=12, max_depth=4, max_nodes=8)
    assert not drafter.compiled
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not per drafter
        again = make_drafter("consensus", vocab_size=12, max_depth=4, max_nodes=8)
    assert not again.compiled
    drafter.add_group(0, [1, 2], [0, 1])
    drafter.observe(0, [3, 4, 5])
    drafter.observe(1, [3, 4, 5, 6])
    drafter.observe(0, [3, 4])
    assert drafter.propose([0], [2])[0].tokens == [5, 6]
