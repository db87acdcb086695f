"""``benchmarks/harness/run.py`` (lm-evaluation-harness against the server): what it computes
itself, without the harness installed: the multiple-choice documents, the seconds per request type
read from the harness's log, and the document-by-document comparison."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "harness" / "run.py"
_SPEC = importlib.util.spec_from_file_location("harness_run", _PATH)
harness = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(harness)


def test_choice_documents_hold_the_answer_once_among_four_numbers():
    from multispec.reasoning import load_gsm8k

    rows = harness.choice_rows(40)
    labels = set()
    for row, problem in zip(rows, load_gsm8k(limit=40)):
        answer = int(problem.reference.replace(",", ""))
        numbers = [int(choice) for choice in row["choices"]]
        assert len(set(numbers)) == 4 and numbers[row["label"]] == answer and numbers.count(answer) == 1
        assert row["context"].startswith(f"Question: {problem.question}\nAnswer: ") and row["context"].endswith("####")
        assert "####" not in row["context"][:-4]  # the reasoning, not the answer line
        labels.add(row["label"])
    assert labels == {0, 1, 2, 3}  # the answer's place varies


def test_phase_seconds_read_from_the_harness_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("2026-01-02:10:00:00 INFO     [evaluator:589] Running generate_until requests\n"
                   "Requesting API: 50%|\r2026-01-02:10:01:05 INFO     [evaluator:589] Running loglikelihood requests\n"
                   "2026-01-02:10:01:50 INFO     [evaluator:589] Running loglikelihood_rolling requests\n"
                   "2026-01-02:10:02:00 INFO     [loggers.evaluation_tracker:247] Saving results aggregated\n")
    assert harness.phase_seconds(log) == {"generate_until": 65, "loglikelihood": 45, "loglikelihood_rolling": 10}


def test_agreement_compares_documents_the_backends_share():
    mine = {0: {"resps": [["a b"]]}, 1: {"resps": [["c"]]}, 2: {"resps": [["x"]]}}
    theirs = {0: {"resps": [["a b"]]}, 1: {"resps": [["d"]]}}
    assert harness.agreement("multispec_gsm8k", mine, theirs) == "1/2 generations identical"
    mine = {0: {"resps": [[[-1.5, True]], [[-3.0, False]]]}}
    theirs = {0: {"resps": [[[-1.5001, True]], [[-2.75, False]]]}}
    assert harness.agreement("multispec_gsm8k_choice", mine, theirs) == "log-likelihood max diff 2.50e-01 over 2"
    rolling = harness.agreement("multispec_gsm8k_ppl", {0: {"resps": [[-10.0]]}}, {0: {"resps": [[-10.5]]}})
    assert rolling == "log-likelihood max diff 5.00e-01 over 1"

