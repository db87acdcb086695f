"""From an API request to what the engine takes: token ids per prompt, ``SamplingParams`` and
``SpecConfig``, every one of them checked before anything runs.

The whole of the engine's own check (``LLMEngine.make_request``) runs here on every prompt, so a
request with one bad prompt runs none and gets a 400 naming the field, never an error half-way
through a stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

from multispec.api import chat_options
from multispec.params import SamplingParams, SpecConfig, StructuredOutputsParams, check_truncation, prompt_tail
from multispec.serve.errors import from_value_error, invalid
from multispec.serve.schemas import (UNSUPPORTED, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                     GenerationRequest, TokenizeRequest, unsupported)
from multispec.serve.tools import ToolMode

log = logging.getLogger("multispec.serve")

MAX_LOGPROBS = 20
"""The most top log-probabilities a token may ask for (vLLM's default limit)."""
COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's and vLLM's default ``max_tokens`` for completions (chat defaults to the rest of the context)."""
SPEC_FIELDS = frozenset(f.name for f in fields(SpecConfig))
LAW_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""The sampling law's fields a model's generation config may give defaults for (OpenAI's defaults
where it gives none)."""


@dataclass
class Limits:
    """The server's per-request limits (``multispec serve --max-n``, ``--max-tokens-limit``)."""

    max_n: int = 64
    max_tokens: int | None = None


@dataclass
class EngineInputs:
    """One request, checked and ready to run: a token-id list per prompt and its settings."""

    prompts: list[list[int]]
    params: SamplingParams
    spec: SpecConfig
    echo: list[str] | None = None
    """Completions with ``echo``: each prompt's text, shown before its choices' text."""
    generate: bool = True
    """False for ``echo`` with ``max_tokens`` 0: the prompt alone is reported (one token is
    generated and left out)."""
    grammar_after: int | None = None
    """The token after which ``params.structured_outputs`` rules (a reasoning model's end of
    thinking, under ``--reasoning-parser``); None: from the first token."""
    grammar_open: bool | None = None
    """Whether the prompt has already passed ``grammar_after`` (see ``LLMEngine.make_request``)."""


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """A string, a list of strings, token ids or a list of token-id lists, as token-id lists."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise invalid("prompt", "prompt is empty: give a string, a list of strings, token ids or a list of them")
    prompts = []
    for i, item in enumerate(prompt):
        ids = tokenizer.encode(item) if isinstance(item, str) and item else item
        if not ids:
            raise invalid("prompt", f"prompt {i} is empty")
        prompts.append(list(ids))
    return prompts


def message_text(message: ChatMessage) -> str:
    """A message's content as text (text parts joined by newlines, as vLLM joins them)."""
    content = message.content
    return "\n".join(part.text for part in content) if isinstance(content, list) else content or ""


def chat_echo(request: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each answer's content, as vLLM: the last message's text where it
    has the answer's role (the assistant's, or the last message's own without a generation
    prompt), else nothing."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt in (None, True) else last.role
    return message_text(last) if last.role == role else ""


def chat_prompt(request: ChatCompletionRequest | TokenizeRequest, tokenizer, chat_template: str | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """The conversation rendered with the request's chat template, else the server's
    (``--chat-template``), else the checkpoint's (text parts of a message are joined by newlines,
    as vLLM does), as token ids."""
    return tokenizer.encode(_render(request, tokenizer.apply_chat_template, chat_template),
                            add_special_tokens=add_special_tokens)


def generation_turn(request: ChatCompletionRequest, tokenizer, chat_template: str | None = None) -> str:
    """The end of the chat prompt's text that belongs to the turn the answer is written into
    (``Tokenizer.generation_turn``)."""
    return _render(request, tokenizer.generation_turn, chat_template)


def _render(request: ChatCompletionRequest | TokenizeRequest, render, chat_template: str | None) -> str:
    """``render(conversation, **options)`` for the request's messages and template options, a
    bad one answered with 400 naming its field."""
    if not request.messages:
        raise invalid("messages", "messages is empty: give at least one message")
    conversation = []
    for message in request.messages:
        extra = {k: v for k, v in (message.model_extra or {}).items() if k in ("tool_calls", "tool_call_id")}
        conversation.append({"role": message.role, "content": message_text(message), "name": message.name, **extra})
    try:
        tools = getattr(request, "tools", None)
        options = chat_options(chat_template if request.chat_template is None else request.chat_template,
                               True if request.add_generation_prompt is None else request.add_generation_prompt,
                               bool(request.continue_final_message), request.chat_template_kwargs,
                               [tool.model_dump(exclude_none=True) for tool in tools] if tools else None)
    except ValueError as error:
        field = next((name for name in ("chat_template_kwargs", "chat_template", "add_generation_prompt")
                      if str(error).startswith(name)), "continue_final_message")
        raise invalid(field, str(error)) from None
    try:
        return render(conversation, **options)
    except ValueError as error:
        field = next((name for name in ("chat_template_kwargs", "continue_final_message")
                      if str(error).startswith(name)), "chat_template" if request.chat_template else "messages")
        raise invalid(field, str(error)) from None


def completion_inputs(request: CompletionRequest, engine, default_spec: SpecConfig, limits: Limits,
                      defaults: dict | None = None) -> EngineInputs:
    if request.logprobs is not None and request.logprobs > MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs={request.logprobs}: at most {MAX_LOGPROBS}")
    prompts = completion_prompts(request.prompt, engine.tokenizer)
    max_tokens = request.max_tokens if request.max_tokens is not None else COMPLETIONS_MAX_TOKENS
    generate = not (request.echo and max_tokens == 0)
    inputs = _inputs(request, prompts, engine, default_spec, limits, max_tokens if generate else 1, request.logprobs,
                     {"max_tokens": "max_tokens", "logprobs": "logprobs", "prompt": "prompt"}, defaults)
    if request.echo:
        # A text prompt is echoed as given; token ids, or a prompt cut to its last tokens, as their text.
        texts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
        inputs.echo = [text if isinstance(text, str) and request.truncate_prompt_tokens is None
                       else engine.tokenizer.decode(ids, skip_special_tokens=False)
                       for text, ids in zip(texts, inputs.prompts)]
        inputs.generate = generate
        if request.logprobs is not None:
            inputs.params = replace(inputs.params, prompt_logprobs=max(request.logprobs,
                                                                       inputs.params.prompt_logprobs or 0))
    return inputs


def chat_inputs(request: ChatCompletionRequest, engine, default_spec: SpecConfig, limits: Limits,
                chat_template: str | None = None, defaults: dict | None = None) -> EngineInputs:
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
        if request.top_logprobs > MAX_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs={request.top_logprobs}: at most {MAX_LOGPROBS}")
    prompts = [chat_prompt(request, engine.tokenizer, chat_template)]
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _inputs(request, prompts, engine, default_spec, limits, max_tokens, logprobs,
                   {"max_tokens": field, "logprobs": "top_logprobs", "prompt": "messages"}, defaults)


def _inputs(request: GenerationRequest, prompts: list[list[int]], engine, default_spec: SpecConfig, limits: Limits,
            max_tokens: int | None, logprobs: int | None, names: dict[str, str],
            defaults: dict | None = None) -> EngineInputs:
    """Settings checked against the server's limits and the context window, then the engine's
    own check on every prompt. ``defaults``: the model's generation config (``LLM.generation_defaults``),
    which fills the sampling fields a request leaves out, and caps ``max_tokens`` where it is left
    to the context window, as vLLM's server does."""
    defaults = defaults or {}
    names = {**names, **{name: "speculation" for name in SPEC_FIELDS}}
    _check_extra_fields(request)
    if request.prompt_logprobs is not None:
        if request.stream:
            raise invalid("prompt_logprobs", "prompt_logprobs are not available with stream=true (as in vLLM)")
        if not 0 <= request.prompt_logprobs <= MAX_LOGPROBS:
            raise invalid("prompt_logprobs", f"prompt_logprobs={request.prompt_logprobs}: must be in [0, "
                                             f"{MAX_LOGPROBS}] (the whole vocabulary, -1, is not offered)")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    n = request.n if request.n is not None else 1
    if n > limits.max_n:
        raise invalid("n", f"n={n}: this server draws at most {limits.max_n} samples per request")
    window = engine.config.max_model_len
    try:
        keep = check_truncation(request.truncate_prompt_tokens)
    except ValueError as error:
        raise invalid("truncate_prompt_tokens", str(error)) from None
    prompts = [prompt_tail(ids, keep, window) for ids in prompts]
    longest = max(len(ids) for ids in prompts)
    if max_tokens is None:
        max_tokens = max(1, min(limits.max_tokens or window, window - longest, defaults.get("max_tokens", window)))
    elif limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(names["max_tokens"], f"{names['max_tokens']}={max_tokens}: this server allows at most "
                                           f"{limits.max_tokens} tokens per sample")
    elif longest < window < longest + max_tokens:
        raise invalid(names["max_tokens"], f"this model's context is {window} tokens, but the prompt has {longest} "
                                           f"and {names['max_tokens']}={max_tokens} asks for more than the rest")
    spec = speculation(default_spec, request.speculation)
    constraint, names["structured_outputs"] = structured_outputs(request)
    law = {**LAW_DEFAULTS, **{name: value for name, value in defaults.items() if name in LAW_DEFAULTS}}
    try:
        params = SamplingParams(
            structured_outputs=constraint, n=n, max_tokens=max_tokens, logprobs=logprobs, seed=request.seed,
            stop=request.stop, stop_token_ids=request.stop_token_ids, prompt_logprobs=request.prompt_logprobs,
            **_given(request, **law, frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False, min_tokens=0,
                     logit_bias=None, allowed_token_ids=None, bad_words=None, truncate_prompt_tokens=None,
                     include_stop_str_in_output=False, skip_special_tokens=True))
        for i, ids in enumerate(prompts):
            name = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            engine.make_request(f"check-{i}", ids, params, spec, name=name)
    except ValueError as error:
        raise from_value_error(error, names, names["prompt"]) from None
    return EngineInputs(prompts, params, spec)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older request fields and the ``StructuredOutputsParams`` field each sets."""
STRUCTURED_FIELDS = ("structured_outputs", "response_format", *GUIDED)
"""Every request field that constrains the text (at most one per request)."""


def structured_outputs(request: GenerationRequest) -> tuple[StructuredOutputsParams | dict | None, str]:
    """The request's constraint on the text and the field that gave it: ``structured_outputs``,
    OpenAI's ``response_format`` or one of vLLM's ``guided_*`` fields (at most one of them)."""
    given = {name: getattr(request, name) for name in STRUCTURED_FIELDS if getattr(request, name) is not None}
    tools = tool_constraint(request) if isinstance(request, ChatCompletionRequest) else None
    if isinstance(request.response_format, dict) and request.response_format.get("type") == "text":
        given.pop("response_format")
    if len(given) > 1 or (given and tools is not None):
        first, second = list(given)[:2] if len(given) > 1 else ("tool_choice", next(iter(given)))
        raise invalid(second, f"{first} and {second} both constrain the text: give one of them")
    if tools is not None:
        return tools, "tool_choice"
    if not given:
        return None, "structured_outputs"
    (name, value), = given.items()
    if name in GUIDED:
        return {GUIDED[name]: value}, name
    if name == "structured_outputs":
        return value, name
    if not isinstance(value, dict):
        raise invalid(name, f"response_format={value!r:.80}: must be an object with a 'type'")
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}, name
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, str)):
            raise invalid(name, "response_format.json_schema must be an object whose 'schema' is a JSON schema")
        return {"json": schema["schema"]}, name
    raise invalid(name, f"response_format.type={kind!r}: must be 'text', 'json_object' or 'json_schema'")


def _tool_choice(request: ChatCompletionRequest) -> tuple[list, str | dict]:
    """The request's tools and its tool_choice, OpenAI's default where it gives none ("auto" with
    tools, else "none")."""
    tools = request.tools or []
    return tools, request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")


def tool_mode(request: ChatCompletionRequest, parser: str | None = None) -> ToolMode | None:
    """How the answer holds tool calls: None (text: no tools, or tool_choice "none"), a named
    function's arguments, "required"'s list, or "auto": the model's own format, read with the
    server's ``--tool-call-parser`` (without one, "auto" is refused, as in vLLM)."""
    tools, choice = _tool_choice(request)
    if choice == "required":
        return ToolMode("required")
    if isinstance(choice, dict):
        return ToolMode("named", (choice.get("function") or {}).get("name"))
    if choice == "auto" and tools:
        if parser is None:
            raise invalid("tool_choice", "tool_choice='auto' (the default with tools) reads the model's own tool-call "
                                         "format, which needs the server started with --enable-auto-tool-choice "
                                         "--tool-call-parser NAME (as vLLM); or give tool_choice='required', a named "
                                         "function {'type': 'function', 'function': {'name': ...}}, or 'none'")
        return ToolMode("auto", parser=parser)
    return None


def tool_constraint(request: ChatCompletionRequest) -> dict | None:
    """The constraint ``tools`` and ``tool_choice`` put on the answer, as vLLM builds it: a named
    function's arguments follow its parameter schema; "required" is a non-empty JSON list of
    ``{"name", "parameters"}``, each as one of the functions declares; None for "none" and "auto"."""
    tools, choice = _tool_choice(request)
    if choice != "none" and not tools:
        raise invalid("tool_choice", f"tool_choice={choice!r} needs tools")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names) or not all(names):
        raise invalid("tools", "tools: each function needs a name, and the names must differ")
    if choice == "none":
        return None
    if choice == "auto":  # unconstrained: the calls are read out of the text (``tool_mode``)
        return None
    if choice == "required":
        return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                              "parameters": tool.function.parameters or {"type": "object"}},
             "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]}}}
    name = tool_mode(request).name
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise invalid("tool_choice", f"tool_choice={choice!r:.80}: must be 'none', 'required' or "
                                     f"{{'type': 'function', 'function': {{'name': ...}}}}")
    tool = next((tool for tool in tools if tool.function.name == name), None)
    if tool is None:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
    return {"json": tool.function.parameters or {"type": "object"}}


def _check_extra_fields(request: GenerationRequest) -> None:
    """Log the fields nobody declared and ignore them, as vLLM does; refuse those that would change
    the output in a way the engine does not offer."""
    extra = request.model_extra or {}
    name = unsupported(extra)
    if name is not None:
        raise invalid(name, f"{name}={extra[name]!r}: not supported by this server")
    ignored = sorted(set(extra) - set(UNSUPPORTED))
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored))


def _given(request: GenerationRequest, **defaults) -> dict:
    """Each named field's value, or its default where the request left it out or sent null."""
    return {name: default if getattr(request, name) is None else getattr(request, name)
            for name, default in defaults.items()}


def speculation(default: SpecConfig, overrides: dict | None) -> SpecConfig:
    """The server's speculation settings with the request's overrides (checked by ``SpecConfig``)."""
    if not overrides:
        return default
    unknown = sorted(set(overrides) - SPEC_FIELDS)
    if unknown:
        raise invalid("speculation", f"speculation: unknown field(s) {', '.join(unknown)}; the fields are "
                                     f"{', '.join(sorted(SPEC_FIELDS))}")
    if "draft_model" in overrides:
        # A path on the server's disk is the server's business, not a client's.
        raise invalid("speculation", "speculation.draft_model is chosen when the server starts (--draft-model), "
                                     "not per request")
    if "max_draft_nodes" not in overrides and {"max_draft_tokens", "num_candidates"} & set(overrides):
        overrides = {**overrides, "max_draft_nodes": None}  # resolved again from the new depth and width
    try:
        return replace(default, **overrides)
    except ValueError as error:
        raise invalid("speculation", f"speculation: {error}") from None
