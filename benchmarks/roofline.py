"""A decode step's floor on this machine, against what the engine's step actually costs.

Part 1 measures the machine with the model's own tensors:
- memory bandwidth: reading a 1 GiB tensor (``sum``), median of several reads;
- the GEMM rate per row count: each of the model's matrix products (fused q/k/v, o, fused
  gate/up, down, output head) timed at M rows in the model's dtype (weights hot in cache: the
  best rate the library reaches at that shape).

The floor of a step with B samples each carrying L draft tokens (M = B x (1 + L) rows) is the
larger of two lower bounds: every weight (in the form the step reads it: a float32 weight's
integer blocks where it has them and the rows are within their limit) and every key and value
the step attends to read once from memory at the measured bandwidth, and the step's matrix
products at the measured GEMM rate for M rows. Everything else a step does (attention arithmetic,
norms, rotary embedding, sampling, verification, bookkeeping, dispatch) is what the measured step
has above its floor. A last-level cache that holds much of the model (the reference Xeon's 480 MiB,
shared with the host) lets a step read part of its weights faster than memory while the host is
quiet: such a step can run under its memory floor, and the table says so under it.

Part 2 times the engine's steps at those shapes (one request of B samples, ``--context`` tokens
into the answer, every sample drafting an L-token chain of filler; ``bench_ceiling.py``'s cost
side) and prints measured / floor. Machines that drift (shared cores) move both parts: each of
the ``--repeats`` passes measures the machine and then times the steps, and a shape's step /
floor is the median over passes of the ratio within a pass. The floor's ratio (1 + L) x
floor(B, 0) / floor(B, L) is the ceiling of speculation at that shape with perfect drafts on
ideal code; the same ratio of measured steps is the ceiling for this engine as it is.

    python benchmarks/roofline.py                         # 4, 16, 64, 128 samples x L 0, 1, 2, 4 (about 7 minutes)
    python benchmarks/roofline.py --samples 16 --lengths 0,1 --dtype float32
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from multispec.models.llama import Projection, affine_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _median_seconds(fn, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second of reading a tensor far larger than any cache."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return data.numel() * 4 / _median_seconds(data.sum, repeats)


def model_products(model) -> tuple[list[Projection], int]:
    """Each matrix product of one (fused, as loaded) decoder layer, and the layer count."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv, attn.o, mlp.gate_up, mlp.down], len(model.model.layers)


def head_product(model) -> Projection:
    """The output head's product, as the model runs it (packed where its layers are)."""
    return model.head or Projection(model.output_weight(), None, pack=False)


def gemm_seconds(model, rows: int, repeats: int = 9) -> tuple[float, float]:
    """(seconds, FLOPs) of all matrix products of one forward of ``rows`` tokens, each run by the
    kernel the engine runs it with (prepacked weights where the model has them)."""
    per_layer, layers = model_products(model)
    dtype, device = model.output_weight().dtype, model.output_weight().device
    seconds = flops = 0.0
    for product, count in [(p, layers) for p in per_layer] + [(head_product(model), 1)]:
        out_features, in_features = product.shape
        x = torch.randn(rows, in_features, dtype=dtype, device=device)
        inner = max(1, 2000 // rows)
        seconds += count * _median_seconds(lambda: product(x), repeats, inner)
        flops += count * 2 * rows * out_features * in_features
    return seconds, flops


def weight_bytes(model, rows: int = 0) -> int:
    """Bytes of weights a forward of ``rows`` tokens reads: each product's integer blocks where it
    reads them at that many rows (float32 weights that are blocks of small integers, see
    ``Projection.affine``), else the weight in the model's dtype."""
    per_layer, layers = model_products(model)
    element = model.output_weight().element_size()

    def size(product: Projection, count: int) -> int:
        if rows and getattr(product, "affine", None) is not None and rows <= affine_rows():
            return count * product.affine.numel()
        return count * element * math.prod(product.shape)

    return sum(size(p, layers) for p in per_layer) + size(head_product(model), 1)


def kv_bytes(config, element: int, samples: int, prompt: int, own: int) -> int:
    """Keys and values a step reads: the prompt's once for all samples, each sample's own."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * element * config.num_hidden_layers
    return per_token * (prompt + samples * own)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="4,16,64,128", help="samples in flight (one request of n samples)")
    parser.add_argument("--lengths", default="0,1,2,4", help="draft tokens per sample (0 = plain, always run)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="'auto' (the model's dtype) or 'bfloat16'")
    parser.add_argument("--context", type=int, default=128, help="tokens each sample has generated when timed")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per draft length")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes, each measuring the machine, then timing every shape and length once")
    args = parser.parse_args()
    samples = [int(x) for x in args.samples.split(",")]
    lengths = sorted({0, *(int(x) for x in args.lengths.split(","))})

    from bench_ceiling import step_costs
    from multispec import LLM
    from multispec.reasoning import load_gsm8k

    torch.manual_seed(0)
    llm = LLM(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    model, config = llm.model, llm.model.config
    element = llm.engine.cache.k_store.element_size()  # the KV cache's, which the floor reads
    tokenizer = llm.tokenizer
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()),
                                  add_special_tokens=False))

    shapes = {str(b): (1, b) for b in samples}
    all_rows = sorted({b * (1 + L) for b in samples for L in lengths})
    weights = weight_bytes(model)
    weights_at = {rows: weight_bytes(model, rows) for rows in all_rows}
    from bench_spec import CoreWait

    waiting = CoreWait()
    passes = []  # per pass: (bandwidth, {rows: (seconds, flops)}, {(cell, L): step seconds})
    for run in range(args.repeats):
        with torch.inference_mode():
            bandwidth = read_bandwidth()
            gemm = {rows: gemm_seconds(model, rows) for rows in all_rows}
        print(f"pass {run + 1}/{args.repeats}: read bandwidth {bandwidth / 1e9:.1f} GB/s, GEMM "
              f"{', '.join(f'{rows} rows {g[1] / g[0] / 1e12:.2f}' for rows, g in gemm.items())} TFLOP/s; "
              "timing engine steps...", file=sys.stderr, flush=True)
        costs = step_costs(list(shapes), lengths, 1, args.context, args.steps, "auto", args.dtype, shapes)
        passes.append((bandwidth, gemm, {key: value[0] for key, value in costs.items()}))

    bandwidth = statistics.median(p[0] for p in passes)
    print(f"{llm.dtype}, {torch.get_num_threads()} threads: read bandwidth {bandwidth / 1e9:.1f} GB/s (median of "
          f"{len(passes)} passes: {', '.join(f'{p[0] / 1e9:.1f}' for p in passes)}); weights "
          f"{weights / 2**20:.0f} MiB (read once per step: {1e3 * weights / bandwidth:.1f} ms"
          + (f"; as integer blocks up to {affine_rows()} rows: {min(weights_at.values()) / 2**20:.0f} MiB"
             if min(weights_at.values()) < weights else "") + f"); prompt {prompt} "
          f"tokens, {args.context} generated\n")
    print("| rows | GEMM ms (all products) | GEMM TFLOP/s |")
    print("|---|---|---|")
    for rows in all_rows:
        seconds = statistics.median(p[1][rows][0] for p in passes)
        print(f"| {rows} | {1e3 * seconds:.1f} | {passes[0][1][rows][1] / seconds / 1e12:.2f} |")

    def floor(machine, b: int, L: int) -> tuple[float, str]:
        rate, gemm = machine
        memory = (weights_at[b * (1 + L)] + kv_bytes(config, element, b, prompt, args.context + L + 1)) / rate
        compute = gemm[b * (1 + L)][0]
        return (memory, "memory") if memory >= compute else (compute, "GEMM")

    print("\n| samples | L | rows | floor ms (bound) | step ms | step / floor | perfect drafts: floor | "
          "perfect drafts: engine |")
    print("|---|---|---|---|---|---|---|---|")
    beaten = []  # shapes whose step ran under their floor
    for b in samples:
        for L in lengths:
            floors = [floor((p[0], p[1]), b, L) for p in passes]
            plain_floors = [floor((p[0], p[1]), b, 0)[0] for p in passes]
            steps = [p[2][(str(b), L)] for p in passes]
            plains = [p[2][(str(b), 0)] for p in passes]
            value = statistics.median(f[0] for f in floors)
            bound = statistics.mode(f[1] for f in floors)
            step = statistics.median(steps)
            over = statistics.median(s / f[0] for s, f in zip(steps, floors))
            floor_gain = statistics.median((1 + L) * pf / f[0] for pf, f in zip(plain_floors, floors))
            engine_gain = statistics.median((1 + L) * p / s for p, s in zip(plains, steps))
            print(f"| {b} | {L} | {b * (1 + L)} | {1e3 * value:.1f} ({bound}) | {1e3 * step:.1f} | "
                  f"{over:.2f} | {floor_gain:.2f}x | {engine_gain:.2f}x |")
            if over < 1 and bound == "memory":
                beaten.append(f"{b} x L {L}")
    if beaten:
        print(f"\nUnder the floor ({', '.join(beaten)}): those steps read faster than the "
              f"{bandwidth / 1e9:.1f} GB/s measured on a 1 GiB tensor, so part of what they read came from a cache "
              "(a last-level cache that holds much of the model while the host is quiet). The floor reads every "
              "weight from memory.")
    print(waiting.report())


if __name__ == "__main__":
    main()
