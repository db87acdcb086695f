"""A checkpoint draft model's forwards in the compiled attention and layer stack, against the path
they took before (the attention module of ``--before``, read from git, and one-prompt forwards
layer by layer), alternating whole runs in one process on one engine.

A draft model's tree grows one forward a depth, each node attending to its sample's text and to
its ancestors among the earlier depths' nodes (its scratch positions). Before, those forwards ran
the portable attention with a mask per row, layer by layer from Python, and a one-prompt forward
never ran the compiled stack; now the compiled attention hides the scratch keys a row does not
descend from, and a forward over one prompt's samples runs the compiled stack. The workload is
``early_exit_draft.py``'s: GSM8K questions one at a time (chat template), the default model as
target and, as the draft, itself (q equal to p: the most drafting a draft LM does here) or its
first ``--layers`` layers; medians of ``--runs`` interleaved runs.

    python experiments/draft_model_steps.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from attention_steps import before_attention  # noqa: E402
from bench_spec import chat_stats  # noqa: E402
from early_exit_draft import write_truncated  # noqa: E402

import multispec.drafters.checkpoint as checkpoint  # noqa: E402
from multispec import LLM, SamplingParams, SpecConfig  # noqa: E402
from multispec.models import load_checkpoint, resolve_model  # noqa: E402
from multispec.reasoning import load_gsm8k  # noqa: E402


class _PerPromptBefore(checkpoint._PerPrompt):
    """``_PerPrompt`` as it was: no ``kernel_args``, so every draft forward ran layer by layer."""

    def __init__(self, parts):
        self.parts = parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10, help="the truncated draft's layers (0: none)")
    parser.add_argument("--out", default="/tmp/multispec-early-exit")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", default="3cadb75", help="the revision whose attention module is 'before'")
    args = parser.parse_args()
    paths = {"after": (checkpoint.DecodeAttention, checkpoint._PerPrompt),
             "before": (before_attention(args.before), _PerPromptBefore)}
    drafts = {"the target itself": "smollm2-135m-instruct"}
    if args.layers:
        source = load_checkpoint(resolve_model("smollm2-135m-instruct")).path
        drafts[f"first {args.layers} layers"] = str(write_truncated(source, args.layers,
                                                                    Path(args.out) / f"layers-{args.layers}"))
    llm = LLM()
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    rows = {"plain": (SpecConfig(), "after")}
    for name, path in drafts.items():
        spec = SpecConfig(drafter="model", draft_model=path, max_draft_tokens=args.depth, adaptive=False,
                          decision_threshold=0.0)
        rows.update({f"{name}, {when}": (spec, when) for when in ("after", "before")})
    measured: dict[str, list] = {}
    for run in range(args.runs):  # interleaved: every row once per run
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=run)
        for name, (spec, when) in rows.items():
            checkpoint.DecodeAttention, checkpoint._PerPrompt = paths[when]
            s = chat_stats(llm, conversations, params, spec, True)
            measured.setdefault(name, []).append(s)
            print(f"  run {run} {name:<28} {s.tokens_per_second:6.1f} tok/s tau {s.tau:.2f} "
                  f"draft model {s.time_draft_model:.2f} s", file=sys.stderr)
    checkpoint.DecodeAttention, checkpoint._PerPrompt = paths["after"]
    print(f"\n{args.questions} questions x {args.n} one at a time, T 0.7, depth {args.depth}, {llm.dtype}; "
          f"medians of {args.runs} runs\n")
    print("| draft | tau | tok/s (runs) | speedup over plain | draft model s (runs) |")
    print("|---|---|---|---|---|")
    for name, runs in measured.items():
        speedup = statistics.median(s.tokens_per_second / p.tokens_per_second for s, p in zip(runs, measured["plain"]))
        print(f"| {name} | {statistics.median(s.tau for s in runs):.2f} | "
              f"{statistics.median(s.tokens_per_second for s in runs):.1f} "
              f"({', '.join(f'{s.tokens_per_second:.1f}' for s in runs)}) | {speedup:.2f}x | "
              f"{statistics.median(s.time_draft_model for s in runs):.2f} "
              f"({', '.join(f'{s.time_draft_model:.2f}' for s in runs)}) |")
    for name in drafts:
        ratios = [a.time_draft_model / b.time_draft_model
                  for a, b in zip(measured[f"{name}, before"], measured[f"{name}, after"])]
        print(f"{name}: draft model time before / after {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
