"""A request (one prompt, its settings) and the n samples it fans out to: their state, the stop
rules and what ``LLMEngine.step`` reports about them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from multispec.params import (CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind, SamplingParams,
                              SpecConfig)


@dataclass(eq=False)
class Sample:
    """One completion in flight.

    ``output_ids`` ends with the *root*: the last sampled token, whose keys are not cached yet
    (it is the first input of the next step). ``cached`` counts the generated tokens whose keys
    are in the sample's slot, so while the sample runs ``cached == len(output_ids) - 1``. ``key``
    keys the random numbers of its tokens (from the request's seed and the sample's index; see
    ``multispec.verify.sampling``). ``text`` is kept as tokens arrive only where something reads
    it before the end (stop strings, streamed outputs); ``sent_*`` is what delta outputs have
    already reported.
    """

    request: Request
    index: int
    sample_id: int
    key: int
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    stream: Callable[[int], str] | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False
    grammar: object = None
    """The request's matcher (``structured_outputs``) copied for this sample, or None."""
    grammar_seen: int = 0
    """How many output tokens ``grammar`` has been fed (``multispec.engine.grammar.advance``)."""
    grammar_ended: bool = False
    """Whether it was fed an end of sequence (later rows are not masked)."""

    @property
    def root(self) -> int:
        return self.output_ids[-1]

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], token_logprobs: list[float], logprob_rows: torch.Tensor | None) -> int:
        """Add tokens up to the first stop condition, with their log-probabilities; returns how
        many were added. A stop token ends the sample after itself; a stop string ends it after
        the token that completes it, its text cut where the string starts (as vLLM does).

        ``logprob_rows`` (log-softmax rows at the tokens' positions) is needed only when the
        request asks for top log-probabilities. A finished sample takes nothing."""
        if self.finished:  # failed or aborted during the step that drew these tokens
            return 0
        request = self.request
        sp = request.params
        take = tokens[: self.remaining]
        top = logprob_rows[: len(take)].topk(sp.logprobs, dim=-1) if sp.logprobs and take else None
        added = 0
        for i, token in enumerate(take):
            self.output_ids.append(token)
            self.cumulative_logprob += token_logprobs[i]
            if sp.logprobs is not None:
                entry = {token: token_logprobs[i]}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                    entry[token] = token_logprobs[i]
                self.logprobs.append(entry)
            added += 1
            stops = token in request.stop_ids
            if self.stream is not None:
                piece = self.stream(token)
                if stops and not sp.include_stop_str_in_output:
                    piece = ""  # as vLLM: the text of the stop token that ends a sample is left out
                if self._extend_text(piece, len(self.output_ids) > sp.min_tokens):
                    break
            if stops:
                self.finish("stop", None if token in request.eos_ids else token)
                break
        if self.finish_reason is None and self.remaining <= 0:
            self.finish("length")
        return added

    def _extend_text(self, piece: str, stops: bool = True) -> bool:
        """Extend the text by ``piece``; on a stop string (looked for where ``stops``: not while
        ``min_tokens`` holds them back, as in vLLM), cut the text there, finish and say so."""
        start = max(0, len(self.text) - self.request.longest_stop + 1)
        self.text += piece
        if not piece or not stops or not self.request.params.stop:
            return False
        hits = [(at, stop) for stop in self.request.params.stop if (at := self.text.find(stop, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[:at + len(stop) if self.request.params.include_stop_str_in_output else at]
        self.finish("stop", stop)
        return True

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def visible_text(self, tokenizer) -> str:
        """The text an output shows: all of it once finished; while running, all but the tail
        that could still turn out to be the start of a stop string."""
        if self.stream is None:
            ids = self.output_ids
            if (self.finish_reason == "stop" and ids and ids[-1] in self.request.stop_ids
                    and not self.request.params.include_stop_str_in_output):
                ids = ids[:-1]  # the stop token that ended the sample (the only stop without a stream)
            return tokenizer.decode_complete(ids, skip_special_tokens=self.request.params.skip_special_tokens)
        if self.finished or not self.request.params.stop:
            return self.text
        return self.text[: max(0, len(self.text) - self.request.longest_stop + 1)]


@dataclass(eq=False)
class Request:
    """One prompt and its settings, validated against the model (see ``LLMEngine.make_request``).

    ``scheme``: the verification scheme its drafts get. ``sample_need``: cache positions each
    sample may write (its tokens plus one step's draft). ``lane``: which drafter and draft budget
    its samples use (requests with the same speculation and sampling settings share one)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecConfig
    max_tokens: int
    seed: int
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]
    output_kind: RequestOutputKind
    scheme: str
    lane: tuple
    sample_need: int
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    samples: list[Sample] = field(default_factory=list)
    prompt_slot: int = -1
    cached: int = 0
    """Leading prompt positions whose keys and values its prompt slot holds before its prefill
    (``multispec.engine.prefix``); the prefill computes the rest."""
    copy_from: int | None = None
    """The prompt slot those are copied from first (None: its own slot holds them already)."""
    source: Request | None = None
    """A request admitted in the same step whose prefill computes them (this one's prefill then
    follows it, in a second forward)."""
    prompt_array: object = None
    """The prompt ids as a numpy array, where the scheduler compared it with others."""
    prompt_scores: object = None
    """Where ``prompt_logprobs`` asked, the ``PromptScores`` its prefill computed or reused."""
    unfinished: int = 0
    error: str | None = None
    aborted: set[int] = field(default_factory=set)
    """Samples aborted before the request was admitted: they start finished."""
    prompt_logprobs: list | None = None
    """The prompt tokens' log-probabilities, where the request asked (filled by the prefill)."""
    prompt_ranks: list | None = None
    """And each prompt token's rank in the vocabulary (``RequestOutput.prompt_token_ranks``)."""
    bad_words_ids: list[list[int]] = field(default_factory=list)
    """``bad_words`` as token ids (each word with and without a leading space, as vLLM has them)."""
    grammar: object = None
    """The compiled matcher of ``structured_outputs`` at the start of the text, or None."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def longest_stop(self) -> int:
        return max((len(s) for s in self.params.stop), default=1)

    @property
    def tracks_text(self) -> bool:
        """Whether samples decode their text as tokens arrive (stop strings need it, and so do
        outputs reported before the end)."""
        return bool(self.params.stop) or self.output_kind != RequestOutputKind.FINAL_ONLY

    @property
    def finished(self) -> bool:
        return bool(self.samples) and self.unfinished == 0

    def output(self, tokenizer) -> RequestOutput | None:
        """What ``step`` reports for this request now, by its output kind (None: nothing to report)."""
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            outputs = [c for s in self.samples if (c := _delta(s, tokenizer)) is not None]
        else:
            outputs = [_cumulative(s, tokenizer) for s in self.samples]
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outputs, self.finished, self.error,
                             self.metrics, self.prompt_logprobs, self.prompt_ranks, self.cached)


def _cumulative(sample: Sample, tokenizer) -> CompletionOutput:
    return CompletionOutput(sample.index, sample.visible_text(tokenizer), list(sample.output_ids),
                            sample.cumulative_logprob, sample.finish_reason,
                            None if sample.logprobs is None else list(sample.logprobs), sample.stop_reason)


def _delta(sample: Sample, tokenizer) -> CompletionOutput | None:
    """The sample's news since its last delta: new tokens and text, and its finish once."""
    text = sample.visible_text(tokenizer)
    new_finish = sample.finished and not sample.sent_finish
    if len(sample.output_ids) == sample.sent_tokens and len(text) == sample.sent_text and not new_finish:
        return None
    out = CompletionOutput(sample.index, text[sample.sent_text:], sample.output_ids[sample.sent_tokens:],
                           sample.cumulative_logprob, sample.finish_reason,
                           None if sample.logprobs is None else sample.logprobs[sample.sent_tokens:],
                           sample.stop_reason)
    sample.sent_tokens, sample.sent_text, sample.sent_finish = len(sample.output_ids), len(text), sample.finished
    return out
