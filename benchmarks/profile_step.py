"""Where a decode step's time goes: torch profiler over plain decode steps at a given batch size.

B samples in flight (one GSM8K question in the chat template, n = B, T 0.7), plain steps until
every sample has ``--context`` tokens, then ``--steps`` steps profiled. Prints the operators by
self CPU time and the share of the step spent in matrix products (mm/bmm/addmm/linear kernels,
and the products of a few rows on AMX tiles) against everything else. Products that the compiled
layer stack (``multispec::decode_layers``) makes are calls from C++ the profiler does not see: they
count in that operator's own time, and the share printed is then that of the output head alone
(``MULTISPEC_KERNELS=0`` shows every product, on the slower portable path).

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
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL)
    print(f"{args.samples} samples, {args.context} tokens in, {llm.dtype}: {1e3 * wall:.1f} ms a step "
          f"(profiled); matrix products {matmul / total:.0%} of operator time, outside the compiled layer "
          "stack\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
