"""How well a drafter's confidence predicts what verification accepts.

Runs fixed-depth drafts (every step drafts, so every confidence level is tried) on GSM8K questions
in the chat template and records, for every draft node whose parent was accepted, the drafter's
confidence, the length of the context match behind it, and whether the node was accepted. Prints
the measured acceptance per confidence bin and per match length: the raw material the engine's
draft budget calibrates on line (see ``multispec/engine/budget.py``).

    python experiments/calibration.py                      # consensus, 4 questions x 16, ~3 min
    python experiments/calibration.py --drafter ngram
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="consensus", choices=["consensus", "ngram"])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k

    nodes: list[tuple[float, int, bool]] = []

    def record(report) -> None:
        """Every draft node whose parent was accepted, from the engine's step report."""
        for tree, result in zip(report.trees, report.results):
            if tree.confidence is None:
                continue
            accepted = set(result.path)
            for i, parent in enumerate(tree.parents):
                if parent < 0 or parent in accepted:
                    nodes.append((tree.confidence[i], tree.evidence[i], i in accepted))

    llm = LLM()
    llm.engine.step_observers.append(record)
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    spec = SpecConfig(drafter=args.drafter, max_draft_tokens=args.depth, max_draft_nodes=args.depth, adaptive=False)
    llm.chat(conversations, SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                           seed=args.seed), spec, use_tqdm=False)
    print(f"{args.drafter}, {args.questions} questions x {args.n}, T {args.temperature}, depth {args.depth}: "
          f"{len(nodes)} draft nodes tried\n")
    print("| confidence | nodes | mean confidence | accepted |")
    print("|---|---|---|---|")
    for lo, hi in zip(EDGES, EDGES[1:]):
        cell = [(c, a) for c, _, a in nodes if lo <= c < hi]
        if cell:
            print(f"| [{lo:.2f}, {min(hi, 1.0):.2f}{')' if hi < 1 else ']'} | {len(cell)} | "
                  f"{statistics.fmean(c for c, _ in cell):.3f} | {statistics.fmean(a for _, a in cell):.1%} |")
    by_match = defaultdict(list)
    for _, match, accepted in nodes:
        by_match[match].append(accepted)
    print("\n| match length | nodes | accepted |")
    print("|---|---|---|")
    for match in sorted(by_match):
        print(f"| {match} | {len(by_match[match])} | {statistics.fmean(by_match[match]):.1%} |")


if __name__ == "__main__":
    main()
