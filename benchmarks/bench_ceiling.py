"""The most speculation can gain on this machine, from what a step costs and what drafts can hit.

A step in which each of B samples carries L draft tokens costs S(B, L) and moves each sample by
tau(L) tokens on average, so against plain decoding on the same hardware

    speedup(B, L) = tau(L) * S(B, 0) / S(B, L).

Part 1 measures S(B, L) in the engine itself, with B samples in flight as in the benchmark's
cells (one question x n for the "one at a time" cells, all questions at once for the batched
ones). One generation per cell and repetition: plain steps until every sample has ``--context``
tokens (mid-way through a 256-token answer, so the caches are as full as on an average step of
``bench_spec.py``), then steps that cycle through the draft lengths, every sample drafting the
same L-token chain of filler, each step timed by the engine's step report (drafting, forward,
verification, commit). Filler (the end-of-text token, which a chat model rarely samples
mid-answer; the progress lines count how often it was accepted) costs nothing
to draft; a real draft adds its drafting time and, where accepted, the cache moves of its path,
so real steps cost at least this much.

Part 2 takes tau(L) three ways:
- perfect drafts, every token accepted: tau = 1 + L. No drafter and no verification scheme does
  better, so this column bounds every speculative method on this hardware at this batch size
  (for drafts of the same length in every sample; a mix of lengths costs in between).
- the target's own greedy chain (its most likely token at each position, given the path so far)
  in every sample: at L = 1 the most any one-token deterministic draft is accepted, near it for
  longer chains. Read from plain samples of the default model (``bench_replay.py``'s recordings,
  8 GSM8K questions x 16, T 0.7): a chain is accepted for as long as the sample's recorded tokens
  are the target's most likely ones, as the deterministic scheme accepts it.
- the consensus drafter's own L-token chains, replayed on the same recordings (n = 4 cells use
  the recordings' 16 siblings as four groups of 4; n = 64 has only the 16, which understates it). The default budget, which drafts per node
  where drafts pay, does better than a fixed chain in every sample.

    python benchmarks/bench_ceiling.py     # 4 and 16 samples one at a time, 8x4, 8x16 (20 minutes here)
    python benchmarks/bench_ceiling.py --cells 4x64 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from multispec.drafters import DraftTree, NoDrafter
from multispec.verify.schemes import COPIED, DraftLaw

sys.path.insert(0, str(Path(__file__).resolve().parent))

CELLS = {  # name: (questions in flight, samples per question)
    "4, one at a time": (1, 4),
    "16, one at a time": (1, 16),
    "8x4": (8, 4),
    "8x16": (8, 16),
    "4x64": (4, 64),
}
DEFAULT_CELLS = "4, one at a time;16, one at a time;8x4;8x16"
FILLER = 0
"""The draft token of every cost-measuring chain: SmolLM2's end-of-text token, rarely sampled."""


class FillerDrafter(NoDrafter):
    """Drafts for timing only: ``warm`` plain steps first (the samples' caches fill to a
    mid-generation length), then steps that cycle through ``lengths``, every sample drafting the
    same L-token chain of filler. The engine builds it from the registry (``DRAFTERS["filler"]``)
    and tells it each step through a step observer (``observe_step``), which keeps the seconds of
    each timed step: the whole step but the bookkeeping between steps (drafting, forward,
    verification, commit). The cost side of speculation alone."""

    lengths: list[int] = [0]
    warm = 0
    current: "FillerDrafter | None" = None

    def __init__(self):
        self.trees = {L: DraftTree([FILLER] * L, list(range(-1, L - 1)), None) if L else DraftTree.EMPTY
                      for L in self.lengths}
        self.step = 0
        self.spans: dict[int, list[float]] = {}

    @classmethod
    def create(cls, **options) -> "FillerDrafter":
        cls.current = cls()
        return cls.current

    @staticmethod
    def draft_law(*, sampled: bool, max_depth: int, max_nodes: int, **_) -> DraftLaw:
        return DraftLaw(COPIED, 1)

    def length(self) -> int:
        step = self.step - self.warm
        return 0 if step < 0 else self.lengths[step % len(self.lengths)]

    def propose(self, sample_ids, budgets, uniforms=None):
        length = self.length()
        return [self.trees[length] if budget >= length else DraftTree.EMPTY for budget in budgets]

    def observe_step(self, report) -> None:
        """One decode step done (a ``StepReport``): timed if every sample drafted the full chain."""
        length = self.length()
        timed = self.step >= self.warm and all(len(tree) == length for tree in report.trees)
        self.step += 1
        if timed:
            self.spans.setdefault(length, []).append(
                report.time_draft + report.time_forward + report.time_verify + report.time_commit)

    def step_seconds(self) -> dict[int, float]:
        """Per draft length, the mean seconds of its timed steps."""
        return {length: statistics.mean(values) for length, values in self.spans.items()}


def step_costs(cells: list[str], lengths: list[int], repeats: int, context: int, per_length: int,
               device: str, dtype: str = "auto", shapes: dict[str, tuple[int, int]] | None = None) -> dict:
    """{(cell, L): [seconds per step, one per repeat]}, ``context`` tokens into every sample.
    ``shapes``: (questions in flight, samples per question) of each cell name (default ``CELLS``)."""
    from multispec import LLM, SamplingParams, SpecConfig
    from multispec.drafters import DRAFTERS
    from multispec.reasoning import load_gsm8k

    shapes = shapes or CELLS
    llm = LLM(device=device, dtype=dtype, enable_prefix_caching=False)
    conversations = [p.chat() for p in load_gsm8k(limit=8)]
    deepest = max(lengths)
    accepted: dict[str, tuple[int, int]] = {}
    DRAFTERS["filler"] = FillerDrafter
    llm.engine.step_observers.append(lambda report: FillerDrafter.current.observe_step(report))

    def run(cell: str, order: list[int], warm: int, seed: int) -> dict[int, float]:
        questions, n = shapes[cell]
        FillerDrafter.lengths, FillerDrafter.warm = order, warm
        llm.engine.lanes.clear()  # a fresh drafter (and its step count) for every run
        spec = SpecConfig(drafter="filler", max_draft_tokens=max(deepest, 1), max_draft_nodes=max(deepest, 1),
                          adaptive=False)
        # Filler is almost never accepted, so a sample gains one token a step: room for the
        # plain steps, the timed ones and a whole chain at the last of them.
        steps = warm + per_length * len(order)
        params = SamplingParams(n=n, temperature=0.7, max_tokens=steps + deepest + 2, ignore_eos=True, seed=seed)
        llm.chat(conversations[:questions], params, spec, use_tqdm=False)
        accepted[cell] = (llm.last_stats.accepted_tokens, llm.last_stats.drafted_tokens)
        return FillerDrafter.current.step_seconds()

    run(cells[0], lengths, 4, 0)  # warm-up: first-call allocations and kernel selection
    costs: dict[tuple[str, int], list[float]] = {}
    for repeat in range(repeats):
        order = lengths if repeat % 2 == 0 else lengths[::-1]  # no length always follows the same one
        for cell in cells:
            started = time.perf_counter()
            for length, seconds in run(cell, order, context, repeat).items():
                costs.setdefault((cell, length), []).append(seconds)
            print(f"  [{repeat + 1}/{repeats}] {cell}: " + ", ".join(
                f"L {L} {1e3 * costs[(cell, L)][-1]:.0f} ms" for L in lengths) +
                f" (filler accepted {accepted[cell][0]} of {accepted[cell][1]}; {time.perf_counter() - started:.0f} s)",
                file=sys.stderr, flush=True)
    return costs


def greedy_tau(groups: list[dict], length: int) -> float:
    """Mean tokens per step when each sample drafts the target's most likely L-token chain."""
    advance = steps = 0
    for group in groups:
        for sample in group["samples"]:
            tokens, alternatives = sample["tokens"], sample["alternatives"]
            done = 1  # the first token comes from the prefill
            while done < len(tokens):
                hit = 0
                while (hit < length and done + hit < len(tokens) and alternatives[done + hit] is not None
                       and alternatives[done + hit][0][0] == tokens[done + hit]):
                    hit += 1
                done += min(hit + 1, len(tokens) - done)
                advance += hit + 1
                steps += 1
    return advance / steps


def split_groups(groups: list[dict], n: int) -> list[dict]:
    """Each group's siblings as groups of ``n`` (siblings are independent samples of one prompt)."""
    return [{"prompt": g["prompt"], "samples": g["samples"][i:i + n]}
            for g in groups for i in range(0, len(g["samples"]) - n + 1, n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"';'-separated, from: {'; '.join(CELLS)}")
    parser.add_argument("--lengths", default="0,1,2,3,4,5,6", help="draft tokens per sample (0 = plain, always run)")
    parser.add_argument("--repeats", type=int, default=3, help="generations per cell, each timing every length")
    parser.add_argument("--context", type=int, default=128,
                        help="tokens each sample has generated when the timed steps start (plain steps until then)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per draft length in a measurement")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="replay recordings (bench_replay.py)")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    args = parser.parse_args()
    cells = [c.strip() for c in args.cells.split(";") if c.strip()]
    for cell in cells:
        if cell not in CELLS:
            parser.error(f"unknown cell {cell!r}; expected one of: {'; '.join(CELLS)}")
    lengths = sorted({0, *(int(x) for x in args.lengths.split(","))})

    from bench_replay import recording, replay

    recordings = [recording(8, 16, 0.7, 256, seed) for seed in args.seeds]
    greedy = {L: statistics.mean(greedy_tau(groups, L) for groups in recordings) for L in lengths}
    consensus: dict[tuple[int, int], float] = {}
    for n in sorted({CELLS[cell][1] for cell in cells}):
        for L in lengths:
            consensus[(n, L)] = 1.0 if L == 0 else statistics.mean(
                replay(split_groups(groups, min(n, 16)), "consensus", L, L)["tau"] for groups in recordings)

    costs = step_costs(cells, lengths, args.repeats, args.context, args.steps, args.device)
    print(f"\nSpeedup over plain decoding that steps with L-token drafts allow: tau(L) x S(B, 0) / S(B, L).\n"
          f"S: a whole step but drafting, {args.context} tokens into the samples (step ms: median over "
          f"{args.repeats} repetitions; step / plain: median of the ratio within each repetition).\n"
          f"tau: from recordings (8 GSM8K questions x 16, T 0.7, seeds {args.seeds}).\n")
    print("| samples in flight | L | step ms | step / plain | perfect drafts | target's greedy chain "
          "| consensus chain |")
    print("|---|---|---|---|---|---|---|")
    best: dict[str, tuple] = {}
    for cell in cells:
        questions, n = CELLS[cell]
        rows = []
        for L in lengths:
            step = statistics.median(costs[(cell, L)])
            # Each repetition's lengths ran interleaved in one generation: ratios within it, then the median.
            ratio = statistics.median(s / p for s, p in zip(costs[(cell, L)], costs[(cell, 0)]))
            bounds = ((1 + L) / ratio, greedy[L] / ratio, consensus[(n, L)] / ratio)
            rows.append((L, bounds))
            print(f"| {cell} ({questions * n}) | {L} | {1e3 * step:.1f} | {ratio:.2f} | {bounds[0]:.2f}x "
                  f"| {bounds[1]:.2f}x (tau {greedy[L]:.2f}) | {bounds[2]:.2f}x (tau {consensus[(n, L)]:.2f}) |")
        best[cell] = tuple(max(rows, key=lambda row: row[1][k]) for k in range(3))
    print("\nBest over L (draft length):")
    for cell, picks in best.items():
        print(f"  {cell}: perfect drafts {picks[0][1][0]:.2f}x (L {picks[0][0]}), target's greedy chain "
              f"{picks[1][1][1]:.2f}x (L {picks[1][0]}), consensus chain {picks[2][1][2]:.2f}x (L {picks[2][0]})")


if __name__ == "__main__":
    main()
