"""Running one API request on the ``AsyncLLM``: its prompts' streams merged into one, read either
into a response or as server-sent events.

Every request runs in delta mode, streamed or not, so the server sees when each prompt starts
(its first output): that is what tells the waiting requests, which ``--max-queued-requests``
bounds, from the running ones. A request ends in one of three ways, counted in the metrics: ok,
failed (an error of its own, or the engine's) or aborted (the client left; its engine requests
are aborted and their slots go to who waits).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager
from typing import AsyncIterator

from multispec.async_llm import AsyncLLM
from multispec.params import RequestMetrics, RequestOutput, RunStats
from multispec.serve.errors import APIError, from_exception
from multispec.serve.formats import Choice
from multispec.serve.metrics import Metrics
from multispec.serve.sampling import EngineInputs
from multispec.serve.schemas import PromptTokensDetails, SpeculationFigures, Usage


class Traffic:
    """The server's engine requests (one per prompt): waiting for their first output, or running."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.waiting = 0
        self.running = 0

    def check(self) -> None:
        """Refuse a new request while the queue is full (503, with when to try again)."""
        if self.waiting >= self.max_waiting:
            raise APIError(503, f"the server is overloaded: {self.waiting} requests wait to start (its "
                                f"--max-queued-requests); try again shortly", code="overloaded",
                           headers={"Retry-After": "1"})


class Generation:
    """One API request's engine requests, one per prompt, read as one stream of (prompt index,
    delta output). ``start`` submits them; ``close`` aborts whatever has not finished."""

    def __init__(self, async_llm: AsyncLLM, inputs: EngineInputs, request_id: str, traffic: Traffic):
        self.async_llm = async_llm
        self.inputs = inputs
        self.request_id = request_id
        self.traffic = traffic
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.traffic.waiting += len(self.inputs.prompts)
        self.tasks = [asyncio.create_task(self._pump(i, ids)) for i, ids in enumerate(self.inputs.prompts)]

    async def _pump(self, index: int, ids: list[int]) -> None:
        started = False
        try:
            async for out in self.async_llm.generate(ids, self.inputs.params, f"{self.request_id}-{index}",
                                                     self.inputs.spec, grammar_after=self.inputs.grammar_after,
                                                     grammar_open=self.inputs.grammar_open):
                if not started:
                    started = True
                    self.traffic.waiting -= 1
                    self.traffic.running += 1
                self.outputs.put_nowait((index, out))
        except Exception as error:  # noqa: BLE001 - handed to the reader, who reports it
            self.outputs.put_nowait((index, error))
        finally:
            if started:
                self.traffic.running -= 1
            else:
                self.traffic.waiting -= 1
            self.outputs.put_nowait((index, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        left = len(self.tasks)
        while left:
            index, item = await self.outputs.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            elif item.error is not None:
                raise APIError(500, f"the request failed: {item.error}", code="request_failed")
            else:
                yield index, item

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Tally:
    """What a response reports beyond its choices: token counts and speculation figures."""

    def __init__(self, prompts: list[list[int]]):
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.completion_tokens = 0
        self.cached_tokens: dict[int, int] = {}
        self.metrics: dict[int, RequestMetrics] = {}
        self.first_token: float | None = None

    def add(self, index: int, out: RequestOutput, tokens: int) -> None:
        """One engine output of prompt ``index``, its samples showing ``tokens`` new tokens."""
        if tokens and self.first_token is None:
            self.first_token = time.monotonic()
        self.completion_tokens += tokens
        self.cached_tokens[index] = out.num_cached_tokens
        if out.metrics is not None:
            self.metrics[index] = out.metrics

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))

    def speculation(self) -> SpeculationFigures:
        parts = self.metrics.values()
        sums = RunStats(decode_forwards=sum(m.decode_steps for m in parts),
                        sample_steps=sum(m.sample_steps for m in parts),
                        drafted_tokens=sum(m.drafted_tokens for m in parts),
                        accepted_tokens=sum(m.accepted_tokens for m in parts))
        return SpeculationFigures(forwards=sums.decode_forwards, tau=sums.tau, acceptance_rate=sums.acceptance_rate,
                                  drafted_tokens=sums.drafted_tokens, accepted_tokens=sums.accepted_tokens)


class Run:
    """One request being answered: the engine side (``Generation``), how it is presented (a format
    from ``multispec.serve.formats``) and its bookkeeping."""

    def __init__(self, generation: Generation, fmt, model: str, n: int, metrics: Metrics):
        self.generation = generation
        self.fmt = fmt
        self.model = model
        self.n = n
        self.metrics = metrics
        self.id = f"{fmt.id_prefix}-{generation.request_id}"
        self.created = int(time.time())
        self.start = time.monotonic()
        self.tally = Tally(generation.inputs.prompts)
        self.choices = [Choice() for _ in range(n * len(generation.inputs.prompts))]

    def _take(self, index: int, out: RequestOutput) -> list[tuple]:
        """Gather one output into the choices; its (choice index, delta, log-probabilities) for
        the stream. Choices are numbered prompt by prompt, n each, as vLLM numbers them."""
        taken = []
        for delta in out.outputs:
            choice_index = index * self.n + delta.index
            choice = self.choices[choice_index]
            delta, logprobs = self.fmt.present(index, out, delta, choice)
            choice.add(delta, logprobs)
            taken.append((choice_index, delta, logprobs))
        self.tally.add(index, out, sum(len(delta.token_ids) for _, delta, _ in taken))
        return taken

    async def collect(self):
        """The whole response (for ``stream: false``)."""
        with self._outcome():
            async for index, out in self.generation:
                self._take(index, out)
        return self.fmt.response(self.id, self.created, self.model, self.choices, usage=self.tally.usage(),
                                 speculation=self.tally.speculation())

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: the opening chunks, one chunk per sample delta (choices interleaved
        as they come, each one's finish_reason once), the usage chunk when asked, ``[DONE]``. An
        error after the stream began arrives as an error chunk before ``[DONE]``."""
        head = (self.id, self.created, self.model)
        try:
            with self._outcome():
                for chunk in self.fmt.opening(*head, len(self.choices)):
                    yield _event(chunk.model_dump_json())
                async for index, out in self.generation:
                    # One write for all the chunks of one engine output (a step's deltas of n samples).
                    chunks = [self.fmt.chunk(*head, choice_index, delta, logprobs, self.choices[choice_index])
                              for choice_index, delta, logprobs in self._take(index, out)
                              if delta.token_ids or delta.text or delta.finish_reason]
                    events = [_event(chunk.model_dump_json()) for chunk in chunks if chunk is not None]
                    if events:
                        yield "".join(events)
                if include_usage:
                    yield _event(self.fmt.tail(*head, usage=self.tally.usage(),
                                               speculation=self.tally.speculation()).model_dump_json())
        except Exception as error:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield _event(json.dumps(from_exception(error).body()))
        yield _event("[DONE]")

    @contextmanager
    def _outcome(self):
        """Count how the run ended (ok, failed, aborted: the client left) and its latencies."""
        outcome = "failed"
        try:
            yield
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            self.metrics.finished(self.fmt.endpoint, outcome, self.start, self.tally.first_token)


def _event(data: str) -> str:
    return f"data: {data}\n\n"
