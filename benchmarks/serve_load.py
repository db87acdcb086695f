"""Load test of the OpenAI-compatible servers: ``multispec serve`` against ``vllm serve`` on the
same model, from concurrent streaming clients over loopback; prints a markdown table.

Workload: ``--requests`` chat requests (default 200) on GSM8K test questions (the chat messages
of ``load_gsm8k``, cycled), each asking for n samples with n drawn from {1, 4, 8, 16} (seeded,
the same sequence for every engine and concurrency), temperature 0.7, top_p 1, ``--max-tokens``
256, streamed with ``stream_options.include_usage``. C clients (``--concurrency``, default 1, 8
and 32) each send their next request as soon as their last one ends. Each engine is started once
(its own process, after a warm-up request) and serves every C in turn.

Per engine and C: requests/s and output tokens/s over the wall time of the whole run (output
tokens as each server's usage chunk counts them), time to first token (the first chunk with text)
and end-to-end latency, p50 and p99, errors (any failed request) and incomplete responses (a
response without exactly one finish_reason for each of its n choices, or without usage).

With ``--engines in-process`` the same jobs and clients run against multispec's ``AsyncLLM`` in the
benchmark's own process (the engine the server wraps, with the server's default speculation),
without HTTP, server-sent events or the openai client's parsing: what those cost is the gap
between the "multispec" and "in-process" rows at each C.

vLLM runs when benchmarks/peers/setup.sh has installed it (benchmarks/peers/envs/vllm), with both
cores (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), the LD_PRELOAD its CPU guide recommends, and a 4 GiB
KV cache (``VLLM_CPU_KVCACHE_SPACE``); it gets the Hugging Face directory the project converts
the default model into, multispec the model itself (same weights). Requests carry no seed (a
per-request seed has crashed vLLM's CPU runner). vLLM's server starts as the module
``vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs): the ``vllm`` command looks up
the package metadata under the name "vllm", which the CPU build (``vllm-cpu``) does not have.

    .venv/bin/python benchmarks/serve_load.py                                  # the full table (long)
    .venv/bin/python benchmarks/serve_load.py --requests 6 --concurrency 2 --max-tokens 16 --engines multispec
    .venv/bin/python benchmarks/serve_load.py --requests 24 --concurrency 32 --engines multispec,in-process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VLLM = HERE / "peers" / "envs" / "vllm" / "bin" / "python"
SAMPLE_COUNTS = (1, 4, 8, 16)
TEMPERATURE, TOP_P = 0.7, 1.0
SERVED_NAME = "bench"


@dataclass
class Outcome:
    """One request as the client saw it."""

    ok: bool
    complete: bool
    tokens: int
    first_token: float | None
    latency: float
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: str, port: int, args, log_path: Path) -> subprocess.Popen:
    """The engine's server in its own process group (so that stopping it ends its children too)."""
    env = dict(os.environ)
    if engine == "multispec":
        command = [sys.executable, "-m", "multispec.cli", "serve", args.model, "--port", str(port), "--dtype",
                   args.dtype, "--served-model-name", SERVED_NAME, "--kv-cache-memory", "4", "--log-level", "warning"]
    else:
        sys.path.insert(0, str(HERE / "peers"))
        from run import vllm_preload  # the preload benchmarks/peers gives vLLM

        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        env["LD_PRELOAD"] = ":".join([*vllm_preload(), *filter(None, [env.get("LD_PRELOAD")])])
        command = [str(VLLM), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_directory(), "--host",
                   "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
                   "--seed", "0"]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def hf_directory() -> str:
    """The Hugging Face directory the default model's GGUF converts into (what vLLM loads)."""
    from multispec.models import DEFAULT_MODEL, load_checkpoint, resolve_model

    return str(load_checkpoint(resolve_model(DEFAULT_MODEL)).path)


def wait_healthy(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


async def one_request(client, messages: list[dict], n: int, max_tokens: int) -> Outcome:
    start = time.perf_counter()
    first, finishes, tokens, usage_seen = None, {}, 0, False
    try:
        stream = await client.chat.completions.create(
            model=SERVED_NAME, messages=messages, n=n, max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                tokens, usage_seen = chunk.usage.completion_tokens, True
            for choice in chunk.choices:
                if first is None and choice.delta.content:
                    first = time.perf_counter() - start
                if choice.finish_reason is not None:
                    finishes[choice.index] = finishes.get(choice.index, 0) + 1
    except Exception as error:  # noqa: BLE001 - counted and shown, the run goes on
        return Outcome(False, False, tokens, first, time.perf_counter() - start, f"{type(error).__name__}: {error}")
    complete = usage_seen and finishes == dict.fromkeys(range(n), 1)
    return Outcome(True, complete, tokens, first, time.perf_counter() - start)


async def run_load(base_url: str, jobs: list[tuple[list[dict], int]], concurrency: int, max_tokens: int,
                   timeout: float) -> tuple[list[Outcome], float]:
    """All jobs through ``concurrency`` clients; the outcomes and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    try:
        return await clients(jobs, concurrency, lambda messages, n: one_request(client, messages, n, max_tokens))
    finally:
        await client.close()


async def clients(jobs: list[tuple[list[dict], int]], concurrency: int, send) -> tuple[list[Outcome], float]:
    """``concurrency`` clients, each awaiting ``send(messages, n)`` for the next job as soon as its
    last one ended; the outcomes and the wall time."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: list[Outcome] = []

    async def worker():
        while not queue.empty():
            messages, n = queue.get_nowait()
            outcomes.append(await send(messages, n))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


async def one_in_process(llm, messages: list[dict], n: int, max_tokens: int) -> Outcome:
    """``one_request`` against an ``AsyncLLM`` directly: the same request, read as it streams."""
    from multispec import SamplingParams

    start = time.perf_counter()
    first, finishes, tokens = None, {}, 0
    params = SamplingParams(n=n, temperature=TEMPERATURE, top_p=TOP_P, max_tokens=max_tokens)
    try:
        async for out in llm.chat(messages, params):
            for completion in out.outputs:
                tokens += len(completion.token_ids)
                if first is None and completion.text:
                    first = time.perf_counter() - start
                if completion.finish_reason is not None:
                    finishes[completion.index] = finishes.get(completion.index, 0) + 1
    except Exception as error:  # noqa: BLE001 - counted and shown, the run goes on
        return Outcome(False, False, tokens, first, time.perf_counter() - start, f"{type(error).__name__}: {error}")
    return Outcome(True, finishes == dict.fromkeys(range(n), 1), tokens, first, time.perf_counter() - start)


async def run_in_process(llm, jobs: list[tuple[list[dict], int]], concurrency: int,
                         max_tokens: int) -> tuple[list[Outcome], float]:
    """``run_load`` with the clients calling ``llm`` (an ``AsyncLLM``) in this process."""
    return await clients(jobs, concurrency, lambda messages, n: one_in_process(llm, messages, n, max_tokens))


def bench_in_process(jobs, levels: list[int], args) -> list[dict]:
    """The engine ``multispec serve`` wraps, as the server builds it (same dtype, KV cache, default
    speculation, prices measured before the first request), driven from this process."""
    from multispec import LLM, SpecConfig
    from multispec.async_llm import AsyncLLM

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=4, spec=SpecConfig(drafter="consensus"))
    llm.engine.step_costs()
    rows = []
    with AsyncLLM(llm) as engine:
        asyncio.run(run_in_process(engine, jobs[:1], 1, 16))  # warm-up
        for concurrency in levels:
            rows.append(summarize("in-process", concurrency,
                                  *asyncio.run(run_in_process(engine, jobs, concurrency, args.max_tokens))))
    return rows


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(engine: str, concurrency: int, outcomes: list[Outcome], wall: float) -> dict:
    """One row of the table, also printed as a progress line."""
    ok = [o for o in outcomes if o.ok]
    first = [o.first_token for o in ok if o.first_token is not None]
    latency = [o.latency for o in ok]
    row = {"engine": engine, "concurrency": concurrency, "requests": len(outcomes),
           "errors": len(outcomes) - len(ok), "incomplete": sum(not o.complete for o in ok),
           "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(o.tokens for o in ok) / wall,
           "ttft_p50": percentile(first, 0.5), "ttft_p99": percentile(first, 0.99),
           "latency_p50": percentile(latency, 0.5), "latency_p99": percentile(latency, 0.99), "wall_s": wall,
           "first_errors": [o.error for o in outcomes if not o.ok][:3]}
    print(f"{engine:<10} C={concurrency:<3} {row['output_tokens_per_s']:.0f} output tok/s, {row['errors']} errors, "
          f"{row['incomplete']} incomplete, {wall:.0f} s", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = ["engine", "C", "requests", "errors", "incomplete", "req/s", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)",
            "latency p50 (s)", "latency p99 (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['incomplete']} | "
                     f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | {r['ttft_p50']:.2f} | "
                     f"{r['ttft_p99']:.2f} | {r['latency_p50']:.1f} | {r['latency_p99']:.1f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """multispec's output tokens/s over vLLM's, and over its own engine in process, at each C where
    both ran."""
    by = {(r["engine"], r["concurrency"]): r for r in rows}
    return [f"C = {c}: multispec / {other} output tokens/s = "
            f"{by[('multispec', c)]['output_tokens_per_s'] / by[(other, c)]['output_tokens_per_s']:.2f}x"
            for other in ("vllm", "in-process")
            for (engine, c) in by if engine == "multispec" and (other, c) in by
            and by[(other, c)]["output_tokens_per_s"] > 0]


def workload(requests: int, seed: int) -> list[tuple[list[dict], int]]:
    from multispec.reasoning import load_gsm8k

    problems = load_gsm8k(limit=requests)
    rng = random.Random(seed)
    return [(problems[i % len(problems)].chat(), rng.choice(SAMPLE_COUNTS)) for i in range(requests)]


def bench_engine(engine: str, jobs, levels: list[int], args, log_dir: Path) -> list[dict]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{engine}.log"
    process = start_server(engine, port, args, log_path)
    rows = []
    try:
        wait_healthy(base_url, process, args.start_timeout)
        asyncio.run(run_load(base_url, jobs[:1], 1, 16, args.request_timeout))  # warm-up
        for concurrency in levels:
            rows.append(summarize(engine, concurrency,
                                  *asyncio.run(run_load(base_url, jobs, concurrency, args.max_tokens,
                                                        args.request_timeout))))
    except RuntimeError as error:
        print(f"{engine}: {error}; its log: {log_path}", file=sys.stderr)
    finally:
        stop_server(process)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="multispec,vllm",
                        help="comma-separated: multispec, vllm, in-process (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="what multispec serves (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draw of each request's n")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=1800, help="seconds one request may take")
    parser.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="also save the rows as JSON")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.requests < 1 or args.max_tokens < 1 or not levels or min(levels) < 1:
        parser.error("--requests, --max-tokens and every --concurrency must be >= 1")
    known = {"multispec", "vllm", "in-process"}
    if set(engines) - known:
        parser.error(f"--engines: unknown {', '.join(sorted(set(engines) - known))}")
    log_dir = Path(args.logs) if args.logs else Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-load-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = workload(args.requests, args.seed)
    rows = []
    for engine in engines:
        if engine == "vllm" and not VLLM.exists():
            print("vllm: not installed (run benchmarks/peers/setup.sh vllm)", file=sys.stderr)
            continue
        rows += bench_in_process(jobs, levels, args) if engine == "in-process" else bench_engine(
            engine, jobs, levels, args, log_dir)
    print(f"\n{args.requests} GSM8K chat requests, n from {{1, 4, 8, 16}}, T {TEMPERATURE}, max_tokens "
          f"{args.max_tokens}, streamed; {os.cpu_count()} cores; loopback.\n")
    print(table(rows))
    for line in ratios(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
