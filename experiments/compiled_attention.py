"""Plain decode steps with the compiled CPU attention against the portable path, in one process.

One GSM8K question, n = B samples (T 0.7), ``--warm`` steps into the answers, then steps that
alternate between the compiled kernel and the portable path (fused attention kernel per half and
a log-sum-exp merge); prints the median step of each and their ratio for every B.

    python experiments/compiled_attention.py --samples 4,16,64,128 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

from multispec import LLM, SamplingParams, kernels
from multispec.reasoning import load_gsm8k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="4,16,64,128")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each path per batch size")
    parser.add_argument("--warm", type=int, default=100, help="steps before timing (the context grows)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    op = kernels.decode_attention()
    if op is None:
        raise SystemExit("the compiled kernel is not built here (see the warning above)")
    llm = LLM(dtype=args.dtype)
    engine, tokenizer = llm.engine, llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
    print(f"{llm.dtype}, prompt {len(prompt)} tokens")
    for batch in (int(x) for x in args.samples.split(",")):
        request = f"ab-{batch}"
        engine.add_request(request, prompt, SamplingParams(n=batch, temperature=0.7, max_tokens=args.warm + 2 * args.steps
                                                           + 8, ignore_eos=True, seed=0))
        for _ in range(args.warm):
            engine.step()
        times: dict[str, list[float]] = {"compiled": [], "portable": []}
        for _ in range(args.steps):
            for name in times:
                kernels._state["op"] = op if name == "compiled" else None
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        kernels._state["op"] = op
        engine.abort(request)
        compiled, portable = (statistics.median(times[k]) for k in ("compiled", "portable"))
        print(f"{batch:4d} samples: compiled {1e3 * compiled:6.1f} ms, portable {1e3 * portable:6.1f} ms, "
              f"portable / compiled {portable / compiled:.2f}", flush=True)


if __name__ == "__main__":
    main()
