"""MATH-style questions from a user JSONL file: the answer is the last ``\\boxed{}``, and two
answers are equal when math-verify finds them mathematically equivalent ("\\frac12" = "0.5")."""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path

from math_verify import parse, verify

from multispec.reasoning.tasks.base import Problem, Task, read_jsonl, row_id, user_turn

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."
TIMEOUT_SECONDS = 5
"""math-verify's own limit on one parse or comparison (it uses SIGALRM, so only on the main thread)."""


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), stripped; None if there is none
    or it is never closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip() or None
    return None


def _timeout() -> int | None:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parsed(answer: str):
    """math-verify's reading of an answer given as LaTeX (wrapped in $...$ so it is read as such)."""
    return parse(f"${answer}$", parsing_timeout=_timeout())


@lru_cache(maxsize=65536)
def math_equal(answer: str, other: str) -> bool:
    """Equal strings, or math-verify finds the two equivalent; an answer it cannot read is equal
    only to itself."""
    if answer == other:
        return True
    left, right = _parsed(answer), _parsed(other)
    return bool(left and right and verify(left, right, timeout_seconds=_timeout()))


class MathJsonl(Task):
    """Rows ``{"problem" (or "question"), "answer" (or a "solution" holding a \\boxed{} answer),
    "id" (optional)}``."""

    name = "math"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.path}"

    def load(self) -> list[Problem]:
        rows = read_jsonl(self.path, [("problem", "question"), ("answer", "solution")])
        problems = []
        for i, row in enumerate(rows):
            reference = row["answer"]
            if "\\boxed{" in reference:
                reference = last_boxed(reference) or reference
            problems.append(Problem(row_id(row, self.name, i), row["problem"], reference,
                                    user_turn(f"{row['problem']}\n{INSTRUCTION}")))
        return problems

    def extract(self, problem: Problem, completion: str) -> str | None:
        answer = last_boxed(completion)
        return None if answer is None else re.sub(r"\s+", " ", answer)

    def equivalent(self, answer: str, other: str) -> bool:
        return math_equal(answer, other)

