"""A draft budget rule (or drafter path) against the one before it, on two long-lived engines in one
process.

Each engine keeps its lanes across calls, as a server or a benchmark does; one runs the budget as
it is, the other with one rule as it was, and each alternates with plain decoding on itself (the
order reversed every other round). Prints tokens/s against plain per round, draft tokens a step,
tau, how often the budget ranked drafts (select calls a step) and, for ``--rule bands``, the live
corrections each engine ends with.

``--rule proposal``: the budget counts the proposal's own seconds when it decides whether a step
paid (``DraftBudget.select(proposing=...)``); the old engine passes 0 for them.
``--rule bands``: the live correction of drafting steps per band of batch sizes
(``multispec.engine.costs.LIVE_BANDS``); the old engine keeps one correction for every batch size
(``Prices(bands=())``).
``--rule live``: drafting steps priced with the live correction (``Prices``); the old engine prices
them as measured (every band's correction held at 1).
``--rule store``: the consensus drafter's compiled store (``multispec/kernels/suffix_store.cpp``);
the old engine's drafters keep their texts, index and tries in Python (the same drafts).

    python experiments/budget_rules.py --rule proposal --questions 8 --n 16 --rounds 4
    python experiments/budget_rules.py --rule bands --questions 8 --n 16 --rounds 4
    python experiments/budget_rules.py --rule bands --questions 4 --n 4 --one-at-a-time --rounds 3
    python experiments/budget_rules.py --rule bands --questions 2 --n 16 --one-at-a-time --rounds 3
    python experiments/budget_rules.py --rule store --questions 2 --n 16 --one-at-a-time --rounds 4
    python experiments/budget_rules.py --rule live --questions 2 --n 16 --one-at-a-time --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rule", choices=("proposal", "bands", "live", "store"), required=True)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--one-at-a-time", action="store_true", help="one request in flight at a time")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.drafters import suffix
    from multispec.engine import budget
    from multispec.engine.costs import Prices
    from multispec.reasoning import load_gsm8k

    now_llm, old_llm = LLM(), LLM()
    if args.rule == "bands":
        old_llm.engine._prices = Prices(old_llm.engine.step_costs(), bands=())
    elif args.rule == "live":
        class Measured(Prices):
            def _factor(self, band: int) -> float:
                return 1.0

        old_llm.engine._prices = Measured(old_llm.engine.step_costs())
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    select = budget.DraftBudget.select
    calls = [0]

    def counted(old: bool):
        def call(self, trees, context, others=0, drafting=0.0, proposing=0.0):
            calls[0] += 1
            return select(self, trees, context, others, drafting, 0.0 if old else proposing)
        return call

    compiled_store = suffix._compiled_store

    def chat(llm, *call, **options):
        # The old engine's lanes are created (in its first call) without the compiled store.
        suffix._compiled_store = (lambda drafter: None) if llm is old_llm and args.rule == "store" else compiled_store
        try:
            return llm.chat(*call, **options)
        finally:
            suffix._compiled_store = compiled_store

    spec = SpecConfig(drafter="consensus")
    for llm in (now_llm, old_llm):
        chat(llm, conversations[:1], SamplingParams(n=args.n, temperature=0.7, max_tokens=16, seed=0), spec,
             use_tqdm=False)

    def run(llm, params, spec):
        batches = [[c] for c in conversations] if args.one_at_a_time else [conversations]
        tokens = steps = drafted = accepted = samples = 0
        start = time.perf_counter()
        for batch in batches:
            chat(llm, batch, params, spec, use_tqdm=False)
            s = llm.last_stats
            tokens += s.generated_tokens
            steps += s.decode_forwards
            drafted += s.drafted_tokens
            accepted += s.accepted_tokens
            samples += s.sample_steps
        return tokens / (time.perf_counter() - start), drafted / steps, (samples + accepted) / samples, steps

    results: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in range(args.rounds):
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=256, seed=r)
        order = [("plain-now", now_llm), ("now", now_llm), ("old", old_llm), ("plain-old", old_llm)]
        for name, llm in order if r % 2 == 0 else order[::-1]:
            budget.DraftBudget.select = counted(old=name == "old" and args.rule == "proposal")
            calls[0] = 0
            tok_s, per_step, tau, steps = run(llm, params, None if name.startswith("plain") else spec)
            results.setdefault(name, []).append((tok_s, per_step, tau, calls[0] / steps))
            print(f"round {r} {name:9s} tok/s {tok_s:7.1f} drafted/step {per_step:.2f} tau {tau:.2f} "
                  f"select/step {calls[0] / steps:.2f}", file=sys.stderr)
    budget.DraftBudget.select = select
    shape = f"{args.questions} x {args.n}" + (" one request at a time" if args.one_at_a_time else " in one call")
    print(f"rule {args.rule}: consensus, {shape}, {args.rounds} rounds")
    for name, plain, llm in (("now", "plain-now", now_llm), ("old", "plain-old", old_llm)):
        ratios = [x[0] / y[0] for x, y in zip(results[name], results[plain])]
        line = (f"{name}: {statistics.median(ratios):.3f}x plain ({', '.join(f'{x:.3f}' for x in ratios)}); "
                f"drafted/step {', '.join(f'{x[1]:.2f}' for x in results[name])}; "
                f"tau {', '.join(f'{x[2]:.2f}' for x in results[name])}; "
                f"select/step {', '.join(f'{x[3]:.2f}' for x in results[name])}")
        if args.rule in ("bands", "live"):
            line += "; corrections: " + ", ".join(
                f"{band} {f:.2f}" for band, f in llm.engine.prices().drafting_factors().items())
        print(line)


if __name__ == "__main__":
    main()
