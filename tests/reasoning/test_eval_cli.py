"""``multispec eval`` end to end on the tiny model: the results file, the summary table, the
plot, the progress bar, the Ray worker's shape, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import pickle
from itertools import combinations

import pytest

from multispec import SamplingParams
from multispec.cli import main
from multispec.distributed import map_with_llm
from multispec.reasoning.evaluate import EvalConfig, solve, solve_rows
from multispec.reasoning.tasks import make_task
from tests.reasoning.conftest import ANSWER_REGEX

SAMPLE_FIELDS = {"index", "text", "tokens", "logprob", "finish_reason", "answer", "correct", "status"}
QUESTION_FIELDS = {"id", "position", "reference", "samples", "answers", "vote", "votes", "correct", "tokens", "time",
                   "grade_time", "finished_samples", "stopped_early", "error"}


def eval_cli(successor_dir, questions_file, *args):
    return main(["eval", "--model", str(successor_dir), "--dtype", "float32", "--device", "cpu",
                 "--task", f"jsonl:{questions_file}", "--answer-regex", ANSWER_REGEX, "--max-tokens", "24",
                 "--temperature", "1.0", "--seed", "0", *args])


def test_vote_with_early_stop_writes_results_table_plot_and_progress(successor_dir, questions_file, tmp_path,
                                                                     capsys, monkeypatch):
    monkeypatch.delenv("MULTISPEC_NO_PROGRESS")
    output, plot = tmp_path / "out.json", tmp_path / "out.png"
    assert eval_cli(successor_dir, questions_file, "--n", "8", "--limit", "3", "--early-stop", "esc:2",
                    "--stop", "o", "--stop", "e", "--output", str(output), "--plot", str(plot)) == 0
    captured = capsys.readouterr()
    assert "accuracy" in captured.out and "generated tokens" in captured.out and "wall time" in captured.out
    assert "question" in captured.err and "accuracy" in captured.err and "tok/s" in captured.err
    results = json.loads(output.read_text())
    assert results["config"]["early_stop"] == "esc:2" and results["config"]["sampling"]["n"] == 8
    assert results["summary"]["questions"] == 3 and results["summary"]["stopped_early"] >= 1
    questions = results["questions"]
    assert [q["id"] for q in questions] == ["jsonl/0", "jsonl/1", "jsonl/2"]
    for question in questions:
        assert QUESTION_FIELDS <= set(question) and len(question["samples"]) == len(question["answers"]) == 8
        assert all(set(s) == SAMPLE_FIELDS for s in question["samples"])
        assert question["tokens"] == sum(s["tokens"] for s in question["samples"])
        assert question["correct"] == (question["vote"] == "8")
        aborted = [s for s in question["samples"] if s["finish_reason"] == "abort"]
        assert all(s["answer"] is None and s["correct"] is None for s in aborted)
        assert question["finished_samples"] == 8 - len(aborted)
    assert results["summary"]["tokens"] == sum(q["tokens"] for q in questions)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pass_at_k_from_the_saved_samples(successor_dir, questions_file, tmp_path, capsys):
    output = tmp_path / "out.json"
    assert eval_cli(successor_dir, questions_file, "--n", "4", "--limit", "2", "--strategy", "pass@k",
                    "--k", "1,3", "--output", str(output)) == 0
    assert "pass@3" in capsys.readouterr().out
    results = json.loads(output.read_text())
    for question in results["questions"]:
        flags = [s["correct"] for s in question["samples"]]
        for k in (1, 3):
            subsets = list(combinations(flags, k))
            assert question["pass@k"][str(k)] == pytest.approx(sum(map(any, subsets)) / len(subsets))
    assert set(results["summary"]["pass@k"]) == {"1", "3"}


def test_best_of_n_keeps_the_most_likely_sample(successor_dir, questions_file, tmp_path):
    output = tmp_path / "out.json"
    assert eval_cli(successor_dir, questions_file, "--n", "4", "--limit", "1", "--strategy", "best-of-n",
                    "--output", str(output)) == 0
    question = json.loads(output.read_text())["questions"][0]
    scores = [s["score"] for s in question["samples"]]
    assert scores == [s["logprob"] / s["tokens"] for s in question["samples"]]
    assert question["best"] == scores.index(max(scores)) and question["vote"] == question["answers"][question["best"]]


def test_the_ray_worker_matches_the_in_process_run(tiny, successor_dir, questions_file):
    """``solve_rows`` is what each Ray replica runs: rows pickle, and a seeded question gets the
    same result whichever batch it lands in."""
    config = EvalConfig(make_task(f"jsonl:{questions_file}", ANSWER_REGEX),
                        SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=3), early_stop="esc:2")
    problems = config.task.problems()
    rows = pickle.loads(pickle.dumps([{"position": i, "problem": p, "config": config} for i, p in enumerate(problems)]))
    batched = map_with_llm(rows, solve_rows, {"model": str(successor_dir), "dtype": "float32", "device": "cpu"},
                           batch_size=3)
    alone = sorted(solve(tiny, config, problems), key=lambda r: r["position"])
    for one, other in zip(batched, alone):  # the same samples; float32 sums differ with the batch shape
        for sample in one["samples"]:
            sample["logprob"] = pytest.approx(other["samples"][sample["index"]]["logprob"], abs=1e-4)
        assert {k: v for k, v in one.items() if k not in ("time", "grade_time")} == {
            k: v for k, v in other.items() if k not in ("time", "grade_time")}


@pytest.mark.parametrize("args, message", [
    (["--task", "mmlu"], "task 'mmlu': must be gsm8k"),
    (["--task", "math:{missing}"], "nope.jsonl: no such file"),
    (["--task", "jsonl:{bad}", "--answer-regex", "x"], "bad.jsonl, line 2: not valid JSON"),
    (["--task", "jsonl:{good}"], "needed by a jsonl:FILE task"),
    (["--task", "gsm8k", "--n", "0"], "n=0: must be an integer >= 1"),
    (["--task", "humaneval", "--strategy", "pass@k", "--n", "4", "--k", "1,5"], "k=5: pass@k needs 1 <= k <= n"),
    (["--task", "gsm8k", "--early-stop", "beta:2"], "early stop beta:2.0: the threshold must lie in (0, 1)"),
    (["--task", "gsm8k", "--early-stop", "soon"], "early stop 'soon': must be"),
    (["--task", "gsm8k", "--n", "4", "--early-stop", "esc:5"], "the window exceeds n=4"),
    (["--task", "humaneval"], "use --strategy pass@k or best-of-n"),
    (["--task", "gsm8k", "--strategy", "majority"], "strategy 'majority': must be one of"),
    (["--task", "gsm8k", "--limit", "0"], "limit=0"),
    (["--task", "gsm8k", "--strategy", "pass@k", "--plot", "x.png"], "--plot draws the accuracy of votes"),
    (["--task", "gsm8k", "--output", "{missing_dir}/out.json"], "its directory does not exist"),
    (["--task", "gsm8k", "--limit", "1", "--ray", "127.0.0.1:1"], "Ray address '127.0.0.1:1' cannot be reached"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "a"}\n{oops\n')
    (tmp_path / "good.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    paths = {"missing": tmp_path / "nope.jsonl", "bad": tmp_path / "bad.jsonl", "good": tmp_path / "good.jsonl",
             "missing_dir": tmp_path / "no" / "dir"}
    assert main(["eval", *(a.format(**paths) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multispec: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_question_too_long_for_the_model_is_one_line(successor_dir, tmp_path, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"question": "lazy dog " * 200, "answer": "1", "id": "q-long"}) + "\n")
    assert main(["eval", "--model", str(successor_dir), "--task", f"jsonl:{path}", "--answer-regex", "x"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the line naming the model loaded
    assert last.startswith("multispec: error: the prompt of question q-long") and "context window" in last


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as error:
        main(["eval", "--task", "gsm8k", "--k", "one"])
    assert error.value.code == 2
