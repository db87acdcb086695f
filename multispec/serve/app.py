"""The FastAPI application of ``multispec serve``, built on an ``AsyncLLM``.

Routes stay thin: check the model name, turn the body into engine inputs
(``multispec.serve.sampling``), pass the queue gate, then answer with the whole response or a
stream (``multispec.serve.generation``). Every refusal, wherever it is found, is OpenAI's error
body (``multispec.serve.errors``) and is counted in the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import multispec
from multispec.async_llm import AsyncLLM
from multispec.serve.errors import APIError, from_exception, from_validation_error, invalid
from multispec.serve.formats import ChatFormat, CompletionFormat
from multispec.serve.generation import Generation, Run, Traffic
from multispec.serve.guard import Guard
from multispec.serve.metrics import Metrics
from multispec.serve.sampling import (Limits, chat_echo, chat_inputs, chat_prompt, completion_inputs, generation_turn,
                                      structured_outputs, tool_mode)
from multispec.serve.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                     ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from multispec.serve.tools import REASONING_PARSERS

CLIENT_CLOSED = 499
"""The status logged for a request whose client left before the answer (nginx's convention)."""


@dataclass
class ServerConfig:
    """What ``multispec serve`` sets beyond the model: the name clients use, the key, the limits."""

    served_model_name: str
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_queued_requests: int = 256
    max_request_bytes: int = 8 << 20
    chat_template: str | None = None
    """``--chat-template``: used where a chat request gives none (None: the checkpoint's)."""
    reasoning_parser: str | None = None
    """``--reasoning-parser NAME``: how a reasoning model's thinking is split from its answer in chat
    responses (``multispec.serve.tools.REASONING_PARSERS``); None: not split."""
    tool_parser: str | None = None
    """``--enable-auto-tool-choice --tool-call-parser NAME``: how "auto" tool calls are read out of
    the text (``multispec.serve.tools.TOOL_PARSERS``); None: "auto" is refused."""
    sampling_defaults: dict = field(default_factory=dict)
    """The model's generation config (``--generation-config``): fills the sampling fields a
    request leaves out."""


class EventStream(StreamingResponse):
    """Server-sent events whose engine requests are aborted however the response ends: finished,
    failed, or cut short by the client leaving (which cancels the stream)."""

    def __init__(self, events, generation: Generation):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()


def build_app(async_llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The app; it owns ``async_llm`` from here on and shuts it down when the server stops."""
    engine = async_llm.engine
    traffic = Traffic(config.max_queued_requests)
    metrics = Metrics(async_llm, traffic)
    default_spec = async_llm.llm.spec
    started = int(time.time())
    ids = itertools.count()
    instance = secrets.token_hex(4)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="multispec", version=multispec.__version__, lifespan=lifespan)

    def reject(error: APIError) -> JSONResponse:
        metrics.rejected.labels(str(error.status)).inc()
        return error.response()

    app.add_middleware(Guard, api_key=config.api_key, max_bytes=config.max_request_bytes, reject=reject)
    app.add_exception_handler(APIError, lambda _request, error: reject(error))
    app.add_exception_handler(RequestValidationError, lambda _request, error: reject(from_validation_error(error)))
    app.add_exception_handler(HTTPException,
                              lambda _request, error: reject(APIError(error.status_code, str(error.detail))))
    app.add_exception_handler(Exception, lambda _request, error: reject(from_exception(error)))

    def check_model(name: str | None) -> None:
        if name is not None and name != config.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {config.served_model_name!r}",
                           "model", "model_not_found")

    def check_healthy() -> None:
        if not async_llm.healthy:
            raise APIError(503, f"the engine loop stopped: {async_llm.error}", code="engine_dead")

    async def answer(body, inputs, fmt, request: Request) -> Response:
        check_healthy()
        traffic.check()
        generation = Generation(async_llm, inputs, f"{instance}{next(ids)}", traffic)
        run = Run(generation, fmt, config.served_model_name, inputs.params.n, metrics)
        generation.start()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(run.events(include_usage), generation)
        try:
            response = await _unless_client_leaves(run.collect(), request)
        except Exception as error:  # noqa: BLE001 - an error of this request or of the engine
            raise from_exception(error) from None
        finally:
            await generation.close()
        if response is None:
            return Response(status_code=CLIENT_CLOSED)
        return Response(response.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        inputs = completion_inputs(body, engine, default_spec, config.limits, config.sampling_defaults)
        fmt = CompletionFormat(engine.tokenizer, body.logprobs, bool(body.return_tokens_as_token_ids), inputs.echo,
                               inputs.generate, body.prompt_logprobs)
        return await answer(body, inputs, fmt, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        tools = tool_mode(body, config.tool_parser)
        inputs = chat_inputs(body, engine, default_spec, config.limits, config.chat_template,
                             config.sampling_defaults)
        parser = REASONING_PARSERS.get(config.reasoning_parser)
        # Qwen3's parser: a request that turns thinking off has no thinking to split off or wait for.
        thinking = not (parser is not None and parser.reads_enable_thinking
                        and (body.chat_template_kwargs or {}).get("enable_thinking", True) is False)
        if parser is not None and thinking and inputs.params.structured_outputs is not None:
            # As vLLM: the constraint rules the answer, from the token that ends the thinking on.
            end = parser.end
            inputs.grammar_after = engine.tokenizer.token_to_id(end)
            if inputs.grammar_after is None:
                _, name = structured_outputs(body)  # (only to name the field)
                raise invalid(name, f"{name}: with --reasoning-parser the constraint starts after {end!r}, which is "
                                    f"no single token of this model's vocabulary")
            # Ended in the prompt only where the answer's own turn closes the thinking (a template
            # that closes an empty block, a continued message holding the tag): an earlier turn's
            # thinking kept in the prompt (a tool loop's) leaves this answer's still to come.
            turn = generation_turn(body, engine.tokenizer, config.chat_template)
            inputs.grammar_open = turn.rfind(end) > turn.rfind(parser.start)
        if tools is not None and tools.kind == "auto":  # as vLLM: the call tags may be special tokens
            inputs.params = replace(inputs.params, skip_special_tokens=False)
        fmt = ChatFormat(engine.tokenizer, inputs.params.logprobs, bool(body.return_tokens_as_token_ids),
                         body.prompt_logprobs, tools, config.reasoning_parser, thinking, chat_echo(body))
        return await answer(body, inputs, fmt, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's: a prompt's or a chat's token ids, as the completions and chat endpoints would
        run them (the chat through the same template and options)."""
        check_model(body.model)
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of 'prompt' (text) and 'messages' (a chat)")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            ids = chat_prompt(body, tokenizer, config.chat_template, bool(body.add_special_tokens))
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.config.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: the text of token ids (special tokens' text included, as vLLM decodes them)."""
        check_model(body.model)
        outside = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if outside:
            raise invalid("tokens", f"token ids must lie in [0, {engine.vocab_size}), not {outside[:5]}")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's: the tokenizer's configuration (named special tokens, the chat template the chat
        endpoint renders with, the context length), what evaluation harnesses read to tokenize
        through this server instead of loading the tokenizer themselves."""
        tokenizer = engine.tokenizer
        info = {**tokenizer.special_tokens, "tokenizer_class": tokenizer.tokenizer_class or "PreTrainedTokenizerFast",
                "model_max_length": engine.config.max_model_len,
                "add_bos_token": tokenizer.bos_token_id is not None
                and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]}
        template = config.chat_template if config.chat_template is not None else tokenizer.chat_template
        if template is not None:
            info["chat_template"] = template
        return info

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=config.served_model_name, created=started, root=str(async_llm.llm.model_name),
                         max_model_len=engine.config.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        check_healthy()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": multispec.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _unless_client_leaves(work, request: Request):
    """Await ``work``; if the client disconnects first, cancel it (its engine requests are then
    aborted) and return None: there is nobody left to answer."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
