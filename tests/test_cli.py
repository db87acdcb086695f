"""The command line end to end on the default model (short generations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args, timeout=300):
    env = dict(os.environ)
    env.pop("MULTISPEC_NO_PROGRESS", None)
    return subprocess.run([sys.executable, "-m", "multispec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_prints_samples_and_progress(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 2?\nName a color.\n")
    result = run_cli("generate", "--prompts-file", str(prompts), "--n", "2", "--max-tokens", "8", "--chat",
                     "--seed", "0", "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [len(line["samples"]) for line in lines] == [2, 2]
    assert all(len(s["token_ids"]) <= 8 for line in lines for s in line["samples"])
    assert "tok/s" in result.stderr  # the live progress bar and the closing summary


def test_gsm8k_job_votes_and_reports_speed():
    result = run_cli("gsm8k", "--questions", "1", "--n", "2", "--max-tokens", "16", "--seed", "0",
                     "--drafter", "consensus", "--baseline")
    assert result.returncode == 0, result.stderr
    assert "Q0: voted" in result.stdout and "reference 18" in result.stdout
    assert "tokens/s" in result.stdout and "speedup" in result.stdout and "tau" in result.stdout


def test_gsm8k_baseline_measures_the_step_prices_before_either_timed_run(monkeypatch):
    """The main job's speedup compares two timed runs; the draft budget's one-time measurement of
    step prices (on a fresh cache) happens before both, not inside or between them."""
    from multispec import LLM, cli
    from multispec.engine.engine import LLMEngine

    events = []
    measure, chat = LLMEngine.step_costs, LLM.chat
    monkeypatch.setattr(LLMEngine, "step_costs",
                        lambda self, refresh=False: events.append("prices") or measure(self, refresh))
    monkeypatch.setattr(LLM, "chat", lambda self, *a, **k: events.append("chat") or chat(self, *a, **k))
    assert cli.main(["gsm8k", "--questions", "1", "--n", "2", "--max-tokens", "4", "--drafter", "consensus",
                     "--baseline"]) == 0
    assert events[0] == "prices" and events.count("chat") == 2


def test_unreadable_prompts_file_is_one_line_error(tmp_path):
    result = run_cli("generate", "--prompts-file", str(tmp_path / "nope.txt"))
    assert result.returncode == 2 and "nope.txt" in result.stderr and "Traceback" not in result.stderr


def test_missing_device_is_one_line_error():
    result = run_cli("generate", "--prompt", "hi", "--device", "cuda:99")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("multispec: error: device='cuda:99'")
    assert len(result.stderr.strip().splitlines()) == 1


def test_python_dash_m_multispec_is_the_command_line():
    result = subprocess.run([sys.executable, "-m", "multispec", "generate", "--n", "0", "--prompt", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "multispec: error: n=0: must be an integer >= 1"


def step_cost_files() -> dict:
    """The cached step-cost tables of the test session's cache (``tests/conftest.py``: the kernels
    built there are reused; a cache of its own built them again, half a minute), by modification time."""
    folder = Path(os.environ["MULTISPEC_CACHE"]) / "step-costs"
    return {path: path.stat().st_mtime_ns for path in folder.glob("*.json")} if folder.exists() else {}


def test_calibrate_measures_and_caches_the_step_costs(successor_dir):
    # --even-if-busy: whether the machine running the tests is quiet must not decide the outcome
    # (without it, prices measured on a busy machine are not cached and the command exits 1:
    # tests/engine/test_costs.py and the test below).
    before = step_cost_files()
    result = run_cli("calibrate", "--model", str(successor_dir), "--dtype", "float32", "--even-if-busy")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("step base ms by tokens {1: ")
    written = [path for path, mtime in step_cost_files().items() if before.get(path) != mtime]
    assert len(written) == 1 and json.loads(written[0].read_text())["key"]["dtype"] == "float32"


def test_calibrate_on_a_busy_machine_says_so_and_exits_1(successor_dir, monkeypatch, capsys, caplog):
    from multispec import cli
    from multispec.engine import costs

    readings = [{"1": (0, 0)}, {"1": (10**9, 6 * 10**8)}]  # the threads waited 0.6 s a second of running
    monkeypatch.setattr(costs, "core_wait", lambda: readings.pop(0))
    monkeypatch.setattr(costs, "measure", lambda engine: costs.StepCosts([1, 64], [0.01, 0.05], 0.001, [1], [0.0]))
    before = step_cost_files()
    assert cli.main(["calibrate", "--model", str(successor_dir), "--dtype", "float32"]) == 1
    out = capsys.readouterr()
    assert "waited for a core 60.0%" in out.out and "the machine was busy" in caplog.text
    assert step_cost_files() == before  # nothing cached


def test_generate_with_a_bfloat16_kv_cache_says_so(successor_dir):
    result = run_cli("generate", "--model", str(successor_dir), "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
                     "--prompt", "1 2 3", "--n", "2", "--max-tokens", "4", "--seed", "0", "--json")
    assert result.returncode == 0, result.stderr
    assert "float32, KV cache bfloat16" in result.stderr
    assert len(json.loads(result.stdout.splitlines()[0])["samples"]) == 2


def test_generate_with_structured_outputs(successor_dir, tmp_path):
    """--json-schema (a file) and --choice on the tiny model: every sample follows its constraint,
    with the consensus drafter (bad values: tests/test_errors.py)."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]}},
                                  "required": ["animal"], "additionalProperties": False}))
    base = ["generate", "--model", str(successor_dir), "--dtype", "float32", "--prompt", "The quick", "--n", "4",
            "--max-tokens", "40", "--seed", "0", "--json", "--drafter", "consensus"]
    for flags, check in ((["--json-schema", str(schema), "--disable-any-whitespace"],
                          lambda text: json.loads(text)["animal"] in ("fox", "dog")),
                         (["--choice", "brown fox", "--choice", "lazy dog"],
                          lambda text: text in ("brown fox", "lazy dog"))):
        result = run_cli(*base, *flags)
        assert result.returncode == 0, result.stderr
        samples = json.loads(result.stdout.splitlines()[0])["samples"]
        assert all(s["finish_reason"] == "stop" and check(s["text"]) for s in samples), samples
