"""Questions from a user JSONL file, answers found by a user regex and compared as text."""

from __future__ import annotations

import re
from pathlib import Path

from multispec.reasoning.tasks.base import Problem, Task, read_jsonl, row_id, user_turn


class Jsonl(Task):
    """Rows ``{"question", "answer", "id" (optional)}``, sent as they are. The answer is the last
    match of ``answer_regex`` in a completion (its first group, if it has groups), stripped; two
    answers are equal when their texts are."""

    name = "jsonl"

    def __init__(self, path: str | Path, answer_regex: str):
        self.path = Path(path)
        try:
            self.pattern = re.compile(answer_regex)
        except (re.error, TypeError) as error:
            raise ValueError(f"answer regex {answer_regex!r} does not compile: {error}") from None

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.path}"

    def load(self) -> list[Problem]:
        rows = read_jsonl(self.path, [("question",), ("answer",)])
        return [Problem(row_id(row, self.name, i), row["question"], row["answer"].strip(), user_turn(row["question"]))
                for i, row in enumerate(rows)]

    def extract(self, problem: Problem, completion: str) -> str | None:
        matches = list(self.pattern.finditer(completion))
        if not matches:
            return None
        last = matches[-1]
        answer = (last.group(1) if self.pattern.groups else last.group(0)) or ""
        return answer.strip() or None
