"""Request and response bodies of the OpenAI-compatible API, with vLLM's field names.

Requests: every field is optional where OpenAI's is, and ``None`` (an explicit JSON null
included) means the default. Types are checked here; values (ranges, limits) are checked by
``multispec.serve.sampling`` and ``SamplingParams`` so that each error names its field. Fields
nobody declared are kept in ``model_extra`` to be logged and ignored, as vLLM does, except the
known ones whose effect the engine does not offer (``UNSUPPORTED``), which are refused unless
they ask for nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UNSUPPORTED: dict[str, tuple] = {
    # OpenAI's
    "echo": (False,), "best_of": (1,), "suffix": ("",), "functions": ([],),
    "function_call": ("none", "auto"),
    # vLLM's extras
    "use_beam_search": (False,), "length_penalty": (1,),
    "logits_processors": ([],),
}
"""Fields that would change the output and that the engine does not implement, with the values
that ask for nothing (None always does; an empty tuple: only None)."""


def unsupported(fields: dict[str, Any]) -> str | None:
    """The first of ``fields`` that asks for something in ``UNSUPPORTED`` (the server and
    ``multispec batch`` refuse it), or None."""
    return next((name for name, value in fields.items()
                 if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]), None)


def _omit_none():
    return Field(default=None, exclude_if=lambda value: value is None)


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's log-probability, with that many top ones (not with streaming)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's: ``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``{"type":
    "json_object"}`` or ``{"type": "text"}``."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: ``StructuredOutputsParams``' fields (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``, ``disable_any_whitespace``)."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older spellings of ``structured_outputs``' fields."""
    return_tokens_as_token_ids: bool | None = None
    """Log-probabilities name tokens as ``token_id:<id>`` instead of their text (vLLM's extra)."""
    speculation: dict[str, Any] | None = None
    """Overrides of the server's ``SpecConfig`` fields for this request (``{"drafter": "none"}``)."""
    user: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    """The prompt's text before each choice's (with ``logprobs``, the prompt tokens' too, the first
    one's None); with ``max_tokens`` 0, the prompt alone (scoring a text, as evaluation harnesses do)."""


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatTemplateOptions(BaseModel):
    """vLLM's: the chat template's options, as ``LLM.chat`` takes them."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(GenerationRequest, ChatTemplateOptions):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    """With ``tools``: "required" or a named function (``{"type": "function", "function": {"name":
    ...}}``) make the answer tool calls, its arguments constrained to the functions' parameter
    schemas (exact under speculation); "none" renders the tools for the model and calls none;
    "auto" (OpenAI's default with tools) reads the model's own calls out of its text, on a server
    started with ``--enable-auto-tool-choice --tool-call-parser NAME`` (else refused)."""
    parallel_tool_calls: bool | None = None
    echo: bool | None = None
    """vLLM's: the answer's content starts with the last message's, where that message has the
    answer's role (an assistant message the answer continues)."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or ``messages`` (a chat, with the chat template's
    options), exactly one."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes its own)."""
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------- responses
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str



class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose keys and values came from earlier prompts (prefix caching)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SpeculationFigures(BaseModel):
    """How the request's samples speculated: target ``forwards`` its prompts took part in (summed
    over its prompts), ``tau`` (tokens a sample gained per forward), the drafted and accepted
    tokens and their ratio."""

    forwards: int
    tau: float
    acceptance_rate: float
    drafted_tokens: int
    accepted_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: a token's log-probability, its rank in the vocabulary (1: the likeliest)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Per prompt token, its entry and the top ones by token id (None for the first token)."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = _omit_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()
    speculation: SpeculationFigures | None = _omit_none()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = _omit_none()
    """The thinking of a reasoning model (a server with ``--reasoning-parser``), as vLLM names it."""
    tool_calls: list[ToolCall] | None = _omit_none()


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = _omit_none()
    usage: Usage | None = _omit_none()
    speculation: SpeculationFigures | None = _omit_none()


class DeltaFunctionCall(BaseModel):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first piece of call ``index`` carries its id, type and
    name; the pieces' ``arguments`` joined are the call's."""
    index: int
    id: str | None = _omit_none()
    type: Literal["function"] | None = _omit_none()
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: str | None = _omit_none()
    reasoning: str | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[DeltaToolCall] | None = _omit_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()
    speculation: SpeculationFigures | None = _omit_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "multispec"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
