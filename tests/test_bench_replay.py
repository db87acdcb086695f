"""``benchmarks/bench_replay.py``: its recordings hold what the engine hands a drafter at every
position, and its replay and coverage run on the drafters as the engine builds them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_replay  # noqa: E402


def test_a_recording_holds_the_likeliest_tokens_at_every_position(llm):
    # Past the budget's idle stretch (8 steps) too: a recording made under the adaptive budget
    # lost them there, and the soft votes it replays with.
    groups = bench_replay.record(1, 2, 0.7, 24, 0, llm=llm)
    samples = groups[0]["samples"]
    assert len(samples) == 2 and all(len(s["tokens"]) > 12 for s in samples)
    for sample in samples:
        assert len(sample["alternatives"]) == len(sample["tokens"]) == len(sample["probs"])
        for token, prob, (tokens, probs) in zip(sample["tokens"], sample["probs"], sample["alternatives"]):
            assert len(tokens) == bench_replay.RECORDED_ALTERNATIVES
            assert probs == sorted(probs, reverse=True) and probs[0] >= prob - 1e-6
            assert token not in tokens or abs(probs[tokens.index(token)] - prob) < 1e-5


def synthetic(samples: int = 4, length: int = 40, seed: int = 0) -> list[dict]:
    """One group of siblings that mostly write one text, a phrase of 8 tokens over and over: each
    token taken from it, one in four a token of the sample's own; the target's likeliest tokens
    put the shared one first."""
    import random

    rng = random.Random(seed)
    phrase = rng.sample(range(5, 30), 8)
    shared = [phrase[i % len(phrase)] for i in range(length)]
    group = {"prompt": [1, 2, 3], "samples": []}
    for _ in range(samples):
        tokens = [t if rng.random() < 0.75 else rng.randrange(30, 60) for t in shared]
        probs = [0.7 if t == s else 0.1 for t, s in zip(tokens, shared)]
        alternatives = [[[s, t] if t != s else [s, 60], [0.7, 0.1]] for t, s in zip(tokens, shared)]
        group["samples"].append({"tokens": tokens, "probs": probs, "alternatives": alternatives})
    return [group]


def test_replay_advances_by_what_the_text_follows():
    groups = synthetic()
    plain = bench_replay.replay(groups, "consensus", 1, 0)
    assert plain["tau"] == 1.0  # no draft nodes: one token a step
    drafted = bench_replay.replay(groups, "consensus", 4, 4)
    assert 1.2 < drafted["tau"] < 5 and 0 < drafted["acceptance"] < 1


def test_coverage_reads_the_sources_of_the_drafter_it_replays():
    shares = bench_replay.coverage(synthetic())
    assert all(0.0 <= value <= 1.0 for value in shares.values())
    assert shares["next token offered"] > 0.3  # the phrase repeats, three tokens in four as it goes
    assert shares["offered with alternatives"] >= shares["next token offered"]
    assert abs(shares["p(likeliest)"] - 0.7) < 1e-9 and shares["p(likeliest)"] >= shares["p(sampled)"]
