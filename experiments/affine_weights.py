"""Float32 products reading a GGUF model's weights as their integer blocks, against the float32 stream.

Where the default dtype is float32 (a CPU with AVX2 but no AVX-512), products of up to
``AFFINE_ROWS`` rows read the model's weights as the quantised blocks they were dequantised from
(``Projection.affine``; bit for bit the same weights, a third of the bytes). This times both
layouts on the default model, switching ``MULTISPEC_AFFINE`` within one process:

- all of the model's products (30 layers and the output head, weights from memory, in the order a
  step runs them) at each row count, layouts alternating, median of ``--repeats``;
- plain decode steps of one request of B samples (``--context`` tokens into the answer), the
  layouts alternating every 10 steps, medians (the step reads the blocks only up to the limit, so
  larger B should read 1.00).

    python experiments/affine_weights.py
    python experiments/affine_weights.py --rows 1,4,8,12,16 --samples 1,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,6,8,12,16,32")
    parser.add_argument("--samples", default="1,4,8,12")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="step rounds (each: 10 steps per layout)")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams
    from multispec.models.llama import affine_rows
    from multispec.reasoning import load_gsm8k

    llm = LLM(dtype="auto")
    model = llm.engine.model
    products = [p for layer in model.model.layers
                for p in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down)] + [model.head]
    if llm.dtype != torch.float32 or any(p is None or p.affine is None for p in products) or not affine_rows():
        raise SystemExit("this needs float32 products with integer blocks (a CPU with AVX2 but no AVX-512, the "
                         "compiled kernels, and a model whose weights are such blocks)")
    blocks = sum(p.affine.numel() for p in products)
    stream = sum(4 * p.stream.numel() for p in products)
    print(f"weights: float32 stream {stream / 2**20:.0f} MiB, integer blocks {blocks / 2**20:.0f} MiB; blocks used "
          f"up to {affine_rows()} rows\n")

    rows_list = [int(r) for r in args.rows.split(",")]
    inputs = {r: [torch.randn(r, p.shape[1]) for p in products] for r in rows_list}
    times = {(r, v): [] for r in rows_list for v in "01"}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for r in rows_list:
                for v in "01":
                    os.environ["MULTISPEC_AFFINE"] = v
                    start = time.perf_counter()
                    for product, x in zip(products, inputs[r]):
                        torch.ops.multispec.stream_linear(x, product.affine if v == "1" else product.stream,
                                                          product.bias)
                    times[r, v].append(time.perf_counter() - start)
    print("| rows | float32 stream ms | integer blocks ms | ratio |")
    print("|---|---|---|---|")
    for r in rows_list:
        a, b = statistics.median(times[r, "0"]), statistics.median(times[r, "1"])
        print(f"| {r} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.2f} |")

    engine, tokenizer = llm.engine, llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
    print("\n| samples | float32 stream ms a step | integer blocks | ratio |")
    print("|---|---|---|---|")
    for b in (int(s) for s in args.samples.split(",")):
        engine.add_request("steps", prompt, SamplingParams(n=b, temperature=0.7, ignore_eos=True, seed=0,
                                                           max_tokens=args.context + 20 * args.rounds + 2))
        os.environ["MULTISPEC_AFFINE"] = "1"
        for _ in range(args.context):
            engine.step()
        steps = {"0": [], "1": []}
        for r in range(args.rounds):
            for v in ("0", "1") if r % 2 == 0 else ("1", "0"):
                os.environ["MULTISPEC_AFFINE"] = v
                for _ in range(10):
                    start = time.perf_counter()
                    engine.step()
                    steps[v].append(time.perf_counter() - start)
        engine.abort("steps")
        a, c = statistics.median(steps["0"]), statistics.median(steps["1"])
        print(f"| {b} | {1e3 * a:.1f} | {1e3 * c:.1f} | {c / a:.2f} |")
    os.environ.pop("MULTISPEC_AFFINE", None)


if __name__ == "__main__":
    main()
