"""A server started with ``--reasoning-parser deepseek_r1``: chat answers' thinking apart from
their content (``message.reasoning``, as vLLM names it), whole and streamed, and constraints on the
text, forced tool calls included, ruling from the end of the thinking on (refused where the
vocabulary has no ``</think>`` token)."""

from __future__ import annotations

import re

import openai
import pytest

from multispec import SamplingParams
from multispec.serve.tools import DeepSeekR1Reasoning
from tests.serve.test_isolation import ThreadServer

CHAT = [{"role": "user", "content": "The quick brown fox"}]


def test_thinking_is_reasoning_and_constraints_are_refused(successor_dir, tiny):
    """The tiny model never writes </think>, so its whole answer is thinking cut short: reasoning
    is LLM.chat's text and content is null, streamed as delta.reasoning. A JSON object is refused
    with 400 naming the field: its vocabulary has no </think> token to start it after."""
    settings = dict(model="tiny", messages=CHAT, n=2, temperature=1.0, seed=4, max_tokens=12)
    want = tiny.chat(CHAT, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=12), use_tqdm=False)[0].outputs
    want = [c.text for c in want]
    with ThreadServer(successor_dir, reasoning_parser="deepseek_r1") as server:
        client = server.client()
        whole = client.chat.completions.create(**settings)
        for choice, expected in zip(whole.choices, want):
            assert choice.message.model_extra["reasoning"] == expected and choice.message.content is None
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **settings):
            for choice in chunk.choices:
                assert not choice.delta.content
                piece = choice.delta.model_extra.get("reasoning") or ""
                streamed[choice.index] = streamed.get(choice.index, "") + piece
        assert streamed == dict(enumerate(want))
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(response_format={"type": "json_object"}, **settings)
        assert caught.value.body["param"] == "response_format"


def test_a_constraint_rules_from_the_end_of_the_thinking(successor_dir, tiny, monkeypatch):
    """The constraint starts after the token that ends the thinking (here a stand-in: the tiny
    vocabulary has no </think>, so the server is told that the third token the seeded answer
    writes is it): the thinking is LLM.chat's text before that token, then the answer follows the
    constraint, a choice or a forced tool call's arguments."""
    settings = dict(model="tiny", messages=CHAT, n=1, temperature=1.0, seed=4, max_tokens=40)
    free = tiny.chat(CHAT, SamplingParams(n=1, temperature=1.0, seed=4, max_tokens=40), use_tqdm=False)[0].outputs[0]
    end = free.token_ids[2]
    end_text = tiny.tokenizer.decode([end])
    thinking = tiny.tokenizer.decode(free.token_ids[:2])
    assert end_text and end_text not in thinking
    monkeypatch.setattr(DeepSeekR1Reasoning, "end", end_text)
    with ThreadServer(successor_dir, reasoning_parser="deepseek_r1") as server:
        tokenizer = server.engine.tokenizer
        real = tokenizer.token_to_id
        monkeypatch.setattr(tokenizer, "token_to_id", lambda text: end if text == end_text else real(text))
        client = server.client()
        out = client.chat.completions.create(extra_body={"structured_outputs": {"choice": [" lazy dog"]}}, **settings)
        message = out.choices[0].message
        assert (message.model_extra["reasoning"], message.content) == (thinking, " lazy dog")
        assert out.choices[0].finish_reason == "stop"
        schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"],
                  "additionalProperties": False}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        out = client.chat.completions.create(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}},
                                             **settings)
        message = out.choices[0].message
        assert message.model_extra["reasoning"] == thinking
        # The tiny model pads JSON with whitespace, which the grammar allows: the arguments are a
        # beginning of {"a": "x"} with whitespace between its tokens, cut by max_tokens or whole.
        arguments = message.tool_calls[0].function.arguments
        assert re.fullmatch(r'\s*\{\s*("a"\s*(:\s*("x"\s*(\}\s*)?)?)?)?', arguments), arguments


def test_an_earlier_turns_thinking_leaves_the_constraint_closed(successor_dir, tiny, monkeypatch):
    """A tool loop keeps the thinking of the assistant turn before it: the end-of-thinking token in
    that turn does not open the constraint for the new answer (it would open at once, and the
    thinking be the constraint's text); the thinking is the free answer up to its own end token."""
    free = tiny.chat(CHAT, SamplingParams(n=1, temperature=1.0, seed=4, max_tokens=40), use_tqdm=False)[0].outputs[0]
    end = free.token_ids[2]
    end_text = tiny.tokenizer.decode([end])
    monkeypatch.setattr(DeepSeekR1Reasoning, "end", end_text)
    loop = CHAT + [{"role": "assistant", "content": f"a{end_text}b"}, {"role": "user", "content": "and then"}]
    law = dict(n=3, temperature=1.0, seed=6, max_tokens=16)
    answers = tiny.chat(loop, SamplingParams(**law), use_tqdm=False)[0].outputs
    with ThreadServer(successor_dir, reasoning_parser="deepseek_r1") as server:
        tokenizer = server.engine.tokenizer
        real = tokenizer.token_to_id
        monkeypatch.setattr(tokenizer, "token_to_id", lambda text: end if text == end_text else real(text))
        assert end in tokenizer.encode(tokenizer.apply_chat_template(loop), add_special_tokens=False)
        out = server.client().chat.completions.create(model="tiny", messages=loop, **law,
                                                      extra_body={"structured_outputs": {"choice": [" lazy dog"]}})
    for answer, choice in zip(answers, out.choices):
        # The free answer up to its own end token, then the constraint; split as the parser splits.
        ids = answer.token_ids
        text = tiny.tokenizer.decode(ids[:ids.index(end) + 1]) + " lazy dog" if end in ids else answer.text
        message = choice.message
        assert (message.model_extra["reasoning"], message.content) == DeepSeekR1Reasoning().split(text)
    assert any(end not in a.token_ids for a in answers)  # (answers the constraint never reached)


def test_qwen3_with_thinking_off_answers_in_content(successor_dir, tiny):
    """``--reasoning-parser qwen3``: a request that thinks splits as deepseek_r1 does (the tiny
    model never ends its thinking: all reasoning, and a constraint is refused for want of a
    </think> token); one with ``chat_template_kwargs: {"enable_thinking": false}`` has no thinking,
    so its answer is content, whole and streamed, and a constraint rules it from the first token."""
    settings = dict(model="tiny", messages=CHAT, n=2, temperature=1.0, seed=4, max_tokens=12)
    want = tiny.chat(CHAT, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=12), use_tqdm=False)[0].outputs
    want = [c.text for c in want]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with ThreadServer(successor_dir, reasoning_parser="qwen3") as server:
        client = server.client()
        thinking = client.chat.completions.create(**settings)
        assert [(c.message.model_extra["reasoning"], c.message.content) for c in thinking.choices] == \
            [(text, None) for text in want]
        answered = client.chat.completions.create(extra_body=off, **settings)
        assert [(c.message.model_extra.get("reasoning"), c.message.content) for c in answered.choices] == \
            [(None, text) for text in want]
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, extra_body=off, **settings):
            for choice in chunk.choices:
                assert not choice.delta.model_extra.get("reasoning")
                streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
        assert streamed == dict(enumerate(want))
        constrained = client.chat.completions.create(
            extra_body={**off, "structured_outputs": {"choice": [" lazy dog"]}}, **settings)
        assert [c.message.content for c in constrained.choices] == [" lazy dog", " lazy dog"]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(extra_body={"structured_outputs": {"choice": [" lazy dog"]}}, **settings)
        assert caught.value.body["param"] == "structured_outputs"
