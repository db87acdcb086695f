"""``multispec batch`` in this process on the tiny model, and its bad input (the Ray path is in
test_distributed.py)."""

from __future__ import annotations

import json

import pytest

from multispec import cli
from multispec.params import SamplingParams


def write_requests(path, *lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def batch(model, requests, output, *extra) -> int:
    return cli.main(["batch", "--model", str(model), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory",
                     "0.05", "--input", requests, "--output", str(output), *extra])


def test_every_request_gets_its_completions_in_order(successor_dir, tiny, tmp_path, capsys):
    chat = [{"role": "user", "content": "The quick brown fox"}]
    requests = write_requests(
        tmp_path / "in.jsonl",
        {"id": "first", "prompt": "Hello world", "seed": 3},
        "",
        {"messages": chat, "n": 3, "max_tokens": 4, "seed": 4, "answer": "ignored"},
        {"id": 7, "prompt": "def f(x):", "temperature": 0, "use_beam_search": False},
        {"prompt": "Hello world", "seed": 3, "top_k": 1, "stop": ["o"]},
        {"prompt": "Hello world", "seed": 5, "logit_bias": {"17": 100}, "min_tokens": 3, "stop": ["o"],
         "include_stop_str_in_output": True},
        {"prompt": "Hello world", "allowed_token_ids": [17, 18], "truncate_prompt_tokens": 1},
        {"prompt": "Hello world", "seed": 6, "max_tokens": 20, "structured_outputs": {"choice": ["brown fox", "dog"]}},
        {"messages": chat, "seed": 4, "max_tokens": 20, "guided_choice": ["lazy dog", "fox"],
         "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %} is", "add_generation_prompt": False},
    )
    assert batch(successor_dir, requests, tmp_path / "out.jsonl", "--n", "2", "--max-tokens", "6") == 0
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [r.get("id") for r in results] == ["first", None, 7, None, None, None, None, None]
    assert [len(r["completions"]) for r in results] == [2, 3, 2, 2, 2, 2, 2, 2]
    assert all(c["text"] in ("brown fox", "dog") and c["finish_reason"] == "stop" for c in results[6]["completions"])
    assert results[5]["usage"]["prompt_tokens"] == 1
    assert all(c["tokens"] <= 4 for c in results[1]["completions"])
    for result in results:
        usage = result["usage"]
        assert usage["completion_tokens"] == sum(c["tokens"] for c in result["completions"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    expected = tiny.chat(chat, SamplingParams(n=3, max_tokens=4, seed=4), use_tqdm=False)[0]
    assert [c["text"] for c in results[1]["completions"]] == [c.text for c in expected.outputs]
    greedy = results[2]["completions"]
    assert greedy[0]["text"] == greedy[1]["text"]
    top_one = tiny.generate(["Hello world"], SamplingParams(n=2, max_tokens=6, seed=3, top_k=1, stop=["o"]),
                            use_tqdm=False)[0]
    assert [c["text"] for c in results[3]["completions"]] == [c.text for c in top_one.outputs]
    ruled = tiny.generate(["Hello world"], SamplingParams(n=2, max_tokens=6, seed=5, logit_bias={17: 100}, min_tokens=3,
                                                          stop=["o"], include_stop_str_in_output=True),
                          use_tqdm=False)[0]
    assert [c["text"] for c in results[4]["completions"]] == [c.text for c in ruled.outputs]
    # a chat line's own template and options, and vLLM's older guided_choice: LLM.chat's samples
    templated = tiny.chat(chat, SamplingParams(n=2, max_tokens=20, seed=4, structured_outputs={
        "choice": ["lazy dog", "fox"]}), chat_template="{% for m in messages %}{{ m.content }}{% endfor %} is",
                          add_generation_prompt=False, use_tqdm=False)[0]
    assert [c["text"] for c in results[7]["completions"]] == [c.text for c in templated.outputs]
    assert results[7]["usage"]["prompt_tokens"] == len(templated.prompt_token_ids)
    assert "8 requests, 17 completions" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object, got list"),
    ({"text": "hi"}, "line 2: needs 'prompt' (text) or 'messages'"),
    ({"prompt": "hi", "messages": []}, "line 2: needs 'prompt'"),
    ({"prompt": ""}, "line 2: prompt=''"),
    ({"messages": [{"role": "user"}]}, "line 2: messages="),
    ({"prompt": "hi", "n": 0}, "line 2: n=0"),
    ({"prompt": "hi", "temperature": -1}, "line 2: temperature=-1"),
    ({"prompt": "hi", "seed": "one"}, "line 2: seed='one'"),
    ({"prompt": "hi", "top_p": 0}, "line 2: top_p=0"), ({"prompt": "hi", "min_p": 2}, "line 2: min_p=2"),
    ({"prompt": "hi", "use_beam_search": True}, "line 2: use_beam_search=True: not supported"),
    ({"prompt": "hi", "frequency_penalty": 3}, "line 2: frequency_penalty=3"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "line 2: min_tokens=5"),
    ({"prompt": "hi", "logit_bias": {"a": 1}}, "line 2: logit_bias={'a': 1}"),
    ({"prompt": "hi", "structured_outputs": {"regex": "(ab"}}, "line 2: structured_outputs.regex: "),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "line 2: response_format.type='xml'"),
    ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "line 2: guided_regex and guided_choice both"),
    ({"prompt": "hi", "prompt_logprobs": 1}, "line 2: prompt_logprobs=1: output lines hold no log-probabilities"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "line 2: tools=[{'type': 'function', 'function': {'name': 'f'}}]: output lines hold"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "line 2: tool_choice='required'"),
    ({"prompt": "hi", "chat_template_kwargs": {"x": 1}}, "line 2: chat_template_kwargs: applies to 'messages' lines"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "line 2: continue_final_message=True needs add_generation_prompt=False"),
])
def test_a_bad_line_is_named(line, message, tmp_path, capsys):
    requests = write_requests(tmp_path / "in.jsonl", {"prompt": "fine"}, line)
    assert batch("no-such-model", requests, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("case", ["missing input", "empty input", "no output directory", "unreachable ray"])
def test_bad_files_and_addresses_are_one_line_errors(case, tmp_path, capsys):
    requests = write_requests(tmp_path / "in.jsonl", {"prompt": "hi"})
    output, extra, named = tmp_path / "out.jsonl", [], "in.jsonl"
    if case == "missing input":
        requests = str(tmp_path / "nope.jsonl")
        named = "nope.jsonl: no such file"
    elif case == "empty input":
        requests = write_requests(tmp_path / "in.jsonl", "", "  ")
        named = "holds no request"
    elif case == "no output directory":
        output, named = tmp_path / "missing" / "out.jsonl", "missing"
    else:
        pytest.importorskip("ray")
        extra, named = ["--ray", "127.0.0.1:1"], "127.0.0.1:1"
    assert batch("no-such-model", requests, output, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("multispec: error:") and named in err and len(err.splitlines()) == 1
