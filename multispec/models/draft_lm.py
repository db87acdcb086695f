"""A causal LM checkpoint loaded as a draft model for a target that shares its tokenizer.

Any checkpoint the target could be (a registered name, a Hugging Face directory, a GGUF file) can
draft for it: it is loaded by the same code, runs the same packed forward (prepacked weights on a
CPU) and keeps its own KV cache (see ``multispec.drafters.checkpoint``). What a draft model must
share with the target is its tokenizer: the two must map every token text to the same id, or a
drafted id would mean another token to the target. Padding rows past the tokenizer (an embedding
table rounded up) may differ; the draft proposes only ids both models have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from multispec.models.config import ModelConfig
from multispec.models.llama import LlamaForCausalLM
from multispec.models.loading import is_gguf, load_checkpoint
from multispec.models.registry import cached_repo, known_models, resolve_model
from multispec.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from multispec.engine.prefix import KeptPrompts


@dataclass(eq=False)
class DraftLM:
    """A loaded draft model: ``vocab_size`` is how many ids it may draft (those of both models),
    ``target_vocab_size`` the length of the target's distributions its q rows are padded to."""

    model: LlamaForCausalLM
    config: ModelConfig
    name: str
    vocab_size: int
    target_vocab_size: int
    kept: KeptPrompts | None = None
    """Its recent prompts' keys and values, for later prompts that begin alike (set by an engine
    with prefix caching on); None: every prompt is computed whole."""

    @property
    def max_len(self) -> int:
        """Longest sequence (prompt and output) it can draft for: its context window."""
        return self.config.context_window


def is_checkpoint(name_or_path: str | Path) -> bool:
    """Whether ``draft_model`` names a causal LM (a registered name, a checkpoint directory, a GGUF
    file, a Hub repository in the local cache) rather than a draft head file."""
    if str(name_or_path) in known_models():
        return True
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path.is_dir() or is_gguf(path)
    return cached_repo(str(name_or_path)) is not None


def load_draft_lm(name_or_path: str | Path, target: LlamaForCausalLM, tokenizer: Tokenizer, target_name: str,
                  cache_dir: str | Path | None = None) -> DraftLM:
    """Load a checkpoint to draft for ``target`` (in the target's dtype, on its device); a
    ValueError names both models when their tokenizers differ or the checkpoint cannot be read."""
    name = str(name_or_path)
    try:
        checkpoint = load_checkpoint(resolve_model(name), cache_dir=cache_dir)
    except ValueError as error:
        raise ValueError(f"draft_model={name!r}: {error}") from None
    mine, theirs = tokenizer.vocab(), checkpoint.tokenizer.vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise ValueError(f"draft_model={name!r} does not share the tokenizer of {target_name}: their vocabularies "
                         f"({len(theirs)} and {len(mine)} tokens) differ in {differ} entries, so a drafted id would "
                         f"name another token")
    weight = target.output_weight()
    model = LlamaForCausalLM.from_tensors(checkpoint.config, checkpoint.tensors, weight.dtype, weight.device)
    vocab = min(checkpoint.config.vocab_size, target.config.vocab_size)
    return DraftLM(model, checkpoint.config, name, vocab, target.config.vocab_size)


def check_window(draft: DraftLM, needed: int, subject: str) -> None:
    """ValueError unless the draft model's context window holds ``needed`` tokens."""
    if needed > draft.max_len:
        why = draft.config.context_window_reason() or f"its max_position_embeddings={draft.max_len}"
        raise ValueError(f"{subject} needs {needed} tokens of context (prompt and max_tokens), more than the draft "
                         f"model {draft.name!r} holds ({draft.max_len}: {why})")

