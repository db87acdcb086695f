"""The engine: requests, scheduling, the KV cache and the step loop (see ``engine.LLMEngine``)."""

from multispec.engine.engine import EngineConfig, LLMEngine, StepReport

__all__ = ["EngineConfig", "LLMEngine", "StepReport"]
