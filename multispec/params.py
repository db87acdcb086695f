"""What a caller asks for (sampling, speculation) and what comes back.

These plain dataclasses are shared by the API, the engine and the server; they validate
themselves on construction so a bad value is reported with its field name before any work
starts (a wrong type included: a string where a bool or a number belongs is refused, never
taken for its truth value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from numbers import Integral, Real

HEAD_DRAFTERS = ("model", "hybrid")
"""Drafters that draft with a draft model, a head or an LM (``SpecConfig.draft_model``)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (as in vLLM): a smaller one would overflow the softmax."""
SEED_RANGE = (-(1 << 63), 1 << 64)
"""Seeds are 64-bit words: anything torch.manual_seed or numpy take, negative ones modulo 2**64."""


def _bad(name: str, value, why: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {why}")


def check_int(name: str, value, low: int | None = None, high: int | None = None, *, none: bool = False):
    """``value`` as an int in [low, high], or a ValueError naming the field (bools are not ints)."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or (low is not None and value < low) or (
            high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(name, value, f"must be an integer {bounds}{' or None' if none else ''}")
    return int(value)


def check_real(name: str, value, why: str, ok) -> float:
    """``value`` as a finite float for which ``ok`` holds, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok(value):
        raise _bad(name, value, why)
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "must be True or False")
    return value


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _bad(name, value, f"must be one of {', '.join(choices)}")
    return value


def check_truncation(value) -> int | None:
    """``truncate_prompt_tokens``: None, k >= 1 or -1, else a ValueError naming the field."""
    value = check_int("truncate_prompt_tokens", value, -1, none=True)
    if value == 0:
        raise _bad("truncate_prompt_tokens", 0, "must be >= 1 (the last k tokens) or -1 (as many as fit)")
    return value


def prompt_tail(ids: list[int], keep: int | None, window: int) -> list[int]:
    """The prompt ``truncate_prompt_tokens`` leaves, as vLLM cuts it: its last ``keep`` tokens
    (-1: as many as a context window of ``window`` leaves room for; None: all of it)."""
    return ids if keep is None else ids[-(window - 1 if keep == -1 else keep):]


def _logit_bias(bias) -> dict[int, float] | None:
    """``logit_bias`` as {token id: float}: keys are ids >= 0 (ints, or their decimal strings as
    JSON writes them), values finite numbers in [-100, 100]; None or {} for none."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", bias, "must be a mapping {token id: bias in [-100, 100]}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
            raise _bad("logit_bias", bias, f"key {key!r} is not a token id >= 0")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or abs(value) > 100:
            raise _bad("logit_bias", bias, f"the bias of token {key} must be a number in [-100, 100]")
        out[int(token)] = float(value)
    return out or None


@dataclass
class StructuredOutputsParams:
    """A constraint on the text, as vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a
    JSON schema, as a dict or its JSON text, or a pydantic model class), ``regex`` (the whole text
    matches it), ``choice`` (the text is one of these strings), ``grammar`` (a Lark grammar, or
    llama.cpp's GBNF) or ``json_object`` (any JSON object). ``disable_any_whitespace`` keeps a JSON
    schema's or object's text free of whitespace between its tokens (by default any amount is
    allowed, as in vLLM). The grammar is compiled here (a syntax error is a ValueError naming the
    field before any model loads) and again against the model's vocabulary when a request is made.

    Each row of a step gets the grammar's mask for the text before it (the sample's output, then a
    draft node's path), so the samples follow the constrained law exactly with or without
    drafts (``multispec.engine.grammar``)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not None:
            check_bool("structured_outputs.json_object", self.json_object)
            if self.json_object:
                given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar or json_object"
                             + (f" (not {' and '.join(given)})" if given else ""))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise _bad("structured_outputs.json", self.json,
                       "must be a JSON schema (a dict or its JSON text, or a pydantic model class)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(f"structured_outputs.{name}", value, "must be a non-empty string")
        choice = self.choice
        if choice is not None:
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise _bad("structured_outputs.choice", choice, "must be a non-empty list of non-empty strings")
            self.choice = list(choice)
        check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        from multispec.engine.grammar import check

        check(self)  # the grammar compiles (its syntax, the schema's rules), before any model is loaded

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next((name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None),
                    "json_object")


def _structured_outputs(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(StructuredOutputsParams)})
        if unknown:
            raise _bad("structured_outputs", value, f"unknown field {unknown[0]!r}")
        return StructuredOutputsParams(**value)
    raise _bad("structured_outputs", value, "must be a StructuredOutputsParams, a dict of its fields, or None")


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM.

    ``temperature`` 0 is greedy, and so is any temperature below ``GREEDY_BELOW`` (as in vLLM).
    ``top_k`` 0 (or -1, as vLLM spells it) turns top-k off. ``min_p`` drops the tokens less likely
    than ``min_p`` times the likeliest one (0 turns it off); as in vLLM it applies after the
    temperature and before top-k and top-p. ``repetition_penalty``, ``frequency_penalty`` and
    ``presence_penalty`` penalise tokens of the text so far as vLLM does (before the temperature;
    see ``multispec.engine.penalties``). ``min_tokens``: the stop tokens (end of sequence unless
    ``ignore_eos``, and ``stop_token_ids``) get no probability and stop strings are not looked
    for until a sample has that many tokens, as in vLLM. ``logit_bias`` ({token id: bias in
    [-100, 100]}) is added to those tokens' logits; ``allowed_token_ids`` leaves only those
    tokens any probability, ``bad_words`` are never completed (the last token of a word gets no
    probability where the text ends with the rest of it; each word with and without a leading
    space), all as vLLM applies them, before the penalties and the temperature (see
    ``multispec.engine.rules``). ``truncate_prompt_tokens`` k keeps the prompt's last k tokens
    (-1: as many as the context window leaves room for), as vLLM does. The text: a stop string,
    and the text of the stop token that ends a sample, are left out unless
    ``include_stop_str_in_output``; special tokens are left out unless ``skip_special_tokens`` is
    False (both as in vLLM). ``prompt_logprobs`` asks for the prompt's tokens' log-probabilities (each with that
    many top ones; the first token has none), as vLLM reports them. ``structured_outputs``
    (``StructuredOutputsParams`` or a dict of its fields) constrains the text to a JSON schema, a
    regex, a choice of strings or a grammar, exactly under speculation. ``logprobs`` asks for that many top
    log-probabilities per generated token (log-softmax of the raw logits, as vLLM reports them).
    ``seed`` makes a request reproducible: sample i's token at output position t is drawn with
    random numbers keyed by (seed, i, t), so a seeded request gives the same samples whatever it
    is batched with, and, with drafts that carry no distribution, whatever was drafted.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self):
        self.n = check_int("n", self.n, 1)
        self.temperature = check_real("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)",
                                      lambda t: t >= 0)
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        self.top_p = check_real("top_p", self.top_p, "must be a number in (0, 1]", lambda p: 0 < p <= 1)
        if self.top_k == -1:
            self.top_k = 0
        self.top_k = check_int("top_k", self.top_k, 0)
        self.min_p = check_real("min_p", self.min_p, "must be a number in [0, 1]", lambda p: 0 <= p <= 1)
        self.repetition_penalty = check_real("repetition_penalty", self.repetition_penalty,
                                             "must be a finite number > 0 (1 turns it off)", lambda p: p > 0)
        for name in ("frequency_penalty", "presence_penalty"):
            setattr(self, name, check_real(name, getattr(self, name), "must be a number in [-2, 2] (0 turns it off)",
                                           lambda p: -2 <= p <= 2))
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be at most max_tokens={self.max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)):
            raise _bad("stop", self.stop, "must be a non-empty string or a list of them")
        self.stop = list(stop or [])
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise _bad("stop_token_ids", ids, "must be a list of token ids >= 0")
        self.stop_token_ids = [int(t) for t in ids or []]
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.skip_special_tokens = check_bool("skip_special_tokens", self.skip_special_tokens)
        self.logit_bias = _logit_bias(self.logit_bias)
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed or not all(
                isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 for t in allowed)):
            raise _bad("allowed_token_ids", allowed, "must be a non-empty list of token ids >= 0 (or None)")
        self.allowed_token_ids = None if allowed is None else sorted({int(t) for t in allowed})
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words)):
            raise _bad("bad_words", words, "must be a list of words (non-empty strings)")
        self.bad_words = list(words) if words else None
        self.truncate_prompt_tokens = check_truncation(self.truncate_prompt_tokens)
        self.seed = check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1, none=True)
        self.logprobs = check_int("logprobs", self.logprobs, 0, none=True)
        self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, 0, none=True)
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            raise _bad("min_tokens", self.min_tokens, "cannot be combined with structured_outputs: the grammar may "
                       "allow nothing but the end of the text before min_tokens")


@dataclass
class SpecConfig:
    """How samples speculate. ``drafter="none"`` is plain decoding through the same step.

    ``max_draft_tokens`` bounds the depth of a sample's draft, ``max_draft_nodes`` its size
    (a chain when the two are equal and the drafter proposes one branch). ``scheme`` picks the
    verification rule ("auto": greedy at temperature 0, deterministic for unsampled drafts,
    the canonical decomposition for sampled ones); a scheme that is not exact for the drafter's
    drafts is refused (see ``multispec.verify.schemes``). ``adaptive`` lets each step
    choose its draft length from the measured cost of a forward and the measured acceptance, so
    speculation never costs more than it gains (off: always draft up to the maximum).

    ``sampled_drafts``: whether drafts are drawn from the drafter's distribution and verified by
    a multi-draft scheme, or copied and verified deterministically (None: the drafter's own way;
    consensus copies, the hybrid draws).

    ``drafter="model"`` drafts with a draft model (``"hybrid"``: merged with consensus's sibling
    drafts: the model's candidates drawn from its q and verified by recursive rejection, the
    sibling text copied after them; with ``sampled_drafts=False`` the model's top candidates are
    copied too and the whole tree verified deterministically). ``draft_model`` is a draft head
    file over the target's features (None: the head the registry pairs with the target), or a
    causal LM that shares the target's tokenizer (a checkpoint directory, a ``.gguf`` file, a
    Hub repository id in the local cache or a known model name), run with its own KV cache.
    ``num_candidates`` candidates are drawn at the root, each extended as a chain up to
    ``max_draft_tokens``; ``decision_threshold`` stops a chain
    where its next token's predicted chance of acceptance (a head's decision model; a draft LM's
    probability of its likeliest next token) falls below it (None: the head's recommended
    threshold, none for a draft LM; 0: always the full depth).
    ``max_draft_nodes`` defaults to ``max_draft_tokens * num_candidates``.
    """

    drafter: str = "none"
    max_draft_tokens: int = 6
    max_draft_nodes: int | None = None
    scheme: str = "auto"
    sampled_drafts: bool | None = None
    aggregate: bool = True
    max_ngram: int = 4
    min_ngram: int = 1
    max_batch_tokens: int | None = None
    adaptive: bool = True
    draft_model: str | None = None
    num_candidates: int = 1
    decision_threshold: float | None = None

    def __post_init__(self):
        if self.max_draft_nodes is None:
            self.max_draft_nodes = self.max_draft_tokens * self.num_candidates if (
                isinstance(self.max_draft_tokens, int) and isinstance(self.num_candidates, int)) else 6
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first bad field, or a scheme that is not exact for the
        drafter's drafts. Runs on construction and again before a request uses the config."""
        from multispec.drafters import DRAFTERS
        from multispec.verify.schemes import NAMES, check_drafts

        check_choice("drafter", self.drafter, tuple(DRAFTERS))
        check_choice("scheme", self.scheme, NAMES)
        for name in ("max_draft_tokens", "max_draft_nodes"):
            check_int(name, getattr(self, name), 0)
        for name in ("aggregate", "adaptive"):
            check_bool(name, getattr(self, name))
        if self.sampled_drafts is not None and not isinstance(self.sampled_drafts, bool):
            raise _bad("sampled_drafts", self.sampled_drafts, "must be True, False or None (the drafter's own way)")
        check_int("max_ngram", self.max_ngram, 1)
        check_int("min_ngram", self.min_ngram, 1, self.max_ngram)
        check_int("max_batch_tokens", self.max_batch_tokens, 1, none=True)
        check_int("num_candidates", self.num_candidates, 1)
        if self.decision_threshold is not None:
            check_real("decision_threshold", self.decision_threshold, "must be a number in [0, 1] or None",
                       lambda t: 0 <= t <= 1)
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise _bad("draft_model", self.draft_model, "must be a path (a string) or None")
        if self.drafter in HEAD_DRAFTERS:
            check_int("max_draft_tokens", self.max_draft_tokens, 1)
            check_int("max_draft_nodes", self.max_draft_nodes, 1)
        elif self.draft_model is not None:
            raise _bad("draft_model", self.draft_model,
                       f"is used only by drafter='model' or 'hybrid' (drafter={self.drafter!r})")
        check_drafts(self.scheme, self.draft_law, drafter=self.drafter)

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.max_draft_nodes > 0 and self.max_draft_tokens > 0

    @property
    def sampled(self) -> bool:
        """Whether the drafts are drawn (``sampled_drafts``, or where it is None the drafter's
        own way)."""
        from multispec.drafters import draws_by_default

        return draws_by_default(self.drafter) if self.sampled_drafts is None else self.sampled_drafts

    @property
    def draft_law(self):
        """How the drafter draws its trees under this config (None: nothing is drafted)."""
        from multispec.drafters import draft_law

        law = draft_law(self.drafter, sampled=self.sampled, max_depth=max(1, self.max_draft_tokens),
                        max_nodes=self.max_draft_nodes, num_candidates=self.num_candidates, scheme=self.scheme)
        return law if self.speculates else None

    def check_temperature(self, temperature: float) -> None:
        """Raise ValueError unless the scheme is exact for this config's drafts at ``temperature``."""
        from multispec.verify.schemes import check_drafts

        check_drafts(self.scheme, self.draft_law, temperature, drafter=self.drafter)


class RequestOutputKind(str, Enum):
    """What ``LLMEngine.step`` reports for a request (vLLM's names): every sample's output so far
    each time it changes (``CUMULATIVE``, the default), only what is new since the last report
    (``DELTA``, for streaming), or nothing until the request is finished (``FINAL_ONLY``)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    """One sample: its text, token ids, summed log-probability and why it stopped.

    ``finish_reason``: None while the sample runs, then "stop" (an end token, a stop token or a
    stop string), "length" (``max_tokens`` or the context window) or "abort"; ``stop_reason`` is
    the stop string or stop token id that ended it (None for the model's end token)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class _SpeculationFigures:
    """tau and acceptance from the counters ``sample_steps``, ``accepted_tokens``, ``drafted_tokens``."""

    sample_steps: int
    accepted_tokens: int
    drafted_tokens: int

    @property
    def tau(self) -> float:
        """Mean tokens a sample gains per target forward (1.0 for plain decoding)."""
        return (self.accepted_tokens + self.sample_steps) / self.sample_steps if self.sample_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class RequestMetrics(_SpeculationFigures):
    """One request's timeline (``time.monotonic`` seconds) and speculation figures."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    decode_steps: int = 0
    sample_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class RequestOutput:
    """One prompt's n completions (all of them, or in delta mode those that changed).

    ``finished`` once every sample is done; ``error`` says why the request failed, if it did (its
    samples then end with finish_reason "abort"; other requests are not affected)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Where ``SamplingParams.prompt_logprobs`` asked: per prompt token, its log-probability given
    the tokens before it (and the top ones), None for the first."""
    prompt_token_ranks: list[int | None] | None = None
    """With ``prompt_logprobs``: each prompt token's rank among the vocabulary at its position (1:
    the likeliest), None for the first (vLLM's ``Logprob.rank``)."""
    num_cached_tokens: int = 0
    """Prompt tokens whose keys and values came from an earlier prompt (prefix caching)."""


@dataclass
class RunStats(_SpeculationFigures):
    """Counters and timings of the engine (running totals) or of one ``generate`` call (their
    difference over the call); the basis of every speed figure."""

    prefill_forwards: int = 0
    decode_forwards: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Of ``prompt_tokens``, those whose keys and values were reused from earlier prompts."""
    generated_tokens: int = 0
    finished_samples: int = 0
    sample_steps: int = 0
    forward_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_forward: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_total: float = 0.0
    time_draft_model: float = 0.0
    """Part of ``time_draft`` spent in a draft model's forwards (``drafter="model"``)."""
    draft_forwards: int = 0
    """Forwards of a draft model (one per draft depth of a step)."""

    def since(self, earlier: RunStats) -> RunStats:
        """What was counted after ``earlier`` (a copy of these totals taken before)."""
        return RunStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def copy(self) -> RunStats:
        return replace(self)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.time_total if self.time_total else 0.0

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.time_total:.2f}s ({self.tokens_per_second:.1f} tok/s); "
                f"forwards {self.decode_forwards} (+{self.prefill_forwards} prefill); tau {self.tau:.2f}; "
                f"acceptance {self.acceptance_rate:.1%} of {self.drafted_tokens} drafted; time draft "
                f"{self.time_draft:.2f}s / forward {self.time_forward:.2f}s / verify {self.time_verify:.2f}s / "
                f"commit {self.time_commit:.2f}s / prefill {self.time_prefill:.2f}s"
                + (f"; draft model {self.time_draft_model:.2f}s in {self.draft_forwards} forwards "
                   f"({self.draft_forwards / max(1, self.decode_forwards):.1f} a step)" if self.draft_forwards else ""))
