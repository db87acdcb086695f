"""``multispec serve [MODEL]``: its arguments and the runner (model loaded, then uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from multispec.cli import DEFAULT_MODEL, _add_model_args, _add_spec_args, _spec, _text_or_file, model_options
from multispec.serve.tools import REASONING_PARSERS, TOOL_PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_name", nargs="?", metavar="MODEL",
                        help="registered name, Hugging Face checkpoint directory, Hub repository id in the "
                             "local cache or .gguf file (or --model)")
    _add_model_args(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context window (default: the model's)")
    _add_spec_args(parser, drafter="consensus")
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients give as 'model' (default: the model as given)")
    parser.add_argument("--api-key", default=os.environ.get("MULTISPEC_API_KEY"),
                        help="every /v1 request must send 'Authorization: Bearer KEY' (default: $MULTISPEC_API_KEY)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the requests that give no seed, in the order they arrive (default: fresh "
                             "randomness)")
    parser.add_argument("--max-n", type=int, default=64, help="samples per request (default: %(default)s)")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="tokens per sample a request may ask for (default: the context window)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests waiting to start beyond which new ones get 503 (default: %(default)s)")
    parser.add_argument("--max-request-bytes", type=int, default=8 << 20,
                        help="largest request body; larger ones get 413 (default: %(default)s)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="where requests' default sampling settings come from: 'auto' (default) the model's "
                             "generation_config.json, 'vllm' OpenAI's defaults, or a directory holding one")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                        help="a Jinja chat template for requests that give none (default: the checkpoint's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="answer tool_choice 'auto' (the default with tools): the model's own tool calls are read "
                             "out of its text with --tool-call-parser (as vLLM)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model's tool-call format (hermes: <tool_call>{...}</tool_call>, as Qwen2.5, Qwen3 "
                             "and Hermes models write them; llama3_json: an answer of JSON objects {\"name\", "
                             "\"parameters\"}, as Llama 3.1-3.3 write them; mistral: [TOOL_CALLS] and the calls)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split a reasoning model's thinking from its answer in chat responses (message.reasoning, "
                             "as vLLM): deepseek_r1 (thinking up to </think>, as DeepSeek-R1 and its distillations "
                             "write it)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    """Load the model, then serve until interrupted."""
    import uvicorn

    from multispec.api import LLM
    from multispec.async_llm import AsyncLLM
    from multispec.serve.app import ServerConfig, build_app
    from multispec.serve.sampling import Limits

    model = _model(args)
    for name in ("max_n", "max_queued_requests", "max_request_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ValueError(f"--max-tokens-limit={args.max_tokens_limit}: must be >= 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})")
    spec = _spec(args)
    chat_template = None if args.chat_template is None else _text_or_file("--chat-template", args.chat_template)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    llm = LLM(**{**model_options(args), "model": model}, max_model_len=args.max_model_len, spec=spec,
              generation_config=args.generation_config, seed=args.seed)
    if llm.generation_defaults:  # as vLLM says it: a request's results may differ from OpenAI's defaults
        print(f"multispec: default sampling settings from the model's generation config: {llm.generation_defaults} "
              f"(--generation-config vllm to not use them)", file=sys.stderr)
    if chat_template is not None:  # a template that does not parse or render is refused before serving
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chat_template)
    if spec.speculates and spec.adaptive:  # the draft budget's prices, before the first client waits on them
        llm.engine.step_costs()
    config = ServerConfig(served_model_name=args.served_model_name or model, api_key=args.api_key or None,
                          limits=Limits(max_n=args.max_n, max_tokens=args.max_tokens_limit),
                          max_queued_requests=args.max_queued_requests, max_request_bytes=args.max_request_bytes,
                          chat_template=chat_template, sampling_defaults=llm.generation_defaults,
                          tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          reasoning_parser=args.reasoning_parser)
    app = build_app(AsyncLLM(llm), config)
    print(f"multispec: serving {config.served_model_name!r} ({model} on {llm.device}, "
          f"{str(llm.dtype).removeprefix('torch.')}, drafter {spec.drafter}) at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _model(args) -> str:
    """The model named positionally or by ``--model`` (the default model when neither is given)."""
    if args.model_name is None:
        return args.model
    if args.model not in (DEFAULT_MODEL, args.model_name):
        raise ValueError(f"the model is named twice: {args.model_name!r} and --model {args.model!r}")
    return args.model_name
