"""What every engine runner of benchmarks/peers shares: its arguments, the workload file, the timed
calls and the result line that run.py reads.

Standard library only: the runners run in different virtual environments (the project's, vLLM's,
llama-cpp-python's), and each imports this file from its own directory.

A runner is given ``--workload FILE`` (written by run.py: the prompts as chat messages, as
chat-templated text and as token ids, the model's paths and end tokens), ``--n`` samples per
prompt, ``--max-tokens`` and ``--runs``. It makes one warm-up call identical to the timed ones,
then ``--runs`` timed calls, each a single call that draws all ``questions x n`` samples. It
prints one line ``PEERS-RESULT {json}`` on stdout; its logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable

RESULT_PREFIX = "PEERS-RESULT "


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", required=True, help="JSON file written by run.py")
    parser.add_argument("--n", type=int, required=True, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--runs", type=int, default=1, help="timed calls after the warm-up call")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def load_workload(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def log(name: str, message: str) -> None:
    print(f"[{name}] {message}", file=sys.stderr, flush=True)


def count_until_end(row: list[int], end_ids: set[int]) -> int:
    """Generated tokens of one sample: up to and including its first end token, never padding."""
    for i, token in enumerate(row):
        if token in end_ids:
            return i + 1
    return len(row)


def timed_calls(name: str, call: Callable[[int], tuple[int, dict]], runs: int) -> list[dict]:
    """One warm-up call (seed 1000), then ``runs`` timed calls (seeds 0, 1, ...).

    ``call(seed)`` does the whole generation and returns (generated tokens, details); the wall
    time around it is the call's time.
    """
    start = time.perf_counter()
    tokens, _ = call(1000)
    log(name, f"warm-up: {tokens} tokens in {time.perf_counter() - start:.1f}s")
    timings = []
    for run in range(runs):
        start = time.perf_counter()
        tokens, details = call(run)
        seconds = time.perf_counter() - start
        timings.append({"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, **details})
        log(name, f"run {run}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.1f} tok/s")
    return timings


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(*, engine: str, version: str, dtype: str, timings: list[dict], notes: str = "", **extra) -> None:
    result = {"engine": engine, "version": version, "dtype": dtype, "timings": timings, "notes": notes,
              "runner_peak_rss_mib": peak_rss_mib(), **extra}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
