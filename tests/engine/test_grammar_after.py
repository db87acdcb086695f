"""Structured outputs that start after a token (``grammar_after``: a reasoning model's
``</think>``, as vLLM starts them under a reasoning parser): before the token nothing is masked,
the token opens the grammar, and from there it rules every row, drafted rows included.

On the default model in float32, with a stand-in for the end of thinking: the token " with",
which the seeded samples below write within their first few tokens."""

from __future__ import annotations

import re

import pytest

from multispec import SamplingParams, SpecConfig
from multispec.engine.grammar import AfterToken, masks
from multispec.params import StructuredOutputsParams

CHAT = [{"role": "user", "content": "Write one short sentence about cats."}]
REGEX = " [0-9]{3}"


def gate(llm) -> int:
    (token,) = llm.tokenizer.encode(" with", add_special_tokens=False)
    return token


def drive(llm, prompt_ids, params, spec, grammar_after, grammar_open=None):
    engine = llm.engine
    engine.enqueue(engine.make_request("gated", prompt_ids, params, spec, grammar_after=grammar_after,
                                       grammar_open=grammar_open))
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last


def test_the_gate_opens_on_its_token_and_rolls_back_with_a_path(llm):
    inner = llm.engine.grammars.matcher(StructuredOutputsParams(regex=REGEX))
    matcher = AfterToken(inner, gate(llm))
    vocab = llm.engine.vocab_size
    digits = llm.tokenizer.encode(" 1", add_special_tokens=False)
    word = llm.tokenizer.encode(" cats", add_special_tokens=False)

    def mask(path):
        rows, bits = masks([(0, matcher, path)], vocab)
        return None if not rows else bits[0]

    fresh = llm.engine.grammars.matcher(StructuredOutputsParams(regex=REGEX))
    _, want_open = masks([(0, fresh, [])], vocab)
    assert bool((mask([]) == -1).all())  # closed: everything allowed
    assert bool((mask(word + [gate(llm)]) == want_open[0]).all())  # the path crosses the gate
    assert not matcher.opened and bool((mask([]) == -1).all())  # rolled back
    assert mask([gate(llm)] + word) is None  # a word after the gate leaves the grammar
    assert mask([gate(llm)] + digits) is not None and not matcher.opened
    copy = matcher.deep_copy()
    matcher.consume_token(gate(llm))
    assert matcher.opened and not copy.opened
    assert bool((mask([]) == want_open[0]).all())


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig(drafter="consensus", adaptive=False)],
                         ids=["plain", "speculative"])
def test_samples_are_free_until_the_token_then_follow_the_grammar(llm, spec):
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    law = dict(n=4, temperature=0.7, seed=3, max_tokens=24)
    free = drive(llm, prompt, SamplingParams(**law), SpecConfig(), None).outputs
    ruled = drive(llm, prompt, SamplingParams(structured_outputs={"regex": REGEX}, **law), spec, gate(llm)).outputs
    opened = 0
    for f, r in zip(free, ruled):
        if gate(llm) not in f.token_ids:
            continue
        cut = f.token_ids.index(gate(llm)) + 1
        assert r.token_ids[:cut] == f.token_ids[:cut]  # the same keyed draws, nothing masked before it
        after = llm.tokenizer.decode(r.token_ids[cut:])
        assert re.fullmatch(REGEX, after) and r.finish_reason == "stop", (after, r.finish_reason)
        opened += 1
    assert opened >= 2


def test_a_prompt_holding_the_token_opens_the_grammar_at_once(llm):
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT), add_special_tokens=False) + [gate(llm)]
    out = drive(llm, prompt, SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=12,
                                            structured_outputs={"regex": REGEX}), SpecConfig(), gate(llm))
    assert all(re.fullmatch(REGEX, c.text) for c in out.outputs)
    # The caller may know better (the token in an earlier turn of a chat, not in this answer's):
    # closed, the samples are the free ones up to the gate.
    law = dict(n=4, temperature=0.7, seed=5, max_tokens=12)
    free = drive(llm, prompt, SamplingParams(**law), SpecConfig(), None).outputs
    closed = drive(llm, prompt, SamplingParams(structured_outputs={"regex": REGEX}, **law), SpecConfig(), gate(llm),
                   grammar_open=False).outputs
    for f, c in zip(free, closed):
        cut = f.token_ids.index(gate(llm)) + 1 if gate(llm) in f.token_ids else len(f.token_ids)
        assert c.token_ids[:cut] == f.token_ids[:cut]
    assert not all(re.fullmatch(REGEX, c.text) for c in closed)
    with pytest.raises(ValueError, match="grammar_after"):
        llm.engine.make_request("bad", prompt, SamplingParams(structured_outputs={"regex": REGEX}),
                                grammar_after=10**9)
