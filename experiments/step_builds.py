"""Whole decode steps of a git revision against the working tree, in alternating processes.

A change that reaches past one kernel (several kernels at once, the layer stack, the step's
Python) is timed on the step itself. The revision is checked out into a temporary git worktree;
each round runs one process on it and one on the working tree, in turn (the order reversed every
other round), and each process times ``--steps`` plain steps of one request of B samples (one
GSM8K question in the chat template, T 0.7) after ``--context`` steps into the answers. The
revision's package is imported from its worktree (this checkout's editable install set aside in
that process), and its kernels compile into their own cache entry (keyed by their sources).
Between processes a 2-core machine drifts by a few percent, so the figure to read is the median
of the per-round ratios, with the rounds' spread.

    python experiments/step_builds.py --base HEAD~1 --samples 4,16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TIMER = r'''
import statistics, sys, time
root, samples, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if root:
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path.insert(0, root)
from multispec import LLM, SamplingParams
from multispec.reasoning import load_gsm8k
llm = LLM(dtype="auto")
engine, tokenizer = llm.engine, llm.tokenizer
prompt = tokenizer.encode(tokenizer.apply_chat_template(load_gsm8k(limit=1)[0].chat()), add_special_tokens=False)
engine.add_request("timed", prompt, SamplingParams(n=samples, temperature=0.7, max_tokens=context + steps + 2,
                                                   ignore_eos=True, seed=0))
for _ in range(context):
    engine.step()
times = []
for _ in range(steps):
    start = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - start)
print(statistics.median(times) * 1e3)
'''


def step_ms(root: str, samples: int, context: int, steps: int) -> float:
    done = subprocess.run([sys.executable, "-c", TIMER, root, str(samples), str(context), str(steps)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the {'revision' if root else 'working tree'}'s step timer failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--samples", default="4,16", help="samples in flight, comma-separated")
    parser.add_argument("--context", type=int, default=100, help="plain steps before the timed ones")
    parser.add_argument("--steps", type=int, default=120, help="timed steps per process (their median)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        added = subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.base], cwd=ROOT,
                               capture_output=True, text=True)
        if added.returncode != 0:
            sys.exit(f"cannot check out {args.base}: {added.stderr.strip()}")
        try:
            for samples in (int(s) for s in args.samples.split(",")):
                ratios = []
                for r in range(args.rounds):
                    order = [("base", str(worktree)), ("tree", "")]
                    if r % 2:
                        order.reverse()
                    ms = {name: step_ms(root, samples, args.context, args.steps) for name, root in order}
                    ratios.append(ms["tree"] / ms["base"])
                    print(f"  {samples} samples, round {r + 1}: base {ms['base']:.2f} ms, tree {ms['tree']:.2f} ms, "
                          f"tree / base {ratios[-1]:.3f}", flush=True)
                print(f"{samples} samples: tree / base {statistics.median(ratios):.3f} (median of {args.rounds}; "
                      f"{min(ratios):.3f}-{max(ratios):.3f})", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False,
                           capture_output=True)


if __name__ == "__main__":
    main()
