"""How streamed forced tool calls are cut out of the answer's text (``ToolCallStream``)."""

from __future__ import annotations

import json

from multispec.serve.formats import ToolCallStream

CALLS = [{"name": "note", "parameters": {"text": 'a "}]" and {[ \\" \\\\'}},
         {"name": "sum", "parameters": {"terms": [1, {"k": [2, 3]}], "empty": {}}},
         {"name": "none", "parameters": {}}]


def streamed(mode: str, text: str, size: int) -> tuple[list, list[int]]:
    """The pieces the stream gives for ``text`` fed ``size`` characters at a time, and after how
    many characters each piece came."""
    stream, pieces, when = ToolCallStream(mode), [], []
    for start in range(0, len(text), size):
        stream.feed(text[start:start + size])
        taken = stream.take()
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
        pieces, when = streamed("required", text, size)
        assert [(p.index, p.function.name, json.loads(p.function.arguments)) for p in pieces] == [
            (i, call["name"], call["parameters"]) for i, call in enumerate(CALLS)]
        assert all(p.id.startswith("chatcmpl-tool-") and p.type == "function" for p in pieces)
        assert len({p.id for p in pieces}) == len(CALLS)
        assert all(end <= got < end + size for end, got in zip(ends, when))


def test_required_list_cut_short_keeps_the_calls_it_completed():
    text = json.dumps(CALLS)
    cut = text.index('{"name": "none"') + 5
    pieces, _ = streamed("required", text[:cut], 4)
    assert [p.function.name for p in pieces] == ["note", "sum"]


def test_named_arguments_stream_as_they_come():
    pieces, _ = streamed("record", '{"animal": "fox"}', 5)
    assert "".join(p.function.arguments for p in pieces) == '{"animal": "fox"}'
    first, *rest = pieces
    assert first.index == 0 and first.function.name == "record" and first.id.startswith("chatcmpl-tool-")
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None and p.type is None for p in rest)
