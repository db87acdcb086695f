"""The first speculative call of a fresh process against plain decoding in the same process.

The draft budget prices a drafting step from the start-up calibration until its live correction
has seen ``LIVE_MIN`` drafting steps (``multispec.engine.costs.Prices``); this shows what those
first calls draft and what the correction learns by their end. One call with the default
speculation, then the same call plain, on 4 GSM8K questions, 128 tokens; ``--cell batched``
sends them in one call of n = 8 (32 samples in flight), ``--cell single`` one at a time with
n = 4. Run it several times: each run is a fresh process.

    python experiments/first_call.py --cell batched
    python experiments/first_call.py --cell single
"""

from __future__ import annotations

import argparse
import json
import time

from multispec import LLM, SamplingParams, SpecConfig
from multispec.reasoning import load_gsm8k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", choices=("batched", "single"), default="batched")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM()
    engine = llm.engine
    engine.step_costs()
    conversations = [p.chat() for p in load_gsm8k(limit=4)]
    n = 8 if args.cell == "batched" else 4
    params = SamplingParams(n=n, temperature=0.7, max_tokens=args.max_tokens, seed=0)

    def run(spec: SpecConfig) -> float:
        start = time.perf_counter()
        for batch in [conversations] if args.cell == "batched" else [[c] for c in conversations]:
            llm.chat(batch, params, spec, use_tqdm=False)
        return time.perf_counter() - start

    steps = []  # (tokens, samples, seconds, accepted) per decode step
    engine.step_observers.append(lambda r: steps.append(
        (r.tokens, len(r.samples), r.time_draft + r.time_forward + r.time_verify + r.time_commit,
         sum(len(x.path) for x in r.results))))
    spec = run(SpecConfig(drafter="consensus"))
    engine.step_observers.clear()
    plain = run(SpecConfig())
    drafting = [s for s in steps if s[0] > s[1]]
    print(json.dumps({"cell": args.cell, "speedup": round(plain / spec, 3), "spec_s": round(spec, 1),
                      "plain_s": round(plain, 1), "drafting_steps": len(drafting), "steps": len(steps),
                      "drafted": sum(s[0] - s[1] for s in drafting), "accepted": sum(s[3] for s in drafting),
                      "live_correction": {band: round(f, 3) for band, f in engine.prices().drafting_factors().items()}}))


if __name__ == "__main__":
    main()
