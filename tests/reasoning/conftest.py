import json

import pytest

QUESTIONS = ["Hello world", "quick brown fox", "def f(x):", "lazy dog"]
ANSWER_REGEX = r"^.(\w)"
"""On the tiny successor model most samples open with the same two characters, so the second
one is an answer with a clear majority and a few dissenters (and some samples give none)."""


def write_questions(directory):
    """The questions as a jsonl task's file, each with the majority answer as its reference."""
    path = directory / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "8"}) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture
def questions_file(tmp_path):
    return write_questions(tmp_path)
