"""Draft calibration kept across calls against a calibration restarted every call.

The engine keeps what verification accepted of each drafter's drafts (``Engine.calibrations``,
one per drafter and sampling setting), so a request sent on its own starts from what earlier
requests measured. This benchmark sends GSM8K questions one at a time (one request in flight,
as a client waiting on each answer does) with the default speculation, in three modes per
repetition, all in one process:

- plain: drafter "none", the reference for every speedup;
- restarted: the engine's calibrations cleared before every request (the budget starts each
  request from its prior, the drafter's raw ratings);
- kept: the calibrations carried over from every earlier request of the process.

It prints each mode's speed against plain in the same repetition, and, per stretch of a
request's steps, how many tokens the budget expected its kept draft nodes to gain (the sum of
their calibrated chances of acceptance) against how many verification accepted: a calibrated
budget has the two agree from a request's first steps.

    python benchmarks/bench_carry.py                # 2 questions x 16, 3 repetitions, ~15 min
    python benchmarks/bench_carry.py --reps 5 --n 4 --questions 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRETCH = 20
"""Steps per row of the expected-against-accepted table."""
STRETCHES = 5
"""Rows before the last, which holds every later step."""


def tracking_budget(base, expected: dict, accepted: dict):
    """A DraftBudget that adds up, per stretch of its request's steps, the calibrated chance of
    every node it keeps (expected accepted tokens) and the nodes verification accepted."""

    class Tracking(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_index = 0

        def _stretch(self) -> int:
            return min(self.step_index // STRETCH, STRETCHES)

        def select(self, trees, context):
            kept = super().select(trees, context)
            self.step_index += 1
            for tree in kept:
                chance: dict[int, float] = {}
                for i, parent in enumerate(tree.parents):
                    # A node is accepted only if its parent was: chance along the path.
                    chance[i] = self.calibrated(tree.confidence[i], tree.evidence[i]) * chance.get(parent, 1.0)
                    expected[self._stretch()] += chance[i]
            return kept

        def record_nodes(self, trees, paths):
            accepted[self._stretch()] += sum(len(path) for path in paths)
            return super().record_nodes(trees, paths)

    return Tracking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.questions < 1 or args.n < 1 or args.reps < 1 or args.max_tokens < 1:
        parser.error("--questions, --n, --reps and --max-tokens must be >= 1")

    sys.path.insert(0, str(ROOT))
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine import llm_engine
    from multispec.reasoning import load_gsm8k

    expected: dict[str, dict[int, float]] = {mode: defaultdict(float) for mode in ("restarted", "kept")}
    accepted: dict[str, dict[int, float]] = {mode: defaultdict(float) for mode in ("restarted", "kept")}
    base = llm_engine.DraftBudget
    llm = LLM()
    questions = load_gsm8k(limit=args.questions + 1)
    conversations = [p.chat() for p in questions]
    warm_up, conversations = conversations[-1], conversations[:-1]
    spec, plain = SpecConfig(drafter="consensus"), SpecConfig(drafter="none")

    def run(mode: str, params) -> float:
        tokens, seconds = 0, 0.0
        if mode != "plain":
            llm_engine.DraftBudget = tracking_budget(base, expected[mode], accepted[mode])
        try:
            for conversation in conversations:
                if mode == "restarted":
                    llm.engine.calibrations.clear()
                start = time.perf_counter()
                llm.chat([conversation], params, plain if mode == "plain" else spec, use_tqdm=False)
                seconds += time.perf_counter() - start
                tokens += llm.last_stats.generated_tokens
        finally:
            llm_engine.DraftBudget = base
        return tokens / seconds

    # One request before timing: warms the process, and gives the kept calibration a start.
    llm.chat([warm_up], SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                       seed=1000), spec, use_tqdm=False)
    speedups: dict[str, list[float]] = {"restarted": [], "kept": []}
    for rep in range(args.reps):
        params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=rep)
        base_speed = run("plain", params)
        kept = dict(llm.engine.calibrations)
        restarted_speed = run("restarted", params)
        llm.engine.calibrations.clear()
        llm.engine.calibrations.update(kept)
        kept_speed = run("kept", params)
        speedups["restarted"].append(restarted_speed / base_speed)
        speedups["kept"].append(kept_speed / base_speed)
        print(f"rep {rep}: plain {base_speed:.1f} tok/s, restarted {speedups['restarted'][-1]:.3f}x, "
              f"kept {speedups['kept'][-1]:.3f}x", file=sys.stderr, flush=True)

    print(f"\n{args.questions} questions x {args.n} samples, one request at a time, T {args.temperature}, "
          f"{args.max_tokens} tokens, {args.reps} repetitions\n")
    print("| calibration | speedup over plain (median) | per repetition |")
    print("|---|---|---|")
    for mode, values in speedups.items():
        print(f"| {mode} | {statistics.median(values):.3f}x | {', '.join(f'{v:.3f}' for v in values)} |")
    print("\n| steps of a request | restarted: expected / accepted | kept: expected / accepted |")
    print("|---|---|---|")
    for stretch in range(STRETCHES + 1):
        steps = (f"{stretch * STRETCH}-{(stretch + 1) * STRETCH - 1}" if stretch < STRETCHES
                 else f"{stretch * STRETCH}+")
        cells = [f"{expected[mode][stretch]:.0f} / {accepted[mode][stretch]:.0f}" for mode in ("restarted", "kept")]
        print(f"| {steps} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
