"""``multispec eval``: a task's accuracy under self-consistency (with early stop), Best-of-N or
pass@k, with a progress bar, a summary table, a JSON results file and a plot. The model,
sampling and speculation flags, and how they become settings, are the command line's own (see
``multispec.cli``); the heavy modules load only when the command runs."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from multispec.distributed import add_ray_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", required=True,
                        help="gsm8k, humaneval, math:FILE (JSONL, \\boxed{} answers) or jsonl:FILE (needs --answer-regex)")
    parser.add_argument("--answer-regex", help="jsonl:FILE: the answer is the last match (its first group, if any)")
    parser.add_argument("--limit", type=int, help="the first LIMIT questions (default: all)")
    parser.add_argument("--strategy", default="vote", help="vote (default), best-of-n or pass@k")
    parser.add_argument("--k", type=_ks, help="pass@k: comma-separated k values, each <= --n (default: 1,5,10 up to n)")
    parser.add_argument("--early-stop", default="none",
                        help="vote: beta[:THRESHOLD] (default 0.95), esc[:WINDOW] (default 5) or none (default)")
    parser.add_argument("--scorer", default="auto",
                        help="best-of-n: logprob (answer tasks' default), tests (code tasks') or MODULE:FUNCTION")
    parser.add_argument("--weighted-vote", action="store_true",
                        help="vote: weigh each sample by its mean token probability")
    parser.add_argument("--output", help="write the results (per question: samples, answers, vote, ...) as JSON")
    parser.add_argument("--plot", help="vote: draw accuracy against generated tokens and wall time into this PNG")
    add_ray_arguments(parser)


def _ks(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def run(args: argparse.Namespace, sampling, spec, load_llm) -> int:
    """The command; ``sampling`` and ``spec`` come from the shared flags, ``load_llm(args)`` loads
    the model (for a run in this process)."""
    from multispec.reasoning.evaluate import EvalConfig, summarize, summary_table
    from multispec.reasoning.tasks import make_task

    spec.check_temperature(sampling.temperature)
    config = EvalConfig(make_task(args.task, args.answer_regex), sampling, spec, args.strategy, args.early_stop,
                        args.k, args.scorer, args.weighted_vote)
    if args.plot and config.strategy != "vote":
        raise ValueError("--plot draws the accuracy of votes: use it with --strategy vote")
    for option, path in (("--output", args.output), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{option} {path}: its directory does not exist")
    problems = config.task.problems(args.limit)
    if args.ray is None:
        llm = load_llm(args)
        start = time.perf_counter()
        results = _in_process(llm, config, problems)
    else:
        start = time.perf_counter()
        results = _on_ray(args, config, problems)
    summary = summarize(config, results, time.perf_counter() - start)
    document = {"model": args.model, "config": config.describe(), "summary": summary, "questions": results}
    if args.output:
        Path(args.output).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        from multispec.reasoning.plot import plot_runs

        plot_runs([(f"n={sampling.n}, early stop {config.rule or 'none'}", document)], args.plot)
    print(summary_table(config, summary, args.model))
    return 0


def _in_process(llm, config, problems) -> list[dict]:
    """Results in question order, a progress bar over questions (with running accuracy and
    generated tokens/s) on stderr meanwhile."""
    from tqdm.auto import tqdm

    from multispec.reasoning.evaluate import solve

    results, correct, tokens = [], 0, 0
    start = time.perf_counter()
    with tqdm(total=len(problems), unit="question", desc="eval", dynamic_ncols=True,
              disable=os.environ.get("MULTISPEC_NO_PROGRESS") is not None) as bar:
        for result in solve(llm, config, problems):
            results.append(result)
            correct += result["correct"]
            tokens += result["tokens"]
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"accuracy {correct / len(results):.1%}, {rate:.1f} tok/s", refresh=False)
            bar.update()
    return sorted(results, key=lambda r: r["position"])


def _on_ray(args, config, problems) -> list[dict]:
    """The questions as rows through Ray replicas, each holding one model."""
    from multispec.distributed import map_with_llm, ray_options
    from multispec.reasoning.evaluate import solve_rows

    rows = [{"position": i, "problem": problem, "config": config} for i, problem in enumerate(problems)]
    from multispec.cli import model_options

    llm_options = model_options(args)
    return map_with_llm(rows, solve_rows, llm_options, **ray_options(args))
