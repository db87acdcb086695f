"""What every task shares: a problem, a grade, the task interface and a strict JSON-lines reader.

A task turns a dataset into problems (an id, the chat messages sent to the model, the reference
answer), extracts an answer from a completion and grades it. Answer tasks (GSM8K, MATH-style,
generic JSONL) compare extracted answers with an equivalence that the majority vote also uses to
group samples; code tasks (HumanEval) run the extracted program against the problem's tests.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True)
class Problem:
    """One question of a task. ``reference``: the correct answer as text (for code, the canonical
    solution, shown in results only). ``data``: what grading needs beyond that (HumanEval: the
    prompt, the tests and the entry point)."""

    id: str
    question: str
    reference: str
    messages: tuple[dict, ...]
    data: dict = field(default_factory=dict)

    def chat(self) -> list[dict]:
        """The conversation to send (a fresh copy: callers may extend it)."""
        return [dict(m) for m in self.messages]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Problem:
        row = json.loads(text)
        return cls(row["id"], row["question"], row["reference"], tuple(row["messages"]), row["data"])


@dataclass(frozen=True)
class Grade:
    """How one answer fared: ``status`` says why ("correct", "wrong", "no answer", or the sandbox's
    "passed" / "failed" / "timeout" / "error"); ``seconds`` spent grading it (the sandbox's run)."""

    correct: bool
    status: str
    seconds: float = 0.0


class Task(ABC):
    """A dataset and how to grade answers to it. Subclasses set ``name`` and implement ``load``
    and ``extract``; answer tasks may refine ``equivalent``, code tasks override ``grade``."""

    name: str = ""
    code: bool = False
    """Answers are programs graded by running tests (no majority vote over them)."""

    @property
    def spec(self) -> str:
        """How ``--task`` names it."""
        return self.name

    def problems(self, limit: int | None = None) -> list[Problem]:
        """The first ``limit`` problems (all when None), in dataset order."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit={limit!r}: must be an integer >= 1 (or None for all)")
        return self.load()[:limit]

    @abstractmethod
    def load(self) -> list[Problem]:
        """Every problem, in dataset order."""

    @abstractmethod
    def extract(self, problem: Problem, completion: str) -> str | None:
        """The answer a completion gives (code tasks: the program), None when it gives none."""

    def equivalent(self, answer: str, other: str) -> bool:
        """Whether two answers say the same; the vote groups samples by it."""
        return answer == other

    def grade(self, problem: Problem, answer: str | None) -> Grade:
        if answer is None:
            return Grade(False, "no answer")
        correct = self.equivalent(answer, problem.reference)
        return Grade(correct, "correct" if correct else "wrong")


def user_turn(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def row_id(row: dict, task: str, index: int) -> str:
    """A row's own "id" if it has one, else the task's name and the row's position."""
    return f"{task}/{index}" if row["id"] is None else str(row["id"])


def read_jsonl(path: str | Path, fields: Iterable[tuple[str, ...]]) -> list[dict]:
    """The rows of a JSON-lines file, blank lines skipped. Each entry of ``fields`` is a group of
    alternative keys of which a row must hold one, as a string or a number (numbers become
    strings); the row comes back under the group's first key. A missing file, undecodable bytes,
    a line that is not a JSON object or a row without a field: ValueError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    fields = list(fields)
    rows = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: must be a JSON object, got {type(row).__name__}")
            rows.append({group[0]: _field(row, group, where) for group in fields} | {"id": row.get("id")})
    if not rows:
        raise ValueError(f"{path}: holds no rows")
    return rows


def _field(row: dict, keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    wanted = " or ".join(repr(k) for k in keys)
    raise ValueError(f"{where}: needs a non-empty {wanted} (a string or a number)")
