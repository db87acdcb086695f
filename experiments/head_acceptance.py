"""How often the engine accepts what two draft heads draw, on the same prompts and seeds.

A head's held-out agreement (``multispec train-draft`` prints it) is measured on text teacher-
forced through the target; what decides speed is how often verification accepts the tokens the
head draws while the engine samples. This runs the head as the only drafter, with no budget (every
sample drafts every step), over GSM8K test questions the benches do not use, n = 4 a question, for
the shipped head and a second one alternately: one drawn token a sample (decision model off: the
first-token acceptance one request of 16 needs, docs/results.md), then chains 4 deep with each
head's decision model. It prints drafted and accepted tokens and tau per head, depth and
temperature.

    python experiments/head_acceptance.py --head draft-head.safetensors
"""

from __future__ import annotations

import argparse

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
    args = parser.parse_args()
    llm = LLM()
    baseline = args.baseline or paired_draft_head(llm.model_name)
    if baseline is None:
        raise SystemExit("the model has no shipped head: give --baseline")
    convs = [p.chat() for p in load_gsm8k(limit=8 + args.questions)[8:]]
    heads = {"baseline": str(baseline), "head": args.head}
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


if __name__ == "__main__":
    main()
