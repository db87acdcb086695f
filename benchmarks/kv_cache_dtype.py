"""The KV cache in the model's dtype against a bfloat16 cache under float32 weights.

Two engines on the default model in one process (``LLM()`` and ``LLM(kv_cache_dtype="bfloat16")``,
float32 weights on a CPU without native bfloat16), timed alternately so that the machine's drift
hits both alike:

- decode steps: one GSM8K question with n samples (T 0.7, no end of text), ``--context`` tokens
  generated first, then ``--rounds`` rounds of ten steps on each engine; median step time each;
- generation (``--generate``): the peers' workload, the first 4 GSM8K test questions as chat
  messages x 16 samples, T 0.7, 256 tokens, all in one call, three calls on each engine;
  tokens/s (the two engines' samples differ: their rounding differs).

    python benchmarks/kv_cache_dtype.py --samples 4,16,64 --context 128
    python benchmarks/kv_cache_dtype.py --samples 16 --context 500
    python benchmarks/kv_cache_dtype.py --samples 0 --generate
"""

from __future__ import annotations

import argparse
import statistics
import time


def alternating_steps(engines: dict, conversation, n: int, context: int, rounds: int, chunk: int = 10) -> dict:
    """{engine name: seconds of each timed decode step}: one request of ``n`` samples of
    ``conversation`` on every engine (T 0.7, no end of text), ``context`` steps each first, then
    ``rounds`` rounds of ``chunk`` steps on each engine in turn (the order reversed every other
    round); the request is then aborted."""
    from multispec import SamplingParams

    for name, llm in engines.items():
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(conversation), add_special_tokens=False)
        params = SamplingParams(n=n, temperature=0.7, max_tokens=context + rounds * chunk + 4, ignore_eos=True, seed=0)
        llm.engine.add_request(f"steps-{n}", ids, params)
        for _ in range(context):
            llm.engine.step()
    times = {name: [] for name in engines}
    for r in range(rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            engine = engines[name].engine
            for _ in range(chunk):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    for llm in engines.values():
        llm.engine.abort(f"steps-{n}")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="4,16,64", help="samples in flight per step shape; 0: none")
    parser.add_argument("--context", type=int, default=128, help="tokens generated before timing steps")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--generate", action="store_true", help="also time the 4 x 16 generation")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams
    from multispec.reasoning import load_gsm8k

    engines = {"model dtype": LLM(enable_prefix_caching=False),
               "bfloat16 cache": LLM(kv_cache_dtype="bfloat16", enable_prefix_caching=False)}
    first = next(iter(engines.values()))
    print(f"weights {str(first.dtype).removeprefix('torch.')}; caches: "
          + ", ".join(f"{name} {str(llm.kv_cache_dtype).removeprefix('torch.')}" for name, llm in engines.items()))
    question = load_gsm8k(limit=1)[0].chat()
    for n in (int(s) for s in args.samples.split(",") if int(s) > 0):
        times = alternating_steps(engines, question, n, args.context, args.rounds)
        a, b = (statistics.median(t) for t in times.values())
        print(f"{n} samples, {args.context}+ tokens generated: model dtype {1e3 * a:.2f} ms a step, "
              f"bfloat16 cache {1e3 * b:.2f} ms ({b / a:.3f}x)", flush=True)
    if args.generate:
        conversations = [p.chat() for p in load_gsm8k(limit=4)]
        params = SamplingParams(n=16, temperature=0.7, max_tokens=256, seed=0)
        for llm in engines.values():
            llm.chat(conversations[:1], SamplingParams(n=4, max_tokens=16, seed=1), use_tqdm=False)  # warm-up
        rates = {name: [] for name in engines}
        for r in range(3):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                start = time.perf_counter()
                outputs = engines[name].chat(conversations, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                rates[name].append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / seconds)
        a, b = (statistics.median(r) for r in rates.values())
        runs = "; ".join(f"{name} " + ", ".join(f"{x:.1f}" for x in r) for name, r in rates.items())
        print(f"4 x 16 generation: model dtype {a:.1f} tok/s, bfloat16 cache {b:.1f} tok/s ({b / a:.3f}x; {runs})")


if __name__ == "__main__":
    main()
