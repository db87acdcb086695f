"""``AsyncLLM``: the engine stepped in one background thread, each request an async stream.

The engine is not thread-safe, so one thread owns it: it takes new requests and aborts from a
queue between steps, steps while there is work, and hands each request's outputs to the asyncio
loop of whoever is reading them. A reader that stops reading (its task cancelled, or the stream
closed early) aborts its request, whose slots go to the next waiting request at once. If a step
raises, the loop stops, every open stream gets the error, and ``healthy`` turns false.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator, Sequence

from multispec.api import LLM, _conversations, chat_options
from multispec.params import RequestOutput, RequestOutputKind, SamplingParams, SpecConfig


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run any more."""


class AsyncLLM:
    """Asynchronous front end of an ``LLM``'s engine (``AsyncLLM(LLM(...))`` or
    ``AsyncLLM(model=..., **llm_options)``); the ``LLM`` must not be used directly meanwhile."""

    def __init__(self, llm: LLM | None = None, **llm_options):
        self.llm = llm if llm is not None else LLM(**llm_options)
        self.engine = self.llm.engine
        if self.engine.driver is not None:
            raise ValueError(f"this LLM's engine is already stepped by {self.engine.driver}")
        self.engine.driver = "an AsyncLLM"
        self.tokenizer = self.llm.tokenizer
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="multispec-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """The engine loop is running."""
        return self.error is None and self._thread.is_alive()

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, spec: SpecConfig | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA, *,
                       grammar_after: int | None = None, grammar_open: bool | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (by default only what is new each time, see
        ``RequestOutputKind``); the last has ``finished`` set. The request is checked before it is
        queued (a ValueError here, as from ``LLM.generate``). Leaving the loop early, or
        cancelling the task that reads, aborts the request. ``grammar_after``, ``grammar_open``:
        see ``LLMEngine.make_request``."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, prompt
        async for out in self._stream(text, ids, sampling_params, request_id, spec, output_kind, grammar_after,
                                      grammar_open):
            yield out

    async def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, spec: SpecConfig | None = None,
                   output_kind: RequestOutputKind = RequestOutputKind.DELTA, *, chat_template: str | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   chat_template_kwargs: dict | None = None, tools: list[dict] | None = None
                   ) -> AsyncIterator[RequestOutput]:
        """``generate`` for one conversation, rendered with the checkpoint's chat template (the
        template options and ``tools`` as ``LLM.chat`` takes them)."""
        (conversation,) = _conversations(messages)
        options = chat_options(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs,
                               tools)
        text = self.tokenizer.apply_chat_template(conversation, **options)
        async for out in self._stream(text, self.tokenizer.encode(text, add_special_tokens=False), sampling_params,
                                      request_id, spec, output_kind):
            yield out

    async def _stream(self, text, ids, sampling_params, request_id, spec, output_kind, grammar_after=None,
                      grammar_open=None):
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.error}")
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        request = self.engine.make_request(request_id, ids, sampling_params or SamplingParams(), spec, prompt=text,
                                           output_kind=output_kind, grammar_after=grammar_after,
                                           grammar_open=grammar_open)
        outputs: asyncio.Queue = asyncio.Queue()
        self._command(("add", request, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # only the stream that owns the request aborts it
                self._command(("abort", request_id, outputs))

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe; unknown ids are ignored)."""
        self._command(("abort", request_id, None))

    async def reset_prefix_cache(self) -> bool:
        """Forget every prompt the cache holds (vLLM's method), on the engine's thread between two
        steps; True once done."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.error}")
        done = threading.Event()
        self._command(("reset", done))
        return await asyncio.get_running_loop().run_in_executor(None, done.wait, 60.0)

    def shutdown(self) -> None:
        """Stop the engine loop; open streams get an error."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self.engine.driver = None

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the engine thread
    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for out in engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as error:  # noqa: BLE001 - reported to every reader, and by ``healthy``
            self.error = error
        failure = EngineDeadError(f"the engine loop stopped: {self.error}" if self.error else "the engine shut down")
        for request_id in list(self._streams):
            self._deliver(request_id, failure)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "reset":
                self.engine.reset_prefix_cache()
                command[1].set()
            elif command[0] == "add":
                _, request, loop, outputs = command
                if request.request_id in self._streams or request.request_id in self.engine.requests:
                    error = ValueError(f"request_id={request.request_id!r} is already in use")
                    loop.call_soon_threadsafe(outputs.put_nowait, error)
                    continue
                self._streams[request.request_id] = (loop, outputs)
                self.engine.enqueue(request)
            else:
                _, request_id, outputs = command
                stream = self._streams.get(request_id)
                if outputs is not None and (stream is None or stream[1] is not outputs):
                    continue  # that stream does not own the request (an id refused as in use, or done)
                self._streams.pop(request_id, None)
                self.engine.abort(request_id)

    def _deliver(self, request_id: str, item) -> None:
        """Hand an output (or an error) to the request's reader; a finished request's stream closes."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the reader's loop is closed: nobody reads this request any more
            self.engine.abort(request_id)
