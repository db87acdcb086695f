"""How often the engine accepts what two draft heads draw, on the same prompts and seeds.

A head's held-out agreement (``multispec train-draft`` prints it) is measured on text teacher-
forced through the target; what decides speed is how often verification accepts the tokens the
head draws while the engine samples. This runs the head as the only drafter, with no budget (every
sample drafts every step), over GSM8K test questions the benches do not use, n = 4 a question, for
the shipped head and a second one alternately: one drawn token a sample (decision model off: the
first-token acceptance one request of 16 needs, docs/results.md), then chains 4 deep with each
head's decision model. It prints drafted and accepted tokens and tau per head, depth and
temperature.

With ``--speed 4,16`` it then times what each head buys as a user runs it: the hybrid drafter
with the default budget, one request of n samples at a time (GSM8K test questions 1-8, T 0.7),
plain decoding and the hybrid with each head alternating in one process for ``--rounds`` rounds
(the order reversed every other round); per head the median of the per-round ratios to plain.

    python experiments/head_acceptance.py --head draft-head.safetensors
    python experiments/head_acceptance.py --head draft-head.safetensors --skip-acceptance --speed 4,16
"""

from __future__ import annotations

import argparse

import statistics

from multispec import LLM, SamplingParams, SpecConfig
from multispec.models.registry import paired_draft_head
from multispec.reasoning import load_gsm8k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="the head to set against the shipped one")
    parser.add_argument("--baseline", help="another head file in place of the shipped one")
    parser.add_argument("--questions", type=int, default=32, help="GSM8K test questions, from the 9th on")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--speed", help="comma-separated n: time the hybrid with each head at one request of n")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--speed-questions", type=int, default=8,
                        help="GSM8K test questions each timed round runs (drawn drafts change the text, so two "
                             "heads write different answers: few questions compare texts, not heads)")
    args = parser.parse_args()
    llm = LLM()
    baseline = args.baseline or paired_draft_head(llm.model_name)
    if baseline is None:
        raise SystemExit("the model has no shipped head: give --baseline")
    convs = [p.chat() for p in load_gsm8k(limit=8 + args.questions)[8:]]
    heads = {"baseline": str(baseline), "head": args.head}
    if not args.skip_acceptance:
        acceptance(llm, convs, heads, args)
    for n in [int(x) for x in args.speed.split(",")] if args.speed else []:
        speed(llm, heads, n, args.rounds, args.speed_questions)


def acceptance(llm, convs, heads: dict, args) -> None:
    for depth in (1, 4):
        for temperature in (0.7, 1.0):
            for name, path in heads.items():
                spec = SpecConfig(drafter="model", draft_model=path, max_draft_tokens=depth, adaptive=False,
                                  **({"decision_threshold": 0.0} if depth == 1 else {}))
                llm.chat(convs, SamplingParams(n=args.n, temperature=temperature, max_tokens=256, seed=args.seed),
                         spec, use_tqdm=False)
                s = llm.last_stats
                print(f"depth {depth} T {temperature} {name:8s} drafted {s.drafted_tokens} accepted "
                      f"{s.accepted_tokens} ({s.accepted_tokens / max(1, s.drafted_tokens):.1%}) tau {s.tau:.3f}",
                      flush=True)


def speed(llm, heads: dict, n: int, rounds: int, questions: int) -> None:
    convs = [p.chat() for p in load_gsm8k(limit=questions)]
    variants = {"plain": None, **{name: SpecConfig(drafter="hybrid", draft_model=path) for name, path in heads.items()}}
    params = SamplingParams(n=n, temperature=0.7, max_tokens=256, seed=0)
    for spec in variants.values():  # warm-up (each head's first draft pays its loading)
        llm.chat(convs[:1], params, spec, use_tqdm=False)
    rates = {name: [] for name in variants}
    taus = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            tokens = seconds = 0.0
            for conv in convs:
                llm.chat([conv], params, variants[name], use_tqdm=False)
                stats = llm.last_stats
                tokens, seconds = tokens + stats.generated_tokens, seconds + stats.time_total
                taus[name].append(stats.tau)
            rates[name].append(tokens / seconds)
    print(f"one request of {n} at a time, {questions} questions, hybrid, default budget, {rounds} rounds; "
          f"plain tok/s per round {[round(x) for x in rates['plain']]}")
    for name in heads:
        ratios = [a / b for a, b in zip(rates[name], rates["plain"])]
        print(f"  {name:8s} {statistics.median(ratios):.3f}x plain (rounds {[round(x, 3) for x in ratios]}), "
              f"tau {statistics.median(taus[name]):.2f}", flush=True)


if __name__ == "__main__":
    main()
