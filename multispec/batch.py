"""``multispec batch``: n completions for every request of a JSONL file, here or on a Ray cluster.

Each input line is a JSON object with ``prompt`` (text) or ``messages`` (a chat, given the
model's template, with the template's options ``CHAT_OPTIONS``), optionally sampling fields
overriding the command line's (``OVERRIDES``, and a constraint on the text in any of the server's
spellings), and any ``id``; keys that would change the output in a way the engine does not offer
(the server's ``UNSUPPORTED``: beam search, ...) or that a line cannot carry (``NOT_IN_LINES``:
prompt log-probabilities, streaming, tools) are refused unless they ask for nothing, and other keys
are ignored. Each output line, in input order, holds the request's
``index`` (its line among the requests, from 0), its ``id`` when it had one, the completions
(text, token count, finish reason) and the token usage. The whole file is checked before any
model is loaded: a bad line is named, with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from multispec.api import chat_options
from multispec.cli import _add_model_args, _add_sampling_args, _add_spec_args, _sampling, _spec, model_options
from multispec.distributed import add_ray_arguments, map_with_llm, ray_options
from multispec.params import SamplingParams, SpecConfig
from multispec.serve.errors import APIError
from multispec.serve.sampling import STRUCTURED_FIELDS, structured_outputs
from multispec.serve.schemas import unsupported

OVERRIDES = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
             "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "include_stop_str_in_output",
             "skip_special_tokens", "seed", "structured_outputs")
"""Sampling fields a request may set for itself."""
CHAT_OPTIONS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
"""The chat template's options a ``messages`` line may set (as the server's chat requests do)."""
NOT_IN_LINES = {"prompt_logprobs": "output lines hold no log-probabilities", "stream": "output lines are written whole",
                "tools": "output lines hold text, not tool calls",
                "tool_choice": "output lines hold text, not tool calls"}
"""Fields the server takes that a batch line cannot: each with why (refused unless they ask for
nothing: absent, null, false, an empty list or tool_choice "none")."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser)
    _add_sampling_args(parser, n=1, max_tokens=256, temperature=1.0)
    _add_spec_args(parser, drafter="none")
    parser.add_argument("--input", required=True, help="JSONL file: one request per line")
    parser.add_argument("--output", required=True, help="JSONL file to write, one result per request")
    add_ray_arguments(parser)


def run(args: argparse.Namespace) -> int:
    params, spec = _sampling(args), _spec(args)
    requests = read_requests(Path(args.input), params, spec)
    output = Path(args.output)
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: no directory {output.parent}")
    llm_options = {**model_options(args), "spec": spec}
    start = time.perf_counter()
    results = map_with_llm(requests, complete, llm_options, **ray_options(args))
    seconds = time.perf_counter() - start
    with output.open("w", encoding="utf-8") as file:
        for result in results:
            file.write(json.dumps(result) + "\n")
    samples = sum(len(r["completions"]) for r in results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    print(f"multispec: {len(results)} requests, {samples} completions, {tokens} tokens in {seconds:.1f}s "
          f"({tokens / max(seconds, 1e-9):.1f} tokens/s) -> {output}", file=sys.stderr)
    return 0


def read_requests(path: Path, params: SamplingParams, spec: SpecConfig) -> list[dict]:
    """Every request of the file, checked, as rows for ``complete``; a ValueError names a bad line."""
    if not path.is_file():
        raise ValueError(f"--input {path}: no such file")
    requests = []
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                requests.append(_request(line, len(requests), params, spec))
            except ValueError as error:
                raise ValueError(f"--input {path} line {number}: {error}") from None
    if not requests:
        raise ValueError(f"--input {path}: holds no request")
    return requests


def _request(line: str, index: int, params: SamplingParams, spec: SpecConfig) -> dict:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    if ("prompt" in fields) == ("messages" in fields):
        raise ValueError("needs 'prompt' (text) or 'messages' (a chat), exactly one of them")
    name = unsupported(fields) or next((k for k in NOT_IN_LINES if fields.get(k) not in (None, False, [], "none")),
                                       None)
    if name is not None:
        why = NOT_IN_LINES.get(name, "not supported")
        raise ValueError(f"{name}={fields[name]!r}: {why}")
    overrides = {k: fields[k] for k in OVERRIDES if k in fields}
    try:  # OpenAI's response_format and vLLM's guided_* fields too, as the server reads them
        constraint, _ = structured_outputs(SimpleNamespace(**{k: fields.get(k) for k in STRUCTURED_FIELDS}))
    except APIError as error:
        raise ValueError(error.message) from None
    if constraint is not None:
        overrides["structured_outputs"] = constraint
    request = {"index": index, "params": replace(params, **overrides)}
    spec.check_temperature(request["params"].temperature)
    if "id" in fields:
        request["id"] = fields["id"]
    if "prompt" in fields:
        if not isinstance(fields["prompt"], str) or not fields["prompt"]:
            raise ValueError(f"prompt={fields['prompt']!r:.80}: must be a non-empty string")
        request["prompt"] = fields["prompt"]
    else:
        request["messages"] = _messages(fields["messages"])
        request["chat"] = chat_options(fields.get("chat_template"), fields.get("add_generation_prompt", True),
                                       fields.get("continue_final_message", False), fields.get("chat_template_kwargs"))
    if "prompt" in fields and any(k in fields for k in CHAT_OPTIONS):
        raise ValueError(f"{next(k for k in CHAT_OPTIONS if k in fields)}: applies to 'messages' lines only")
    return request


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"messages={messages!r:.80}: must be a non-empty list of {{'role': ..., 'content': ...}} "
                         f"objects with string values")
    return messages


def complete(llm, requests: list[dict]) -> list[dict]:
    """The ``map_with_llm`` worker: plain prompts in one ``generate`` call, chats in one ``chat``
    call, each request with its own sampling parameters; one result per request, in order."""
    outputs = {}
    prompts = [r for r in requests if "prompt" in r]
    chats = [r for r in requests if "messages" in r]
    if prompts:
        done = llm.generate([r["prompt"] for r in prompts], [r["params"] for r in prompts], use_tqdm=False)
        outputs.update(zip((r["index"] for r in prompts), done))
    if chats:  # each rendered with its own template options, as LLM.chat renders them
        ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(r["messages"], **r["chat"]),
                                    add_special_tokens=False) for r in chats]
        done = llm.generate(ids, [r["params"] for r in chats], use_tqdm=False)
        outputs.update(zip((r["index"] for r in chats), done))
    return [_result(r, outputs[r["index"]]) for r in requests]


def _result(request: dict, output) -> dict:
    completions = [{"text": c.text, "tokens": len(c.token_ids), "finish_reason": c.finish_reason}
                   for c in output.outputs]
    generated = sum(c["tokens"] for c in completions)
    prompt = len(output.prompt_token_ids)
    result = {"index": request["index"]}
    if "id" in request:
        result["id"] = request["id"]
    result["completions"] = completions
    result["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if output.error:
        result["error"] = output.error
    return result
