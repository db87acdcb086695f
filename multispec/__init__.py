"""multispec: fast multi-sample generation with sibling-drafted, lossless speculative decoding."""

from multispec.params import CompletionOutput, RequestOutput, RunStats, SamplingParams, SpecConfig

__all__ = ["LLM", "SamplingParams", "SpecConfig", "RequestOutput", "CompletionOutput", "RunStats"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from multispec.api import LLM

        return LLM
    raise AttributeError(name)
