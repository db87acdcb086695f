"""Command line: ``multispec generate``, ``multispec gsm8k`` (self-consistency) and ``multispec analyze-verify``.

Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from multispec.devices import DTYPES, KV_CACHE_DTYPES
from multispec.drafters import DRAFTERS
from multispec.params import SamplingParams, SpecConfig
from multispec.verify.schemes import NAMES as SCHEMES

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr and exit status 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="registered name, Hugging Face checkpoint directory, Hub repository id in the local "
                             "cache or .gguf file (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="'auto' (default): bfloat16 where the hardware computes it natively, else float32")
    parser.add_argument("--kv-cache-memory", type=float, default=4.0, help="KV cache cap in GiB (default: %(default)s)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="'auto' (default): the model's dtype; 'bfloat16' under float32 weights halves the cache")
    parser.add_argument("--device", default="auto",
                        help="'auto' (a CUDA GPU if there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the keys and values of prompts that begin alike (default: on)")
    parser.add_argument("--tokenizer", default=None,
                        help="another tokenizer than the model's own: a directory holding tokenizer.json or a Hub "
                             "repository id in the local cache (for a .gguf file, its original model's)")
    parser.add_argument("--revision", default=None,
                        help="the snapshot of a Hub repository id: a branch, tag or commit the cache holds "
                             "(default: main)")


def model_options(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments that ``_add_model_args``' flags give."""
    return {"model": args.model, "dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
            "kv_cache_dtype": args.kv_cache_dtype, "device": args.device,
            "enable_prefix_caching": args.enable_prefix_caching, "tokenizer": args.tokenizer,
            "revision": args.revision}


MODEL_LAW_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The flags a model's generation config gives defaults for, where a command takes them from it."""


def _add_sampling_args(parser: argparse.ArgumentParser, n: int, max_tokens: int, temperature: float,
                       model_defaults: bool = False) -> None:
    """The sampling flags. ``model_defaults``: the law's flags left out take the model's generation
    config (``LLM.generation_defaults``), else these defaults (as vLLM does for requests)."""
    laws = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    parser.set_defaults(law_defaults=laws if model_defaults else None)

    def law(flag: str, kind, what: str = "") -> None:
        name = flag[2:].replace("-", "_")
        default = f"the model's generation config, else {laws[name]}" if model_defaults else str(laws[name])
        parser.add_argument(flag, type=kind, default=None if model_defaults else laws[name],
                            help=f"{what}(default: {default})")

    parser.add_argument("--n", type=int, default=n, help="samples per prompt (default: %(default)s)")
    law("--temperature", float)
    law("--top-p", float)
    law("--top-k", int, "0 turns top-k off ")
    law("--min-p", float, "drop tokens less likely than this times the likeliest one (0 turns it off) ")
    law("--repetition-penalty", float,
        "divide (or, below 0, multiply) the logits of tokens already in the text (1: off) ")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtract this times a token's count in the generated text (0: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtract this from tokens already generated (0: off)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="no stop token or stop string before a sample has this many tokens (default: 0)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _add_structured_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (at most one; exact under speculation)")
    group.add_argument("--json-schema", metavar="FILE_OR_JSON", help="every sample is JSON following this schema")
    group.add_argument("--json-object", action="store_true", help="every sample is a JSON object")
    group.add_argument("--regex", help="every sample matches this regular expression")
    group.add_argument("--choice", action="append", default=None,
                       help="every sample is one of these strings (repeatable)")
    group.add_argument("--grammar", metavar="FILE_OR_TEXT", help="a Lark grammar, or llama.cpp's GBNF")
    group.add_argument("--disable-any-whitespace", action="store_true",
                       help="no whitespace between JSON tokens (by default any is allowed)")


def _text_or_file(flag: str, value: str) -> str:
    """A flag's value, or the text of the file it names."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{flag} {value}: {error.strerror}") from None
    return value


def _structured(args) -> dict | None:
    """``structured_outputs`` from the generate flags (checked by ``SamplingParams``)."""
    rule = {}
    if args.json_schema is not None:
        text = _text_or_file("--json-schema", args.json_schema)
        try:
            rule["json"] = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--json-schema: neither a file nor JSON text ({error})") from None
    if args.json_object:
        rule["json_object"] = True
    if args.regex is not None:
        rule["regex"] = args.regex
    if args.choice is not None:
        rule["choice"] = args.choice
    if args.grammar is not None:
        rule["grammar"] = _text_or_file("--grammar", args.grammar)
    if len(rule) > 1:
        raise ValueError(f"--{' and --'.join(k.replace('_', '-') for k in rule)}: give at most one "
                         f"of --json-schema, --json-object, --regex, --choice and --grammar")
    if rule and args.disable_any_whitespace:
        rule["disable_any_whitespace"] = True
    return rule or None


def _chat_options(args) -> dict:
    """``LLM.chat``'s template options from ``--chat-template`` and ``--chat-template-kwargs``."""
    if not args.chat and (args.chat_template is not None or args.chat_template_kwargs is not None):
        raise ValueError("--chat-template and --chat-template-kwargs apply with --chat")
    options = {}
    if args.chat_template is not None:
        options["chat_template"] = _text_or_file("--chat-template", args.chat_template)
    if args.chat_template_kwargs is not None:
        try:
            options["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as error:
            raise ValueError(f"--chat-template-kwargs: not valid JSON ({error})") from None
        if not isinstance(options["chat_template_kwargs"], dict):
            raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs}: must be a JSON object")
    return options


def _add_spec_args(parser: argparse.ArgumentParser, drafter: str) -> None:
    parser.add_argument("--drafter", default=drafter, choices=list(DRAFTERS), help="(default: %(default)s)")
    parser.add_argument("--max-draft-tokens", type=int, default=SpecConfig.max_draft_tokens)
    parser.add_argument("--max-draft-nodes", type=int, default=None,
                        help="default: max-draft-tokens x num-candidates")
    parser.add_argument("--scheme", default="auto", choices=SCHEMES)
    parser.add_argument("--draft-model", default=None,
                        help="drafter 'model' or 'hybrid': a draft head file (default: the head paired with the "
                             "model), or a causal LM sharing the model's tokenizer (checkpoint directory, .gguf, "
                             "cached Hub repository id or known name)")
    parser.add_argument("--num-candidates", type=int, default=1,
                        help="drafter 'model': candidates drawn at the root, each extended as a chain")
    parser.add_argument("--decision-threshold", type=float, default=None,
                        help="drafter 'model': stop a chain below this predicted acceptance (a head's decision "
                             "model; a draft LM's confidence in its next token) (default: the head's own; 0: full "
                             "depth)")
    parser.add_argument("--sampled-drafts", action=argparse.BooleanOptionalAction, default=None,
                        help="sample drafts and verify with multi-draft schemes, or copy them and verify "
                             "deterministically (default: the drafter's own way: consensus copies; hybrid draws the "
                             "head's candidates, the sibling text copied beside them)")
    parser.add_argument("--no-aggregate", action="store_true", help="consensus ablation: first match wins")


def _sampling(args, model_defaults: dict | None = None) -> SamplingParams:
    """The sampling flags as ``SamplingParams``; where the command takes the model's defaults, the
    law's flags left out come from ``model_defaults`` (the model's generation config), else from
    the command's own defaults."""
    fallback = getattr(args, "law_defaults", None) or {}
    law = {name: getattr(args, name) if getattr(args, name) is not None
           else (model_defaults or {}).get(name, fallback.get(name)) for name in MODEL_LAW_FLAGS}
    return SamplingParams(n=args.n, **law, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, max_tokens=args.max_tokens,
                          min_tokens=args.min_tokens, seed=args.seed, stop=args.stop)


def _spec(args) -> SpecConfig:
    return SpecConfig(drafter=args.drafter, max_draft_tokens=args.max_draft_tokens,
                      max_draft_nodes=args.max_draft_nodes, scheme=args.scheme, sampled_drafts=args.sampled_drafts,
                      aggregate=not args.no_aggregate, draft_model=args.draft_model,
                      num_candidates=args.num_candidates, decision_threshold=args.decision_threshold)


def _llm(args):
    from multispec.api import LLM

    llm = LLM(**model_options(args))
    kv = "" if llm.kv_cache_dtype == llm.dtype else f", KV cache {str(llm.kv_cache_dtype).removeprefix('torch.')}"
    print(f"multispec: {args.model} on {llm.device}, {str(llm.dtype).removeprefix('torch.')}{kv}", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"--prompts-file {path}: no such file")
        prompts = [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {path}: holds no prompt")
    elif args.prompt is not None:
        prompts = [args.prompt]
    else:
        raise ValueError("give --prompt TEXT or --prompts-file FILE")
    params, spec = replace(_sampling(args), structured_outputs=_structured(args)), _spec(args)
    spec.check_temperature(params.temperature)
    options = _chat_options(args)
    llm = _llm(args)
    if llm.generation_defaults:  # the law's flags left out take the model's generation config
        model_law = _sampling(args, llm.generation_defaults)
        params = replace(params, **{name: getattr(model_law, name) for name in MODEL_LAW_FLAGS})
        spec.check_temperature(params.temperature)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, spec, **options)
    else:
        outputs = llm.generate(prompts, params, spec)
    if args.json:
        for i, out in enumerate(outputs):
            print(json.dumps({"prompt": prompts[i], "samples": [
                {"text": c.text, "token_ids": c.token_ids, "cumulative_logprob": c.cumulative_logprob,
                 "finish_reason": c.finish_reason} for c in out.outputs]}))
    else:
        for i, out in enumerate(outputs):
            for c in out.outputs:
                print(f"=== prompt {i}, sample {c.index} ({c.finish_reason}, {len(c.token_ids)} tokens, "
                      f"logprob {c.cumulative_logprob:.2f}) ===")
                print(c.text)
    print(llm.last_stats.summary(), file=sys.stderr)
    return 0


def cmd_gsm8k(args) -> int:
    from multispec.reasoning import extract_answer, load_gsm8k, majority_vote

    if args.questions < 1:
        raise ValueError(f"--questions={args.questions}: must be >= 1")
    problems = load_gsm8k(limit=args.questions, offset=args.offset)
    params, spec = _sampling(args), _spec(args)
    spec.check_temperature(params.temperature)
    llm = _llm(args)
    conversations = [p.chat() for p in problems]
    baseline = None
    if args.baseline and spec.drafter != "none":
        if spec.adaptive:
            # The draft budget's step prices, measured once per machine and model: measured before
            # either timed run, so that neither carries the measurement or what it leaves behind.
            llm.engine.step_costs()
        llm.chat(conversations, params, SpecConfig(drafter="none"))
        baseline = llm.last_stats
        llm.reset_prefix_cache()  # the timed runs prefill the same prompts alike
    outputs = llm.chat(conversations, params, spec)
    stats = llm.last_stats
    correct = 0
    for i, (problem, out) in enumerate(zip(problems, outputs)):
        voted, votes = majority_vote([extract_answer(c.text) for c in out.outputs])
        ok = voted == problem.reference
        correct += ok
        print(f"Q{args.offset + i}: voted {voted} ({votes}/{len(out.outputs)} votes), reference {problem.reference} "
              f"{'OK' if ok else 'WRONG'}")
    print(f"majority-vote accuracy {correct}/{len(problems)}; {stats.generated_tokens} tokens in "
          f"{stats.time_total:.1f}s = {stats.tokens_per_second:.1f} tokens/s ({spec.drafter} drafter)")
    print(f"speculation: {stats.decode_forwards} target forwards, tau {stats.tau:.2f} tokens per forward per sample, "
          f"{stats.acceptance_rate:.1%} of {stats.drafted_tokens} drafted tokens accepted; time draft "
          f"{stats.time_draft:.1f}s / forward {stats.time_forward:.1f}s / verify {stats.time_verify:.1f}s / "
          f"commit {stats.time_commit:.1f}s")
    if baseline is not None:
        print(f"plain decoding, same run: {baseline.generated_tokens} tokens in {baseline.time_total:.1f}s = "
              f"{baseline.tokens_per_second:.1f} tokens/s; speedup {stats.tokens_per_second / baseline.tokens_per_second:.2f}x")
    print(stats.summary(), file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    """Measure the decode step costs the draft budget prices drafts with, and cache them."""
    llm = _llm(args)
    costs = llm.engine.step_costs(refresh=True, even_if_busy=args.even_if_busy)
    print(costs.table())
    return 1 if costs.busy and not args.even_if_busy else 0  # the warning above says why


def cmd_train_draft(args) -> int:
    """Train a draft head (and its decision model) for the model from its own GSM8K answers."""
    from multispec.training import TrainConfig, train_draft

    config = TrainConfig(questions=args.questions, samples=args.samples, epochs=args.epochs, seed=args.seed,
                         num_tokens=args.num_tokens, unroll=args.unroll, references=args.references,
                         context=args.context)
    if args.references < 0:
        raise ValueError(f"--references {args.references}: must be >= 0")
    for name in ("questions", "samples", "epochs", "num_tokens", "unroll", "context"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    llm = _llm(args)
    train_draft(llm, Path(args.output), config, log=lambda line: print(line, flush=True),
                answers_file=Path(args.answers) if args.answers else None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multispec", description="Fast multi-sample generation.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="draw n samples for each prompt")
    _add_model_args(gen)
    _add_sampling_args(gen, n=1, max_tokens=256, temperature=1.0, model_defaults=True)
    _add_spec_args(gen, drafter="none")
    gen.add_argument("--prompt", help="one prompt")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                     help="--chat: this Jinja template instead of the model's")
    gen.add_argument("--chat-template-kwargs", metavar="JSON",
                     help='--chat: more variables for the template, e.g. \'{"enable_thinking": false}\'')
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_structured_args(gen)
    gen.set_defaults(func=cmd_generate)

    gsm = sub.add_parser("gsm8k", help="self-consistency on GSM8K test questions: n samples, majority vote")
    _add_model_args(gsm)
    _add_sampling_args(gsm, n=8, max_tokens=256, temperature=0.7)
    _add_spec_args(gsm, drafter="none")
    gsm.add_argument("--questions", type=int, default=4)
    gsm.add_argument("--offset", type=int, default=0)
    gsm.add_argument("--baseline", action="store_true",
                     help="first run the same job with plain decoding and print the speedup")
    gsm.set_defaults(func=cmd_gsm8k)

    from multispec import batch

    bat = sub.add_parser("batch", help="n completions for every request of a JSONL file, here or on a Ray cluster")
    batch.add_arguments(bat)
    bat.set_defaults(func=batch.run)

    from multispec.serve import cli as serve_cli

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (streaming, continuous batching)")
    serve_cli.add_arguments(srv)
    srv.set_defaults(func=serve_cli.run)

    cal = sub.add_parser("calibrate", help="measure what a decode step of each shape costs here (the draft "
                                           "budget's prices, cached per machine and model) and print it")
    _add_model_args(cal)
    cal.add_argument("--even-if-busy", action="store_true",
                     help="cache the prices even where other work kept the machine busy while they were measured "
                          "(they are then slower than the model's own steps; by default they are not cached and "
                          "the command exits 1)")
    cal.set_defaults(func=cmd_calibrate)

    trn = sub.add_parser("train-draft", help="train a draft head for the model from its own answers to GSM8K "
                                             "train questions (offline), print its held-out agreement")
    _add_model_args(trn)
    from multispec.training import TrainConfig

    defaults = TrainConfig()
    trn.add_argument("--output", default="draft-head.safetensors", help="where the head goes (default: %(default)s)")
    trn.add_argument("--questions", type=int, default=defaults.questions, help="questions the model answers itself")
    trn.add_argument("--samples", type=int, default=defaults.samples, help="answers per question")
    trn.add_argument("--epochs", type=int, default=defaults.epochs)
    trn.add_argument("--num-tokens", type=int, default=defaults.num_tokens, help="the head's vocabulary size")
    trn.add_argument("--unroll", type=int, default=defaults.unroll, help="training-time draft depth")
    trn.add_argument("--context", type=int, default=defaults.context,
                     help="pairs of target feature and token before the root the head reads, the root's included")
    trn.add_argument("--references", type=int, default=defaults.references,
                     help="further questions whose reference solution is teacher-forced as the answer")
    trn.add_argument("--answers", help="keep the sampled answers in this JSON file (a rerun reuses them)")
    trn.add_argument("--seed", type=int, default=defaults.seed)
    trn.set_defaults(func=cmd_train_draft)

    from multispec import analysis

    ana = sub.add_parser("analyze-verify", help="expected acceptance of every verification scheme")
    analysis.add_arguments(ana)
    ana.set_defaults(func=analysis.run)

    from multispec.reasoning import eval_command

    ev = sub.add_parser("eval", help="a task's accuracy: self-consistency (with early stop), best-of-n or pass@k")
    _add_model_args(ev)
    _add_sampling_args(ev, n=8, max_tokens=256, temperature=0.7)
    _add_spec_args(ev, drafter="consensus")
    eval_command.add_arguments(ev)
    ev.set_defaults(func=lambda args: eval_command.run(args, _sampling(args), _spec(args), _llm))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"multispec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("multispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
