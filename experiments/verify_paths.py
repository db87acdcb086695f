"""Verification's own time in drafted steps, two ways, alternating in one process.

- ``now``: copied drafts (consensus) verified inside the compiled softmax's pass, every row drawn
  and ranked there (``multispec.engine.step._draw_copied``); elsewhere the alternatives ranked by
  the compiled ``top_rows`` and a small forest's rows of p drawn in one call before the walk
  (``multispec.verify.tree.ALL_ROWS_AT_ONCE``);
- ``torch``: the probabilities written for the walk, the alternatives ranked by torch's top-k, and
  the walks drawing the rows they reach depth by depth (the chain walk still decides its accept
  tests at once).

The same requests, seeds and drafter each round; per variant the median over rounds of the
verification seconds per decode step (``RunStats.time_verify``), of the whole step, of tokens per
second and of draft tokens per step, and the per-round ratios. Outputs may part where top-k ties
are ranked differently (the drafts then differ, the output law does not).

    python experiments/verify_paths.py --drafter consensus --n 4 --questions 3 --rounds 5
    python experiments/verify_paths.py --drafter hybrid --n 4
    python experiments/verify_paths.py --n 16 --questions 8 --batched --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="consensus")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batched", action="store_true", help="all questions in one call instead of one at a time")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.engine import step as step_module
    from multispec.reasoning import load_gsm8k
    from multispec.verify import tree

    llm = LLM()
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    spec = SpecConfig(drafter=args.drafter)
    compiled_top, at_once, fused = step_module._top_rows, tree.ALL_ROWS_AT_ONCE, step_module._draw_copied

    def variant(name: str) -> None:
        step_module._top_rows = compiled_top if name == "now" else (lambda probs: None)
        step_module._draw_copied = fused if name == "now" else (lambda *args: None)
        tree.ALL_ROWS_AT_ONCE = at_once if name == "now" else -1

    def run(seed: int) -> dict:
        verify = step = tokens = wall = forwards = drafted = 0.0
        for conversation in [conversations] if args.batched else [[c] for c in conversations]:
            llm.chat(conversation, SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=seed),
                     spec, use_tqdm=False)
            s = llm.last_stats
            verify += s.time_verify
            step += s.time_draft + s.time_forward + s.time_verify + s.time_commit
            forwards += s.decode_forwards
            drafted += s.drafted_tokens
            tokens += s.generated_tokens
            wall += s.time_total
        return {"verify_ms": 1e3 * verify / forwards, "step_ms": 1e3 * step / forwards, "tok_s": tokens / wall,
                "drafted": drafted / forwards}

    variant("now")
    llm.chat(conversations[:1], SamplingParams(n=args.n, temperature=0.7, max_tokens=16, seed=0), spec, use_tqdm=False)
    results: dict[str, list[dict]] = {"now": [], "torch": []}
    for r in range(args.rounds):
        for name in ("now", "torch") if r % 2 == 0 else ("torch", "now"):
            variant(name)
            results[name].append(run(r))
            print(f"round {r} {name:5s} " + " ".join(f"{k} {v:.3f}" for k, v in results[name][-1].items()),
                  file=sys.stderr)
    variant("now")
    shape = "all in one call" if args.batched else "one request at a time"
    print(f"{args.drafter}, {args.questions} questions x {args.n} samples, {shape}, {args.rounds} rounds")
    for key in ("verify_ms", "step_ms", "tok_s", "drafted"):
        now = [m[key] for m in results["now"]]
        old = [m[key] for m in results["torch"]]
        ratios = [a / b if b else float("nan") for a, b in zip(now, old)]
        print(f"{key:9s} now {statistics.median(now):8.3f}  torch {statistics.median(old):8.3f}  "
              f"ratio {statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
