"""Each task's problems, answer extraction and grading; malformed files named with their line."""

from __future__ import annotations

import json

import pytest

from multispec.reasoning.tasks import Problem, make_task
from multispec.reasoning.tasks.base import read_jsonl
from multispec.reasoning.tasks.gsm8k import GSM8K, extract_answer, load_gsm8k
from multispec.reasoning.tasks.humaneval import HumanEval, counting_tests, extract_code, program
from multispec.reasoning.tasks.math_jsonl import last_boxed


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_gsm8k_problems_extraction_and_grading():
    task = make_task("gsm8k")
    first = task.problems(limit=2)[0]
    assert first.id == "gsm8k/0" and first.reference == "18" and first == load_gsm8k(limit=1)[0]
    assert len(GSM8K().problems()) == 1319
    assert extract_answer("so she makes $1,234.50.\n#### $1,234.50") == "1234.5"
    assert extract_answer("The answer is 42 apples") == "42"
    assert extract_answer("no digits") is None
    # An answer repeated until max_tokens cut it: the first complete one, not the cut last copy.
    assert extract_answer("720 / 4 = 184.\n\n#### 184\n#### 184\n#### 184\n#### 1") == "184"
    # A '####' with no number before the next '####' defers to the next one.
    assert extract_answer("#### see below\n#### 5") == "5"
    assert task.grade(first, task.extract(first, "9 * 2 = 18\n#### 18")).correct
    assert task.grade(first, "17").status == "wrong" and task.grade(first, None).status == "no answer"


def test_math_boxed_extraction_and_math_verify_equivalence(tmp_path):
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\sqrt{2}") is None and last_boxed("no box") is None
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "Half of one?", "answer": r"\frac{1}{2}"},
                                             {"question": "Two plus two?", "solution": r"It is \boxed{4}.", "id": 7}])
    task = make_task(f"math:{path}")
    half, four = task.problems()
    assert (half.id, four.id, four.reference) == ("math/0", "7", "4") and "\\boxed{}" in half.messages[0]["content"]
    assert task.extract(half, r"So \boxed{ 0.5 }.") == "0.5"
    assert task.grade(half, "0.5").correct and task.grade(half, r"\dfrac12").correct
    assert not task.grade(half, "2").correct and task.grade(half, None).status == "no answer"
    assert task.equivalent("4", "4.0") and not task.equivalent("4", "x")


def test_jsonl_answer_regex(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "Capital of France?", "answer": " Paris "},
                                             {"question": "2+2?", "answer": 4}])
    task = make_task(f"jsonl:{path}", r"Answer:\s*(\w+)")
    paris, four = task.problems()
    assert paris.reference == "Paris" and four.reference == "4" and paris.chat() == [
        {"role": "user", "content": "Capital of France?"}]
    assert task.extract(paris, "Answer: Lyon... no. Answer: Paris") == "Paris"
    assert task.extract(paris, "I think Paris") is None
    assert make_task(f"jsonl:{path}", r"\d+").extract(four, "3 or 4") == "4"  # no group: the whole match
    assert task.grade(paris, "Paris").correct and not task.grade(paris, "paris").correct


@pytest.mark.parametrize("lines, message", [
    (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": '], ", line 2: not valid JSON"),
    (['{"question": "a", "answer": "1"}', "", '["a list"]'], ", line 3: must be a JSON object, got list"),
    (['{"question": "a"}'], ", line 1: needs a non-empty 'answer'"),
    (['{"question": "", "answer": "1"}'], ", line 1: needs a non-empty 'question'"),
    ([""], ": holds no rows"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as error:
        make_task(f"jsonl:{path}", "x").problems()
    assert str(error.value).startswith(f"{path}{message}")


def test_math_rows_need_a_problem_and_an_answer_or_solution(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b"}])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: needs a non-empty 'answer' or 'solution'"):
        make_task(f"math:{path}").problems()


def test_unreadable_dataset_files(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl: no such file"):
        make_task(f"math:{tmp_path / 'nope.jsonl'}").problems()
    (tmp_path / "bin.jsonl").write_bytes(b'{"question": "a", "answer": "1"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"bin\.jsonl, line 2: not UTF-8"):
        read_jsonl(tmp_path / "bin.jsonl", [("question",)])


@pytest.mark.parametrize("spec, regex, message", [
    ("mmlu", None, "must be gsm8k, humaneval"), ("math", None, "must be"), ("gsm8k:x.jsonl", None, "must be"),
    ("jsonl:q.jsonl", None, "answer regex"), ("gsm8k", "x", "answer regex"), ("jsonl:q.jsonl", "(", "does not compile"),
])
def test_bad_task_specs(spec, regex, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec, regex)


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit=0"):
        make_task("gsm8k").problems(0)


def test_humaneval_problems_come_from_the_wheel():
    task = make_task("humaneval")
    problems = task.problems()
    assert len(problems) == 164 and task.code
    first = problems[0]
    assert first.id == "HumanEval/0" and first.data["entry_point"] == "has_close_elements"
    assert first.data["prompt"] in first.messages[0]["content"]


def test_code_extraction_prefers_the_block_defining_the_entry_point():
    text = "Here:\n```python\nimport math\n```\nThen\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("```py\ndef g():\n    return 1", "f") == "def g():\n    return 1"  # cut off, no match
    assert extract_code("    return x\n", "f") == "    return x\n"  # a bare continuation


HUMANEVAL_0_RIGHT = ("def has_close_elements(numbers, threshold):\n"
                     "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])")
HUMANEVAL_0_HALF = "def has_close_elements(numbers, threshold):\n    return threshold > 0.4"


def test_humaneval_grading_in_the_sandbox():
    task = HumanEval()
    problem = task.problems(limit=1)[0]
    assert task.grade(problem, task.extract(problem, f"```python\n{HUMANEVAL_0_RIGHT}\n```")).correct
    wrong = task.grade(problem, HUMANEVAL_0_HALF)
    assert not wrong.correct and wrong.status == "failed" and wrong.seconds > 0
    assert task.grade(problem, None).status == "no answer"
    # Best-of-N's code scorer: of the 7 asserts, "threshold > 0.4" passes those at 0.05, 0.95 and 1.0.
    assert task.fraction_passed(problem, HUMANEVAL_0_RIGHT)[0] == 1.0
    assert task.fraction_passed(problem, HUMANEVAL_0_HALF)[0] == pytest.approx(3 / 7)
    assert task.fraction_passed(problem, "def has_close_elements(:")[0] == 0.0


def test_program_is_prompt_completion_tests_check():
    test = "def check(c):\n    assert c() == 1"
    problem = Problem("p", "q", "", (), {"prompt": "P\n", "test": test, "entry_point": "f"})
    assert program(problem, "C") == f"P\n\nC\n\n{test}\n\ncheck(f)\n"
    counted = counting_tests("def check(c):\n    x = 1\n    assert c() == x\n    for i in (1, 2):\n        assert i\n")
    assert "_passed += 1" in counted and counted.count("try:") == 2 and "x = 1" in counted
    assert counting_tests("def other():\n    assert True") is None
