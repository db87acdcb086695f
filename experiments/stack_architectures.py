"""Plain decode steps of Gemma 3 and OLMo 2 shapes with the compiled layer stack against the layers
one by one from Python (the compiled attention in both), alternating in one process.

The compiled stack (``multispec/kernels/decode_layers.cpp``) runs Gemma's norms (by 1 + weight,
around each block), GELU gates and Gemma 3's second rotation, and OLMo 2's norms; before it did,
these models' decode steps ran layer by layer. This times what that saves on the shapes of
Gemma-3-270M (18 layers, hidden 640) and Gemma-3-1B (26 layers, hidden 1152), both with 4 query
heads of 256 over one KV head and a 262,144-token tied head, and OLMo-2-0425-1B (16 layers, hidden
2048, 16 heads of 128, a 100,352-token head), transformers' random initialisation, bf16: one
request of ``--samples`` samples after a 100-token prompt (within Gemma 3's 512-position windows),
``--warm`` steps into the answers, then ``--steps`` rounds of one step each way. The checkpoints
are ``experiments/architecture_shape.py``'s.

    python experiments/stack_architectures.py --shape gemma3-270m,gemma3,olmo2 --samples 4,16 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from architecture_shape import SHAPES, write_checkpoint  # noqa: E402  (the same checkpoints of each shape)

from multispec import LLM, SamplingParams, kernels  # noqa: E402

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma3-270m,gemma3,olmo2",
                        help="shapes of experiments/architecture_shape.py, comma-separated")
    parser.add_argument("--samples", default="4,16")
    parser.add_argument("--steps", type=int, default=40, help="timed rounds (one step each way)")
    parser.add_argument("--warm", type=int, default=30, help="steps before timing")
    args = parser.parse_args()
    if kernels.decode_layers() is None:
        raise SystemExit("the compiled kernels are not built here")
    for shape in args.shape.split(","):
        with tempfile.TemporaryDirectory() as directory:
            write_checkpoint(Path(directory), shape)
            llm = LLM(directory, dtype="bfloat16", kv_cache_memory=2.0)
            engine, model = llm.engine, llm.engine.model
            for batch in (int(b) for b in args.samples.split(",")):
                engine.add_request(f"r{batch}", list(range(1000, 1100)), SamplingParams(
                    n=batch, temperature=0.7, max_tokens=args.warm + 2 * args.steps + 8, ignore_eos=True, seed=0))
                for _ in range(args.warm):
                    engine.step()
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.steps):
                    for stack in (True, False):
                        model.compiled_layers = stack
                        start = time.perf_counter()
                        engine.step()
                        times[stack].append(time.perf_counter() - start)
                model.compiled_layers = True
                engine.abort(f"r{batch}")
                stacked, layered = (1e3 * statistics.median(times[k]) for k in (True, False))
                print(f"{SHAPES[shape][0]} shape, {batch:3d} samples: stack {stacked:6.1f} ms a step, layer by layer "
                      f"{layered:6.1f} ms; layer by layer / stack {layered / stacked:.3f}", flush=True)
            del llm, engine, model


if __name__ == "__main__":
    main()
