"""What a sliding window costs a decode step once sequences pass it: Gemma-3-1B's shape (random
weights, see ``architecture_shape.py``) with its windows of 512 positions against the same
checkpoint with the windows widened past every sequence, the two alternating in one process.

Both run the compiled layer stack; past the window the windowed layers' attention reads only the
window's keys, without one every key. (When this was first measured, windowed layers past their
window ran the portable attention with a mask per row, layer by layer. The two compute different
models past 512 positions; what is compared is the step's price.) tokens/s =
generated tokens / wall seconds of the call; medians of ``--runs`` calls.

    .venv/bin/python experiments/window_cost.py --prompt-tokens 600 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from architecture_shape import write_checkpoint  # this folder, first on the path when run as a script
from multispec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        windowed, whole = Path(tmp) / "windowed", Path(tmp) / "whole"
        windowed.mkdir()
        whole.mkdir()
        vocab_size = write_checkpoint(windowed, "gemma3")
        for file in windowed.iterdir():  # the same weights and tokenizer, a window wider than any sequence
            if file.name != "config.json":
                (whole / file.name).symlink_to(file)
        config = json.loads((windowed / "config.json").read_text())
        (whole / "config.json").write_text(json.dumps({**config, "sliding_window": 1 << 20}))
        gen = torch.Generator().manual_seed(1)
        prompts = [{"prompt_token_ids": torch.randint(0, vocab_size, (args.prompt_tokens,), generator=gen).tolist()}
                   for _ in range(args.prompts)]
        params = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
        engines = {f"window {config['sliding_window']}": LLM(str(windowed), dtype="bfloat16",
                                                            enable_prefix_caching=False),
                   "no window": LLM(str(whole), dtype="bfloat16", enable_prefix_caching=False)}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for llm in engines.values():  # warm-up
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.runs):
            for name, llm in engines.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
                rates[name].append(tokens / (time.perf_counter() - start))
        print(f"Gemma-3-1B shape, random weights, bf16, {args.prompts} x {args.n} samples, {args.prompt_tokens}-token "
              f"prompts, {args.max_tokens} tokens each, {torch.get_num_threads()} threads")
        for name, values in rates.items():
            print(f"  {name:11s} {statistics.median(values):7.1f} tok/s  ({', '.join(f'{v:.1f}' for v in values)})")
        first, second = rates.values()
        ratios = [a / b for a, b in zip(first, second)]
        each = ", ".join(f"{r:.3f}" for r in ratios)
        print(f"  windowed / no window: {statistics.median(ratios):.3f}x (per-run {each})")


if __name__ == "__main__":
    main()
