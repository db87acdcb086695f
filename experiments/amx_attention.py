"""The decode attention on AMX tiles against the vector path, alternating in one process.

``MULTISPEC_AMX=0`` sends the compiled attention down its vector path (read at every call), so
both paths run on the same data in one process, interleaved:

- ``--kernel``: the attention operator alone, 30 layers (separate caches, as in the model) of
  B samples in groups of 16 per prompt, L draft tokens each in a chain, a prompt of P keys and
  ``own`` keys of each sample's own text; shapes as ``B.own.L.P``;
- ``--steps``: decode steps through the engine (``benchmarks/bench_ceiling.py``'s step timer, one
  GSM8K question per 16 samples, 128 tokens into the answers) at 0, 1, 2 and 4 draft tokens, with
  the perfect-draft ceiling (1 + L) * step(0) / step(L) of each path.

    python experiments/amx_attention.py --kernel 4.128.0.127,16.128.0.127,128.128.0.127,16.128.4.127
    python experiments/amx_attention.py --steps 4,16,64,128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

PATHS = {"tiles": "1", "vectors": "0"}


def kernel(shapes: list[str], repeats: int) -> None:
    from multispec import kernels

    op = kernels.decode_attention()
    if op is None:
        sys.exit("the compiled kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    dt, kv_heads, heads, dim, layers = torch.bfloat16, 3, 9, 64, 30
    for shape in shapes:
        batch, own, drafts, plen = map(int, shape.split("."))
        tokens, prompts = batch * (1 + drafts), max(1, -(-batch // 16))
        q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dt) for h in (heads, kv_heads, kv_heads))
        own_k, own_v = (torch.randn(layers, batch, kv_heads, own + 1 + drafts, dim, generator=gen).to(dt) for _ in "kv")
        prompt_k, prompt_v = (torch.randn(layers, prompts, kv_heads, plen, dim, generator=gen).to(dt) for _ in "kv")
        slots, counts = torch.arange(batch), torch.full((batch,), 1 + drafts)
        offsets, written = slots * (1 + drafts), torch.full((batch,), own)
        prompt_slot, prompt_len = slots // 16, torch.full((batch,), plen)
        mask = torch.tril(torch.ones(1 + drafts, 1 + drafts, dtype=torch.bool)).expand(batch, -1, -1).contiguous()
        times: dict[str, list[float]] = {name: [] for name in PATHS}
        outs = {}
        for _ in range(repeats):
            for name, flag in PATHS.items():
                os.environ["MULTISPEC_AMX"] = flag
                start = time.perf_counter()
                for layer in range(layers):
                    outs[name] = op(q, k, v, own_k[layer], own_v[layer], prompt_k[layer], prompt_v[layer], slots,
                                    offsets, counts, written, prompt_slot, prompt_len, mask, dim ** -0.5)
                times[name].append(time.perf_counter() - start)
        tiles, vectors = (statistics.median(times[name]) for name in PATHS)
        diff = (outs["tiles"].float() - outs["vectors"].float()).abs().max().item()
        print(f"B={batch} own={own} L={drafts} P={plen}: tiles {1e3 * tiles:.1f} ms, vectors {1e3 * vectors:.1f} ms "
              f"(30 layers), vectors / tiles {vectors / tiles:.2f}, largest difference {diff:.1e}", flush=True)


def steps(cells: list[str], repeats: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_ceiling import step_costs

    shapes = {cell: (max(1, int(cell) // 16), min(16, int(cell))) for cell in cells}
    lengths = [0, 1, 2, 4]
    runs: dict[str, list[dict]] = {name: [] for name in PATHS}
    for _ in range(repeats):
        for name, flag in PATHS.items():
            os.environ["MULTISPEC_AMX"] = flag
            runs[name].append(step_costs(cells, lengths, 1, 128, 6, "auto", "auto", shapes))
    for cell in cells:
        for name in PATHS:
            step = {n: statistics.median(run[(cell, n)][0] for run in runs[name]) for n in lengths}
            times = ", ".join(f"L{n} {1e3 * step[n]:.1f} ms" for n in lengths)
            ceiling = ", ".join(f"{(1 + n) * step[0] / step[n]:.2f}x" for n in lengths[1:])
            print(f"B={cell} {name}: {times}; perfect-draft ceiling L1/L2/L4 {ceiling}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", help="operator shapes B.own.L.P, comma-separated")
    parser.add_argument("--steps", help="samples in flight, comma-separated (16 per question)")
    parser.add_argument("--repeats", type=int, default=9, help="alternations (--steps: 2 is plenty)")
    args = parser.parse_args()
    if args.kernel:
        kernel(args.kernel.split(","), args.repeats)
    if args.steps:
        steps(args.steps.split(","), args.repeats)


if __name__ == "__main__":
    main()
