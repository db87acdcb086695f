"""Does the draft head gain from reading a window of the text before its root?

A head of ``HeadConfig.context`` 1 reads only the target's feature at the root (the first shipped
head did; the one shipped now reads 8). A head with a window attends to the last C pairs (the target's feature at a position, the token written
after it), at the cost of C - 1 more rows through its first projection and q/k/v per draft step.
This trains heads with each window on the same teacher-forced data (reference solutions of GSM8K
train questions the shipped recipe does not use, so no sampling is needed), with the same
seeds, and prints their held-out agreement with the target per draft depth and their training
time. It asks the question cheaply; the shipped head comes from ``multispec train-draft``.

    python experiments/head_window.py --contexts 1,4,8 --seeds 0,1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from multispec import LLM
from multispec.models.draft_head import DraftHead, HeadConfig
from multispec.reasoning import load_gsm8k
from multispec.training import TrainConfig, _reference_answers, agreement, frequent_tokens, teacher_forced, train_head


def forced_slices(llm, first: int, counts: list[int], cache: Path | None = None) -> list:
    """Teacher-forced reference solutions of consecutive slices of the GSM8K train questions from
    ``first`` on, ``counts[i]`` questions each (one ``Sequences`` a slice), kept in ``cache`` where
    given (a rerun reuses it)."""
    if cache is not None and cache.is_file():
        return torch.load(cache, weights_only=False)
    problems = load_gsm8k(limit=first + sum(counts), split="train")[first:]
    sequences = _reference_answers(llm, problems)
    start = time.perf_counter()
    slices, at = [], 0
    for count in counts:
        slices.append(teacher_forced(llm, sequences[at:at + count]))
        at += count
    print(f"teacher forcing: {time.perf_counter() - start:.0f}s, "
          f"{' + '.join(str(s.tokens.numel()) for s in slices)} positions", flush=True)
    if cache is not None:
        torch.save(slices, cache)
    return slices


def train_fresh(llm, train, held, config: TrainConfig) -> tuple[DraftHead, float, list[dict]]:
    """A new head (``config``'s window and seed, the training data's frequent tokens) trained on
    ``train``: the head, its training seconds and its held-out figures per draft depth."""
    vocab = frequent_tokens(train, config.num_tokens, llm.config.vocab_size)
    torch.manual_seed(config.seed)
    head = DraftHead(HeadConfig.for_target(llm.config, vocab.numel(), config.intermediate_size,
                                           context=config.context))
    head.vocab_ids.copy_(vocab)
    head.attach(llm.model)
    head.output, head.embedding = head.output.float(), head.embedding.float()
    start = time.perf_counter()
    train_head(head, train, config, log=lambda line: None)
    return head, time.perf_counter() - start, agreement(head, held, config.unroll)


def figures_line(figures: list[dict]) -> str:
    return " ".join(f"{f['agree']:.3f}" for f in figures) + " " + " ".join(f"{f['accept']:.3f}" for f in figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1,8", help="windows to compare (1: the root alone)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--train", type=int, default=420, help="reference solutions trained on")
    parser.add_argument("--held", type=int, default=80, help="reference solutions held out")
    parser.add_argument("--first", type=int, default=1400, help="first GSM8K train question used")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--data", help="keep the teacher-forced data in this file (a rerun reuses it)")
    args = parser.parse_args()

    llm = LLM()
    train, held = forced_slices(llm, args.first, [args.train, args.held], Path(args.data) if args.data else None)
    print("seed context train_s top-1(depth 1,2,3) acceptance-at-T1(depth 1,2,3)")
    for seed in (int(s) for s in args.seeds.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            config = TrainConfig(epochs=args.epochs, context=context, seed=seed)
            _, seconds, figures = train_fresh(llm, train, held, config)
            print(seed, context, f"{seconds:.0f}", figures_line(figures), flush=True)


if __name__ == "__main__":
    main()
