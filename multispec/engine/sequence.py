"""A request (one prompt, its sampling settings) and the n samples it fans out to."""

from __future__ import annotations

from dataclasses import dataclass, field

from multispec.params import SamplingParams


@dataclass
class Sample:
    """One completion in flight.

    ``output_ids`` ends with the *root*: the last sampled token, whose keys are not cached yet
    (it is the first input of the next step). ``cached`` counts the generated tokens whose keys
    are in the sample's cache slot, so while the sample runs ``cached == len(output_ids) - 1``.
    ``written`` is how many cache entries the slot uses: equal to ``cached`` except in the
    padded-batching ablation, where masked filler entries sit between real ones. ``key`` keys the
    random numbers of its tokens (from the request's seed and the sample's index; see
    ``multispec.verify.sampling``).
    """

    request: "Request"
    index: int
    sample_id: int
    key: int
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0
    written: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_text_end: int | None = None

    @property
    def root(self) -> int:
        return self.output_ids[-1]

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output_ids)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    seed: int
    stop_ids: frozenset[int]
    samples: list[Sample] = field(default_factory=list)
    prompt_slot: int = -1
    unfinished: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
