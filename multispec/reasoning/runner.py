"""Questions through the engine side by side, each one's samples watched as they finish.

``generate`` steps the engine itself (``enqueue`` / ``step`` / ``abort_sample``) rather than
calling ``LLM.generate``: every time a sample of a question finishes, the question's early-stop
rule sees the answers finished so far, and once it fires the question's unfinished samples are
aborted at once, their slots going to the next question. Questions are admitted while the
samples in flight stay within ``max_samples``, so the batch stays full as questions stop early.
Each question's request is seeded with the run's seed plus the question's position, so a seeded
question gets the same samples whatever runs beside it (and on whichever machine).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

from multispec.api import LLM
from multispec.engine.request import Request
from multispec.params import RequestOutput, RequestOutputKind, SamplingParams, SpecConfig
from multispec.reasoning.early_stop import StopRule
from multispec.reasoning.tasks import Problem, Task

MAX_SAMPLES = 64
"""Samples in flight the runner aims for: enough to keep a CPU's matrix products busy, few
enough that a question's samples share a step with a few other questions only."""
_IDS = itertools.count()


@dataclass
class Completion:
    """One sample of a question as far as it ran: ``finish_reason`` "stop", "length" or "abort"
    (ended by the early stop, or by a request error); ``answer`` is extracted from samples that
    finished on their own only."""

    index: int
    text: str = ""
    tokens: int = 0
    logprob: float = 0.0
    finish_reason: str | None = None
    answer: str | None = None


@dataclass
class Generation:
    """A question's samples once its request ended. ``finish_order``: the samples that finished on
    their own, in the order they did; ``seconds`` from queuing the request to its end."""

    position: int
    problem: Problem
    samples: list[Completion]
    finish_order: list[int] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def tokens(self) -> int:
        """Tokens generated for the question, aborted samples' included: its compute."""
        return sum(s.tokens for s in self.samples)

    @property
    def stopped_early(self) -> bool:
        return self.error is None and any(s.finish_reason == "abort" for s in self.samples)


class _Question:
    """A question in flight: its samples' text so far, and its stop rule."""

    def __init__(self, position: int, problem: Problem, request: Request, task: Task, rule: StopRule | None):
        self.generation = Generation(position, problem, [Completion(i) for i in range(request.n)])
        self.request_id = request.request_id
        self.task = task
        self.rule = rule
        self.stopped = False
        self.start = time.perf_counter()

    @property
    def running(self) -> int:
        """Samples still holding a slot."""
        return 0 if self.stopped else len(self.generation.samples) - len(self.generation.finish_order)

    def absorb(self, output: RequestOutput, engine) -> None:
        """Take a step's deltas; at each sample that finishes on its own, extract its answer and
        ask the rule, aborting the rest once it fires."""
        generation = self.generation
        for delta in output.outputs:
            sample = generation.samples[delta.index]
            sample.text += delta.text
            sample.tokens += len(delta.token_ids)
            sample.logprob = delta.cumulative_logprob
            if delta.finish_reason is None or sample.finish_reason is not None:
                continue
            sample.finish_reason = delta.finish_reason
            if delta.finish_reason == "abort":
                continue
            sample.answer = self.task.extract(generation.problem, sample.text)
            generation.finish_order.append(delta.index)
            if self._rule_fires():
                self.stopped = True
                for other in generation.samples:
                    if other.finish_reason is None:
                        engine.abort_sample(self.request_id, other.index)
        if output.finished:
            generation.seconds = time.perf_counter() - self.start
            generation.error = output.error

    def _rule_fires(self) -> bool:
        generation = self.generation
        if self.rule is None or self.stopped or len(generation.finish_order) == len(generation.samples):
            return False
        answers = [generation.samples[i].answer for i in generation.finish_order]
        return self.rule.should_stop(answers, self.task.equivalent)


def generate(llm: LLM, task: Task, problems: Sequence[Problem], params: SamplingParams,
             spec: SpecConfig | None = None, rule: StopRule | None = None, *,
             positions: Sequence[int] | None = None, max_samples: int = MAX_SAMPLES) -> Iterator[Generation]:
    """Each question's ``Generation`` as soon as its request ends (not in input order: see
    ``position``). Every request is built and checked before any runs. ``positions``: the
    questions' places in the whole job (default 0, 1, ...), which key their seeds."""
    engine = llm.engine
    if engine.driver is not None:
        raise RuntimeError(f"this LLM's engine is stepped by {engine.driver}; use that, or shut it down")
    positions = list(range(len(problems))) if positions is None else list(positions)
    waiting = deque(zip(positions, problems, _requests(llm, problems, params, spec, positions)))
    live: dict[str, _Question] = {}
    try:
        while waiting or live:
            while waiting and (not live or sum(q.running for q in live.values()) + params.n <= max_samples):
                position, problem, request = waiting.popleft()
                engine.enqueue(request)
                live[request.request_id] = _Question(position, problem, request, task, rule)
            if not engine.has_unfinished_requests():
                raise RuntimeError("the engine has no work left but questions are unanswered")
            for output in engine.step():
                question = live.get(output.request_id)
                if question is None:
                    continue
                question.absorb(output, engine)
                if output.finished:
                    del live[output.request_id]
                    yield question.generation
    finally:
        for request_id in live:
            engine.abort(request_id)


def _requests(llm: LLM, problems: Sequence[Problem], params: SamplingParams, spec: SpecConfig | None,
              positions: list[int]) -> list[Request]:
    """One streamed request per question, its prompt the chat template applied to the problem's
    messages, seeded by position when the run is."""
    tokenizer = llm.tokenizer
    requests = []
    for position, problem in zip(positions, problems):
        text = tokenizer.apply_chat_template(problem.chat(), add_generation_prompt=True)
        seeded = params if params.seed is None else replace(params, seed=params.seed + position)
        requests.append(llm.engine.make_request(
            f"eval-{next(_IDS)}", tokenizer.encode(text, add_special_tokens=False), seeded, spec, prompt=text,
            output_kind=RequestOutputKind.DELTA, name=f"the prompt of question {problem.id}"))
    return requests
