"""Admission in arrival order, slot layouts planned for what waits, and refusal of what never fits."""

from __future__ import annotations

import pytest
import torch

from multispec.engine.cache import KVCache, lazy_memory
from multispec.engine.request import Request, Sample
from multispec.engine.scheduler import PROMPT_CAPACITY, SAMPLE_CAPACITY, SPARE_PROMPTS, Scheduler
from multispec.models.config import ModelConfig
from multispec.params import RequestOutputKind, SamplingParams, SpecConfig

CONFIG = ModelConfig.from_hf_dict(dict(
    architectures=["LlamaForCausalLM"], vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))


def request(n: int, prompt: int, need: int, name: str = "r") -> Request:
    return Request(name, None, [1] * prompt, SamplingParams(n=n), SpecConfig(), need - 1, 0, frozenset(), frozenset(),
                   RequestOutputKind.FINAL_ONLY, "deterministic", (), need)


def scheduler(tokens: int) -> Scheduler:
    return Scheduler(KVCache(CONFIG, tokens, torch.float32), max_model_len=4096)


def run(s: Scheduler, admitted: list[Request]) -> None:
    """Give the admitted requests their live samples, as the engine does after a prefill."""
    for r in admitted:
        r.samples = [Sample(r, i, i, 0, output_ids=[1]) for i in range(r.n)]
        r.unfinished = r.n
        s.place(r.samples)


def finish(s: Scheduler, r: Request) -> None:
    for sample in r.samples:
        sample.finish("stop")
    s.retire()


def test_a_request_that_never_fits_is_refused():
    s = scheduler(1000)
    s.check_fits(request(4, 200, 200))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        s.check_fits(request(4, 201, 200))


def test_the_plan_fits_everything_waiting_and_fills_the_cache():
    s = scheduler(100_000)
    s.waiting.extend([request(16, 300, 263), request(16, 120, 263)])
    shape = s.plan()
    assert shape.tokens() <= 100_000
    assert (shape.sample_capacity, shape.prompt_capacity) == (SAMPLE_CAPACITY, PROMPT_CAPACITY)  # room to grow
    assert shape.sample_slots >= 32 and shape.prompt_slots >= 2
    # The spare slots (beyond the 32 samples and 2 prompts that wait) keep SPARE_PROMPTS prompts per sample.
    spare = (shape.prompt_slots - 2) / (shape.sample_slots - 32)
    assert spare == pytest.approx(SPARE_PROMPTS, abs=0.02)


def test_spare_slots_leave_room_for_requests_of_any_n():
    """A server laid out while its first request (n = 16) ran: later clients ask for n = 1 to 16,
    and the spare slots must not cap how many requests run at once at a handful. Before
    ``SPARE_PROMPTS`` this layout had 10 prompt slots beside 161 sample slots (93,206 tokens)."""
    s = scheduler(93_206)
    s.waiting.append(request(16, 200, 17))
    shape = s.plan()
    assert shape.tokens() <= 93_206
    assert shape.prompt_slots >= SPARE_PROMPTS * (shape.sample_slots - 16)
    assert shape.sample_slots >= 100  # still most of the cache for samples
    # Requests that want more prompts per sample than that keep their own proportion.
    s = scheduler(93_206)
    s.waiting.extend(request(1, 200, 17, str(i)) for i in range(4))
    shape = s.plan()
    assert shape.prompt_slots == pytest.approx(shape.sample_slots, abs=1)


def test_a_tight_plan_sizes_slots_exactly_and_takes_the_queue_in_order():
    s = scheduler(4 * 263 + 300 + 8 * 263)  # the first two requests fit, the third not with them
    s.waiting.extend([request(4, 300, 263), request(4, 100, 263), request(8, 100, 263)])
    shape = s.plan()
    assert (shape.sample_capacity, shape.prompt_capacity) == (263, 300)
    assert 8 <= shape.sample_slots < 16 and shape.prompt_slots == 2 and shape.tokens() <= s.cache.capacity


def test_admission_is_first_come_first_served_and_respects_both_kinds_of_slot():
    s = scheduler(12 * 100 + 3 * 50)
    a, b, c, d = (request(4, 50, 100, name) for name in "abcd")
    s.waiting.extend([a, b, c, d])
    s.cache.layout(s.plan())
    first = s.admit()
    assert first == [a, b, c] and list(s.waiting) == [d]  # three prompt slots, twelve sample slots
    run(s, first)
    for sample in b.samples[:2]:  # two samples finish: sample slots free up, no prompt slot does
        sample.finish("stop")
    s.retire()
    assert s.admit() == [] and len(s.slots) == 10
    finish(s, b)
    assert s.admit() == [d]
    assert [x.request for x in s.slots[:4]] == [a] * 4 and len(s.slots) == 8


def test_a_request_too_big_for_the_layout_waits_for_the_engine_to_drain():
    s = scheduler(10_000)
    small, big, after = request(2, 20, 50, "small"), request(2, 2000, 50, "big"), request(1, 10, 10, "after")
    s.waiting.append(small)
    run(s, s.admit())
    assert s.cache.shape.prompt_capacity == PROMPT_CAPACITY
    s.waiting.extend([big, after])
    assert s.admit() == []  # big needs a larger prompt slot; after waits behind it
    finish(s, small)
    assert s.admit() == [big, after]  # laid out again, for both
    assert s.cache.shape.prompt_capacity >= 2000


def test_an_idle_cache_is_laid_out_again_when_that_admits_more_of_what_waits():
    """A layout planned for one request of 16 samples keeps 30 prompt slots here; 40 requests of 2
    that come after it must not run in two waves (30, then 10 once those end) when a new layout
    takes all 40 at once. While anything runs, the layout stays as it is."""
    s = scheduler(100_000)
    first = request(16, 200, 100, "first")
    s.waiting.append(first)
    run(s, s.admit())
    small = [request(2, 200, 100, str(i)) for i in range(40)]
    s.waiting.extend(small)
    kept = s.cache.shape
    assert kept.prompt_slots < 41  # the first request's layout cannot hold all of them beside it
    running = s.admit()
    assert s.cache.shape == kept and len(running) == kept.prompt_slots - 1
    run(s, running)
    finish(s, first)
    for r in running:
        finish(s, r)
    rest = s.admit()
    assert rest == small[len(running):]  # everything left, in arrival order

    s = scheduler(100_000)
    s.waiting.append(request(16, 200, 100, "first"))
    only = s.admit()
    run(s, only)
    finish(s, only[0])
    s.waiting.extend(small)
    assert s.admit() == small and s.cache.shape.prompt_slots >= 40


@pytest.mark.skipif(not lazy_memory("cpu"), reason="memory here is not committed page by page")
def test_an_overcommitted_layout_admits_by_the_memory_requests_touch():
    """Laid out with four times its budget in slots, the cache admits requests while the memory
    their slots touch fits the budget: more samples than slots of full capacity would hold, and
    never more than the budget resident. Memory that finished requests left zeroed goes back to
    the system when a request needs more per sample than they did."""
    budget = 20_000
    s = Scheduler(KVCache(CONFIG, budget, torch.float32, overcommit=4), max_model_len=4096)
    first = request(4, 50, 400, "first")
    s.waiting.append(first)
    run(s, s.admit())
    assert s.cache.shape.sample_slots * s.cache.shape.sample_capacity > budget  # the layout overcommits
    many = [request(4, 50, 400, str(i)) for i in range(60)]
    s.waiting.extend(many)
    running = s.admit()
    run(s, running)
    assert len(running) == (budget - 1650) // 1650  # 1,650 tokens each: 4 x 400 + 50
    assert 4 * (1 + len(running)) > budget // SAMPLE_CAPACITY  # more than full-capacity slots would hold
    assert s.cache.resident() <= budget
    # A request whose samples need far more than the earlier ones arrives while one of them still
    # runs: the memory the finished ones left zeroed is handed back, and it fits.
    for r in running:
        finish(s, r)
    s.waiting.clear()
    big = request(4, 50, SAMPLE_CAPACITY, "big")
    s.waiting.append(big)
    assert s.cache.resident() + 8 * (SAMPLE_CAPACITY - 400) > budget
    assert s.admit() == [big]
    assert s.cache.resident() == 8 * SAMPLE_CAPACITY + 2 * 50 <= budget
    run(s, [big])
    # Nothing more fits beside them: a request waits rather than exceed the budget.
    s.waiting.append(request(32, 50, SAMPLE_CAPACITY, "later"))  # 40 x 512 + 150 > 20,000
    assert s.admit() == []
