"""What a caller asks for (sampling, speculation) and what comes back.

These plain dataclasses are shared by the API, the engine and the server; they validate
themselves on construction so a bad value is reported with its field name before any work
starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFTERS = ("none", "consensus", "ngram")
SCHEMES = ("auto", "greedy", "deterministic", "single", "specinfer", "without_replacement", "spectr",
           "canonical_lp", "canonical_wis")
BATCHING = ("unpadded", "padded")


def _bad(name: str, value, why: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {why}")


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM.

    ``top_k`` 0 (or -1, as vLLM spells it) turns top-k off. ``logprobs`` asks for that many
    top log-probabilities per generated token (log-softmax of the raw logits, as vLLM
    reports them); ``seed`` makes a request reproducible on its own, whatever it is batched
    with.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", self.n, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise _bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise _bad("top_k", self.top_k, "must be an integer >= 0 (0 turns it off)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", self.stop, "must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be token ids >= 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise _bad("seed", self.seed, "must be an integer or None")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "must be an integer >= 0 or None")


@dataclass
class SpecConfig:
    """How samples speculate. ``drafter="none"`` is plain decoding through the same step.

    ``max_draft_tokens`` bounds the depth of a sample's draft, ``max_draft_nodes`` its size
    (a chain when the two are equal and the drafter proposes one branch). ``scheme`` picks the
    verification rule ("auto": greedy at temperature 0, deterministic for unsampled drafts,
    the canonical decomposition for sampled ones). ``batching="padded"`` is the ablation that
    pads every sample to the batch's longest draft and acceptance. ``adaptive`` lets each step
    choose its draft length from the measured cost of a forward and the measured acceptance, so
    speculation never costs more than it gains (off: always draft up to the maximum).
    """

    drafter: str = "none"
    max_draft_tokens: int = 6
    max_draft_nodes: int = 6
    scheme: str = "auto"
    sampled_drafts: bool = False
    aggregate: bool = True
    batching: str = "unpadded"
    max_ngram: int = 4
    min_ngram: int = 1
    max_batch_tokens: int | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise _bad("drafter", self.drafter, f"must be one of {', '.join(DRAFTERS)}")
        if self.scheme not in SCHEMES:
            raise _bad("scheme", self.scheme, f"must be one of {', '.join(SCHEMES)}")
        if self.batching not in BATCHING:
            raise _bad("batching", self.batching, f"must be one of {', '.join(BATCHING)}")
        for name in ("max_draft_tokens", "max_draft_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad(name, value, "must be an integer >= 0")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise _bad("min_ngram", self.min_ngram, f"must be in [1, max_ngram={self.max_ngram}]")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise _bad("max_batch_tokens", self.max_batch_tokens, "must be >= 1 or None")

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.max_draft_nodes > 0 and self.max_draft_tokens > 0


@dataclass
class CompletionOutput:
    """One sample: its text, token ids, summed log-probability and why it stopped."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One prompt's n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class RunStats:
    """Counters and timings of one ``generate`` call; the basis of every speed figure."""

    prefill_forwards: int = 0
    decode_forwards: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
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
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens a sample gains per target forward (1.0 for plain decoding)."""
        return (self.accepted_tokens + self.sample_steps) / self.sample_steps if self.sample_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.time_total if self.time_total else 0.0

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.time_total:.2f}s ({self.tokens_per_second:.1f} tok/s); "
                f"forwards {self.decode_forwards} (+{self.prefill_forwards} prefill); tau {self.tau:.2f}; "
                f"acceptance {self.acceptance_rate:.1%} of {self.drafted_tokens} drafted; time draft "
                f"{self.time_draft:.2f}s / forward {self.time_forward:.2f}s / verify {self.time_verify:.2f}s / "
                f"commit {self.time_commit:.2f}s / prefill {self.time_prefill:.2f}s")
