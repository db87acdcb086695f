"""Tokenizer gives exactly what transformers.AutoTokenizer gives on the same files.

Checked on the default model (both against the GGUF it came from and against the
converted directory) and on a tiny Llama-style tokenizer that prepends BOS and has a
template using bos_token, tojson, loop controls and raise_exception.
"""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from multispec.models.tokenizer import Tokenizer
from tests.models.conftest import TINY_CHAT_TEMPLATE, write_tiny_tokenizer

TEXTS = [
    "Hello world",
    "",
    "  leading and  double  spaces ",
    "héllo wörld — 世界 🙂",
    "def f(x):\n\treturn x**2\n\n",
    "Numbers 1234567 and 3.14159",
    "It's, don't, we'll; (brackets) [and] {braces}",
    "<|im_start|>user\nhi<|im_end|>",
    "<s>Hello</s> <unk>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
]


def assert_same(ours: Tokenizer, hf) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
            got = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
            assert got == want
            ids = ours.encode(got, add_special_tokens=False)
            assert ids == hf.apply_chat_template(conversation, add_generation_prompt=generation_prompt)["input_ids"]
            assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    # A plain string is one user message.
    assert ours.apply_chat_template("Hi there") == hf.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(hf)
    for token in (hf.bos_token, hf.eos_token, hf.unk_token, "Hello"):
        assert ours.token_to_id(token) == hf.convert_tokens_to_ids(token)


@pytest.mark.slow
def test_default_model_matches_its_gguf(default_checkpoint, default_gguf):
    hf = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    assert_same(default_checkpoint.tokenizer, hf)


@pytest.mark.slow
def test_default_model_matches_converted_files(default_checkpoint):
    hf = transformers.AutoTokenizer.from_pretrained(default_checkpoint.path)
    assert_same(Tokenizer.from_dir(default_checkpoint.path), hf)


@pytest.mark.slow
def test_default_model_stops_on_turn_end(default_checkpoint):
    tokenizer = default_checkpoint.tokenizer
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.eos_token_ids
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False)  # no BOS for SmolLM2


def test_tiny_llama_style_tokenizer_matches(tmp_path):
    write_tiny_tokenizer(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.encode("Hello")[0] == ours.bos_token_id  # the post-processor prepends BOS
    assert_same(ours, transformers.AutoTokenizer.from_pretrained(tmp_path))


def test_template_features_match(tmp_path):
    write_tiny_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    conversation = [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "  padded  ", "meta": {"é": [1, "<x>"]}, "name": None},
        {"role": "system", "content": "skipped by continue"},
    ]
    want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(conversation) == want
    assert '{"é": [1, "<x>"]}' in want and "skipped" not in want


PREFILLED = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is  "}]
"""A conversation whose last (assistant) message the model should go on writing; its trailing
spaces test transformers' rule for whitespace the template may or may not keep."""


@pytest.mark.parametrize("template", ["checkpoint", "keeping"])
def test_template_options_match_transformers(tmp_path, template):
    """``continue_final_message``, another template and more template variables, as transformers
    renders them (vLLM's ``LLM.chat`` options pass straight to it)."""
    write_tiny_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    other = None
    if template == "keeping":  # unlike the checkpoint's, a template that keeps the content's trailing spaces
        other = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}{% if flag %}[{{ flag }}]{% endif %}")
    for options in ({"continue_final_message": True, "add_generation_prompt": False},
                    {"add_generation_prompt": True, "flag": "on"}):
        hf_options = dict(options, **({"chat_template": other} if other else {}))
        want = hf.apply_chat_template(PREFILLED, tokenize=False, **hf_options)
        kwargs = {k: v for k, v in options.items() if k == "flag"}
        got = ours.apply_chat_template(PREFILLED, options["add_generation_prompt"],
                                       continue_final_message=options.get("continue_final_message", False),
                                       chat_template=other, template_kwargs=kwargs)
        assert got == want, options
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ours.apply_chat_template(PREFILLED, chat_template=with_tools, tools=tools) == hf.apply_chat_template(
        PREFILLED, tokenize=False, chat_template=with_tools, tools=tools)
    cut = ours.apply_chat_template(PREFILLED, False, continue_final_message=True, chat_template=other)
    assert cut.endswith("It is  " if other else "assistantIt is")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        ours.apply_chat_template(PREFILLED, True, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages' is set by the chat call itself"):
        ours.apply_chat_template(PREFILLED, template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="chat template does not parse"):
        ours.apply_chat_template(PREFILLED, chat_template="{% for %}")


def test_template_exception_is_a_value_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="bad role tool"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "tool", "content": "x"}])


def test_jinja_file_and_named_templates(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ 'named' }}"},
    ]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template("x") == "named"
    (tmp_path / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    want = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[1]) == want


def test_legacy_special_tokens_map(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["eos_token"]
    config_file.write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.eos_token_ids == [hf.eos_token_id] == [ours.token_to_id("<|end|>")]


def test_eos_ids_gather_generation_config_config_and_tokenizer(tmp_path):
    write_tiny_tokenizer(tmp_path)
    plain = Tokenizer.from_dir(tmp_path)
    end, eos = plain.token_to_id("<|end|>"), plain.token_to_id("</s>")
    assert plain.eos_token_ids == [eos]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [end, 0, eos]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.rmtree(tmp_path)
    write_tiny_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template("hi")
    config_file.write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for bad in ([], ["hi"]):
        with pytest.raises(ValueError, match="conversation"):
            Tokenizer.from_dir(tmp_path).apply_chat_template(bad)
    config_file.write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match="does not parse"):
        Tokenizer.from_dir(tmp_path).apply_chat_template("hi")


# Qwen3's way with thinking, cut down: an assistant turn after the last user message keeps its
# thinking (a tool loop's), the generation prompt opens the turn, and with thinking off closes an
# empty thinking block in it.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")


def test_generation_turn_is_the_text_of_the_answers_own_turn(tmp_path):
    """What decides whether a prompt already ended the thinking (the server's reasoning parsers):
    the generation prompt's text, or the continued final message; never an earlier turn."""
    write_tiny_tokenizer(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    loop = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "<think>call it</think>[call]"},
            {"role": "tool", "content": "sunny"}]
    options = dict(chat_template=THINKING_TEMPLATE)
    assert ours.generation_turn(loop, **options) == "<|assistant|>"
    assert ours.generation_turn(loop, template_kwargs={"enable_thinking": False}, **options) == \
        "<|assistant|><think></think>"
    prefilled = loop + [{"role": "assistant", "content": "<think>sunny, so</think>It is"}]
    assert ours.generation_turn(prefilled, False, continue_final_message=True, **options) == \
        "<think>sunny, so</think>It is"
    # Without either option the new text follows the whole prompt, which is what is returned.
    assert ours.generation_turn(loop, False, **options) == ours.apply_chat_template(loop, False, **options)
    # A template that renders the earlier turns otherwise once the turn is there: the whole prompt.
    odd = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}!{% else %}?{% endif %}"
    assert ours.generation_turn(loop, chat_template=odd) == ours.apply_chat_template(loop, chat_template=odd)
