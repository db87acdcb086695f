"""The gate/up product fused with its activation against the product and then the activation.

On AMX tiles the layer stack runs a layer's gate/up product and its activation as one operator
(``multispec::stream_gate_up``: each gate panel with its up panel, activated while in cache).
Timed here against the two steps it replaces (``stream_linear``, then the stack's ``silu_mul``)
alternating in one process, over 30 gate/up weights of the default model's shape (3072 x 576 bf16,
106 MiB, far more than the cores' own caches; a large shared L3 may keep them between rounds),
with the outputs compared bit for bit.

    python experiments/fused_gate_up.py --rows 1,4,16,32,48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from multispec import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,48")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if kernels.decode_layers() is None or kernels.stream_kind() != 2:
        sys.exit("the fused gate/up product runs on AMX tiles only")
    ops = torch.ops.multispec
    gen = torch.Generator().manual_seed(0)
    packs = [ops.stream_pack((torch.randn(3072, 576, generator=gen) * 0.05).bfloat16()) for _ in range(30)]
    paths = {"fused": lambda x: [ops.stream_gate_up(x, p, None) for p in packs],
             "product, then activation": lambda x: [ops.silu_mul(ops.stream_linear(x, p, None)) for p in packs]}
    print("| rows | fused ms | product, then activation ms | ratio | bit for bit |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        times = {name: [] for name in paths}
        outs = {}
        for _ in range(args.rounds):
            for name, run in paths.items():
                start = time.perf_counter()
                outs[name] = run(x)
                times[name].append(time.perf_counter() - start)
        fused, unfused = (statistics.median(times[name]) * 1e3 for name in paths)
        same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
        print(f"| {rows} | {fused:.2f} | {unfused:.2f} | {unfused / fused:.3f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
