"""A decode step's matrix products streaming each weight once (on AMX tiles, or AVX512-BF16 vectors
where the CPU has no tiles; float32 on AVX2 vectors where it has no AVX-512), against oneDNN.

Times all products of a 30-layer stack shaped like the default model (fused q/k/v 960 x 576, o
576 x 576, fused gate/up 3072 x 576, down 576 x 1536, then the 49,152 x 576 output head; 256 MiB
of bf16 weights, 512 MiB in float32, far larger than any cache) at 1 to 128 rows: oneDNN's linear on weights
prepacked for it (the engine's product before) and ``multispec.stream_linear`` on weights laid out
for the tiles. Interleaved, median of several passes. Also prints the machine's read bandwidth
(one ``sum`` over 1 GiB), the floor of any product that reads its weights once, and the layer
stack's streaming products twice: as a step runs them (every weight read from memory, "cold") and
with the first layer's four weights thirty times over ("hot", in cache: the arithmetic alone). A
cold time near hot + the weights' read time means the product waits for memory instead of
overlapping the read with its arithmetic (``PREFETCH`` in ``stream_gemm.cpp``). The streamed
layouts sit on 2 MiB pages where the system grants them, as the engine's do. Each product is
called from Python, which adds a few microseconds a call: a step calls them from C++, so whole
steps (``step_builds.py``, ``benchmarks/profile_step.py``) are the measure of a change to them.

    python experiments/stream_gemm.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import sys
from pathlib import Path

import torch

from multispec import kernels
from multispec.models.llama import PACK_ROWS
from multispec.models.pages import huge_page_arena

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,8,16,20,32,48,64,96,128")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--steps", action="store_true", help="time engine steps, streaming product on and off")
    parser.add_argument("--cells", default="4, one at a time;16, one at a time;8x4")
    parser.add_argument("--lengths", default="0,1,2,4")
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    if args.steps:
        return steps(args)
    torch.manual_seed(0)
    if not kernels.stream_available():
        raise SystemExit("this CPU has neither AMX tiles, AVX512-BF16 nor AVX2 (or the kernels are off)")
    print("streaming on", {2: "AMX tiles", 1: "AVX512-BF16 vectors", 3: "AVX2 vectors (float32)"}[kernels.stream_kind()])
    ops = torch.ops.multispec
    dtype = kernels.stream_dtype()
    weights = [torch.randn(n, k, dtype=dtype) * 0.05 for _ in range(30) for n, k in SHAPES]
    weights.append(torch.randn(49152, 576, dtype=dtype) * 0.05)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
    stream = [ops.stream_pack(w) for w in weights]
    arena = huge_page_arena(stream)  # where the engine keeps them (on 4 KiB pages: 1.2-1.3x the time)
    if arena is not None:
        stream = [arena.copy(t) for t in stream]
    big = torch.ones(1 << 29, dtype=torch.bfloat16)
    read = statistics.median(timed(lambda: big.sum()) for _ in range(5))
    del big
    total = sum(w.numel() * w.element_size() for w in weights)
    print(f"read bandwidth {2 ** 30 / read / 1e9:.1f} GB/s: weights {total / 2 ** 20:.0f} MiB read once "
          f"= {total / (2 ** 30 / read) * 1e3:.1f} ms")

    # Correctness against a float32 reference on each shape.
    for w, s in zip(weights[:4] + weights[-1:], stream[:4] + stream[-1:]):
        x = torch.randn(37, w.shape[1], dtype=dtype)
        ref = x.float() @ w.float().T
        got = ops.stream_linear(x, s, None).float()
        err = ((got - ref).abs() / (ref.abs() + 1e-2)).max().item()
        assert err < 2e-2, (w.shape, err)

    print("| rows | oneDNN ms | stream ms | ratio | layers cold ms | layers hot ms |")
    print("|---|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
        a_runs, b_runs = [], []

        def run_onednn():
            for w, p in zip(weights, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def run_stream():
            for w, p in zip(weights, stream):
                ops.stream_linear(xs[w.shape[1]], p, None)

        def run_layers(layers):
            for w, p in zip(weights[:-1], layers):
                ops.stream_linear(xs[w.shape[1]], p, None)

        hot_layers = stream[:4] * 30
        cold_runs, hot_runs = [], []
        run_onednn(), run_stream()
        for _ in range(args.passes):
            a_runs.append(timed(run_onednn))
            b_runs.append(timed(run_stream))
            cold_runs.append(timed(lambda: run_layers(stream[:-1])))
            hot_runs.append(timed(lambda: run_layers(hot_layers)))
        a, b = statistics.median(a_runs) * 1e3, statistics.median(b_runs) * 1e3
        cold, hot = statistics.median(cold_runs) * 1e3, statistics.median(hot_runs) * 1e3
        print(f"| {rows} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {cold:.1f} | {hot:.1f} |", flush=True)


def steps(args) -> None:
    from bench_ceiling import step_costs

    cells = [c.strip() for c in args.cells.split(";") if c.strip()]
    lengths = [int(x) for x in args.lengths.split(",")]
    times: dict[tuple[str, str, int], list[float]] = {}
    for repeat in range(args.passes):
        variants = [("oneDNN", "0"), ("stream", "1")]
        for name, flag in variants if repeat % 2 == 0 else variants[::-1]:
            os.environ["MULTISPEC_STREAM"] = flag  # read at every product
            costs = step_costs(cells, lengths, 1, args.context, 4, "cpu")
            for (cell, length), seconds in costs.items():
                times.setdefault((name, cell, length), []).extend(seconds)
    os.environ.pop("MULTISPEC_STREAM")
    print("| cell | L | oneDNN ms | stream ms | ratio |")
    print("|---|---|---|---|---|")
    for cell in cells:
        for length in lengths:
            a = statistics.median(times[("oneDNN", cell, length)]) * 1e3
            b = statistics.median(times[("stream", cell, length)]) * 1e3
            print(f"| {cell} | {length} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
