"""GSM8K: the vendored test split, answer extraction and the prompt the main job uses."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

INSTRUCTION = ("Solve the problem step by step. End with the final answer as a number on its own line, "
               "in the form '#### <number>'.")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str

    @property
    def answer(self) -> str:
        return reference_answer(self.solution)

    def chat(self) -> list[dict]:
        """The conversation the main job and the benchmarks send: the question, then ``INSTRUCTION``."""
        return [{"role": "user", "content": f"{self.question}\n{INSTRUCTION}"}]


def load_gsm8k(limit: int | None = None, offset: int = 0) -> list[Problem]:
    """The test problems in file order (offset/limit select a slice; a slice that would be empty
    is a ValueError naming the option)."""
    text = resources.files("multispec.reasoning").joinpath("data/gsm8k_test.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not 0 <= offset < len(rows):
        raise ValueError(f"offset={offset}: the GSM8K test set has {len(rows)} questions, numbered 0 to {len(rows) - 1}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: must be >= 1 (or None for all)")
    rows = rows[offset: None if limit is None else offset + limit]
    return [Problem(r["question"], r["answer"]) for r in rows]


def reference_answer(solution: str) -> str:
    return normalize_number(solution.split("####")[-1])


_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """'$1,234.50' -> '1234.5'; '' when there is no number."""
    match = _NUMBER.search(text)
    if not match:
        return ""
    raw = match.group(0).replace("$", "").replace(",", "").replace(" ", "")
    if "." in raw:
        raw = raw.rstrip("0").rstrip(".")
    return raw if raw not in ("-", "") else ""


def extract_answer(completion: str) -> str | None:
    """The final numeric answer of a completion: after '####' if present, else 'answer is',
    else a \\boxed{}, else the last number in the text; None when there is no number."""
    if "####" in completion:
        value = normalize_number(completion.split("####")[-1])
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
