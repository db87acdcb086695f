"""How tool calls are read out of an answer's text: forced ones as they stream
(``ForcedToolStream``), and the model's own (``tool_choice`` "auto") with the Hermes parser, whole
and streamed (``HermesParser``, ``AutoToolStream``)."""

from __future__ import annotations

import json

import pytest

from multispec.serve.tools import AutoToolStream, ForcedToolStream, HermesParser, ToolMode

REQUIRED = ToolMode("required")
CALLS = [{"name": "note", "parameters": {"text": 'a "}]" and {[ \\" \\\\'}},
         {"name": "sum", "parameters": {"terms": [1, {"k": [2, 3]}], "empty": {}}},
         {"name": "none", "parameters": {}}]


def streamed(mode: ToolMode, text: str, size: int) -> tuple[list, list[int]]:
    """The pieces the stream gives for ``text`` fed ``size`` characters at a time, and after how
    many characters each piece came."""
    stream, pieces, when = ForcedToolStream(mode), [], []
    for start in range(0, len(text), size):
        stream.feed(text[start:start + size])
        content, taken = stream.take()
        assert content == ""
        pieces += taken
        when += [start + size] * len(taken)
    return pieces, when


def test_required_calls_come_whole_as_each_object_closes_whatever_the_pieces():
    """Brackets and escaped quotes inside strings do not end a call; each call is sent once, whole,
    as soon as the text holds its closing brace, however the text was cut into deltas."""
    text = json.dumps(CALLS, ensure_ascii=False)
    ends = [text.index(json.dumps(call, ensure_ascii=False)) + len(json.dumps(call, ensure_ascii=False))
            for call in CALLS]
    for size in (1, 2, 3, 7, len(text)):
        pieces, when = streamed(REQUIRED, text, size)
        assert [(p.index, p.function.name, json.loads(p.function.arguments)) for p in pieces] == [
            (i, call["name"], call["parameters"]) for i, call in enumerate(CALLS)]
        assert all(p.id.startswith("chatcmpl-tool-") and p.type == "function" for p in pieces)
        assert len({p.id for p in pieces}) == len(CALLS)
        assert all(end <= got < end + size for end, got in zip(ends, when))


def test_required_list_cut_short_keeps_the_calls_it_completed():
    text = json.dumps(CALLS)
    cut = text.index('{"name": "none"') + 5
    pieces, _ = streamed(REQUIRED, text[:cut], 4)
    assert [p.function.name for p in pieces] == ["note", "sum"]


def test_named_arguments_stream_as_they_come():
    pieces, _ = streamed(ToolMode("named", "record"), '{"animal": "fox"}', 5)
    assert "".join(p.function.arguments for p in pieces) == '{"animal": "fox"}'
    first, *rest = pieces
    assert first.index == 0 and first.function.name == "record" and first.id.startswith("chatcmpl-tool-")
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None and p.type is None for p in rest)


HERMES_CALLS = [("note", {"text": "a <tool_call> tag inside a string"}), ("sum", {"terms": [1, 2]})]
HERMES_TEXT = "Let me look.\n" + "".join(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n'
                                         '</tool_call>\n' for name, arguments in HERMES_CALLS)


def streamed_auto(text: str, size: int) -> tuple[str, list]:
    stream, content, calls = AutoToolStream(HermesParser()), "", []
    for start in range(0, len(text), size):
        stream.feed(text[start:start + size])
        piece, taken = stream.take()
        content, calls = content + piece, calls + taken
    stream.finish()
    piece, taken = stream.take()
    return content + piece, calls + taken


BAD = 'Bad: <tool_call>{"name": "f", "arguments": </tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    (HERMES_TEXT, "Let me look.\n", HERMES_CALLS),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # unclosed at the end
    ("No calls here, though < and <tool are written.", "No calls here, though < and <tool are written.", []),
    (BAD, BAD, []),
])
def test_hermes_calls_read_whole_and_streamed(text, content, calls):
    """Whole: the content before the first call and each call's name and arguments (a call left
    unclosed at the end counts; one that does not parse leaves the answer as text). Streamed in
    pieces of any size: the same content (a tail that may open a call is held back, never shown
    as text) and the same calls, each whole."""
    got_content, got_calls = HermesParser().parse(text)
    assert got_content == content and [(n, json.loads(a)) for n, a in got_calls] == calls
    for size in (1, 2, 5, 11, len(text)):
        streamed_content, pieces = streamed_auto(text, size)
        assert streamed_content == (content or "") and [p.index for p in pieces] == list(range(len(calls)))
        assert [(p.function.name, json.loads(p.function.arguments)) for p in pieces] == calls
