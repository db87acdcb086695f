"""Where a drafted step's time goes: plain decoding against the draft head at a few fixed shapes.

One request of n samples at a time (2 GSM8K test questions in the chat template, T 0.7,
max_tokens 256, the machine's default dtype), every variant once per seed and the seeds
interleaved, so drift hits all of them alike. Per decode step (median over the seeds): the head's
forwards, the target's forward, verification and commit, in ms, with tau and tokens/s. This is
what says whether a deeper or wider tree can pay on a machine: each extra depth adds one head
forward and one token per chain to the target's forward and to verification.

    python experiments/head_step_split.py            # 4 samples in flight, seeds 0-2
    python experiments/head_step_split.py --n 16 --seeds 0,1
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--questions", type=int, default=2)
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k

    def head(width: int, depth: int) -> SpecConfig:
        return SpecConfig(drafter="model", num_candidates=width, max_draft_tokens=depth, adaptive=False,
                          decision_threshold=0.0)

    rows = {"plain": SpecConfig(), "head w1 d3": head(1, 3), "head w1 d5": head(1, 5), "head w2 d5": head(2, 5)}
    llm = LLM()
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    measured: dict[str, list[dict]] = {label: [] for label in rows}
    for seed in (int(s) for s in args.seeds.split(",")):
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=256, seed=seed)
        for label, spec in rows.items():
            totals = dict(steps=0, head=0.0, draft=0.0, forward=0.0, verify=0.0, commit=0.0, tokens=0, wall=0.0)
            taus = []
            for conversation in conversations:
                llm.chat([conversation], params, spec, use_tqdm=False)
                s = llm.last_stats
                totals["steps"] += s.decode_forwards
                totals["head"] += s.time_draft_model
                totals["draft"] += s.time_draft
                totals["forward"] += s.time_forward
                totals["verify"] += s.time_verify
                totals["commit"] += s.time_commit
                totals["tokens"] += s.generated_tokens
                totals["wall"] += s.time_total
                taus.append(s.tau)
            per_step = {key: 1000 * totals[key] / totals["steps"] for key in ("head", "draft", "forward", "verify",
                                                                              "commit")}
            per_step["step"] = per_step["draft"] + per_step["forward"] + per_step["verify"] + per_step["commit"]
            measured[label].append({**per_step, "tau": statistics.mean(taus),
                                    "tok_s": totals["tokens"] / totals["wall"]})
    print(f"{args.n} samples in flight, {llm.dtype}; ms per decode step, medians over seeds {args.seeds}\n")
    print("| variant | step | head | target forward | verify | commit | tau | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, runs in measured.items():
        m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"| {label} | {m['step']:.1f} | {m['head']:.1f} | {m['forward']:.1f} | {m['verify']:.1f} | "
              f"{m['commit']:.1f} | {m['tau']:.2f} | {m['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
