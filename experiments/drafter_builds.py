"""The draft head's drafting code of a git revision against the working tree's, in one process.

The methods that turn the head's distributions into trees (``ModelDrafter._draft``, ``_trees``,
``_draw_children``, ``_probs``) are read from ``multispec/drafters/model.py`` at ``--base`` and
swapped onto the working tree's ``ModelDrafter`` in turn with its own, round by round (the order
reversed every other round), everything else being the working tree's. Each round generates the
same GSM8K questions with the head as the only drafter at a fixed depth, no budget; both versions
must give the same tokens (they draw the same tokens from the same rows), and the figures are the
engine's own seconds a step in drafting (and in the head's forwards) and in verification, median
of the rounds. Valid while the revision's methods keep the signatures the rest of the class calls.

    python experiments/drafter_builds.py --base HEAD~1 --n 16 --depth 3 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import types
from pathlib import Path

from multispec import LLM, SamplingParams, SpecConfig
from multispec.drafters import model as current
from multispec.reasoning import load_gsm8k

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("_draft", "_trees", "_draw_children", "_probs")


def base_methods(revision: str) -> dict:
    source = subprocess.run(["git", "show", f"{revision}:multispec/drafters/model.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("base_model")
    exec(compile(source, f"{revision}:multispec/drafters/model.py", "exec"), module.__dict__)
    return {name: getattr(module.ModelDrafter, name) for name in METHODS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to set against the working tree")
    parser.add_argument("--n", type=int, default=16, help="samples of the one request in flight")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    versions = {"base": base_methods(args.base), "tree": {name: getattr(current.ModelDrafter, name) for name in METHODS}}
    llm = LLM()
    convs = [p.chat() for p in load_gsm8k(limit=args.questions)]
    spec = SpecConfig(drafter="model", max_draft_tokens=args.depth, adaptive=False)
    params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, seed=0)
    llm.chat(convs[:1], params, spec, use_tqdm=False)  # warm-up
    figures = {name: [] for name in versions}
    tokens = {}
    for r in range(args.rounds):
        for name in (list(versions) if r % 2 == 0 else list(versions)[::-1]):
            for method, function in versions[name].items():
                setattr(current.ModelDrafter, method, function)
            steps = draft = head = verify = 0.0
            out = []
            for conv in convs:
                result = llm.chat([conv], params, spec, use_tqdm=False)[0]
                s = llm.last_stats
                steps += s.decode_forwards
                draft, head, verify = draft + s.time_draft, head + s.time_draft_model, verify + s.time_verify
                out.append([c.token_ids for c in result.outputs])
            tokens.setdefault(name, out)
            figures[name].append((1e3 * draft / steps, 1e3 * head / steps, 1e3 * verify / steps))
    for method, function in versions["tree"].items():
        setattr(current.ModelDrafter, method, function)
    print(f"one request of {args.n}, head {args.depth} deep, {args.rounds} rounds; same tokens: "
          f"{tokens['base'] == tokens['tree']}")
    for name, rows in figures.items():
        d, h, v = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"  {name}: drafting {d:.3f} ms a step (head {h:.3f}), verification {v:.3f} ms a step; "
              f"drafting per round {[round(row[0], 2) for row in rows]}")


if __name__ == "__main__":
    main()
