"""The GSM8K prompt every GSM8K run sends (the main job, the benchmarks, the lossless tests)."""

from multispec.reasoning import load_gsm8k
from multispec.reasoning.tasks.gsm8k import INSTRUCTION


def test_chat_is_one_user_turn_with_the_question_then_the_instruction():
    problem = load_gsm8k(limit=1)[0]
    assert problem.chat() == [{"role": "user", "content": problem.question + "\n" + INSTRUCTION}]
