"""Prefill time of one prompt at several lengths: what a request waits before its first token.

Default model, random token ids (the cost does not depend on which), one prompt per forward
through ``LLMEngine.sequence_states`` (the prefill path every request takes), a warm-up forward
per length, then the median of ``--repeats`` timed forwards.

    python benchmarks/prefill.py                              # 128, 512, 2048 tokens
    python benchmarks/prefill.py --lengths 4096 --repeats 2 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from multispec import LLM

    llm = LLM(dtype=args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = torch.randint(100, llm.config.vocab_size - 100, (max(lengths),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{llm.dtype}, {torch.get_num_threads()} threads\n")
    print("| prompt tokens | prefill ms (median) | ms a token | tokens/s |")
    print("|---|---|---|---|")
    for n in lengths:
        llm.engine.sequence_states(ids[:n])
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.engine.sequence_states(ids[:n])
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        print(f"| {n} | {1e3 * t:.0f} | {1e3 * t / n:.2f} | {n / t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
