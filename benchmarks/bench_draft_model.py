"""Draft-model speculation on GSM8K: the shipped draft head against plain decoding, consensus and both.

Default model, GSM8K test questions in the chat template, max_tokens 256, bf16 where the machine
has it. Cells: one request of 4 samples in flight at a time, one of 16 at a time, and 4 x 16
batched, at temperature 0.7 and 1.0. Rows:

- none: plain decoding through the same engine (the speedup's baseline, same run, interleaved:
  every other run takes the rows in reverse order, so that a drift of the machine's speed over a
  run does not favour the rows that come first);
- consensus: the default SpecConfig(drafter="consensus") (sibling drafts, adaptive budget);
- model-w1, model-w2, model-w4: the draft head with 1, 2 or 4 candidates at the root, each a chain
  of up to ``--depth`` tokens, every step at full depth (decision model off, ``adaptive=False``):
  what the head itself achieves;
- model-w2-decision: as model-w2 with the head's decision model stopping chains (the ablation of
  the decision model against fixed depth; the other ablation, trees rooted in the target's token
  against a first level the head proposes itself, is ``experiments/head_first_level.py``);
- model-auto: SpecConfig(drafter="model"): one candidate, the decision model and the adaptive draft
  budget, the setting a user gets by asking for the draft model;
- consensus-fixed, hybrid-fixed: sibling drafts alone and merged with the head's top 2 candidates
  and their argmax chains (copied drafts, ``sampled_drafts=False``, deterministic verification),
  trees of up to 2 x depth nodes every step: the hybrid against its parts;
- hybrid: SpecConfig(drafter="hybrid") (one candidate, the head's candidates drawn from its q and
  verified by recursive rejection, the sibling text copied after them) with the adaptive budget,
  the setting a user gets by asking for the hybrid; hybrid-copied: the same with
  ``sampled_drafts=False`` (the head's top candidates copied);
- hybrid-drawn-fixed: as hybrid-fixed with the head's candidates drawn; hybrid-drawn-wide: the
  same with 3 x depth nodes, room for the head's whole tree and up to depth sibling nodes beside it;
- lm-w1, lm-w2: with ``--draft-checkpoint`` (a causal LM sharing the model's tokenizer: a
  directory, a .gguf or a known name), that model drafting with its own KV cache, 1 or 2
  candidates, chains of ``--depth``, every step at full depth.

Columns: tau (tokens per sample per forward), acceptance, tokens/s, speedup over none in the same
run (median over ``--runs`` runs), the share of a step spent drafting and in the head's forwards.

    python benchmarks/bench_draft_model.py                        # all cells, 2 questions each
    python benchmarks/bench_draft_model.py --cells 0 --runs 3     # one request of 4 at a time, median of 3
    python benchmarks/bench_draft_model.py --rows model-w2,model-auto --temperatures 0.7
    python benchmarks/bench_draft_model.py --rows lm-w1 --draft-checkpoint smollm2-135m-instruct --depth 3
    python benchmarks/bench_draft_model.py --cells 0 --rows model-w2 --draft-head my-head.safetensors
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import CoreWait, chat_stats, warm_up  # noqa: E402 - the one-at-a-time loop is shared with bench_spec

ROOT = Path(__file__).resolve().parent.parent
CELLS = [  # (questions, n, one request at a time)
    (2, 4, True),
    (2, 16, True),
    (4, 16, False),
]
ROWS = ("none", "consensus", "model-w1", "model-w2", "model-w4", "model-w2-decision", "model-auto",
        "consensus-fixed", "hybrid-fixed", "hybrid", "hybrid-copied", "hybrid-drawn-fixed", "hybrid-drawn-wide",
        "lm-w1", "lm-w2")


def configs(depth: int, checkpoint: str | None = None, head: str | None = None):
    """The rows' settings; ``head``: a draft head file the model and hybrid rows use instead of
    the one shipped for the model."""
    from multispec import SpecConfig

    fixed = dict(drafter="model", draft_model=head, max_draft_tokens=depth, adaptive=False, decision_threshold=0.0)
    return {"none": SpecConfig(),
            "consensus": SpecConfig(drafter="consensus"),
            "model-w1": SpecConfig(num_candidates=1, **fixed),
            "model-w2": SpecConfig(num_candidates=2, **fixed),
            "model-w4": SpecConfig(num_candidates=4, **fixed),
            "model-w2-decision": SpecConfig(drafter="model", draft_model=head, max_draft_tokens=depth,
                                            num_candidates=2, adaptive=False),
            "model-auto": SpecConfig(drafter="model", draft_model=head, max_draft_tokens=depth),
            "consensus-fixed": SpecConfig(drafter="consensus", max_draft_tokens=depth, max_draft_nodes=2 * depth,
                                          adaptive=False),
            "hybrid-fixed": SpecConfig(drafter="hybrid", draft_model=head, max_draft_tokens=depth, num_candidates=2,
                                       adaptive=False, decision_threshold=0.0, sampled_drafts=False),
            "hybrid": SpecConfig(drafter="hybrid", draft_model=head, max_draft_tokens=depth),
            "hybrid-copied": SpecConfig(drafter="hybrid", draft_model=head, max_draft_tokens=depth,
                                        sampled_drafts=False),
            "hybrid-drawn-fixed": SpecConfig(drafter="hybrid", draft_model=head, max_draft_tokens=depth,
                                             num_candidates=2, adaptive=False, decision_threshold=0.0,
                                             sampled_drafts=True),
            "hybrid-drawn-wide": SpecConfig(drafter="hybrid", draft_model=head, max_draft_tokens=depth,
                                            max_draft_nodes=3 * depth, num_candidates=2, adaptive=False,
                                            decision_threshold=0.0, sampled_drafts=True),
            **({} if checkpoint is None else {
                f"lm-w{w}": SpecConfig(drafter="model", draft_model=checkpoint, num_candidates=w,
                                       max_draft_tokens=depth, adaptive=False, decision_threshold=0.0)
                for w in (1, 2)})}


def run_cell(llm, questions: int, n: int, temperature: float, one_at_a_time: bool, rows, runs: int, depth: int,
             max_tokens: int, checkpoint: str | None = None, head: str | None = None) -> dict:
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    conversations = [p.chat() for p in load_gsm8k(limit=questions)]
    specs = configs(depth, checkpoint, head)
    warm_up(llm, conversations[0], n, temperature, [specs[label] for label in rows])
    results: dict[str, list[dict]] = {}
    for run in range(runs):
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=run)
        for label in rows if run % 2 == 0 else rows[::-1]:
            s = chat_stats(llm, conversations, params, specs[label], one_at_a_time)
            step = s.time_draft + s.time_forward + s.time_verify + s.time_commit
            results.setdefault(label, []).append({
                "tok_s": s.tokens_per_second, "tau": s.tau, "acceptance": s.acceptance_rate,
                "draft_share": s.time_draft / step if step else 0.0,
                "draft_model_share": s.time_draft_model / step if step else 0.0,
                "draft_forwards_per_step": s.draft_forwards / max(1, s.decode_forwards)})
            where = f"{questions} x {n}{' one at a time' if one_at_a_time else ''} T {temperature} run {run}"
            print(f"  {where} {label:<18} {s.tokens_per_second:7.1f} tok/s tau {s.tau:.2f}", file=sys.stderr)
    summary = {}
    for label, measured in results.items():
        summary[label] = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
        speedups = [m["tok_s"] / base["tok_s"] for m, base in zip(measured, results["none"])]
        summary[label].update(speedup=statistics.median(speedups), speedups=speedups, runs=len(measured))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", help="comma-separated cell indexes (default: all)")
    parser.add_argument("--rows", help=f"comma-separated rows (none always runs); rows: {', '.join(ROWS)}")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--depth", type=int, default=5, help="draft depth of the model rows")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_draft_model.json"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    parser.add_argument("--draft-checkpoint", help="a causal LM drafting for the model (rows lm-w1, lm-w2)")
    parser.add_argument("--draft-head", help="a draft head file (multispec train-draft) for the model and hybrid "
                                             "rows, in place of the one shipped for the model")
    args = parser.parse_args()
    rows = list(ROWS) if args.rows is None else ["none"] + [r for r in args.rows.split(",") if r != "none"]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    if args.rows is None and args.draft_checkpoint is None:
        rows = [r for r in rows if not r.startswith("lm-")]
    if any(r.startswith("lm-") for r in rows) and args.draft_checkpoint is None:
        sys.exit("rows lm-w1 and lm-w2 need --draft-checkpoint")
    cells = CELLS if args.cells is None else [CELLS[int(i)] for i in args.cells.split(",")]
    from multispec import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=False)
    print(f"model {args.model} on {llm.device}, {llm.dtype}; draft head {args.draft_head or 'shipped'}",
          file=sys.stderr)
    if any(r in ("consensus", "model-auto", "hybrid", "hybrid-copied") for r in rows):
        llm.engine.step_costs()  # the adaptive budget's prices, measured before any timing
    waiting = CoreWait()
    table = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for questions, n, one_at_a_time in cells:
            summary = run_cell(llm, questions, n, temperature, one_at_a_time, rows, args.runs, args.depth,
                               args.max_tokens, args.draft_checkpoint, args.draft_head)
            table.append({"questions": questions, "n": n, "one_at_a_time": one_at_a_time,
                          "temperature": temperature, "rows": summary})
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(table, indent=1))
    print(f"\n{llm.dtype}, max_tokens {args.max_tokens}, model rows {args.depth} deep; speedup: tokens/s over "
          f"none in the same run, median of {args.runs}\n")
    print("| cell | T | row | tau | acceptance | tok/s | speedup | draft share | head share | head forwards/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cell in table:
        name = f"{cell['questions']} x {cell['n']}" + (", one at a time" if cell["one_at_a_time"] else "")
        for label, r in cell["rows"].items():
            print(f"| {name} | {cell['temperature']} | {label} | {r['tau']:.2f} | {r['acceptance']:.1%} | "
                  f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['draft_share']:.1%} | {r['draft_model_share']:.1%} | "
                  f"{r['draft_forwards_per_step']:.1f} |")
    print(waiting.report())


if __name__ == "__main__":
    main()
