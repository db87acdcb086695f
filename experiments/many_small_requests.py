"""128 samples in flight as 8 GSM8K test questions x 16 or as 64 x 2, alternately in one process.

Plain decoding, T 0.7, 64 tokens, ignore_eos; per call: tokens/s, decode steps, decode and
prefill seconds, and the cache layout the call ran under (a layout is planned for what waits
when the engine is idle, so the second kind of call after the first shows whether it runs in
one wave or several).

    python experiments/many_small_requests.py --rounds 2
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from multispec import LLM, SamplingParams
    from multispec.reasoning import load_gsm8k

    llm = LLM()
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template(q.chat(), add_generation_prompt=True) for q in load_gsm8k(limit=64)]
    for _ in range(args.rounds):
        for label, chosen, n in (("8 x 16", prompts[:8], 16), ("64 x 2", prompts, 2)):
            llm.generate(chosen, SamplingParams(n=n, temperature=0.7, max_tokens=args.max_tokens, seed=0,
                                                ignore_eos=True), use_tqdm=False)
            s = llm.last_stats
            shape = llm.engine.cache.shape
            print(f"{label}: {s.tokens_per_second:.0f} tok/s, {s.decode_forwards} decode steps, decode "
                  f"{s.time_total - s.time_prefill:.1f} s, prefill {s.time_prefill:.1f} s; layout "
                  f"{shape.prompt_slots} prompt slots, {shape.sample_slots} sample slots", flush=True)


if __name__ == "__main__":
    main()
