"""Forward time of one decode step per draft shape, with the attention in one part or split in two.

``DecodeAttention`` either pads every sample's query rows to the deepest draft (one part) or runs
the root rows and the drafting samples' draft rows as two parts (no padding for samples without
a draft, but a second pass of every attention operation per layer and a gather of the drafting
samples' caches). ``split_step`` picks one from the step's shape; this script measures both on
the default model so the rule can be checked on any machine. Every shape runs through both
layouts in turn, repeated, and the median is reported.

    python experiments/layout.py                       # 16 samples, 250 cached tokens each
    python experiments/layout.py --batch 64 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def shapes(batch: int) -> dict[str, list[int]]:
    """Tokens per sample (1 = root only) for a few typical steps."""
    half, quarter = batch // 2, batch // 4
    return {
        "plain": [1] * batch,
        "all draft 1": [2] * batch,
        "half draft 1": [2] * half + [1] * (batch - half),
        "all but one draft 1": [2] * (batch - 1) + [1],
        "one drafts 1": [2] + [1] * (batch - 1),
        "one drafts 4": [5] + [1] * (batch - 1),
        "quarter draft 2": [3] * quarter + [1] * (batch - quarter),
        "half draft 3": [4] * half + [1] * (batch - half),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="samples in the step")
    parser.add_argument("--context", type=int, default=250, help="tokens already cached per sample")
    parser.add_argument("--prompt", type=int, default=120, help="prompt tokens (one prompt shared by all)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registered name, checkpoint directory or .gguf")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    args = parser.parse_args()

    from multispec import LLM
    from multispec.engine.attention import DecodeAttention, StepLayout, split_step
    from multispec.engine.cache import CacheShape, KVCache

    llm = LLM(args.model, device=args.device)
    model, dtype, device = llm.engine.model, llm.engine.dtype, llm.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    batch = args.batch
    shape = CacheShape(batch, args.context + 8, 1, args.prompt)
    cache = KVCache(model.config, shape.tokens(), dtype, device)
    cache.layout(shape)
    for tensor in (cache.sample_k, cache.sample_v, cache.prompt_k, cache.prompt_v):
        tensor.normal_()
    generator = torch.Generator().manual_seed(0)

    def forward(counts: list[int], split: bool) -> float:
        qmax = max(counts)
        tree_mask = torch.zeros(batch, qmax, qmax, dtype=torch.bool)
        positions = []
        for b, count in enumerate(counts):
            for i in range(count):  # each draft a chain
                tree_mask[b, i, : i + 1] = True
                positions.append(args.prompt + args.context + i)
        layout = StepLayout(torch.tensor(counts), torch.full((batch,), args.context),
                            torch.zeros(batch, dtype=torch.long), torch.full((batch,), args.prompt), tree_mask)
        ids = torch.randint(0, model.config.vocab_size, (sum(counts),), generator=generator).to(device)
        with torch.inference_mode():
            sync()
            start = time.perf_counter()
            model(ids, torch.tensor(positions, device=device), DecodeAttention(cache, layout, split))
            sync()
            return time.perf_counter() - start

    table = shapes(batch)
    for counts in table.values():  # warm-up: first-call allocations and kernel selection
        forward(counts, False)
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for name, counts in table.items():
            for split in (False, True):
                times.setdefault((name, split), []).append(forward(counts, split))
    print(f"{device}: {batch} samples, {args.context} cached tokens each, {args.prompt}-token prompt; "
          f"median of {args.repeats} forwards, ms")
    print(f"{'shape':<22}{'tokens':>7}{'one part':>10}{'two parts':>11}  rule picks")
    for name, counts in table.items():
        one, two = (1e3 * statistics.median(times[(name, split)]) for split in (False, True))
        drafting = sum(1 for c in counts if c > 1)
        picked = "two parts" if split_step(batch, max(counts), drafting, sum(counts)) else "one part"
        same = " (same layout: none or all draft)" if drafting in (0, batch) else ""
        print(f"{name:<22}{sum(counts):>7}{one:>10.1f}{two:>11.1f}  {picked}{same}")


if __name__ == "__main__":
    main()
