"""How much does the draft head gain from more training text?

The shipped head agrees with the target on 0.56 of held-out positions at depth 1 and on 0.68 of
its training positions: it overfits, which says more text should help. This measures the slope:
heads trained with one seed and one recipe on growing parts (``--sizes``) of one pool of
teacher-forced reference solutions (GSM8K train questions the shipped recipe does not use, so
no sampling is needed), each judged on the same held-out solutions. Per size it prints the
training positions, the held-out top-1 agreement and the single-draft acceptance at T 1 per
draft depth, and the training time.

With ``--sampled S`` the text is the target's own answers instead (S a question, sampled as
``multispec train-draft`` samples them, the features kept from the sampling forwards): sizes
count questions, and the held-out figures are on held-out questions' answers. ``--save`` writes
the largest size's head for ``benchmarks/bench_draft_model.py --draft-head``, which judges it by
what the engine accepts.

    python experiments/head_data.py --sizes 420,840,1680,3360 --held 160
    python experiments/head_data.py --sampled 2 --sizes 160,320,640 --held 40
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from head_window import figures_line, forced_slices, train_fresh

from multispec import LLM
from multispec.reasoning import load_gsm8k
from multispec.training import Sequences, TrainConfig, _answers, observed


def first_answers(data: Sequences, count: int) -> Sequences:
    """The positions of the first ``count`` answers (they are stored in order)."""
    end = int(torch.searchsorted(data.sequence, torch.tensor(count)).item())
    return Sequences(data.features[:end], data.tokens[:end], data.lse[:end], data.sequence[:end])


def sampled_slices(llm, first: int, counts: list[int], samples: int, cache: Path | None = None) -> list:
    """The target's own answers (``samples`` a question, half the questions at T 0.7 and half at
    1.0, as ``multispec train-draft`` samples them) to consecutive slices of the GSM8K train
    questions from ``first`` on, with the features the engine computed while sampling; one
    ``Sequences`` a slice, answers in question order."""
    if cache is not None and cache.is_file():
        return torch.load(cache, weights_only=False)
    problems = load_gsm8k(limit=first + sum(counts), split="train")[first:]
    answers = sorted(_answers(llm, problems, TrainConfig(samples=samples), print), key=lambda a: a.problem)
    slices, at = [], 0
    for count in counts:
        slices.append(observed([a for a in answers if at <= a.problem < at + count and a.features is not None]))
        at += count
    if cache is not None:
        torch.save(slices, cache)
    return slices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="420,840,1680", help="reference solutions trained on, per head")
    parser.add_argument("--held", type=int, default=160, help="reference solutions held out (the same for every head)")
    parser.add_argument("--first", type=int, default=1800, help="first GSM8K train question used")
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="keep the teacher-forced data in this file (a rerun reuses it)")
    parser.add_argument("--sampled", type=int, default=0,
                        help="train on this many of the target's own answers a question instead of reference solutions")
    parser.add_argument("--save", help="write the head of the largest size to this file (no decision model: "
                                       "it drafts to full depth), for bench_draft_model.py --draft-head")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    llm = LLM()
    cache = Path(args.data) if args.data else None
    if args.sampled:
        held, pool = sampled_slices(llm, args.first, [args.held, sizes[-1]], args.sampled, cache)
    else:
        held, pool = forced_slices(llm, args.first, [args.held, sizes[-1]], cache)
    print("questions positions train_s top-1(depth 1,2,3) acceptance-at-T1(depth 1,2,3)")
    for size in sizes:
        train = first_answers(pool, size * max(1, args.sampled))  # the answers of the first ``size`` questions
        config = TrainConfig(epochs=args.epochs, context=args.context, seed=args.seed)
        head, seconds, figures = train_fresh(llm, train, held, config)
        print(size, train.tokens.numel(), f"{seconds:.0f}", figures_line(figures), flush=True)
    if args.save:
        head.save(args.save)


if __name__ == "__main__":
    main()
