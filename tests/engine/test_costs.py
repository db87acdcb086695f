"""Step costs: the fit recovers a cost law from timings at the calibration's shapes, the
measurement runs the engine's own step without touching the engine's state, and the result is
cached per machine and model."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from multispec.engine import costs as costs_module
from multispec.engine.costs import (CONTEXT_BATCHES, DRAFT_BATCHES, DRAFT_LENGTHS, LONG_PROMPT, PLAIN_BATCHES,
                                    SHORT_PROMPT, Measurement, StepCosts, load_or_measure, work)


def law_measurements(base, per_work: float, extra) -> list[Measurement]:
    """What timing the calibration's shapes gives when a step costs ``base(tokens) + per_work *
    work + extra(batch)`` (the last only with drafts)."""
    extra = extra if callable(extra) else (lambda batch, value=extra: value)
    out = []
    for batch in PLAIN_BATCHES:
        lengths = (0, *DRAFT_LENGTHS) if batch in DRAFT_BATCHES else (0,)
        prompts = (SHORT_PROMPT, LONG_PROMPT) if batch in CONTEXT_BATCHES else (SHORT_PROMPT,)
        for prompt in prompts:
            for length in lengths if prompt == SHORT_PROMPT else (0,):
                tokens, qmax, context = batch * (1 + length), 1 + length, prompt + 8
                w = work(batch, qmax, context, batch if length else 0, tokens)
                seconds = base(tokens) + per_work * w + (extra(batch) if length else 0.0)
                out.append(Measurement(batch, tokens, w, bool(length), seconds))
    return out


def law_costs(base, per_work: float = 0.0, extra=0.0) -> StepCosts:
    return StepCosts.fit(law_measurements(base, per_work, extra))


def knee(tokens: int) -> float:
    """A CPU-like base: flat (overhead-bound) up to 32 tokens, then 1 ms a token."""
    return 0.04 + 0.001 * max(0, tokens - 32)


def test_the_fit_recovers_a_law_with_a_knee_attention_and_a_drafting_extra():
    costs = law_costs(knee, per_work=0.02, extra=lambda batch: 0.002 + 0.0001 * batch)
    assert costs.per_work == pytest.approx(0.02)
    for tokens in (1, 4, 16, 32, 64, 128, 256):
        assert costs.base_at(tokens) == pytest.approx(knee(tokens))
    assert costs.base_at(512) == pytest.approx(knee(512))  # past the last point: the last slope
    # A step shape the calibration never ran: 24 samples, 10 of them drafting 2 tokens, context 300.
    batch, tokens, qmax, drafting = 24, 44, 3, 10
    expected = knee(tokens) + 0.02 * work(batch, qmax, 300, drafting, tokens) + 0.002 + 0.0001 * batch
    assert costs.seconds(tokens, batch, qmax, 300, drafting) == pytest.approx(expected, rel=0.02)
    assert costs.seconds(24, 24, 1, 300) == pytest.approx(knee(24) + 0.02 * work(24, 1, 300))


def test_noise_never_makes_more_tokens_cheaper():
    measurements = law_measurements(knee, 0.0, 0.001)
    noisy = [Measurement(m.batch, m.tokens, m.work, m.drafting, m.seconds * (0.8 if m.tokens == 16 else 1.0))
             for m in measurements]
    costs = StepCosts.fit(noisy)
    assert costs.base == sorted(costs.base)
    assert costs.extra == sorted(costs.extra) and min(costs.extra) >= 0.0


def test_measuring_runs_every_shape_and_leaves_the_engine_as_it_was(tiny, monkeypatch):
    fitted = []
    monkeypatch.setattr(StepCosts, "fit", classmethod(lambda cls, ms: fitted.append(ms) or StepCosts([1], [1.0], 0.0,
                                                                                                      [1], [0.0])))
    engine = tiny.engine
    stats_before = (engine.stats.decode_forwards, engine.stats.generated_tokens)
    costs_module.measure(engine)
    (measurements,) = fitted
    shapes = {(m.batch, m.tokens, m.drafting) for m in measurements}
    expected_plain = {(b, b, False) for b in PLAIN_BATCHES}
    expected_drafting = {(b, b * (1 + L), True) for b in DRAFT_BATCHES for L in DRAFT_LENGTHS}
    assert expected_plain | expected_drafting <= shapes
    long_context = [m for m in measurements if m.batch in CONTEXT_BATCHES and not m.drafting]
    assert len(long_context) == 2 * len(CONTEXT_BATCHES)
    assert all(m.seconds > 0 for m in measurements)
    assert (engine.stats.decode_forwards, engine.stats.generated_tokens) == stats_before
    assert not engine.requests and not engine.lanes


def unknown_waits(monkeypatch) -> None:
    """The system says nothing about waiting for a core: what the machine did meanwhile cannot
    decide whether a test's prices are cached."""
    monkeypatch.setattr(costs_module, "core_wait", lambda: None)


def test_the_costs_are_cached_per_machine_and_model(tiny, tmp_path, monkeypatch, caplog):
    unknown_waits(monkeypatch)
    calls = []
    prices = StepCosts([1, 64], [0.01, 0.05], 0.001, [1, 64], [0.0, 0.002])
    monkeypatch.setattr(costs_module, "measure", lambda engine: calls.append(engine) or prices)
    engine = tiny.engine
    assert load_or_measure(engine, "model-a", tmp_path) == prices and len(calls) == 1
    (stored,) = (tmp_path / "step-costs").glob("*.json")
    key = json.loads(stored.read_text())["key"]
    assert key["model"] == "model-a" and key["dtype"] == "float32" and key["processor"]
    assert load_or_measure(engine, "model-a", tmp_path) == prices and len(calls) == 1  # from the cache
    load_or_measure(engine, "model-b", tmp_path)  # other weights: measured again, cached apart
    assert len(calls) == 2 and len(list((tmp_path / "step-costs").glob("*.json"))) == 2
    load_or_measure(engine, None, tmp_path)  # nothing names the weights: measured, never cached
    assert len(calls) == 3 and len(list((tmp_path / "step-costs").glob("*.json"))) == 2
    stored.write_text("{not json")  # a damaged file is measured again and rewritten
    assert load_or_measure(engine, "model-a", tmp_path) == prices and len(calls) == 4
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="multispec"):
        assert load_or_measure(engine, "model-a", blocked) == prices  # cannot write: still served
    assert "could not cache the step costs" in caplog.text


def test_the_engine_measures_once_and_only_for_an_adaptive_budget(successor_dir, tmp_path, monkeypatch):
    from multispec import LLM, SamplingParams, SpecConfig

    unknown_waits(monkeypatch)
    calls = []
    real = costs_module.measure
    monkeypatch.setattr(costs_module, "measure", lambda engine: calls.append(1) or real(engine))
    llm = LLM(str(successor_dir), dtype="float32", cache_dir=str(tmp_path), kv_cache_memory=0.01)
    params = SamplingParams(n=4, temperature=0.7, max_tokens=12, seed=0)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.generate([[5, 6, 7]], params, spec=SpecConfig(drafter="consensus", adaptive=False), use_tqdm=False)
    assert calls == []  # plain decoding and fixed drafts never price a step
    llm.generate([[5, 6, 7]], params, spec=SpecConfig(drafter="consensus"), use_tqdm=False)
    llm.generate([[5, 6, 7]], params, spec=SpecConfig(drafter="ngram"), use_tqdm=False)
    assert calls == [1]
    again = LLM(str(successor_dir), dtype="float32", cache_dir=str(tmp_path), kv_cache_memory=0.01)
    again.generate([[5, 6, 7]], params, spec=SpecConfig(drafter="consensus"), use_tqdm=False)
    assert calls == [1]  # the second engine on the same weights reads the cache
    assert again.engine.step_costs() == llm.engine.step_costs()


def test_prices_measured_on_a_busy_machine_are_used_but_not_cached(tiny, tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(costs_module, "measure",
                        lambda engine: calls.append(1) or StepCosts([1, 64], [0.01, 0.05], 0.001, [1], [0.0]))
    readings = []
    monkeypatch.setattr(costs_module, "core_wait", lambda: readings.pop(0))
    # Two threads; between the readings the second one starts. 2 s run in all, 0.5 s waited: 25%.
    readings += [{"1": (10**9, 10**8)}, {"1": (2 * 10**9, 4 * 10**8), "2": (10**9, 2 * 10**8)}]
    with caplog.at_level(logging.WARNING, logger="multispec"):
        busy = load_or_measure(tiny.engine, "model-a", tmp_path)
    assert busy.waited == pytest.approx(0.25) and busy.busy
    assert "the machine was busy" in caplog.text and "25%" in caplog.text
    assert not (tmp_path / "step-costs").exists()  # the next process measures again
    assert "waited for a core 25.0% of the time it ran" in busy.table()
    readings += [{"1": (0, 0)}, {"1": (10**9, 5 * 10**6)}]  # quiet: 0.5% waited, cached with its share
    quiet = load_or_measure(tiny.engine, "model-a", tmp_path)
    assert quiet.waited == pytest.approx(0.005) and not quiet.busy and len(calls) == 2
    assert load_or_measure(tiny.engine, "model-a", tmp_path) == quiet and len(calls) == 2  # from the cache
    readings += [{"1": (0, 0)}, {"1": (10**9, 5 * 10**8)}]  # busy, but asked to cache anyway
    kept = load_or_measure(tiny.engine, "model-a", tmp_path, refresh=True, even_if_busy=True)
    assert kept.busy and load_or_measure(tiny.engine, "model-a", tmp_path) == kept and len(calls) == 3


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or costs_module.core_wait() is None,
                    reason="needs Linux's per-thread scheduler statistics and CPU affinity")
def test_a_thread_sharing_its_core_with_a_spinning_process_is_seen_waiting():
    """What ``BUSY`` rests on, on the real scheduler: this thread and a process that spins, pinned to
    one core, each run about half the time, so the thread waits about as long as it runs (a
    measurement alone on its core waits almost nothing)."""
    allowed = os.sched_getaffinity(0)
    core = min(allowed)
    spinner = subprocess.Popen([sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{core}}})\n"
                                "end = time.monotonic() + 3\nwhile time.monotonic() < end: pass"])
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.3)  # the spinner is running on the core
        before = costs_module.core_wait()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        share = costs_module.waited_share(before, costs_module.core_wait())
    finally:
        os.sched_setaffinity(0, allowed)
        spinner.kill()
        spinner.wait()
    assert share is not None and share > 3 * costs_module.BUSY


def test_live_steps_correct_what_drafting_adds_to_a_step():
    from multispec.engine.costs import LIVE_BOUNDS, LIVE_MIN, Prices

    prices = Prices(law_costs(knee, per_work=0.01, extra=0.001))
    shape = dict(tokens=48, batch=16, qmax=4, context=200, drafting=8)
    measured = prices.costs.seconds(**shape)
    plain = prices.costs.seconds(16, 16, 1, 200, 0)
    increment = measured - plain
    assert increment > 0
    # The machine runs 1.5x slower than measured, and drafting adds twice its measured increment.
    for _ in range(LIVE_MIN - 1):  # too few steps of each kind: the measured price
        prices.record(1.5 * plain, 16, 16, 1, 200, 0)
        prices.record(1.5 * (plain + 2 * increment), **shape)
    assert prices.seconds(**shape) == pytest.approx(measured)
    prices.record(1.5 * plain, 16, 16, 1, 200, 0)
    prices.record(1.5 * (plain + 2 * increment), **shape)
    assert prices.drafting_factor(16) == pytest.approx(2.0)
    assert prices.seconds(**shape) == pytest.approx(plain + 2 * increment)
    assert prices.seconds(16, 16, 1, 200) == pytest.approx(plain)  # plain steps stay as measured
    # A few percent of noise between plain and drafting steps moves the increment by as much, not
    # the whole step: drafting steps observed 5% under their price (relative to plain ones) do not
    # make drafts free.
    noisy = Prices(prices.costs)
    for _ in range(LIVE_MIN):
        noisy.record(plain, 16, 16, 1, 200, 0)
        noisy.record(0.95 * measured, **shape)
    assert noisy.seconds(**shape) - plain >= LIVE_BOUNDS[0] * increment
    for _ in range(100):
        prices.record(10 * measured, **shape)
    assert prices.drafting_factor(16) == LIVE_BOUNDS[1]  # bounded


def test_each_band_of_batch_sizes_corrects_its_own_drafting_steps():
    """Drafting steps of 16 samples cheaper than measured must not make drafts at 128 samples look
    cheap (one shared correction did), and a band that never drafted keeps the measured price."""
    from multispec.engine.costs import LIVE_MIN, Prices, live_band

    prices = Prices(law_costs(knee, per_work=0.01, extra=0.001))
    small = dict(tokens=32, batch=16, qmax=2, context=200, drafting=16)
    large = dict(tokens=160, batch=128, qmax=2, context=200, drafting=32)
    middle = dict(tokens=96, batch=64, qmax=2, context=200, drafting=32)
    assert len({live_band(16), live_band(64), live_band(128)}) == 3

    def parts(shape):
        plain = prices.costs.seconds(shape["batch"], shape["batch"], 1, shape["context"])
        return plain, prices.costs.seconds(**shape) - plain

    for _ in range(LIVE_MIN):
        for shape, factor in ((small, 0.8), (large, 2.5)):
            plain, increment = parts(shape)
            prices.record(plain, shape["batch"], shape["batch"], 1, shape["context"], 0)
            prices.record(plain + factor * increment, **shape)
    assert prices.drafting_factor(16) == pytest.approx(0.8)
    assert prices.drafting_factor(128) == pytest.approx(2.5)
    assert prices.drafting_factor(64) == 1.0
    for shape, factor in ((small, 0.8), (large, 2.5), (middle, 1.0)):
        plain, increment = parts(shape)
        assert prices.seconds(**shape) == pytest.approx(plain + factor * increment)
    assert list(prices.drafting_factors().values()).count(1.0) == len(prices.drafting_factors()) - 2


def test_a_pricer_gives_exactly_the_seconds_of_its_batch_and_context():
    """The budget prices every cut of a step's ranked nodes through ``pricer``; it must be
    ``seconds`` itself (the same floats), measured prices and corrected ones alike."""
    from multispec.engine.costs import LIVE_MIN, Prices

    costs = law_costs(knee, per_work=0.01, extra=lambda batch: 0.001 + 0.00002 * batch)
    prices = Prices(costs)
    for _ in range(LIVE_MIN):  # a correction of 1.3 for the band of 16 samples
        plain = costs.seconds(16, 16, 1, 200)
        prices.record(plain, 16, 16, 1, 200, 0)
        prices.record(plain + 1.3 * (costs.seconds(40, 16, 4, 200, 8) - plain), 40, 16, 4, 200, 8)
    assert prices.drafting_factor(16) == pytest.approx(1.3)
    for batch in (1, 4, 16, 100):
        for context in (30, 400):
            for each in (costs, prices):
                price = each.pricer(batch, context)
                for tokens, qmax, drafting in ((batch, 1, None), (batch, 1, 0), (batch + 3, 2, 3),
                                               (batch + 7, 4, 3), (batch * 3, 3, batch), (batch + 40, 7, 9)):
                    assert price(tokens, qmax, drafting) == each.seconds(tokens, batch, qmax, context, drafting)
