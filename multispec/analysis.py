"""``multispec analyze-verify``: expected per-token acceptance of every verification scheme for K = 1..8 drafts.

Two settings: (a) random target/draft pairs, (b) real ones: p is the default model's next-token
distribution at temperature 1.0 at the positions of its own samples on GSM8K questions (chat
template), q the same logits at the paper's draft temperatures 1.2, 1.6 and 2.0. Every number is
exact except "without_replacement", a Rao-Blackwellised Monte-Carlo estimate (its standard error is
printed), because its exact value needs an enumeration over V^(K-1) rejection sequences. The LP
of "canonical_lp" is exact over its top-s block; the block size and the number of ranked tokens
are those the tree verifier uses (--top-s, --ranked) plus one row with every token ranked.
"""

import argparse
import time

import torch

from multispec.verify.canonical import DEFAULT_RANKED, DEFAULT_TOP_S, acceptance_canonical
from multispec.verify.optimal import optimal_acceptance
from multispec.verify.recursive import acceptance_specinfer, estimate_acceptance_without_replacement
from multispec.verify.spectr import acceptance_spectr


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the analysis command."""
    parser.add_argument("--max-drafts", type=int, default=8, help="largest K in the tables")
    parser.add_argument("--random-cases", type=int, default=40, help="random (p, q) pairs in table (a)")
    parser.add_argument("--random-vocab", type=int, default=200, help="vocabulary of the random pairs")
    parser.add_argument("--questions", type=int, default=3, help="GSM8K questions for table (b); 0 skips the model")
    parser.add_argument("--positions", type=int, default=32, help="sampled tokens (positions) per question")
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[1.2, 1.6, 2.0])
    parser.add_argument("--top-s", type=int, default=DEFAULT_TOP_S, help="LP block size of the canonical schemes")
    parser.add_argument("--ranked", type=int, default=DEFAULT_RANKED, help="tokens ranked per tournament round")
    parser.add_argument("--paths", type=int, default=16, help="Monte-Carlo chains per position for without_replacement")
    parser.add_argument("--seed", type=int, default=0)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option out of range."""
    least = {"max_drafts": 1, "random_cases": 1, "random_vocab": 2, "questions": 0, "positions": 1, "top_s": 1,
             "ranked": 1, "paths": 1}
    for name, low in least.items():
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= {low}")
    bad = [t for t in args.draft_temperatures if not t > 0]
    if bad:
        raise ValueError(f"--draft-temperatures {bad[0]}: must be > 0")


def run(args: argparse.Namespace) -> int:
    """Print the tables (markdown) and return 0."""
    check_arguments(args)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    p, q = random_pairs(args.random_cases, args.random_vocab, args.seed)
    print(f"## (a) random pairs: V = {args.random_vocab}, {args.random_cases} cases, p = softmax(2 z), q = softmax(2 z + e), z, e ~ N(0, 1)\n")
    print_table(acceptance_table(p, q, args))
    if args.questions > 0:
        p = model_distributions(args.questions, args.positions, args.seed)
        logits = p.log()
        for temperature in args.draft_temperatures:
            q = (logits / temperature).softmax(-1)
            print(f"\n## (b) SmolLM2-135M-Instruct on GSM8K: {p.shape[0]} positions, target T = 1.0, draft T = {temperature}\n")
            print_table(acceptance_table(p, q, args))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


def random_pairs(cases: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets with a language-model-like spread and drafts that are close but imperfect."""
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(cases, vocab, generator=g, dtype=torch.float64)
    return z.softmax(-1), (z + torch.randn(cases, vocab, generator=g, dtype=torch.float64)).softmax(-1)


def acceptance_table(p: torch.Tensor, q: torch.Tensor, args) -> dict[str, list[str]]:
    """Mean acceptance over rows for K = 1..max_drafts, formatted, per scheme."""
    k = args.max_drafts
    fmt = lambda curve: [f"{float(v):.3f}" for v in curve]
    table = {
        "optimal": fmt(optimal_acceptance(p, q, k).mean(0)),
        "canonical_lp": fmt(acceptance_canonical(p, q, k, "lp", args.top_s, args.ranked).mean(0)),
        "canonical_lp, all ranked": fmt(acceptance_canonical(p, q, k, "lp", args.top_s, None).mean(0)),
        "canonical_wis": fmt(acceptance_canonical(p, q, k, "wis", args.top_s, args.ranked).mean(0)),
        "spectr": fmt(acceptance_spectr(p, q, k).mean(0)),
    }
    g = torch.Generator().manual_seed(args.seed)
    estimates = [estimate_acceptance_without_replacement(p[i], q[i], k, args.paths, g) for i in range(p.shape[0])]
    mean = torch.stack([m for m, _ in estimates]).mean(0)
    stderr = torch.stack([s for _, s in estimates]).pow(2).sum(0).sqrt() / p.shape[0]
    table["without_replacement (MC)"] = [f"{float(m):.3f}±{float(s):.3f}" for m, s in zip(mean, stderr)]
    table["specinfer"] = fmt(acceptance_specinfer(p, q, k).mean(0))
    return table


def print_table(table: dict[str, list[str]]) -> None:
    """One row per scheme, one column per K."""
    k = len(next(iter(table.values())))
    print("| scheme | " + " | ".join(f"K={i}" for i in range(1, k + 1)) + " |")
    print("|---|" + "---:|" * k)
    for name, values in table.items():
        print(f"| {name} | " + " | ".join(values) + " |")


def model_distributions(questions: int, positions: int, seed: int) -> torch.Tensor:
    """p [questions * positions, V] (float64): the model's T = 1 distributions along its own samples.

    The engine samples one completion per GSM8K question (chat template, T = 1); one forward of
    prompt + completion then gives the distribution at every generated position.
    """
    from multispec.api import LLM
    from multispec.params import SamplingParams
    from multispec.reasoning import load_gsm8k

    llm = LLM()
    conversations = [[{"role": "user", "content": p.question}] for p in load_gsm8k(limit=questions)]
    outputs = llm.chat(conversations, SamplingParams(n=1, temperature=1.0, max_tokens=positions, ignore_eos=True,
                                                     seed=seed), use_tqdm=False)
    rows = []
    for out in outputs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        logits = llm.logits(ids)
        rows.append(logits[len(out.prompt_token_ids) - 1: len(ids) - 1])
    return torch.cat(rows).double().softmax(-1)
