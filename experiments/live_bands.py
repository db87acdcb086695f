"""The live correction of drafting steps per band of batch sizes, against one correction for all.

``multispec.engine.costs.Prices`` scales what drafting adds to a step by what live drafting steps
cost against their measured price, now per band of batch sizes (``LIVE_BANDS``). Two engines in one
process, each keeping its lanes across calls as a server or a benchmark does: one with the bands,
the other with one correction for every batch size (``Prices(bands=())``, the rule before). Each
alternates with plain decoding on itself (the order reversed every other round). Prints tokens/s
against plain per round, draft tokens per step, tau, and the corrections each engine ends with.

    python experiments/live_bands.py --questions 8 --n 16 --rounds 4
    python experiments/live_bands.py --questions 4 --n 4 --one-at-a-time --rounds 3
    python experiments/live_bands.py --questions 2 --n 16 --one-at-a-time --rounds 3
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
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--one-at-a-time", action="store_true", help="one request in flight at a time")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine.costs import Prices
    from multispec.reasoning import load_gsm8k

    bands_llm, one_llm = LLM(), LLM()
    one_llm.engine._prices = Prices(one_llm.engine.step_costs(), bands=())
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    spec = SpecConfig(drafter="consensus")
    for llm in (bands_llm, one_llm):
        llm.chat(conversations[:1], SamplingParams(n=args.n, temperature=0.7, max_tokens=16, seed=0), spec,
                 use_tqdm=False)

    def run(llm, params, spec):
        calls = [[c] for c in conversations] if args.one_at_a_time else [conversations]
        tokens = steps = drafted = accepted = samples = 0
        start = time.perf_counter()
        for batch in calls:
            llm.chat(batch, params, spec, use_tqdm=False)
            s = llm.last_stats
            tokens += s.generated_tokens
            steps += s.decode_forwards
            drafted += s.drafted_tokens
            accepted += s.accepted_tokens
            samples += s.sample_steps
        seconds = time.perf_counter() - start
        return tokens / seconds, drafted / steps, (samples + accepted) / samples

    results: dict[str, list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=256, seed=r)
        order = [("plain-bands", bands_llm), ("bands", bands_llm), ("one", one_llm), ("plain-one", one_llm)]
        for name, llm in order if r % 2 == 0 else order[::-1]:
            got = run(llm, params, None if name.startswith("plain") else spec)
            results.setdefault(name, []).append(got)
            print(f"round {r} {name:11s} tok/s {got[0]:7.1f} drafted/step {got[1]:.2f} tau {got[2]:.2f}",
                  file=sys.stderr)
    shape = f"{args.questions} x {args.n}" + (" one request at a time" if args.one_at_a_time else " in one call")
    print(f"consensus, {shape}, {args.rounds} rounds")
    for name, plain, llm in (("bands", "plain-bands", bands_llm), ("one", "plain-one", one_llm)):
        ratios = [x[0] / y[0] for x, y in zip(results[name], results[plain])]
        factors = ", ".join(f"{band} {f:.2f}" for band, f in llm.engine.prices().drafting_factors().items())
        print(f"{name}: {statistics.median(ratios):.3f}x plain ({', '.join(f'{x:.3f}' for x in ratios)}); "
              f"drafted/step {', '.join(f'{x[1]:.2f}' for x in results[name])}; "
              f"tau {', '.join(f'{x[2]:.2f}' for x in results[name])}; corrections: {factors}")


if __name__ == "__main__":
    main()
