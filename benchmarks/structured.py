"""Structured outputs: what a JSON schema costs, and what speculation gains under one.

Default model, GSM8K test questions in the chat template, each asking for a JSON reply
{"reasoning": ..., "answer": <integer>}, temperature 0.7, max_tokens 256, in two shapes: all
questions in one call (questions x n samples in flight) and one request of n at a time. Rows per
shape: plain decoding and the default speculation (consensus, draft budget on) without a
constraint (the question alone asks for JSON); plain decoding, consensus and the hybrid (the draft
head with sibling drafts) under the schema. Every row runs once per round, interleaved in one
process with the same seed; a ratio is the median of the per-round ratios to plain decoding under
the same constraint (or none), which draws from the same law (the grammar masks every drafted row
by its own path), so it is a speedup. The constrained texts differ from the free ones (shorter
replies, samples that end at other steps), so the two plain rows' speeds are not compared as a
ratio; what the grammar itself costs is timed inside the engine (its matchers, masks and their
application to the logits) as a share of the run's time. Also printed: the share of samples whose
text parses and follows the schema, and the share whose answer is the reference. The last line
says how long the run's threads waited for a core (above 10%, the timings are the machine's).

    python benchmarks/structured.py                    # 4 questions x 16, 3 rounds
    python benchmarks/structured.py --n 4 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import CoreWait  # noqa: E402

SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
          "required": ["reasoning", "answer"], "additionalProperties": False}
ASK = '\n\nReply in JSON only: {"reasoning": "<your steps>", "answer": <the final number>}'


def follows(text: str) -> dict | None:
    """The reply as a dict where it parses and follows SCHEMA, else None."""
    try:
        reply = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(reply, dict) and set(reply) == {"reasoning", "answer"} and isinstance(reply["reasoning"], str) \
        and isinstance(reply["answer"], int) and not isinstance(reply["answer"], bool)
    return reply if ok else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine import rules
    from multispec.reasoning import load_gsm8k

    grammar_seconds = [0.0]

    def clocked(function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                grammar_seconds[0] += time.perf_counter() - start
        return run

    for name in ("advance", "masks", "apply_masks"):  # the grammar's whole part of a step
        setattr(rules, name, clocked(getattr(rules, name)))

    llm = LLM(enable_prefix_caching=False)
    problems = load_gsm8k(limit=args.questions)
    conversations = [[{"role": "user", "content": p.question + ASK}] for p in problems]
    references = [p.reference for p in problems]
    for schema in (None, {"json": SCHEMA}):  # warm-up: kernels, the grammar library's view of the vocabulary
        llm.chat(conversations[:1], SamplingParams(n=args.n, max_tokens=16, structured_outputs=schema), use_tqdm=False)
    llm.engine.step_costs()  # the budget's step prices, measured once before anything is timed
    waiting = CoreWait()
    rates: dict[str, list[float]] = {}
    quality: dict[str, list[tuple[float, float]]] = {}
    taus: dict[str, list[float]] = {}
    shares: dict[str, list[float]] = {}

    def timed(label: str, schema: bool, spec: SpecConfig, seed: int, one_at_a_time: bool) -> None:
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=seed,
                                structured_outputs={"json": SCHEMA} if schema else None)
        before, grammar_before = llm.engine.stats.copy(), grammar_seconds[0]
        start, tokens, valid, right, samples = time.perf_counter(), 0, 0, 0, 0
        for batch, refs in (zip([[c] for c in conversations], [[r] for r in references]) if one_at_a_time
                            else [(conversations, references)]):
            for out, reference in zip(llm.chat(batch, params, spec, use_tqdm=False), refs):
                for completion in out.outputs:
                    tokens += len(completion.token_ids)
                    reply = follows(completion.text)
                    samples += 1
                    valid += reply is not None
                    right += reply is not None and str(reply["answer"]) == str(reference)
        seconds = time.perf_counter() - start
        rates.setdefault(label, []).append(tokens / seconds)
        shares.setdefault(label, []).append((grammar_seconds[0] - grammar_before) / seconds)
        quality.setdefault(label, []).append((valid / samples, right / samples))
        taus.setdefault(label, []).append(llm.engine.stats.since(before).tau)

    shapes = {f"{args.questions} x {args.n} in one call": False, f"one request of {args.n} at a time": True}
    rows = {"plain, free": (False, SpecConfig()), "consensus, free": (False, SpecConfig(drafter="consensus")),
            "plain, schema": (True, SpecConfig()),
            "consensus, schema": (True, SpecConfig(drafter="consensus")),
            "hybrid, schema": (True, SpecConfig(drafter="hybrid"))}
    for seed in range(args.rounds):
        for shape, one_at_a_time in shapes.items():
            for name, (schema, spec) in rows.items():
                timed(f"{shape}, {name}", schema, spec, seed, one_at_a_time)
        print(f"round {seed + 1}/{args.rounds} done", file=sys.stderr)

    print(f"GSM8K x {args.questions}, n {args.n}, max_tokens {args.max_tokens}, T 0.7, medians of {args.rounds} "
          f"rounds; ratio: median of the per-round ratios\n")
    print("| row | tok/s | runs | over plain (same constraint) | tau | grammar's share of the time | "
          "follows the schema | right answer |")
    print("|---|---|---|---|---|---|---|---|")
    for label, runs in rates.items():
        shape, name = label.rsplit(", ", 2)[0], ", ".join(label.rsplit(", ", 2)[1:])
        plain = f"{shape}, plain, {name.split(', ')[1]}"
        ratio = "" if name.startswith("plain") else \
            f"{statistics.median(a / b for a, b in zip(runs, rates[plain])):.2f}x"
        valid = statistics.median(v for v, _ in quality[label])
        right = statistics.median(r for _, r in quality[label])
        print(f"| {label} | {statistics.median(runs):.0f} | {', '.join(f'{r:.0f}' for r in runs)} | {ratio} | "
              f"{statistics.median(taus[label]):.2f} | {statistics.median(shares[label]):.1%} | {valid:.0%} | "
              f"{right:.0%} |")
    print(waiting.report())


if __name__ == "__main__":
    main()
