"""Tokens/s of plain multi-sample generation: multispec against transformers, same weights, same run.

Default model, GSM8K test questions in the chat template, temperature 0.7, max_tokens 256, at
n = 1, 4, 16. All questions go into one call on both sides (transformers: left-padded batch with
``num_return_sequences=n``). Each (system, n) runs in its own process so its peak resident memory
is its own; the figure is the median of ``--runs`` runs. Generated tokens count up to and
including the first end-of-sequence token, never padding.

    python benchmarks/bench_generate.py            # full table (about 20-30 minutes here)
    python benchmarks/bench_generate.py --quick    # n = 1, 4, fewer tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def conversations(questions: int) -> list[list[dict]]:
    from multispec.reasoning import load_gsm8k

    return [p.chat() for p in load_gsm8k(limit=questions)]


def run_multispec(n: int, questions: int, max_tokens: int, runs: int) -> list[float]:
    from multispec import LLM, SamplingParams

    llm = LLM(dtype="float32", enable_prefix_caching=False)  # float32: the weights transformers runs
    rates = []
    for run in range(runs):
        llm.chat(conversations(questions), SamplingParams(n=n, temperature=0.7, max_tokens=max_tokens, seed=run),
                 use_tqdm=False)
        rates.append(llm.last_stats.tokens_per_second)
    return rates


def run_transformers(n: int, questions: int, max_tokens: int, runs: int) -> list[float]:
    import torch
    import transformers

    from multispec.models import load_checkpoint, resolve_model

    directory = load_checkpoint(resolve_model("smollm2-135m-instruct")).path  # the converted HF directory
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
               for c in conversations(questions)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    rates = []
    for run in range(runs):
        torch.manual_seed(run)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=max_tokens,
                                 num_return_sequences=n, pad_token_id=tokenizer.pad_token_id or 0)
        elapsed = time.perf_counter() - start
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        tokens = 0
        for row in new:
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            tokens += len(row) if stop is None else stop + 1
        rates.append(tokens / elapsed)
    return rates


def child(args) -> None:
    runner = run_multispec if args.system == "multispec" else run_transformers
    rates = runner(args.n, args.questions, args.max_tokens, args.runs)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"system": args.system, "n": args.n, "rates": rates, "peak_mib": peak_mib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="n = 1, 4; 64 tokens; 1 run")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_generate.json"))
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        child(args)
        return
    if args.quick:
        args.ns, args.max_tokens, args.runs = [1, 4], 64, 1
    results = []
    for n in args.ns:
        for system in ("multispec", "transformers"):
            cmd = [sys.executable, __file__, "--system", system, "--n", str(n), "--questions", str(args.questions),
                   "--max-tokens", str(args.max_tokens), "--runs", str(args.runs)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"n={n:<3} {system:<12} tok/s runs {[round(r, 1) for r in result['rates']]} "
                  f"peak {result['peak_mib']:.0f} MiB", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{args.questions} GSM8K questions, chat template, temperature 0.7, max_tokens {args.max_tokens}, "
          f"median of {args.runs} run(s)\n")
    print("| n | multispec tok/s | transformers tok/s | ratio | multispec peak RSS | transformers peak RSS |")
    print("|---|---|---|---|---|---|")
    for n in args.ns:
        ours = next(r for r in results if r["n"] == n and r["system"] == "multispec")
        theirs = next(r for r in results if r["n"] == n and r["system"] == "transformers")
        a, b = statistics.median(ours["rates"]), statistics.median(theirs["rates"])
        print(f"| {n} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {ours['peak_mib']:.0f} MiB | {theirs['peak_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
