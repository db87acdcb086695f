"""GSM8K: the vendored test and train splits, its prompt and the numeric answer extraction."""

from __future__ import annotations

import re
from importlib import resources

from multispec.reasoning.tasks.base import Problem, Task, read_jsonl, user_turn

INSTRUCTION = ("Solve the problem step by step. End with the final answer as a number on its own line, "
               "in the form '#### <number>'.")


def load_gsm8k(limit: int | None = None, offset: int = 0, split: str = "test") -> list[Problem]:
    """The problems of ``split`` ("test", or "train": what the draft head is trained on) in file
    order (offset/limit select a slice; a slice that would be empty is a ValueError naming the
    option). Each asks the question, then ``INSTRUCTION``; its reference is the number after the
    solution's '####', and ``data["solution"]`` the worked solution."""
    if split not in ("test", "train"):
        raise ValueError(f"split={split!r}: must be 'test' or 'train'")
    with resources.as_file(resources.files("multispec.reasoning").joinpath(f"data/gsm8k_{split}.jsonl")) as path:
        rows = read_jsonl(path, [("question",), ("answer",)])
    if not 0 <= offset < len(rows):
        raise ValueError(f"offset={offset}: the GSM8K {split} set has {len(rows)} questions, numbered 0 to "
                         f"{len(rows) - 1}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: must be >= 1 (or None for all)")
    end = None if limit is None else offset + limit
    prefix = "gsm8k" if split == "test" else "gsm8k-train"
    return [Problem(f"{prefix}/{i}", r["question"], reference_answer(r["answer"]),
                    user_turn(f"{r['question']}\n{INSTRUCTION}"), {"solution": r["answer"]})
            for i, r in enumerate(rows[offset:end], offset)]


def reference_answer(solution: str) -> str:
    return normalize_number(solution.split("####")[-1])


_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """'$1,234.50' -> '1234.5', '- 3' -> '-3' (whitespace inside the match, line breaks included,
    dropped); '' when there is no number."""
    match = _NUMBER.search(text)
    if not match:
        return ""
    raw = "".join(match.group(0).replace("$", "").replace(",", "").split())
    if "." in raw:
        raw = raw.rstrip("0").rstrip(".")
    return raw if raw not in ("-", "") else ""


def extract_answer(completion: str) -> str | None:
    """The final numeric answer of a completion: the number after the first '####' that has one
    (before the next '####'), else after 'answer is', else in a \\boxed{}, else the last number
    in the text; None when there is no number.

    The first '####', not the last: a small model that has given its answer often repeats the
    '#### <number>' line until max_tokens cuts it, and the last copy is then a cut number
    ('#### 184' repeated, ending in '#### 1'). The prompt asks for the answer once, at the end,
    and GSM8K's own strict answer format is read the same way."""
    for part in completion.split("####")[1:]:
        value = normalize_number(part)
        if value:
            return value
    for pattern in (r"answer is[:\s]*([^\n]*)", r"\\boxed\{([^}]*)\}"):
        found = re.findall(pattern, completion, flags=re.IGNORECASE)
        if found:
            value = normalize_number(found[-1])
            if value:
                return value
    numbers = _NUMBER.findall(completion)
    if numbers:
        return normalize_number(numbers[-1]) or None
    return None


class GSM8K(Task):
    """The 1,319 GSM8K test questions; answers are numbers compared after normalisation."""

    name = "gsm8k"

    def load(self) -> list[Problem]:
        return load_gsm8k()

    def extract(self, problem: Problem, completion: str) -> str | None:
        return extract_answer(completion)
