"""Plain decode steps with the compiled CPU kernels against the portable path, in one process.

One GSM8K question, n = B samples (T 0.7), ``--warm`` steps into the answers, then steps that
rotate between three ways of running the same step:
- ``stack``: the whole layer stack in one compiled call (``decode_layers``, which runs the
  compiled attention inside), the engine's default on a CPU;
- ``attention``: the layers one by one from Python, with the compiled attention;
- ``portable``: no compiled kernel (the fused attention kernel per half and a log-sum-exp merge).
Prints the median step of each and the ratios for every B.

    python experiments/compiled_kernels.py --samples 4,16,64,128 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from multispec import LLM, SamplingParams, kernels
from multispec.reasoning import load_gsm8k

VARIANTS = ("stack", "attention", "portable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="4,16,64,128")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each variant per batch size")
    parser.add_argument("--warm", type=int, default=100, help="steps before timing (the context grows)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    if kernels.decode_layers() is None:
        raise SystemExit("the compiled kernels are not built here (see the warning above)")
    llm = LLM(dtype=args.dtype)
    engine, tokenizer, model = llm.engine, llm.tokenizer, llm.engine.model
    prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
    print(f"{llm.dtype}, prompt {len(prompt)} tokens")
    for batch in (int(x) for x in args.samples.split(",")):
        request = f"ab-{batch}"
        engine.add_request(request, prompt, SamplingParams(n=batch, temperature=0.7, max_tokens=args.warm + 3 * args.steps
                                                           + 8, ignore_eos=True, seed=0))
        for _ in range(args.warm):
            engine.step()
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.steps):
            for name in VARIANTS:
                os.environ["MULTISPEC_KERNELS"] = "0" if name == "portable" else "1"
                model.compiled_layers = name == "stack"
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        os.environ.pop("MULTISPEC_KERNELS")
        model.compiled_layers = True
        engine.abort(request)
        stack, attention, portable = (1e3 * statistics.median(times[k]) for k in VARIANTS)
        print(f"{batch:4d} samples: stack {stack:6.1f} ms, attention {attention:6.1f} ms, portable {portable:6.1f} ms; "
              f"attention / stack {attention / stack:.2f}, portable / stack {portable / stack:.2f}", flush=True)


if __name__ == "__main__":
    main()
