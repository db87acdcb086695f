"""Every refusal is OpenAI's error body with the right status and the field named in ``param``;
none is FastAPI's 422 or a pydantic traceback, and none harms the server."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve.conftest import API_KEY, MAX_N, MAX_REQUEST_BYTES, MAX_TOKENS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS = [
    ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"), ({"n": "many"}, "n"),
    ({"temperature": -0.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": "low"}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"max_tokens": 255, "prompt": "Hello world! The quick brown fox"}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"stop": ""}, "stop"), ({"stop": ["ok", ""]}, "stop"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"), ({"seed": 2**64}, "seed"),
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"), ({"prompt": [1] * 300}, "prompt"), ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": None}, "prompt"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"speculation": {"drafter": "oracle"}}, "speculation"), ({"speculation": {"depth": 3}}, "speculation"),
    ({"speculation": {"scheme": "greedy"}, "temperature": 1.0}, "speculation"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"), ({"echo": "loud"}, "echo"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "word"}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -3}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"skip_special_tokens": "maybe"}, "skip_special_tokens"),
    ({"guided_regex": "(ab"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{bad"}, "guided_json"), ({"guided_grammar": "start: missing"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"schema": {}}}, "structured_outputs"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"echo": "loud"}, "echo"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"n": 0}, "n"), ({"temperature": -1}, "temperature"), ({"stop": [""]}, "stop"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL, TOOL], "tool_choice": "none"}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"continue_final_message": True}, "continue_final_message"), ({"add_generation_prompt": "maybe"},
                                                                    "add_generation_prompt"),
    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ({"chat_template": "{% if %}"}, "chat_template"),
    ({"chat_template": ""}, "chat_template"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
]


def check_error(status: int, body: bytes, want_status: int, param: str | None) -> dict:
    error = json.loads(body)["error"]
    assert status == want_status, error
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert "Traceback" not in error["message"] and "detail" not in json.loads(body)
    return error


@pytest.mark.parametrize("fields, param", BAD_COMPLETIONS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_fields_are_400_naming_the_field(server, fields, param):
    body = {"model": "tiny", "prompt": "hi", **fields}
    check_error(*server.request("POST", "/v1/completions", body, AUTH)[::2], 400, param)


@pytest.mark.parametrize("fields, param", BAD_CHAT, ids=[p + str(i) for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_fields_are_400_naming_the_field(server, fields, param):
    body = {"model": "tiny", "messages": CHAT, **fields}
    check_error(*server.request("POST", "/v1/chat/completions", body, AUTH)[::2], 400, param)


def test_the_official_client_sees_the_same_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=CHAT, top_p=2.0)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="hi")
    assert caught.value.status_code == 404 and caught.value.body["param"] == "model"


def test_malformed_bodies_are_400_never_422(server):
    for raw in (b'{"prompt": "hi",', b"[1, 2]", b"", b"\xff\xfe"):
        status, _, body = server.request("POST", "/v1/completions", raw, AUTH)
        check_error(status, body, 400, None)


def test_unknown_model_is_404(server):
    body = {"model": "gpt-4", "messages": CHAT}
    error = check_error(*server.request("POST", "/v1/chat/completions", body, AUTH)[::2], 404, "model")
    assert error["code"] == "model_not_found"


def test_api_key_is_needed_on_v1_only(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            status, reply_headers, body = server.request(method, path, {"prompt": "hi"}, headers)
            assert check_error(status, body, 401, None)["type"] == "authentication_error"
            assert reply_headers.get("WWW-Authenticate") == "Bearer"
    for path in ("/health", "/version", "/metrics"):
        assert server.request("GET", path)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert client.models.list().data


def test_oversized_bodies_are_413_whether_sized_or_chunked(server):
    big = json.dumps({"model": "tiny", "prompt": "x" * MAX_REQUEST_BYTES}).encode()
    check_error(*server.request("POST", "/v1/completions", big, AUTH)[::2], 413, None)
    chunks = iter([big[i:i + 8192] for i in range(0, len(big), 8192)])
    check_error(*server.request("POST", "/v1/completions", chunks, AUTH)[::2], 413, None)
    assert server.request("GET", "/health")[0] == 200


def test_refusals_are_counted_and_leave_the_server_healthy(server, client):
    samples = server.metrics()
    assert samples['multispec_rejected_requests_total{status="400"}'] >= len(BAD_COMPLETIONS) + len(BAD_CHAT)
    assert samples['multispec_rejected_requests_total{status="401"}'] >= 6
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).choices[0].finish_reason
