"""A server started with ``--reasoning-parser deepseek_r1``: chat answers' thinking apart from
their content (``message.reasoning``, as vLLM names it), whole and streamed, and constraints on the
text refused (they would constrain the thinking too)."""

from __future__ import annotations

import openai
import pytest

from multispec import SamplingParams
from tests.serve.test_isolation import ThreadServer

CHAT = [{"role": "user", "content": "The quick brown fox"}]


def test_thinking_is_reasoning_and_constraints_are_refused(successor_dir, tiny):
    """The tiny model never writes </think>, so its whole answer is thinking cut short: reasoning
    is LLM.chat's text and content is null, streamed as delta.reasoning. A JSON schema is refused
    with 400 naming the field."""
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
