"""Drafter quality on the default model's own samples, replayed without the model.

Step 1 (once, cached): plain sampling of GSM8K questions in the chat template records every
sample's tokens, the target probability of each and the target's 8 most likely tokens at each
position (what the engine hands its drafter).
Step 2 (seconds per drafter): the samples are replayed through a drafter as the engine would run
it. Each step every live sample proposes a tree from its prefix and its siblings' prefixes, and
advances by the longest path of the tree that its recorded text follows, plus one token.

Why this measures tau exactly in expectation: the deterministic scheme draws y ~ p at each node
and accepts the child equal to y, so a tree advances by its longest path that a fresh sample of
the target follows. The recorded continuation is such a sample (its siblings, which the draft
depends on, are independent of it), so the mean advance per sample-step here is an unbiased
estimate of the tau the engine measures with the same drafter and fixed draft sizes. The only
difference from a live run is which sibling prefixes are visible at each step; here siblings
progress at their own replayed pace, as in the engine.

Checked against live runs of the engine (8 x 16, T 0.7, 4-token drafts): replay tau ngram 1.58,
first match 1.62, consensus 1.79 (1.75 with hard votes); live (benchmarks/bench_spec.py) 1.56,
1.65, 1.81 (1.76 before soft votes).

    python benchmarks/bench_replay.py [--questions 8] [--n 16] [--temperature 0.7] [--seeds 0 1]
                                      [--budgets 4:4 6:6 8:6 12:6 16:8] [--coverage]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent


RECORDED_ALTERNATIVES = 8


def record(questions: int, n: int, temperature: float, max_tokens: int, seed: int, llm=None) -> list[dict]:
    """Plain samples with their target probabilities and most likely tokens:
    [{prompt, samples: [{tokens, probs, alternatives: [[tokens, probs], ...]}]}]. ``llm``: the
    default model in float32 unless given."""
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.drafters import DRAFTERS, NoDrafter
    from multispec.reasoning import load_gsm8k

    groups: dict[int, dict] = {}
    owner: dict[int, dict] = {}

    class Recorder(NoDrafter):
        """Drafts nothing; keeps what the engine tells a drafter (registered for this run only)."""

        alternatives = RECORDED_ALTERNATIVES

        def add_group(self, group_id, prompt_ids, sample_ids):
            group = groups.setdefault(len(groups), {"prompt": list(prompt_ids), "samples": []})
            for sample_id in sample_ids:
                owner[sample_id] = {"tokens": [], "probs": [], "alternatives": []}
                group["samples"].append(owner[sample_id])

        def observe(self, sample_id, new_tokens, token_probs=None, alternatives=None):
            entry = owner[sample_id]
            entry["tokens"].extend(new_tokens)
            entry["probs"].extend(token_probs if token_probs is not None else [-1.0] * len(new_tokens))
            entry["alternatives"].extend(alternatives if alternatives is not None else [None] * len(new_tokens))

    DRAFTERS["recorder"] = Recorder
    try:
        if llm is None:
            llm = LLM(dtype="float32")  # the recordings the tables were made from
        conversations = [p.chat() for p in load_gsm8k(limit=questions)]
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
        # adaptive=False: a drafter whose budget keeps nothing for a few steps is no longer given
        # the target's likeliest tokens (see ``Lane.wants_alternatives``), and a recording must
        # hold them at every position.
        llm.chat(conversations, params, SpecConfig(drafter="recorder", adaptive=False), use_tqdm=False)
    finally:
        del DRAFTERS["recorder"]
    return [groups[k] for k in sorted(groups)]


def recording(questions: int, n: int, temperature: float, max_tokens: int, seed: int,
              cache: Path = ROOT / "results" / "replay") -> list[dict]:
    """``record``'s groups, from ``cache`` where an earlier run left them."""
    # "_v2": recordings before it held the likeliest tokens for each sample's first steps only.
    name = f"q{questions}_n{n}_T{temperature}_t{max_tokens}_s{seed}_a{RECORDED_ALTERNATIVES}_v2"
    path = cache / f"{name}.json"
    if not path.exists():
        print(f"recording {path.name} (plain sampling)...", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record(questions, n, temperature, max_tokens, seed)))
    return json.loads(path.read_text())


def accepted(tree, text: list[int], at: int) -> int:
    """Length of the tree's longest path that ``text`` follows from position ``at``."""
    depth = {-1: 0}
    best = 0
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if parent in depth and at + depth[parent] < len(text) and token == text[at + depth[parent]]:
            depth[node] = depth[parent] + 1
            best = max(best, depth[node])
    return best


def replay(groups: list[dict], kind: str, depth: int, nodes: int, inspect=None, **options) -> dict:
    """Replays every group through a fresh drafter; tau and acceptance per drafted token.

    ``inspect(drafter, live, trees, texts, done)``, if given, sees each step after the drafts are
    proposed and before any sample of the step moves on."""
    from multispec.drafters import make_drafter

    advance, steps, drafted, hits = 0, 0, 0, 0
    for group in groups:
        drafter = make_drafter(kind, vocab_size=49152, max_depth=depth, max_nodes=nodes, **options)
        texts = [s for s in group["samples"] if s["tokens"]]
        ids = list(range(len(texts)))
        drafter.add_group(0, group["prompt"], ids)
        done = [0] * len(texts)
        for i in ids:  # the first token comes from the prefill, as in the engine
            drafter.observe(i, texts[i]["tokens"][:1], texts[i]["probs"][:1], texts[i]["alternatives"][:1])
            done[i] = 1
        live = [i for i in ids if done[i] < len(texts[i]["tokens"])]
        while live:
            trees = drafter.propose(live, [nodes] * len(live))
            if inspect is not None:
                inspect(drafter, live, trees, texts, done)
            for i, tree in zip(live, trees):
                tokens, probs, alternatives = texts[i]["tokens"], texts[i]["probs"], texts[i]["alternatives"]
                gain = accepted(tree, tokens, done[i])
                take = min(gain + 1, len(tokens) - done[i])
                window = slice(done[i], done[i] + take)
                drafter.observe(i, tokens[window], probs[window], alternatives[window])
                done[i] += take
                advance += gain + 1
                steps += 1
                drafted += len(tree.tokens)
                hits += gain
            live = [i for i in live if done[i] < len(texts[i]["tokens"])]
    return {"tau": advance / steps, "acceptance": hits / max(drafted, 1), "steps": steps}


def coverage(groups: list[dict], depth: int = 4, nodes: int = 4) -> dict:
    """What the sources offer for the next token, replaying consensus drafts (shares of steps): no
    source continues the sample's last tokens; the next token is among the first tokens offered
    (the tokens the sources took, then also their alternatives); the draft's first token is the
    next token; the mean target probability of the token sampled (a floor for how often the
    target's own most likely token would be right); and the mean probability of the target's most
    likely token (how often a one-token draft that always guessed it would be accepted: the ceiling
    of any deterministic one-token draft)."""
    from multispec.drafters.lookup import find_continuations

    counts = {"no source": 0.0, "next token offered": 0.0, "offered with alternatives": 0.0,
              "first draft token right": 0.0, "p(sampled)": 0.0, "p(likeliest)": 0.0}

    def inspect(drafter, live, trees, texts, done):
        for i, tree in zip(live, trees):
            sample = drafter._samples[i]
            continuations = find_continuations(sample.text, sample.lookup, depth, False, 10**6)  # every source
            following = texts[i]["tokens"][done[i]]
            counts["no source"] += not continuations
            counts["next token offered"] += any(c[0][0] == following for c in continuations)
            counts["offered with alternatives"] += any(
                c[0][0] == following or (c[4] and c[4][0] is not None and following in c[4][0][0])
                for c in continuations)
            counts["first draft token right"] += bool(tree.tokens) and tree.tokens[0] == following
            counts["p(sampled)"] += texts[i]["probs"][done[i]]
            likeliest = texts[i]["alternatives"][done[i]]
            counts["p(likeliest)"] += likeliest[1][0] if likeliest else texts[i]["probs"][done[i]]

    # The sources are read from the Python path's state (the compiled store keeps its own).
    with mock.patch.dict(os.environ, {"MULTISPEC_KERNELS": "0"}):
        steps = replay(groups, "consensus", depth, nodes, inspect=inspect)["steps"]
    return {key: value / steps for key, value in counts.items()}


VARIANTS = {
    "ngram": ("ngram", {}),
    "consensus-first-match": ("consensus", {"aggregate": False}),
    "consensus-hard-votes": ("consensus", {"alternatives": 0}),
    "consensus": ("consensus", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one recording per seed")
    parser.add_argument("--budgets", nargs="+", default=["4:4"],
                        help="draft sizes as NODES:DEPTH, e.g. 4:4 6:6 8:6 12:6 16:8")
    parser.add_argument("--cache", default=str(ROOT / "results" / "replay"))
    parser.add_argument("--coverage", action="store_true",
                        help="also print what the sources offer for the next token (consensus, 4:4)")
    args = parser.parse_args()
    budgets = [tuple(int(x) for x in b.split(":")) for b in args.budgets]
    recordings = [recording(args.questions, args.n, args.temperature, args.max_tokens, seed, Path(args.cache))
                  for seed in args.seeds]
    print(f"{args.questions} questions x n = {args.n}, T {args.temperature}, max_tokens {args.max_tokens}, "
          f"seeds {args.seeds} (mean over seeds); tau = tokens per sample-step, acc = accepted / drafted\n")
    print("| nodes:depth | " + " | ".join(f"{name} tau (acc)" for name in VARIANTS) + " | consensus / ngram tau |")
    print("|---" * (len(VARIANTS) + 2) + "|")
    for nodes, depth in budgets:
        cells, taus = [], {}
        for name, (kind, options) in VARIANTS.items():
            rows = [replay(groups, kind, depth, nodes, **options) for groups in recordings]
            taus[name] = statistics.mean(r["tau"] for r in rows)
            cells.append(f"{taus[name]:.3f} ({statistics.mean(r['acceptance'] for r in rows):.1%})")
        print(f"| {nodes}:{depth} | " + " | ".join(cells) + f" | {taus['consensus'] / taus['ngram']:.3f}x |",
              flush=True)
    if args.coverage:
        shares = [coverage(groups) for groups in recordings]
        print("\nshares of steps (consensus, 4:4): " + ", ".join(
            f"{key} {statistics.mean(s[key] for s in shares):.1%}" for key in shares[0]))


if __name__ == "__main__":
    main()
