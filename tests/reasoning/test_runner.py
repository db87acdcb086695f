"""Early stopping inside the engine loop on the tiny model: unfinished samples are really aborted,
fewer tokens are generated, and the vote is the fixed-n vote."""

from __future__ import annotations

import pytest

from multispec import SamplingParams
from multispec.reasoning.early_stop import BetaRule, WindowRule, replay
from multispec.reasoning.runner import generate
from multispec.reasoning.tasks.jsonl import Jsonl
from multispec.reasoning.vote import majority_vote
from tests.reasoning.conftest import ANSWER_REGEX, write_questions

# Ten of the 400 tokens end a sample: samples finish at spread-out steps, as real answers do.
PARAMS = SamplingParams(n=16, temperature=1.0, max_tokens=48, seed=0, stop_token_ids=list(range(5, 15)))


def run(llm, task, rule, **options):
    return sorted(generate(llm, task, task.problems(), PARAMS, rule=rule, **options), key=lambda g: g.position)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return Jsonl(write_questions(tmp_path_factory.mktemp("questions")), ANSWER_REGEX)


@pytest.fixture(scope="module")
def fixed(tiny, task):
    """Every sample run to its end, at most two questions' samples in flight: the generations and
    the samples of each decode step."""
    step_samples = []
    observe = lambda report: step_samples.append([s.request.request_id for s in report.samples])  # noqa: E731
    tiny.engine.step_observers.append(observe)
    try:
        return run(tiny, task, None, max_samples=2 * PARAMS.n), step_samples
    finally:
        tiny.engine.step_observers.remove(observe)


@pytest.mark.parametrize("rule", [BetaRule(), WindowRule(3)], ids=str)
def test_early_stop_aborts_unfinished_samples_and_keeps_the_vote(tiny, task, fixed, rule):
    fixed, _ = fixed
    early = run(tiny, task, rule)
    assert not tiny.engine.has_unfinished_requests() and not tiny.engine.scheduler.slots
    assert sum(g.tokens for g in early) < 0.8 * sum(g.tokens for g in fixed)
    for full, cut in zip(fixed, early):
        assert not full.stopped_early and cut.stopped_early
        votes = [majority_vote([s.answer for s in g.samples]) for g in (full, cut)]
        assert votes[0][0] == votes[1][0] == "8"
        answers = [cut.samples[i].answer for i in cut.finish_order]
        fired = next(m for m in range(1, len(answers) + 1) if rule.should_stop(answers[:m]))
        assert fired < PARAMS.n  # checked as each sample finished: it fired, then the rest were cut
        for sample, same in zip(cut.samples, full.samples):
            assert same.text.startswith(sample.text) and sample.tokens <= same.tokens
            if sample.finish_reason == "abort":
                assert sample.answer is None and sample.index not in cut.finish_order
            else:  # seeded: a finished sample is the fixed run's own
                assert (sample.text, sample.tokens, sample.finish_reason) == (
                    same.text, same.tokens, same.finish_reason)
        # ``replay`` (what benchmarks/early_stop_replay.py runs on saved results) predicts this run
        # from the fixed-n samples alone: which samples finished, the tokens and the vote. A sample
        # writes one token a step here (no drafts), so its concurrent schedule is exact; this fails
        # if it ordered finishes, cut tokens or counted same-step finishes otherwise than the runner.
        r = replay(rule, [s.answer for s in full.samples], [s.tokens for s in full.samples])
        assert r.stopped and r.finished == len(cut.finish_order) and r.tokens == cut.tokens
        assert r.vote == votes[1][0]


def test_questions_share_the_batch_up_to_max_samples(fixed):
    generations, step_samples = fixed
    assert max(len(ids) for ids in step_samples) <= 2 * PARAMS.n
    assert max(len(set(ids)) for ids in step_samples) >= 2  # questions side by side
    assert [g.position for g in generations] == [0, 1, 2, 3]
    assert all(len(g.finish_order) == PARAMS.n and g.seconds > 0 and g.error is None for g in generations)

