"""multispec: fast multi-sample generation with sibling-drafted, lossless speculative decoding."""

from multispec.params import (CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind, RunStats,
                              SamplingParams, SpecConfig, StructuredOutputsParams)

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "SpecConfig", "StructuredOutputsParams", "RequestOutput",
           "RequestOutputKind", "RequestMetrics", "CompletionOutput", "RunStats"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from multispec.api import LLM

        return LLM
    if name == "AsyncLLM":
        from multispec.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
