"""The arithmetic of ``benchmarks/bench_ceiling.py``: the target's greedy chain in replay, and which
steps its cost timing keeps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_ceiling  # noqa: E402


def _sample(tokens: list[int], top: list[int]) -> dict:
    return {"tokens": tokens, "alternatives": [[[t, 9], [0.6, 0.1]] for t in top]}


def test_greedy_chain_advances_while_the_sample_takes_the_most_likely_token():
    # Position 0 comes from the prefill; from 1 on, the sample took the top token at 1, 2, 4, 5, 6.
    sample = _sample([5, 1, 2, 7, 4, 5, 6], [5, 1, 2, 3, 4, 5, 6])
    groups = [{"prompt": [0], "samples": [sample]}]
    # L = 1: steps at 1 (hit, +2), 3 (miss, +1), 4 (hit, +2), 6 (hit, capped at the end, +2 counted).
    assert bench_ceiling.greedy_tau(groups, 1) == (2 + 1 + 2 + 2) / 4
    # L = 4: at 1, hits 1 and 2 then misses 3 (+3); at 4, hits 4, 5, 6 and the text ends (+4).
    assert bench_ceiling.greedy_tau(groups, 4) == (3 + 4) / 2
    assert bench_ceiling.greedy_tau(groups, 0) == 1.0


def test_split_groups_makes_sibling_groups_of_n():
    groups = [{"prompt": [1], "samples": list(range(16))}]
    split = bench_ceiling.split_groups(groups, 4)
    assert [g["samples"] for g in split] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert all(g["prompt"] == [1] for g in split)


def test_step_timing_cycles_lengths_after_the_plain_steps_and_skips_cut_chains():
    from types import SimpleNamespace

    bench_ceiling.FillerDrafter.lengths, bench_ceiling.FillerDrafter.warm = [0, 2], 2
    drafter = bench_ceiling.FillerDrafter.create()
    sizes = []
    for budgets, seconds in (([4, 4], 9), ([4, 4], 9), ([4, 4], 1), ([4, 4], 2), ([4, 4], 0.5), ([1, 4], 9),
                             ([4, 4], 1)):
        trees = drafter.propose([0, 1], budgets)
        sizes.append([len(tree) for tree in trees])
        drafter.observe_step(SimpleNamespace(trees=trees, time_draft=0.0, time_forward=seconds, time_verify=0.0,
                                             time_commit=0.0))
    # Two plain warm-up steps (not timed), then L = 0, 2, 0, 2 (cut short by a budget: not timed), 0.
    assert sizes == [[0, 0], [0, 0], [0, 0], [2, 2], [0, 0], [0, 2], [0, 0]]
    assert drafter.step_seconds() == {0: 2.5 / 3, 2: 2.0}
