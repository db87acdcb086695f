"""The server end to end through the official ``openai`` client: completions and chat, n = 1 and
8, streamed and not, log-probabilities, stop rules, seeds, usage, and the same samples as
``LLM.generate``."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest

from multispec import SamplingParams
from tests.helpers import last_logits
from tests.serve.conftest import API_KEY

PROMPT = "Hello world! The quick brown fox"
CHAT = [{"role": "user", "content": "The quick brown fox"}]


def stream_texts(stream) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Texts by choice index, the finish reasons each index got, and the chunks without choices."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    tails = []
    for chunk in stream:
        if not chunk.choices:
            tails.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, tails


def test_models_health_version(server, client):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 256
    assert server.request("GET", "/health")[0] == 200
    status, _, body = server.request("GET", "/version")
    assert status == 200 and json.loads(body)["version"]


@pytest.mark.parametrize("n", [1, 8])
def test_completions_n_samples_usage_and_logprobs(client, tiny, n):
    out = client.completions.create(model="tiny", prompt=PROMPT, n=n, max_tokens=12, temperature=0.8, seed=3,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(n))
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 12 for c in out.choices)
    for c in out.choices:  # the top 2 and the sampled token, by text (distinct tokens may read the same)
        pairs = zip(c.logprobs.tokens, c.logprobs.top_logprobs)
        assert all(1 <= len(top) <= 3 and token in top for token, top in pairs)
    assert out.usage.prompt_tokens == len(tiny.tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == n * 12 == sum(len(c.logprobs.tokens) for c in out.choices)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert set(out.model_extra["speculation"]) == {"forwards", "tau", "acceptance_rate", "drafted_tokens",
                                                   "accepted_tokens"}


def test_streamed_completion_is_the_unstreamed_one_with_usage_last(client):
    settings = dict(model="tiny", prompt=PROMPT, n=4, max_tokens=20, temperature=1.0, seed=7)
    whole = client.completions.create(**settings)
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **settings)
    texts, finishes, tails = stream_texts(stream)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    (tail,) = tails
    assert tail.usage.completion_tokens == whole.usage.completion_tokens
    assert tail.model_extra["speculation"]["forwards"] >= 1


def test_seeds_reproduce_and_lists_of_prompts_number_choices_prompt_by_prompt(client, tiny):
    settings = dict(model="tiny", n=3, max_tokens=10, temperature=1.0, seed=11)
    first = client.completions.create(prompt=[PROMPT, "The lazy dog"], **settings)
    again = client.completions.create(prompt=[PROMPT, "The lazy dog"], **settings)
    alone = client.completions.create(prompt="The lazy dog", **settings)
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.text for c in first.choices[3:]] == [c.text for c in alone.choices]
    assert first.usage.prompt_tokens == len(tiny.tokenizer.encode(PROMPT)) + len(tiny.tokenizer.encode("The lazy dog"))


def token_ids(choice) -> list[int]:
    """A choice's token ids, read from log-probabilities asked with ``return_tokens_as_token_ids``."""
    logprobs = choice.logprobs
    tokens = logprobs.tokens if hasattr(logprobs, "tokens") else [entry.token for entry in logprobs.content]
    return [int(token.removeprefix("token_id:")) for token in tokens]


def test_greedy_and_seeded_samples_equal_llm_generate(client, tiny):
    """The server's default speculation (the consensus drafter) gives the samples plain decoding
    gives; a sample's text may only lack what ``decode`` shows of a character cut at the end."""
    ids = tiny.tokenizer.encode(PROMPT)
    exact = {"return_tokens_as_token_ids": True}
    for temperature in (0.0, 0.7):
        want = tiny.generate([ids], SamplingParams(n=3, temperature=temperature, max_tokens=24, seed=5),
                             use_tqdm=False)[0].outputs
        got = client.completions.create(model="tiny", prompt=ids, n=3, max_tokens=24, temperature=temperature, seed=5,
                                        logprobs=0, extra_body=exact)
        assert [token_ids(c) for c in got.choices] == [c.token_ids for c in want], temperature
        assert all(w.text.startswith(c.text) for c, w in zip(got.choices, want))
        assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want)
    want = tiny.chat(CHAT, SamplingParams(n=2, temperature=0.0, max_tokens=16, seed=0), use_tqdm=False)[0].outputs
    got = client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=16, temperature=0.0, seed=0,
                                         logprobs=True, extra_body=exact)
    assert [token_ids(c) for c in got.choices] == [c.token_ids for c in want]


def test_stop_strings_and_stop_token_ids(client, tiny):
    want = tiny.generate([PROMPT], SamplingParams(temperature=0.9, max_tokens=30, seed=2, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    base = dict(model="tiny", prompt=PROMPT, temperature=0.9, max_tokens=30, seed=2)
    token = next(t for t in want.token_ids[3:] if t not in tiny.tokenizer.eos_token_ids)
    got = client.completions.create(extra_body={"stop_token_ids": [token], "ignore_eos": True}, **base)
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == token
    assert got.usage.completion_tokens == want.token_ids.index(token) + 1
    stop = next(ch for ch in want.text[1:] if ch.isascii() and ch.isalnum())
    got = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **base)
    choice = got.choices[0]
    assert choice.text == want.text[:want.text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    # min_tokens past that stop: the server's sample is LLM.generate's, longer than the stopped one
    held = got.usage.completion_tokens + 1
    got = client.completions.create(stop=[stop], extra_body={"ignore_eos": True, "min_tokens": held}, **base)
    expected = tiny.generate([PROMPT], SamplingParams(temperature=0.9, max_tokens=30, seed=2, ignore_eos=True,
                                                      stop=[stop], min_tokens=held), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].text == expected.text and got.usage.completion_tokens == len(expected.token_ids) >= held


def test_echo_scores_a_text_as_evaluation_harnesses_ask(client, tiny):
    """echo with logprobs: the choice's text starts with the prompt, and its log-probabilities
    cover the prompt's tokens (the first None) before the generated ones; with max_tokens 0, the
    prompt alone and no completion tokens. The prompt's figures are LLM.generate's."""
    ids = tiny.tokenizer.encode(PROMPT)
    want = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    for max_tokens in (0, 3):
        got = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        choice = got.choices[0]
        generated = want.outputs[0].token_ids[:max_tokens]
        assert choice.text == PROMPT + (want.outputs[0].text if max_tokens else "")
        assert got.usage.completion_tokens == max_tokens and len(choice.logprobs.tokens) == len(ids) + max_tokens
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        expected = [e[t] for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
        expected += [e[t] for t, e in zip(generated, want.outputs[0].logprobs)]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        if max_tokens:
            assert choice.logprobs.text_offset[len(ids)] == len(PROMPT)
    streamed = client.completions.create(model="tiny", prompt=[ids], echo=True, max_tokens=3, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    texts, _, _ = stream_texts(streamed)
    assert texts[0] == tiny.tokenizer.decode(ids, skip_special_tokens=False) + want.outputs[0].text


def test_scores_continuations_as_lm_eval_asks(server, tiny):
    """What lm-evaluation-harness's ``local-completions`` does for a loglikelihood task: check
    /tokenizer_info and /tokenize (its remote tokenizer), then send a batch of context +
    continuation token lists with echo, max_tokens 1, logprobs 1, temperature 0 and a seed, and
    read each continuation's log-likelihood as the sum of token_logprobs[ctxlen:-1] and "greedy" as
    every such token being the likeliest of its top_logprobs. Both equal LLM.generate's prompt
    log-probabilities and ranks for the same tokens."""
    status, _, body = server.request("GET", "/tokenizer_info")
    assert status == 200 and "eos_token" in json.loads(body)
    status, _, body = server.request("POST", "/tokenize", {"prompt": "test", "add_special_tokens": False})
    assert status == 200 and json.loads(body)["tokens"] == tiny.tokenizer.encode("test", add_special_tokens=False)
    context = tiny.tokenizer.encode(PROMPT, add_special_tokens=False)
    continuations = [tiny.tokenizer.encode(text, add_special_tokens=False) for text in (" jumps over", " is red")]
    payload = {"model": "tiny", "prompt": [context + c for c in continuations], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    status, _, body = server.request("POST", "/v1/completions", payload, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    choices = sorted(json.loads(body)["choices"], key=lambda choice: choice["index"])
    assert len(choices) == 2
    for choice, continuation in zip(choices, continuations):
        ids = context + continuation
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt's, then the one generated
        got = sum(logprobs["token_logprobs"][len(context):-1])
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][len(context):-1],
                                                                logprobs["top_logprobs"][len(context):-1]))
        want = tiny.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        expected = sum(want.prompt_logprobs[i][t] for i, t in enumerate(ids) if i >= len(context))
        assert got == pytest.approx(expected, abs=1e-4)
        assert greedy == all(want.prompt_token_ranks[i] == 1 for i in range(len(context), len(ids)))


def test_truncate_prompt_tokens_runs_a_prompt_past_the_window(client, tiny):
    """A prompt longer than the context window (256) is refused, and runs with its last tokens kept:
    the usage counts those, the sample is LLM.generate's on them."""
    prompt = [(7 * i) % 300 + 5 for i in range(300)]
    base = dict(model="tiny", prompt=prompt, temperature=0.9, max_tokens=4, seed=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**base)
    got = client.completions.create(extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True}, **base)
    want = tiny.generate([prompt[-10:]], SamplingParams(temperature=0.9, max_tokens=4, seed=2, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert got.usage.prompt_tokens == 10 and got.choices[0].text == want.text


def test_logit_bias_and_allowed_token_ids_as_llm_generate(client, tiny):
    """OpenAI's logit_bias (keys are token ids as strings) and vLLM's allowed_token_ids: the
    server's seeded sample is LLM.generate's with the same rule."""
    plain = SamplingParams(temperature=0.9, max_tokens=12, seed=3, ignore_eos=True)
    want = tiny.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0]
    base = dict(model="tiny", prompt=PROMPT, temperature=0.9, max_tokens=12, seed=3)
    rules = [({"logit_bias": {str(want.token_ids[0]): -100, str(want.token_ids[5]): 3}},
              {"logit_bias": {want.token_ids[0]: -100, want.token_ids[5]: 3}}),
             ({"extra_body": {"allowed_token_ids": sorted(set(want.token_ids[:4]))}},
              {"allowed_token_ids": sorted(set(want.token_ids[:4]))})]
    for fields, rule in rules:
        fields.setdefault("extra_body", {})["ignore_eos"] = True
        got = client.completions.create(**fields, **base).choices[0].text
        expected = tiny.generate([PROMPT], SamplingParams(**{**vars(plain), **rule}), use_tqdm=False)[0].outputs[0]
        assert got == expected.text and expected.token_ids != want.token_ids
        if "allowed_token_ids" in rule:
            assert set(expected.token_ids) <= set(rule["allowed_token_ids"])
        else:
            assert expected.token_ids[0] != want.token_ids[0]


def test_chat_template_options_as_llm_chat(client, tiny):
    """vLLM's chat options in the request body: another template with a variable, and the last
    message continued; the seeded sample is ``LLM.chat``'s with the same options."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ tail }}"
    continued = CHAT + [{"role": "assistant", "content": "jumps over"}]
    for messages, options in ((CHAT, {"chat_template": template, "chat_template_kwargs": {"tail": "the"},
                                      "add_generation_prompt": False}),
                              (continued, {"continue_final_message": True, "add_generation_prompt": False})):
        got = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=8, temperature=1.0,
                                             seed=6, logprobs=True, extra_body={"ignore_eos": True, **options,
                                                                                "return_tokens_as_token_ids": True})
        want = tiny.chat(messages, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=6, ignore_eos=True),
                         use_tqdm=False, **options)[0]
        assert [token_ids(c) for c in got.choices] == [c.token_ids for c in want.outputs]
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_echo_puts_the_continued_message_first(client, tiny):
    """vLLM's ``echo`` on chat: where the last message is the assistant's and the answer continues
    it, the content starts with that message's text, whole and streamed; after a user message
    there is nothing to echo. The rest is LLM.chat's seeded text."""
    continued = CHAT + [{"role": "assistant", "content": "jumps over"}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    settings = dict(model="tiny", n=2, max_tokens=8, temperature=1.0, seed=6)
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=6)
    for messages, extra, echoed in ((continued, options, "jumps over"), (CHAT, {}, "")):
        want = [c.text for c in tiny.chat(messages, params, use_tqdm=False, **extra)[0].outputs]
        got = client.chat.completions.create(messages=messages, extra_body={"echo": True, **extra}, **settings)
        assert [c.message.content for c in got.choices] == [echoed + text for text in want]
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(messages=messages, stream=True,
                                                    extra_body={"echo": True, **extra}, **settings):
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
        assert streamed == {i: echoed + text for i, text in enumerate(want)}


class Animal(pydantic.BaseModel):
    animal: Literal["fox", "dog"]
    legs: int


def test_structured_outputs_through_the_official_client(client, tiny):
    """OpenAI's ``response_format`` (a pydantic model through the client's ``parse``, and
    ``json_object``), vLLM's ``structured_outputs`` and an older ``guided_choice``: every finished
    answer follows its constraint, and a seeded sample is LLM.generate's with the same one (the
    server drafts with consensus, so drafted rows are masked by their paths there too)."""
    parsed = client.beta.chat.completions.parse(model="tiny", messages=CHAT, n=4, temperature=0.8, seed=1,
                                                max_completion_tokens=120, response_format=Animal)
    finished = [c for c in parsed.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(c.message.parsed, Animal) for c in finished)
    objects = client.chat.completions.create(model="tiny", messages=CHAT, n=4, temperature=0.8, seed=1,
                                             max_completion_tokens=120, response_format={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in objects.choices if c.finish_reason == "stop")
    schema = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}}, "required": ["animal"],
              "additionalProperties": False}
    for fields, rule in (({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                          {"json": schema, "disable_any_whitespace": True}),
                         ({"guided_choice": ["quick brown fox", "lazy dog"]},
                          {"choice": ["quick brown fox", "lazy dog"]})):
        got = client.completions.create(model="tiny", prompt=PROMPT, n=6, max_tokens=40, temperature=1.0, seed=2,
                                        extra_body=fields)
        want = tiny.generate([PROMPT], SamplingParams(n=6, max_tokens=40, temperature=1.0, seed=2,
                                                      structured_outputs=rule), use_tqdm=False)[0].outputs
        assert [c.text for c in got.choices] == [c.text for c in want]
        assert all(c.finish_reason == "stop" for c in want)
        streamed, _, _ = stream_texts(client.completions.create(
            model="tiny", prompt=PROMPT, n=6, max_tokens=40, temperature=1.0, seed=2, stream=True, extra_body=fields))
        assert streamed == {c.index: c.text for c in got.choices}
        if "choice" in rule:
            assert {c.text for c in want} <= set(rule["choice"])
        else:
            assert all(json.loads(c.text)["animal"] in ("fox", "dog") and " " not in c.text for c in want)


ANIMAL_TOOL = {"type": "function", "function": {"name": "record", "description": "Record an animal.", "parameters": {
    "type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}}, "required": ["animal"],
    "additionalProperties": False}}}
COUNT_TOOL = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}}}


def test_forced_tool_calls_through_the_official_client(client, tiny):
    """A named function (what libraries that extract data with function calling send) and
    "required": the answers are tool calls whose arguments follow the functions' schemas, as vLLM
    gives them (content "", finish_reason "stop"); the named call's arguments are LLM.chat's text
    under that schema."""
    settings = dict(model="tiny", messages=CHAT, n=4, temperature=1.0, seed=5, max_tokens=60)
    named = client.chat.completions.create(tools=[ANIMAL_TOOL, COUNT_TOOL], **settings,
                                           tool_choice={"type": "function", "function": {"name": "record"}})
    want = tiny.chat(CHAT, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=60, structured_outputs={
        "json": ANIMAL_TOOL["function"]["parameters"]}), use_tqdm=False)[0].outputs
    for choice, expected in zip(named.choices, want):
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "record" and call.id.startswith("chatcmpl-tool-")
        assert call.function.arguments == expected.text and choice.message.content == ""
        if choice.finish_reason == "stop":
            assert json.loads(call.function.arguments)["animal"] in ("fox", "dog")
    required = client.chat.completions.create(tools=[ANIMAL_TOOL, COUNT_TOOL], tool_choice="required",
                                              **{**settings, "max_tokens": 120})
    parsed = [c for c in required.choices if c.message.tool_calls]
    assert parsed and all(c.finish_reason == "stop" for c in parsed)
    for choice in parsed:
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, set(arguments)) in (("record", {"animal"}), ("count", {"n"}))


HERMES_CALL = r'Checking\.<tool_call>\{"name": "record", "arguments": \{"animal": "(fox|dog)"\}\}</tool_call>'


@pytest.mark.parametrize("answer", [HERMES_CALL, r"No call (needed|today)\."], ids=["call", "text"])
def test_auto_tool_calls_read_with_the_hermes_parser(client, tiny, answer):
    """tool_choice "auto" on a server started with --enable-auto-tool-choice --tool-call-parser
    hermes: the model's own <tool_call> blocks (here a regex makes the tiny model write one, or
    none) are read out of its text into message.tool_calls, the text before them is the content and
    finish_reason is "tool_calls"; an answer without calls stays text. Streamed, the content and
    the calls joined are the same. The sampled text is LLM.chat's under the same regex (reading
    it changes nothing drawn)."""
    settings = dict(model="tiny", messages=CHAT, n=4, temperature=1.0, seed=3, max_tokens=120, tools=[ANIMAL_TOOL],
                    extra_body={"structured_outputs": {"regex": answer}})
    whole = client.chat.completions.create(**settings)
    want = tiny.chat(CHAT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, skip_special_tokens=False,
                                          structured_outputs={"regex": answer}), use_tqdm=False)[0].outputs
    for choice, expected in zip(whole.choices, want):
        assert expected.finish_reason == "stop"
        if answer == HERMES_CALL:
            (call,) = choice.message.tool_calls
            assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
            assert call.function.name == "record" and call.id.startswith("chatcmpl-tool-")
            assert expected.text.endswith(call.function.arguments + "}</tool_call>")
        else:
            assert choice.message.content == expected.text and not choice.message.tool_calls
            assert choice.finish_reason == "stop"
    content: dict[int, str] = {}
    calls: dict[int, list] = {}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **settings):
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            calls.setdefault(choice.index, []).extend(
                (piece.function.name, piece.function.arguments) for piece in choice.delta.tool_calls or [])
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    for choice in whole.choices:
        assert content[choice.index] == (choice.message.content or "")
        assert calls[choice.index] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert finishes[choice.index] == choice.finish_reason


def test_forced_tool_calls_streamed(client):
    """Streamed, forced tool calls arrive as delta.tool_calls: a named function's arguments piece by
    piece (the first piece with the call's id, type and name), "required"'s calls each whole once
    its object closes; no content. Joined, they are the calls the same seeded request answers
    unstreamed, and every token's log-probability is streamed."""
    settings = dict(model="tiny", messages=CHAT, n=4, temperature=1.0, seed=5, max_tokens=120,
                    tools=[ANIMAL_TOOL, COUNT_TOOL], logprobs=True, top_logprobs=1)
    for tool_choice in ({"type": "function", "function": {"name": "record"}}, "required"):
        whole = client.chat.completions.create(tool_choice=tool_choice, **settings)
        calls: dict[int, dict[int, list]] = {}
        finishes = {}
        pieces = 0
        logprobs: dict[int, list] = {}
        for chunk in client.chat.completions.create(tool_choice=tool_choice, stream=True, **settings):
            for choice in chunk.choices:
                assert not choice.delta.content
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
                for piece in choice.delta.tool_calls or []:
                    pieces += 1
                    held = calls.setdefault(choice.index, {})
                    if piece.index not in held:
                        assert piece.id.startswith("chatcmpl-tool-") and piece.type == "function"
                        held[piece.index] = [piece.function.name, ""]
                    else:
                        assert piece.id is None and piece.function.name is None
                    held[piece.index][1] += piece.function.arguments
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
        assert finishes == {c.index: c.finish_reason for c in whole.choices}
        for choice in whole.choices:  # every token's log-probability streamed, those of held-back text too
            assert [e.token for e in logprobs[choice.index]] == [e.token for e in choice.logprobs.content]
            if choice.message.tool_calls:
                want = [[call.function.name, call.function.arguments] for call in choice.message.tool_calls]
                assert [calls[choice.index][i] for i in sorted(calls[choice.index])] == want
        if tool_choice != "required":
            assert pieces > sum(len(calls[i]) for i in calls)  # arguments came in several pieces


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 8])
def test_chat_n_samples_streamed_or_not_with_logprobs(client, n, stream):
    settings = dict(model="tiny", messages=CHAT, n=n, max_completion_tokens=10, temperature=1.0, seed=4,
                    logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**settings)
    assert [c.index for c in whole.choices] == list(range(n))
    assert all(c.message.role == "assistant" for c in whole.choices)
    assert all(len(entry.top_logprobs) == 2 for c in whole.choices for entry in c.logprobs.content)
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)
    if stream:
        texts, finishes, tails = stream_texts(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **settings))
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
        assert tails[0].usage == whole.usage


def test_metrics_count_requests_tokens_and_speculation(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=5)
    samples = server.metrics()
    assert samples['multispec_requests_total{endpoint="/v1/completions",outcome="ok"}'] >= 1
    assert samples["multispec_generation_tokens_total"] >= 10
    assert samples["multispec_step_seconds_count"] >= 1
    for name in ("multispec_tau", "multispec_draft_acceptance_rate", "multispec_requests_waiting",
                 "multispec_requests_running", "multispec_samples_running", "multispec_prompt_tokens_total"):
        assert name in samples
    assert samples["multispec_engine_healthy"] == 1.0


def test_usage_counts_prompt_tokens_from_the_prefix_cache(server, client, tiny):
    """A prompt sent again (or continued) computes only what the cache did not hold: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` says how many, and the metrics count them."""
    prompt = "Seven violet herons fold the river maps of Ulm"
    length = len(tiny.tokenizer.encode(prompt))
    before = server.metrics()["multispec_prefix_cache_hits_total"]
    first, again = (client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
                    for _ in range(2))
    cached = [out.usage.prompt_tokens_details.cached_tokens for out in (first, again)]
    assert cached[0] < length // 2 and cached[1] == length - 1  # (the first may share a token or so)
    assert again.choices[0].text == first.choices[0].text
    assert server.metrics()["multispec_prefix_cache_hits_total"] - before == sum(cached)
    chats = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt + " twice"}],
                                            max_tokens=2, temperature=0) for _ in range(2)]
    assert chats[1].usage.prompt_tokens_details.cached_tokens == chats[1].usage.prompt_tokens - 1


def test_tokenize_and_detokenize_as_vllm(server, tiny):
    """vLLM's /tokenize (a prompt, or a chat through the template and its options), /detokenize and
    /tokenizer_info: the ids the completions and chat endpoints run on, their text back, and the
    special tokens and template a client tokenizing through the server reads; bad bodies are 400s
    naming the field."""
    status, _, body = server.request("POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    out = json.loads(body)
    assert status == 200 and out["tokens"] == tiny.tokenizer.encode(PROMPT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256 and out["token_strs"] == [tiny.tokenizer.id_to_token(t) for t in out["tokens"]]
    status, _, body = server.request("POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    rendered = tiny.tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert status == 200 and json.loads(body)["tokens"] == tiny.tokenizer.encode(rendered, add_special_tokens=False)
    status, _, body = server.request("POST", "/detokenize", {"tokens": out["tokens"]})
    text = tiny.tokenizer.decode(out["tokens"], skip_special_tokens=False)
    assert status == 200 and json.loads(body)["prompt"] == text
    status, _, body = server.request("GET", "/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == tiny.tokenizer.special_tokens["eos_token"]
    assert info["chat_template"] == tiny.tokenizer.chat_template and info["model_max_length"] == 256
    assert info["add_bos_token"] == (tiny.tokenizer.encode("a")[0] == tiny.tokenizer.bos_token_id)
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
                             ("/detokenize", {"tokens": [10**6]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                             ("/tokenize", {"messages": CHAT, "chat_template": "{% if %}"}, "chat_template")):
        status, _, body = server.request("POST", path, bad)
        assert status == 400 and json.loads(body)["error"]["param"] == param, (path, bad, body)


def test_prompt_logprobs_in_vllms_shape(client, tiny):
    """vLLM's prompt_logprobs: per prompt token (None for the first) its log-probability, its rank
    in the vocabulary and its text, and the k likeliest ranked 1 to k, keyed by token id; on each
    completion choice, and once on a chat response. The figures are LLM.generate's, and a rank is
    the count of likelier tokens plus one at that position."""
    ids = tiny.tokenizer.encode(PROMPT)
    want = tiny.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=ids, n=2, max_tokens=2, extra_body={"prompt_logprobs": 2})
    for choice in got.choices:
        block = choice.model_extra["prompt_logprobs"]
        assert len(block) == len(ids) and block[0] is None
        for position, (token, entry) in enumerate(zip(ids[1:], block[1:]), 1):
            ranked = sorted(want.prompt_logprobs[position].items(), key=lambda item: -item[1])[:2]
            assert entry[str(token)]["rank"] == want.prompt_token_ranks[position]
            assert entry[str(token)]["logprob"] == pytest.approx(want.prompt_logprobs[position][token])
            assert entry[str(token)]["decoded_token"] == tiny.tokenizer.decode([token], skip_special_tokens=False)
            for rank, (t, lp) in enumerate(ranked, 1):
                assert entry[str(t)]["logprob"] == pytest.approx(lp) and entry[str(t)]["rank"] == (
                    rank if t != token else want.prompt_token_ranks[position])
            assert set(entry) == {str(token)} | {str(t) for t, _ in ranked}
    for position in (1, len(ids) // 2, len(ids) - 1):  # the rank itself, from the model's logits
        logits = last_logits(tiny, ids[:position])
        assert want.prompt_token_ranks[position] == int((logits > logits[ids[position]]).sum()) + 1
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    block = chat.model_extra["prompt_logprobs"]
    assert block[0] is None and all(len(entry) == 1 for entry in block[1:])
    for bad in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="stream=true"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
