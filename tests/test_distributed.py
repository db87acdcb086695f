"""The Ray path on a local Ray instance (loopback, two CPUs, started once for the module): the same
job gives the in-process results, and a replica that dies mid-job loses and repeats no row."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest

from multispec import cli
from multispec.distributed import map_with_llm
from multispec.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello world", "The quick brown fox", "def f(x):", "jumps over the lazy dog", "return x * 2",
           "Hello", "quick", "lazy dog."]


def sample(llm, rows):
    """A worker: two seeded samples per row, as token ids."""
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=row["seed"]) for row in rows]
    outputs = llm.generate([row["prompt"] for row in rows], params, use_tqdm=False)
    return [{"row": row["row"], "samples": [c.token_ids for c in out.outputs]} for row, out in zip(rows, outputs)]


def sample_but_die_once(llm, rows):
    """The first batch to arrive kills its replica (os._exit, as a lost node would); the flag file
    makes the retry, on the restarted replica, succeed."""
    try:
        os.close(os.open(rows[0]["flag"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return sample(llm, rows)
    os._exit(1)


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def rows():
    return [{"row": i, "prompt": PROMPTS[i % len(PROMPTS)], "seed": 100 + i} for i in range(12)]


@pytest.fixture(scope="module")
def options(successor_dir):
    return {"model": str(successor_dir), "dtype": "float32", "device": "cpu", "kv_cache_memory": 0.05}


@pytest.fixture(scope="module")
def in_process(rows, options):
    return map_with_llm(rows, sample, options, batch_size=4)


def test_a_replica_killed_mid_job_loses_and_repeats_no_row(ray_address, rows, options, in_process, tmp_path):
    flag = tmp_path / "died"
    doomed = [dict(row, flag=str(flag)) for row in rows]
    on_ray = map_with_llm(doomed, sample_but_die_once, options, ray_address=ray_address, replicas=2, batch_size=4)
    assert flag.exists()
    assert [r["row"] for r in in_process] == list(range(len(rows)))
    assert on_ray == in_process


def test_batch_command_on_two_replicas_gives_the_in_process_results(ray_address, successor_dir, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": f"q{i}", "prompt": p, "seed": i} for i, p in enumerate(PROMPTS[:5])]
    lines.append({"messages": [{"role": "user", "content": "Hello"}], "n": 3, "seed": 7})
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ["batch", "--model", str(successor_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory",
              "0.05", "--input", str(requests), "--n", "2", "--max-tokens", "6", "--batch-size", "2"]
    assert cli.main([*common, "--output", str(tmp_path / "here.jsonl")]) == 0
    assert cli.main([*common, "--output", str(tmp_path / "ray.jsonl"), "--ray", ray_address, "--replicas", "2"]) == 0
    here, there = ((tmp_path / name).read_text().splitlines() for name in ("here.jsonl", "ray.jsonl"))
    assert here == there and len(here) == len(lines)
    assert [json.loads(line).get("id") for line in there] == ["q0", "q1", "q2", "q3", "q4", None]


def test_unreachable_address_is_named():
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="127.0.0.1:1"):
        map_with_llm([{"prompt": "x"}], sample, {}, ray_address="127.0.0.1:1")


def test_missing_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install multispec\[ray\]"):
        map_with_llm([{"prompt": "x"}], sample, {}, ray_address=True)


def test_in_process_needs_no_ray(monkeypatch, rows, options, in_process):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert map_with_llm(rows[:3], sample, options, batch_size=2) == in_process[:3]


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"batch_size": 0}, {"num_cpus": -1}, {"num_gpus": "one"},
                                 {"ray_address": 3}])
def test_bad_options_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        map_with_llm([{"prompt": "x"}], sample, {}, **bad)


def test_results_are_keyed_by_row_index():
    from multispec.distributed import _in_order

    records = [{"index": 1, "result": pickle.dumps({"r": 1})}, {"index": 0, "result": pickle.dumps({"r": 0})},
               {"index": 1, "result": pickle.dumps({"r": "again"})}]
    assert _in_order(records, 2) == [{"r": 0}, {"r": 1}]
    with pytest.raises(RuntimeError, match="row 2"):
        _in_order(records, 3)
