"""Decode steps that the compiled attention now runs itself, against the path they took before it
did (the attention module of ``--before``, read from git), alternating step by step in one
process on one engine.

Past Gemma 3's sliding windows (five of every six layers windowed to 512 positions): before, such
steps ran layer by layer, the windowed layers through the portable attention with a mask per row;
now the compiled stack runs them, windows in its attention. Gemma 2's soft-capped scores: before,
every step ran layer by layer through the unfused reference attention; now the compiled stack.
The shapes are ``architecture_shape.py``'s checkpoints (random weights, bf16): one request of
``--samples`` samples after a ``--prompt-tokens`` prompt, ``--warm`` steps into the answers, then
``--steps`` rounds of one step each way; medians of the rounds.

    python experiments/attention_steps.py --shape gemma3-270m,gemma3 --samples 4,16 --steps 30
    python experiments/attention_steps.py --shape gemma2 --samples 4,16 --steps 30 --prompt-tokens 100
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from architecture_shape import SHAPES, write_checkpoint  # noqa: E402  (the same checkpoints of each shape)

import multispec.engine.engine as engine_module  # noqa: E402
from multispec import LLM, SamplingParams, kernels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def before_attention(revision: str):
    """``DecodeAttention`` as ``multispec/engine/attention.py`` defined it at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:multispec/engine/attention.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as directory:  # (read once: the file is not needed after)
        path = Path(directory) / "attention_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("attention_before", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.DecodeAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma3-270m,gemma3", help="shapes of architecture_shape.py")
    parser.add_argument("--samples", default="4,16")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (one step each way)")
    parser.add_argument("--warm", type=int, default=10, help="steps before timing")
    parser.add_argument("--before", default="3cadb75", help="the revision whose attention module is 'before' "
                        "(3cadb75: neither windows nor caps in the compiled attention)")
    args = parser.parse_args()
    if kernels.decode_layers() is None:
        raise SystemExit("the compiled kernels are not built here")
    paths = {"after": engine_module.DecodeAttention, "before": before_attention(args.before)}
    for shape in args.shape.split(","):
        with tempfile.TemporaryDirectory() as directory:
            write_checkpoint(Path(directory), shape)
            llm = LLM(directory, dtype="bfloat16", kv_cache_memory=2.0, enable_prefix_caching=False)
            engine = llm.engine
            for batch in (int(b) for b in args.samples.split(",")):
                prompt = [1000 + i % 5000 for i in range(args.prompt_tokens)]
                engine.add_request(f"r{batch}", prompt, SamplingParams(
                    n=batch, temperature=0.7, max_tokens=args.warm + 2 * args.steps + 8, ignore_eos=True, seed=0))
                for _ in range(args.warm):
                    engine.step()
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.steps):
                    for name, attention in paths.items():
                        engine_module.DecodeAttention = attention
                        start = time.perf_counter()
                        engine.step()
                        times[name].append(time.perf_counter() - start)
                engine_module.DecodeAttention = paths["after"]
                engine.abort(f"r{batch}")
                after, before = (1e3 * statistics.median(times[k]) for k in ("after", "before"))
                print(f"{SHAPES[shape][0]} shape, {args.prompt_tokens}-token prompt, {batch:3d} samples: "
                      f"after {after:6.1f} ms a step, before {before:6.1f} ms; before / after {before / after:.3f}",
                      flush=True)
            del llm, engine


if __name__ == "__main__":
    main()
