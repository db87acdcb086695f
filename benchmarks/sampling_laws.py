"""What a sampling law costs: tokens/s with top-p, min-p, top-k and penalties against temperature alone.

Default model, GSM8K test questions in the chat template, temperature 0.7, max_tokens 256, all
questions in one call (4 x n samples in flight), plain decoding; with ``--speculate`` also the
default speculation (consensus) with one request of n at a time. Every law runs once per round,
the laws interleaved in one process, and each ratio is the median of the per-round ratios to
temperature alone (the same seed in each round). The last line says how long the run's threads
waited for a core (above 10%, the timings are the machine's).

    python benchmarks/sampling_laws.py                  # 4 x 16, 3 rounds
    python benchmarks/sampling_laws.py --n 4 --speculate
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import CoreWait  # noqa: E402

LAWS = {"temperature alone": {}, "top_p 0.95": {"top_p": 0.95}, "min_p 0.05": {"min_p": 0.05},
        "top_k 20": {"top_k": 20}, "top_k 50, top_p 0.95": {"top_k": 50, "top_p": 0.95},
        "repetition_penalty 1.1": {"repetition_penalty": 1.1},
        "frequency_penalty 0.5, presence_penalty 0.5": {"frequency_penalty": 0.5, "presence_penalty": 0.5}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculate", action="store_true",
                        help="also the default speculation, one request of n at a time, against plain")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k

    llm = LLM(enable_prefix_caching=False)
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    llm.chat(conversations[:1], SamplingParams(n=args.n, max_tokens=16), use_tqdm=False)
    if args.speculate:
        llm.engine.step_costs()  # the budget's step prices, measured once before anything is timed
    waiting = CoreWait()
    rows = {}

    def timed(label: str, law: dict, seed: int, spec=None, one_at_a_time: bool = False) -> None:
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=seed, **law)
        start, tokens = time.perf_counter(), 0
        for batch in ([[c] for c in conversations] if one_at_a_time else [conversations]):
            for out in llm.chat(batch, params, spec, use_tqdm=False):
                tokens += sum(len(c.token_ids) for c in out.outputs)
        rows.setdefault(label, []).append(tokens / (time.perf_counter() - start))

    for seed in range(args.rounds):
        for name, law in LAWS.items():
            timed(f"{args.questions} x {args.n} in one call, plain, {name}", law, seed)
            if args.speculate:
                timed(f"one request of {args.n} at a time, plain, {name}", law, seed, SpecConfig(), True)
                timed(f"one request of {args.n} at a time, consensus, {name}", law, seed,
                      SpecConfig(drafter="consensus"), True)
        print(f"round {seed + 1}/{args.rounds} done", file=sys.stderr)

    print(f"max_tokens {args.max_tokens}, T 0.7, medians of {args.rounds} rounds; ratio: per-round ratio to the "
          f"row it is compared with, median\n")
    print("| row | tok/s | runs | ratio |")
    print("|---|---|---|---|")
    for label, rates in rows.items():
        if ", consensus, " in label:
            against = rows[label.replace(", consensus, ", ", plain, ")]
            what = "over plain"
        else:
            against = rows[label.split(", plain, ")[0] + ", plain, temperature alone"]
            what = "of temperature alone"
        ratio = statistics.median(a / b for a, b in zip(rates, against))
        print(f"| {label} | {statistics.median(rates):.0f} | {', '.join(f'{r:.0f}' for r in rates)} | "
              f"{ratio:.2f}x {what} |")
    print(waiting.report())


if __name__ == "__main__":
    main()
