"""Where a decode step's time goes: torch profiler over plain decode steps at a given batch size.

B samples in flight (one GSM8K question in the chat template, n = B, T 0.7), plain steps until
every sample has ``--context`` tokens, then ``--steps`` steps profiled. Prints the operators by
self CPU time and the share of the step spent in matrix products (mm/bmm/addmm/linear kernels,
the streaming products of a few rows) against everything else. The compiled layer stack
(``multispec::decode_layers``) runs each part of a layer under a profiler scope
(``multispec::layers.qkv_product``, ``.attention``, ``.norm``, ...): they are listed with the
operators, summed per step in a table of their own, and its products count as products, the
gate/up product fused with its activation (``gate_up_silu``) among them (``MULTISPEC_KERNELS=0``
shows the portable path's operators instead).

    python benchmarks/profile_step.py --samples 16
    python benchmarks/profile_step.py --samples 128 --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch

MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise",
          "multispec::stream_linear"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=25, help="operators listed")
    args = parser.parse_args()

    from multispec import LLM, SamplingParams
    from multispec.reasoning import load_gsm8k

    llm = LLM(dtype=args.dtype)
    engine, tokenizer = llm.engine, llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
    engine.add_request("profile", prompt, SamplingParams(n=args.samples, temperature=0.7, max_tokens=args.context +
                                                         args.steps + 2, ignore_eos=True, seed=0))
    for _ in range(args.context):
        engine.step()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = (time.perf_counter() - start) / args.steps
    engine.abort("profile")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    # The fused gate/up product with its activation (``gate_up_silu``, on AMX tiles) counts as a product.
    matmul = sum(e.self_cpu_time_total for e in events
                 if e.key in MATMUL or e.key.endswith("_product") or e.key.endswith("gate_up_silu"))
    print(f"{args.samples} samples, {args.context} tokens in, {llm.dtype}: {1e3 * wall:.1f} ms a step "
          f"(profiled); matrix products {matmul / total:.0%} of operator time\n")
    parts = sorted((e for e in events if e.key.startswith("multispec::layers.")), key=lambda e: -e.cpu_time_total)
    if parts:
        print("| part of the compiled layer stack | ms a step (all layers) | share of the step |")
        print("|---|---|---|")
        for e in parts:
            step_ms = e.cpu_time_total / 1e3 / args.steps
            print(f"| {e.key.split('.', 1)[1]} | {step_ms:.2f} | {step_ms / (1e3 * wall):.0%} |")
        print()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
