"""Target-rooted draft trees against trees whose first level the draft head proposes itself.

multispec roots every draft tree in the target's own token: the bonus the last verification drew
from the target's distribution p at the next position, drawn from p itself, is the root, and the
draft head drafts the tokens after it from the target's feature at the root's parent and the
root's embedding (the "target initialisation" of arXiv 2409.10644). The alternative: the head
proposes the token at the root's position itself, from its own predicted feature there (it reads
the pair before: the target's feature one position further back and the token after it), and that
proposal c is verified against p like any draft, accepted with probability min(1, p(c) / q(c))
(else the residual is drawn); only an accepted c keeps the chain the head drafted after it.

This script measures what rooting gains, exactly and within the engine: ``HeadFirstDrafter`` (one
candidate, chains of fixed depth) drafts as the head-proposed scheme would, then keeps its chain
with the probability that scheme's first level would be accepted. The engine drew its root r from
a law p': the target's p at a bonus position, the residual norm((p - q)+) where the last step's
draft was rejected (the head-proposed scheme would verify its proposal against the same law).
Given r, a maximal coupling of the head's proposal c ~ q with r ~ p' has c = r with probability
min(1, q(r) / p'(r)) (its marginal: the sum over r of min(p', q), the first level's acceptance);
when c = r the chain after c is the chain after r, drafted from the head's predicted feature (not
the target's) as it would be. So each step keeps the chain with that probability, drawn from its
own generator, and offers no draft otherwise: tau and acceptance are those of the head-proposed
scheme, and the output law is the engine's (a draft tree may depend on anything known before
verification; it is verified as any other). p'(r) is recomputed from the step's logits in float32
after verification (``record_root_laws``). The chain is drafted for every sample and dropped where
the coupling rejects it, as the scheme too drafts before it knows.

    python experiments/head_first_level.py                     # one request of 4, T 0.7 and 1.0, 3 runs
    python experiments/head_first_level.py --depth 3 --runs 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from multispec.drafters import DRAFTERS, DraftTree  # noqa: E402
from multispec.drafters.model import ModelDrafter  # noqa: E402
from multispec.verify.support import SupportQ, dense_rows  # noqa: E402

NAME = "model-head-first"


class HeadFirstDrafter(ModelDrafter):
    """The head proposes the token at the root's position itself (see the module docstring)."""

    def __init__(self, **options):
        super().__init__(**options)
        if self.width != 1:
            raise ValueError(f"{NAME} drafts single chains (num_candidates=1)")
        self.root_prob: dict[int, float] = {}
        """Per sample, the probability of its newest token (the root) under the law it was drawn
        from (set by ``record_root_laws`` after each verification)."""
        self.coupling = np.random.default_rng(0)
        self.column = SupportQ.columns(self.vocab_ids, self.vocab_size)
        self.offered = self.kept = 0

    def remove(self, sample_id: int) -> None:
        super().remove(sample_id)
        self.root_prob.pop(sample_id, None)

    def _draft(self, sample_ids: list[int], budgets: list[int], uniforms) -> list[DraftTree]:
        ready = [len(self.features[s]) >= 2 and len(self.tokens[s]) >= 2 and s in self.root_prob for s in sample_ids]
        if not any(ready):
            return [DraftTree.EMPTY] * len(sample_ids)
        self._keep = [False] * len(sample_ids)
        self._ready = ready
        trees = super()._draft(sample_ids, budgets, uniforms)
        self.offered += sum(ready)
        self.kept += sum(self._keep)
        return [tree if keep else DraftTree.EMPTY for tree, keep in zip(trees, self._keep)]

    def _root_probs(self, sample_ids: list[int]) -> torch.Tensor:
        """The head's q at the root's position from the window one pair back, the coupling's
        verdict per sample, then the head's state fed the root: the q of the chain's first node."""
        shifted_features = {s: list(self.features[s])[:-1] if ready else self.features[s]
                            for s, ready in zip(sample_ids, self._ready)}
        shifted_tokens = {s: list(self.tokens[s])[:-1] if ready else self.tokens[s]
                          for s, ready in zip(sample_ids, self._ready)}
        features, tokens = self.features, self.tokens
        self.features, self.tokens = shifted_features, shifted_tokens
        try:
            proposal = super()._root_probs(sample_ids)  # q of the token at the root's position
        finally:
            self.features, self.tokens = features, tokens
        self.model_forwards += 1
        roots = torch.tensor([self.tokens[s][-1] for s in sample_ids], device=self.device)
        columns = self.column[roots]
        q_root = torch.where(columns >= 0, proposal.gather(1, columns.clamp_min(0)[:, None])[:, 0], 0.0).tolist()
        for i, s in enumerate(sample_ids):
            if self._ready[i]:
                self._keep[i] = bool(self.coupling.random() < min(1.0, q_root[i] / max(self.root_prob[s], 1e-30)))
        rows = torch.arange(len(sample_ids), device=self.device)
        return ModelDrafter._child_probs(self, rows, rows, columns.clamp_min(0), 1)

    def _child_probs(self, rows, samples, picks, depth: int) -> torch.Tensor:
        return super()._child_probs(rows, samples, picks, depth + 1)


def record_root_laws(verify, lanes: dict):
    """``verify`` (``multispec.engine.step.verify``) that also gives each ``HeadFirstDrafter`` the
    probability of every sample's new root under the law it was drawn from: p at the row it was
    drawn from, or, where the chain's next node was rejected there, norm((p - q)+) with that node's
    q (one candidate a depth: recursive rejection is plain speculative sampling)."""

    def wrapped(step, logits, alternatives):
        results = verify(step, logits, alternatives)
        for b, (sample, tree, result) in enumerate(zip(step.samples, step.trees, results)):
            lane = lanes.get(sample.request.lane)
            drafter = None if lane is None else lane.drafter
            if not isinstance(drafter, HeadFirstDrafter):
                continue
            node = result.path[-1] if result.path else -1
            row = step.row_offsets[b] + 1 + node
            temperature = sample.request.params.temperature
            p = torch.softmax(logits[row].float() / temperature, -1)
            child = node + 1  # a chain: node j's child is j + 1
            if tree.tokens and child < len(tree.tokens) and tree.q is not None:
                q = dense_rows(tree.q, [child])[0].float()
                residual = (p - q).clamp_min(0)
                law = float(residual[result.bonus]) / max(float(residual.sum()), 1e-30)
            else:
                law = float(p[result.bonus])
            drafter.root_prob[sample.sample_id] = law
        return results

    return wrapped



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if any(t <= 0 for t in temperatures):
        parser.error("--temperatures must be above 0: the coupling emulates drawn proposals")

    import multispec.engine.engine as engine_module
    import multispec.params as params_module
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.reasoning import load_gsm8k
    from bench_spec import chat_stats, warm_up

    DRAFTERS[NAME] = HeadFirstDrafter
    for module in (params_module, engine_module):
        module.HEAD_DRAFTERS = (*module.HEAD_DRAFTERS, NAME)

    llm = LLM()
    engine_module.verify = record_root_laws(engine_module.verify, llm.engine.lanes)
    conversations = [p.chat() for p in load_gsm8k(limit=args.questions)]
    fixed = dict(max_draft_tokens=args.depth, num_candidates=1, adaptive=False, decision_threshold=0.0)
    rows = {"none": SpecConfig(), "target-rooted": SpecConfig(drafter="model", **fixed),
            "head-first": SpecConfig(drafter=NAME, **fixed)}
    print(f"{llm.dtype}, one request of {args.n} at a time, {args.questions} GSM8K questions, chains "
          f"{args.depth} deep, max_tokens {args.max_tokens}; speedup over none in the same run, median of "
          f"{args.runs}\n")
    print("| T | row | tau | acceptance | speedup (runs) | first level kept |")
    print("|---|---|---|---|---|---|")
    for temperature in temperatures:
        warm_up(llm, conversations[0], args.n, temperature, list(rows.values()))
        measured: dict[str, list] = {label: [] for label in rows}
        kept = []
        for run in range(args.runs):
            params = SamplingParams(n=args.n, temperature=temperature, max_tokens=args.max_tokens, seed=run)
            for label in rows if run % 2 == 0 else list(rows)[::-1]:
                stats = chat_stats(llm, conversations, params, rows[label], True)
                measured[label].append(stats)
                for lane in llm.engine.lanes.values():
                    drafter = lane.drafter
                    if isinstance(drafter, HeadFirstDrafter) and drafter.offered:
                        kept.append(drafter.kept / drafter.offered)
                        drafter.kept = drafter.offered = 0
                print(f"  T {temperature} run {run} {label:<14} {stats.tokens_per_second:7.1f} tok/s "
                      f"tau {stats.tau:.2f}", file=sys.stderr)
        for label, runs in measured.items():
            speedups = [s.tokens_per_second / b.tokens_per_second for s, b in zip(runs, measured["none"])]
            share = f"{statistics.median(kept):.1%}" if label == "head-first" else ""
            print(f"| {temperature} | {label} | {statistics.median(s.tau for s in runs):.2f} | "
                  f"{statistics.median(s.acceptance_rate for s in runs):.1%} | {statistics.median(speedups):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in speedups)}) | {share} |")


if __name__ == "__main__":
    main()
