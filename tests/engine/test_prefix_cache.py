"""Prompt caching across requests (``multispec.engine.prefix``): a prompt that begins with tokens
an earlier or concurrent prompt computed skips them, and nothing it returns changes.

On the default model in float32. Each comparison runs the same requests with caching switched off
and on in one process: greedy ids, the prompt's log-probabilities and ranks, and seeded samples
at temperature 0.7 (keyed draws, so a cached prefill must give the very tokens an uncached one
gives, except where a draw falls within ``NEAR_TIE`` of a boundary: a wrong key, value or
position anywhere in the reused prefix moves far more than that). Each test's text is its own, so
that what other tests left in the cache cannot match it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from multispec import LLM, SamplingParams
from multispec.engine.cache import CacheShape, KVCache
from multispec.engine.prefix import PromptPrefixes, PromptScores, common_prefix
from multispec.engine.scheduler import SECOND_FORWARD_GAIN
from tests.helpers import assert_same_sampled_tokens


@contextlib.contextmanager
def no_prefix_caching(llm):
    scheduler = llm.engine.scheduler
    scheduler.prefix_caching = False
    try:
        yield
    finally:
        scheduler.prefix_caching = True


def ids_of(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def run(llm, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_common_prefix_and_slot_choice():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.array([5])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0
    prefixes = PromptPrefixes(4)
    prefixes.hold(0, [1, 2, 3], None)
    prefixes.hold(1, [1, 2, 7], None)
    prefixes.hold(2, [1, 2, 8, 9], None)
    # Longest first; on a tie the most recently used.
    assert prefixes.best(np.array([1, 2, 8, 5]), range(4)) == (2, 3)
    assert prefixes.best(np.array([1, 2, 5]), range(4)) == (2, 2)
    assert prefixes.best(np.array([1, 2, 5]), [0, 1]) == (1, 2)
    assert prefixes.best(np.array([6]), range(4)) == (None, 0)
    # A prompt that reuses nothing goes to an empty slot, else to the least recently used.
    assert prefixes.spare([0, 1, 3]) == 3
    assert prefixes.spare([0, 1, 2]) == 0
    prefixes.forget(0)
    assert prefixes.spare([0, 1, 2]) == 0 and prefixes.shared(0, np.array([1, 2])) == 0


def test_prompt_scores_rebuild_fewer_top_tokens():
    scores = PromptScores(2, [None, -1.0, -0.5], [None, 3, 1], [None, ([4, 5], [-0.1, -0.2]), ([6, 7], [-0.5, -0.9])])
    logprobs, ranks = scores.entries([9, 8, 6], 1)
    assert logprobs == [None, {8: -1.0, 4: -0.1}, {6: -0.5}] and ranks == [None, 3, 1]
    assert list(logprobs[1]) == [8, 4]  # the prompt's own token first, as the uncached path has it
    assert scores.prefix(2).extend(PromptScores(1, [-2.0], [7], [([1], [-0.3])])).top == 1


def test_layout_and_hand_back_forget_what_slots_held(llm):
    cache = KVCache(llm.config, 4096, torch.float32, overcommit=4)
    cache.layout(CacheShape(4, 64, 4, 256))
    cache.prefixes.hold(0, [1, 2, 3], None)
    cache.prefixes.hold(1, [1, 2, 3], None)
    cache.ready(0, 0, [0, 1], 8)
    cache.release_unused(0, {1})  # slot 0 nobody uses: its memory goes back, and what it held
    if cache.overcommit > 1:
        assert cache.prefixes.tokens[0] is None and cache.prefixes.tokens[1] is not None
    cache.layout(CacheShape(2, 64, 8, 128))
    assert cache.prefixes.tokens == [None] * 8


def test_continued_prompt_computes_only_the_rest(llm):
    base = ids_of(llm, "Quartz lanterns hum over the harbour of Vellmar while the night ferries load salt. " * 6)
    more = base + ids_of(llm, " The harbourmaster counts the crates and writes:")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    with no_prefix_caching(llm):
        want = run(llm, [base, more, base], greedy)
    first = run(llm, [base], greedy)[0]
    continued = run(llm, [more], greedy)[0]
    again = run(llm, [base], greedy)[0]
    assert first.num_cached_tokens == 0
    assert continued.num_cached_tokens == len(base)
    assert again.num_cached_tokens == len(base) - 1  # its last token is computed again: its row samples
    for got, expected in zip((first, continued, again), want):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert all(o.num_cached_tokens == 0 for o in want)


def test_long_continuation_of_a_short_prefix(llm):
    """More new rows than held positions: attention runs causal over the whole prompt with zero
    rows in front of the new ones (the masked form serves the other case)."""
    short = ids_of(llm, "Brass owls of Mirefield:")
    longer = short + ids_of(llm, " they nest in clock towers and wake at the twelfth chime of every night. " * 4)
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    with no_prefix_caching(llm):
        want = run(llm, [longer], greedy)[0]
    run(llm, [short], greedy)
    got = run(llm, [longer], greedy)[0]
    assert got.num_cached_tokens == len(short) < len(longer) - len(short)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_prompts_admitted_together_share_their_prefix(llm):
    """Prompts arriving together that begin alike: the first computes the shared part, the others
    continue it in a second forward; seeded samples are those of the uncached run."""
    stem = ids_of(llm, "Copper kites drift above the orchards of Thessaly as the beekeepers sing. " * 8)
    assert len(stem) > SECOND_FORWARD_GAIN
    tails = [" How many kites?", " Why do they sing?", " Name the orchards.", " Count the bees."]
    prompts = [stem + ids_of(llm, tail) for tail in tails]
    params = SamplingParams(n=4, temperature=0.7, max_tokens=16, seed=77)
    with no_prefix_caching(llm):
        want = run(llm, prompts, params)
    forwards = llm.engine.stats.prefill_forwards
    got = run(llm, prompts, params)
    assert llm.engine.stats.prefill_forwards - forwards == 2
    shared = [common_prefix(np.array(prompts[0]), np.array(p)) for p in prompts]
    assert [o.num_cached_tokens for o in got] == [0] + shared[1:]
    assert min(shared[1:]) >= len(stem)
    for prompt, g, w in zip(prompts, got, want):
        for i, (a, b) in enumerate(zip(g.outputs, w.outputs)):
            assert_same_sampled_tokens(llm, prompt, a.token_ids, b.token_ids, 77, i, 0.7)


def test_prompt_copied_from_a_slot_in_use(llm):
    """A prompt continuing one whose samples still run gets its keys and values copied into a
    slot of its own (the running request's slot stays as it is)."""
    engine = llm.engine
    base = ids_of(llm, "Silver otters chart the tides of Korrin Bay each spring for the lighthouse keepers. " * 5)
    more = base + ids_of(llm, " Their latest chart shows")
    long = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    with no_prefix_caching(llm):
        want = run(llm, [more], greedy)[0]
    engine.add_request("runs", base, long)
    engine.step()
    running = next(s.request for s in engine.scheduler.slots if s.request.request_id == "runs")
    engine.add_request("continues", more, greedy)
    outputs, checked = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if "continues" in engine.requests and engine.requests["continues"].samples:
            continuing = engine.requests["continues"]
            assert continuing.copy_from == running.prompt_slot != continuing.prompt_slot
            checked = True
    assert checked and outputs["continues"].num_cached_tokens == len(base)
    assert outputs["continues"].outputs[0].token_ids == want.outputs[0].token_ids
    assert len(outputs["runs"].outputs[0].token_ids) == 40


def test_prompt_logprobs_reuse_scores_kept_with_the_prefix(llm):
    base = ids_of(llm, "Amber trains cross the salt flats of Oruna twice a day, carrying glass and wool. " * 5)
    tail = base + ids_of(llm, " The evening train is late again.")
    other = base + ids_of(llm, " Nobody remembers the first train.")
    two, one, three = (SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k) for k in (2, 1, 3))
    with no_prefix_caching(llm):
        want = [run(llm, [p], sp)[0] for p, sp in ((base, two), (tail, one), (other, three))]
    got = [run(llm, [p], sp)[0] for p, sp in ((base, two), (tail, one), (other, three))]
    # The second reuses the first's scores (2 top tokens kept, 1 asked) and computes from the row
    # before its first new token; the third asks for more top tokens than were kept: all computed.
    assert [o.num_cached_tokens for o in got] == [0, len(base) - 1, 0]
    for g, w in zip(got, want):
        assert g.prompt_token_ranks == w.prompt_token_ranks
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert list(a) == list(b)
            assert np.allclose(list(a.values()), list(b.values()), atol=1e-4)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_continuations_scored_together_as_lm_eval_sends_them(llm):
    """One context and several continuations in one call, each with its prompt's log-probabilities
    (a harness's multiple choice): the first computes the context, the others its scores too."""
    context = ids_of(llm, "Velvet comets circle the observatory of Brask; the astronomers log each pass. " * 5)
    prompts = [context + ids_of(llm, f" The answer is {c}.") for c in (12, 18, 240)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with no_prefix_caching(llm):
        want = run(llm, prompts, params)
    got = run(llm, prompts, params)
    shared = [common_prefix(np.array(prompts[0]), np.array(p)) for p in prompts]
    assert [o.num_cached_tokens for o in got] == [0] + [k - 1 for k in shared[1:]]
    for g, w in zip(got, want):
        assert g.prompt_token_ranks == w.prompt_token_ranks
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_prompt_logprobs_are_not_taken_from_a_prompt_that_had_none(llm):
    base = ids_of(llm, "Indigo foxes guard the library of Sel on moonless nights, reading maps by lamplight. " * 4)
    run(llm, [base], SamplingParams(temperature=0, max_tokens=2))
    asks = run(llm, [base + ids_of(llm, " One fox")], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert asks[0].num_cached_tokens == 0 and len(asks[0].prompt_logprobs) == len(asks[0].prompt_token_ids)


def test_switched_off(successor_dir):
    off = LLM(str(successor_dir), device="cpu", dtype="float32", enable_prefix_caching=False)
    prompt = list(range(3, 60))
    outs = [run(off, [prompt], SamplingParams(temperature=0, max_tokens=4))[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0] and off.engine.stats.cached_prompt_tokens == 0
