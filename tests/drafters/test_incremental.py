"""A step must cost time in proportion to its new tokens, not to the length of the texts."""

import random
import statistics
import time

import pytest

from multispec.drafters import make_drafter
from multispec.drafters.index import NgramIndex, Text


def test_index_adds_only_the_new_ngrams():
    index = NgramIndex(1, 3, keep=8)
    text = Text([1, 2, 3])
    index.add(text, 1)
    assert index.recent((1, 2, 3)) == [(text, 3)]
    text.extend([1, 2], None)
    index.add(text, 4)
    assert index.recent((2,)) == [(text, 2), (text, 5)]
    assert index.recent((3, 1, 2)) == [(text, 5)]
    assert index.recent((1, 2, 3)) == [(text, 3)]


def test_occurrences_kept_per_ngram_are_bounded():
    index = NgramIndex(1, 2, keep=4)
    text = Text([7] * 1000)
    index.add(text, 1)
    assert index.recent((7,)) == [(text, end) for end in range(997, 1001)]
    assert len(index._table[(7,)]) <= 8


def step_time(drafter, samples, rng, steps=40) -> float:
    """Median seconds of one step: propose for every sample, then observe a few tokens each."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        drafter.propose(samples, [6] * len(samples), None)
        for sample in samples:
            new = [rng.randrange(30) for _ in range(3)]
            drafter.observe(sample, new, [0.5] * len(new))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.parametrize("kind", ["consensus", "ngram"])
def test_step_time_does_not_grow_with_text_length(kind):
    rng = random.Random(0)
    samples = list(range(16))
    drafter = make_drafter(kind, vocab_size=30, max_depth=6, max_nodes=6)
    drafter.add_group(0, [rng.randrange(30) for _ in range(50)], samples)
    for sample in samples:
        drafter.observe(sample, [rng.randrange(30) for _ in range(200)])
    short = step_time(drafter, samples, rng)
    for sample in samples:
        drafter.observe(sample, [rng.randrange(30) for _ in range(3800)])
    long = step_time(drafter, samples, rng)
    assert long < 3 * short + 1e-3
