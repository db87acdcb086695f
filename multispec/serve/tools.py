"""Tool calls in a chat answer: what the request asks for (``ToolMode``), and the calls read out
of the text, whole or as it streams.

Forced calls ("required", a named function) are constrained text (``sampling.tool_constraint``);
"auto" leaves the model free and reads its own tool-call format out of the answer with a parser
the server is started with (``multispec serve --enable-auto-tool-choice --tool-call-parser NAME``,
vLLM's flags). Reading never changes what is sampled, so every mode is exact under speculation.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Literal

from multispec.serve.schemas import DeltaFunctionCall, DeltaToolCall


@dataclass(frozen=True)
class ToolMode:
    """How a chat answer holds tool calls: ``named`` (the text is the arguments of ``name``),
    ``required`` (a JSON list of ``{"name", "parameters"}``) or ``auto`` (the model's own format,
    read by ``parser``)."""

    kind: Literal["named", "required", "auto"]
    name: str | None = None
    parser: str | None = None


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id when the
    call is sent back in the next turn."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class ForcedToolStream:
    """A streamed answer's forced tool calls, as the text arrives. A named function: the text is
    its arguments, sent as it comes (the first piece with the call's id and name). "required": the
    text is a JSON list of ``{"name", "parameters"}``, and each call is sent whole once its object
    closes (a list cut short by max_tokens keeps the calls it completed)."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.pending: list[DeltaToolCall] = []
        self.sent = 0
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.start = 0

    def feed(self, text: str) -> None:
        if not text:
            return
        if self.mode.kind == "named":
            first = self.sent == 0
            self.pending.append(DeltaToolCall(index=0, id=call_id() if first else None,
                                              type="function" if first else None,
                                              function=DeltaFunctionCall(name=self.mode.name if first else None,
                                                                         arguments=text)))
            self.sent = 1
            return
        offset = len(self.text)
        self.text += text
        for i, char in enumerate(text, offset):  # the list's depth-1 objects, strings skipped
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = i
            elif char in "]}":
                self.depth -= 1
                if self.depth == 1:
                    self._complete(self.text[self.start:i + 1])

    def _complete(self, text: str) -> None:
        try:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["parameters"], ensure_ascii=False)
        except (ValueError, TypeError, KeyError):
            return
        self.pending.append(DeltaToolCall(index=self.sent, id=call_id(), type="function",
                                          function=DeltaFunctionCall(name=name, arguments=arguments)))
        self.sent += 1

    def finish(self) -> None:
        pass

    def take(self) -> tuple[str, list[DeltaToolCall]]:
        """No content (the whole text is calls), and the pieces of calls since the last take."""
        pieces, self.pending = self.pending, []
        return "", pieces


class _CallStream:
    """What the streams of "auto" answers share: the content released and the calls read since the
    last ``take``, each call sent whole with an id of its parser's kind."""

    def __init__(self, parser):
        self.parser = parser
        self.content: list[str] = []
        self.pending: list[DeltaToolCall] = []
        self.sent = 0

    def _send(self, name: str, arguments: str, given_id: str | None = None) -> None:
        self.pending.append(DeltaToolCall(index=self.sent, id=given_id or self.parser.new_id(), type="function",
                                          function=DeltaFunctionCall(name=name, arguments=arguments)))
        self.sent += 1

    def take(self) -> tuple[str, list[DeltaToolCall]]:
        """The content released and the calls read since the last take."""
        text, calls = "".join(self.content), self.pending
        self.content, self.pending = [], []
        return text, calls


class HermesParser:
    """The Hermes format (Qwen2.5, Hermes 2/3 and others): each call is a JSON object
    ``{"name", "arguments"}`` between ``<tool_call>`` and ``</tool_call>``; the text before the
    first call is the content. As vLLM's ``hermes`` parser reads it: the last call may be left
    unclosed at the end, and a call that does not parse leaves the whole answer as content."""

    start, end = "<tool_call>", "</tool_call>"
    _blocks = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
    new_id = staticmethod(call_id)

    def stream(self) -> AutoToolStream:
        return AutoToolStream(self)

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments as JSON text)]); no calls: (text, [])."""
        if self.start not in text:
            return text, []
        calls = []
        for closed, open_ in self._blocks.findall(text):
            call = self.call(closed or open_)
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.index(self.start)]
        return content or None, calls

    @staticmethod
    def call(block: str) -> tuple[str, str] | None:
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if not isinstance(name, str):
            return None
        return name, _json_text(arguments)


class Llama3JsonParser:
    """Llama 3's JSON format (Llama 3.1-3.3, with the tool template that asks for JSON): an answer
    that calls tools is nothing but calls, each a JSON object ``{"name", "parameters"}`` (or
    ``"arguments"``), several separated by ``;``, after an optional ``<|python_tag|>``. As vLLM's
    ``llama3_json`` parser streams it: an answer that begins otherwise is content; one whose
    objects do not all parse as calls is content whole."""

    tag = "<|python_tag|>"
    _decoder = json.JSONDecoder()
    new_id = staticmethod(call_id)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)

    def calls_start(self, text: str) -> int | None:
        """Where the calls begin (after the tag and whitespace) if ``text`` is calls, None if it
        is content; -1 while too little has come to tell."""
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        elif self.tag.startswith(body):
            return -1
        if not body:
            return -1
        return len(text) - len(body) if body[0] == "{" else None

    @staticmethod
    def next_object(text: str, at: int) -> int:
        """Where the object after ``text[:at]`` starts: past whitespace and one ``;``."""
        rest = text[at:].lstrip()
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        return len(text) - len(rest)

    def call(self, text: str, at: int) -> tuple[tuple[str, str] | None, int]:
        """The call whose object starts at ``text[at]`` and where the object ends; (None, -1)
        where no whole object starts there (yet) or it is no call."""
        try:
            call, end = self._decoder.raw_decode(text, at)
        except ValueError:
            return None, -1
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not (
                "parameters" in call or "arguments" in call):
            return None, -1
        return (call["name"], _json_text(call["parameters"] if "parameters" in call else call["arguments"])), end

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(None, [(name, arguments as JSON text)]) where the answer is calls; else (text, [])."""
        at = self.calls_start(text)
        if at is None or at < 0:
            return text, []
        calls = []
        while at < len(text):
            call, end = self.call(text, at)
            if call is None:
                return text, []
            calls.append(call)
            at = self.next_object(text, end)
        return None, calls


class Llama3JsonStream(_CallStream):
    """A streamed "auto" answer in Llama 3's JSON format: held back until its first characters say
    whether it is calls (``Llama3JsonParser.calls_start``); content is then released as it comes,
    and calls are sent whole, each once its object closes. Where a later object is no call, the
    text from it on arrives as content at the end (the whole answer would be all content: a stream
    cannot take back the calls it sent)."""

    def __init__(self, parser: Llama3JsonParser):
        super().__init__(parser)
        self.buffer = ""
        self.start: int | None = -1  # where the calls begin; None: the answer is content
        self.at = 0  # the end of the last call sent (or where the calls begin)

    def feed(self, text: str) -> None:
        released = len(self.buffer) if self.start is None else None
        self.buffer += text
        if self.start is None:
            self.content.append(self.buffer[released:])
            return
        if self.start < 0:
            self.start = self.parser.calls_start(self.buffer)
            if self.start is None:
                self.content.append(self.buffer)
                return
            if self.start < 0:
                return
            self.at = self.start
        while True:
            begin = self.parser.next_object(self.buffer, self.at) if self.sent else self.at
            if begin >= len(self.buffer):
                return
            call, end = self.parser.call(self.buffer, begin)
            if call is None:
                return
            self._send(*call)
            self.at = end

    def finish(self) -> None:
        """The answer ended: what is held back (an object that never closed or is no call, an
        answer too short to tell) is content: the whole text where no call was sent."""
        if self.start is None:
            return
        rest = self.buffer[self.parser.next_object(self.buffer, self.at):] if self.sent else self.buffer
        if rest:
            self.content.append(rest)


def _json_text(arguments) -> str:
    """A call's arguments as JSON text (those a model wrote as a string are that text already)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class MistralParser:
    """Mistral's format: the content, then ``[TOOL_CALLS]`` and the calls, either a JSON list of
    ``{"name", "arguments"}`` (Mistral 7B v0.3 and the tokenizers before v11) or, from v11 on,
    ``name[ARGS]{arguments}`` after each ``[TOOL_CALLS]`` (v13 on: ``name[CALL_ID]id[ARGS]{...}``,
    the call's id written by the model, which the call then keeps). As vLLM's ``mistral`` parser
    reads them: calls that do not parse leave the whole answer as content. Call ids are nine
    letters and digits, as Mistral's templates require of the calls sent back (an id the model
    writes otherwise is replaced by one)."""

    tag, args_tag, id_tag = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _decoder = json.JSONDecoder()
    new_id = staticmethod(mistral_call_id)

    def stream(self) -> MistralStream:
        return MistralStream(self)

    def parse(self, text: str) -> tuple[str | None, list[tuple]]:
        """(content before the calls or None, [(name, arguments as JSON text[, id the model wrote])]);
        no calls: (text, [])."""
        before, opened, after = text.partition(self.tag)
        calls = self.calls(after) if opened else None
        if not calls:
            return text, []
        return before or None, calls

    def calls(self, text: str) -> list[tuple] | None:
        """The calls written after the first ``[TOOL_CALLS]``, or None where they do not parse."""
        if self.args_tag in text:
            calls = []
            for body in text.split(self.tag):
                head, opened, arguments = body.partition(self.args_tag)
                name, _, given_id = head.partition(self.id_tag)
                try:
                    parsed = self._decoder.raw_decode(arguments.strip())[0] if opened and name.strip() else None
                except ValueError:
                    return None
                if not isinstance(parsed, dict):
                    return None
                given_id = given_id.strip()
                valid = len(given_id) == 9 and given_id.isascii() and given_id.isalnum()
                calls.append((name.strip(), _json_text(parsed), *([given_id] if valid else [])))
            return calls
        try:
            listed = self._decoder.raw_decode(text.replace(self.tag, "").strip())[0]
        except ValueError:
            return None
        listed = [listed] if isinstance(listed, dict) else listed
        if not isinstance(listed, list) or not all(
                isinstance(call, dict) and isinstance(call.get("name"), str) for call in listed):
            return None
        return [(call["name"], _json_text(call.get("arguments", {}))) for call in listed]


class MistralStream(_CallStream):
    """A streamed "auto" answer in Mistral's format: the content is released as it comes (a tail
    that may open ``[TOOL_CALLS]`` held back); from the tag on the text is held and read when the
    answer ends, into calls, or into content where they do not parse (so the pieces join to the
    whole answer's reading)."""

    def __init__(self, parser: MistralParser):
        super().__init__(parser)
        self.buffer = ""
        self.released = 0
        self.opened: int | None = None  # where [TOOL_CALLS] starts, once seen

    def feed(self, text: str) -> None:
        self.buffer += text
        if self.opened is not None:
            return
        found = self.buffer.find(self.parser.tag, self.released)
        upto = found if found >= 0 else len(self.buffer) - _partial(self.buffer, self.parser.tag, self.released)
        self.content.append(self.buffer[self.released:upto])
        self.released = upto
        if found >= 0:
            self.opened = found

    def finish(self) -> None:
        if self.opened is None:
            self.content.append(self.buffer[self.released:])
            return
        calls = self.parser.calls(self.buffer[self.opened + len(self.parser.tag):])
        if not calls:
            self.content.append(self.buffer[self.opened:])
            return
        for call in calls:
            self._send(*call)


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
"""``--tool-call-parser`` names."""


class AutoToolStream(_CallStream):
    """A streamed "auto" answer read as it arrives: its content (the text before the first call) is
    released as it comes, except a tail that could be the start of a call's opening tag; each
    call is sent whole once its closing tag arrives (or the answer ends inside it). A call that
    does not parse is released as text (whole, such an answer is all text: a stream cannot take
    back the calls it sent before)."""

    def __init__(self, parser: HermesParser):
        super().__init__(parser)
        self.buffer = ""
        self.at = 0  # how much of the buffer is released or sent
        self.inside = self.called = False

    def feed(self, text: str) -> None:
        self.buffer += text
        start, end = self.parser.start, self.parser.end
        while True:
            if not self.inside:
                found = self.buffer.find(start, self.at)
                if found < 0:
                    self._release(len(self.buffer) - _partial(self.buffer, start, self.at))
                    return
                self._release(found)
                self.at, self.inside, self.called = found + len(start), True, True
            found = self.buffer.find(end, self.at)
            if found < 0:
                return
            self._call(self.at - len(start), self.buffer[self.at:found], found + len(end))

    def finish(self) -> None:
        """The answer ended: an open call is read as it stands, a held-back tail released."""
        if self.inside:
            self._call(self.at - len(self.parser.start), self.buffer[self.at:], len(self.buffer))
        self._release(len(self.buffer))

    def _call(self, opened: int, block: str, after: int) -> None:
        call = self.parser.call(block)
        if call is None:
            self.content.append(self.buffer[opened:after])
        else:
            self._send(*call)
        self.at, self.inside = after, False

    def _release(self, upto: int) -> None:
        """Text up to ``upto`` is content; once a call has begun, text between calls is not (as
        in the whole answer, whose content is the text before the first call)."""
        if upto > self.at:
            if not self.called:
                self.content.append(self.buffer[self.at:upto])
            self.at = upto


def _partial(text: str, tag: str, start: int) -> int:
    """The length of the longest tail of ``text[start:]`` that ``tag`` begins with (held back)."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - size:]):
            return size
    return 0


class DeepSeekR1Reasoning:
    """Reasoning models' thinking (DeepSeek-R1 and its distillations, QwQ and others that think
    between ``<think>`` and ``</think>``), split from the answer as vLLM's ``deepseek_r1`` parser
    splits it: the text up to ``</think>`` is the reasoning (an opening ``<think>`` and anything
    before it dropped; templates often write the opening tag into the prompt), the rest the
    content; without ``</think>`` the whole text is reasoning (the answer was cut short while
    thinking)."""

    start, end = "<think>", "</think>"
    reads_enable_thinking = False
    """Whether the request's ``chat_template_kwargs.enable_thinking`` says if the model thinks."""

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        """False: the request turned thinking off, and the whole answer is content."""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), each None where empty."""
        if not self.thinking:
            return None, text or None
        before, opened, after = text.partition(self.start)
        text = after if opened else before
        if self.end not in text:
            return text or None, None
        reasoning, _, content = text.partition(self.end)
        return reasoning or None, content or None


class Qwen3Reasoning(DeepSeekR1Reasoning):
    """Qwen3's thinking, split as vLLM's ``qwen3`` parser splits it: as ``deepseek_r1`` (Qwen3
    writes ``<think>`` itself, later templates put it in the prompt), except that a request with
    ``chat_template_kwargs: {"enable_thinking": false}`` (the template then closes an empty
    thinking block in the prompt) has no reasoning: its whole answer is content."""

    reads_enable_thinking = True


REASONING_PARSERS = {"deepseek_r1": DeepSeekR1Reasoning, "qwen3": Qwen3Reasoning}
"""``--reasoning-parser`` names."""


class ReasoningStream:
    """A streamed answer split into reasoning and content as it arrives, each delta's text looked at
    once: the tags are searched for in the new text only (less a tail that could be the start of
    one, held back), and each take gives what the text adds to either part. The pieces join to the
    split of the whole answer, but for text a model writes before an opening tag (the whole answer
    drops it; a stream has sent it) or tags in an order no thinking model writes (an opening tag
    after the closing one)."""

    def __init__(self, parser: DeepSeekR1Reasoning):
        self.parser = parser
        self.text = ""
        self.looked = 0  # the text before this holds no tag still to find
        self.begin = 0  # where the thinking starts (after an opening tag, once one is seen)
        self.opened = False
        self.closed: int | None = None  # where the closing tag starts, once seen
        self.sent = [0, 0]  # how far into the text the reasoning and the content have been sent
        self.ended = False

    def feed(self, text: str) -> None:
        self.text += text

    def finish(self) -> None:
        self.ended = True

    def take(self) -> tuple[str, str]:
        """The reasoning and the content the text adds since the last take."""
        text, start, end = self.text, self.parser.start, self.parser.end
        if not self.parser.thinking:
            content, self.sent[1] = text[self.sent[1]:], len(text)
            return "", content
        upto = len(text) - (0 if self.ended else max(_partial(text, tag, 0) for tag in (start, end)))
        if self.closed is None:
            if not self.opened and (found := text.find(start, self.looked, upto)) >= 0:
                self.opened, self.begin = True, found + len(start)
            if (found := text.find(end, max(self.begin, self.looked), upto)) >= 0:
                self.closed = found
            self.looked = max(self.looked, upto - len(end) + 1, 0)
        thinking_end = upto if self.closed is None else self.closed
        reasoning = text[max(self.sent[0], self.begin):thinking_end]
        self.sent[0] = max(self.sent[0], thinking_end)
        content = ""
        if self.closed is not None:
            after = max(self.sent[1], self.closed + len(end))
            content = text[after:upto]
            self.sent[1] = max(after, upto)
        return reasoning, content
