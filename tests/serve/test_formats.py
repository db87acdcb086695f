"""How tool calls and reasoning are read out of an answer's text: forced calls as they stream
(``ForcedToolStream``), the model's own (``tool_choice`` "auto") with the Hermes and Llama 3 JSON
parsers, whole and streamed (``HermesParser``, ``AutoToolStream``, ``Llama3JsonParser``), and a
reasoning model's thinking split from its answer (``DeepSeekR1Reasoning``, ``Qwen3Reasoning``,
``ReasoningStream``), through the chat format too."""

from __future__ import annotations

import json

import pytest

from multispec.params import CompletionOutput
from multispec.serve.formats import ChatFormat, Choice
from multispec.serve.tools import (DeepSeekR1Reasoning, ForcedToolStream, HermesParser, Llama3JsonParser,
                                   MistralParser, Qwen3Reasoning, ReasoningStream, ToolMode)

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


def streamed_auto(text: str, size: int, parser=None) -> tuple[str, list]:
    stream, content, calls = (parser or HermesParser()).stream(), "", []
    for start in range(0, len(text), size):
        stream.feed(text[start:start + size])
        piece, taken = stream.take()
        content, calls = content + piece, calls + taken
    stream.finish()
    piece, taken = stream.take()
    return content + piece, calls + taken


def read_whole_and_streamed(parser, text: str, content: str | None, calls: list) -> list:
    """Asserts that ``parser`` reads ``text`` into ``content`` and ``calls`` ([(name, arguments)]),
    whole and streamed in pieces of 1 to all characters; returns the streamed calls' pieces."""
    got_content, got_calls = parser.parse(text)
    assert got_content == content and [(c[0], json.loads(c[1])) for c in got_calls] == calls
    every = []
    for size in (1, 2, 5, 11, len(text)):
        streamed_content, pieces = streamed_auto(text, size, parser)
        assert streamed_content == (content or "") and [p.index for p in pieces] == list(range(len(calls)))
        assert [(p.function.name, json.loads(p.function.arguments)) for p in pieces] == calls
        every += pieces
    return every


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
    read_whole_and_streamed(HermesParser(), text, content, calls)


LLAMA_CALLS = [("get_weather", {"city": "Paris", "note": "a } and a ; inside"}), ("sum", {"terms": [1, 2]})]
LLAMA_TEXT = "; ".join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in LLAMA_CALLS)
NOT_A_CALL = '{"name": "f", "parameters": {"a": 1}}; {"answer": 42}'


@pytest.mark.parametrize("text, content, calls", [
    (LLAMA_TEXT, None, LLAMA_CALLS),
    ("<|python_tag|>" + LLAMA_TEXT + ";\n", None, LLAMA_CALLS),  # the tag, a trailing separator
    ('  {"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # "arguments" as well
    ("The weather is fine; no {braces} needed.", "The weather is fine; no {braces} needed.", []),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut short
    ("<|python", "<|python", []),  # too short to tell
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # an object that is no call
])
def test_llama3_json_calls_read_whole_and_streamed(text, content, calls):
    """llama3_json: an answer that begins (after <|python_tag|>) with an object is calls, each
    {"name", "parameters" or "arguments"}, separated by ";"; any object that is no call, or an
    answer that begins otherwise, leaves it all content. Streamed in pieces of any size: the same
    content (nothing released while the start could still be a call) and the same calls."""
    read_whole_and_streamed(Llama3JsonParser(), text, content, calls)


def test_llama3_json_stream_sends_each_call_as_its_object_closes():
    """Calls go out one by one as their objects close; a later object that is no call arrives as
    text at the end (the whole answer reads as content: a stream cannot take back a sent call)."""
    stream = Llama3JsonParser().stream()
    first = json.dumps({"name": "f", "parameters": {"a": 1}})
    stream.feed(first[:-1])
    assert stream.take() == ("", [])
    stream.feed(first[-1] + "; {")
    text, calls = stream.take()
    assert text == "" and [c.function.name for c in calls] == ["f"]
    stream.feed('"answer": 42}')
    stream.finish()
    assert stream.take() == ('{"answer": 42}', [])
    assert Llama3JsonParser().parse(NOT_A_CALL) == (NOT_A_CALL, [])


def chunk_choices(fmt: ChatFormat, text: str, size: int) -> list:
    """The chunk choices ``fmt`` streams for one answer ``text`` arriving ``size`` characters at a
    time (the last piece finishing it with "stop")."""
    choice, deltas = Choice(), []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta = CompletionOutput(0, piece, [i], 0.0, "stop" if i == len(pieces) - 1 else None)
        fmt.present(0, None, delta, choice)
        chunk = fmt.chunk("id", 0, "m", 0, delta, None, choice)
        if chunk is not None:
            deltas.append(chunk.choices[0])
    return deltas


MISTRAL_LIST = "Checking. [TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in LLAMA_CALLS])
MISTRAL_V11 = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in LLAMA_CALLS)


@pytest.mark.parametrize("text, content, calls", [
    (MISTRAL_LIST, "Checking. ", LLAMA_CALLS),  # a JSON list after the tag (tokenizers before v11)
    (MISTRAL_V11, None, LLAMA_CALLS),  # name[ARGS]{...} after each tag (v11 on)
    ('[TOOL_CALLS] {"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # one object, unlisted
    ("No [TOOL_ call, just [brackets].", "No [TOOL_ call, just [brackets].", []),
    ('Cut [TOOL_CALLS][{"name": "f", "argu', 'Cut [TOOL_CALLS][{"name": "f", "argu', []),  # cut short
    ("[TOOL_CALLS]f[ARGS]not json", "[TOOL_CALLS]f[ARGS]not json", []),
])
def test_mistral_calls_read_whole_and_streamed(text, content, calls):
    """mistral: the content before [TOOL_CALLS], then the calls in either of Mistral's two forms;
    calls that do not parse leave the answer all content. Streamed in pieces of any size: the same
    content (a tail that may open the tag held back) and the same calls, each with a nine-character
    id (Mistral's templates refuse others when the call comes back)."""
    pieces = read_whole_and_streamed(MistralParser(), text, content, calls)
    assert all(len(p.id) == 9 and p.id.isalnum() for p in pieces)
    fmt = ChatFormat(None, None, tool_mode=ToolMode("auto", parser="mistral"))
    message = fmt._message(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls or [])
    # Through the format's chunks: the finish is "tool_calls" where calls came.
    deltas = chunk_choices(fmt, text, 6)
    assert "".join(d.delta.content or "" for d in deltas) == (message.content or "")
    assert [t.function.name for d in deltas for t in d.delta.tool_calls or []] == [n for n, _ in calls]
    assert deltas[-1].finish_reason == ("tool_calls" if calls else "stop")


def test_mistral_calls_keep_the_ids_the_model_writes():
    """v13 on, the model writes each call's id after [CALL_ID]: the call keeps it, whole and
    streamed (it is the id the model expects with the result); an id Mistral's templates would
    refuse (not nine letters and digits) is replaced by one they take."""
    text = "[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]sum[CALL_ID]bad id[ARGS]{}"
    calls = [("get_weather", {"city": "Paris"}), ("sum", {})]
    pieces = read_whole_and_streamed(MistralParser(), text, None, calls)
    assert {p.id for p in pieces[::2]} == {"a1B2c3D4e"} and all(p.id.isalnum() and len(p.id) == 9 for p in pieces)
    assert len({p.id for p in pieces[1::2]}) == len(pieces) // 2  # fresh ones, each its own
    message = ChatFormat(None, None, tool_mode=ToolMode("auto", parser="mistral"))._message(text)
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "sum"] and message.content is None
    assert message.tool_calls[0].id == "a1B2c3D4e" and message.tool_calls[1].id not in ("bad id", "a1B2c3D4e")


THINKING = ["<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.", "2 + 2 is 4, so\n</think>The answer is 4.",
            "Still thinking when cut", "<think></think>Just the answer.", "Before <think>x</think>y"]


@pytest.mark.parametrize("text", THINKING)
def test_reasoning_split_whole_and_streamed(text):
    """deepseek_r1, as vLLM's parser splits: thinking up to </think> (an opening <think> and what
    precedes it dropped), the rest the content, all reasoning without </think>, each None where
    empty. Streamed in pieces of any size, the pieces join to the same split (a tail that may
    start a tag held back), except text written before an opening tag, which a stream has sent."""
    reasoning, content = DeepSeekR1Reasoning().split(text)
    before, opened, after = text.partition("<think>")
    thinking = after if opened else before
    assert (reasoning or "") + ("</think>" if "</think>" in thinking else "") + (content or "") == thinking
    for size in (1, 3, 8, len(text)):
        stream, got = ReasoningStream(DeepSeekR1Reasoning()), ["", ""]
        for start in range(0, len(text), size):
            stream.feed(text[start:start + size])
            if start + size >= len(text):
                stream.finish()
            for i, piece in enumerate(stream.take()):
                assert "<think>" not in piece and "</think>" not in piece
                got[i] += piece
        if text.startswith("Before"):
            assert got[1] == content
            continue
        assert got == [reasoning or "", content or ""]


@pytest.mark.parametrize("text", THINKING)
def test_qwen3_reasoning_splits_as_deepseek_r1_unless_thinking_is_off(text):
    """qwen3, as vLLM's parser: the split of deepseek_r1 while the request thinks (Qwen3 writes its
    own <think>); with thinking turned off (enable_thinking false) the whole answer is content,
    whole and streamed, whatever tags it holds."""
    assert Qwen3Reasoning().split(text) == DeepSeekR1Reasoning().split(text)
    assert Qwen3Reasoning(thinking=False).split(text) == (None, text)
    for size in (1, 3, len(text)):
        stream, got = ReasoningStream(Qwen3Reasoning(thinking=False)), ["", ""]
        for start in range(0, len(text), size):
            stream.feed(text[start:start + size])
            for i, piece in enumerate(stream.take()):
                got[i] += piece
        assert got == ["", text]


def test_chat_format_shows_reasoning_apart_and_reads_calls_from_the_content():
    """A chat answer through the format, as the server presents it: message.reasoning and the
    content (null where empty), streamed as delta.reasoning then delta.content; with "auto" tool
    calls, the calls are read from the content only (a tag inside the thinking is thinking)."""
    text = ('<think>I could call <tool_call>{"name": "f", "arguments": {}}</tool_call> here.</think>Sure. '
            '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call>')
    for mode in (None, ToolMode("auto", parser="hermes")):
        fmt = ChatFormat(None, None, tool_mode=mode, reasoning_parser="deepseek_r1")
        message = fmt._message(text)
        assert message.reasoning == 'I could call <tool_call>{"name": "f", "arguments": {}}</tool_call> here.'
        if mode is None:
            assert message.content == text.split("</think>")[1] and message.tool_calls is None
        else:
            assert message.content == "Sure. " and [c.function.name for c in message.tool_calls] == ["g"]
        deltas = chunk_choices(fmt, text, 7)
        joined = {name: "".join(getattr(d.delta, name) or "" for d in deltas) for name in ("reasoning", "content")}
        assert joined == {"reasoning": message.reasoning, "content": message.content}
        calls = [t.function.name for d in deltas for t in d.delta.tool_calls or []]
        assert calls == [c.function.name for c in message.tool_calls or []]
        assert deltas[-1].finish_reason == ("stop" if mode is None else "tool_calls")
    assert ChatFormat(None, None, reasoning_parser="deepseek_r1")._message("<think>only</think>").content is None
