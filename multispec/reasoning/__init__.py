from multispec.reasoning.tasks.base import Problem
from multispec.reasoning.tasks.gsm8k import extract_answer, load_gsm8k, normalize_number, reference_answer
from multispec.reasoning.vote import majority_vote

__all__ = ["Problem", "extract_answer", "load_gsm8k", "majority_vote", "normalize_number", "reference_answer"]
