"""The streamed weights on 2 MiB pages against ordinary 4 KiB pages (``multispec.models.pages``).

Two engines on the default model in one process, one built with ``MULTISPEC_HUGE_PAGES=0`` (its
streamed layouts stay where packing put them, on 4 KiB pages) and one without (moved onto 2 MiB
pages where the system grants them), timed alternately so that the machine's drift hits both
alike:

- products (``--rows``): each of the four layer products of R rows, all 30 layers in a row, then
  the four of every layer in the step's order, weights from memory; median of ``--repeats``;
- decode steps (``--samples``): one GSM8K question with n samples (T 0.7, no end of text),
  ``--context`` tokens generated first, then ``--rounds`` rounds of ten steps on each engine;
  median step time each (``kv_cache_dtype.alternating_steps``).

    python benchmarks/huge_pages.py --rows 16 --samples 1,4,16,64
    python benchmarks/huge_pages.py --rows 4,16 --samples 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache_dtype import alternating_steps  # noqa: E402 - the alternating step timer is shared

NAMES = ("4 KiB pages", "2 MiB pages")


def huge_page_bytes() -> int:
    """Anonymous memory of this process on transparent huge pages."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def product_seconds(engines: dict, rows: int, repeats: int) -> dict:
    """{(engine, product): seconds of the 30 layers' products}, the engines alternating each repeat."""
    parts = {"q/k/v": lambda layer: layer.self_attn.qkv, "o": lambda layer: layer.self_attn.o,
             "gate/up": lambda layer: layer.mlp.gate_up, "down": lambda layer: layer.mlp.down}
    times: dict = {}
    for r in range(repeats):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            layers = engines[name].engine.model.model.layers
            x, wide = torch.randn(rows, layers[0].mlp.gate_up.shape[1]), torch.randn(rows, layers[0].mlp.down.shape[1])
            for part, get in parts.items():
                start = time.perf_counter()
                for layer in layers:
                    get(layer)(wide if part == "down" else x)
                times.setdefault((name, part), []).append(time.perf_counter() - start)
            start = time.perf_counter()
            for layer in layers:
                layer.self_attn.qkv(x), layer.self_attn.o(x), layer.mlp.gate_up(x), layer.mlp.down(wide)
            times.setdefault((name, "all four, in the step's order"), []).append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16", help="row counts of the products; 0: none")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--samples", default="1,4,16,64", help="samples in flight per step shape; 0: none")
    parser.add_argument("--context", type=int, default=128, help="tokens generated before timing steps")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()

    from multispec import LLM
    from multispec.models import pages
    from multispec.reasoning import load_gsm8k

    if not pages.huge_pages_available():
        sys.exit("transparent huge pages are not available here (not Linux, or switched off): nothing to compare")
    engines = {}
    for name, setting in zip(NAMES, ("0", "1")):
        os.environ["MULTISPEC_HUGE_PAGES"] = setting
        before = huge_page_bytes()
        engines[name] = LLM(enable_prefix_caching=False)
        print(f"{name}: {(huge_page_bytes() - before) / 2**20:.0f} MiB of the process on huge pages after loading")
    os.environ.pop("MULTISPEC_HUGE_PAGES")
    print(f"weights {str(engines[NAMES[0]].dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads")
    for rows in (int(r) for r in args.rows.split(",") if int(r) > 0):
        times = product_seconds(engines, rows, args.repeats)
        for part in dict.fromkeys(p for _, p in times):
            a, b = (statistics.median(times[(name, part)]) for name in NAMES)
            print(f"{rows} rows, {part} (30 layers): {1e3 * a:.2f} ms on 4 KiB pages, {1e3 * b:.2f} on 2 MiB "
                  f"({b / a:.3f}x)", flush=True)
    question = load_gsm8k(limit=1)[0].chat()
    for n in (int(s) for s in args.samples.split(",") if int(s) > 0):
        times = alternating_steps(engines, question, n, args.context, args.rounds)
        a, b = (statistics.median(times[name]) for name in NAMES)
        print(f"{n} samples, {args.context}+ tokens generated: {1e3 * a:.2f} ms a step on 4 KiB pages, "
              f"{1e3 * b:.2f} on 2 MiB ({b / a:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
