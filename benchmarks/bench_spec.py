"""Speculative multi-sample decoding on GSM8K: tau and wall-clock speedup per drafter.

Default model, GSM8K test questions in the chat template, max_tokens 256. Every ratio compares
runs of one process on the same questions and seeds (drafter "none" is the same engine without
drafts). Rows per cell:

- none, consensus, consensus-first-match (aggregation off), ngram (prompt lookup): drafts of up to
  ``--depth`` tokens every step (``adaptive=False``), so tau measures the drafter itself;
- consensus-auto: the default, draft length chosen per step from measured cost and acceptance;
- consensus-1 (only with ``--rows``): every sample drafts its one likeliest token every step, the
  simplest fixed policy, to hold the budget's choices against.

The cells above batch all questions of a cell into one call (32 to 256 samples in flight), as
an offline evaluation does. Two more cells send the questions one after another, one request in
flight at a time (4 and 16 samples), as a client waiting on each answer does: there a forward is
overhead-bound on a CPU, the regime where speculation turns tau into speed.

The headline cell (n = 16, temperature 0.7) is the median of 3 runs for the wall-clock comparison
(none and consensus-auto); its other rows and the other cells run once (tau barely moves between
runs). Fixed 4-token drafts run at about half the speed of plain decoding at the batched sizes on
a CPU, so the n = 64 cell and the temperature 1.0 cell keep to the rows they are there for.

The last line says how long the run's threads waited for a core (``CoreWait``; this benchmark,
``bench_draft_model.py`` and ``roofline.py``): above 10% of the time they ran, other work kept the
machine busy and the timings are the machine's, not the engine's.

    python benchmarks/bench_spec.py           # the full table and plot (about 75 minutes here)
    python benchmarks/bench_spec.py --quick   # a few-minute subset
    python benchmarks/bench_spec.py --cells 0 --append   # rerun one cell into the saved table
    python benchmarks/bench_spec.py --rows consensus-auto --append   # rerun the default's rows (and none)
    python benchmarks/bench_spec.py --cells 1,4,5 --rows consensus-auto --depth 6 --nodes 6 --runs 3
                                              # the default SpecConfig against plain, median of 3
    python benchmarks/bench_spec.py --cells 1 --rows consensus,ngram --depth 6 --nodes 12 \\
        --out results/tree.json --plot results/tree.png
                                              # drafts as trees of 12 nodes, 6 deep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALL = ("none", "consensus", "consensus-first-match", "ngram", "consensus-auto")
MEDIAN = ("none", "consensus-auto")
"""Rows of the headline cell's further runs: the wall-clock comparison (tau barely moves between runs)."""
SMALL = ("none", "consensus", "ngram", "consensus-auto")
ROWS = ALL + ("consensus-1",)
FULL_CELLS = [  # (questions, n, temperature, rows of the first run, rows of each further run, one at a time)
    (8, 4, 0.7, ALL, [], False),
    (8, 16, 0.7, ALL, [MEDIAN, MEDIAN], False),
    (4, 64, 0.7, ("none", "consensus", "consensus-auto"), [], False),
    (8, 16, 1.0, SMALL, [], False),
    (4, 4, 0.7, SMALL, [], True),
    (2, 16, 0.7, SMALL, [], True),
]
QUICK_CELLS = [(2, 4, 0.7, ALL, [], False), (2, 16, 0.7, ALL, [], False),
               (1, 4, 0.7, SMALL, [], True)]


def configs(depth: int, labels, nodes: int | None = None):
    from multispec import SpecConfig

    nodes = nodes or depth
    fixed = dict(max_draft_tokens=depth, max_draft_nodes=nodes, adaptive=False)
    specs = {"none": SpecConfig(drafter="none"),
             "consensus": SpecConfig(drafter="consensus", **fixed),
             "consensus-first-match": SpecConfig(drafter="consensus", aggregate=False, **fixed),
             "ngram": SpecConfig(drafter="ngram", **fixed),
             "consensus-auto": SpecConfig(drafter="consensus", max_draft_tokens=depth, max_draft_nodes=nodes),
             "consensus-1": SpecConfig(drafter="consensus", max_draft_tokens=1, max_draft_nodes=1, adaptive=False)}
    return [(label, specs[label]) for label in labels]


def chat_stats(llm, conversations, params, spec, one_at_a_time: bool):
    """RunStats of one chat call over all conversations, or summed over one call per conversation
    (a single prompt in flight at a time, as a client sending one request after another)."""
    from multispec.params import RunStats

    if not one_at_a_time:
        llm.chat(conversations, params, spec, use_tqdm=False)
        return llm.last_stats
    total = RunStats()
    for conversation in conversations:
        llm.chat([conversation], params, spec, use_tqdm=False)
        for f in dataclasses.fields(RunStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(llm.last_stats, f.name))
    return total


class CoreWait:
    """How long this process's threads waited for a core while a benchmark ran (Linux's scheduler
    statistics, ``multispec.engine.costs.core_wait``): timings taken while other work kept the
    machine busy are the machine's, not the engine's, and the line ``report`` prints says so."""

    def __init__(self):
        from multispec.engine.costs import core_wait

        self.before = core_wait()

    def report(self) -> str:
        from multispec.engine.costs import BUSY, core_wait, waited_share

        share = waited_share(self.before, core_wait())
        if share is None:
            return "waiting for a core: not known on this system"
        line = f"this run's threads waited for a core {100 * share:.1f}% of the time they ran"
        if share > BUSY:
            line += " (other work kept the machine busy: these timings are not the engine's; rerun when nothing else runs)"
        return line


def warm_up(llm, conversation, n: int, temperature: float, specs) -> None:
    """One short untimed call per row before any timed one: the first generation of a process pays
    for lazy initialisation (on a GPU, kernel loading and the allocator's first blocks: the first
    timed row of a cell ran at 0.8x the same row's later runs there), which would bias whichever
    row comes first."""
    from multispec import SamplingParams

    params = SamplingParams(n=n, temperature=temperature, max_tokens=16, seed=0)
    for spec in specs:
        llm.chat([conversation], params, spec, use_tqdm=False)


def run_cell(llm, questions: int, n: int, temperature: float, schedule, max_tokens: int, depth: int,
             one_at_a_time: bool = False, nodes: int | None = None):
    from multispec import SamplingParams
    from multispec.reasoning import load_gsm8k

    conversations = [p.chat() for p in load_gsm8k(limit=questions)]
    warm_up(llm, conversations[0], n, temperature, [spec for _, spec in configs(depth, schedule[0], nodes)])
    results = {}
    for run, labels in enumerate(schedule):
        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=run)
        rows = configs(depth, labels, nodes)
        for label, spec in rows if run % 2 == 0 else rows[::-1]:  # reversed every other run: drift favours no row
            s = chat_stats(llm, conversations, params, spec, one_at_a_time)
            step_time = s.time_draft + s.time_forward + s.time_verify + s.time_commit
            results.setdefault(label, []).append({
                "tok_s": s.tokens_per_second, "tau": s.tau, "acceptance": s.acceptance_rate,
                "forwards": s.decode_forwards, "tokens": s.generated_tokens,
                "draft_share": s.time_draft / step_time if step_time else 0.0,
                "forward_tokens_per_step": s.forward_tokens / max(s.decode_forwards, 1)})
            where = f"q={questions}{' (1 at a time)' if one_at_a_time else ''} n={n} T={temperature} run {run}"
            print(f"  {where} {label:<22} {s.tokens_per_second:7.1f} tok/s tau {s.tau:.2f}", file=sys.stderr)
    summary = {}
    for label, rows in results.items():
        summary[label] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        summary[label]["runs"] = len(rows)
        # Speedup per run against that run's own plain decoding, then the median.
        summary[label]["speedup"] = statistics.median(
            r["tok_s"] / base["tok_s"] for r, base in zip(rows, results["none"]))
        summary[label]["speedups"] = [r["tok_s"] / base["tok_s"] for r, base in zip(rows, results["none"])]
        summary[label]["tok_s_runs"] = [r["tok_s"] for r in rows]
        summary[label]["tau_runs"] = [r["tau"] for r in rows]
    return summary


def cell_name(cell: dict) -> str:
    return f"{cell['questions']} x {cell['n']}" + (", one at a time" if cell.get("one_at_a_time") else "")


def plot(table: list[dict], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batched = [c for c in table if c["temperature"] == 0.7 and not c.get("one_at_a_time")]
    single = [c for c in table if c["temperature"] == 0.7 and c.get("one_at_a_time")]
    labels = list(dict.fromkeys(label for c in batched + single for label in c["rows"] if label != "none"))
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.5))
    for color, label in enumerate(labels):
        for cells, style, suffix in ((batched, "-", ""), (single, ":", ", one prompt at a time")):
            cells = [c for c in cells if label in c["rows"]]
            if not cells:
                continue
            ns = [c["n"] for c in cells]
            for ax, key in ((ax_tau, "tau"), (ax_speed, "speedup")):
                ax.plot(ns, [c["rows"][label][key] for c in cells], style, marker="o", color=f"C{color}",
                        label=label + suffix)
    for ax, title in ((ax_tau, "tau (tokens per forward per sample)"), (ax_speed, "wall-clock speedup over plain")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("samples per question (n)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, GSM8K, temperature 0.7, {subtitle} (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4, help="draft tokens per sample per step")
    parser.add_argument("--nodes", type=int, help="draft-tree nodes per sample per step (default: --depth, a chain)")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_spec.json"))
    parser.add_argument("--plot", help="PNG path (default docs/spec_speedup.png, or docs/spec_speedup_quick.png; a run "
                        "of some --cells or --rows without --append draws only where this names)")
    parser.add_argument("--from-json", help="only redraw the table and plot from a saved result file")
    parser.add_argument("--cells", help="comma-separated indexes of the cells to run (default: all)")
    parser.add_argument("--append", action="store_true",
                        help="merge the cells run into those already in --out instead of replacing the file: "
                             "the rows rerun replace their old values, the others stay")
    parser.add_argument("--runs", type=int, help="run every selected cell's first-run rows this many times (seeds 0, 1, "
                                                 "...) and report medians, instead of the cell's own schedule")
    parser.add_argument("--rows", help="comma-separated rows to run in each cell (none is always run too)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registered name, checkpoint directory or .gguf")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    parser.add_argument("--dtype", default="auto", help="'auto', 'float32', 'bfloat16' or 'float16'")
    args = parser.parse_args()
    cells = QUICK_CELLS if args.quick else FULL_CELLS
    max_tokens = 128 if args.quick and args.max_tokens == 256 else args.max_tokens
    waiting = CoreWait()
    if args.from_json:
        table = json.loads(Path(args.from_json).read_text())
    else:
        from multispec import LLM

        requested = None if args.rows is None else ["none"] + [r for r in args.rows.split(",") if r != "none"]
        unknown = [] if requested is None else [r for r in requested if r not in ROWS]
        if unknown:
            sys.exit(f"unknown rows {', '.join(unknown)}; rows are {', '.join(ROWS)}")
        try:
            llm = LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=False)
        except ValueError as error:
            sys.exit(f"bench_spec: {error}")
        print(f"model {args.model} on {llm.device}, {llm.dtype}", file=sys.stderr)
        table = json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists() else []
        if args.cells:
            cells = [cells[int(i)] for i in args.cells.split(",")]
        for questions, n, temperature, first, further, one_at_a_time in cells:
            schedule = [first] + further
            if requested is not None:  # the first run runs every row asked for, further runs keep theirs
                schedule = [requested] + [[label for label in labels if label in requested] for labels in further]
                schedule = [labels for labels in schedule if len(labels) > 1]
            if args.runs:
                schedule = [schedule[0]] * args.runs
            rows = run_cell(llm, questions, n, temperature, schedule, max_tokens, args.depth, one_at_a_time,
                            args.nodes)
            key = (questions, n, temperature, one_at_a_time)
            old = next((c for c in table if (c["questions"], c["n"], c["temperature"],
                                             c.get("one_at_a_time", False)) == key), None)
            if old is None:
                table.append({"questions": questions, "n": n, "temperature": temperature,
                              "one_at_a_time": one_at_a_time, "rows": rows})
            else:  # speedups stay same-run ratios: a rerun row comes with its own none
                old["rows"].update(rows)
            # Saved after every cell, so a run cut short keeps what it finished (--from-json redraws it).
            table.sort(key=lambda c: (c.get("one_at_a_time", False), c["temperature"], c["n"]))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(table, indent=1))
    default_plot = "spec_speedup_quick.png" if args.quick else "spec_speedup.png"
    subtitle = f"{'quick subset, ' if args.quick else ''}max_tokens {max_tokens}"
    # The documented plot is the whole table's: a run of some cells or rows draws only where asked.
    partial = (args.cells or args.rows) and not (args.append or args.from_json)
    if args.plot or not partial:
        plot(table, Path(args.plot or ROOT / "docs" / default_plot), subtitle)
    print(f"max_tokens {max_tokens}, draft depth {args.depth}, nodes {args.nodes or args.depth}; "
          "speedup = tokens/s over drafter none in the same run\n")
    print("| questions x n | T | drafter | runs | tau | acceptance | tok/s | speedup | draft share of step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in table:
        for label, r in cell["rows"].items():
            print(f"| {cell_name(cell)} | {cell['temperature']} | {label} | {r['runs']} | "
                  f"{r['tau']:.2f} | {r['acceptance']:.1%} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['draft_share']:.1%} |")
    for cell in table:
        rows = cell["rows"]
        if "ngram" in rows and "consensus" in rows:
            print(f"{cell_name(cell)}, T {cell['temperature']}: consensus tau / ngram tau "
                  f"{rows['consensus']['tau_runs'][0] / rows['ngram']['tau_runs'][0]:.2f}x (same run)")
    if not args.from_json:
        print(waiting.report())


if __name__ == "__main__":
    main()
