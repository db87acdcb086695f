"""Checkpoint loading for multispec's Llama-family network: config, weights, tokenizer."""

from multispec.models.config import ModelConfig
from multispec.models.loading import Checkpoint, load_checkpoint
from multispec.models.registry import DEFAULT_MODEL, paired_draft_head, resolve_model
from multispec.models.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "Checkpoint", "ModelConfig", "Tokenizer", "load_checkpoint", "paired_draft_head",
           "resolve_model"]
