"""Tokenizer and chat template for a checkpoint directory, without transformers.

transformers takes seconds to import, while a ``tokenizer.json`` loads with the
``tokenizers`` library in a fraction of a second. This wrapper reproduces what
``transformers.AutoTokenizer`` (v5) does for Llama-family checkpoints:

* ``tokenizer.json`` is the whole pipeline, including its post-processor, which is
  what decides whether a BOS token is prepended (transformers v5 ignores
  ``add_bos_token`` in ``tokenizer_config.json`` whenever a ``tokenizer.json`` exists).
* the chat template is rendered by a sandboxed Jinja environment set up like
  transformers' (trim/lstrip blocks, a ``tojson`` that does not HTML-escape,
  ``raise_exception``, ``strftime_now``, loop controls, ``{% generation %}`` blocks),
  with the named special tokens available as variables.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from multispec.models.config import language_model_config, read_json_object, token_id_list

# The named special tokens a chat template can refer to, as transformers exposes them.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint."""

    def __init__(
        self,
        backend: _Backend,
        special_tokens: dict[str, str],
        chat_template: str | None,
        extra_eos_token_ids: list[int],
    ):
        self._backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        bos_token = special_tokens.get("bos_token")
        # None when the tokenizer names no BOS (Qwen2), even if config.json has a bos_token_id.
        self.bos_token_id: int | None = self.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = list(extra_eos_token_ids)
        eos_token = special_tokens.get("eos_token")
        if eos_token is not None and (eos_id := self.token_to_id(eos_token)) is not None:
            eos_ids.append(eos_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.tokenizer_class: str | None = None
        """The class ``tokenizer_config.json`` names (transformers' ``tokenizer_class``), if any."""

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint directory holding ``tokenizer.json``.

        End-of-sequence ids are gathered from ``generation_config.json``, ``config.json``
        and the tokenizer's ``eos_token``, in that order, because instruction-tuned
        checkpoints often stop on a turn-end token that only one of them names.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise ValueError(f"cannot read {tokenizer_file}: {exc}") from None

        config = read_json_object(path / "tokenizer_config.json")
        special_tokens = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES if config.get(name)}
        if "added_tokens_decoder" not in config:
            # Older checkpoints keep the special tokens in a separate file.
            legacy = read_json_object(path / "special_tokens_map.json")
            special_tokens.update(
                {name: _token_text(legacy[name]) for name in _SPECIAL_TOKEN_NAMES if legacy.get(name)}
            )

        eos_ids = token_id_list(read_json_object(path / "generation_config.json").get("eos_token_id"))
        eos_ids += token_id_list(language_model_config(read_json_object(path / "config.json")).get("eos_token_id"))
        tokenizer = cls(backend, special_tokens, _chat_template(path, config), eos_ids)
        if isinstance(config.get("tokenizer_class"), str):
            tokenizer.tokenizer_class = config["tokenizer_class"]
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included).

        The model's embedding table may be larger (padded); never smaller.
        """
        return self._backend.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token text and its id (added tokens included)."""
        return self._backend.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The whole pipeline as ``tokenizer.json`` text (what other libraries load it from)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for a token id (byte-level pieces as stored), or None."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the checkpoint's BOS/EOS rule.

        Text produced by :meth:`apply_chat_template` already carries its special tokens,
        so encode it with ``add_special_tokens=False``.
        """
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_complete(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``decode``, less a last character the ids leave unfinished (a multi-byte character cut
        short, which ``decode`` shows as U+FFFD): the text ``stream``'s pieces add up to, as
        vLLM's detokenizer gives it."""
        text = self.decode(ids, skip_special_tokens)
        if not text.endswith("\ufffd"):
            return text
        step = self.stream(skip_special_tokens)
        return "".join(step(token) for token in ids)

    def stream(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """Incremental decoding (``tokenizers``' DecodeStream): a function that takes the next token
        id and returns the text it completes, "" while a multi-byte character is still open; the
        pieces add up to ``decode`` of the whole sequence."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        backend = self._backend
        return lambda token: stream.step(backend, token) or ""

    def apply_chat_template(self, messages: list[dict] | str, add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        """Render a conversation with the checkpoint's own template (or ``chat_template``).

        A plain string is one user message. Keys whose value is ``None`` are dropped, as
        transformers does, because templates test for presence rather than for None. As in
        transformers and vLLM: ``continue_final_message`` ends the text inside the last message
        (the model goes on writing it, for example a prefilled assistant answer) instead of
        after it; ``template_kwargs`` are more variables for the template (for example
        ``{"enable_thinking": False}`` where a template reads it); ``tools``: function
        definitions (OpenAI's ``{"type": "function", "function": {...}}``) for templates that
        render them.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new one")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not all(isinstance(message, dict) for message in messages):
            raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...} dicts")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & {"messages", "tools", "documents", "add_generation_prompt",
                                        *self.special_tokens})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} is set by the chat call itself")
        template = self._template if chat_template is None else _compile_template(chat_template)
        if template is None:
            raise ValueError("this checkpoint has no chat template: give one (chat_template)")
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            text = template.render(messages=messages, tools=tools or None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content"))
        return text

    def generation_turn(self, messages: list[dict] | str, add_generation_prompt: bool = True, **options) -> str:
        """The end of ``apply_chat_template``'s text that belongs to the turn the answer is
        written into: what the generation prompt adds (an assistant header, an opening
        ``<think>`` some templates write), or with ``continue_final_message`` the final message as
        rendered. Found as what the prompt adds to the conversation without that turn, rendered
        alike; where the template renders the earlier turns otherwise once that turn is there (or
        with neither option), the whole prompt."""
        text = self.apply_chat_template(messages, add_generation_prompt, **options)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if options.get("continue_final_message"):
            if len(messages) < 2:
                return text
            base = self.apply_chat_template(messages[:-1], True, **{**options, "continue_final_message": False})
        elif add_generation_prompt:
            base = self.apply_chat_template(messages, False, **options)
        else:
            return text
        return text[len(base):] if text.startswith(base) else text

    @cached_property
    def _template(self) -> jinja2.Template | None:
        return None if self.chat_template is None else _compile_template(self.chat_template)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles them (a sandbox, its filters and globals)."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"chat_template={source!r:.80}: must be a non-empty Jinja template")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from None


def _cut_after_final_message(text: str, final) -> str:
    """The rendered text up to the end of the last message's content (transformers' rule for
    ``continue_final_message``: the content's last occurrence, its trailing whitespace kept only
    where the template kept it)."""
    if isinstance(final, list):  # content parts: the last text part is what goes on
        final = next((part.get("text") for part in reversed(final) if isinstance(part, dict) and "text" in part), None)
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "chat (an empty last message cannot be continued)")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    for inference it only needs to render its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _chat_template(path: Path, config: dict) -> str | None:
    """The default template: ``chat_template.jinja`` (newer layout) over the config entry.

    A config may list several named templates; the one named ``default`` is used.
    """
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _token_text(value: str | dict) -> str:
    """Special tokens are stored either as text or as an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else value
