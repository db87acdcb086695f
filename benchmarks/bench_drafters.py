"""Drafting cost per engine step, and how many tokens the drafts would let each sample advance.

No model runs here. Each of n samples has a fixed text that plays the target: sibling texts are
made from GSM8K worked answers (several consecutive answers joined, to reach the length asked
for), each sibling rewriting some lines in other words and changing a few tokens, as sampled
reasoning paths do. Every step each live sample proposes a tree, accepts the longest path of the
tree that its text follows, and gains that plus one bonus token, as with a target that always
picks its text's token. Reported per drafter and n: milliseconds of propose + observe for the
whole batch per step (median over steps), and tokens gained per sample-step.

    python benchmarks/bench_drafters.py [--n 4 16 64] [--length 1000] [--budget 6] [--depth 6]
                                        [--vocab 49152] [--data path/to/gsm8k/test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from pathlib import Path

import torch

from multispec.drafters import make_drafter

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
TOKEN = re.compile(r"\d|[A-Za-z]+|\s+|[^\sA-Za-z\d]")
"""Digits one by one, words, runs of space, single symbols: close to what BPE does to math text."""


def load_problems(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


class Vocabulary(dict):
    def ids(self, text: str) -> list[int]:
        return [self.setdefault(piece, len(self)) for piece in TOKEN.findall(text)]


def sibling_texts(answers: list[list[str]], first: int, n: int, length: int, vocab: Vocabulary,
                  rng: random.Random, rewrite: float = 0.25, noise: float = 0.03) -> list[list[int]]:
    """n token texts of at least ``length`` tokens from answers first, first+1, ...; each sibling
    replaces a line by a line of another answer with probability ``rewrite`` and then changes each
    token with probability ``noise``."""
    base: list[str] = []
    index = first
    while len(vocab.ids("\n".join(base))) < length:
        base.extend(answers[index % len(answers)])
        index += 1
    every_line = [line for answer in answers[:200] for line in answer]
    texts = []
    for _ in range(n):
        lines = [rng.choice(every_line) if rng.random() < rewrite else line for line in base]
        tokens = vocab.ids("\n".join(lines))
        for i in range(len(tokens)):
            if rng.random() < noise:
                tokens[i] = rng.randrange(len(vocab))
        texts.append(tokens[:length])
    return texts


def accepted(tree, text: list[int], at: int) -> list[int]:
    """The tokens of the tree's longest path that ``text`` follows from position ``at``."""
    path, parent = [], -1
    for node, (token, up) in enumerate(zip(tree.tokens, tree.parents)):
        if up == parent and at + len(path) < len(text) and token == text[at + len(path)]:
            path.append(token)
            parent = node
    return path


def simulate(kind: str, n: int, length: int, budget: int, depth: int, vocab_size: int, seed: int,
             data: Path = GSM8K, **options) -> tuple[float, float]:
    """(median ms of propose + observe per step for all live samples, tokens gained per sample-step)."""
    rng = random.Random(seed)
    vocab = Vocabulary()
    problems = load_problems(data)
    first = rng.randrange(len(problems))
    prompt = vocab.ids("Question: " + problems[first]["question"] + "\nAnswer:")
    answers = [p["answer"].split("\n") for p in problems]
    texts = sibling_texts(answers, first, n, length, vocab, rng)
    drafter = make_drafter(kind, vocab_size=vocab_size, max_depth=depth, max_nodes=budget, **options)
    ids = list(range(n))
    drafter.add_group(0, prompt, ids)
    done = [0] * n
    live = list(ids)
    generator = torch.Generator().manual_seed(seed)
    times, gained, sample_steps = [], 0, 0
    while live:
        start = time.perf_counter()
        uniforms = torch.rand(len(live), budget, generator=generator, dtype=torch.float64).tolist() if drafter.sampled else None
        trees = drafter.propose(live, [budget] * len(live), uniforms)
        for sample, tree in zip(live, trees):
            text, at = texts[sample], done[sample]
            path = accepted(tree, text, at)
            new = path + text[at + len(path):][:1]
            drafter.observe(sample, new, [0.9] * len(new))
            done[sample] += len(new)
            gained += len(new)
        sample_steps += len(live)
        for sample in [s for s in live if done[s] >= len(texts[s])]:
            drafter.remove(sample)
        live = [s for s in live if done[s] < len(texts[s])]
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), gained / sample_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--length", type=int, default=1000, help="tokens per sample")
    parser.add_argument("--budget", type=int, default=6, help="draft nodes per sample per step")
    parser.add_argument("--depth", type=int, default=6, help="max draft depth")
    parser.add_argument("--vocab", type=int, default=49152, help="width of q rows (sampled drafts); SmolLM2's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=GSM8K, help="GSM8K jsonl file")
    args = parser.parse_args()
    drafters = {
        "ngram (prompt lookup)": ("ngram", {}),
        "consensus, first match": ("consensus", {"aggregate": False}),
        "consensus": ("consensus", {}),
        "consensus, sampled": ("consensus", {"sampled": True}),
    }
    print(f"texts of {args.length} tokens, budget {args.budget} nodes, depth <= {args.depth}, q rows of {args.vocab}")
    print(f"{'drafter':<24}" + "".join(f"{'n=' + str(n) + ' ms/step':>16}{'tok/step':>10}" for n in args.n))
    for name, (kind, options) in drafters.items():
        row = f"{name:<24}"
        for n in args.n:
            ms, tokens = simulate(kind, n, args.length, args.budget, args.depth, args.vocab, args.seed, args.data,
                                  **options)
            row += f"{ms:>16.2f}{tokens:>10.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
