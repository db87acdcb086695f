"""The tasks ``multispec eval`` runs, by the name given to ``--task``. Each lives in its own
module, imported when named: math-verify (sympy) and the sandbox load only for the tasks that
use them."""

from __future__ import annotations

from multispec.reasoning.tasks.base import Grade, Problem, Task

__all__ = ["Grade", "Problem", "Task", "TASK_SPECS", "make_task"]

TASK_SPECS = "gsm8k, humaneval, math:FILE or jsonl:FILE"


def make_task(spec: str, answer_regex: str | None = None) -> Task:
    """The task a spec names; no file is read until its problems are loaded. ``answer_regex`` is
    required by (and only allowed with) ``jsonl:FILE``."""
    name, _, path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if name not in _TAKES_FILE or _TAKES_FILE[name] != bool(path):
        raise ValueError(f"task {spec!r}: must be {TASK_SPECS}")
    if (name == "jsonl") != (answer_regex is not None):
        raise ValueError(f"task {spec!r}: an answer regex (--answer-regex) is needed by a jsonl:FILE task, and "
                         f"taken by no other")
    if name == "gsm8k":
        from multispec.reasoning.tasks.gsm8k import GSM8K
        return GSM8K()
    if name == "humaneval":
        from multispec.reasoning.tasks.humaneval import HumanEval
        return HumanEval()
    if name == "math":
        from multispec.reasoning.tasks.math_jsonl import MathJsonl
        return MathJsonl(path)
    from multispec.reasoning.tasks.jsonl import Jsonl
    return Jsonl(path, answer_regex)


_TAKES_FILE = {"gsm8k": False, "humaneval": False, "math": True, "jsonl": True}
