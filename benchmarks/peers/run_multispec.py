"""benchmarks/peers runner for multispec (run with the project's .venv python; run.py starts it).

``--drafter none`` is plain decoding, ``--drafter consensus`` the default speculation: a
``SpecConfig`` with only the drafter set, as ``multispec gsm8k --drafter consensus`` builds it
(default draft budget, adaptive). The conversations go through ``LLM.chat``, which applies the
checkpoint's chat template; generated tokens are those of the returned samples (end token
included), which the run's own counter must agree with.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from _common import load_workload, log, parse_args, report, timed_calls

NAME = "multispec"


def version() -> str:
    """The commit, with "+changes" when multispec/ differs from it in the working tree."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "multispec"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return commit + ("+changes" if dirty else "")


def main() -> None:
    args = parse_args(__doc__, lambda p: (p.add_argument("--dtype", default="bfloat16"),
                                          p.add_argument("--drafter", default="none")))
    workload = load_workload(args.workload)
    from multispec import LLM, SamplingParams, SpecConfig

    llm = LLM(dtype=args.dtype)
    spec = SpecConfig(drafter=args.drafter)
    log(NAME, f"{llm.model_name} on {llm.device}, {str(llm.dtype).removeprefix('torch.')}, drafter {args.drafter}")

    def call(seed: int) -> tuple[int, dict]:
        llm.reset_prefix_cache()  # every call prefills its prompts, as vLLM's runner has it
        params = SamplingParams(n=args.n, temperature=workload["temperature"], top_p=workload["top_p"],
                                max_tokens=args.max_tokens, seed=seed)
        outputs = llm.chat(workload["conversations"], params, spec=spec, use_tqdm=False)
        stats = llm.last_stats
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        if tokens != stats.generated_tokens:
            raise RuntimeError(f"samples hold {tokens} tokens, the run counted {stats.generated_tokens}")
        details = {"engine_tokens_per_second": stats.tokens_per_second}
        if spec.speculates:
            details.update(tau=stats.tau, acceptance=stats.acceptance_rate, drafted_tokens=stats.drafted_tokens)
        return tokens, details

    timings = timed_calls(NAME, call, args.runs)
    notes = ""
    if spec.speculates:
        last = timings[-1]
        notes = f"tau {last['tau']:.2f}, {last['acceptance']:.1%} of {last['drafted_tokens']} drafted tokens accepted"
    report(engine=NAME, version=version(), dtype=str(llm.dtype).removeprefix("torch."), timings=timings, notes=notes)


if __name__ == "__main__":
    main()
