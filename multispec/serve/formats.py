"""How completions and chat completions present samples: the response, its stream chunks and the
log-probabilities, in OpenAI's (and vLLM's) shapes.

Both endpoints run the same way (``multispec.serve.generation``); only these shapes differ. A
format turns one sample's delta (new text, token ids, log-probabilities, a finish reason) into a
chunk choice, and a finished ``Choice`` (the deltas gathered) into a response choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from pydantic import BaseModel

from multispec.params import CompletionOutput, RequestOutput
from multispec.serve.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionLogprobs,
                                     CompletionResponse, Delta, FunctionCall, PromptLogprob, TokenLogprob, ToolCall,
                                     TopLogprob)
from multispec.serve.tools import (REASONING_PARSERS, TOOL_PARSERS, AutoToolStream, ForcedToolStream,
                                   Llama3JsonStream, MistralStream, ReasoningStream, ToolMode, call_id)


@dataclass
class Choice:
    """One sample's deltas gathered: its text, token count, log-probabilities and finish."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: BaseModel | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0
    echoed: bool = False
    prompt_logprobs: list | None = None
    calls: ForcedToolStream | AutoToolStream | Llama3JsonStream | MistralStream | None = None
    """A streamed answer's tool calls so far (where the request has a ``ToolMode``)."""
    thinking: ReasoningStream | None = None
    """A streamed answer's split into reasoning and content (a server with a reasoning parser)."""
    shown: tuple[str, str] = ("", "")
    """The reasoning and content of the last delta, as its chunk shows them."""

    def add(self, delta: CompletionOutput, logprobs: BaseModel | None) -> None:
        self.text.append(delta.text)
        self.tokens += len(delta.token_ids)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if logprobs is None:
            return
        if self.logprobs is None:
            self.logprobs = logprobs
            return
        for name in type(logprobs).model_fields:  # every field of a log-probability block is a list
            getattr(self.logprobs, name).extend(getattr(logprobs, name))


class CompletionFormat:
    endpoint = "/v1/completions"
    id_prefix = "cmpl"

    def __init__(self, tokenizer, top_logprobs: int | None, token_ids: bool = False, echo: list[str] | None = None,
                 generate: bool = True, prompt_logprobs: int | None = None):
        """``echo``: each prompt's text, put before its choices' text (with ``top_logprobs``, the
        prompt tokens' log-probabilities before theirs); ``generate`` False: the generated token
        is left out (echo with max_tokens 0); ``prompt_logprobs``: vLLM's, that many top ones."""
        self.tokenizer = tokenizer
        self.text = _token_text(tokenizer)
        self.token_text = _token_id if token_ids else self.text
        self.top_logprobs = top_logprobs
        self.echo = echo
        self.generate = generate
        self.prompt_logprobs = prompt_logprobs

    def opening(self, response_id: str, created: int, model: str, choices: int) -> list[BaseModel]:
        return []

    def present(self, prompt: int, out: RequestOutput, delta: CompletionOutput,
                choice: Choice) -> tuple[CompletionOutput, CompletionLogprobs | None]:
        """The delta as the choice shows it, and its log-probabilities: with echo, a choice's
        first delta starts with its prompt."""
        if not self.generate:
            delta = replace(delta, text="", token_ids=[], logprobs=None if delta.logprobs is None else [])
        _keep_prompt_logprobs(self.prompt_logprobs, out, choice, self.token_text)
        if self.echo is None or choice.echoed:
            return delta, self.logprobs(delta, choice)
        choice.echoed = True
        block = None
        if self.top_logprobs is not None and out.prompt_logprobs is not None:
            # The prompt tokens' offsets from the prompt decoded as a whole (a token alone may
            # read otherwise); the generated tokens' start after the echoed text.
            stream = self.tokenizer.stream(skip_special_tokens=False)
            block = self._block(out.prompt_token_ids, out.prompt_logprobs, choice,
                                [len(stream(token)) for token in out.prompt_token_ids])
            choice.text_offset = len(self.echo[prompt])
            after = self.logprobs(delta, choice)
            if after is not None:
                for name in type(block).model_fields:
                    getattr(block, name).extend(getattr(after, name))
        elif self.top_logprobs is not None:
            block = self.logprobs(delta, choice)
        return replace(delta, text=self.echo[prompt] + delta.text), block

    def logprobs(self, delta: CompletionOutput, choice: Choice) -> CompletionLogprobs | None:
        """Tokens as text, their log-probabilities, the top ones by text, and where each token's
        text starts in the choice's text (as vLLM reports them)."""
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        return self._block(delta.token_ids, delta.logprobs, choice)

    def _block(self, tokens: list[int], entries: list, choice: Choice,
               lengths: list[int] | None = None) -> CompletionLogprobs:
        """The block of these tokens; ``lengths``: each token's text length, where known better
        than by decoding it alone."""
        block = CompletionLogprobs()
        for i, (token, entry) in enumerate(zip(tokens, entries)):
            block.tokens.append(self.token_text(token))
            block.token_logprobs.append(None if entry is None else entry[token])
            block.top_logprobs.append(None if entry is None else {
                self.token_text(t): lp for t, lp in _top(entry, token, self.top_logprobs)})
            block.text_offset.append(choice.text_offset)
            choice.text_offset += lengths[i] if lengths is not None else len(self.text(token))
        return block

    def chunk(self, response_id: str, created: int, model: str, index: int, delta: CompletionOutput,
              logprobs: BaseModel | None, choice: Choice) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[CompletionChoice(
            index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason)])

    def tail(self, response_id: str, created: int, model: str, **extra) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[], **extra)

    def response(self, response_id: str, created: int, model: str, choices: list[Choice],
                 **extra) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[
            CompletionChoice(index=i, text="".join(c.text), logprobs=c.logprobs, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason, prompt_logprobs=c.prompt_logprobs)
            for i, c in enumerate(choices)], **extra)


class ChatFormat:
    endpoint = "/v1/chat/completions"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, top_logprobs: int | None, token_ids: bool = False,
                 prompt_logprobs: int | None = None, tool_mode: ToolMode | None = None,
                 reasoning_parser: str | None = None, thinking: bool = True, echo: str = ""):
        """``tool_mode``: how the answers hold tool calls; ``reasoning_parser``: how their reasoning
        is split from the content (``multispec.serve.tools``; the calls are read from the content);
        ``thinking``: False where the request turned the model's thinking off (all content);
        ``echo``: text each answer's content starts with (``sampling.chat_echo``)."""
        self.token_text = _token_id if token_ids else _token_text(tokenizer)
        self.top_logprobs = top_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.tool_mode = tool_mode
        self.reasoning_parser = reasoning_parser
        self.thinking = thinking
        self.echo = echo

    def present(self, prompt: int, out: RequestOutput, delta: CompletionOutput,
                choice: Choice) -> tuple[CompletionOutput, ChatLogprobs | None]:
        _keep_prompt_logprobs(self.prompt_logprobs, out, choice, self.token_text)
        reasoning, content = "", delta.text
        if self.reasoning_parser is not None:
            if choice.thinking is None:
                choice.thinking = ReasoningStream(REASONING_PARSERS[self.reasoning_parser](self.thinking))
            choice.thinking.feed(delta.text)
            if delta.finish_reason is not None:
                choice.thinking.finish()
            reasoning, content = choice.thinking.take()
        choice.shown = (reasoning, content)
        if self.tool_mode is not None:
            if choice.calls is None:
                mode = self.tool_mode
                choice.calls = TOOL_PARSERS[mode.parser]().stream() if mode.kind == "auto" else ForcedToolStream(mode)
            choice.calls.feed(content)
        return delta, self.logprobs(delta, choice)

    def opening(self, response_id: str, created: int, model: str, choices: int) -> list[BaseModel]:
        """Each choice's first chunk carries the role only, as OpenAI's and vLLM's streams do; with
        ``echo``, a second one the echoed text."""
        chunks = [ChatCompletionChunk(id=response_id, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(choices)]
        if self.echo:
            chunks += [ChatCompletionChunk(id=response_id, created=created, model=model, choices=[
                ChatChunkChoice(index=i, delta=Delta(content=self.echo))]) for i in range(choices)]
        return chunks

    def logprobs(self, delta: CompletionOutput, choice: Choice) -> ChatLogprobs | None:
        """Each token's text, bytes and log-probability, with the ``top_logprobs`` likeliest tokens."""
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        content = []
        for token, entry in zip(delta.token_ids, delta.logprobs):
            top = sorted(entry.items(), key=lambda item: -item[1])[:self.top_logprobs]
            content.append(TokenLogprob(**self._entry(token, entry[token]).model_dump(),
                                        top_logprobs=[self._entry(t, lp) for t, lp in top]))
        return ChatLogprobs(content=content)

    def _entry(self, token: int, logprob: float) -> TopLogprob:
        text = self.token_text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def chunk(self, response_id: str, created: int, model: str, index: int, delta: CompletionOutput,
              logprobs: BaseModel | None, choice: Choice) -> ChatCompletionChunk | None:
        """The delta's chunk; where the answer holds tool calls, the content and the pieces of
        calls it completes (None where it completes nothing, finishes nothing and carries no
        log-probabilities)."""
        finish = delta.finish_reason
        reasoning, content = choice.shown
        if choice.calls is None and choice.thinking is None:
            shown = Delta(content=content)
        else:
            pieces = []
            if choice.calls is not None:
                if finish is not None:
                    choice.calls.finish()
                content, pieces = choice.calls.take()
            if not reasoning and not content and not pieces and finish is None and logprobs is None:
                return None
            shown = Delta(reasoning=reasoning or None, content=content or None, tool_calls=pieces or None)
            if finish is not None and self.tool_mode is not None and self.tool_mode.kind == "auto" \
                    and choice.calls.sent:
                finish = "tool_calls"
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[ChatChunkChoice(
            index=index, delta=shown, logprobs=logprobs, finish_reason=finish, stop_reason=delta.stop_reason)])

    def tail(self, response_id: str, created: int, model: str, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], **extra)

    def response(self, response_id: str, created: int, model: str, choices: list[Choice],
                 **extra) -> ChatCompletionResponse:
        messages = [self._message("".join(c.text)) for c in choices]
        for message in messages:  # as vLLM: the echo goes before the content, whatever the answer holds
            if self.echo:
                message.content = self.echo + (message.content or "")
        return ChatCompletionResponse(id=response_id, created=created, model=model, choices=[
            ChatChoice(index=i, message=message, logprobs=c.logprobs, stop_reason=c.stop_reason,
                       finish_reason="tool_calls" if self.tool_mode is not None and self.tool_mode.kind == "auto"
                       and message.tool_calls else c.finish_reason)
            for i, (c, message) in enumerate(zip(choices, messages))],
            prompt_logprobs=choices[0].prompt_logprobs if choices else None, **extra)

    def _message(self, text: str) -> AssistantMessage:
        """The answer as text, or as tool calls, as vLLM gives them: a named function's arguments
        are the text; "required" parses the list (a list cut short by max_tokens stays text);
        "auto" reads the model's calls with the server's parser (the text before them is the
        content; finish_reason "tool_calls"). With a reasoning parser, the thinking is
        ``reasoning`` and the rest is read as above."""
        reasoning = None
        if self.reasoning_parser is not None:  # as vLLM: no content after the thinking is null
            reasoning, content = REASONING_PARSERS[self.reasoning_parser](self.thinking).split(text)
            text = content or ""
        whole = text or None if self.reasoning_parser is not None else text
        mode = self.tool_mode
        if mode is None:
            return AssistantMessage(content=whole, reasoning=reasoning)
        if mode.kind == "auto":
            parser = TOOL_PARSERS[mode.parser]()
            content, calls = parser.parse(text)
            if not calls:
                return AssistantMessage(content=whole, reasoning=reasoning)
            # A call may carry the id its model wrote (Mistral's [CALL_ID]); the others get the parser's kind.
            tool_calls = [_tool_call(name, arguments, *given or [parser.new_id()]) for name, arguments, *given in calls]
            return AssistantMessage(content=content, tool_calls=tool_calls, reasoning=reasoning)
        if mode.kind == "named":
            return AssistantMessage(content="", tool_calls=[_tool_call(mode.name, text)], reasoning=reasoning)
        try:
            calls = [_tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                     for call in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return AssistantMessage(content=whole, reasoning=reasoning)
        return AssistantMessage(content="", tool_calls=calls, reasoning=reasoning)


def _tool_call(name: str, arguments: str, id: str | None = None) -> ToolCall:
    return ToolCall(id=id or call_id(), function=FunctionCall(name=name, arguments=arguments))


def _top(entry: dict[int, float], token: int, k: int | None) -> list[tuple[int, float]]:
    """The entry's ``k`` likeliest tokens (all of them where k is None) and ``token``'s own."""
    ranked = sorted(entry.items(), key=lambda item: -item[1])
    kept = ranked if k is None else ranked[:k]
    return kept + [(token, entry[token])] if token not in dict(kept) else kept


def _keep_prompt_logprobs(asked: int | None, out: RequestOutput, choice: Choice, token_text) -> None:
    """vLLM's ``prompt_logprobs`` of a choice's prompt, kept once: per prompt token (None for the
    first) the token's entry with its rank in the vocabulary, and the ``asked`` likeliest, ranked
    1 to ``asked``, keyed by token id."""
    if asked is None or choice.prompt_logprobs is not None or out.prompt_logprobs is None:
        return
    block = []
    for token, entry, rank in zip(out.prompt_token_ids, out.prompt_logprobs, out.prompt_token_ranks):
        if entry is None:
            block.append(None)
            continue
        ordered = sorted(entry.items(), key=lambda item: -item[1])[:asked]  # the engine's top ones and the token
        kept = {t: PromptLogprob(logprob=lp, rank=i + 1, decoded_token=token_text(t))
                for i, (t, lp) in enumerate(ordered)}
        kept[token] = PromptLogprob(logprob=entry[token], rank=rank, decoded_token=token_text(token))
        block.append({str(t): value for t, value in kept.items()})
    choice.prompt_logprobs = block


def _token_text(tokenizer):
    """One token as text, special tokens included (a lone piece of a multi-byte character shows as U+FFFD)."""
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def _token_id(token: int) -> str:
    """A token named by its id, which text cannot always do (``return_tokens_as_token_ids``)."""
    return f"token_id:{token}"
