"""EleutherAI's lm-evaluation-harness against ``multispec serve``, next to the harness's own
transformers backend on the same checkpoint; prints a markdown table.

The harness talks to the server as it talks to vLLM's (``--model local-completions``): it reads
``/tokenizer_info`` and tokenizes through ``/tokenize`` (no tokenizer download), generates through
``/v1/completions``, and scores texts with ``echo`` and ``logprobs`` (``max_tokens`` 1, the
prompt's log-probabilities read back). Its transformers backend (``--model hf``) loads the
Hugging Face directory the project converts the default GGUF into. Three tasks on the vendored
GSM8K test set (``--limit`` questions each), each in both backends:

    gsm8k         the harness's own gsm8k task (5-shot, greedy, until "Question:"), the data read
                  from the vendored files instead of the hub
    gsm8k_choice  multiple choice (loglikelihood): the question and its reference reasoning, then
                  which of four numbers follows "#### " (the answer, or one of three near misses)
    gsm8k_ppl     perplexity (loglikelihood_rolling) of each question with its reference answer

Besides each task's metrics, the table compares the two backends document by document (``--log_samples``):
the largest difference of a scored log-likelihood, and the share of identical generations. In
float32 (``--dtype float32``, both backends) the log-likelihoods agree to rounding; in bfloat16
(the server's default on CPUs with bf16) they differ by bf16's rounding and a greedy generation
can part from float32's at a near tie (README, "Lossless").

    bash benchmarks/harness/setup.sh                              # the harness's environment (once)
    .venv/bin/python benchmarks/harness/run.py                    # 3 tasks x 2 backends, --limit 20
    .venv/bin/python benchmarks/harness/run.py --dtype float32 --limit 50
    .venv/bin/python benchmarks/harness/run.py --tasks gsm8k_choice --backends multispec

Offline: the tasks read local files, and ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` are set for the
harness.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENV_PYTHON = HERE / "env" / "bin" / "python"
TASKS = ("gsm8k", "gsm8k_choice", "gsm8k_ppl")
BACKENDS = ("multispec", "transformers")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=20, help="questions per task (default: %(default)s)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the server's dtype (auto: bf16 where the CPU has it); transformers runs float32 "
                             "unless this is bfloat16 (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="prompts per request (server) or per forward (transformers) (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--serve-args", default="", metavar="FLAGS",
                        help="more flags for multispec serve, e.g. '--no-enable-prefix-caching'")
    parser.add_argument("--keep", metavar="DIR", default=None, help="write the harness's outputs here and keep them")
    return parser.parse_args()


def choice_rows(limit: int) -> list[dict]:
    """The multiple-choice documents: the question and its reference reasoning up to "#### ", then
    four numbers, the reference answer among three near misses, in an order fixed by the question."""
    from multispec.reasoning import load_gsm8k

    rows = []
    for problem in load_gsm8k(limit=limit):
        answer = int(problem.reference.replace(",", ""))
        misses = [m for m in (answer + 1, answer - 1, 2 * answer, answer + 10, answer * 10, answer + 2)
                  if m != answer]
        choices = [answer, *list(dict.fromkeys(misses))[:3]]
        key = int(hashlib.sha256(problem.question.encode()).hexdigest(), 16)
        order = sorted(range(4), key=lambda i: (key >> (8 * i)) & 0xFF)
        reasoning = problem.data["solution"].rsplit("####", 1)[0].rstrip()
        rows.append({"context": f"Question: {problem.question}\nAnswer: {reasoning}\n####",
                     "choices": [f" {choices[i]}" for i in order], "label": order.index(0)})
    return rows


def write_tasks(folder: Path, limit: int) -> None:
    """The three tasks' YAML files (written as JSON, which YAML reads) and their data."""
    data = ROOT / "multispec" / "reasoning" / "data"
    where = "import lm_eval, os; print(os.path.dirname(lm_eval.__file__))"
    lm_eval_dir = subprocess.run([str(ENV_PYTHON), "-c", where], capture_output=True, text=True,
                                 check=True).stdout.strip()
    gsm8k = {"data_files": {"train": str(data / "gsm8k_train.jsonl"), "test": str(data / "gsm8k_test.jsonl")}}
    choice_file = folder / "gsm8k_choice.jsonl"
    choice_file.write_text("".join(json.dumps(row) + "\n" for row in choice_rows(limit)), encoding="utf-8")
    tasks = {
        "gsm8k": {"include": f"{lm_eval_dir}/tasks/gsm8k/gsm8k.yaml", "task": "multispec_gsm8k",
                  "dataset_path": "json", "dataset_name": None, "dataset_kwargs": gsm8k},
        "gsm8k_choice": {"task": "multispec_gsm8k_choice", "dataset_path": "json", "dataset_name": None,
                         "dataset_kwargs": {"data_files": {"test": str(choice_file)}}, "test_split": "test",
                         "output_type": "multiple_choice", "doc_to_text": "{{context}}",
                         "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "target_delimiter": "",
                         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                         {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
                         "metadata": {"version": 1}},
        "gsm8k_ppl": {"task": "multispec_gsm8k_ppl", "dataset_path": "json", "dataset_name": None,
                      "dataset_kwargs": {"data_files": {"test": str(data / "gsm8k_test.jsonl")}},
                      "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
                      "doc_to_target": "Question: {{question}}\nAnswer: {{answer}}",
                      "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                      {"metric": "bits_per_byte"}],
                      "metadata": {"version": 1}},
    }
    for name, task in tasks.items():
        (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1), encoding="utf-8")


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """``multispec serve`` on the default model, once /health answers; its dtype and served name."""
    log = open(Path(args.out) / "server.log", "w")
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "multispec"), "serve", "--port", str(args.port),
                               "--dtype", args.dtype, *shlex.split(args.serve_args)],
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited (code {server.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2):
                break
        except OSError:
            time.sleep(1)
    else:
        server.kill()
        raise SystemExit(f"the server did not answer within 300 s; see {log.name}")
    with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models") as reply:
        served = json.load(reply)["data"][0]["id"]
    log_text = Path(log.name).read_text()
    dtype = re.search(r"on \w+, (\w+), drafter", log_text)
    return server, (dtype.group(1) if dtype else args.dtype), served


def run_harness(args, backend: str, tasks: list[str], model_args: str, model: str) -> tuple[float, Path]:
    out = Path(args.out) / backend
    command = [str(ENV_PYTHON), "-m", "lm_eval", "--model", model, "--model_args", model_args,
               "--include_path", str(Path(args.out) / "tasks"), "--tasks", ",".join(f"multispec_{t}" for t in tasks),
               "--limit", str(args.limit), "--batch_size", str(args.batch_size), "--output_path", str(out),
               "--log_samples"] + (["--device", "cpu"] if backend == "transformers" else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"[harness] {backend}: {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(Path(args.out) / f"{backend}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=args.out)
    seconds = time.perf_counter() - started
    if done.returncode:
        tail = Path(log.name).read_text().strip().splitlines()[-15:]
        raise SystemExit(f"lm_eval ({backend}) failed:\n" + "\n".join(tail))
    return seconds, out


PHASES = {"generate_until": "gsm8k", "loglikelihood": "gsm8k_choice", "loglikelihood_rolling": "gsm8k_ppl"}
"""The harness's request types, and the task of each here."""


def phase_seconds(log: Path) -> dict[str, float]:
    """Seconds the harness spent on each request type, from its log's timestamps (to the second):
    from "Running <type> requests" to the next such line, or to "Saving results"."""
    marks = []
    for line in log.read_text(errors="replace").replace("\r", "\n").splitlines():
        found = re.match(r"(\d{4}-\d\d-\d\d:\d\d:\d\d:\d\d) INFO .*?(?:Running (\w+) requests|(Saving results))", line)
        if found:
            stamp = time.mktime(time.strptime(found.group(1), "%Y-%m-%d:%H:%M:%S"))
            marks.append((stamp, found.group(2)))
    return {kind: end - start for (start, kind), (end, _) in zip(marks, marks[1:]) if kind}


def read_results(out: Path) -> tuple[dict, dict]:
    """The harness's metrics per task, and its logged samples per task (by document index)."""
    results_file = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]
    results = json.loads(Path(results_file).read_text())["results"]
    samples = {}
    for path in glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True):
        task = re.search(r"samples_(.+?)_\d{4}-", Path(path).name).group(1)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        samples[task] = {row["doc_id"]: row for row in rows}
    return results, samples


def agreement(task: str, mine: dict, theirs: dict) -> str:
    """How the two backends' per-document outputs compare."""
    common = sorted(set(mine) & set(theirs))
    if task == "multispec_gsm8k":
        same = sum(mine[i]["resps"][0][0] == theirs[i]["resps"][0][0] for i in common)
        return f"{same}/{len(common)} generations identical"
    diffs = []
    for i in common:
        for a, b in zip(mine[i]["resps"], theirs[i]["resps"]):
            a, b = a[0], b[0]
            a, b = (a[0], b[0]) if isinstance(a, list) else (a, b)
            diffs.append(abs(float(a) - float(b)))
    return f"log-likelihood max diff {max(diffs):.2e} over {len(diffs)}" if diffs else "-"


def main() -> None:
    args = parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [t for t in tasks if t not in TASKS] + [b for b in backends if b not in BACKENDS]:
        raise SystemExit(f"unknown task or backend: {', '.join(unknown)}")
    if not ENV_PYTHON.exists():
        raise SystemExit("the harness is not installed: run bash benchmarks/harness/setup.sh")
    from multispec.models import DEFAULT_MODEL, load_checkpoint, resolve_model

    hf_dir = load_checkpoint(resolve_model(DEFAULT_MODEL)).path
    with tempfile.TemporaryDirectory(prefix="multispec-harness-") as scratch:
        args.out = args.keep or scratch
        (Path(args.out) / "tasks").mkdir(parents=True, exist_ok=True)
        write_tasks(Path(args.out) / "tasks", args.limit)
        rows, seconds, labels = {}, {}, {}
        if "multispec" in backends:
            server, dtype, served = start_server(args)
            try:
                model_args = (f"base_url=http://127.0.0.1:{args.port}/v1/completions,model={served},"
                              f"num_concurrent=1,max_retries=1,tokenizer_backend=remote")
                seconds["multispec"], out = run_harness(args, "multispec", tasks, model_args, "local-completions")
            finally:
                server.terminate()
                server.wait(timeout=30)
            rows["multispec"] = read_results(out)
            labels["multispec"] = f"multispec serve ({dtype})"
        if "transformers" in backends:
            hf_dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
            model_args = f"pretrained={hf_dir},dtype={hf_dtype}"
            seconds["transformers"], out = run_harness(args, "transformers", tasks, model_args, "hf")
            rows["transformers"] = read_results(out)
            labels["transformers"] = f"lm-eval hf backend ({hf_dtype})"
        phases = {b: phase_seconds(Path(args.out) / f"{b}.log") for b in backends}
        print_table(tasks, backends, rows, seconds, phases, labels, args)


def print_table(tasks, backends, rows, seconds, phases, labels, args) -> None:
    print(f"\nlm-evaluation-harness, {args.limit} GSM8K test questions a task, batch size {args.batch_size}\n")
    print("| task | metric | " + " | ".join(labels[b] for b in backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for task in tasks:
        name = f"multispec_{task}"
        first = rows[backends[0]][0].get(name, {})
        for key in first:
            if key in ("alias", "name", "sample_len") or "stderr" in key:
                continue
            values = []
            for b in backends:
                value = rows[b][0].get(name, {}).get(key)
                values.append(f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value))
            print(f"| {task} | {key.replace(',none', '')} | " + " | ".join(values) + " |")
    for kind, task in PHASES.items():
        if task in tasks:
            print(f"| {task} | seconds ({kind}) | " + " | ".join(
                f"{phases[b].get(kind, float('nan')):.0f}" for b in backends) + " |")
    print("| all | wall seconds (the harness's start included) | " + " | ".join(
        f"{seconds[b]:.0f}" for b in backends) + " |")
    if len(backends) == 2:
        print("\nDocument by document:")
        for task in tasks:
            name = f"multispec_{task}"
            mine, theirs = (rows[b][1].get(name, {}) for b in backends)
            print(f"- {task}: " + agreement(name, mine, theirs))


if __name__ == "__main__":
    main()
