"""Structured outputs: a grammar's mask on every row, exact under speculation.

A request with ``structured_outputs`` holds a compiled matcher (llguidance, the library vLLM's
"guidance" backend runs), and each of its samples a copy, advanced through the sample's output as
tokens are accepted. A row of a step gets the mask the grammar gives after the text before it: the
sample's output for its root, and for a draft node the output and the node's path (the matcher
advanced along the path, then rolled back). So every row has the law plain decoding under the
grammar gives its position, and a drafted token the grammar forbids has no probability and is
rejected. A row whose path leaves the grammar is never reached (its parent's token is rejected)
and is left unmasked. Where a grammar's text is complete it allows only the end of sequence; the
rows after an end of sequence (with ``ignore_eos``, a sample goes on) are left unmasked, as vLLM
leaves them.
"""

from __future__ import annotations

import ctypes
import functools
import json

import torch

from multispec.params import StructuredOutputsParams


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params``, or a ValueError naming the field."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    field = f"structured_outputs.{kind}"
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return grammar_from("choice", params.choice)
        return grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{field}: {_one_line(error)}") from None


def check(params: StructuredOutputsParams) -> str:
    """The grammar for ``params`` once it compiles without a tokenizer (syntax, the schema's own
    rules), or a ValueError naming the field; the engine checks it again against its vocabulary."""
    grammar = grammar_text(params)
    error = _compile_error(grammar)
    if error is not None:
        raise ValueError(f"structured_outputs.{params.kind}: {error}")
    return grammar


@functools.lru_cache(maxsize=64)
def _compile_error(grammar: str) -> str | None:
    """Why ``grammar`` does not compile, or None; cached, as ``SamplingParams`` checks its grammar
    again whenever it is copied with a change (``dataclasses.replace``)."""
    from llguidance import LLMatcher

    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return _one_line(messages[0] if messages else "invalid") if failed else None


def _one_line(error) -> str:
    """A compiler's message on one line (llguidance's regex errors span several)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip() and set(line.strip()) != {"^"})
    return (text or type(error).__name__)[:300]


class Grammars:
    """The model's tokenizer as llguidance reads it (built on first use, a fraction of a second),
    and the matchers of requests."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None

    @property
    def tokenizer(self):
        if self._ll is None:
            from llguidance import LLTokenizer

            self._ll = LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                   eos_token=list(self._tokenizer.eos_token_ids))
        return self._ll

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for ``params`` (a request's template: its samples take copies), or a
        ValueError naming the field where the grammar does not fit the vocabulary."""
        from llguidance import LLMatcher

        # SamplingParams compiled it without a tokenizer when it was built; built here once more,
        # against the vocabulary, the matcher says what it cannot take there (a special token, an id).
        matcher = LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_one_line(matcher.get_error())}")
        return matcher


def advance(sample) -> bool:
    """Feed the sample's matcher the output tokens it has not seen, up to an end of sequence;
    whether the grammar still rules the sample's rows (no end of sequence yet)."""
    matcher, output, eos = sample.grammar, sample.output_ids, sample.request.eos_ids
    while sample.grammar_seen < len(output) and not sample.grammar_ended:
        token = output[sample.grammar_seen]
        matcher.consume_token(token)
        sample.grammar_seen += 1
        sample.grammar_ended = token in eos
    return not sample.grammar_ended


def masks(rows: list[tuple], vocab: int) -> tuple[list[int], torch.Tensor | None]:
    """For ``rows`` (each ``(row, matcher, path)``: the matcher at the text before the path, which
    holds no end of sequence), the rows the grammar masks and their bitmasks, int32 [k, words]:
    token ``w * 32 + b`` at bit b of word w, set where the grammar allows it."""
    words = (vocab + 31) // 32
    bits = torch.empty(len(rows), words, dtype=torch.int32)
    base, size = bits.data_ptr(), words * 4
    masked: list[int] = []
    for row, matcher, path in rows:
        if matcher.is_error():  # never after tokens drawn under its masks
            continue
        took = matcher.try_consume_tokens(path) if path else 0
        if took == len(path):
            matcher.unsafe_compute_mask_ptr(base + len(masked) * size, size)
            masked.append(row)
        if took:
            matcher.rollback(took)
    return masked, (bits[:len(masked)] if masked else None)


def apply_masks(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> None:
    """Give the tokens each row's bitmask clears no probability (-inf), in place: the compiled
    ``mask_rows`` on a CPU (it skips the words whose tokens are all allowed), else torch's
    operators (an accelerator, or no compiled kernels)."""
    from multispec import kernels

    index = torch.tensor(rows, dtype=torch.long)
    op = kernels.mask_rows() if logits.device.type == "cpu" and logits.dtype == torch.float32 and \
        logits.is_contiguous() else None
    if op is not None:
        op(logits, index, bits.contiguous())
        return
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.to(logits.device)[:, :, None] >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    index = index.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class AfterToken:
    """A matcher that rules only after ``token`` (a reasoning model's ``</think>``, as vLLM starts a
    reasoning request's structured output): until that token every token is allowed, ``token``
    itself opens the grammar, and from there ``inner`` rules. It answers the calls the engine makes
    on a matcher, counting the gate's own tokens in ``try_consume_tokens`` and ``rollback``, so a
    draft path that crosses the gate is masked as the sample's text would be at each of its rows."""

    def __init__(self, inner, token: int, opened: bool = False):
        self.inner, self.token, self.opened = inner, token, opened
        self._path: list[int] = []
        """Per token taken on trial (``try_consume_tokens``): 0 before the gate, 1 the gate, 2 the grammar's."""

    def deep_copy(self) -> AfterToken:
        return AfterToken(self.inner.deep_copy(), self.token, self.opened)

    def is_error(self) -> bool:
        return self.inner.is_error()

    def consume_token(self, token: int) -> bool:
        if self.opened:
            return self.inner.consume_token(token)
        self.opened = token == self.token
        return True

    def try_consume_tokens(self, tokens: list[int]) -> int:
        for i, token in enumerate(tokens):
            if self.opened:
                took = self.inner.try_consume_tokens(tokens[i:])
                self._path += [2] * took
                return i + took
            self.opened = token == self.token
            self._path.append(1 if self.opened else 0)
        return len(tokens)

    def rollback(self, count: int) -> None:
        inner = 0
        for _ in range(count):
            kind = self._path.pop()
            inner += kind == 2
            if kind == 1:
                self.opened = False
        if inner:
            self.inner.rollback(inner)

    def unsafe_compute_mask_ptr(self, address: int, size: int) -> None:
        if self.opened:
            self.inner.unsafe_compute_mask_ptr(address, size)
        else:
            ctypes.memset(address, 0xFF, size)
