"""What the persistent engine's shell costs: plain decoding speed, and how fast a request joins.

1. Plain decoding tokens/s (drafter none) on GSM8K test questions in the chat template, T 0.7,
   max_tokens 256, all questions of a cell in one ``LLM.chat`` call: 4 x 16 and 8 x 4 by default.
   Only the public ``LLM`` API is used, so the same script measures any version of the engine
   (run it from another checkout, or with ``PYTHONPATH`` pointing at one) for a before/after
   comparison; run the versions alternately and compare medians.
2. ``--join``: time from ``add_request`` to the first token of a request that joins a busy batch:
   4 questions x 16 samples run (64 samples in flight), and every ``--every`` steps one more
   question (n = 4) is added; its first token is the first output ``step`` reports for it.

    python benchmarks/bench_shell.py --runs 3            # part 1, about 5 minutes here
    python benchmarks/bench_shell.py --runs 0 --join     # part 2 only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def plain_speed(llm, questions: int, n: int, max_tokens: int, seed: int) -> float:
    from multispec import SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k

    conversations = [p.chat() for p in load_gsm8k(limit=questions)]
    llm.chat(conversations, SamplingParams(n=n, temperature=0.7, max_tokens=max_tokens, seed=seed), SpecConfig(),
             use_tqdm=False)
    return llm.last_stats.tokens_per_second


def join_latency(llm, every: int, joins: int, max_tokens: int) -> list[float]:
    """Seconds from add_request to the first token of each request that joins 64 running samples."""
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    engine, tokenizer = llm.engine, llm.tokenizer
    problems = load_gsm8k(limit=4 + joins)
    ids = [tokenizer.encode(tokenizer.apply_chat_template(p.chat()), add_special_tokens=False) for p in problems]
    busy = SamplingParams(n=16, temperature=0.7, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for i in range(4):
        engine.add_request(f"busy-{i}", ids[i], busy)
    added: dict[str, float] = {}
    latencies, step = [], 0
    while engine.has_unfinished_requests():
        if step and step % every == 0 and len(added) < joins and len(engine.scheduler.slots) >= 64:
            name = f"join-{len(added)}"
            added[name] = time.perf_counter()
            engine.add_request(name, ids[4 + len(added) - 1], SamplingParams(n=4, temperature=0.7, max_tokens=16,
                                                                             seed=1))
        for out in engine.step():
            if out.request_id in added and out.request_id not in {k for k, _ in latencies}:
                latencies.append((out.request_id, time.perf_counter() - added[out.request_id]))
        step += 1
    return [seconds for _, seconds in latencies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="4x16,8x4", help="questions x n, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--join", action="store_true", help="measure the time to first token of joining requests")
    parser.add_argument("--every", type=int, default=20, help="steps between joining requests")
    parser.add_argument("--joins", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="float32 by default: engines from before 'auto' existed ran it")
    args = parser.parse_args()
    from multispec import LLM

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
    plain_speed(llm, 1, 4, 16, 0)  # warm-up
    speeds: dict[tuple[int, int], list[float]] = {}
    for run in range(args.runs):
        for questions, n in cells:
            speeds.setdefault((questions, n), []).append(plain_speed(llm, questions, n, args.max_tokens, run))
            print(f"  run {run} {questions} x {n}: {speeds[(questions, n)][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    for (questions, n), values in speeds.items():
        print(f"{questions} x {n}: plain {statistics.median(values):.1f} tok/s (median of {len(values)}: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    if args.join:
        latencies = join_latency(llm, args.every, args.joins, args.max_tokens)
        print(f"time to first token joining 64 samples in flight: median {1e3 * statistics.median(latencies):.0f} ms "
              f"over {len(latencies)} requests ({', '.join(f'{1e3 * s:.0f}' for s in latencies)} ms)")


if __name__ == "__main__":
    main()
