"""Vote, the early-stop rules, pass@k and Best-of-N scorers against hand-computed cases."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from multispec.reasoning.best_of_n import best_of_n, make_scorer, mean_logprob
from multispec.reasoning.early_stop import BetaRule, WindowRule, parse_early_stop, replay
from multispec.reasoning.passk import check_ks, pass_at_k
from multispec.reasoning.runner import Completion
from multispec.reasoning.tasks import Problem, make_task
from multispec.reasoning.vote import group_answers, majority_vote, tally


def test_vote_counts_answers_and_skips_samples_without_one():
    assert majority_vote(["3", None, "4", "3"]) == ("3", 2)
    assert majority_vote([None, None]) == (None, 0)


def test_vote_ties_go_to_the_lowest_sample_index():
    assert majority_vote(["5", "7", "7", "5"]) == ("5", 2)
    assert majority_vote([None, "7", "5", "5", "7"]) == ("7", 2)


def test_weighted_vote_and_equivalent_answers():
    assert majority_vote(["a", "b", "b"], weights=[0.9, 0.4, 0.4]) == ("a", 0.9)
    same_number = lambda x, y: float(x) == float(y)  # noqa: E731
    assert group_answers(["0.5", "2", ".50", None], same_number) == [0, 1, 0, None]
    assert tally(["0.5", "2", ".50"], equivalent=same_number) == [("0.5", 2), ("2", 1)]
    assert majority_vote(["2", "0.5", ".50"], equivalent=same_number) == ("0.5", 2)


def test_beta_rule_against_the_closed_form():
    # P(p > 1/2) for p ~ Beta(a, 1) is 1 - 2^-a; for Beta(v1+1, v2+1) it is the chance that v1+v2+1
    # fair coin flips show more than v2 heads: Beta(6, 2) -> 1 - 8/128, Beta(7, 2) -> 1 - 9/256.
    assert BetaRule.confidence(3, 0) == pytest.approx(1 - 2 ** -4)
    assert BetaRule.confidence(4, 0) == pytest.approx(1 - 2 ** -5)
    assert BetaRule.confidence(5, 1) == pytest.approx(1 - 8 / 128)
    assert BetaRule.confidence(6, 1) == pytest.approx(1 - 9 / 256)
    rule = BetaRule()
    assert not rule.should_stop(["a", "a", "a"]) and rule.should_stop(["a", "a", None, "a", "a"])
    assert not rule.should_stop(list("aabaaa")) and rule.should_stop(list("aabaaaa"))
    assert not rule.should_stop([None] * 10)
    assert BetaRule(0.9).should_stop(list("aaa"))  # 0.9375
    assert rule.should_stop(["1", "1.0", "1", "1"], equivalent=lambda x, y: float(x) == float(y))


def test_esc_window_rule():
    rule = WindowRule(3)
    assert not rule.should_stop(["1", "2", "2"]) and rule.should_stop(["1", "2", "2", "2"])
    assert not rule.should_stop(["2", "2", None, "2"]) and not rule.should_stop(["2", "2"])
    assert not rule.should_stop([None, None, None])
    assert WindowRule(1).should_stop(["x"])


@pytest.mark.parametrize("spec, rule", [
    ("beta:0.95", BetaRule(0.95)), ("beta", BetaRule()), ("beta:0.8", BetaRule(0.8)), ("esc:5", WindowRule(5)),
    ("esc", WindowRule(5)), ("none", None)])
def test_early_stop_specs(spec, rule):
    assert parse_early_stop(spec) == rule


def test_replay_concurrent_schedule_cuts_the_longer_samples_where_they_are():
    # Finishing order by length: c (2), a (3), b (3, same step as a), e (5), d (9). ESC with a
    # window of 2 fires when a finishes (c, a agree); b finishes in that step too and votes.
    answers, lengths = ["7", "8", "7", "9", "9"], [3, 3, 2, 9, 5]
    r = replay(WindowRule(2), answers, lengths)
    assert (r.finished, r.tokens, r.vote, r.stopped) == (3, 3 + 3 + 2 + 3 + 3, "7", True)
    full = replay(None, answers, lengths)
    assert (full.finished, full.tokens, full.vote, full.stopped) == (5, 22, "7", False)
    # A rule that never fires, and one that would only fire on the last sample: nothing is cut.
    assert replay(WindowRule(5), answers, lengths) == full
    assert replay(WindowRule(4), ["1"] * 4 + ["2"], [1, 2, 3, 5, 4]).finished == 5


def test_replay_sequential_schedule_and_the_vote_over_finished_samples():
    answers, lengths = ["5", "6", "6", "6", "5"], [10, 20, 30, 40, 50]
    r = replay(WindowRule(2), answers, lengths, schedule="sequential", order=[4, 0, 1, 2, 3])
    assert (r.finished, r.tokens, r.vote) == (2, 60, "5")  # 5, 5: stop; tokens of samples 4 and 0
    r = replay(WindowRule(2), answers, lengths, schedule="sequential")  # index order: 5, 6, 6
    assert (r.finished, r.tokens, r.vote) == (3, 60, "6")
    # Ties go to the lowest finished index, whatever the finishing order.
    r = replay(WindowRule(3), ["6", "5", "5", "6"], [1, 1, 1, 1], schedule="sequential", order=[3, 1, 0, 2])
    assert (r.finished, r.vote) == (4, "6")


@pytest.mark.parametrize("kwargs, message", [
    ({"lengths": [1, 2]}, "3 answers but 2 lengths"), ({"schedule": "batched"}, "schedule 'batched'"),
    ({"order": [0, 0, 1]}, "each of the 3 samples once")])
def test_replay_bad_input(kwargs, message):
    options = {"lengths": [1, 2, 3], **kwargs}
    lengths = options.pop("lengths")
    with pytest.raises(ValueError, match=message):
        replay(BetaRule(), ["1", "1", "2"], lengths, **options)


@pytest.mark.parametrize("spec", ["beta:1.5", "beta:0", "beta:x", "esc:0", "esc:2.5", "window:3", "none:1", ""])
def test_bad_early_stop_specs(spec):
    with pytest.raises(ValueError, match="early stop"):
        parse_early_stop(spec)


@pytest.mark.parametrize("n", [1, 4, 10])
def test_pass_at_k_matches_brute_force_enumeration(n):
    for correct in range(n + 1):
        outcomes = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(combinations(outcomes, k))
            assert pass_at_k(n, correct, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow():
    n, correct, k = 2000, 3, 10
    assert pass_at_k(n, correct, k) == pytest.approx(1 - math.comb(n - correct, k) / math.comb(n, k), rel=1e-12)
    assert 0 < pass_at_k(5000, 1, 1) == pytest.approx(1 / 5000)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"k=10: .*--n 8"):
        check_ks([1, 10], 8)
    assert check_ks(None, 8) == [1, 5] and check_ks([5, 1, 5], 8) == [1, 5]


def completions(*pairs):
    return [Completion(i, text, tokens, logprob, "stop", text) for i, (text, tokens, logprob) in enumerate(pairs)]


def user_scorer(problem, sample):
    """Best-of-N's user callable in these tests: the longer the text, the better."""
    return len(sample.text)


PROBLEM = Problem("p", "q", "r", ())


def test_best_of_n_with_the_mean_logprob_and_a_user_callable():
    samples = completions(("short", 2, -1.0), ("longest", 10, -3.0), ("tie", 2, -1.0), ("empty", 0, 0.0))
    assert mean_logprob(PROBLEM, samples[1]) == -0.3 and mean_logprob(PROBLEM, samples[3]) == -math.inf
    task = make_task("gsm8k")
    assert best_of_n(PROBLEM, samples, make_scorer("auto", task)) == (1, [-0.5, -0.3, -0.5, -math.inf])
    assert best_of_n(PROBLEM, samples[::2], make_scorer("logprob", task))[0] == 0  # a tie: the first
    assert best_of_n(PROBLEM, samples, make_scorer(f"{__name__}:user_scorer", task))[0] == 1
    assert best_of_n(PROBLEM, [], mean_logprob) == (None, [])


def test_best_of_n_code_scorer_is_the_fraction_of_tests_passed(monkeypatch):
    task = make_task("humaneval")
    fractions = {"good": (1.0, 0.1), "half": (0.5, 0.1)}
    monkeypatch.setattr(task, "fraction_passed", lambda problem, answer: fractions[answer])
    scorer = make_scorer("auto", task)
    assert best_of_n(PROBLEM, completions(("half", 1, 0.0), ("good", 1, -9.0)), scorer) == (1, [0.5, 1.0])


@pytest.mark.parametrize("name, message", [("tests", "needs a code task"), ("nope", "must be logprob"),
                                           ("json:nope", "cannot import"), ("math:pi", "not callable")])
def test_bad_scorers(name, message):
    with pytest.raises(ValueError, match=message):
        make_scorer(name, make_task("gsm8k"))
