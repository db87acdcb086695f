"""Reasoning workloads at dataset scale: what early stopping and speculation save, and pass@k.

GSM8K (the first ``--questions`` test questions, n samples, T 0.7, one seed), three runs of the
same questions in one process, one model load:

- fixed n, plain decoding;
- fixed n, the default speculation (sibling drafts, ``SpecConfig(drafter="consensus")``);
- early-stopped (Adaptive-Consistency's Beta rule at 0.95) with the same speculation.

For each: accuracy, generated tokens, wall time; for the early-stopped run, how often its vote
is the fixed-n vote (seeded, so its finished samples are the fixed run's own where float32
rounding allows), and the saving in tokens and wall time against fixed n plain. Goals: the vote
kept on at least 97% of questions with at least 2.5x fewer tokens, and at least 3x less wall
time than fixed n plain.

HumanEval: pass@1 and pass@10 from n = 10 at T 0.8, with the time spent in the sandbox apart
from generation, and pass@k recomputed from the saved per-sample results with the binomial form
1 - C(n - c, k) / C(n, k) (the run computes a product form): the two must agree.

    python benchmarks/eval_reasoning.py                       # the full benchmark (hours on a CPU)
    python benchmarks/eval_reasoning.py --questions 3 --n 4 --max-tokens 64 \\
        --humaneval-problems 3 --humaneval-n 4 --humaneval-max-tokens 64   # a smoke run

Results (one JSON per run, as ``multispec eval --output`` writes them, a summary and a plot of
accuracy against tokens and wall time) go to ``--out-dir``. What early stopping could save on the
model's own answers, whatever this run's rule did: ``python benchmarks/early_stop_replay.py
--results OUT_DIR/run0.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multispec import LLM, SamplingParams, SpecConfig  # noqa: E402
from multispec.reasoning.evaluate import EvalConfig, solve, summarize  # noqa: E402
from multispec.reasoning.plot import plot_runs  # noqa: E402
from multispec.reasoning.tasks import make_task  # noqa: E402

SPECULATION = SpecConfig(drafter="consensus")
GSM8K_RUNS = [("fixed n, plain", None, "none"), ("fixed n, speculation", SPECULATION, "none"),
              ("early stop beta:0.95, speculation", SPECULATION, "beta:0.95")]


def run(llm: LLM, config: EvalConfig, limit: int, label: str) -> dict:
    """One run of ``config`` over the task's first ``limit`` problems, as a results document."""
    problems = config.task.problems(limit)
    start = time.perf_counter()
    results = sorted(solve(llm, config, problems), key=lambda r: r["position"])
    summary = summarize(config, results, time.perf_counter() - start)
    print(f"  {label}: accuracy {summary['accuracy']:.1%}, {summary['tokens']} tokens, "
          f"{summary['wall_time']:.1f} s", file=sys.stderr, flush=True)
    return {"label": label, "config": config.describe(), "summary": summary, "questions": results}


def gsm8k(llm: LLM, args) -> list[dict]:
    task = make_task("gsm8k")
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    return [run(llm, EvalConfig(task, params, spec, early_stop=early_stop), args.questions, label)
            for label, spec, early_stop in GSM8K_RUNS]


def agreement(early: dict, fixed: dict) -> float:
    """The share of questions whose early-stopped vote is the fixed-n vote."""
    pairs = list(zip(early["questions"], fixed["questions"]))
    return sum(a["vote"] == b["vote"] for a, b in pairs) / len(pairs)


def humaneval(llm: LLM, args) -> dict:
    params = SamplingParams(n=args.humaneval_n, temperature=args.humaneval_temperature,
                            max_tokens=args.humaneval_max_tokens, seed=args.seed)
    ks = [k for k in (1, 10) if k <= args.humaneval_n]
    config = EvalConfig(make_task("humaneval"), params, SPECULATION, strategy="pass@k", ks=ks)
    return run(llm, config, args.humaneval_problems, f"humaneval pass@k, n={args.humaneval_n}")


def recomputed_pass_at_k(document: dict) -> dict[str, float]:
    """pass@k from the saved per-sample grades alone, with exact binomials."""
    out = {}
    for k in document["config"]["k"]:
        values = []
        for question in document["questions"]:
            n, c = len(question["samples"]), sum(bool(s["correct"]) for s in question["samples"])
            values.append(1 - math.comb(n - c, k) / math.comb(n, k))
        out[str(k)] = sum(values) / len(values)
    return out


def report(runs: list[dict], code: dict | None) -> str:
    fixed_plain, fixed_spec, early = runs
    lines = ["| GSM8K run | accuracy | generated tokens | wall time (s) | tokens/s |", "|---|---|---|---|---|"]
    for r in runs:
        s = r["summary"]
        lines.append(f"| {r['label']} | {s['accuracy']:.1%} | {s['tokens']} | {s['wall_time']:.1f} | "
                     f"{s['tokens_per_second']:.1f} |")
    e, p = early["summary"], fixed_plain["summary"]
    lines += ["", f"early stop: vote = fixed-n plain vote on {agreement(early, fixed_plain):.1%} of questions "
                  f"(= fixed-n speculative vote on {agreement(early, fixed_spec):.1%}); "
                  f"{p['tokens'] / max(e['tokens'], 1):.2f}x fewer tokens, "
                  f"{p['wall_time'] / max(e['wall_time'], 1e-9):.2f}x less wall time than fixed n plain; "
                  f"{e['finished_samples']:.1f} of {early['config']['sampling']['n']} samples finished per question"]
    if code is not None:
        s = code["summary"]
        again = recomputed_pass_at_k(code)
        agree = all(abs(again[k] - v) < 1e-9 for k, v in s["pass@k"].items())
        lines += ["", f"HumanEval ({s['questions']} problems, n={code['config']['sampling']['n']}): " + ", ".join(
            f"pass@{k} {v:.3f}" for k, v in s["pass@k"].items()) + f"; recomputed from the saved samples: "
            + ", ".join(f"pass@{k} {v:.3f}" for k, v in again.items()) + (" (equal)" if agree else " (DIFFERENT)"),
            f"time: {s['wall_time']:.1f} s in all, of which {s['grade_time']:.1f} s in the sandbox"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--humaneval-problems", type=int, default=None, help="default: all 164; 0 skips HumanEval")
    parser.add_argument("--humaneval-n", type=int, default=10)
    parser.add_argument("--humaneval-temperature", type=float, default=0.8)
    parser.add_argument("--humaneval-max-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "eval_reasoning"))
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    print(f"{args.model} on {llm.device}, {llm.dtype}", file=sys.stderr)
    runs = gsm8k(llm, args)
    code = humaneval(llm, args) if args.humaneval_problems != 0 else None
    for i, document in enumerate(runs + ([code] if code else [])):
        (out / f"run{i}.json").write_text(json.dumps(document, indent=1) + "\n")
    plot_runs([(r["label"], r) for r in runs], str(out / "gsm8k_accuracy.png"))
    table = report(runs, code)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
