"""The engine's request API on the tiny successor model: add, step, abort, output kinds, queueing,
failures that stay with their request, and the seams benchmarks use."""

from __future__ import annotations

import pytest

from multispec import RequestOutputKind, SamplingParams, SpecConfig
from multispec.drafters import DRAFTERS, ConsensusDrafter
from multispec.engine import EngineConfig, LLMEngine, StepReport
from multispec.engine.cache import kv_bytes_per_token
from tests.tiny_models import chain, cycle_start

SPEC = SpecConfig(drafter="consensus", max_draft_tokens=3, max_draft_nodes=3, adaptive=False)


@pytest.fixture
def engine(tiny):
    """The shared tiny engine, left without requests whatever the test did."""
    yield tiny.engine
    for request_id in list(tiny.engine.requests):
        tiny.engine.abort(request_id)


@pytest.fixture
def prompt(tiny):
    return chain(tiny_successor(tiny), cycle_start(tiny_successor(tiny)), 16)


def tiny_successor(llm) -> list[int]:
    """The successor map, read back from the model: argmax of each token's head row direction."""
    if not hasattr(llm, "_successor"):
        embedding, head = llm.model.model.embed_tokens.weight, llm.model.output_weight()
        llm._successor = (embedding @ head.T).argmax(-1).tolist()
    return llm._successor


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until idle; every output of every request, in order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def params(**options) -> SamplingParams:
    return SamplingParams(**{"n": 4, "temperature": 1.0, "max_tokens": 20, "ignore_eos": True, "seed": 3, **options})


def test_step_reports_changed_requests_until_finished(engine, prompt):
    assert engine.step() == [] and not engine.has_unfinished_requests()
    engine.add_request("a", prompt, params())
    outputs = run(engine)["a"]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    lengths = [[len(c.token_ids) for c in o.outputs] for o in outputs]
    assert lengths[0] == [2] * 4 and lengths[-1] == [20] * 4  # a step: the prefill token and one decode step
    assert all(c.finish_reason is None for c in outputs[0].outputs)
    assert {c.finish_reason for c in outputs[-1].outputs} == {"length"}
    assert outputs[-1].metrics.sample_steps == 4 * 19 and outputs[-1].metrics.decode_steps == 19


def test_delta_outputs_add_up_to_the_cumulative_ones(engine, prompt):
    engine.add_request("c", prompt, params(stop=["zz"]), SPEC)
    engine.add_request("d", prompt, params(stop=["zz"]), SPEC, output_kind=RequestOutputKind.DELTA)
    seen = run(engine)
    final = {c.index: c for c in seen["c"][-1].outputs}
    tokens: dict[int, list] = {i: [] for i in range(4)}
    text = dict.fromkeys(range(4), "")
    finishes = []
    for out in seen["d"]:
        for c in out.outputs:
            tokens[c.index] += c.token_ids
            text[c.index] += c.text
            if c.finish_reason is not None:
                finishes.append(c.index)
    assert sorted(finishes) == [0, 1, 2, 3]  # each sample's finish once
    assert tokens == {i: final[i].token_ids for i in range(4)}
    assert text == {i: final[i].text for i in range(4)}


def test_final_only_reports_once(engine, prompt):
    engine.add_request("f", prompt, params(), output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = run(engine)["f"]
    assert len(outputs) == 1 and outputs[0].finished


def test_bad_requests_are_refused_when_added(engine, prompt):
    engine.add_request("x", prompt, params())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompt, params())
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(7, prompt, params())
    with pytest.raises(ValueError, match="index=4"):
        engine.abort_sample("x", 4)
    engine.abort("no-such-request")  # a no-op, as in vLLM
    engine.abort_sample("no-such-request", 0)


def test_a_request_that_never_fits_is_refused_before_anything_runs(tiny, prompt):
    small = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(256, 200 * kv_bytes_per_token(tiny.config, tiny.engine.dtype)))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        small.add_request("big", prompt, params(n=16))
    assert not small.has_unfinished_requests() and small.cache.shape is None


def test_abort_frees_the_slots_at_once(engine, prompt):
    engine.add_request("a", prompt, params(n=6, max_tokens=60))
    engine.add_request("b", prompt, params(n=2, max_tokens=60))
    engine.step()
    engine.step()
    assert len(engine.scheduler.slots) == 8
    engine.abort("a")
    assert len(engine.scheduler.slots) == 2 and list(engine.requests) == ["b"]
    assert all(s.request.request_id == "b" for s in engine.scheduler.slots)
    assert list(run(engine)) == ["b"]


def test_abort_of_a_waiting_request_takes_it_off_the_queue(engine, prompt):
    engine.add_request("w", prompt, params())
    engine.abort("w")
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_abort_sample_stops_one_sample_and_the_others_go_on(engine, prompt):
    engine.add_request("s", prompt, params(n=4, max_tokens=30))
    engine.step()
    engine.abort_sample("s", 2)
    assert len(engine.scheduler.slots) == 3
    engine.abort_sample("s", 2)  # already finished: nothing happens
    final = run(engine)["s"][-1]
    reasons = {c.index: c.finish_reason for c in final.outputs}
    assert reasons == {0: "length", 1: "length", 2: "abort", 3: "length"}
    assert len(final.outputs[2].token_ids) < 30


def test_abort_sample_before_admission(engine, prompt):
    engine.add_request("early", prompt, params(n=3))
    engine.abort_sample("early", 0)
    final = run(engine)["early"][-1]
    assert [c.finish_reason for c in final.outputs] == ["abort", "length", "length"]
    assert final.outputs[0].token_ids == []


def test_requests_queue_and_match_what_they_give_with_room(tiny, engine, prompt):
    """Capped to about one request at a time, requests wait and are admitted as slots free up; each
    gives the samples it gives with room for all."""
    requests = [(f"q{i}", chain(tiny_successor(tiny), 10 + i, 5 + i), params(n=4, seed=i)) for i in range(5)]
    for request_id, ids, sp in requests:
        engine.add_request(request_id, ids, sp, SPEC)
    free = run(engine)
    per_token = kv_bytes_per_token(tiny.config, tiny.engine.dtype)
    small = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(256, int(1.5 * (4 * 24 + 10) * per_token)))
    for request_id, ids, sp in requests:
        small.add_request(request_id, ids, sp, SPEC)
    queued = run(small)
    assert small.stats.prefill_forwards == 5
    for request_id, _, _ in requests:
        assert [c.token_ids for c in queued[request_id][-1].outputs] == [c.token_ids for c in free[request_id][-1].outputs]


def test_stop_strings_end_samples_at_the_same_token_with_and_without_speculation(tiny, engine, prompt):
    """A stop string found in the middle of a step's accepted tokens ends the sample at the token
    that completes it, as plain decoding does; the text stops before it."""
    plain = tiny.generate([prompt], params(n=8, max_tokens=40), use_tqdm=False)[0].outputs
    stop = plain[0].text[5:8]
    assert stop
    want = tiny.generate([prompt], params(n=8, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs
    got = tiny.generate([prompt], params(n=8, max_tokens=40, stop=[stop]), SPEC, use_tqdm=False)[0].outputs
    assert tiny.last_stats.accepted_tokens > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert want[0].finish_reason == "stop" and want[0].stop_reason == stop and stop not in want[0].text


class Failing(ConsensusDrafter):
    """Raises when asked for drafts for (``fail_in`` "propose") or told a decode step's tokens of
    (``fail_in`` "observe") any sample of its second prompt group: the engine asks for a lane's
    samples in one call, and again request by request when that call raises; it tells each
    request's samples in one call."""

    fail_in = "propose"

    def propose(self, sample_ids, budgets, uniforms=None):
        if self.fail_in == "propose" and max(sample_ids) >= self.fail_from:
            raise RuntimeError("drafter broke")
        return super().propose(sample_ids, budgets, uniforms)

    def observe(self, sample_id, new_tokens, token_probs=None, alternatives=None):
        told = self.__dict__.setdefault("told", set())
        if self.fail_in == "observe" and sample_id >= self.fail_from and sample_id in told:
            raise RuntimeError("drafter broke")  # in a decode step's commit, not the prefill's
        told.add(sample_id)
        super().observe(sample_id, new_tokens, token_probs, alternatives)


@pytest.mark.parametrize("fail_in", ["propose", "observe"])
def test_a_failing_request_ends_with_its_error_and_the_others_complete(engine, prompt, monkeypatch, fail_in):
    monkeypatch.setitem(DRAFTERS, "failing", Failing)
    monkeypatch.setattr(Failing, "fail_in", fail_in)
    spec = SpecConfig(drafter="failing", max_draft_tokens=3, max_draft_nodes=3, adaptive=False)
    monkeypatch.setattr(Failing, "fail_from", engine._next_sample_id + 4, raising=False)  # the second request's
    engine.add_request("ok", prompt, params(), spec)
    engine.add_request("bad", prompt, params(seed=4), spec)
    seen = run(engine)
    bad, ok = seen["bad"][-1], seen["ok"][-1]
    assert bad.finished and "drafter broke" in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"abort"}
    assert ok.error is None and [len(c.token_ids) for c in ok.outputs] == [20] * 4
    engine.add_request("plain", prompt, params())
    assert [c.token_ids for c in run(engine)["plain"][-1].outputs] == [c.token_ids for c in ok.outputs]


class FailingTogether(ConsensusDrafter):
    """Raises when asked for two requests' samples in one call, never for one request's alone."""

    def propose(self, sample_ids, budgets, uniforms=None):
        if max(sample_ids) - min(sample_ids) >= 4:
            raise RuntimeError("drafter broke on the batch")
        return super().propose(sample_ids, budgets, uniforms)


def test_a_drafter_failing_only_on_the_whole_batch_is_reported_once(engine, prompt, monkeypatch):
    """No request fails alone, so every request completes (drafting request by request), and the
    error is shown once as a warning rather than passing unseen."""
    import warnings

    monkeypatch.setitem(DRAFTERS, "failing-together", FailingTogether)
    spec = SpecConfig(drafter="failing-together", max_draft_tokens=3, max_draft_nodes=3, adaptive=False)
    engine.add_request("a", prompt, params(), spec)
    engine.add_request("b", prompt, params(seed=4), spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = run(engine)
    shown = [w for w in caught if "drafter broke on the batch" in str(w.message)]
    assert len(shown) == 1 and "'failing-together'" in str(shown[0].message)
    for name in "ab":
        assert seen[name][-1].error is None and [len(c.token_ids) for c in seen[name][-1].outputs] == [20] * 4
    assert engine.stats.accepted_tokens > 0


class FailingAtAdmission(ConsensusDrafter):
    """Raises when told about a prompt whose first token is 399 (a request's prefill bookkeeping)."""

    def add_group(self, group_id, prompt_ids, sample_ids):
        if prompt_ids[0] == 399:
            raise ValueError("cannot index this prompt")
        super().add_group(group_id, prompt_ids, sample_ids)


def test_a_request_failing_in_its_prefill_fails_alone(engine, prompt, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "failing-at-admission", FailingAtAdmission)
    spec = SpecConfig(drafter="failing-at-admission", max_draft_tokens=3, max_draft_nodes=3, adaptive=False)
    engine.add_request("good", prompt, params(), spec)
    engine.add_request("bad", [399] + prompt, params(), spec)
    seen = run(engine)
    assert "cannot index this prompt" in seen["bad"][-1].error and seen["bad"][-1].finished
    assert seen["good"][-1].error is None and [len(c.token_ids) for c in seen["good"][-1].outputs] == [20] * 4
    assert not engine.scheduler.slots and not engine.requests


def test_step_observers_see_every_decode_step(engine, prompt):
    reports: list[StepReport] = []
    engine.step_observers.append(reports.append)
    try:
        engine.add_request("o", prompt, params(n=2, max_tokens=10), SPEC)
        run(engine)
    finally:
        engine.step_observers.remove(reports.append)
    assert reports and all(len(r.samples) == len(r.trees) == len(r.results) for r in reports)
    assert sum(len(t.tokens) for report in reports for t in report.trees) > 0
    assert all(r.time_forward > 0 for r in reports)
