"""How much does the draft head gain from more training text?

The shipped head agrees with the target on 0.56 of held-out positions at depth 1 and on 0.68 of
its training positions: it overfits, which says more text should help. This measures the slope:
heads trained with one seed and one recipe on the first 1/4, 1/2 and all of one pool of
teacher-forced reference solutions (GSM8K train questions the shipped recipe does not use, so
no sampling is needed), each judged on the same held-out solutions. Per size it prints the
training positions, the held-out top-1 agreement and the single-draft acceptance at T 1 per
draft depth, and the training time.

    python experiments/head_data.py --sizes 420,840,1680 --held 160
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from head_window import figures_line, forced_slices, train_fresh

from multispec import LLM
from multispec.training import Sequences, TrainConfig


def first_answers(data: Sequences, count: int) -> Sequences:
    """The positions of the first ``count`` answers (they are stored in order)."""
    end = int(torch.searchsorted(data.sequence, torch.tensor(count)).item())
    return Sequences(data.features[:end], data.tokens[:end], data.lse[:end], data.sequence[:end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="420,840,1680", help="reference solutions trained on, per head")
    parser.add_argument("--held", type=int, default=160, help="reference solutions held out (the same for every head)")
    parser.add_argument("--first", type=int, default=1800, help="first GSM8K train question used")
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="keep the teacher-forced data in this file (a rerun reuses it)")
    parser.add_argument("--save", help="write the head of the largest size to this file (no decision model: "
                                       "it drafts to full depth), for bench_draft_model.py --draft-head")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    llm = LLM()
    held, pool = forced_slices(llm, args.first, [args.held, sizes[-1]], Path(args.data) if args.data else None)
    print("answers positions train_s top-1(depth 1,2,3) acceptance-at-T1(depth 1,2,3)")
    for size in sizes:
        train = first_answers(pool, size)
        config = TrainConfig(epochs=args.epochs, context=args.context, seed=args.seed)
        head, seconds, figures = train_fresh(llm, train, held, config)
        print(size, train.tokens.numel(), f"{seconds:.0f}", figures_line(figures), flush=True)
    if args.save:
        head.save(args.save)


if __name__ == "__main__":
    main()
