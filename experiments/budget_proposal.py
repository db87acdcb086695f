"""Whether a step paid, with and without the proposal's own seconds, on long-lived engines.

The draft budget counts a step as one that kept nothing where its kept nodes do not repay their
rows and the proposal's seconds (``DraftBudget.select(proposing=...)``); the old rule left the
proposal out. Two engines in one process, each keeping its lanes across calls as a server or a
benchmark does: one runs the rule as it is, the other with the proposal's seconds set to 0, and
each alternates with plain decoding on itself (the order reversed every other round). Prints
tokens/s against plain per round, how often the budget ranked drafts (select calls per step) and
draft tokens per step.

    python experiments/budget_proposal.py --questions 8 --n 16 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine import budget
    from multispec.reasoning import load_gsm8k

    now_llm, old_llm = LLM(), LLM()
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    select = budget.DraftBudget.select
    calls = [0]

    def counted(rule):
        def call(self, *rest, **options):
            calls[0] += 1
            return rule(self, *rest, **options)
        return call

    def without_proposal(self, trees, context, others=0, drafting=0.0, proposing=0.0):
        return select(self, trees, context, others, drafting, 0.0)

    spec = SpecConfig(drafter="consensus")
    for llm in (now_llm, old_llm):
        llm.chat(conversations[:1], SamplingParams(n=args.n, temperature=0.7, max_tokens=16, seed=0), spec,
                 use_tqdm=False)
    results: dict[str, list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        order = [("plain-now", now_llm), ("now", now_llm), ("old", old_llm), ("plain-old", old_llm)]
        for name, llm in order if r % 2 == 0 else order[::-1]:
            budget.DraftBudget.select = counted(without_proposal if name == "old" else select)
            calls[0] = 0
            llm.chat(conversations, SamplingParams(n=args.n, temperature=0.7, max_tokens=256, seed=r),
                     None if name.startswith("plain") else spec, use_tqdm=False)
            s = llm.last_stats
            results.setdefault(name, []).append(
                (s.tokens_per_second, calls[0] / s.decode_forwards, s.drafted_tokens / s.decode_forwards))
            print(f"round {r} {name:9s} tok/s {s.tokens_per_second:7.1f} "
                  f"select/step {calls[0] / s.decode_forwards:.2f} "
                  f"drafted/step {s.drafted_tokens / s.decode_forwards:.2f}", file=sys.stderr)
    budget.DraftBudget.select = select
    print(f"consensus, {args.questions} questions x {args.n} samples in one call, {args.rounds} rounds")
    for name, plain in (("now", "plain-now"), ("old", "plain-old")):
        ratios = [x[0] / y[0] for x, y in zip(results[name], results[plain])]
        print(f"{name}: {statistics.median(ratios):.3f}x plain ({', '.join(f'{x:.3f}' for x in ratios)}); "
              f"select/step {', '.join(f'{x[1]:.2f}' for x in results[name])}; "
              f"drafted/step {', '.join(f'{x[2]:.2f}' for x in results[name])}")


if __name__ == "__main__":
    main()
