"""``--tool-call-parser llama3_json``: the model's own calls in Llama 3's JSON format read out of a
chat answer, whole and streamed, through the official client. A regex makes the tiny model write
a call (or plain text); the sampled text is LLM.chat's under the same regex, since reading calls
changes nothing drawn."""

from __future__ import annotations

import json

import pytest

from multispec import SamplingParams
from tests.serve.test_isolation import ThreadServer

CHAT = [{"role": "user", "content": "The quick brown fox"}]
TOOL = {"type": "function", "function": {"name": "record", "description": "Record an animal.", "parameters": {
    "type": "object", "properties": {"animal": {"type": "string"}}, "required": ["animal"]}}}
CALL = r'<\|python_tag\|>\{"name": "record", "parameters": \{"animal": "(fox|dog)"\}\}'
TEXT = r"No call (needed|today)\."


@pytest.fixture(scope="module")
def server(successor_dir):
    with ThreadServer(successor_dir, tool_parser="llama3_json") as running:
        yield running


@pytest.mark.parametrize("answer", [CALL, TEXT], ids=["call", "text"])
def test_llama3_json_calls_whole_and_streamed(server, tiny, answer):
    settings = dict(model="tiny", messages=CHAT, n=3, temperature=1.0, seed=2, max_tokens=80, tools=[TOOL],
                    extra_body={"structured_outputs": {"regex": answer}})
    want = tiny.chat(CHAT, SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=80, skip_special_tokens=False,
                                          structured_outputs={"regex": answer}), use_tqdm=False)[0].outputs
    client = server.client()
    whole = client.chat.completions.create(**settings)
    for choice, expected in zip(whole.choices, want):
        assert expected.finish_reason == "stop"
        if answer == CALL:
            (call,) = choice.message.tool_calls
            assert choice.message.content is None and choice.finish_reason == "tool_calls"
            assert call.function.name == "record"
            assert json.loads(call.function.arguments) == json.loads(expected.text.split('"parameters": ')[1][:-1])
        else:
            assert choice.message.content == expected.text and not choice.message.tool_calls
            assert choice.finish_reason == "stop"
    content: dict[int, str] = {}
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **settings):
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            calls.setdefault(choice.index, []).extend(
                (piece.function.name, piece.function.arguments) for piece in choice.delta.tool_calls or [])
    for choice in whole.choices:
        assert content[choice.index] == (choice.message.content or "")
        assert calls[choice.index] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
